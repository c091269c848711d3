"""The lazy graph: what a Tensor is until it is realized.

A `LazyNode` is one operation over its sources, with a known shape, dtype and device. Tensor
methods build nodes; `realize` hands the graph to the scheduler, which fuses nodes into kernels.
Once a node's result exists on a device, `node.buffer` holds it and the node is a leaf for every
later graph that uses it.

Movement ops never create work: they become a VIEW (a ShapeTracker over a base node). Over an
unrealized elementwise node, reshape / permute / shrink are pushed down to its sources, so
`(a + b).T` stays one fused kernel; expand and pad over computed values make the scheduler
materialize the value first (recomputing it per expanded element would cost more, and padding
must read zeros, not f(0)).
"""

from __future__ import annotations

import enum
import functools
import itertools
import operator
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from tinydist.base.walk import Step, drive
from tinydist.graph import dtypes
from tinydist.graph.dtypes import DType
from tinydist.graph.shape import Shape, ShapeTracker, prod

if TYPE_CHECKING:  # a realized node holds a runtime buffer; the graph never calls it
    from tinydist.runtime.buffer import Buffer


class Op(enum.Enum):
    # leaves
    BUFFER = "buffer"        # realized memory (node.buffer)
    CONST = "const"          # a scalar (arg), shape ()
    # elementwise, unary
    NEG = "neg"; ABS = "abs"; NOT = "not"; SQRT = "sqrt"; EXP = "exp"; EXP2 = "exp2"; LOG = "log"  # noqa: E702
    LOG2 = "log2"; SIN = "sin"; COS = "cos"; CAST = "cast"; FLOOR = "floor"  # noqa: E702
    BITCAST = "bitcast"      # the same bits read as another dtype of the same size (bool: its byte)
    # elementwise, binary
    ADD = "add"; SUB = "sub"; MUL = "mul"; DIV = "div"; IDIV = "idiv"; MOD = "mod"; POW = "pow"  # noqa: E702
    MAX = "max"; MIN = "min"; AND = "and"; OR = "or"; XOR = "xor"; SHL = "shl"; SHR = "shr"  # noqa: E702
    CMPLT = "cmplt"; CMPLE = "cmple"; CMPEQ = "cmpeq"; CMPNE = "cmpne"  # noqa: E702
    # elementwise, ternary
    WHERE = "where"
    # reduction over arg = (reduce op, axes); keeps reduced axes with size 1
    REDUCE = "reduce"
    # structure
    VIEW = "view"            # arg: ShapeTracker over srcs[0] (never itself a VIEW)
    CONTIGUOUS = "contiguous"
    MATMUL = "matmul"        # srcs: (a [B,M,K], b [B,K,N]) contiguous → [B,M,N]
    COPY = "copy"            # srcs[0] moved to this node's device
    ASSIGN = "assign"        # srcs: (target BUFFER node, value): write value into target's memory
    ALLREDUCE = "allreduce"  # srcs: one per device, all alike; arg (reduce op, i): their reduction on srcs[i]'s device
    COLLECTIVE = "collective"  # srcs: (x,); arg: a process collective (tinydist.dist.lazy) of x over every rank


UNARY = frozenset({Op.NEG, Op.ABS, Op.NOT, Op.SQRT, Op.EXP, Op.EXP2, Op.LOG, Op.LOG2, Op.SIN, Op.COS, Op.CAST, Op.FLOOR,
                   Op.BITCAST})
BINARY = frozenset({Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.IDIV, Op.MOD, Op.POW, Op.MAX, Op.MIN, Op.AND, Op.OR, Op.XOR,
                    Op.SHL, Op.SHR, Op.CMPLT, Op.CMPLE, Op.CMPEQ, Op.CMPNE})
ELEMENTWISE = UNARY | BINARY | {Op.WHERE}
TRANSCENDENTAL = frozenset({Op.EXP, Op.EXP2, Op.LOG, Op.LOG2, Op.SIN, Op.COS, Op.POW})

_ids = itertools.count()
_ASSIGN = Op.ASSIGN


# ---- autograd hook (tinydist.frontend.autograd) ------------------------------------------------------
# A node `requires_grad` when it is a float value computed (with gradients enabled) from a node
# that requires grad; leaves are marked by tinydist.frontend.autograd. realize() keeps `srcs` of such
# nodes so backward() can still walk the forward graph after the forward was computed.
class _GradMode:
    enabled = True


grad_mode = _GradMode()
# ---- end autograd hook -----------------------------------------------------------------------


class LazyNode:
    __slots__ = ("op", "srcs", "arg", "dtype", "shape", "device", "buffer", "id", "_readers", "requires_grad", "__weakref__")

    def __init__(self, op: Op, srcs: tuple[LazyNode, ...], arg: Any, dtype: DType, shape: Shape, device: str,
                 buffer: Buffer | None = None) -> None:
        self.op = op
        self.srcs = srcs
        self.arg = arg
        self.dtype = dtype
        self.shape = shape if type(shape) is tuple else tuple(shape)
        self.device = device
        self.buffer = buffer
        self.id = next(_ids)
        # Who reads this node, weakly: an assign must let readers of the old value run first.
        self._readers: list[weakref.ref[LazyNode]] | None = None
        grad = False
        if srcs:
            me = weakref.ref(self)
            for src in srcs:
                readers = src._readers
                if readers is None:
                    src._readers = [me]
                else:
                    readers.append(me)
                    # A long-lived node (a weight) is read by every graph built from it: drop dead
                    # entries whenever the list doubles, so it stays proportional to the readers alive.
                    count = len(readers)
                    if count >= 32 and count & (count - 1) == 0:
                        readers[:] = [ref for ref in readers if ref() is not None]
                if src.requires_grad:
                    grad = True
        self.requires_grad: bool = grad and grad_mode.enabled and op is not _ASSIGN and dtype.is_float  # autograd hook

    def live_readers(self) -> Iterator[LazyNode]:
        """Unrealized nodes still alive that read this node."""
        for ref in self._readers or ():
            reader = ref()
            if reader is not None and not reader.realized:
                yield reader

    def __repr__(self) -> str:
        state = " realized" if self.buffer is not None else ""
        return f"<{self.op.name} {self.dtype.name}{list(self.shape)} {self.device}{state}>"

    @property
    def realized(self) -> bool:
        return self.buffer is not None

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def base(self) -> LazyNode:
        """The node a view reads; a realized node (a view too) is its own memory."""
        return self.srcs[0] if self.op is Op.VIEW and self.buffer is None else self

    @property
    def tracker(self) -> ShapeTracker:
        return self.arg if self.op is Op.VIEW else ShapeTracker.contiguous(self.shape)


def buffer_node(buffer: Buffer, dtype: DType, shape: Shape, device: str) -> LazyNode:
    return LazyNode(Op.BUFFER, (), None, dtype, shape, device, buffer)


def const_node(value: Any, dtype: DType, device: str) -> LazyNode:
    return LazyNode(Op.CONST, (), dtype.np.type(value).item(), dtype, (), device)


# Arithmetic over constants is done when the graph is built: a constant expression left in the
# graph is inlined where it is read, except by another device, where it becomes a kernel and a
# cross-device wait of its own (a loss's gradient seed 1/N, read by every data-parallel replica).
# Only IEEE basic arithmetic on floats, which numpy rounds exactly as the kernels do.
_FOLDABLE: dict[Op, Callable[..., Any]] = {Op.ADD: operator.add, Op.SUB: operator.sub, Op.MUL: operator.mul, Op.DIV: operator.truediv, Op.NEG: operator.neg}


_CONST = Op.CONST


def elementwise(op: Op, srcs: tuple[LazyNode, ...], dtype: DType, arg: Any = None) -> LazyNode:
    first = srcs[0]
    if first.op is not _CONST:  # the common case: nothing to fold
        return LazyNode(op, srcs, arg, dtype, first.shape, first.device)
    shape, device = first.shape, first.device
    fold = _FOLDABLE.get(op)
    if (fold is not None and dtype in (dtypes.float32, dtypes.float64)
            and all(s.op is Op.CONST and s.buffer is None and s.dtype == dtype and not s.requires_grad for s in srcs)):
        with np.errstate(all="ignore"):  # 1/0 is inf, 0/0 is nan, as in a kernel
            return const_node(fold(*(dtype.np.type(s.arg) for s in srcs)), dtype, device)
    return LazyNode(op, srcs, arg, dtype, shape, device)


_PUSHABLE = frozenset({"reshape", "permute", "shrink", "step"})

# The most elementwise ops one kernel inlines: fusion cuts a longer chain into kernels of this
# many, and a view is pushed through at most this many nodes (beyond, it reads the value from
# memory, as an expand does). Lowering and compiling cost about 0.5 ms per op (a kernel of a
# 40,000-op chain took 20 s; kernels of 256 alike ops compile once). Pushing a view into a deep
# chain copies the chain: a residual stream (x + f(x) per layer, reshaped by each layer's matmul)
# is copied once per layer, quadratic in depth below the cap (a 2,000-layer residual MLP's
# forward: 6 s at 256, 20 s at 512). Normal graphs stay far below: the largest kernel and the
# deepest push over tests/{schedule,tensor,jit,train,onnx,multi} have 98 ops (an ONNX model),
# the next largest 38, so the cap changes no schedule of theirs.
MAX_FUSED_OPS = 256


def view(node: LazyNode, movement: str, arg: Any) -> LazyNode:
    """Apply a movement op (`reshape`, `permute`, `expand`, `shrink`, `pad`, `step`, `as_strided`)."""
    if movement in _PUSHABLE and _pushable(node):
        size = _push_size(node, MAX_FUSED_OPS)
        if size <= SHALLOW_PUSH:  # a few frames deep: recursion, without a generator per node
            return _push_shallow(node, movement, arg)
        if size <= MAX_FUSED_OPS:
            return drive(_push(node, movement, arg))
    return _view_of(node, movement, arg)


def _pushable(node: LazyNode) -> bool:
    return node.buffer is None and node.op in ELEMENTWISE


def _push_size(node: LazyNode, limit: int) -> int:
    """How many nodes pushing a view into `node` rebuilds (a source read twice, twice), counted
    up to `limit + 1`."""
    count, pending = 0, [node]
    while pending and count <= limit:
        node = pending.pop()
        if _pushable(node):
            count += 1
            pending.extend(node.srcs)
    return count


# Pushes through at most this many nodes recurse (as deep as the count, at most): the chains of
# a training step's gradients are a few nodes long, and a generator per node driven by
# `tinydist.base.walk.drive` cost about twice the recursion for them.
SHALLOW_PUSH = 32


def _push_shallow(node: LazyNode, movement: str, arg: Any) -> LazyNode:
    """`_push` for a chain of at most SHALLOW_PUSH nodes, by recursion (the same nodes, in the same order)."""
    srcs = tuple([_push_shallow(src, movement, arg) if _pushable(src) else _view_of(src, movement, arg) for src in node.srcs])
    return elementwise(node.op, srcs, node.dtype, node.arg)


def _push(node: LazyNode, movement: str, arg: Any) -> Step[LazyNode]:
    """`node`'s op over its sources' views. A Step (tinydist.base.walk): the chain may be deep. Not
    memoized: a source read twice is pushed twice (two nodes), and fusion decides on each."""
    srcs = []
    for src in node.srcs:
        srcs.append((yield _push(src, movement, arg)) if _pushable(src) else _view_of(src, movement, arg))
    return elementwise(node.op, tuple(srcs), node.dtype, node.arg)


def broadcast_scalar(node: LazyNode, shape: Shape) -> LazyNode:
    """A shape-() node (not an unrealized view) read at every index of `shape`: the VIEW that
    reshaping it to ones and expanding makes, without the two movement ops in between (a
    tensor-scalar op cost ~5x a tensor-tensor one through them: Adam makes ~10 per parameter).
    An unrealized elementwise scalar is expanded as it is, not rebuilt at shape (1, ..., 1) by
    pushing the reshape into it: the scheduler materializes an expanded computed value either
    way, so the same arithmetic runs once, at shape () (Adam's bias corrections)."""
    return LazyNode(Op.VIEW, (node,), _scalar_tracker(shape), node.dtype, shape, node.device)


@functools.lru_cache(maxsize=4096)
def _scalar_tracker(shape: Shape) -> ShapeTracker:
    tracker = ShapeTracker.contiguous(())
    return tracker.reshape((1,) * len(shape)).expand(shape)


_contiguous = functools.lru_cache(maxsize=4096)(ShapeTracker.contiguous)


@functools.lru_cache(maxsize=8192)
def _moved(tracker: ShapeTracker, movement: str, arg: Any) -> ShapeTracker:
    """A movement of a tracker (a pure function of immutable values): cached, since a training
    loop moves the same trackers the same way every step (a reshape's re-striding is ~5 µs)."""
    return tracker.as_strided(*arg) if movement == "as_strided" else getattr(tracker, movement)(arg)


def _view_of(node: LazyNode, movement: str, arg: Any) -> LazyNode:
    """The movement as a VIEW node over `node`'s memory (the base of a view: views never stack)."""
    if node.buffer is None and node.op is Op.VIEW:
        base, tracker = node.srcs[0], node.arg
    else:  # realized memory (of any op) is contiguous in its own shape
        base, tracker = node, _contiguous(node.shape)
    try:
        new = _moved(tracker, movement, arg)
    except TypeError:  # an unhashable argument (a list): not cached
        new = tracker.as_strided(*arg) if movement == "as_strided" else getattr(tracker, movement)(arg)
    if new.contiguous_base and new.shape == base.shape:
        return base
    return LazyNode(Op.VIEW, (base,), new, base.dtype, new.shape, base.device)
