"""LLVM IR for a batched, row-major matrix multiply: C_b = A_b @ B_b, GotoBLAS/BLIS style.

The generated entry point is

    void @<name>(ptr noalias C, ptr noalias A, ptr noalias B, ptr noalias W,
                 i64 batch, i64 M, i64 N, i64 K, i64 strideA, i64 strideB, i64 strideC)

where X_b starts at X + b*strideX elements (stride 0 broadcasts an operand) and W is a 64-byte
aligned workspace of ``workspace_bytes(M, N, K, dtype)`` bytes.

This module is the driver: the loop nest below and the small-M path. Its parts each have their
own: the tile and block sizes and the memory they imply (`matmul_tiling`), the micro-kernel
(`matmul_microkernel`), packing (`matmul_packing`), and the LLVM module they all emit into
(`matmul_emit`).

Blocking (the five loops around the micro-kernel, outermost first):

    jc: NC columns of B and C
    pc: KC of the reduction          B[pc:pc+KC, jc:jc+NC] is packed into NR-wide micro-panels
    ic: MC rows of A and C           A[ic:ic+MC, pc:pc+KC] is packed into MR-tall micro-panels
    jr: NR columns                   one KC×NR micro-panel of B is reused by ...
    ir: MR rows                      ... every MR×KC micro-panel of A in the MC block

The micro-kernel keeps an MR×NR tile of C in vector registers for the whole KC loop: per step of
k it loads NR/V vectors of packed B, broadcasts MR scalars of A and issues MR*NR/V fused
multiply-adds (on AVX-512: 2 aligned vmovaps, 8 vbroadcastss and 16 vfmadd231ps zmm, nothing
spilled). Packing pads partial micro-panels of B with zeros. An edge tile is computed in place,
not in a buffer: its rows by the kernels for MR and the powers of two below it (rows 7 = 4 + 2 +
1), its columns under a mask (masked loads and stores of C only there, plain ones for a full
tile), so there is no scalar tail and nothing past C's last column is touched.

Where packing does not pay, an operand is read where it lies:
- B, when M <= MR (one row of tiles: each B element is used once, so packing it doubled the
  memory traffic; at M = 1 it was the whole cost). B is swept a few rows at a time across N
  (row streams in order) under the column mask; tiles of 1-2 rows span several NR panels, so
  8 FMA chains are in flight, not 2.
- B, when it is a weight: `pack_b_ir` / `pack_b_array` pack it once (at load), and the kernel of
  `matmul_ir(prepacked="b")` reads that layout with no B packing and no B workspace.
- A, when it is a weight (a convolution's, times its gathered columns): `pack_a_array` packs it
  once into MR-tall micro-panels the length of K, and `matmul_ir(prepacked="a")` reads its MC×KC
  blocks there (any KC and MC: panel p is at p·MR·K), with no A packing and no A workspace.

A strided operand (`StridedOperand`, for a batch of one): A or B is not a contiguous matrix but a
view of another buffer, e.g. a convolution's im2col columns over its padded input. Its packing
gathers straight from that view, through tables of row and column offsets the driver fills in
the workspace first, so the (often large) matrix is never written out and read back. The kernel
is compiled for the view's form (`StridedForm`: the operand, the vector width of its pieces, the
axis counts); the view's offset, sizes and strides are trailing arguments (`signature`), so one
kernel serves every view of its form.

Numerics: no fast-math flags are used; the multiply-adds are explicit ``llvm.fma`` calls (what
``contract`` would produce: one rounding per multiply-add). The reduction order is *not* changed:
the tile is reloaded from C at the start of every KC block (and of every sweep of the small-M
path) and each element accumulates k = 0, 1, ..., K-1 in sequence, whichever path, packed or in
place, prepacked or not, computes it, so C[i, j] is exactly the FMA chain
fma(a[i,K-1], b[K-1,j], ... fma(a[i,0], b[0,j], 0)) — bitwise what a naive k loop using fma
gives, whatever the tile sizes. numpy/OpenBLAS sum K in a different order, so the two agree to
ordinary rounding error (worst case O(K·eps) relative), not bitwise.
"""


from __future__ import annotations

from collections.abc import Callable

import llvmlite.ir as ir

from tinydist.codegen import progress
from tinydist.codegen.matmul_emit import I32, I64, PTR, Builder, MatmulModule, define, i64
from tinydist.codegen.matmul_microkernel import micro_kernel
from tinydist.codegen.matmul_packing import offset_table, pack_a, pack_a_gathered, pack_b, pack_b_gathered, packed_block
from tinydist.codegen.matmul_tiling import (ALIGN, DEFAULT_TILINGS, StridedForm, StridedOperand, Tiling, itemsize,
                                            tiling_for)

SIGNATURE = ("w", "r", "r", "w", "i64", "i64", "i64", "i64", "i64", "i64", "i64")


def signature(strided: StridedForm | None = None) -> tuple[str, ...]:
    """The kernel's signature: SIGNATURE, then a strided operand's view (`StridedOperand.arguments`)."""
    return SIGNATURE + ("i64",) * (strided.arguments if strided is not None else 0)

_SWEEP_BYTES = 128 << 10   # B bytes one small-M sweep spans (see small_loops)


class _Driver:
    """The loop nest around the micro-kernel: the batch, jc, pc and ic loops with their packing
    calls, then the jr/ir loops over packed blocks or the small-M sweeps over B in place."""

    def __init__(self, name: str, dtype: str, tiling: Tiling, strided: StridedForm | None,
                 publish_progress: bool = True, prepacked: str | None = None) -> None:
        if prepacked not in (None, "a", "b"):
            raise ValueError(f"prepacked names the operand packed at load, 'a' or 'b' (or None), got {prepacked!r}")
        if prepacked is not None and strided is not None and strided.operand == prepacked:
            raise ValueError(f"a prepacked {prepacked.upper()} cannot also be read through a strided view")
        self.publish_progress = publish_progress
        self.prepacked = prepacked
        self.m = m = MatmulModule(name, dtype, tiling, strided)
        self.t, self.elem, self.itemsize, self.lanes = m.t, m.elem, m.itemsize, m.lanes
        self.strided, self.module, self.name = m.strided, m.module, m.name

    def generate(self) -> str:
        kernels = {rows: micro_kernel(self.m, rows) for rows in self.row_parts}
        # M <= MR: one panel of A, so each element of B is used once per call. B is read in place
        # unless it is prepacked or gathered (a strided view); a tile of few rows spans several
        # panels of B.
        read_b_in_place = self.prepacked != "b" and not (self.strided is not None and self.strided.operand == "b")
        small = {rows: kernel if self.panels_for(rows) == 1 and not read_b_in_place
                 else micro_kernel(self.m, rows, self.panels_for(rows), read_b_in_place)
                 for rows, kernel in kernels.items()}
        gathered = self.strided.operand if self.strided is not None else None
        packs_a = pack_a_gathered(self.m) if gathered == "a" else pack_a(self.m)
        packs_b = ({chunk: pack_b_gathered(self.m, chunk) for chunk in self.b_chunks} if gathered == "b"
                   else pack_b(self.m))
        self.driver(kernels, small, read_b_in_place, packs_a, packs_b)
        return str(self.module)

    @property
    def row_parts(self) -> list[int]:
        """The row counts micro-kernels are generated for: MR, and the powers of two below it,
        whose sums make every edge tile (at most log2(MR) calls, each a vector kernel). A kernel
        for every count 1..MR (twice: packed and small-M) compiled the float32 module in 1.9-2.0 s
        where the kernel before this change took 0.8-0.9 s; with the parts (and A's strides
        constant) 0.45-0.53 s against 0.28-0.29 s (each pair in one loaded minute)."""
        return [self.t.mr] + [1 << e for e in reversed(range(self.t.mr.bit_length())) if 1 << e < self.t.mr]

    @property
    def b_chunks(self) -> list[int]:
        """The piece widths a gathered B is packed in: every power of two up to NR (a view's is
        the largest dividing its run, `StridedForm`)."""
        return [1 << e for e in range(self.t.nr.bit_length()) if 1 << e <= self.t.nr]

    def by_chunk(self, b: Builder, chunk: ir.Value, packs: dict[int, ir.Function], args: list[ir.Value]) -> None:
        """Call the packing for `chunk` (one of `b_chunks`; any other value: the one for 1)."""
        done = b.append_basic_block("chunk.done")
        blocks = {size: b.append_basic_block(f"chunk{size}") for size in packs}
        switch = b.switch(chunk, blocks[1])
        for size, block in blocks.items():
            if size != 1:
                switch.add_case(i64(size), block)
            b.position_at_end(block)
            b.call(packs[size], args)
            b.branch(done)
        b.position_at_end(done)

    def by_row_parts(self, b: Builder, rows: ir.Value, emit: Callable[[int, ir.Value], None]) -> None:
        """emit(size, first_row) for the parts of a tile of `rows` (1..MR) rows: all MR at once,
        or one part per set bit of rows (4, 2, 1 ...), each starting below the bigger ones."""
        with b.if_else(b.icmp_signed("==", rows, i64(self.t.mr)), likely=True) as (full, partial):
            with full:
                emit(self.t.mr, i64(0))
            with partial:
                for size in self.row_parts[1:]:
                    with b.if_then(b.icmp_unsigned("!=", b.and_(rows, i64(size)), i64(0))):
                        emit(size, b.and_(rows, i64(~(2 * size - 1))))

    def panels_for(self, rows: int) -> int:
        """Micro-panels of B side by side in a small-M tile of `rows` rows: enough for ~8 independent
        accumulators (the FMA latency times the FMA ports of znver4/5 is 8 in flight)."""
        return max(1, 8 // (rows * (self.t.nr // self.lanes)))

    def driver(self, kernels: dict[int, ir.Function], small: dict[int, ir.Function], read_b_in_place: bool,
               pack_a: ir.Function, pack_b: ir.Function | dict[int, ir.Function]) -> None:
        t = self.t
        strided = self.strided
        view = [] if strided is None else [("view_run", I64), ("view_offset", I64)] + [
            (f"{side}{d}_{what}", I64) for side, count in (("row", strided.rows), ("col", strided.cols))
            for d in range(count) for what in ("size", "stride")]
        fn, b = define(self.module, self.name,
                        [("C", PTR), ("A", PTR), ("B", PTR), ("W", PTR), ("batch", I64), ("M", I64),
                         ("N", I64), ("K", I64), ("strideA", I64), ("strideB", I64), ("strideC", I64), *view],
                        internal=False)
        C, A, B, W, batch, M, N, K, stride_a, stride_b, stride_c = fn.args[:len(SIGNATURE)]

        # The layout workspace_bytes describes, evaluated at run time.
        def round_up(value: ir.Value, multiple: int) -> ir.Value:
            return b.mul(b.sdiv(b.add(value, i64(multiple - 1)), i64(multiple)), i64(multiple))
        kc_max = b.min(K, i64(t.kc))
        nc_max = b.min(round_up(N, t.nr), i64(t.nc))
        mc_max = b.min(round_up(M, t.mr), i64(t.mc))
        a_offset = i64(0) if self.prepacked == "b" else round_up(b.mul(b.mul(kc_max, nc_max), i64(self.itemsize)), ALIGN)
        a_bytes = i64(0) if self.prepacked == "a" else round_up(b.mul(b.mul(mc_max, kc_max), i64(self.itemsize)), ALIGN)
        tables_offset = b.add(a_offset, a_bytes)
        b_packed, a_packed = W, b.at(W, a_offset, ir.IntType(8))
        if strided is not None:
            view_run, view_offset, *axes = fn.args[len(SIGNATURE):]
            # B's pieces: the largest power of two dividing the run, at most NR (run & -run: its lowest set bit)
            b_chunk = b.min(b.and_(view_run, b.sub(i64(0), view_run)), i64(t.nr))
            pairs = list(zip(axes[0::2], axes[1::2]))
            rows_axes, cols_axes = pairs[:strided.rows], pairs[strided.rows:]
            row_entries: ir.Value = i64(1)
            for size, _ in rows_axes:
                row_entries = b.mul(row_entries, size)
            row_table = b.at(W, tables_offset, ir.IntType(8))
            col_table = b.at(row_table, row_entries, I32)
            offset_table(self.m, b, row_table, rows_axes, view_offset)
            offset_table(self.m, b, col_table, cols_axes, i64(0))
        is_small = b.icmp_signed("<=", M, i64(t.mr))
        pack_b_now = b.not_(is_small) if read_b_in_place else ir.Constant(ir.IntType(1), 1)

        published = progress.word(self.module, self.name) if self.publish_progress else None
        with b.loop(i64(0), batch, 1, "batch") as item:
            a_item = b.at(A, b.mul(item, stride_a), self.elem)
            b_item = b.at(B, b.mul(item, stride_b), self.elem)
            c_item = b.at(C, b.mul(item, stride_c), self.elem)
            with b.loop(i64(0), N, t.nc, "jc") as jc:
                nc = b.min(b.sub(N, jc), i64(t.nc))
                with b.loop(i64(0), K, t.kc, "pc") as pc:
                    kc = b.min(b.sub(K, pc), i64(t.kc))
                    accumulate = b.icmp_signed(">", pc, i64(0))
                    b_block = b.at(b_item, b.add(b.mul(pc, N), jc), self.elem)
                    if self.prepacked == "b":
                        b_source = packed_block(self.m, b, b_item, jc, pc, nc, K)
                    else:
                        with b.if_then(pack_b_now):
                            if isinstance(pack_b, dict):   # a gathered B
                                self.by_chunk(b, b_chunk, pack_b,
                                              [b_packed, b_item, b.at(row_table, pc, I32), b.at(col_table, jc, I32), kc, nc])
                            else:
                                b.call(pack_b, [b_packed, b_block, N, kc, nc])
                        b_source = b_packed
                    with b.loop(i64(0), M, t.mc, "ic") as ic:
                        if published is not None:  # per MC x KC x NC block: at most 2.7e8 flops (float32 tiling)
                            progress.bump(b, published)
                        mc = b.min(b.sub(M, ic), i64(t.mc))
                        if self.prepacked == "a":   # panel p (rows p·MR…) at p·MR·K, its column pc at pc·MR
                            a_block = b.at(a_item, b.add(b.mul(ic, K), b.mul(pc, i64(t.mr))), self.elem)
                        else:
                            if strided is not None and strided.operand == "a":
                                b.call(pack_a, [a_packed, a_item, b.at(row_table, ic, I32), b.at(col_table, pc, I32), mc, kc])
                            else:
                                b.call(pack_a, [a_packed, b.at(a_item, b.add(b.mul(ic, K), pc), self.elem), K, mc, kc])
                            a_block = a_packed
                        # elements from one micro-panel of A to the next, per row: kc packed per call, K prepacked
                        a_panel_rows = K if self.prepacked == "a" else kc
                        with b.if_else(is_small) as (then, otherwise):
                            with then:
                                self.small_loops(b, small, read_b_in_place, M, kc, nc, a_block,
                                                 b_block if read_b_in_place else b_source, c_item, jc, N, accumulate)
                            with otherwise:
                                self.panel_loops(b, kernels, kc, nc, mc, a_block, a_panel_rows, b_source, c_item, ic, jc,
                                                 N, accumulate)
        b.ret_void()

    def small_loops(self, b: Builder, kernels: dict[int, ir.Function], in_place: bool, M: ir.Value, kc: ir.Value,
                    nc: ir.Value, a_packed: ir.Value, b_source: ir.Value, c_item: ir.Value, jc: ir.Value, N: ir.Value,
                    accumulate: ir.Value) -> None:
        """M <= MR: one row of tiles per part of M's rows (`by_row_parts`), each `panels_for`
        micro-panels wide, over the KC×NC block of B — read in place (b_source is B at row pc,
        column jc) or packed (b_source is the packed block). In place, B is swept DIRECT_KC rows at
        a time across all of nc: DIRECT_KC row streams, each in order, rather than one
        micro-panel's columns down all kc rows (a new 4 KiB page every row). The rows per sweep
        shrink as nc grows, so one sweep spans about _SWEEP_BYTES of B: at M = 8, K = N = 1536
        16 rows ran 21 GFLOP/s where 64 ran 8, at 4096 18 where 64 ran 7 (median of 9, loaded
        machine; numpy 9 and 15 alongside)."""
        t = self.t
        rows_per_sweep = b.select(b.icmp_signed("<", b.mul(nc, i64(self.itemsize * t.direct_kc)), i64(_SWEEP_BYTES)),
                                  i64(t.direct_kc), b.sdiv(i64(_SWEEP_BYTES), b.mul(nc, i64(self.itemsize))))
        dkc = b.select(b.icmp_signed("<", rows_per_sweep, i64(4)), b.min(i64(4), i64(t.direct_kc)), rows_per_sweep)

        def sweep(rows: int, first: ir.Value) -> None:
            kernel, width = kernels[rows], self.panels_for(rows) * t.nr
            a_rows, c_rows = b.at(a_packed, first, self.elem), b.at(c_item, b.add(b.mul(first, N), jc), self.elem)
            if in_place:
                with b.loop(i64(0), kc, dkc, "kd") as kd:
                    with b.loop(i64(0), nc, width, "jr") as jr:
                        b.call(kernel, [b.min(b.sub(kc, kd), dkc), b.at(a_rows, b.mul(kd, i64(t.mr)), self.elem),
                                        b.at(b_source, b.add(b.mul(kd, N), jr), self.elem), N, i64(t.nr),
                                        b.at(c_rows, jr, self.elem), N,
                                        b.or_(accumulate, b.icmp_signed(">", kd, i64(0))), b.min(b.sub(nc, jr), i64(width)),
                                        ir.Constant(PTR, None), i64(0)])
            else:
                with b.loop(i64(0), nc, width, "jr") as jr:
                    b.call(kernel, [kc, a_rows, b.at(b_source, b.mul(jr, kc), self.elem), i64(t.nr), b.mul(kc, i64(t.nr)),
                                    b.at(c_rows, jr, self.elem), N, accumulate, b.min(b.sub(nc, jr), i64(width)),
                                    b.gep(b_source, [b.mul(b.add(jr, i64(width)), kc)], source_etype=self.elem),
                                    i64(t.nr * self.itemsize)])   # (past the block after its last panel: a hint)
        self.by_row_parts(b, M, sweep)

    def panel_loops(self, b: Builder, kernels: dict[int, ir.Function], kc: ir.Value, nc: ir.Value, mc: ir.Value,
                    a_packed: ir.Value, a_panel_rows: ir.Value, b_packed: ir.Value, c_item: ir.Value, ic: ir.Value,
                    jc: ir.Value, N: ir.Value, accumulate: ir.Value) -> None:
        """The jr and ir loops over one packed MC×KC block of A (micro-panel r/MR at
        r·a_panel_rows) and KC×NC block of B."""
        t = self.t
        # The ir loop's calls, between them, prefetch the micro-panel of B the next jr step reads
        # (the block's first after its last: the next MC block starts there) into L2, each its
        # share: `step` bytes per step of k.
        tiles = b.sdiv(b.add(mc, i64(t.mr - 1)), i64(t.mr))
        step = b.sdiv(b.add(i64(t.nr * self.itemsize), b.sub(tiles, i64(1))), tiles)
        with b.loop(i64(0), nc, t.nr, "jr") as jr:
            cols = b.min(b.sub(nc, jr), i64(t.nr))
            b_panel = b.at(b_packed, b.mul(jr, kc), self.elem)
            following = b.add(jr, i64(t.nr))
            next_panel = b.at(b_packed, b.mul(b.select(b.icmp_signed("<", following, nc), following, i64(0)), kc), self.elem)
            with b.loop(i64(0), mc, t.mr, "ir") as ir_:
                rows = b.min(b.sub(mc, ir_), i64(t.mr))
                c_tile = b.at(c_item, b.add(b.mul(b.add(ic, ir_), N), b.add(jc, jr)), self.elem)
                share = b.gep(next_panel, [b.mul(b.sdiv(ir_, i64(t.mr)), b.mul(kc, step))], source_etype=ir.IntType(8))
                self.call_tile(b, rows, kernels, [kc, b.at(a_packed, b.mul(ir_, a_panel_rows), self.elem),
                                                  b_panel, i64(t.nr), b.mul(kc, i64(t.nr)), c_tile, N, accumulate, cols,
                                                  share, step])

    def call_tile(self, b: Builder, rows: ir.Value, kernels: dict[int, ir.Function], args: list[ir.Value]) -> None:
        """The micro-kernel call(s) for a tile of `rows` rows, `args` as for a full one: an edge
        tile's rows go through the kernels of their parts, not a full tile into a buffer."""
        kc, a_panel, b_panel, ldb, pstride, c_tile, ldc, accumulate, cols, next_b, next_step = args

        def part(size: int, first: ir.Value) -> None:
            b.call(kernels[size], [kc, b.at(a_panel, first, self.elem), b_panel, ldb, pstride,
                                   b.at(c_tile, b.mul(first, ldc), self.elem), ldc, accumulate, cols, next_b, next_step])
        self.by_row_parts(b, rows, part)



def strided_form(dtype: str, strided: StridedOperand | StridedForm | None, tiling: Tiling | None = None) -> StridedForm | None:
    """The form a strided operand's kernel is compiled for under `tiling` (`tiling_for`'s choice for that view)."""
    if isinstance(strided, StridedOperand):
        return strided.form(tiling or tiling_for(dtype, strided))
    return strided


def program_name(dtype: str, strided: StridedOperand | StridedForm | None = None, prepacked: str | None = None) -> str:
    """The matmul kernel's name: one per dtype and operand packed at load, and one per form of view
    a strided operand is read through (with its blocking where that is not the dtype's default)."""
    name = f"tinydist_matmul_{dtype}" + {None: "", "b": "_prepacked", "a": "_prepacked_a"}[prepacked]
    form = strided_form(dtype, strided)
    if form is not None:
        name += f"_strided_{form.operand}{form.chunk or ''}_{form.rows}x{form.cols}"
        t = form.tiling
        if t is not None and t != DEFAULT_TILINGS[dtype]:
            name += f"_t{t.mr}x{t.nr}k{t.kc}m{t.mc}n{t.nc}d{t.direct_kc}"
    return name


def matmul_ir(name: str, dtype: str = "float32", tiling: Tiling | None = None,
              strided: StridedOperand | StridedForm | None = None, publish_progress: bool = True,
              prepacked: str | None = None) -> str:
    """LLVM IR text defining ``void @<name>(C, A, B, W, batch, M, N, K, strideA, strideB, strideC)``;
    with `strided` (a view, or the form of one), that operand is read through a view passed after
    those (`signature`, `StridedOperand.arguments`; M, N, K must match the view's sizes);
    with `prepacked="b"`, B is the output of `pack_b_ir` (strideB counts its elements, a multiple of
    `packed_b_elements` keeps every item 64-byte aligned) and is not packed again; with
    `prepacked="a"`, A is `pack_a_array`'s (strideA: a multiple of `packed_a_elements`).
    `publish_progress=False` leaves out the progress word (a program for a remote node)."""
    itemsize(dtype)
    form_tiling = strided.tiling if isinstance(strided, StridedForm) else None
    if tiling is not None and form_tiling is not None and tiling != form_tiling:
        raise ValueError(f"tiling {tiling} differs from the one the strided form was made for ({form_tiling})")
    t = tiling or form_tiling or tiling_for(dtype, strided if isinstance(strided, StridedOperand) else None)
    return _Driver(name, dtype, t, strided_form(dtype, strided, t), publish_progress, prepacked).generate()

