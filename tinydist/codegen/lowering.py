"""Kernel IR → LLVM IR text: the loop nest, loads and stores, reductions, vector loops.

The loop nest is emitted by us, not discovered by LLVM: adjacent axes that every load walks
contiguously are collapsed into one loop first (`tinydist.codegen.collapse`, so a 4096×4096
elementwise kernel is one loop of 16M), reduced axes run innermost with the accumulator in a
register, and the innermost loop is affine in its induction variable so LLVM's loop vectoriser
can widen it. Each op's own IR comes from `tinydist.codegen.alu`, the dtypes' LLVM types and
their memory forms from `tinydist.codegen.llvm_types`.

A contiguous one-dimensional elementwise kernel (every load walks its input with stride 1 or 0)
is emitted as explicit vector code — a loop over 64-byte vectors plus a scalar tail — so that an
output much larger than the caches can be written with streaming (non-temporal) stores: they
skip reading each cache line before overwriting it, a fifth of a triad's memory traffic. LLVM's
vectoriser will not widen non-temporal stores itself.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Protocol

from llvmlite import ir

from tinydist.base.walk import postorder
from tinydist.codegen import progress
from tinydist.codegen.alu import ALU_RULES, CONTRACT, ROUNDED, combine
from tinydist.codegen.collapse import collapse
from tinydist.codegen.kernel import KernelAST, KNode
from tinydist.codegen.llvm_types import (F16, F32, F64, I1, I8, I16, I32, I64, constant, from_memory, identity, llvm_type,
                                         round_narrow, to_memory)
from tinydist.graph.dtypes import DType
from tinydist.graph.shape import ShapeTracker, prod

PTR = ir.PointerType()  # opaque, address space 0: the CPU kernels' argument pointers
VECTOR_BYTES = 64                  # one AVX-512 register, one cache line
STREAMING_STORE_BYTES = 32 << 20   # bigger than this machine's last-level cache
MAX_LOOP_PIECES = 128              # most copies of a loop body that index-set splitting may emit
CASCADE_BLOCK = 1024               # elements a long float sum adds from zero before the pairwise cascade


# ---- IR building ------------------------------------------------------------------------------

class _Lowerer:
    # whether the outermost loops publish progress (`tinydist.codegen.progress`): host code, whose
    # globals the watchdog reads; a GPU kernel's globals are device memory
    publishes_progress = True

    def __init__(self, ast: KernelAST, module_name: str = "tinydist", pointer: ir.Type = PTR) -> None:
        self.ast = ast
        self.module = ir.Module(name=module_name)
        self.shape, self.reduce_axes, self.trackers = collapse(ast)
        arg_types = [pointer] * (ast.outputs + len(ast.slot_dtypes))
        self.fn = ir.Function(self.module, ir.FunctionType(ir.VoidType(), arg_types), name="KERNEL")
        self.outs, self.slots = self.fn.args[:ast.outputs], self.fn.args[ast.outputs:]
        self.out = self.outs[0]  # a kernel with a reduce has one output
        if not ast.aliased_slots:  # an in-place assign reads the memory it writes: no noalias there
            for out in self.outs:
                out.add_attribute("noalias")
        for i, slot in enumerate(self.slots):
            if i not in ast.aliased_slots:
                slot.add_attribute("noalias")
        self.entry = self.fn.append_basic_block("entry")
        self.b = ir.IRBuilder(self.entry)
        self.width: int | None = None  # lanes while emitting a vector loop body
        self.known: dict[int, tuple[int, int]] = {}  # axis -> the index range of the loop piece being emitted
        self.progress: ir.GlobalVariable | None = None  # defined by the first loop that publishes
        self.depth = 0  # loops open around the code being emitted: the outermost ones publish progress

    # -- helpers --

    def intrinsic(self, name: str, ret: ir.Type, args: list[ir.Type]) -> ir.Function:
        existing = self.module.globals.get(name)
        if existing is not None:
            return existing
        return ir.Function(self.module, ir.FunctionType(ret, args), name=name)

    def suffix(self, t: ir.Type) -> str:
        if isinstance(t, ir.VectorType):
            return f"v{t.count}{self.suffix(t.element)}"
        return {F16: "f16", F32: "f32", F64: "f64", I32: "i32", I64: "i64", I1: "i1", I8: "i8", I16: "i16"}[t]

    def typ(self, dtype: DType) -> ir.Type:
        """The register type of `dtype` in the code being emitted (a vector inside a vector loop)."""
        return llvm_type(dtype, width=self.width)

    def call(self, base: str, value_type: ir.Type, *args: ir.Value) -> ir.Value:
        fn = self.intrinsic(f"llvm.{base}.{self.suffix(value_type)}", value_type, [a.type for a in args])
        return self.b.call(fn, list(args))

    def loop(self, count: int, body: Callable[[ir.Value], None], name: str) -> None:
        """for i in range(count): body(i) — rotated form (count ≥ 1 is known), canonical for LLVM.
        An outermost loop over a big iteration space publishes progress (see `_publishing_loop`)."""
        every = self._publish_every(count) if self.depth == 0 and self.publishes_progress else None
        if every is None:
            self._loop(ir.Constant(I64, count), body, name)
        else:
            self._publishing_loop(count, every, body, name)

    def _loop(self, count: ir.Value, body: Callable[[ir.Value], None], name: str) -> None:
        pre = self.b.block
        header = self.fn.append_basic_block(f"{name}.body")
        after = self.fn.append_basic_block(f"{name}.end")
        self.b.branch(header)
        self.b.position_at_end(header)
        index = self.b.phi(I64, name=name)
        index.add_incoming(ir.Constant(I64, 0), pre)
        self.depth += 1
        body(index)
        self.depth -= 1
        nxt = self.b.add(index, ir.Constant(I64, 1), name=f"{name}.next", flags=("nuw", "nsw"))
        index.add_incoming(nxt, self.b.block)
        self.b.cbranch(self.b.icmp_unsigned("==", nxt, count), after, header)
        self.b.position_at_end(after)

    def _publish_every(self, count: int) -> int | None:
        """How many iterations of an outermost loop of `count` make about PUBLISH_ELEMENTS of the
        kernel's iteration space (a power of two); None when the whole kernel is smaller than
        that — done in about a millisecond, it has nothing to publish."""
        total = prod(self.shape)
        if total < progress.PUBLISH_ELEMENTS:
            return None
        per_iteration = max(1, total // count)
        return 1 << max(0, (progress.PUBLISH_ELEMENTS // per_iteration).bit_length() - 1)

    def _publishing_loop(self, count: int, every: int, body: Callable[[ir.Value], None], name: str) -> None:
        """The loop strip-mined into blocks of `every` iterations, the block index published
        before each: the inner loop is the plain loop, with no store or branch added to it. A
        store in every iteration of a short-bodied loop cost 15-27 %, a test of the index 20 %
        (bench/progress.py, a (1M, 3) kernel); one store per block costs nothing measurable."""
        if self.progress is None:
            self.progress = progress.word(self.module, "KERNEL")
        if every == 1:  # every iteration is a million elements or more
            def published(i: ir.Value) -> None:
                progress.publish(self.b, self.progress, i)
                body(i)
            self._loop(ir.Constant(I64, count), published, name)
            return
        blocks, rest = divmod(count, every)

        def block(k: ir.Value) -> None:
            progress.publish(self.b, self.progress, k)
            base = self.b.mul(k, ir.Constant(I64, every), flags=("nuw", "nsw"))
            length: ir.Value = ir.Constant(I64, every)
            if rest:  # the last block is short
                left = self.b.sub(ir.Constant(I64, count), base, flags=("nuw", "nsw"))
                length = self.b.select(self.b.icmp_unsigned("<", left, length), left, length)
            self._loop(length, lambda j: body(self.b.add(base, j, flags=("nuw", "nsw"))), f"{name}.in")
        self._loop(ir.Constant(I64, blocks + (1 if rest else 0)), block, f"{name}.blk")

    def loops(self, axes: list[int], body: Callable[[dict[int, ir.Value]], None], prefix: str,
              pieces: dict[int, list[tuple[int, int]]] | None = None) -> None:
        """Nested loops over `axes`; an axis in `pieces` runs as one loop per index range, each
        emitted with its range known (see offset)."""
        indices: dict[int, ir.Value] = {}

        def nest(k: int) -> None:
            if k == len(axes):
                body(dict(indices))
                return
            axis = axes[k]
            for lo, hi in (pieces or {}).get(axis, [(0, self.shape[axis])]):
                def inner(i: ir.Value, lo: int = lo) -> None:
                    indices[axis] = self.b.add(i, ir.Constant(I64, lo), flags=("nuw", "nsw")) if lo else i
                    nest(k + 1)
                if pieces and axis in pieces:
                    self.known[axis] = (lo, hi)
                self.loop(hi - lo, inner, f"{prefix}{axis}_{lo}")
                self.known.pop(axis, None)
        nest(0)

    def mask_pieces(self, axes: list[int]) -> dict[int, list[tuple[int, int]]]:
        """Index-set splitting: each axis of `axes` that loads are masked on, cut at the mask bounds,
        so that inside one piece every mask on it is all in or all out — padded and shifted reads
        (convolution taps) become plain affine loads or zeros, and the inner loop vectorises.
        Innermost axes first, while the number of loop-body copies stays small."""
        pieces: dict[int, list[tuple[int, int]]] = {}
        copies = 1
        for axis in reversed(axes[:-1]):
            n = self.shape[axis]
            cuts = {0, n}
            for tracker in self.trackers.values():
                mask = tracker.views[-1].mask
                if mask is not None:
                    cuts.update(bound for bound in mask[axis] if 0 < bound < n)
            if len(cuts) > 2 and copies * (len(cuts) - 1) <= MAX_LOOP_PIECES:
                points = sorted(cuts)
                pieces[axis] = list(zip(points, points[1:]))
                copies *= len(points) - 1
        return pieces

    # -- indexing --

    def offset(self, tracker: ShapeTracker, index: list[ir.Value]) -> tuple[ir.Value, ir.Value | None]:
        """Element offset into the base buffer and (if masked) whether the element exists."""
        b = self.b
        valid: ir.Value | None = None
        current = index
        offset: ir.Value = ir.Constant(I64, 0)
        for depth, view in enumerate(reversed(tracker.views)):
            if depth:  # a lower view sees the flat index of the one above it
                flat, current = offset, []
                for size in reversed(view.shape):
                    current.append(b.urem(flat, ir.Constant(I64, size)) if size != 1 else ir.Constant(I64, 0))
                    flat = b.udiv(flat, ir.Constant(I64, size)) if size != 1 else flat
                current.reverse()
            offset = ir.Constant(I64, view.offset)
            for i, (size, stride) in enumerate(zip(view.shape, view.strides)):
                if stride and size != 1:
                    term = current[i] if stride == 1 else b.mul(current[i], ir.Constant(I64, stride), flags=("nsw",))
                    offset = b.add(offset, term, flags=("nsw",)) if not (isinstance(offset, ir.Constant) and offset.constant == 0) else term
            if view.mask is not None:
                for i, ((lo, hi), size) in enumerate(zip(view.mask, view.shape)):
                    if lo == 0 and hi == size:
                        continue
                    if depth == 0 and i in self.known:  # the loop piece decides this mask statically
                        first, end = self.known[i]
                        if lo <= first and end <= hi:
                            continue
                        if end <= lo or hi <= first:
                            return offset, ir.Constant(I1, 0)
                    ok = b.and_(b.icmp_signed(">=", current[i], ir.Constant(I64, lo)), b.icmp_signed("<", current[i], ir.Constant(I64, hi)))
                    valid = ok if valid is None else b.and_(valid, ok)
        return offset, valid

    def load(self, node: KNode, index: list[ir.Value]) -> ir.Value:
        slot = node.arg[0]
        tracker = self.trackers[id(node)]
        offset, valid = self.offset(tracker, index)
        mem_type = llvm_type(node.dtype, in_memory=True)
        if self.width:  # vector body: stride 1 loads a vector, stride 0 broadcasts one element
            pointer = self.b.gep(self.slots[slot], [offset], inbounds=True, source_etype=mem_type)
            if tracker.views[0].strides[0] == 1:
                value = self.b.load(pointer, typ=ir.VectorType(mem_type, self.width), align=node.dtype.itemsize)
            else:
                value = self.broadcast(self.b.load(pointer, typ=mem_type), self.width)
            return from_memory(self.b, value, node.dtype)
        if isinstance(valid, ir.Constant) and not valid.constant:  # masked out in this whole loop piece
            return ir.Constant(llvm_type(node.dtype), 0)
        if valid is not None:
            offset = self.b.select(valid, offset, ir.Constant(I64, 0))
        pointer = self.b.gep(self.slots[slot], [offset], inbounds=True, source_etype=mem_type)
        value = from_memory(self.b, self.b.load(pointer, typ=mem_type), node.dtype)
        if valid is not None:
            value = self.b.select(valid, value, ir.Constant(value.type, 0))
        return value

    def broadcast(self, scalar: ir.Value, width: int) -> ir.Value:
        vector_type = ir.VectorType(scalar.type, width)
        first = self.b.insert_element(ir.Constant(vector_type, None), scalar, ir.Constant(I32, 0))
        return self.b.shuffle_vector(first, ir.Constant(vector_type, None), ir.Constant(ir.VectorType(I32, width), [0] * width))

    # -- expressions --

    def evaluate(self, root: KNode, index: list[ir.Value], cache: dict[int, ir.Value], reduced: ir.Value | None = None) -> ir.Value:
        """The value of `root` at `index`, emitting each node's code once (sources first, left to
        right); `reduced` stands for the reduce's result. Iterative: a fused chain can be very deep."""
        def sources(node: KNode) -> tuple[KNode, ...]:
            return () if node.op in ("reduce", "load", "const") or id(node) in cache else node.srcs

        for node in postorder((root,), sources):
            if id(node) in cache:
                continue
            if node.op == "reduce":
                assert reduced is not None, "a reduce below another reduce is split by the scheduler"
                value = round_narrow(self.b, reduced, node.dtype)  # a float16 sum accumulates in float32
            elif node.op == "load":
                value = self.load(node, index)
            elif node.op == "const":
                value = constant(node.dtype, node.arg, self.width)
            else:
                value = self.alu(node, [cache[id(src)] for src in node.srcs])
            cache[id(node)] = value
        return cache[id(root)]

    def alu(self, node: KNode, args: list[ir.Value]) -> ir.Value:
        value = ALU_RULES[node.op](self, node, args)
        if node.op in ROUNDED and node.dtype.is_narrow_float:
            value = round_narrow(self.b, value, node.dtype)
        return value

    # -- the kernel --

    def build(self) -> str:
        reduce_node = next((n for n in self.ast.root.walk() if n.op == "reduce"), None)
        outer = [a for a in range(len(self.shape)) if a not in self.reduce_axes]
        out_strides = _contiguous([1 if a in self.reduce_axes else s for a, s in enumerate(self.shape)])
        out_type = llvm_type(self.ast.out_dtype, in_memory=True)

        def store(value: ir.Value, idx: dict[int, ir.Value]) -> None:
            flat: ir.Value = ir.Constant(I64, 0)
            for axis in outer:
                if out_strides[axis] and self.shape[axis] != 1:
                    term = idx[axis] if out_strides[axis] == 1 else self.b.mul(idx[axis], ir.Constant(I64, out_strides[axis]), flags=("nsw",))
                    flat = term if isinstance(flat, ir.Constant) else self.b.add(flat, term, flags=("nsw",))
            value = to_memory(self.b, value, self.ast.out_dtype)
            for out in self.outs:
                self.b.store(value, self.b.gep(out, [flat], inbounds=True, source_etype=out_type))

        def full_index(idx: dict[int, ir.Value]) -> list[ir.Value]:
            return [idx.get(a, ir.Constant(I64, 0)) for a in range(len(self.shape))]

        width = self.vector_width() if reduce_node is None else None
        if width:
            self.vector_loops(width, out_type)
        elif reduce_node is None:
            self.loops(outer, lambda idx: store(self.evaluate(self.ast.root, full_index(idx), {}), idx), "i",
                       self.mask_pieces(outer))
        elif self.accumulate_rows(reduce_node):
            self.accumulate_in_output(reduce_node, outer, store, full_index, out_type)
        elif self.cascades(reduce_node):
            self.cascade_sum(reduce_node, outer, store, full_index)
        else:
            acc_type = llvm_type(reduce_node.dtype)
            acc = _entry_alloca(self, acc_type)

            def body(idx: dict[int, ir.Value]) -> None:
                self.b.store(identity(reduce_node.arg, reduce_node.dtype), acc)

                def step(ridx: dict[int, ir.Value]) -> None:
                    value = self.evaluate(reduce_node.srcs[0], full_index({**idx, **ridx}), {})
                    self.b.store(combine(self, reduce_node.arg, reduce_node.dtype, self.b.load(acc), value), acc)
                self.loops(list(self.reduce_axes), step, "r")
                result = self.evaluate(self.ast.root, full_index(idx), {}, reduced=self.b.load(acc))
                store(result, idx)
            self.loops(outer, body, "i")
        self.b.ret_void()
        return str(self.module)


    def cascades(self, reduce_node: KNode) -> bool:
        """Whether a float sum is long enough to need the cascade (see `cascade_sum`)."""
        count = prod([self.shape[a] for a in self.reduce_axes])
        return reduce_node.arg == "sum" and reduce_node.dtype.is_float and count > CASCADE_BLOCK

    def cascade_sum(self, reduce_node: KNode, outer: list[int], store: Callable[..., None],
                    full_index: Callable[[dict[int, ir.Value]], list[ir.Value]]) -> None:
        """A long float sum as blocks of at most `CASCADE_BLOCK` elements of the innermost reduced
        axis, each summed from zero (vectorised: lanes × interleave partial sums), and the block
        sums combined pairwise by a binary counter: block k is added to the partial of level l
        while bit l of k is set, so at most log2(blocks) partials are live and each element passes
        through about log2(n / CASCADE_BLOCK) + CASCADE_BLOCK / 64 additions. The error of a
        sequential float32 sum grows with n (the old kernel: 536870912 for the sum of 2**32 ones,
        relative error ~1e-2 at 1e8 random elements); this one stays within a few ulp × log2(n).
        The counter costs a few scalar ops per block: under 1 % of a block of 1,024 elements."""
        b = self.b
        acc_type = llvm_type(reduce_node.dtype)
        zero = identity("sum", reduce_node.dtype)
        block_acc = _entry_alloca(self, acc_type)
        levels = _entry_alloca(self, ir.ArrayType(acc_type, 64))
        blocks = _entry_alloca(self, I64)
        inner = self.reduce_axes[-1]
        extent = self.shape[inner]
        block = min(extent, CASCADE_BLOCK)
        full, tail = divmod(extent, block)

        def push() -> None:
            """Add the block sum into the levels: carry while the counter's low bits are set."""
            count = b.load(blocks)
            # the levels that carry are the counter's trailing ones
            level_of = b.call(self.intrinsic("llvm.cttz.i64", I64, [I64, I1]), [b.not_(count), ir.Constant(I1, 0)])
            carry_loop = self.fn.append_basic_block("carry.body")
            carry_end = self.fn.append_basic_block("carry.end")
            pre = b.block
            b.cbranch(b.icmp_unsigned("==", level_of, ir.Constant(I64, 0)), carry_end, carry_loop)
            b.position_at_end(carry_loop)
            level = b.phi(I64)
            level.add_incoming(ir.Constant(I64, 0), pre)
            value = b.load(block_acc)
            slot = b.gep(levels, [ir.Constant(I64, 0), level], inbounds=True)
            b.store(b.fadd(b.load(slot), value, flags=CONTRACT), block_acc)
            nxt = b.add(level, ir.Constant(I64, 1), flags=("nuw", "nsw"))
            level.add_incoming(nxt, b.block)
            b.cbranch(b.icmp_unsigned("==", nxt, level_of), carry_end, carry_loop)
            b.position_at_end(carry_end)
            b.store(b.load(block_acc), b.gep(levels, [ir.Constant(I64, 0), level_of], inbounds=True))
            b.store(b.add(count, ir.Constant(I64, 1), flags=("nuw",)), blocks)

        def sum_block(idx: dict[int, ir.Value], ridx: dict[int, ir.Value], start: ir.Value, length: int) -> None:
            b.store(zero, block_acc)

            def step(i: ir.Value) -> None:
                position = b.add(start, i, flags=("nuw", "nsw")) if not _is_zero(start) else i
                value = self.evaluate(reduce_node.srcs[0], full_index({**idx, **ridx, inner: position}), {})
                b.store(combine(self, "sum", reduce_node.dtype, b.load(block_acc), value), block_acc)
            self.loop(length, step, f"c{inner}_{length}")
            push()

        def body(idx: dict[int, ir.Value]) -> None:
            b.store(ir.Constant(I64, 0), blocks)

            def row(ridx: dict[int, ir.Value]) -> None:
                if full == 1:
                    sum_block(idx, ridx, ir.Constant(I64, 0), block)
                else:
                    self.loop(full, lambda j: sum_block(idx, ridx, b.mul(j, ir.Constant(I64, block), flags=("nuw", "nsw")), block),
                              f"cb{inner}")
                if tail:
                    sum_block(idx, ridx, ir.Constant(I64, full * block), tail)
            self.loops(list(self.reduce_axes[:-1]), row, "r")
            total = self.fold_levels(levels, b.load(blocks), acc_type, zero)
            store(self.evaluate(self.ast.root, full_index(idx), {}, reduced=total), idx)
        self.loops(outer, body, "i")

    def fold_levels(self, levels: ir.Value, count: ir.Value, acc_type: ir.Type, zero: ir.Value) -> ir.Value:
        """The sum of the live partials (the levels whose bit is set in `count`), smallest first."""
        b = self.b
        pre = b.block
        loop = self.fn.append_basic_block("fold.body")
        end = self.fn.append_basic_block("fold.end")
        b.branch(loop)
        b.position_at_end(loop)
        level = b.phi(I64)
        rest = b.phi(I64)
        total = b.phi(acc_type)
        level.add_incoming(ir.Constant(I64, 0), pre)
        rest.add_incoming(count, pre)
        total.add_incoming(zero, pre)
        partial = b.load(b.gep(levels, [ir.Constant(I64, 0), level], inbounds=True))
        live = b.trunc(rest, I1)
        added = b.select(live, b.fadd(total, partial, flags=CONTRACT), total)
        shifted = b.lshr(rest, ir.Constant(I64, 1))
        level.add_incoming(b.add(level, ir.Constant(I64, 1), flags=("nuw", "nsw")), b.block)
        rest.add_incoming(shifted, b.block)
        total.add_incoming(added, b.block)
        b.cbranch(b.icmp_unsigned("==", shifted, ir.Constant(I64, 0)), end, loop)
        b.position_at_end(end)
        return added

    def accumulate_rows(self, reduce_node: KNode) -> bool:
        """Loop order for a reduce whose axes are not the innermost ones: accumulate into output
        rows when some input walks the innermost kept axis contiguously, unless an input walks the
        innermost reduced axis contiguously instead (then a per-element inner reduction reads it
        in order, like a matrix-vector product over a transposed weight)."""
        last = len(self.shape) - 1
        if self.reduce_axes[-1] == last or reduce_node.dtype is not self.ast.out_dtype or reduce_node.dtype.is_narrow_float:
            return False  # (a float16 output row would round the running sum at every step)
        reduce_inner = self.reduce_axes[-1]
        along_kept = along_reduce = False
        for node in reduce_node.srcs[0].walk():
            if node.op == "load":
                view = self.trackers[id(node)].views[-1]
                along_kept |= view.strides[last] == 1 and view.shape[last] > 1
                along_reduce |= view.strides[reduce_inner] == 1 and view.shape[reduce_inner] > 1
        return along_kept or not along_reduce

    def accumulate_in_output(self, reduce_node: KNode, outer: list[int], store: Callable[..., None],
                             full_index: Callable[[dict[int, ir.Value]], list[ir.Value]], out_type: ir.Type) -> None:
        """Reduce axes that lie before the innermost kept axes: loop the reduction outside those
        axes and accumulate into the output row, so the inner loop walks memory contiguously
        (and vectorises) instead of striding down columns."""
        last_reduce = self.reduce_axes[-1]
        before = [a for a in outer if a < last_reduce]
        inner = [a for a in outer if a > last_reduce]
        out_strides = _contiguous([1 if a in self.reduce_axes else s for a, s in enumerate(self.shape)])

        def out_pointer(idx: dict[int, ir.Value]) -> ir.Value:
            flat: ir.Value = ir.Constant(I64, 0)
            for axis in outer:
                if self.shape[axis] != 1:
                    term = self.b.mul(idx[axis], ir.Constant(I64, out_strides[axis]), flags=("nsw",))
                    flat = self.b.add(flat, term, flags=("nsw",))
            return self.b.gep(self.out, [flat], inbounds=True, source_etype=out_type)

        def accumulated(idx: dict[int, ir.Value]) -> ir.Value:
            return from_memory(self.b, self.b.load(out_pointer(idx), typ=out_type), reduce_node.dtype)

        def per_row(idx: dict[int, ir.Value]) -> None:
            self.loops(inner, lambda i: store(identity(reduce_node.arg, reduce_node.dtype), {**idx, **i}), "z")

            def step(ridx: dict[int, ir.Value]) -> None:
                def lane(i: dict[int, ir.Value]) -> None:
                    where = {**idx, **ridx, **i}
                    value = self.evaluate(reduce_node.srcs[0], full_index(where), {})
                    store(combine(self, reduce_node.arg, reduce_node.dtype, accumulated({**idx, **i}), value), {**idx, **i})
                self.loops(inner, lane, "c")
            self.loops(list(self.reduce_axes), step, "r")
            if self.ast.root is not reduce_node:  # elementwise ops on the result, in a last pass
                self.loops(inner, lambda i: store(self.evaluate(self.ast.root, full_index({**idx, **i}), {},
                                                                reduced=accumulated({**idx, **i})), {**idx, **i}), "p")
        self.loops(before, per_row, "o")

    def vector_width(self) -> int | None:
        """Lanes for an explicit vector loop, or None when the kernel is not 1-D contiguous."""
        if len(self.shape) != 1:
            return None
        nodes = self.ast.root.walk()
        for node in nodes:
            if node.op == "load":
                tracker = self.trackers[id(node)]
                if len(tracker.views) != 1 or tracker.views[0].mask is not None or tracker.views[0].strides[0] not in (0, 1):
                    return None
        widest = max(node.dtype.itemsize for node in nodes)
        width = VECTOR_BYTES // max(widest, self.ast.out_dtype.itemsize)
        return width if self.shape[0] >= width else None

    def vector_loops(self, width: int, out_type: ir.Type) -> None:
        n = self.shape[0]
        vectors, tail = divmod(n, width)
        itemsize = self.ast.out_dtype.itemsize
        # Outputs start 64-byte aligned (allocator alignment, 256-byte arena blocks, SliceCall
        # ranges on whole vectors), so every vector store is aligned to its own size — which
        # streaming stores require.
        streaming = (self.ast.stream_stores or n * itemsize >= STREAMING_STORE_BYTES) and not self.ast.aliased_slots

        def store(value: ir.Value, flat: ir.Value, aligned: bool) -> None:
            value = to_memory(self.b, value, self.ast.out_dtype)
            for out in self.outs:
                pointer = self.b.gep(out, [flat], inbounds=True, source_etype=out_type)
                stored = self.b.store(value, pointer, align=width * itemsize if aligned else itemsize)
                if streaming and aligned:
                    stored.set_metadata("nontemporal", self.module.add_metadata([ir.Constant(I32, 1)]))

        def vector_body(k: ir.Value) -> None:
            first = self.b.mul(k, ir.Constant(I64, width), flags=("nuw", "nsw"))
            self.width = width
            value = self.evaluate(self.ast.root, [first], {})
            self.width = None
            store(value, first, aligned=True)

        def tail_body(i: ir.Value) -> None:
            index = self.b.add(i, ir.Constant(I64, vectors * width), flags=("nuw", "nsw"))
            store(self.evaluate(self.ast.root, [index], {}), index, aligned=False)

        self.loop(vectors, vector_body, "v")
        if tail:
            self.loop(tail, tail_body, "t")
        if streaming:  # streaming stores are weakly ordered: fence before the queue signals completion
            self.b.fence("seq_cst")


def _contiguous(shape: list[int]) -> list[int]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return list(reversed(strides))


def _is_zero(value: ir.Value) -> bool:
    return isinstance(value, ir.Constant) and value.constant == 0


class _HasEntryBlock(Protocol):
    """What _entry_alloca needs of a lowerer: its builder and its function's entry block."""

    b: ir.IRBuilder
    entry: ir.Block


def _entry_alloca(lowerer: _HasEntryBlock, t: ir.Type) -> ir.Value:
    """A stack slot in the entry block, where LLVM's mem2reg turns it into a register."""
    with lowerer.b.goto_block(lowerer.entry):  # restores the builder's position on exit
        lowerer.b.position_at_start(lowerer.entry)
        return lowerer.b.alloca(t)


def lower(ast: KernelAST, publish_progress: bool = True, name: str | None = None) -> tuple[str, str]:
    """(entry name, LLVM IR text). The name is `name`, or a hash of the IR, so equal kernels share code.
    `publish_progress=False` leaves out the progress word (`tinydist.codegen.progress`): for a
    program shipped to a remote node, whose verifier admits no writable global or atomic."""
    lowerer = _Lowerer(ast) if publish_progress else _SilentLowerer(ast)
    text = lowerer.build()
    name = name or "k_" + hashlib.sha256(text.encode()).hexdigest()[:20]
    return name, text.replace('@"KERNEL', f'@"{name}').replace("@KERNEL", f"@{name}")


class _SilentLowerer(_Lowerer):
    publishes_progress = False
