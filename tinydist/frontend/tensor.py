"""The lazy Tensor: numpy semantics, computed by fused native kernels on tinydist devices.

    a = td.Tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    y = ((a * 2 + 1).relu().exp() / 3).sum(axis=1)
    y.numpy()

Operations only build a graph (`tinydist.graph.lazy`); `realize()` schedules and runs it, `numpy()`
realizes and reads back. Every argument is validated when the op is built, so shape, axis and
dtype mistakes raise `ValueError` / `TypeError` naming the shapes — never deep inside codegen.

This file holds the class: construction and upload, reading back, devices, `assign`, the
factories, and the primitives every op is built on (`_operand`, `_binary`, `_unary`, `cast`,
`_reduce`, `_view`, `where`). The ops themselves are module functions in their topic's module,
attached in the class body below, so `Tensor` stays one class with one API and its types checked:
`frontend/arithmetic.py` (operators, elementwise math), `frontend/reductions.py`,
`frontend/movement.py` (views, `cat`, `stack`), `frontend/indexing.py`, and the compound ops
(matmul, convolution, pooling, softmax, layernorm) in `frontend/functional.py`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from tinydist.engine.realize import realize
from tinydist.frontend import arithmetic, indexing, movement, reductions
from tinydist.frontend.arguments import broadcast_shapes, normalize_axes, promote, shape_arg
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
        shape = shape_arg((shape,) if isinstance(shape, int) else shape, infer=False)
        dtype = to_dtype(dtype) if dtype is not None else dtypes.result_type(value)
        device = canonical_name(device or "CPU")
        scalar = const_node(value, dtype, device)
        return Tensor(broadcast_scalar(scalar, shape) if shape else scalar)

    @staticmethod
    def zeros(*shape: Any, dtype: Any = dtypes.float32, device: str | None = None) -> Tensor:
        return Tensor.full(shape_arg(shape, infer=False), 0, dtype, device)

    @staticmethod
    def ones(*shape: Any, dtype: Any = dtypes.float32, device: str | None = None) -> Tensor:
        return Tensor.full(shape_arg(shape, infer=False), 1, dtype, device)

    @staticmethod
    def arange(start: Scalar, stop: Scalar | None = None, step: Scalar = 1, dtype: Any = None, device: str | None = None) -> Tensor:
        values = np.arange(start, stop, step) if stop is not None else np.arange(start)
        return Tensor(values, device, dtype if dtype is not None else values.dtype)

    @staticmethod
    def eye(n: int, m: int | None = None, dtype: Any = dtypes.float32, device: str | None = None) -> Tensor:
        return Tensor(np.eye(n, m, dtype=to_dtype(dtype).np), device)

    @staticmethod
    def rand(*shape: Any, dtype: Any = dtypes.float32, device: str | None = None) -> Tensor:
        return Tensor(_rng.random(shape_arg(shape), dtype=np.float64).astype(to_dtype(dtype).np), device)

    @staticmethod
    def randn(*shape: Any, dtype: Any = dtypes.float32, device: str | None = None) -> Tensor:
        return Tensor(_rng.standard_normal(shape_arg(shape)).astype(to_dtype(dtype).np), device)

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
            shape = broadcast_shapes(shape, b_node.shape, a.shape, b.shape)
        common = operand_dtype or (a_node.dtype if a_node.dtype is b_node.dtype else promote(a, b))
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

    # ---- operators and elementwise math (tinydist.frontend.arithmetic) --------------------------

    __add__ = add = arithmetic.add
    __radd__ = arithmetic.radd
    __sub__ = sub = arithmetic.sub
    __rsub__ = arithmetic.rsub
    __mul__ = mul = arithmetic.mul
    __rmul__ = arithmetic.rmul
    __truediv__ = div = arithmetic.truediv
    __rtruediv__ = arithmetic.rtruediv
    __floordiv__ = arithmetic.floordiv
    __rfloordiv__ = arithmetic.rfloordiv
    __mod__ = arithmetic.mod
    __rmod__ = arithmetic.rmod
    __pow__ = arithmetic.pow
    __rpow__ = arithmetic.rpow
    __neg__ = neg = arithmetic.neg
    __abs__ = abs = arithmetic.abs
    __lt__ = arithmetic.lt
    __le__ = arithmetic.le
    __gt__ = arithmetic.gt
    __ge__ = arithmetic.ge
    __eq__ = arithmetic.eq  # type: ignore[assignment]
    __ne__ = arithmetic.ne  # type: ignore[assignment]
    __hash__ = object.__hash__
    __and__ = __rand__ = arithmetic.and_
    __or__ = __ror__ = arithmetic.or_
    __xor__ = __rxor__ = arithmetic.xor
    __lshift__ = arithmetic.lshift
    __rshift__ = arithmetic.rshift
    __rlshift__ = arithmetic.rlshift
    __rrshift__ = arithmetic.rrshift
    __invert__ = arithmetic.invert
    logical_not = arithmetic.logical_not
    maximum = arithmetic.maximum
    minimum = arithmetic.minimum

    def where(self, a: Any, b: Any) -> Tensor:
        return where(self, a, b)

    exp = arithmetic.exp
    exp2 = arithmetic.exp2
    log = arithmetic.log
    log2 = arithmetic.log2
    sqrt = arithmetic.sqrt
    sin = arithmetic.sin
    cos = arithmetic.cos
    floor = arithmetic.floor
    reciprocal = arithmetic.reciprocal
    square = arithmetic.square
    isnan = arithmetic.isnan
    relu = arithmetic.relu
    sigmoid = arithmetic.sigmoid
    tanh = arithmetic.tanh
    pow = arithmetic.pow
    clip = arithmetic.clip

    # ---- reductions (tinydist.frontend.reductions) ----------------------------------------------

    def _reduce(self, op: str, axis: int | Sequence[int] | None, keepdim: bool, dtype: DType | None = None) -> Tensor:
        axes = normalize_axes(axis, self.ndim)
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

    sum = reductions.sum
    prod = reductions.prod
    max = reductions.max
    min = reductions.min
    mean = reductions.mean
    var = reductions.var
    std = reductions.std
    any = reductions.any
    all = reductions.all
    argmax = reductions.argmax
    argmin = reductions.argmin

    # ---- movement and indexing (tinydist.frontend.movement, tinydist.frontend.indexing) ----------

    def _view(self, movement: str, arg: Any) -> Tensor:
        return Tensor(view(self.node, movement, arg))

    reshape = movement.reshape
    view = movement.view
    permute = movement.permute
    transpose = movement.transpose

    @property
    def T(self) -> Tensor:
        return self.transpose()

    expand = movement.expand
    broadcast_to = movement.broadcast_to
    flatten = movement.flatten
    squeeze = movement.squeeze
    unsqueeze = movement.unsqueeze
    pad = movement.pad
    shrink = movement.shrink
    _as_strided = movement.as_strided
    __getitem__ = indexing.getitem
    __setitem__ = indexing.setitem

    def __matmul__(self, other: Any) -> Tensor:
        return self.matmul(other)

    def __rmatmul__(self, other: Any) -> Tensor:
        return self._operand(other).matmul(self)

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
    common = promote(x, y)
    nodes = (cond.cast(dtypes.bool_)._broadcast_to(shape).node, x.cast(common)._broadcast_to(shape).node,
             y.cast(common)._broadcast_to(shape).node)
    return Tensor(elementwise(Op.WHERE, nodes, common))
