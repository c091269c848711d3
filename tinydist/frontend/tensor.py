"""The lazy Tensor: numpy semantics, computed by fused native kernels on tinydist devices.

    a = td.Tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    y = ((a * 2 + 1).relu().exp() / 3).sum(axis=1)
    y.numpy()

Operations only build a graph (`tinydist.graph.lazy`); `realize()` schedules and runs it, `numpy()`
realizes and reads back. Every argument is validated when the op is built, so shape, axis and
dtype mistakes raise `ValueError` / `TypeError` naming the shapes — never deep inside codegen.
Compound ops (matmul, convolution, pooling, softmax, layernorm) live in `tinydist.frontend.functional`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from tinydist.engine.realize import realize
from tinydist.graph import dtypes
from tinydist.graph.dtypes import DType, to_dtype
from tinydist.graph.lazy import LazyNode, Op, broadcast_scalar, buffer_node, const_node, elementwise, view
from tinydist.runtime.engine import get_engine
from tinydist.runtime.registry import canonical_name

Scalar = int | float | bool
_rng = np.random.default_rng(0)
_assign_observers: list[list[LazyNode]] = []


@contextlib.contextmanager
def observe_assigns() -> Iterator[list[LazyNode]]:
    """Collect the assign nodes made in this scope (the JIT captures them as side effects)."""
    seen: list[LazyNode] = []
    _assign_observers.append(seen)
    try:
        yield seen
    finally:
        _assign_observers.remove(seen)


def synchronize(timeout: float | None = None) -> None:
    """Block until every submitted kernel and copy has finished (realize() only submits)."""
    get_engine().synchronize(timeout)


def manual_seed(seed: int) -> None:
    """Seed `Tensor.rand` / `Tensor.randn` (a host-side generator; results are reproducible)."""
    global _rng
    _rng = np.random.default_rng(seed)


def _normalize_axis(axis: int, ndim: int) -> int:
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise TypeError(f"axis must be an int, got {type(axis).__name__}")
    if not -max(ndim, 1) <= axis < max(ndim, 1):   # a 0-d tensor has axis 0 (or -1), as in numpy
        raise np.exceptions.AxisError(f"axis {axis} is out of bounds for tensor of dimension {ndim}")
    return int(axis) % max(ndim, 1)


def _normalize_axes(axis: int | Sequence[int] | None, ndim: int) -> tuple[int, ...]:
    """The axes a reduction runs over, sorted. As numpy's ufunc reductions, a 0-d tensor accepts
    axis 0 or -1 and reduces over nothing."""
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    result = tuple(sorted(_normalize_axis(a, ndim) for a in axes))
    if ndim == 0:
        return ()
    if len(set(result)) != len(result):
        raise ValueError(f"duplicate value in axis {axis}")
    return result


MAX_ELEMENTS = 1 << 48   # past this a kernel's loop would run for days, or its int64 offsets overflow


def _shape_arg(shape: Sequence[Any], infer: bool = True) -> tuple[int, ...]:
    """Dimensions given as `f(2, 3)` or `f((2, 3))`: integers, at least 0; `infer` allows one -1
    (reshape's "whatever is left")."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = shape[0]
    if type(shape) is tuple and all([type(s) is int and s >= 0 for s in shape]) and math.prod(shape) <= MAX_ELEMENTS:
        return shape  # the common case (the shapes a step's ops pass each other): one pass, nothing to convert
    for s in shape:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
            raise TypeError(f"dimensions must be integers, got {s!r} ({type(s).__name__}) in shape {tuple(shape)}")
    result = tuple(int(s) for s in shape)
    if any(s < 0 for s in result if not (infer and s == -1)):
        what = "negative dimensions are not allowed" + ("" if infer else " (-1 is reshape's, not a factory's)")
        raise ValueError(f"{what}: {result}")
    count = abs(math.prod(result))   # reshape's -1 only flips the sign
    if count > MAX_ELEMENTS:
        raise ValueError(f"shape {result} has {count:,} elements, more than the "
                         f"{MAX_ELEMENTS:,} a kernel can index (2**48): split the work into smaller tensors")
    return result


def _broadcast_shapes(x: tuple[int, ...], y: tuple[int, ...], a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """numpy's broadcast of two shapes (`a`, `b`: the operands' own, for the error), without
    numpy's machinery for any number of arrays (~5 us a call; a step's ops broadcast ~20 times)."""
    if len(x) < len(y):
        x = (1,) * (len(y) - len(x)) + x
    elif len(y) < len(x):
        y = (1,) * (len(x) - len(y)) + y
    result = []
    for p, q in zip(x, y):
        if p == q or q == 1:
            result.append(p)
        elif p == 1:
            result.append(q)
        else:
            raise ValueError(f"operands could not be broadcast together with shapes {a} {b}")
    return tuple(result)


_DEFAULT_DEVICE = canonical_name("CPU")


class Tensor:
    __array_ufunc__ = None  # `ndarray + Tensor` defers to Tensor.__radd__ instead of making an object array
    __slots__ = ("node", "grad", "_grad_hooks", "__weakref__")  # grad, _grad_hooks: tinydist.frontend.autograd

    def __init__(self, data: Any, device: str | None = None, dtype: Any = None, requires_grad: bool = False) -> None:
        self.grad: Tensor | None = None   # autograd: filled by backward() on leaves that require grad
        self._grad_hooks: list[Any] | None = None
        if type(data) is LazyNode:  # every op's result: the node knows its device
            self.node = data
            if requires_grad:
                self.requires_grad_()
            return
        device = _DEFAULT_DEVICE if device is None else canonical_name(device)
        if type(data) is np.ndarray and dtype is None and data.flags.c_contiguous:  # a frame: upload it as it is
            found = dtypes.of_numpy(data.dtype)
            if found is not None:
                self.node = _upload(data, found, device)
                if requires_grad:
                    self.requires_grad_()
                return
        if isinstance(data, Tensor):
            data = data.numpy()
        array = np.asarray(data)
        target = to_dtype(dtype if dtype is not None else array.dtype)
        array = np.asarray(array, dtype=target.np, order="C")  # (ascontiguousarray would make 0-d arrays 1-d)
        self.node = _upload(array, target, device)
        if requires_grad:
            self.requires_grad_()

    # ---- autograd (tinydist.frontend.autograd) ---------------------------------------------------------

    @property
    def requires_grad(self) -> bool:
        return self.node.requires_grad

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        self.requires_grad_(value)

    def requires_grad_(self, value: bool = True) -> Tensor:
        from tinydist.frontend.autograd import set_requires_grad
        if value and self.node.op is Op.VIEW and self.node.buffer is None and not self.node.requires_grad:
            # a leaf must be a node of its own: a view of an unrealized view is a view of its base
            # (views never stack), which would drop the leaf (td.zeros(3, 2).requires_grad_() @ x)
            self.node = self._buffered().node
        set_requires_grad(self, value)
        return self

    @property
    def is_leaf(self) -> bool:
        from tinydist.frontend.autograd import is_leaf
        return is_leaf(self.node) or not self.node.requires_grad

    def backward(self, gradient: Tensor | None = None, retain_graph: bool = False) -> None:
        """Accumulate d(self)/d(leaf) into `.grad` of every leaf that requires grad (lazily)."""
        from tinydist.frontend.autograd import backward
        backward(self, gradient, retain_graph)

    def detach(self) -> Tensor:
        """The same value, cut from the autograd graph."""
        from tinydist.frontend.autograd import detach
        return detach(self)

    # ---- properties ---------------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, ...]:
        return self.node.shape

    @property
    def dtype(self) -> DType:
        return self.node.dtype

    @property
    def device(self) -> str:
        return self.node.device

    @property
    def ndim(self) -> int:
        return len(self.node.shape)

    def numel(self) -> int:
        return self.node.numel

    @property
    def nbytes(self) -> int:
        """Bytes of the value, numel × itemsize (numpy's `ndarray.nbytes`; torch's `Tensor.nbytes`)."""
        return self.node.numel * self.node.dtype.itemsize

    @property
    def itemsize(self) -> int:
        return self.node.dtype.itemsize

    @property
    def size(self) -> int:
        return self.node.numel

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __repr__(self) -> str:
        state = "realized" if self.node.realized else "lazy"
        return f"<Tensor {self.dtype.name}{list(self.shape)} on {self.device}, {state}>"

    def __bool__(self) -> bool:
        if self.numel() != 1:
            raise ValueError(f"the truth value of a tensor of shape {self.shape} ({self.numel()} elements) is "
                             "ambiguous: use .any() or .all()")
        return bool(self.item())

    def __float__(self) -> float:
        return float(self._scalar("float"))

    def __int__(self) -> int:
        return int(self._scalar("int"))

    def _scalar(self, what: str) -> Scalar:
        """The one element of a one-element tensor of any shape (as numpy and torch take it for
        `float(t)`, `int(t)`); a ValueError naming the shape otherwise."""
        if self.numel() != 1:
            raise ValueError(f"{what}() needs a tensor with exactly one element, this tensor has shape {self.shape} "
                             f"({self.numel()} elements): reduce it first (.sum(), .mean()) or index one element")
        return self.numpy().reshape(()).item()

    # ---- realizing and reading ---------------------------------------------------------------

    def realize(self) -> Tensor:
        """Compute the value and keep it on the device; returns self."""
        if self.node.buffer is None:
            realize([self.node])
        return self

    def numpy(self) -> np.ndarray:
        """The value as a numpy array (a synchronisation point)."""
        node = self.node
        buffer = node.buffer
        if buffer is not None:  # computed, in host memory, nothing unfinished writes it: one copy
            array = buffer.device.read_array(buffer, node.dtype.np, node.shape)
            if array is not None:
                return array
        out = np.empty(self.shape, self.dtype.np)
        if out.size == 0:
            if node.op is Op.COLLECTIVE and buffer is None:
                # no bytes here, but every rank of the process collective takes part, before what
                # this thread does next (another collective, in the order every rank calls them)
                self.realize()
                synchronize()
            return out
        self.realize()
        buffer = self.node.buffer
        assert buffer is not None, "a realized node has its buffer"
        flat = out.reshape(-1).view(np.uint8)
        if buffer.device.read_now(flat, buffer):
            return out
        batch = buffer.device.batch("copy")
        batch.read_to_host(flat, buffer)
        batch.submit(inline=True).wait_blocking()
        return out

    def item(self) -> Scalar:
        return self._scalar("item")

    def tolist(self) -> Any:
        return self.numpy().tolist()

    def cpu(self) -> Tensor:
        """This tensor on the host's first CPU device (torch's `.cpu()`): itself when it is there already."""
        return self.to(_DEFAULT_DEVICE)

    def to(self, device: str) -> Tensor:
        device = canonical_name(device)
        if device == self.device:
            return self
        node = self.node
        base = node.base
        if base.op is Op.CONST and not base.realized and not node.requires_grad:
            # a constant (or a view of one) is the same constant there: nothing to copy, and no
            # reader on `device` waits for a kernel on this one (a data-parallel loss's 1/N seed)
            moved = const_node(base.arg, base.dtype, device)
            return Tensor(moved if base is node else LazyNode(Op.VIEW, (moved,), node.arg, node.dtype, node.shape, device))
        src = self.contiguous().node
        return Tensor(LazyNode(Op.COPY, (src,), None, self.dtype, self.shape, device))

    def shard(self, devices: Sequence[str], axis: int | None = 0) -> Any:
        """Split along `axis` over `devices` (uneven splits allowed; axis=None replicates): a
        `tinydist.multi.MultiTensor` whose ops run per shard, in parallel."""
        from tinydist.multi.sharded import MultiTensor
        return MultiTensor.shard(self, devices, axis)

    def contiguous(self) -> Tensor:
        node = self.node
        if node.realized or (node.op is not Op.VIEW and node.op is not Op.CONST):
            return self
        if node.op is Op.VIEW and node.arg.is_reshape_of(node.srcs[0].shape) and node.srcs[0].op is not Op.CONST:
            return self  # a reshape of contiguous memory is already contiguous: the fuser shares the buffer
        return self._buffered()

    def _buffered(self) -> Tensor:
        """This value computed once into a buffer of its own (a CONTIGUOUS node), even when it is
        elementwise: for a value several kernels read, which inlining would recompute in each."""
        node = self.node
        return Tensor(LazyNode(Op.CONTIGUOUS, (node,), None, node.dtype, node.shape, node.device))

    def _pending_assign_of_this_scope(self) -> bool:
        """Whether this tensor's node is an assign not yet run that a new assign may follow in
        the same graph: it names memory already. Inside a capture (`observe_assigns`) only an
        assign the captured function made qualifies — one made before belongs to no step and
        is run first, or every replay would repeat it (AdamW's decay, then its update)."""
        if self.node.op is not Op.ASSIGN:
            return False
        return not _assign_observers or any(node is self.node for node in _assign_observers[-1])

    def assign(self, value: Tensor | Scalar | np.ndarray) -> Tensor:
        """Overwrite this tensor's memory with `value` (broadcast and cast to its shape and dtype).

        Readers of the old value that were built before the assign still see the old value."""
        if self.node.op is Op.VIEW and not self.node.realized:
            if self.node.base.op is not Op.CONST or self.node.base.realized:
                raise ValueError("assign() needs a whole tensor, not a view of one; assign to the base tensor")
            self.realize()  # a factory's broadcast constant (td.zeros(3)) owns no memory yet: now it does
        value = self._operand(value)
        if value.device != self.device:
            raise ValueError(f"assign across devices: target on {self.device}, value on {value.device}; use value.to({self.device!r})")
        value = value.cast(self.dtype)._broadcast_to(self.shape)
        if not self.node.realized and not self._pending_assign_of_this_scope():
            self.realize()
        old = self.node
        self.node = LazyNode(Op.ASSIGN, (self.node, value.node), None, self.dtype, self.shape, self.device)
        if old.requires_grad:  # autograd: a leaf stays a leaf across in-place updates
            from tinydist.frontend.autograd import after_assign
            after_assign(self, old)
        for observer in _assign_observers:
            observer.append(self.node)
        return self

    # ---- factories ----------------------------------------------------------------------------

    @staticmethod
    def full(shape: Sequence[int] | int, value: Scalar | np.number | np.bool_, dtype: Any = None, device: str | None = None) -> Tensor:
        shape = _shape_arg((shape,) if isinstance(shape, int) else shape, infer=False)
        dtype = to_dtype(dtype) if dtype is not None else dtypes.result_type(value)
        device = canonical_name(device or "CPU")
        scalar = const_node(value, dtype, device)
        return Tensor(broadcast_scalar(scalar, shape) if shape else scalar)

    @staticmethod
    def zeros(*shape: Any, dtype: Any = dtypes.float32, device: str | None = None) -> Tensor:
        return Tensor.full(_shape_arg(shape, infer=False), 0, dtype, device)

    @staticmethod
    def ones(*shape: Any, dtype: Any = dtypes.float32, device: str | None = None) -> Tensor:
        return Tensor.full(_shape_arg(shape, infer=False), 1, dtype, device)

    @staticmethod
    def arange(start: Scalar, stop: Scalar | None = None, step: Scalar = 1, dtype: Any = None, device: str | None = None) -> Tensor:
        values = np.arange(start, stop, step) if stop is not None else np.arange(start)
        return Tensor(values, device, dtype if dtype is not None else values.dtype)

    @staticmethod
    def eye(n: int, m: int | None = None, dtype: Any = dtypes.float32, device: str | None = None) -> Tensor:
        return Tensor(np.eye(n, m, dtype=to_dtype(dtype).np), device)

    @staticmethod
    def rand(*shape: Any, dtype: Any = dtypes.float32, device: str | None = None) -> Tensor:
        return Tensor(_rng.random(_shape_arg(shape), dtype=np.float64).astype(to_dtype(dtype).np), device)

    @staticmethod
    def randn(*shape: Any, dtype: Any = dtypes.float32, device: str | None = None) -> Tensor:
        return Tensor(_rng.standard_normal(_shape_arg(shape)).astype(to_dtype(dtype).np), device)

    def _like(self, value: Scalar, dtype: DType | None = None) -> Tensor:
        return Tensor.full(self.shape, value, dtype or self.dtype, self.device)

    # ---- elementwise --------------------------------------------------------------------------

    def _operand(self, other: Any) -> Tensor:
        if isinstance(other, Tensor):
            return other
        if isinstance(other, (bool, int, float, np.number, np.bool_)):
            dtype = dtypes.result_type(self.dtype, other) if isinstance(other, (bool, int, float)) else to_dtype(np.asarray(other).dtype)
            return Tensor.full((), other, dtype, self.device)
        if isinstance(other, (np.ndarray, list, tuple)):
            return Tensor(other, self.device)
        raise TypeError(f"unsupported operand type {type(other).__name__} for a Tensor operation")

    def _broadcast_to(self, shape: tuple[int, ...]) -> Tensor:
        if self.shape == shape:
            return self
        node = self.node
        if not node.shape and (node.op is not Op.VIEW or node.buffer is not None):  # a scalar operand's one view
            return Tensor(broadcast_scalar(node, shape))
        padded = (1,) * (len(shape) - self.ndim) + self.shape
        return self.reshape(padded).expand(shape) if padded != self.shape else self.expand(shape)

    def _binary(self, other: Any, op: Op, reverse: bool = False, out_dtype: DType | None = None,
                operand_dtype: DType | None = None) -> Tensor:
        a, b = self, other if type(other) is Tensor else self._operand(other)
        if reverse:
            a, b = b, a
        a_node, b_node = a.node, b.node
        if a_node.device != b_node.device:
            raise ValueError(f"operands are on different devices: {a.device} and {b.device}; move one with .to()")
        shape = a_node.shape
        if b_node.shape != shape and b_node.shape:
            shape = _broadcast_shapes(shape, b_node.shape, a.shape, b.shape)
        common = operand_dtype or (a_node.dtype if a_node.dtype is b_node.dtype else _promote(a, b))
        if common.is_bool:  # numpy: bool + bool is or, bool * bool is and, bool - bool is refused
            if op is Op.SUB:
                raise TypeError("boolean subtract (-) is not supported, as in numpy; use ^ (xor) or logical_not")
            if op is Op.IDIV or op is Op.MOD:  # bool // bool and bool % bool are int8, as in numpy
                common = out_dtype = dtypes.int8
            op = {Op.ADD: Op.OR, Op.MUL: Op.AND}.get(op, op)
        a, b = a.cast(common)._broadcast_to(shape), b.cast(common)._broadcast_to(shape)
        return Tensor(elementwise(op, (a.node, b.node), out_dtype or common))

    def _unary(self, op: Op, float_only: bool = False) -> Tensor:
        x = self.cast(dtypes.ufunc_float_result(self.dtype)) if float_only else self
        return Tensor(elementwise(op, (x.node,), x.dtype))

    def cast(self, dtype: Any) -> Tensor:
        dtype = to_dtype(dtype)
        if dtype is self.dtype:
            return self
        if self.node.op is Op.CONST and not self.node.realized:
            return Tensor(const_node(self.node.arg, dtype, self.device))
        return Tensor(elementwise(Op.CAST, (self.node,), dtype, dtype))

    astype = cast

    def bitcast(self, dtype: Any) -> Tensor:
        """The same bits read as `dtype`, of the same size (numpy's `.view(dtype)`; a bool is its byte)."""
        dtype = to_dtype(dtype)
        if dtype.itemsize != self.dtype.itemsize:
            raise ValueError(f"bitcast from {self.dtype.name} ({8 * self.dtype.itemsize} bits) to {dtype.name} "
                             f"({8 * dtype.itemsize} bits): the sizes must match; cast() converts values")
        if dtype is self.dtype:
            return self
        return Tensor(elementwise(Op.BITCAST, (self.node,), dtype))

    def __add__(self, other: Any) -> Tensor: return self._binary(other, Op.ADD)
    def __radd__(self, other: Any) -> Tensor: return self._binary(other, Op.ADD, reverse=True)
    def __sub__(self, other: Any) -> Tensor: return self._binary(other, Op.SUB)
    def __rsub__(self, other: Any) -> Tensor: return self._binary(other, Op.SUB, reverse=True)
    def __mul__(self, other: Any) -> Tensor: return self._binary(other, Op.MUL)
    def __rmul__(self, other: Any) -> Tensor: return self._binary(other, Op.MUL, reverse=True)
    def __truediv__(self, other: Any) -> Tensor: return self._true_divide(other, False)
    def __rtruediv__(self, other: Any) -> Tensor: return self._true_divide(other, True)
    def __floordiv__(self, other: Any) -> Tensor: return self._binary(other, Op.IDIV)
    def __rfloordiv__(self, other: Any) -> Tensor: return self._binary(other, Op.IDIV, reverse=True)
    def __mod__(self, other: Any) -> Tensor: return self._binary(other, Op.MOD)
    def __rmod__(self, other: Any) -> Tensor: return self._binary(other, Op.MOD, reverse=True)
    def __pow__(self, other: Any) -> Tensor: return self.pow(other)
    def __rpow__(self, other: Any) -> Tensor: return self._operand(other).pow(self)
    def __neg__(self) -> Tensor: return self.neg()
    def __abs__(self) -> Tensor: return self.abs()
    def __lt__(self, other: Any) -> Tensor: return self._compare(other, Op.CMPLT)
    def __le__(self, other: Any) -> Tensor: return self._compare(other, Op.CMPLE)
    def __gt__(self, other: Any) -> Tensor: return self._compare(other, Op.CMPLT, reverse=True)
    def __ge__(self, other: Any) -> Tensor: return self._compare(other, Op.CMPLE, reverse=True)
    def __eq__(self, other: Any) -> Tensor: return self._compare(other, Op.CMPEQ)  # type: ignore[override]
    def __ne__(self, other: Any) -> Tensor: return self._compare(other, Op.CMPNE)  # type: ignore[override]
    def __and__(self, other: Any) -> Tensor: return self._bitwise(other, Op.AND)
    def __or__(self, other: Any) -> Tensor: return self._bitwise(other, Op.OR)
    def __xor__(self, other: Any) -> Tensor: return self._bitwise(other, Op.XOR)
    def __rand__(self, other: Any) -> Tensor: return self._bitwise(other, Op.AND)
    def __ror__(self, other: Any) -> Tensor: return self._bitwise(other, Op.OR)
    def __rxor__(self, other: Any) -> Tensor: return self._bitwise(other, Op.XOR)
    def __lshift__(self, other: Any) -> Tensor: return self._shift(other, Op.SHL)
    def __rshift__(self, other: Any) -> Tensor: return self._shift(other, Op.SHR)
    def __rlshift__(self, other: Any) -> Tensor: return self._operand(other)._shift(self, Op.SHL)
    def __rrshift__(self, other: Any) -> Tensor: return self._operand(other)._shift(self, Op.SHR)
    def __invert__(self) -> Tensor:
        if self.dtype.is_bool:
            return self.logical_not()
        return self._bitwise(self._like((1 << self.dtype.itemsize * 8) - 1 if self.dtype.is_unsigned else -1), Op.XOR)
    __hash__ = object.__hash__

    def __matmul__(self, other: Any) -> Tensor:
        return self.matmul(other)

    def __rmatmul__(self, other: Any) -> Tensor:
        return self._operand(other).matmul(self)

    def _true_divide(self, other: Any, reverse: bool) -> Tensor:
        other = self._operand(other)
        common = dtypes.float_result(_promote(self, other))
        return self._binary(other, Op.DIV, reverse=reverse, operand_dtype=common)

    def _compare(self, other: Any, op: Op, reverse: bool = False) -> Tensor:
        return self._binary(other, op, reverse=reverse, out_dtype=dtypes.bool_)

    def _bitwise(self, other: Any, op: Op) -> Tensor:
        other = self._operand(other)
        if _promote(self, other).is_float:  # uint64 with a signed int promotes to float64, as in numpy
            raise TypeError(f"bitwise {op.value} is not defined for {self.dtype.name} and {other.dtype.name}; use integer or bool tensors")
        return self._binary(other, op)

    def _shift(self, other: Any, op: Op) -> Tensor:
        """numpy's left_shift / right_shift: a count outside [0, bits) gives 0 (-1 for a negative
        value shifted right); right shifts of signed values are arithmetic."""
        other = self._operand(other)
        common = _promote(self, other)
        if not common.is_int:
            raise TypeError(f"shift is not defined for {self.dtype.name} and {other.dtype.name}; use integer tensors")
        return self._binary(other, op, operand_dtype=common)

    def add(self, other: Any) -> Tensor: return self + other
    def sub(self, other: Any) -> Tensor: return self - other
    def mul(self, other: Any) -> Tensor: return self * other
    def div(self, other: Any) -> Tensor: return self / other

    def neg(self) -> Tensor:
        if self.dtype.is_bool:
            raise TypeError("negation of a bool tensor is not supported; use ~x or logical_not()")
        return self._unary(Op.NEG)

    def abs(self) -> Tensor:
        return self if self.dtype.is_bool else self._unary(Op.ABS)

    def logical_not(self) -> Tensor:
        return Tensor(elementwise(Op.NOT, (self.cast(dtypes.bool_).node,), dtypes.bool_))

    def maximum(self, other: Any) -> Tensor: return self._binary(other, Op.MAX)
    def minimum(self, other: Any) -> Tensor: return self._binary(other, Op.MIN)

    def where(self, a: Any, b: Any) -> Tensor:
        return where(self, a, b)

    def exp(self) -> Tensor: return self._unary(Op.EXP, float_only=True)
    def exp2(self) -> Tensor: return self._unary(Op.EXP2, float_only=True)
    def log(self) -> Tensor: return self._unary(Op.LOG, float_only=True)
    def log2(self) -> Tensor: return self._unary(Op.LOG2, float_only=True)
    def sqrt(self) -> Tensor: return self._unary(Op.SQRT, float_only=True)
    def sin(self) -> Tensor: return self._unary(Op.SIN, float_only=True)
    def cos(self) -> Tensor: return self._unary(Op.COS, float_only=True)
    def floor(self) -> Tensor: return self if not self.dtype.is_float else self._unary(Op.FLOOR)
    def reciprocal(self) -> Tensor: return 1 / self
    def square(self) -> Tensor: return self * self
    def isnan(self) -> Tensor: return self != self

    def relu(self) -> Tensor:
        return self.maximum(0)

    def sigmoid(self) -> Tensor:
        x = self.cast(dtypes.float_result(self.dtype))
        return 1 / (1 + (-x).exp())

    def tanh(self) -> Tensor:
        # tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2|x|) ≤ 1: never overflows
        x = self.cast(dtypes.ufunc_float_result(self.dtype))
        e = (x.abs() * -2).exp()
        magnitude = (1 - e) / (1 + e)
        return (x < 0).where(-magnitude, magnitude)

    def pow(self, exponent: Any) -> Tensor:
        exponent_t = self._operand(exponent)
        common = _promote(self, exponent_t)
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

    def clip(self, low: Any = None, high: Any = None) -> Tensor:
        x = self
        if low is not None:
            x = x.maximum(low)
        if high is not None:
            x = x.minimum(high)
        return x

    # ---- reductions ---------------------------------------------------------------------------

    def _reduce(self, op: str, axis: int | Sequence[int] | None, keepdim: bool, dtype: DType | None = None) -> Tensor:
        axes = _normalize_axes(axis, self.ndim)
        x = self.cast(dtype) if dtype is not None else self
        if x.dtype.is_bool and op in ("max", "min"):
            return x.cast(dtypes.int32)._reduce(op, axis, keepdim).cast(dtypes.bool_)
        kept = tuple(1 if i in axes else s for i, s in enumerate(self.shape))
        if any(self.shape[a] == 0 for a in axes):
            if op in ("max", "min"):
                raise ValueError(f"zero-size tensor (shape {self.shape}) to reduction operation {op} which has no identity")
            result = Tensor.full(kept, 0 if op == "sum" else 1, x.dtype, self.device)
        elif not axes:
            result = x
        else:
            result = Tensor(LazyNode(Op.REDUCE, (x.node,), (op, axes), x.dtype, kept, self.device))
        if keepdim:
            return result
        return result.reshape(tuple(s for i, s in enumerate(self.shape) if i not in axes))

    def sum(self, axis: int | Sequence[int] | None = None, keepdim: bool = False, dtype: Any = None) -> Tensor:
        return self._reduce("sum", axis, keepdim, to_dtype(dtype) if dtype is not None else dtypes.sum_result(self.dtype))

    def prod(self, axis: int | Sequence[int] | None = None, keepdim: bool = False, dtype: Any = None) -> Tensor:
        return self._reduce("prod", axis, keepdim, to_dtype(dtype) if dtype is not None else dtypes.sum_result(self.dtype))

    def max(self, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
        return self._reduce("max", axis, keepdim)

    def min(self, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
        return self._reduce("min", axis, keepdim)

    def mean(self, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
        if self.ndim == 0 and axis is not None:   # numpy's mean, unlike its sum, has no axis 0 there
            raise np.exceptions.AxisError(f"axis {axis} is out of bounds for a 0-d tensor (it has no axes; use axis=None)")
        axes = _normalize_axes(axis, self.ndim)
        count = math.prod(self.shape[a] for a in axes)
        dtype = dtypes.float_result(self.dtype)
        total = self.cast(dtype)._reduce("sum", axis, keepdim)
        return total / count if count else total * float("nan")

    def var(self, axis: int | Sequence[int] | None = None, keepdim: bool = False, correction: float | None = None,
            *, ddof: float | None = None) -> Tensor:
        """The variance, sum((x - mean)²) / (N - correction), in numpy's float result type.

        `correction` is torch's name and `ddof` numpy's for the same number; the default is
        numpy's, 0 (the population variance), where torch's is 1: pass `correction=1` for
        torch's `x.var()`. Where N - correction <= 0 the result is inf (nan for an all-equal
        or empty input), as in both."""
        return self._centered_square_mean(axis, keepdim, _correction(correction, ddof, "var"))

    def std(self, axis: int | Sequence[int] | None = None, keepdim: bool = False, correction: float | None = None,
            *, ddof: float | None = None) -> Tensor:
        """The standard deviation, sqrt of `var` with the same arguments (numpy's default correction 0)."""
        return self._centered_square_mean(axis, keepdim, _correction(correction, ddof, "std")).sqrt()

    def _centered_square_mean(self, axis: int | Sequence[int] | None, keepdim: bool, correction: float) -> Tensor:
        axes = _normalize_axes(axis, self.ndim)
        count = math.prod(self.shape[a] for a in axes)
        centered = self - self.mean(axis, keepdim=True)
        return (centered * centered).sum(axis, keepdim) / max(count - correction, 0)

    def any(self, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
        return self._truth("max", axis, keepdim)

    def all(self, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
        return self._truth("min", axis, keepdim)

    def _truth(self, op: str, axis: int | Sequence[int] | None, keepdim: bool) -> Tensor:
        """any (max) / all (min) of truth values; over no elements False / True, as numpy."""
        axes = _normalize_axes(axis, self.ndim)
        if any(self.shape[a] == 0 for a in axes):
            kept = tuple(1 if i in axes else s for i, s in enumerate(self.shape))
            empty = Tensor.full(kept, op == "min", dtypes.bool_, self.device)
            return empty if keepdim else empty.reshape(tuple(s for i, s in enumerate(self.shape) if i not in axes))
        return self.cast(dtypes.bool_)._reduce(op, axis, keepdim)

    def _arg_reduce(self, op: str, axis: int | None, keepdim: bool) -> Tensor:
        flat = axis is None
        x = self.reshape(-1) if flat else self
        axis = _normalize_axis(axis if axis is not None else 0, x.ndim)
        if x.shape[axis] == 0:
            raise ValueError(f"attempt to get arg{op} of an empty sequence")
        extreme = x._reduce(op, axis, keepdim=True)
        hit = (x == extreme) | x.isnan() if x.dtype.is_float else x == extreme
        positions = Tensor.arange(x.shape[axis], dtype=dtypes.int64, device=self.device)
        positions = positions.reshape(tuple(-1 if i == axis else 1 for i in range(x.ndim)))
        first = hit.where(positions, x.shape[axis]).min(axis, keepdim=True)
        if keepdim:
            return first.reshape((1,) * self.ndim) if flat else first
        return first.reshape(tuple(s for i, s in enumerate(x.shape) if i != axis))

    def argmax(self, axis: int | None = None, keepdim: bool = False) -> Tensor:
        return self._arg_reduce("max", axis, keepdim)

    def argmin(self, axis: int | None = None, keepdim: bool = False) -> Tensor:
        return self._arg_reduce("min", axis, keepdim)

    # ---- movement -----------------------------------------------------------------------------

    def _view(self, movement: str, arg: Any) -> Tensor:
        return Tensor(view(self.node, movement, arg))

    def reshape(self, *shape: Any) -> Tensor:
        checked = _shape_arg(shape)
        if -1 not in checked:  # most reshapes: the element count is all there is to check
            if checked == self.node.shape:
                return self
            if math.prod(checked) != self.node.numel:
                raise ValueError(f"cannot reshape tensor of shape {self.shape} into shape {checked}")
            return Tensor(view(self.node, "reshape", checked))
        new = list(checked)
        if new.count(-1) > 1:
            raise ValueError(f"can only specify one unknown dimension, got shape {tuple(new)}")
        if -1 in new:
            known = math.prod(s for s in new if s != -1)
            if known == 0 or self.numel() % known:
                raise ValueError(f"cannot reshape tensor of shape {self.shape} into shape {tuple(new)}")
            new[new.index(-1)] = self.numel() // known
        if math.prod(new) != self.numel():
            raise ValueError(f"cannot reshape tensor of shape {self.shape} into shape {tuple(new)}")
        return self if tuple(new) == self.shape else self._view("reshape", tuple(new))

    def view(self, *shape: Any) -> Tensor:
        """torch's `view`: `view(2, -1)` is `reshape(2, -1)`, `view(dtype)` is `bitcast(dtype)`.

        torch refuses a view whose strides cannot express the new shape (a transposed tensor's
        `view(-1)`) because the view must share the input's memory. No Tensor here aliases
        memory a caller can write through (`assign()` refuses views; ops never write their
        inputs), so sharing is never observable and every reshape is a valid view: the graph
        moves data only where a kernel needs it contiguous."""
        if len(shape) == 1 and not isinstance(shape[0], (int, np.integer, tuple, list)):
            return self.bitcast(shape[0])
        return self.reshape(*shape)

    def permute(self, *order: Any) -> Tensor:
        if len(order) == 1 and isinstance(order[0], (tuple, list)):
            order = tuple(order[0])
        ndim = len(self.node.shape)
        if not all([type(a) is int and 0 <= a < ndim for a in order]):  # else: negative axes, or an error to name
            order = tuple(_normalize_axis(a, ndim) for a in order)
        if sorted(order) != list(range(ndim)):
            raise ValueError(f"permute order {order} is not a permutation of the axes of shape {self.shape}")
        return self if order == tuple(range(self.ndim)) else self._view("permute", order)

    def transpose(self, *axes: int) -> Tensor:
        """No axes: reverse them (numpy). Two axes: swap them (torch). Otherwise: a permutation."""
        if not axes:
            return self.permute(tuple(reversed(range(self.ndim))))
        if len(axes) == 2 and self.ndim != 2:
            a, b = (_normalize_axis(x, self.ndim) for x in axes)
            order = list(range(self.ndim))
            order[a], order[b] = order[b], order[a]
            return self.permute(tuple(order))
        return self.permute(*axes)

    @property
    def T(self) -> Tensor:
        return self.transpose()

    def expand(self, *shape: Any) -> Tensor:
        new = _shape_arg(shape)
        if len(new) < self.ndim:
            raise ValueError(f"cannot expand shape {self.shape} to {new}: fewer dimensions")
        x = self.reshape((1,) * (len(new) - self.ndim) + self.shape) if len(new) > self.ndim else self
        target = tuple(old if want == -1 else want for old, want in zip(x.shape, new))
        for old, want in zip(x.shape, target):
            if old != want and old != 1:
                raise ValueError(f"cannot expand shape {self.shape} to {new}: only size-1 axes can expand")
        return x if target == x.shape else x._view("expand", target)

    def broadcast_to(self, *shape: Any) -> Tensor:
        return self.expand(*shape)

    def flatten(self, start_axis: int = 0, end_axis: int = -1) -> Tensor:
        if self.ndim == 0:
            return self.reshape(1)
        start, end = _normalize_axis(start_axis, self.ndim), _normalize_axis(end_axis, self.ndim)
        return self.reshape(self.shape[:start] + (math.prod(self.shape[start:end + 1]),) + self.shape[end + 1:])

    def squeeze(self, axis: int | Sequence[int] | None = None) -> Tensor:
        if axis is None:
            return self.reshape(tuple(s for s in self.shape if s != 1))
        axes = _normalize_axes(axis, self.ndim)
        for a in axes:
            if self.shape[a] != 1:
                raise ValueError(f"cannot squeeze axis {a} of shape {self.shape}: its size is {self.shape[a]}, not 1")
        return self.reshape(tuple(s for i, s in enumerate(self.shape) if i not in axes))

    def unsqueeze(self, axis: int) -> Tensor:
        axis = _normalize_axis(axis, self.ndim + 1)
        return self.reshape(self.shape[:axis] + (1,) + self.shape[axis:])

    def pad(self, padding: Any, value: Scalar = 0) -> Tensor:
        """Constant padding; `padding` as numpy's pad_width: int, (before, after), or one pair per axis."""
        pairs = np.broadcast_to(np.asarray(padding, dtype=np.int64), (self.ndim, 2)) if self.ndim else np.zeros((0, 2), np.int64)
        if (pairs < 0).any():
            raise ValueError(f"negative padding {padding!r} is not supported")
        pairs_t = tuple((int(b), int(a)) for b, a in pairs)
        if not any(b or a for b, a in pairs_t):
            return self
        padded = self._view("pad", pairs_t)
        if value == 0:
            return padded
        inside = Tensor.full(self.shape, True, dtypes.bool_, self.device)._view("pad", pairs_t)
        return inside.where(padded, Tensor.full((), value, self.dtype, self.device))

    def shrink(self, bounds: Sequence[tuple[int, int]]) -> Tensor:
        bounds = tuple((int(lo), int(hi)) for lo, hi in bounds)
        if len(bounds) != self.ndim or any(not 0 <= lo <= hi <= s for (lo, hi), s in zip(bounds, self.shape)):
            raise ValueError(f"shrink bounds {bounds} do not fit shape {self.shape}")
        return self if all(b == (0, s) for b, s in zip(bounds, self.shape)) else self._view("shrink", bounds)

    def __getitem__(self, index: Any) -> Tensor:
        return _getitem(self, index)

    def __setitem__(self, index: Any, value: Any) -> None:
        raise TypeError("item assignment is not supported; build the new tensor and use assign()")

    def _as_strided(self, shape: tuple[int, ...], strides: tuple[int, ...], offset: int = 0) -> Tensor:
        return self.contiguous()._view("as_strided", (shape, strides, offset))

    # ---- compound ops (tinydist.frontend.functional) ---------------------------------------------------

    def matmul(self, other: Any) -> Tensor:
        from tinydist.frontend.functional import matmul
        return matmul(self, self._operand(other))

    def dot(self, other: Any) -> Tensor:
        return self.matmul(other)

    def softmax(self, axis: int = -1) -> Tensor:
        from tinydist.frontend.functional import softmax
        return softmax(self, axis)

    def log_softmax(self, axis: int = -1) -> Tensor:
        from tinydist.frontend.functional import log_softmax
        return log_softmax(self, axis)

    def layernorm(self, axis: int | Sequence[int] = -1, eps: float = 1e-5) -> Tensor:
        from tinydist.frontend.functional import layernorm
        return layernorm(self, axis, eps)

    def conv2d(self, weight: Tensor, bias: Tensor | None = None, stride: Any = 1, padding: Any = 0,
               dilation: Any = 1, groups: int = 1) -> Tensor:
        from tinydist.frontend.functional import conv2d
        return conv2d(self, weight, bias, stride, padding, dilation, groups)

    def max_pool2d(self, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1) -> Tensor:
        from tinydist.frontend.functional import max_pool2d
        return max_pool2d(self, kernel_size, stride, padding, dilation)

    def avg_pool2d(self, kernel_size: Any, stride: Any = None, padding: Any = 0) -> Tensor:
        from tinydist.frontend.functional import avg_pool2d
        return avg_pool2d(self, kernel_size, stride, padding)


def _correction(correction: float | None, ddof: float | None, what: str) -> float:
    """One number from torch's `correction` or numpy's `ddof` (0 when neither is given)."""
    if correction is not None and ddof is not None:
        raise TypeError(f"{what}() got both correction={correction!r} and ddof={ddof!r}: they are the same "
                        "number (torch's and numpy's name); pass one")
    value = correction if correction is not None else ddof if ddof is not None else 0
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{what}() correction must be a number, got {value!r} ({type(value).__name__})")
    return value


def _promote(a: Tensor, b: Tensor) -> DType:
    """numpy promotion; a 0-d tensor made from a Python scalar already carries its weak dtype."""
    return dtypes.result_type(a.dtype, b.dtype)


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


def _upload(array: np.ndarray, dtype: DType, device: str) -> LazyNode:
    if array.size == 0:
        return Tensor.full(array.shape, 0, dtype, device).node
    dev = get_engine().device(device)
    buffer = dev.allocator.recycled(array.nbytes)  # a frame loop's upload: the last frame's buffer, when dropped
    if not dev.write_now(buffer, array):  # (C-contiguous: its bytes as they lie)
        batch = dev.batch("copy")
        batch.write_from_host(buffer, array)
        batch.submit(inline=True).wait_blocking()
    return buffer_node(buffer, dtype, array.shape, device)


def where(condition: Any, a: Any, b: Any) -> Tensor:
    """Elements of `a` where `condition` holds, else of `b` (numpy broadcasting and promotion)."""
    anchor = next((t for t in (condition, a, b) if isinstance(t, Tensor)), None)
    if anchor is None:
        raise TypeError("where() needs at least one Tensor argument")
    # Python scalars are weak (NEP 50): they take the kind of the tensor branch they meet
    branch_dtypes = [v.dtype for v in (a, b) if isinstance(v, Tensor)]
    scalars = [v for v in (a, b) if isinstance(v, (bool, int, float))]
    common = dtypes.result_type(*branch_dtypes, *scalars) if branch_dtypes else None
    cond = anchor._operand(condition)
    x, y = (Tensor.full((), v, common, anchor.device) if common is not None and isinstance(v, (bool, int, float))
            else anchor._operand(v) for v in (a, b))
    devices = {cond.device, x.device, y.device}
    if len(devices) > 1:
        raise ValueError(f"where() operands are on different devices: {sorted(devices)}")
    try:
        shape = tuple(np.broadcast_shapes(cond.shape, x.shape, y.shape))
    except ValueError:
        raise ValueError(f"operands could not be broadcast together with shapes {cond.shape} {x.shape} {y.shape}") from None
    common = _promote(x, y)
    nodes = (cond.cast(dtypes.bool_)._broadcast_to(shape).node, x.cast(common)._broadcast_to(shape).node,
             y.cast(common)._broadcast_to(shape).node)
    return Tensor(elementwise(Op.WHERE, nodes, common))


def cat(tensors: Sequence[Tensor], axis: int = 0) -> Tensor:
    """Join tensors along an existing axis (each piece is a padded view; one fused kernel adds them)."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("cat() needs at least one tensor")
    first = tensors[0]
    axis = _normalize_axis(axis, first.ndim)
    for t in tensors[1:]:
        if t.ndim != first.ndim or any(s != f for i, (s, f) in enumerate(zip(t.shape, first.shape)) if i != axis):
            raise ValueError(f"cat(): shapes {[x.shape for x in tensors]} differ outside axis {axis}")
        if t.device != first.device:
            raise ValueError(f"cat(): tensors are on different devices: {sorted({x.device for x in tensors})}")
    dtype = dtypes.result_type(*(t.dtype for t in tensors))   # empty pieces take part, as in numpy
    total = sum(t.shape[axis] for t in tensors)
    if total == 0 or any(s == 0 for i, s in enumerate(first.shape) if i != axis):
        shape = list(first.shape)
        shape[axis] = total
        return Tensor.zeros(tuple(shape), dtype=dtype, device=first.device)
    result: Tensor | None = None
    offset = 0
    for t in (t for t in tensors if t.shape[axis]):   # an empty piece adds nothing
        pads = [(0, 0)] * first.ndim
        pads[axis] = (offset, total - offset - t.shape[axis])
        piece = t.cast(dtype).pad(pads)
        if result is None:
            result = piece
        else:  # select, not add: -0.0 and NaN payloads come through unchanged
            inside = Tensor.full(t.shape, True, dtypes.bool_, t.device).pad(pads)
            result = inside.where(piece, result)
        offset += t.shape[axis]
    assert result is not None
    return result


def stack(tensors: Sequence[Tensor], axis: int = 0) -> Tensor:
    tensors = list(tensors)
    if not tensors:
        raise ValueError("stack() needs at least one tensor")
    if len({t.shape for t in tensors}) != 1:
        raise ValueError(f"stack(): all tensors must have the same shape, got {[t.shape for t in tensors]}")
    axis = _normalize_axis(axis, tensors[0].ndim + 1)
    return cat([t.unsqueeze(axis) for t in tensors], axis)


def _getitem(x: Tensor, index: Any) -> Tensor:
    items = index if isinstance(index, tuple) else (index,)
    if sum(1 for i in items if i is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
    if consumed > x.ndim:
        raise IndexError(f"too many indices for tensor of dimension {x.ndim}")
    if Ellipsis in [i for i in items if not isinstance(i, Tensor)]:
        at = next(k for k, i in enumerate(items) if i is Ellipsis)
        items = items[:at] + (slice(None),) * (x.ndim - consumed) + items[at + 1:]
    else:
        items = items + (slice(None),) * (x.ndim - consumed)
    bounds, steps, final_shape, axis = [], [], [], 0
    for item in items:
        if item is None:
            final_shape.append(1)
            continue
        size = x.shape[axis]
        if isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            i = int(item)
            if not -size <= i < size:
                raise IndexError(f"index {i} is out of bounds for axis {axis} with size {size}")
            i %= size
            bounds.append((i, i + 1))
            steps.append(1)
        elif isinstance(item, slice):
            start, stop, step = item.indices(size)
            if step <= 0:
                raise IndexError(f"slice step {item.step} is not supported: only positive steps")
            stop = max(stop, start)
            bounds.append((start, stop))
            steps.append(step)
            final_shape.append(len(range(start, stop, step)))
        else:
            raise IndexError(f"unsupported index {item!r}: use ints, slices with positive steps, None and ...")
        axis += 1
    result = x.shrink(bounds)
    if any(s != 1 for s in steps):
        result = result._view("step", tuple(steps))
    return result.reshape(tuple(final_shape))

