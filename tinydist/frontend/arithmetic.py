"""Tensor arithmetic: the operators (`+`, `<`, `&`, `<<`, ...) and the elementwise math methods
(neg, abs, exp, log, sqrt, sin, relu, sigmoid, tanh, pow, clip, ...), with numpy's promotion and
its refusals (bool subtract, bitwise ops on floats, integers to negative powers).

The functions are named as in the `operator` module and attached in the class body of
`tinydist.frontend.tensor` (`__add__ = add = arithmetic.add`); each is built on the primitives
`Tensor._binary` / `Tensor._unary`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tinydist.frontend.arguments import promote
from tinydist.graph import dtypes
from tinydist.graph.lazy import Op

if TYPE_CHECKING:
    from tinydist.frontend.tensor import Tensor


def _true_divide(self: Tensor, other: Any, reverse: bool) -> Tensor:
    other = self._operand(other)
    common = dtypes.float_result(promote(self, other))
    return self._binary(other, Op.DIV, reverse=reverse, operand_dtype=common)


def _compare(self: Tensor, other: Any, op: Op, reverse: bool = False) -> Tensor:
    return self._binary(other, op, reverse=reverse, out_dtype=dtypes.bool_)


def _bitwise(self: Tensor, other: Any, op: Op) -> Tensor:
    other = self._operand(other)
    if promote(self, other).is_float:  # uint64 with a signed int promotes to float64, as in numpy
        raise TypeError(f"bitwise {op.value} is not defined for {self.dtype.name} and {other.dtype.name}; use integer or bool tensors")
    return self._binary(other, op)


def _shift(self: Tensor, other: Any, op: Op) -> Tensor:
    """numpy's left_shift / right_shift: a count outside [0, bits) gives 0 (-1 for a negative
    value shifted right); right shifts of signed values are arithmetic."""
    other = self._operand(other)
    common = promote(self, other)
    if not common.is_int:
        raise TypeError(f"shift is not defined for {self.dtype.name} and {other.dtype.name}; use integer tensors")
    return self._binary(other, op, operand_dtype=common)


# The operators, named as in the `operator` module; a reflected form (`radd`) is `other + self`.
def add(self: Tensor, other: Any) -> Tensor: return self._binary(other, Op.ADD)
def radd(self: Tensor, other: Any) -> Tensor: return self._binary(other, Op.ADD, reverse=True)
def sub(self: Tensor, other: Any) -> Tensor: return self._binary(other, Op.SUB)
def rsub(self: Tensor, other: Any) -> Tensor: return self._binary(other, Op.SUB, reverse=True)
def mul(self: Tensor, other: Any) -> Tensor: return self._binary(other, Op.MUL)
def rmul(self: Tensor, other: Any) -> Tensor: return self._binary(other, Op.MUL, reverse=True)
def truediv(self: Tensor, other: Any) -> Tensor: return _true_divide(self, other, False)
def rtruediv(self: Tensor, other: Any) -> Tensor: return _true_divide(self, other, True)
def floordiv(self: Tensor, other: Any) -> Tensor: return self._binary(other, Op.IDIV)
def rfloordiv(self: Tensor, other: Any) -> Tensor: return self._binary(other, Op.IDIV, reverse=True)
def mod(self: Tensor, other: Any) -> Tensor: return self._binary(other, Op.MOD)
def rmod(self: Tensor, other: Any) -> Tensor: return self._binary(other, Op.MOD, reverse=True)
def rpow(self: Tensor, other: Any) -> Tensor: return self._operand(other).pow(self)
def lt(self: Tensor, other: Any) -> Tensor: return _compare(self, other, Op.CMPLT)
def le(self: Tensor, other: Any) -> Tensor: return _compare(self, other, Op.CMPLE)
def gt(self: Tensor, other: Any) -> Tensor: return _compare(self, other, Op.CMPLT, reverse=True)
def ge(self: Tensor, other: Any) -> Tensor: return _compare(self, other, Op.CMPLE, reverse=True)
def eq(self: Tensor, other: Any) -> Tensor: return _compare(self, other, Op.CMPEQ)
def ne(self: Tensor, other: Any) -> Tensor: return _compare(self, other, Op.CMPNE)
def and_(self: Tensor, other: Any) -> Tensor: return _bitwise(self, other, Op.AND)
def or_(self: Tensor, other: Any) -> Tensor: return _bitwise(self, other, Op.OR)
def xor(self: Tensor, other: Any) -> Tensor: return _bitwise(self, other, Op.XOR)
def lshift(self: Tensor, other: Any) -> Tensor: return _shift(self, other, Op.SHL)
def rshift(self: Tensor, other: Any) -> Tensor: return _shift(self, other, Op.SHR)
def rlshift(self: Tensor, other: Any) -> Tensor: return _shift(self._operand(other), self, Op.SHL)
def rrshift(self: Tensor, other: Any) -> Tensor: return _shift(self._operand(other), self, Op.SHR)


def invert(self: Tensor) -> Tensor:
    if self.dtype.is_bool:
        return self.logical_not()
    return _bitwise(self, self._like((1 << self.dtype.itemsize * 8) - 1 if self.dtype.is_unsigned else -1), Op.XOR)


def neg(self: Tensor) -> Tensor:
    if self.dtype.is_bool:
        raise TypeError("negation of a bool tensor is not supported; use ~x or logical_not()")
    return self._unary(Op.NEG)


def abs(self: Tensor) -> Tensor:
    return self if self.dtype.is_bool else self._unary(Op.ABS)


def logical_not(self: Tensor) -> Tensor:
    return self.cast(dtypes.bool_)._unary(Op.NOT)


def maximum(self: Tensor, other: Any) -> Tensor: return self._binary(other, Op.MAX)
def minimum(self: Tensor, other: Any) -> Tensor: return self._binary(other, Op.MIN)
def exp(self: Tensor) -> Tensor: return self._unary(Op.EXP, float_only=True)
def exp2(self: Tensor) -> Tensor: return self._unary(Op.EXP2, float_only=True)
def log(self: Tensor) -> Tensor: return self._unary(Op.LOG, float_only=True)
def log2(self: Tensor) -> Tensor: return self._unary(Op.LOG2, float_only=True)
def sqrt(self: Tensor) -> Tensor: return self._unary(Op.SQRT, float_only=True)
def sin(self: Tensor) -> Tensor: return self._unary(Op.SIN, float_only=True)
def cos(self: Tensor) -> Tensor: return self._unary(Op.COS, float_only=True)
def floor(self: Tensor) -> Tensor: return self if not self.dtype.is_float else self._unary(Op.FLOOR)
def reciprocal(self: Tensor) -> Tensor: return 1 / self
def square(self: Tensor) -> Tensor: return self * self
def isnan(self: Tensor) -> Tensor: return self != self


def relu(self: Tensor) -> Tensor:
    return self.maximum(0)


def sigmoid(self: Tensor) -> Tensor:
    x = self.cast(dtypes.float_result(self.dtype))
    return 1 / (1 + (-x).exp())


def tanh(self: Tensor) -> Tensor:
    # tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2|x|) ≤ 1: never overflows
    x = self.cast(dtypes.ufunc_float_result(self.dtype))
    e = (x.abs() * -2).exp()
    magnitude = (1 - e) / (1 + e)
    return (x < 0).where(-magnitude, magnitude)


def pow(self: Tensor, exponent: Any) -> Tensor:
    exponent_t = self._operand(exponent)
    common = promote(self, exponent_t)
    if common.is_bool:  # bool ** bool is int8, as in numpy
        common = dtypes.int8
    if not common.is_float:
        if isinstance(exponent, int) and not isinstance(exponent, bool):
            if exponent < 0:
                raise ValueError("integers to negative integer powers are not allowed")
            return _int_power(self.cast(common), exponent)
        # integer tensor exponents: exact through float64 while results stay below 2**53
        result = self.cast(dtypes.float64)._binary(exponent_t.cast(dtypes.float64), Op.POW)
        return result.cast(common)
    return self._binary(exponent_t, Op.POW)


def clip(self: Tensor, low: Any = None, high: Any = None) -> Tensor:
    x = self
    if low is not None:
        x = x.maximum(low)
    if high is not None:
        x = x.minimum(high)
    return x


def _int_power(x: Tensor, exponent: int) -> Tensor:
    result: Tensor | None = None
    base = x
    while exponent:
        if exponent & 1:
            result = base if result is None else result * base
        exponent >>= 1
        if exponent:
            base = base * base
    return result if result is not None else x._like(1)
