"""Fusion: the lazy graph → kernel calls over numbered buffers.

Rules, in the order they are applied:

  1. Realized nodes are inputs (read-only leaves).
  2. A node is materialized (gets a buffer) when it is a target; a reduce that is viewed
     (e.g. broadcast back against its input, as in softmax) or is a second reduce in one kernel;
     the base of an expand/pad over computed values; a matmul, its operands, a copy and its
     source, a `contiguous`; and a node used more than once when recomputing it would cost more
     than storing it (it contains a transcendental, a reduce, or more than a few ops).
     A copy between devices of one peer group (CPU devices of one process) is the exception:
     not a call at all, its readers load the source straight from the peer's memory (the source
     itself is still computed on its own device). So is, on host devices, a matmul operand that
     is a `contiguous` copy of one strided view (a convolution's im2col columns): the matmul
     packs it straight from the view's base, unless something else needs the copy first.
  3. Everything else — chains of elementwise ops, the reduce they feed, and elementwise ops
     applied to that reduce's result — is inlined into the kernel that computes the
     materialized node that uses it, up to `lazy.MAX_FUSED_OPS` elementwise ops per kernel: the
     elementwise node met past that (depth first, sources in order) is materialized instead.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from tinydist.base.walk import Step, drive, postorder
from tinydist.codegen import kernel as K
from tinydist.codegen.kernel import KernelAST, KNode
from tinydist.codegen.lowering import STREAMING_STORE_BYTES, VECTOR_BYTES
from tinydist.codegen.matmul_tiling import StridedOperand, packed_a_elements, workspace_bytes
from tinydist.graph import dtypes
from tinydist.graph.collectives import shard_bounds
from tinydist.graph.lazy import ELEMENTWISE, MAX_FUSED_OPS, TRANSCENDENTAL, LazyNode, Op
from tinydist.graph.reduce_ops import ReduceOp
from tinydist.graph.shape import ShapeTracker, prod
from tinydist.runtime.registry import peer_group
from tinydist.schedule.items import BufferSpec, Call, CollectiveCall, CopyCall, GatherCall, KernelCall, MatmulCall, SliceCall

CHEAP_RECOMPUTE_OPS = 3


@dataclass
class FusedGraph:
    specs: list[BufferSpec] = field(default_factory=list)      # one per buffer number
    calls: list[Call] = field(default_factory=list)            # producers before their readers
    number: dict[int, int] = field(default_factory=dict)       # id(node) -> buffer number
    aliases: dict[int, int] = field(default_factory=dict)      # assign version -> buffer whose memory it is
    overwrites: dict[int, int] = field(default_factory=dict)   # assign version -> the version it overwrites


AllreduceGroups = dict[tuple[str, tuple[int, ...]], dict[int, list[LazyNode]]]


def _consumers(targets: list[LazyNode]) -> tuple[Counter[int], AllreduceGroups]:
    """How many graph nodes read each node; and the ALLREDUCE nodes by (op, their inputs), then
    by output index: one group is computed by one set of calls, whichever member is reached first."""
    counts: Counter[int] = Counter()
    groups: AllreduceGroups = {}
    seen: set[int] = set()
    stack = list(targets)
    while stack:
        node = stack.pop()
        if id(node) in seen or node.realized:
            continue
        seen.add(id(node))
        if node.op is Op.ALLREDUCE:
            op, index = node.arg
            groups.setdefault((op, tuple(id(src) for src in node.srcs)), {}).setdefault(index, []).append(node)
        for src in node.srcs:
            counts[id(src)] += 1
            stack.append(src)
    return counts, groups


def _inline_cost(node: LazyNode, limit: int) -> int:
    """Ops an inlined copy of `node` would recompute (a source used twice, twice), up to `limit + 1`;
    a transcendental, a reduce or anything that is not elementwise counts as more than `limit`
    (always worth a buffer). The count stops once over the limit: a long chain costs only that."""
    cost, pending = 0, [node]
    while pending:
        node = pending.pop()
        if node.realized or node.op in (Op.CONST, Op.VIEW):
            continue
        if node.op not in ELEMENTWISE or node.op in TRANSCENDENTAL or cost == limit:
            return limit + 1
        cost += 1
        pending.extend(node.srcs)
    return cost


class _Fuser:
    def __init__(self, targets: list[LazyNode], inputs: list[LazyNode]) -> None:
        self.targets = targets
        self.graph = FusedGraph()
        for node in inputs:
            self._new_buffer(node, BufferSpec(node.nbytes, node.dtype, node.shape, node.device))
        self.consumers, self.allreduces = _consumers(targets)
        self.target_ids = {id(t) for t in targets}
        self.must_materialize: set[int] = set(self.target_ids)

    def run(self) -> FusedGraph:
        for target in self.targets:
            drive(self.materialize(target))
        return self.graph

    # The methods below that may materialize another node are Steps (tinydist.base.walk): each call of
    # one is `(yield self.method(...))`, so that chains of thousands of kernels, each inlining
    # thousands of ops, stack up in `drive` and not on the interpreter's stack.

    def buffer_of(self, node: LazyNode) -> Step[int]:
        """The buffer number holding `node`'s value (materializing it if needed)."""
        return self.graph.number[id(node)] if node.realized else (yield self.materialize(node))

    def _new_buffer(self, node: LazyNode | None, spec: BufferSpec) -> int:
        number = len(self.graph.specs)
        self.graph.specs.append(spec)
        if node is not None:
            self.graph.number[id(node)] = number
        return number

    def _holds_apart(self, node: LazyNode, base: LazyNode) -> bool:
        """Whether target `node` must not share `base`'s memory: the caller holds both as values
        of their own (an input, or another target), and an assign to one must not change the
        other — an assign makes a new version, readers built before it keep the old value."""
        return id(node) in self.target_ids and (base.realized or id(base) in self.target_ids)

    def materialize(self, node: LazyNode) -> Step[int]:
        if id(node) in self.graph.number:
            return self.graph.number[id(node)]
        if node.op is Op.COLLECTIVE:  # before the empty case: every rank takes part, whatever its bytes
            src = yield self.buffer_of(node.srcs[0])
            out = self._new_buffer(node, BufferSpec(node.nbytes, node.dtype, node.shape, node.device))
            self.graph.calls.append(CollectiveCall(out, src, node.arg, node.device))
            return out
        if node.numel == 0:  # nothing to compute: an empty buffer, no call
            return self._new_buffer(node, BufferSpec(0, node.dtype, node.shape, node.device))
        base = node.srcs[0] if node.op is Op.VIEW else None
        if base is not None and node.arg.is_reshape_of(base.shape) and base.op is not Op.CONST and not self._holds_apart(node, base):
            # a reshape of contiguous memory (a reduce dropping its size-1 axes, a weight matrix
            # viewed with a batch axis) is the same bytes: both nodes name one buffer, no copy
            number = yield self.buffer_of(base)
            self.graph.number[id(node)] = number
            return number
        if node.op is Op.MATMUL:
            return (yield self._matmul(node))
        if node.op is Op.COPY:
            src = yield self.buffer_of(node.srcs[0])
            out = self._new_buffer(node, BufferSpec(node.nbytes, node.dtype, node.shape, node.device, lane="copy"))
            self.graph.calls.append(CopyCall(out, src, node.nbytes, node.device))
            return out
        if node.op is Op.ASSIGN:
            return (yield self._assign(node))
        if node.op is Op.ALLREDUCE:
            yield self._allreduce(node)
            return self.graph.number[id(node)]
        pieces = _cat_pieces(node)
        if pieces is not None:
            return (yield self._gather(node, pieces))
        return (yield self._kernel(node, out=None))

    def _gather(self, node: LazyNode, pieces: list[tuple[LazyNode, int]]) -> Step[int]:
        """`node` (a `cat`) as its pieces' buffers copied into their ranges of its buffer."""
        srcs, offsets = [], []
        for piece, start in pieces:
            if piece.numel == 0:
                continue
            if piece.op is Op.COPY and self._peer_copy(piece) and id(piece) not in self.graph.number \
                    and not self._should_materialize(piece):
                piece = piece.srcs[0]  # the gather's copy reads the peer's memory itself
            srcs.append((yield self.buffer_of(piece)))
            offsets.append(start * node.dtype.itemsize)
        out = self._new_buffer(node, BufferSpec(node.nbytes, node.dtype, node.shape, node.device, lane="copy"))
        self.graph.calls.append(GatherCall(out, tuple(srcs), tuple(offsets), node.nbytes, node.device))
        return out

    def _kernel(self, node: LazyNode, out: int | None, aliased: int | None = None) -> Step[int]:
        """A kernel computing `node` into a new buffer, or into `out` (an assign; `aliased` is the
        buffer number of the memory being overwritten, which the kernel may also read)."""
        slots: dict[int, int] = {}     # buffer number -> slot
        reduce_info: list[tuple[tuple[int, ...], tuple[int, ...]]] = []  # (input shape, axes)
        reshaped: list[tuple[int, ...]] = []  # the reduce's own shape, when reached through a reshape
        inlined = 0                           # elementwise ops in this kernel so far (at most MAX_FUSED_OPS)

        def slot(number: int) -> int:
            return slots.setdefault(number, len(slots))

        def load_of(base: LazyNode, tracker: ShapeTracker) -> Step[KNode]:
            if base.op is Op.CONST and not base.realized and all(v.mask is None for v in tracker.views):
                return K.const(base.arg, base.dtype)
            return K.load(slot((yield self.buffer_of(base))), tracker, base.dtype)

        def build(n: LazyNode, top: bool) -> Step[KNode]:
            nonlocal inlined
            if n.realized or (n is not node and (id(n) in self.graph.number or self._should_materialize(n))):
                return (yield load_of(n, ShapeTracker.contiguous(n.shape)))
            if n.op is Op.VIEW:
                base = n.srcs[0]
                if (top and not reduce_info and base.op is Op.REDUCE and not base.realized
                        and id(base) not in self.graph.number and not self._should_materialize(base)
                        and self.consumers[id(n)] <= 1 and n.arg.is_reshape_of(base.shape)):
                    # a reduce seen through a reshape (keepdim=False drops its size-1 axes): the same
                    # bytes, so inline it; the loads above it are re-expressed in its shape below.
                    # Only for a view with one consumer: views are never materialized for sharing,
                    # so inlining a shared one would recompute the reduction in every consumer.
                    reshaped.append(base.shape)
                    return (yield build(base, top))  # noqa: F821 (ruff#7733, the del below)
                if (base.op is Op.COPY and not base.realized and id(base) not in self.graph.number
                        and not self._should_materialize(base)):
                    return (yield self._peer_load(base, n.arg, load_of))  # e.g. a pad of a peer's chunk (cat)
                if not (base.realized or base.op is Op.CONST):
                    yield self.materialize(base)
                return (yield load_of(base, n.arg))
            if n.op is Op.CONST:
                return K.const(n.arg, n.dtype)
            if n.op is Op.COPY and self._peer_copy(n):
                return (yield self._peer_load(n, ShapeTracker.contiguous(n.shape), load_of))
            if n.op is Op.CONTIGUOUS:
                return (yield build(n.srcs[0], top))  # noqa: F821 (ruff#7733, the del below)
            if n.op is Op.REDUCE:
                reduce_op, axes = n.arg
                if reduce_info or not top:  # one reduce per kernel: a nested one gets its own kernel
                    return (yield load_of(n, ShapeTracker.contiguous(n.shape)))
                reduce_info.append((n.srcs[0].shape, axes))
                return KNode("reduce", ((yield build(n.srcs[0], False)),), reduce_op, n.dtype)  # noqa: F821 (ruff#7733, the del below)
            if n.op in ELEMENTWISE:
                if inlined == MAX_FUSED_OPS:  # a longer chain is cut: the rest is computed by kernels of its own
                    return (yield load_of(n, ShapeTracker.contiguous(n.shape)))
                inlined += 1
                srcs = []
                for s in n.srcs:
                    srcs.append((yield build(s, top)))  # noqa: F821 (ruff#7733, the del below)
                return KNode(n.op.value, tuple(srcs), n.arg, n.dtype)
            return (yield load_of(n, ShapeTracker.contiguous(n.shape)))  # matmul / copy / assign results

        root = yield build(node, True)
        del build  # a recursive closure is a reference cycle: break it, or the graph outlives this call
        if reshaped and reshaped[0] != node.shape:
            root = _in_shape_above_reduce(root, reshaped[0])
        shape, axes = reduce_info[0] if reduce_info else (node.shape, ())
        inputs = tuple(sorted(slots, key=slots.__getitem__))
        aliased_slots = tuple(slots[b] for b in inputs if aliased is not None and self._memory_of(b) == self._memory_of(aliased))
        ast = KernelAST(shape, axes, root, tuple(self.graph.specs[b].dtype for b in inputs), node.dtype, aliased_slots)
        if out is None:
            out = self._new_buffer(node, BufferSpec(node.nbytes, node.dtype, node.shape, node.device))
        self.graph.calls.append(KernelCall(ast, out, inputs, node.device))
        return out

    def _should_materialize(self, node: LazyNode) -> bool:
        if id(node) in self.must_materialize:
            return True
        if node.op is Op.COPY and self._peer_copy(node):
            return False  # its readers load the source where it lives: no copy, no buffer
        if node.op in (Op.MATMUL, Op.COPY, Op.ASSIGN, Op.CONTIGUOUS, Op.ALLREDUCE, Op.COLLECTIVE):
            return True
        if self.consumers[id(node)] > 1 and node.op not in (Op.VIEW, Op.CONST):
            return node.op is Op.REDUCE or _inline_cost(node, CHEAP_RECOMPUTE_OPS) > CHEAP_RECOMPUTE_OPS
        return False

    def _peer_copy(self, node: LazyNode) -> bool:
        """Whether the COPY `node` is between devices of one peer group (one memory)."""
        group = peer_group(node.device)
        return group is not None and peer_group(node.srcs[0].device) == group

    def _peer_load(self, copy: LazyNode, tracker: ShapeTracker,
                   load_of: Callable[[LazyNode, ShapeTracker], Step[KNode]]) -> Step[KNode]:
        """A load through `tracker` (over the peer copy's shape) of the copy's source, from its own
        device's memory. The source is computed there (materialized on its device, never inlined
        into the reader's kernel, so the work stays where the graph put it); a view of a buffer
        (`.to()` wraps one in `contiguous`) is read in place, its tracker under `tracker`."""
        src = copy.srcs[0]
        if (src.op is Op.CONTIGUOUS and not src.realized and id(src) not in self.graph.number
                and id(src) not in self.must_materialize and self.consumers[id(src)] <= 1
                and src.srcs[0].op is Op.VIEW):
            src = src.srcs[0]
        if src.op is not Op.VIEW or src.realized:
            return (yield load_of(src, tracker))
        base = src.srcs[0]
        if not (base.realized or base.op is Op.CONST):
            yield self.materialize(base)
        # `tracker` indexes contiguous memory of the view's shape: stack it on the view's tracker
        inner = src.arg
        return (yield load_of(base, inner.reshape(tracker.shape) if tracker.contiguous_base else ShapeTracker(inner.views + tracker.views)))

    def _matmul(self, node: LazyNode) -> Step[int]:
        if node.arg is not None:
            return (yield self._prepacked_matmul(node))
        a_node, b_node = node.srcs
        (ba, m, k), (bb, _, n) = a_node.shape, b_node.shape
        # One operand at most is read strided (host devices only: the LLVM matmul gathers), the
        # bigger one, whose copy costs the most: a convolution's columns, not the transposed
        # weights or output gradient it is multiplied with.
        found = [(operand.numel, view) for operand, view in ((a_node, self._strided_view(a_node, "a")),
                                                             (b_node, self._strided_view(b_node, "b")))
                 if view is not None and peer_group(node.device) == "host"]
        strided: StridedOperand | None = None
        if found:
            base, strided = max(found, key=lambda pair: pair[0])[1]
        a = yield self.buffer_of(base if strided is not None and strided.operand == "a" else a_node)
        b = yield self.buffer_of(base if strided is not None and strided.operand == "b" else b_node)
        batch = max(ba, bb)
        workspace = self._new_buffer(None, BufferSpec(workspace_bytes(m, n, k, node.dtype.name, strided=strided),
                                                      dtypes.bool_, (), node.device))
        out = self._new_buffer(node, BufferSpec(node.nbytes, node.dtype, node.shape, node.device))
        self.graph.calls.append(MatmulCall(out, a, b, workspace, batch, m, n, k, 0 if ba == 1 else m * k,
                                           0 if bb == 1 else k * n, node.dtype, node.device, strided=strided))
        return out

    def _prepacked_matmul(self, node: LazyNode) -> Step[int]:
        """A matmul whose B is a weight packed at load (`functional.matmul_prepacked`): one packed
        operand for the whole batch, read as it is (no B block in the workspace), times an A that
        may be read through a strided view (a convolution's windows, pixels first); or whose A is
        (`functional.matmul_prepacked_a`, a convolution's weight): one packed item per batch item
        or one for all, times a B that may be read through a strided view (the columns)."""
        a_node, b_node = node.srcs
        count, m, n = node.shape
        operand = node.arg[0]
        # the operand not packed may be a strided view read in place: a convolution's columns (B,
        # beside its packed weight) or, turned around (pixels × weight), its windows (A)
        loose, loose_node = ("b", b_node) if operand == "a" else ("a", a_node)
        found = self._strided_view(loose_node, loose) if peer_group(node.device) == "host" else None
        source, strided = found if found is not None else (loose_node, None)
        a = yield self.buffer_of(a_node if operand == "a" else source)
        b = yield self.buffer_of(source if operand == "a" else b_node)
        if operand == "a":
            k = b_node.shape[1]
            per_item = packed_a_elements(m, k, node.dtype.name)
            strides = (0 if a_node.numel == per_item else per_item, 0 if b_node.shape[0] == 1 else k * n)
        else:
            k = a_node.shape[2]
            strides = (0 if a_node.shape[0] == 1 else m * k, 0)
        workspace = self._new_buffer(None, BufferSpec(workspace_bytes(m, n, k, node.dtype.name, strided=strided,
                                                                      prepacked=operand),
                                                      dtypes.bool_, (), node.device))
        out = self._new_buffer(node, BufferSpec(node.nbytes, node.dtype, node.shape, node.device))
        self.graph.calls.append(MatmulCall(out, a, b, workspace, count, m, n, k, *strides, node.dtype, node.device,
                                           strided=strided, prepacked=operand))
        return out

    def _strided_view(self, operand: LazyNode, which: str) -> tuple[LazyNode, StridedOperand] | None:
        """For matmul operand `which` when it is a not yet computed `contiguous` copy of one strided
        view (a convolution's im2col columns): the view's base node and how the matrix lies in it.
        None where the copy is needed anyway, or the view is masked, or the rows do not end on an
        axis of the view, or offsets would not fit int32."""
        _, rows, _ = operand.shape
        node = operand
        if node.op is Op.VIEW and not node.realized and node.arg.is_reshape_of(node.srcs[0].shape):
            node = node.srcs[0]
        if (node.realized or node.op is not Op.CONTIGUOUS or operand.shape[0] != 1
                or id(node) in self.graph.number or id(node) in self.must_materialize):
            return None
        view = node.srcs[0]
        if view.op is not Op.VIEW or view.realized or len(view.arg.views) != 1 or view.arg.views[0].mask is not None:
            return None
        base, inner = view.srcs[0], view.arg.views[0]
        if base.op is Op.CONST or base.numel >= 1 << 31:
            return None
        axes = tuple((size, stride) for size, stride in zip(inner.shape, inner.strides) if size != 1)
        split, count = 0, 1
        while split < len(axes) and count < rows:
            count *= axes[split][0]
            split += 1
        if count != rows:
            return None
        return base, StridedOperand(which, axes[:split], axes[split:], inner.offset)

    def _allreduce(self, node: LazyNode) -> Step[None]:
        """`node`'s whole group (every output of one allreduce in this graph) as one SliceCall per
        input device: device d reduces range d of all inputs, reading its peers' memory in place,
        and writes the result into range d of every output — each input byte read once, each
        output byte written once."""
        op, _ = node.arg
        members = self.allreduces[(op, tuple(id(src) for src in node.srcs))]
        numbers = []
        for src in node.srcs:
            numbers.append((yield self.buffer_of(src)))
        inputs = tuple(numbers)
        outs = []
        for index in sorted(members):
            first, *same = members[index]
            outs.append(self._new_buffer(first, BufferSpec(first.nbytes, first.dtype, first.shape, first.device)))
            for other in same:  # the same allreduce built twice: one buffer
                self.graph.number[id(other)] = outs[-1]
        itemsize = node.dtype.itemsize
        align = max(1, VECTOR_BYTES // itemsize)  # ranges start on a vector: the kernels' stores are aligned
        ranges = [(min(node.numel, lo * align), min(node.numel, hi * align))
                  for lo, hi in shard_bounds(-(-node.numel // align), len(inputs))]
        slots = tuple(range(len(inputs)))
        # The devices' kernels together read and write 2·N·S bytes through the last-level cache
        # they share. From about half of it, the outputs are evicted before anyone reads them and
        # streaming stores pay (measured: 2 devices × 8 MiB and 4 × 2 MiB gain, 4 × 1 MiB loses).
        stream = 2 * len(inputs) * node.nbytes >= STREAMING_STORE_BYTES // 2
        for src, (lo, hi) in zip(node.srcs, ranges):
            if hi == lo:
                continue
            tracker = ShapeTracker.contiguous((hi - lo,))
            root = K.load(0, tracker, node.dtype)
            for slot in slots[1:]:
                root = KNode(ReduceOp(op).binary, (root, K.load(slot, tracker, node.dtype)), None, node.dtype)
            ast = KernelAST((hi - lo,), (), root, (node.dtype,) * len(inputs), node.dtype, outputs=len(outs), stream_stores=stream)
            self.graph.calls.append(SliceCall(ast, tuple(outs), inputs, lo * itemsize, (hi - lo) * itemsize, src.device))

    def _memory_of(self, number: int) -> int:
        return self.graph.aliases.get(number, number)

    def _assign(self, node: LazyNode) -> Step[int]:
        target, value = node.srcs
        old = yield self.buffer_of(target)
        out = self._new_buffer(node, self.graph.specs[old])
        self.graph.aliases[out] = self._memory_of(old)
        self.graph.overwrites[out] = old
        if value.numel:
            yield self._kernel(value, out=out, aliased=old)
            call = self.graph.calls[-1]
            assert isinstance(call, KernelCall), call
            if not _reads_aliased_in_place(call):
                # the kernel would read elements it has already overwritten: compute the value
                # into a buffer of its own, then copy it over the target
                self.graph.calls.pop()
                computed = yield self._kernel(value, out=None)
                copy = KernelAST(value.shape, (), K.load(0, ShapeTracker.contiguous(value.shape), value.dtype), (value.dtype,), value.dtype)
                self.graph.calls.append(KernelCall(copy, out, (computed,), node.device))
        return out


def _cat_pieces(node: LazyNode) -> list[tuple[LazyNode, int]] | None:
    """`cat`'s graph — where(padded True, padded piece, rest), down to a first padded piece — as
    (piece, first element in the result) in order, when every piece fills a contiguous range of
    the result (it is padded along the first axis only) and the pieces tile the result; else None."""
    if node.op is not Op.WHERE or node.realized:
        return None
    pieces: list[tuple[LazyNode, tuple[int, int]]] = []
    rest = node
    while rest.op is Op.WHERE and not rest.realized:
        cond, piece, rest = rest.srcs
        where = _padded_range(piece, node.shape)
        flag = cond.srcs[0] if cond.op is Op.VIEW else cond
        if (where is None or cond.op is not Op.VIEW or flag.op is not Op.CONST or flag.realized
                or not flag.dtype.is_bool or flag.arg is not True or cond.arg.views[0].mask != piece.arg.views[0].mask
                or cond.arg.views[1:] != piece.arg.views[1:]):
            return None
        pieces.append((piece.srcs[0], where))
    where = _padded_range(rest, node.shape)
    if where is None:
        return None
    pieces.append((rest.srcs[0], where))
    pieces.sort(key=lambda p: p[1])
    covered = 0
    for _, (start, end) in pieces:
        if start != covered:
            return None
        covered = end
    return [(piece, start) for piece, (start, _) in pieces] if covered == prod(node.shape) else None


def _padded_range(view: LazyNode, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """The elements [start, end) of a result of `shape` that `view` fills with its base's
    contiguous memory, in order, when it is the base padded along the first axis only (and then
    perhaps reshaped to `shape`: reshapes are pushed down through the cat's elementwise ops);
    else None."""
    if view.op is not Op.VIEW or view.realized or view.dtype != view.srcs[0].dtype or view.srcs[0].op is Op.CONST:
        return None
    padded = view.arg.views[0]
    if padded.mask is None or not padded.shape:
        return None
    lo, hi = padded.mask[0]
    region = (hi - lo, *padded.shape[1:])
    if prod(region) != view.srcs[0].numel:
        return None
    expected = ShapeTracker.contiguous(region).pad(((lo, padded.shape[0] - hi),) + ((0, 0),) * (len(region) - 1))
    if view.arg != (expected if padded.shape == shape else expected.reshape(shape)):
        return None
    row = prod(padded.shape[1:])
    return lo * row, hi * row


def _in_shape_above_reduce(root: KNode, shape: tuple[int, ...]) -> KNode:
    """The expression with every load above its reduce reading in `shape` (the reduce's keep-dims
    shape) instead of the reshaped one the graph used; same elements, same order."""
    memo: dict[int, KNode] = {}
    for k in postorder((root,), lambda k: () if k.op == "reduce" else k.srcs):
        if k.op == "reduce" or (not k.srcs and k.op != "load"):
            memo[id(k)] = k
        elif k.op == "load":
            slot, tracker = k.arg
            memo[id(k)] = K.load(slot, tracker.reshape(shape), k.dtype)
        else:
            memo[id(k)] = KNode(k.op, tuple(memo[id(src)] for src in k.srcs), k.arg, k.dtype)
    return memo[id(root)]


def _reads_aliased_in_place(call: KernelCall) -> bool:
    """Whether every read of the overwritten memory is of the very element being written (so an
    in-place kernel never reads a value it already replaced)."""
    ast = call.ast
    identity = ShapeTracker.contiguous(ast.shape)
    for node in ast.root.walk():
        if node.op == "load" and node.arg[0] in ast.aliased_slots:
            if ast.reduce_axes or node.arg[1] != identity:
                return False
    return True


def fuse(targets: list[LazyNode], inputs: list[LazyNode]) -> FusedGraph:
    """Kernel calls computing `targets`; `inputs` (realized nodes) take buffer numbers 0.. in order."""
    return _Fuser(targets, inputs).run()
