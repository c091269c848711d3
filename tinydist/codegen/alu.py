"""Elementwise ops as LLVM, per dtype kind, and a reduction's combine.

`ALU_RULES[op](emitter, node, args)` emits one kernel-IR op on its lowered operands: numpy's
semantics where LLVM's differ (astype's truncating and wrapping casts, floor division and modulo
with the divisor's sign, shifts past the width, NaN-propagating max/min, saturating float → int),
the transcendental functions as vectorisable polynomials (`tinydist.codegen.transcendental`).
The CPU and NVPTX lowerers both emit through it; `Emitter` is what a rule asks of them.

Floating-point flags: every float op may `contract` (a*b+c → fma, one rounding instead of two).
Only a reduction's accumulation (`combine`) carries `reassoc`, which lets the vectoriser keep
several partial sums (lanes × interleave) and combine them at the end: the result differs from a
sequential sum in the last bits, with an error bound no worse than the sequential one (it is
closer to pairwise summation). Nothing else is reordered, and NaN/inf semantics are kept (no
`nnan`/`ninf`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from llvmlite import ir

from tinydist.codegen import transcendental
from tinydist.codegen.kernel import KNode
from tinydist.codegen.llvm_types import F32, I1, I32, I64, from_memory, llvm_type, round_narrow, shaped, splat, to_memory
from tinydist.graph import dtypes
from tinydist.graph.dtypes import DType

CONTRACT = ("contract",)
REASSOC = ("reassoc", "contract")


class Emitter(Protocol):
    """What an elementwise rule needs of the lowerer emitting it (`lowering._Lowerer`, `ptx._PTXLowerer`)."""

    b: ir.IRBuilder
    width: int | None            # lanes while emitting a vector loop body, else None

    def typ(self, dtype: DType) -> ir.Type: ...
    def suffix(self, t: ir.Type) -> str: ...
    def intrinsic(self, name: str, ret: ir.Type, args: list[ir.Type]) -> ir.Function: ...
    def call(self, base: str, value_type: ir.Type, *args: ir.Value) -> ir.Value: ...


def combine(lowerer: Emitter, op: str, dtype: DType, acc: ir.Value, value: ir.Value) -> ir.Value:
    b = lowerer.b
    if dtype.is_float:
        if op == "sum":
            return b.fadd(acc, value, flags=REASSOC)
        if op == "prod":
            return b.fmul(acc, value, flags=REASSOC)
        return lowerer.call("maximum" if op == "max" else "minimum", acc.type, acc, value)
    if op == "sum":
        return b.add(acc, value)
    if op == "prod":
        return b.mul(acc, value)
    if dtype.is_unsigned:
        return lowerer.call("umax" if op == "max" else "umin", acc.type, acc, value)
    return lowerer.call("smax" if op == "max" else "smin", acc.type, acc, value)


def _float_or_int(f: Callable[..., ir.Value], i: Callable[..., ir.Value],
                  u: Callable[..., ir.Value] | None = None) -> Callable[[Emitter, KNode, list[ir.Value]], ir.Value]:
    """The rule for float operands, signed (and bool) ones, and unsigned ones (`u`, else `i`)."""
    def rule(lw: Emitter, node: KNode, args: list[ir.Value]) -> ir.Value:
        dtype = node.srcs[0].dtype
        if dtype.is_float:
            return f(lw, *args)
        return u(lw, *args) if u is not None and dtype.is_unsigned else i(lw, *args)
    return rule


# Ops whose float16 result is rounded to float16 after computing in float32 (numpy's float16
# loops do the same); the others (compare, select, max/min, negate, abs, floor) are exact.
ROUNDED = frozenset({"add", "sub", "mul", "div", "idiv", "mod", "pow", "sqrt", "exp", "exp2", "log", "log2", "sin", "cos"})


def _fptosi_sat(lw: Emitter, x: ir.Value, to: ir.Type) -> ir.Value:
    """float → signed int, saturating: NaN → 0 and out-of-range clamps, never poison."""
    name = f"llvm.fptosi.sat.{lw.suffix(to)}.{lw.suffix(x.type)}"
    return lw.b.call(lw.intrinsic(name, to, [x.type]), [x])


def _to_float32_round_to_odd(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """float64 → float32 rounded to odd (truncated, the last bit set when inexact): rounding that
    to float16 then rounds once, correctly. (LLVM lowers a direct double → half to a libcall,
    __truncdfhf2, that the JIT cannot resolve; x86 has no instruction for it.)"""
    t = b.fptrunc(x, shaped(x.type, F32))
    bits_type = shaped(x.type, I32)
    r = b.bitcast(t, bits_type)
    inexact = b.fcmp_unordered("!=", b.fpext(t, x.type), x)
    even = b.icmp_unsigned("==", b.and_(r, splat(bits_type, 1)), splat(bits_type, 0))
    away = b.fcmp_ordered(">", b.fpext(b.call(_fabs(b, t.type), [t]), x.type), b.call(_fabs(b, x.type), [x]))
    odd = b.select(away, b.sub(r, splat(bits_type, 1)), b.or_(r, splat(bits_type, 1)))
    return b.bitcast(b.select(b.and_(inexact, even), odd, r), t.type)


def _fabs(b: ir.IRBuilder, t: ir.Type) -> ir.Function:
    module = b.module
    suffix = (f"v{t.count}" if isinstance(t, ir.VectorType) else "") + ("f32" if (t.element if isinstance(t, ir.VectorType) else t) == F32 else "f64")
    name = f"llvm.fabs.{suffix}"
    existing = module.globals.get(name)
    return existing if existing is not None else ir.Function(module, ir.FunctionType(t, [t]), name=name)


def _to_int64_x86(lw: Emitter, x: ir.Value) -> ir.Value:
    """float → int64 as x86-64's cvttsd2si, numpy's conversion: truncated, and INT64_MIN for NaN,
    infinities and values out of range."""
    b, to = lw.b, shaped(x.type, I64)
    inside = b.fcmp_ordered("<", lw.call("fabs", x.type, x), splat(x.type, 2.0 ** 63))
    return b.select(inside, _fptosi_sat(lw, x, to), splat(to, -(1 << 63)))


def _bitcast(lw: Emitter, src: DType, dst: DType, x: ir.Value) -> ir.Value:
    """The bits of `x` (its memory form: a bool's byte, a float16's 16 bits) read as `dst`."""
    bits = to_memory(lw.b, x, src)
    want = llvm_type(dst, in_memory=True, width=lw.width)
    if bits.type != want:
        bits = lw.b.bitcast(bits, want)
    return from_memory(lw.b, bits, dst)


def _cast(lw: Emitter, node: KNode, args: list[ir.Value]) -> ir.Value:
    """numpy's astype (which ONNX's Cast follows): float → int truncates toward zero; into an int
    narrower than 32 bits or an unsigned one it wraps modulo 2**bits, as numpy's x86-64 conversion
    through int64 does (float32 300.7 → uint8 44, -1.0 → uint32 4294967295, inf and NaN → 0);
    float → int32/int64 saturates (NaN → 0), where numpy's result is undefined. Float → float
    rounds to nearest even, overflowing to inf."""
    (x,), src, dst = args, node.srcs[0].dtype, node.dtype
    b, to = lw.b, lw.typ(dst)
    if src is dst:
        return x
    if dst.is_bool:
        return b.fcmp_unordered("!=", x, splat(x.type, 0.0)) if src.is_float else b.icmp_unsigned("!=", x, splat(x.type, 0))
    if src.is_bool:  # 0 and 1: exact in every type
        return b.uitofp(x, to) if dst.is_float else b.zext(x, to)
    if src.is_float and dst.is_float:
        if dst.is_narrow_float and x.type != to:  # float64 → float16 rounds once, as numpy does
            return round_narrow(b, _to_float32_round_to_odd(b, x), dst)
        if x.type != to:
            x = b.fpext(x, to) if dst.itemsize > src.itemsize else b.fptrunc(x, to)
        return round_narrow(b, x, dst)
    if src.is_float:
        if dst.is_signed_wide:
            return _fptosi_sat(lw, x, to)
        wide = _to_int64_x86(lw, x)
        if dst is dtypes.uint64:  # from 2**63 up: the conversion of x - 2**63, its top bit set again
            big = b.fcmp_ordered(">=", x, splat(x.type, 2.0 ** 63))
            high = b.xor(_to_int64_x86(lw, b.fsub(x, splat(x.type, 2.0 ** 63))), splat(to, -(1 << 63)))
            return b.select(big, high, wide)
        return b.trunc(wide, to)
    if dst.is_float:
        value = b.uitofp(x, to) if src.is_unsigned else b.sitofp(x, to)
        return round_narrow(b, value, dst)
    if dst.itemsize > src.itemsize:
        return b.zext(x, to) if src.is_unsigned else b.sext(x, to)
    return b.trunc(x, to) if dst.itemsize < src.itemsize else x


def _safe_divisor(lw: Emitter, a: ir.Value, d: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(divisor safe for sdiv/srem, is-zero) — x86 traps on a zero divisor and on MIN / -1."""
    b = lw.b
    width = a.type.element.width if isinstance(a.type, ir.VectorType) else a.type.width
    zero = b.icmp_signed("==", d, splat(d.type, 0))
    overflow = b.and_(b.icmp_signed("==", a, splat(a.type, -(1 << (width - 1)))), b.icmp_signed("==", d, splat(d.type, -1)))
    # MIN // -1 wraps to MIN and MIN % -1 is 0 in numpy: dividing by 1 gives exactly that
    return b.select(b.or_(zero, overflow), splat(d.type, 1), d), zero


def _floordiv_int(lw: Emitter, a: ir.Value, d: ir.Value) -> ir.Value:
    b = lw.b
    zero, one = splat(a.type, 0), splat(a.type, 1)
    safe_d, bad = _safe_divisor(lw, a, d)
    q = b.sdiv(a, safe_d)
    r = b.srem(a, safe_d)
    adjust = b.and_(b.icmp_signed("!=", r, zero), b.icmp_signed("!=", b.icmp_signed("<", r, zero), b.icmp_signed("<", safe_d, zero)))
    q = b.select(adjust, b.sub(q, one), q)
    return b.select(bad, zero, q)  # numpy: integer division by zero gives 0


def _mod_int(lw: Emitter, a: ir.Value, d: ir.Value) -> ir.Value:
    b = lw.b
    zero = splat(a.type, 0)
    safe_d, bad = _safe_divisor(lw, a, d)
    r = b.srem(a, safe_d)
    adjust = b.and_(b.icmp_signed("!=", r, zero), b.icmp_signed("!=", b.icmp_signed("<", r, zero), b.icmp_signed("<", safe_d, zero)))
    return b.select(bad, zero, b.select(adjust, b.add(r, safe_d), r))


def _floordiv_uint(lw: Emitter, a: ir.Value, d: ir.Value) -> ir.Value:
    b = lw.b
    zero = b.icmp_unsigned("==", d, splat(d.type, 0))
    return b.select(zero, splat(a.type, 0), b.udiv(a, b.select(zero, splat(d.type, 1), d)))  # numpy: x // 0 is 0


def _mod_uint(lw: Emitter, a: ir.Value, d: ir.Value) -> ir.Value:
    b = lw.b
    zero = b.icmp_unsigned("==", d, splat(d.type, 0))
    return b.select(zero, splat(a.type, 0), b.urem(a, b.select(zero, splat(d.type, 1), d)))


def _shift(left: bool) -> Callable[[Emitter, KNode, list[ir.Value]], ir.Value]:
    """numpy's shifts: counts outside [0, bits) (compared unsigned) give 0, or for an arithmetic
    right shift the sign; LLVM's own shifts are poison there, so the select keeps the defined arm."""
    def rule(lw: Emitter, node: KNode, args: list[ir.Value]) -> ir.Value:
        (a, c), b, dtype = args, lw.b, node.srcs[0].dtype
        bits = dtype.itemsize * 8
        inside = b.icmp_unsigned("<", c, splat(c.type, bits))
        if left:
            return b.select(inside, b.shl(a, c), splat(a.type, 0))
        if dtype.is_unsigned:
            return b.select(inside, b.lshr(a, c), splat(a.type, 0))
        return b.select(inside, b.ashr(a, c), b.ashr(a, splat(a.type, bits - 1)))
    return rule


def _mod_float(lw: Emitter, a: ir.Value, d: ir.Value) -> ir.Value:
    b = lw.b
    r = b.frem(a, d)  # sign of the dividend; numpy's % takes the divisor's sign
    zero = splat(a.type, 0.0)
    adjust = b.and_(b.fcmp_ordered("!=", r, zero), b.xor(b.fcmp_ordered("<", r, zero), b.fcmp_ordered("<", d, zero)))
    fixed = b.select(adjust, b.fadd(r, d), r)
    return b.select(b.fcmp_ordered("==", r, zero), lw.call("copysign", a.type, zero, d), fixed)


def _floordiv_float(lw: Emitter, a: ir.Value, d: ir.Value) -> ir.Value:
    """numpy's npy_divmod: from fmod, corrected toward -inf, rounded; a / d when d is zero."""
    b = lw.b
    zero = splat(a.type, 0.0)
    mod = b.frem(a, d)
    div = b.fdiv(b.fsub(a, mod), d)
    adjust = b.and_(b.fcmp_ordered("!=", mod, zero), b.xor(b.fcmp_ordered("<", d, zero), b.fcmp_ordered("<", mod, zero)))
    div = b.select(adjust, b.fsub(div, splat(a.type, 1.0)), div)
    rounded = lw.call("floor", a.type, div)
    rounded = b.select(b.fcmp_ordered(">", b.fsub(div, rounded), splat(a.type, 0.5)), b.fadd(rounded, splat(a.type, 1.0)), rounded)
    quotient = b.fdiv(a, d)
    result = b.select(b.fcmp_unordered("!=", div, zero), rounded, lw.call("copysign", a.type, zero, quotient))
    return b.select(b.fcmp_ordered("==", d, zero), quotient, result)


def _cmp(pred: str) -> Callable[[Emitter, KNode, list[ir.Value]], ir.Value]:
    def rule(lw: Emitter, node: KNode, args: list[ir.Value]) -> ir.Value:
        a, c = args
        if node.srcs[0].dtype.is_float:
            # NaN compares false except for != (numpy semantics)
            return lw.b.fcmp_unordered(pred, a, c) if pred == "!=" else lw.b.fcmp_ordered(pred, a, c)
        if node.srcs[0].dtype.kind in "bu":
            return lw.b.icmp_unsigned(pred, a, c)
        return lw.b.icmp_signed(pred, a, c)
    return rule


def _minmax(which: str) -> Callable[[Emitter, KNode, list[ir.Value]], ir.Value]:
    def rule(lw: Emitter, node: KNode, args: list[ir.Value]) -> ir.Value:
        a, c = args
        dtype = node.srcs[0].dtype
        if dtype.is_float:  # NaN-propagating, like numpy.maximum / minimum
            return lw.call("maximum" if which == "max" else "minimum", a.type, a, c)
        if dtype.is_bool:
            return lw.b.or_(a, c) if which == "max" else lw.b.and_(a, c)
        if dtype.is_unsigned:
            return lw.call("umax" if which == "max" else "umin", a.type, a, c)
        return lw.call("smax" if which == "max" else "smin", a.type, a, c)
    return rule


def _transcendental(name: str) -> Callable[[Emitter, KNode, list[ir.Value]], ir.Value]:
    def rule(lw: Emitter, node: KNode, args: list[ir.Value]) -> ir.Value:
        return getattr(transcendental, name)(lw.b, *args)
    return rule


ALU_RULES: dict[str, Callable[[Emitter, KNode, list[ir.Value]], ir.Value]] = {
    "add": _float_or_int(lambda lw, a, c: lw.b.fadd(a, c, flags=CONTRACT), lambda lw, a, c: lw.b.add(a, c)),
    "sub": _float_or_int(lambda lw, a, c: lw.b.fsub(a, c, flags=CONTRACT), lambda lw, a, c: lw.b.sub(a, c)),
    "mul": _float_or_int(lambda lw, a, c: lw.b.fmul(a, c, flags=CONTRACT), lambda lw, a, c: lw.b.mul(a, c)),
    "div": lambda lw, node, args: lw.b.fdiv(*args, flags=CONTRACT),
    "idiv": _float_or_int(_floordiv_float, _floordiv_int, _floordiv_uint),
    "mod": _float_or_int(_mod_float, _mod_int, _mod_uint),
    "pow": _transcendental("pow"),
    "max": _minmax("max"),
    "min": _minmax("min"),
    "and": lambda lw, node, args: lw.b.and_(*args),
    "or": lambda lw, node, args: lw.b.or_(*args),
    "xor": lambda lw, node, args: lw.b.xor(*args),
    "shl": _shift(left=True), "shr": _shift(left=False),
    "cmplt": _cmp("<"), "cmple": _cmp("<="), "cmpeq": _cmp("=="), "cmpne": _cmp("!="),
    "where": lambda lw, node, args: lw.b.select(*args),
    "neg": _float_or_int(lambda lw, a: lw.b.fneg(a), lambda lw, a: lw.b.neg(a)),
    "not": lambda lw, node, args: lw.b.not_(args[0]),
    "abs": _float_or_int(lambda lw, a: lw.call("fabs", a.type, a), lambda lw, a: lw.call("abs", a.type, a, ir.Constant(I1, 0)),
                         lambda lw, a: a),
    "floor": lambda lw, node, args: lw.call("floor", args[0].type, args[0]),
    "sqrt": lambda lw, node, args: lw.call("sqrt", args[0].type, args[0]),
    "exp": _transcendental("exp"), "exp2": _transcendental("exp2"),
    "log": _transcendental("log"), "log2": _transcendental("log2"),
    "sin": _transcendental("sin"), "cos": _transcendental("cos"),
    "cast": _cast,
    "bitcast": lambda lw, node, args: _bitcast(lw, node.srcs[0].dtype, node.dtype, args[0]),
}
