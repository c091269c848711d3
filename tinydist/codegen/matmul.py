"""LLVM IR for a batched, row-major matrix multiply: C_b = A_b @ B_b, GotoBLAS/BLIS style.

The generated entry point is

    void @<name>(ptr noalias C, ptr noalias A, ptr noalias B, ptr noalias W,
                 i64 batch, i64 M, i64 N, i64 K, i64 strideA, i64 strideB, i64 strideC)

where X_b starts at X + b*strideX elements (stride 0 broadcasts an operand) and W is a 64-byte
aligned workspace of ``workspace_bytes(M, N, K, dtype)`` bytes.

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
  `matmul_ir(prepacked=True)` reads that layout with no B packing and no B workspace.

A strided operand (`StridedOperand`, for a batch of one): A or B is not a contiguous matrix but a
view of another buffer, e.g. a convolution's im2col columns over its padded input. Its packing
gathers straight from that view, through tables of row and column offsets the driver fills in
the workspace first, so the (often large) matrix is never written out and read back.

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

import hashlib
import math
from contextlib import ExitStack, contextmanager
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import llvmlite.ir as ir
import numpy as np

from tinydist.codegen import progress

SIGNATURE = ("w", "r", "r", "w", "i64", "i64", "i64", "i64", "i64", "i64", "i64")
PACK_B_SIGNATURE = ("w", "r", "i64", "i64")

_VECTOR_BYTES = 64   # one zmm register: AVX-512 is the target (znver4 has 32 of them)
_SWEEP_BYTES = 128 << 10   # B bytes one small-M sweep spans (see small_loops)
_ALIGN = 64          # workspace regions start on cache lines, so packed-B vector loads are aligned


@dataclass(frozen=True)
class Tiling:
    """Micro-tile MR×NR (NR a multiple of the vector width) and the cache blocks KC, MC, NC; a
    small-M product reading B in place sweeps it at most direct_kc rows at a time (see small_loops)."""

    mr: int
    nr: int
    kc: int
    mc: int
    nc: int
    direct_kc: int = 64

    def __post_init__(self) -> None:
        if self.mc % self.mr or self.nc % self.nr:
            raise ValueError(f"MC must be a multiple of MR and NC of NR: {self}")


Axes = tuple[tuple[int, int], ...]   # (size, stride) per axis, outermost first


@dataclass(frozen=True)
class StridedOperand:
    """Operand `operand` ("a" or "b") of a batch-of-one matmul read through a strided view: its
    element (r, c) is at `offset + Σ r_i·stride_i + Σ c_j·stride_j` elements of the buffer passed
    for it, r decomposed over the `rows` axes and c over the `cols` axes. Offsets must fit in int32."""

    operand: str
    rows: Axes
    cols: Axes
    offset: int

    def __post_init__(self) -> None:
        if self.operand not in ("a", "b"):
            raise ValueError(f"operand must be 'a' or 'b', got {self.operand!r}")

    @property
    def run(self) -> int:
        """How many consecutive columns are consecutive in memory (from column 0 of every row)."""
        run = 1
        for size, stride in reversed(self.cols):
            if stride != run:
                break
            run *= size
        return run

    @property
    def table_entries(self) -> int:
        return math.prod(size for size, _ in self.rows) + math.prod(size for size, _ in self.cols)


_DTYPES: dict[str, tuple[ir.Type, int]] = {"float32": (ir.FloatType(), 4), "float64": (ir.DoubleType(), 8)}

# MR=8 rows × NR/V=2 vectors = 16 zmm accumulators leave room for the two B vectors and the
# broadcasts. At 1024³ 6×32 and 8×32 run alike (~110 GFLOP/s; 12×32 no faster), but 8 divides the
# channel counts convolutions have (16, 32, 3·3·16 = 144) where 6 leaves a partial edge tile (computed
# whole into a buffer, then copied) every sixth row: the CNN's 32-channel conv forward (M=32,
# N=16384, K=144) took 1.9-2.0 ms with MR=6, 1.7-1.8 ms with MR=8. The MR×KC micro-panel of A
# (32 KiB) is re-read from L1/L2 for the whole call while the KC×NR micro-panel of B (128 KiB) and
# the MC×KC block of A (256 KiB) share the L2; a long KC also means the C tile is loaded and stored
# only once per K/KC. The KC×NC panel of B (8 MiB at most) lives in L3, and is streamed once per MC
# block: MC=64 makes a transformer's 64-row products one block (M=64, K=N=4096, B prepacked:
# 96-131 GFLOP/s median with MC=48, 121-165 with 64; 1024³ and M=512 alike either way).
# KC chosen by measurement on znver4 at 1024³ float32: KC=128..256 gave 87-94 GFLOP/s, KC=1024
# 105-110 (with MR=8 on the CNN's conv matmuls KC=768 measured the same as 1024).
DEFAULT_TILINGS: dict[str, Tiling] = {
    "float32": Tiling(mr=8, nr=32, kc=1024, mc=64, nc=2048),
    "float64": Tiling(mr=6, nr=16, kc=512, mc=48, nc=2048),
}


def _dtype(dtype: str) -> tuple[ir.Type, int]:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"matmul supports {', '.join(_DTYPES)}, got {dtype!r}") from None


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def workspace_bytes(M: int, N: int, K: int, dtype: str = "float32", tiling: Tiling | None = None,
                    strided: StridedOperand | None = None, prepacked: bool = False) -> int:
    """Bytes of workspace the kernel for (M, N, K) needs.

    Layout (mirrored in the generated driver): the packed KC×NC block of B at offset 0 (none for
    a prepacked B), the packed MC×KC block of A, then a strided operand's offset tables (int32,
    rows then columns); each region starts on a 64-byte boundary. Blocks shrink to the problem,
    so small problems need little.
    """
    tables = 4 * strided.table_entries if strided is not None else 0
    _, itemsize = _dtype(dtype)
    t = tiling or DEFAULT_TILINGS[dtype]
    kc, nc, mc = min(K, t.kc), min(_round_up(N, t.nr), t.nc), min(_round_up(M, t.mr), t.mc)
    regions = (0 if prepacked else kc * nc * itemsize, mc * kc * itemsize)
    return sum(_round_up(size, _ALIGN) for size in regions) + tables


def packed_b_elements(K: int, N: int, dtype: str = "float32", tiling: Tiling | None = None) -> int:
    """Elements of a prepacked K×N operand B (`pack_b_ir`): its columns rounded up to NR."""
    _dtype(dtype)
    return K * _round_up(N, (tiling or DEFAULT_TILINGS[dtype]).nr)


I32, I64 = ir.IntType(32), ir.IntType(64)
PTR = ir.PointerType()


def _i64(value: int) -> ir.Constant:
    return ir.Constant(I64, value)


class _Builder(ir.IRBuilder):
    """IRBuilder plus the few structured helpers the generator needs."""

    @contextmanager
    def loop(self, start: ir.Value, stop: ir.Value, step: int | ir.Value, name: str) -> Iterator[ir.Value]:
        """``for i in range(start, stop, step)`` (step > 0); the body is emitted inside the block."""
        preheader = self.block
        header = self.append_basic_block(f"{name}.header")
        body = self.append_basic_block(f"{name}.body")
        exit_ = self.append_basic_block(f"{name}.exit")
        self.branch(header)
        self.position_at_end(header)
        index = self.phi(I64, name=name)
        index.add_incoming(start, preheader)
        self.cbranch(self.icmp_signed("<", index, stop), body, exit_)
        self.position_at_end(body)
        yield index
        index.add_incoming(self.add(index, _i64(step) if isinstance(step, int) else step, name=f"{name}.next"), self.block)
        self.branch(header)
        self.position_at_end(exit_)

    def min(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.select(self.icmp_signed("<", a, b), a, b)

    def at(self, base: ir.Value, offset: ir.Value, elem: ir.Type) -> ir.Value:
        """Address of base[offset] for elements of type elem."""
        return self.gep(base, [offset], inbounds=True, source_etype=elem)


def _define(module: ir.Module, name: str, args: list[tuple[str, ir.Type]], internal: bool = True
            ) -> tuple[ir.Function, _Builder]:
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [ty for _, ty in args]), name)
    if internal:
        fn.linkage = "internal"
    for arg, (arg_name, ty) in zip(fn.args, args):
        arg.name = arg_name
        if ty == PTR:
            arg.add_attribute("noalias")
    fn.attributes.add("nounwind")
    return fn, _Builder(fn.append_basic_block("entry"))


class _Generator:
    def __init__(self, name: str, dtype: str, tiling: Tiling, strided: StridedOperand | None,
                 publish_progress: bool = True, prepacked: bool = False) -> None:
        if prepacked and strided is not None and strided.operand == "b":
            raise ValueError("a prepacked B cannot also be read through a strided view")
        self.publish_progress = publish_progress
        self.prepacked = prepacked
        self.elem, self.itemsize = _dtype(dtype)
        self.t = tiling
        self.strided = strided
        self.lanes = _VECTOR_BYTES // self.itemsize
        if tiling.nr % self.lanes:
            raise ValueError(f"NR={tiling.nr} must be a multiple of the vector width {self.lanes}")
        self.vec = ir.VectorType(self.elem, self.lanes)
        self.name = name
        self.module = ir.Module(name=name)
        # llvmlite cannot mangle vector or opaque-pointer intrinsic names, so they are spelled out.
        self.fma = ir.Function(self.module, ir.FunctionType(self.vec, [self.vec] * 3),
                               f"llvm.fma.v{self.lanes}{'f32' if self.itemsize == 4 else 'f64'}")
        self.memset = ir.Function(self.module, ir.FunctionType(ir.VoidType(), [PTR, ir.IntType(8), I64, ir.IntType(1)]),
                                  "llvm.memset.p0.i64")
        suffix = f"v{self.lanes}{'f32' if self.itemsize == 4 else 'f64'}.p0"
        mask = ir.VectorType(ir.IntType(1), self.lanes)
        self.masked_load_fn = ir.Function(self.module, ir.FunctionType(self.vec, [PTR, I32, mask, self.vec]),
                                          f"llvm.masked.load.{suffix}")
        self.masked_store = ir.Function(self.module, ir.FunctionType(ir.VoidType(), [self.vec, PTR, I32, mask]),
                                        f"llvm.masked.store.{suffix}")

    def generate(self) -> str:
        kernels = {rows: self.micro_kernel(rows) for rows in self.row_parts}
        # M <= MR: one panel of A, so each element of B is used once per call. B is read in place
        # unless it is prepacked or gathered (a strided view); a tile of few rows spans several
        # panels of B.
        read_b_in_place = not self.prepacked and not (self.strided is not None and self.strided.operand == "b")
        small = {rows: kernel if self.panels_for(rows) == 1 and not read_b_in_place
                 else self.micro_kernel(rows, self.panels_for(rows), read_b_in_place)
                 for rows, kernel in kernels.items()}
        gathered = self.strided.operand if self.strided is not None else None
        pack_a = self.pack_a_gathered() if gathered == "a" else self.pack_a()
        pack_b = self.pack_b_gathered() if gathered == "b" else self.pack_b()
        self.driver(kernels, small, read_b_in_place, pack_a, pack_b)
        return str(self.module)

    @property
    def row_parts(self) -> list[int]:
        """The row counts micro-kernels are generated for: MR, and the powers of two below it,
        whose sums make every edge tile (at most log2(MR) calls, each a vector kernel). A kernel
        for every count 1..MR (twice: packed and small-M) compiled the float32 module in 1.9-2.0 s
        where the kernel before this change took 0.8-0.9 s; with the parts (and A's strides
        constant) 0.45-0.53 s against 0.28-0.29 s (each pair in one loaded minute)."""
        return [self.t.mr] + [1 << e for e in reversed(range(self.t.mr.bit_length())) if 1 << e < self.t.mr]

    def by_row_parts(self, b: _Builder, rows: ir.Value, emit: Callable[[int, ir.Value], None]) -> None:
        """emit(size, first_row) for the parts of a tile of `rows` (1..MR) rows: all MR at once,
        or one part per set bit of rows (4, 2, 1 ...), each starting below the bigger ones."""
        with b.if_else(b.icmp_signed("==", rows, _i64(self.t.mr)), likely=True) as (full, partial):
            with full:
                emit(self.t.mr, _i64(0))
            with partial:
                for size in self.row_parts[1:]:
                    with b.if_then(b.icmp_unsigned("!=", b.and_(rows, _i64(size)), _i64(0))):
                        emit(size, b.and_(rows, _i64(~(2 * size - 1))))

    def panels_for(self, rows: int) -> int:
        """Micro-panels of B side by side in a small-M tile of `rows` rows: enough for ~8 independent
        accumulators (the FMA latency times the FMA ports of znver4/5 is 8 in flight)."""
        return max(1, 8 // (rows * (self.t.nr // self.lanes)))

    def pack_b_entry(self) -> str:
        """The module of `pack_b_ir`: all of B packed in the layout a prepacked driver reads."""
        pack_b = self.pack_b()
        t = self.t
        fn, b = _define(self.module, self.name, [("dst", PTR), ("src", PTR), ("K", I64), ("N", I64)], internal=False)
        dst, src, K, N = fn.args
        with b.loop(_i64(0), N, t.nc, "jc") as jc:
            nc = b.min(b.sub(N, jc), _i64(t.nc))
            with b.loop(_i64(0), K, t.kc, "pc") as pc:
                kc = b.min(b.sub(K, pc), _i64(t.kc))
                b.call(pack_b, [self.packed_block(b, dst, jc, pc, nc, K), b.at(src, b.add(b.mul(pc, N), jc), self.elem), N, kc, nc])
        b.ret_void()
        return str(self.module)

    def packed_block(self, b: _Builder, packed: ir.Value, jc: ir.Value, pc: ir.Value, nc: ir.Value, K: ir.Value) -> ir.Value:
        """Where block (jc, pc) starts in a prepacked B: the jc blocks before it are NC wide and
        K tall (jc·K elements), then pc rows of this block's micro-panels (rounded to NR)."""
        nc_padded = b.mul(b.sdiv(b.add(nc, _i64(self.t.nr - 1)), _i64(self.t.nr)), _i64(self.t.nr))
        return b.at(packed, b.add(b.mul(jc, K), b.mul(pc, nc_padded)), self.elem)

    def zero_fill(self, b: _Builder, dst: ir.Value, elements: ir.Value) -> None:
        nbytes = b.mul(elements, _i64(self.itemsize))
        b.call(self.memset, [dst, ir.Constant(ir.IntType(8), 0), nbytes, ir.Constant(ir.IntType(1), 0)])

    def micro_kernel(self, rows: int, panels: int = 1, direct: bool = False) -> ir.Function:
        """C[0:rows, 0:cols] (+)= Apanel @ Bpanels, the tile held in rows × panels·NR/V registers.

        a: an MR-tall packed micro-panel (a[k*MR + i], rows ≥ `rows` unused; A is packed even for
        M <= MR, where it costs 1/N of the multiply-adds: strides known at compile time keep the
        row addresses out of the hot loop, which with run-time strides became a chain of adds as
        long as the FMAs and compiled the module in 0.78 s instead of 0.49). b: `panels` NR-wide
        micro-panels side by side, panel p's row k at b[p*pstride + k*ldb]: packed (ldb = NR,
        pstride = kc*NR, 64-byte aligned, zero-padded past the operand's last column) or, `direct`,
        B itself (ldb = N, pstride = NR). c: the tile, leading dimension ldc; accumulate: start
        from C, not zero. Columns ≥ `cols` are neither read nor written (masked vector loads and
        stores): an edge tile needs no buffer and no scalar loop, and nothing past B's last
        column is read. Several panels give a tile of few rows enough independent FMA chains to
        cover the FMA latency (one row × one panel is 2 chains: a quarter of the FMA rate).
        """
        mr, nv, lanes = rows, panels * self.t.nr // self.lanes, self.lanes
        per_panel = self.t.nr // lanes
        fn, b = _define(self.module, f"{self.name}.kernel{rows}x{panels}{'d' if direct else ''}",
                        [("kc", I64), ("a", PTR), ("b", PTR), ("ldb", I64), ("pstride", I64),
                         ("c", PTR), ("ldc", I64), ("accumulate", ir.IntType(1)), ("cols", I64)])
        kc, a_panel, b_panel, ldb, pstride, c, ldc, accumulate, cols = fn.args
        # Keep LLVM from inlining this into the loop nest: a standalone function gets the whole
        # register file for the tile, and the hot loop's layout does not depend on the callers.
        fn.attributes.add("noinline")
        lane_type = ir.VectorType(I64, lanes)
        splat_cols = b.shuffle_vector(b.insert_element(ir.Constant(lane_type, ir.Undefined), cols, _i64(0)),
                                      ir.Constant(lane_type, ir.Undefined), ir.Constant(ir.VectorType(I32, lanes), None))
        masks = [b.icmp_signed("<", ir.Constant(lane_type, [v * lanes + j for j in range(lanes)]), splat_cols)
                 for v in range(nv)]
        panel_starts = [b.at(b_panel, b.mul(_i64(p), pstride), self.elem) for p in range(panels)]
        zero = ir.Constant(self.vec, None)

        def c_row(i: int) -> ir.Value:
            return b.at(c, b.mul(_i64(i), ldc), self.elem)

        # C moves with masked loads and stores only at an edge: a full tile's are plain ones
        # (12x64x32x64, kc = 32: all moves masked ran 67 GFLOP/s median, plain full-tile moves 134, in
        # runs minutes apart on the loaded 2-core machine; the old kernel ran 92-142 alongside them).
        full = b.icmp_signed("==", cols, _i64(nv * lanes))
        blocks = {n: fn.append_basic_block(n) for n in ("load_c", "load_full", "load_masked", "zero_c", "loop")}
        b.cbranch(accumulate, blocks["load_c"], blocks["zero_c"])
        b.position_at_end(blocks["load_c"])
        b.cbranch(full, blocks["load_full"], blocks["load_masked"])
        starts: dict[str, list[list[ir.Value]]] = {}
        for name, masked in (("load_full", False), ("load_masked", True)):
            b.position_at_end(blocks[name])
            starts[name] = [[self.masked_load(b, b.at(c_row(i), _i64(v * lanes), self.elem), masks[v]) if masked
                             else b.load(b.at(c_row(i), _i64(v * lanes), self.elem), typ=self.vec, align=self.itemsize)
                             for v in range(nv)] for i in range(mr)]
            b.branch(blocks["loop"])
        b.position_at_end(blocks["zero_c"])
        starts["zero_c"] = [[zero] * nv for _ in range(mr)]
        b.branch(blocks["loop"])

        b.position_at_end(blocks["loop"])
        k = b.phi(I64, name="k")
        acc = [[b.phi(self.vec, name=f"c{i}_{v}") for v in range(nv)] for i in range(mr)]
        for name, values in starts.items():
            k.add_incoming(_i64(0), blocks[name])
            for i in range(mr):
                for v in range(nv):
                    acc[i][v].add_incoming(values[i][v], blocks[name])
        b_rows = [b.at(start, b.mul(k, ldb), self.elem) for start in panel_starts]
        b_addresses = [b.at(b_rows[v // per_panel], _i64(v % per_panel * lanes), self.elem) for v in range(nv)]
        if direct or panels > 1:   # a panel may lie (partly) past B's last column
            b_vecs = [self.masked_load(b, address, mask) for address, mask in zip(b_addresses, masks)]
        else:
            b_vecs = [b.load(address, typ=self.vec, align=_ALIGN) for address in b_addresses]
        a_col = b.at(a_panel, b.mul(k, _i64(self.t.mr)), self.elem)
        new_acc = []
        for i in range(mr):
            a_scalar = b.load(b.at(a_col, _i64(i), self.elem), typ=self.elem, align=self.itemsize)
            splat = b.shuffle_vector(b.insert_element(ir.Constant(self.vec, ir.Undefined), a_scalar, _i64(0)),
                                     ir.Constant(self.vec, ir.Undefined), ir.Constant(ir.VectorType(I32, lanes), None))
            new_acc.append([b.call(self.fma, [splat, b_vecs[v], acc[i][v]]) for v in range(nv)])
        k_next = b.add(k, _i64(1), name="k.next")
        for i in range(mr):
            for v in range(nv):
                acc[i][v].add_incoming(new_acc[i][v], b.block)
        k.add_incoming(k_next, b.block)
        store = fn.append_basic_block("store")
        b.cbranch(b.icmp_signed("<", k_next, kc), blocks["loop"], store)

        b.position_at_end(store)
        with b.if_else(full, likely=True) as (whole, edge):
            with whole:
                for i in range(mr):
                    for v in range(nv):
                        b.store(new_acc[i][v], b.at(c_row(i), _i64(v * lanes), self.elem), align=self.itemsize)
            with edge:
                for i in range(mr):
                    for v in range(nv):
                        b.call(self.masked_store, [new_acc[i][v], b.at(c_row(i), _i64(v * lanes), self.elem),
                                                   ir.Constant(I32, self.itemsize), masks[v]])
        b.ret_void()
        return fn

    def masked_load(self, b: _Builder, address: ir.Value, mask: ir.Value) -> ir.Value:
        return b.call(self.masked_load_fn, [address, ir.Constant(I32, self.itemsize), mask, ir.Constant(self.vec, None)])

    def pack_a(self) -> ir.Function:
        """dst[p*kc*MR + k*MR + i] = src[(p*MR + i)*lda + k] for a mc×kc block; rows ≥ mc are zero."""
        mr = self.t.mr
        fn, b = _define(self.module, f"{self.name}.pack_a",
                        [("dst", PTR), ("src", PTR), ("lda", I64), ("mc", I64), ("kc", I64)])
        dst, src, lda, mc, kc = fn.args
        full_panels_end = b.mul(b.sdiv(mc, _i64(mr)), _i64(mr))
        with b.loop(_i64(0), full_panels_end, mr, "p") as p:
            # MR row streams read in step, written as one contiguous MR-wide column per k.
            panel = b.at(dst, b.mul(p, kc), self.elem)
            rows = [b.at(src, b.mul(b.add(p, _i64(i)), lda), self.elem) for i in range(mr)]
            with b.loop(_i64(0), kc, 1, "k") as k:
                column = b.at(panel, b.mul(k, _i64(mr)), self.elem)
                for i in range(mr):
                    value = b.load(b.at(rows[i], k, self.elem), typ=self.elem, align=self.itemsize)
                    b.store(value, b.at(column, _i64(i), self.elem), align=self.itemsize)
        rest = b.sub(mc, full_panels_end)
        with b.if_then(b.icmp_signed(">", rest, _i64(0))):
            panel = b.at(dst, b.mul(full_panels_end, kc), self.elem)
            self.zero_fill(b, panel, b.mul(kc, _i64(mr)))
            with b.loop(_i64(0), rest, 1, "i") as i:
                row = b.at(src, b.mul(b.add(full_panels_end, i), lda), self.elem)
                with b.loop(_i64(0), kc, 1, "k") as k:
                    value = b.load(b.at(row, k, self.elem), typ=self.elem, align=self.itemsize)
                    b.store(value, b.at(panel, b.add(b.mul(k, _i64(mr)), i), self.elem), align=self.itemsize)
        b.ret_void()
        return fn

    def pack_b(self) -> ir.Function:
        """dst[q*kc*NR + k*NR + j] = src[k*ldb + q*NR + j] for a kc×nc block; columns ≥ nc are zero."""
        nr, lanes = self.t.nr, self.lanes
        fn, b = _define(self.module, f"{self.name}.pack_b",
                        [("dst", PTR), ("src", PTR), ("ldb", I64), ("kc", I64), ("nc", I64)])
        dst, src, ldb, kc, nc = fn.args
        full_panels_end = b.mul(b.sdiv(nc, _i64(nr)), _i64(nr))
        with b.loop(_i64(0), full_panels_end, nr, "q") as q:
            panel = b.at(dst, b.mul(q, kc), self.elem)
            with b.loop(_i64(0), kc, 1, "k") as k:
                row = b.at(src, b.add(b.mul(k, ldb), q), self.elem)
                out = b.at(panel, b.mul(k, _i64(nr)), self.elem)
                for v in range(nr // lanes):
                    value = b.load(b.at(row, _i64(v * lanes), self.elem), typ=self.vec, align=self.itemsize)
                    b.store(value, b.at(out, _i64(v * lanes), self.elem), align=_ALIGN)
        rest = b.sub(nc, full_panels_end)
        with b.if_then(b.icmp_signed(">", rest, _i64(0))):
            panel = b.at(dst, b.mul(full_panels_end, kc), self.elem)
            self.zero_fill(b, panel, b.mul(kc, _i64(nr)))
            with b.loop(_i64(0), kc, 1, "k") as k:
                row = b.at(src, b.add(b.mul(k, ldb), full_panels_end), self.elem)
                out = b.at(panel, b.mul(k, _i64(nr)), self.elem)
                with b.loop(_i64(0), rest, 1, "j") as j:
                    value = b.load(b.at(row, j, self.elem), typ=self.elem, align=self.itemsize)
                    b.store(value, b.at(out, j, self.elem), align=self.itemsize)
        b.ret_void()
        return fn

    def pack_a_gathered(self) -> ir.Function:
        """pack_a from a strided operand: row r starts at src[rows[r]], its column k is at
        [cols[k]] from there (the tables are offset to this block's first row and column)."""
        mr = self.t.mr
        fn, b = _define(self.module, f"{self.name}.pack_a_gathered",
                        [("dst", PTR), ("src", PTR), ("rows", PTR), ("cols", PTR), ("mc", I64), ("kc", I64)])
        dst, src, rows, cols, mc, kc = fn.args

        def row_start(r: ir.Value) -> ir.Value:
            return b.at(src, b.sext(b.load(b.at(rows, r, I32), typ=I32), I64), self.elem)

        def element(row: ir.Value, k: ir.Value) -> ir.Value:
            column = b.sext(b.load(b.at(cols, k, I32), typ=I32), I64)
            return b.load(b.at(row, column, self.elem), typ=self.elem, align=self.itemsize)

        # Every KC block starts on a multiple of KC and K is a multiple of the run, so a block's
        # columns come in whole pieces of `chunk` consecutive ones: one table lookup per piece.
        assert self.strided is not None
        chunk = math.gcd(self.strided.run, self.t.kc)
        full_panels_end = b.mul(b.sdiv(mc, _i64(mr)), _i64(mr))
        with b.loop(_i64(0), full_panels_end, mr, "p") as p:
            panel = b.at(dst, b.mul(p, kc), self.elem)
            starts = [row_start(b.add(p, _i64(i))) for i in range(mr)]
            with b.loop(_i64(0), kc, chunk, "k") as k:
                # MR rows × chunk columns: one vector load per row, transposed in registers into
                # chunk MR-wide columns
                column = b.sext(b.load(b.at(cols, k, I32), typ=I32), I64)
                piece = ir.VectorType(self.elem, chunk)
                loaded = [b.load(b.at(starts[i], column, self.elem), typ=piece, align=self.itemsize) for i in range(mr)]
                for kk in range(chunk):
                    out = ir.Constant(ir.VectorType(self.elem, mr), ir.Undefined)
                    for i in range(mr):
                        out = b.insert_element(out, b.extract_element(loaded[i], _i64(kk)), _i64(i))
                    b.store(out, b.at(panel, b.mul(b.add(k, _i64(kk)), _i64(mr)), self.elem), align=self.itemsize)
        rest = b.sub(mc, full_panels_end)
        with b.if_then(b.icmp_signed(">", rest, _i64(0))):
            panel = b.at(dst, b.mul(full_panels_end, kc), self.elem)
            self.zero_fill(b, panel, b.mul(kc, _i64(mr)))
            with b.loop(_i64(0), rest, 1, "i") as i:
                start = row_start(b.add(full_panels_end, i))
                with b.loop(_i64(0), kc, 1, "k") as k:
                    b.store(element(start, k), b.at(panel, b.add(b.mul(k, _i64(mr)), i), self.elem), align=self.itemsize)
        b.ret_void()
        return fn

    def pack_b_gathered(self) -> ir.Function:
        """pack_b from a strided operand (tables as pack_a_gathered's). A full micro-panel is
        copied in pieces of `chunk` columns, consecutive in memory (the view's innermost run,
        e.g. one output row of a convolution): one column-table lookup per piece and row."""
        assert self.strided is not None
        nr = self.t.nr
        chunk = math.gcd(self.strided.run, nr)
        piece = ir.VectorType(self.elem, chunk) if chunk > 1 else self.elem
        fn, b = _define(self.module, f"{self.name}.pack_b_gathered",
                        [("dst", PTR), ("src", PTR), ("rows", PTR), ("cols", PTR), ("kc", I64), ("nc", I64)])
        dst, src, rows, cols, kc, nc = fn.args

        def row_start(k: ir.Value) -> ir.Value:
            return b.at(src, b.sext(b.load(b.at(rows, k, I32), typ=I32), I64), self.elem)

        def column(j: ir.Value) -> ir.Value:
            return b.sext(b.load(b.at(cols, j, I32), typ=I32), I64)

        full_panels_end = b.mul(b.sdiv(nc, _i64(nr)), _i64(nr))
        with b.loop(_i64(0), full_panels_end, nr, "q") as q:
            panel = b.at(dst, b.mul(q, kc), self.elem)
            pieces = [column(b.add(q, _i64(r))) for r in range(0, nr, chunk)]
            with b.loop(_i64(0), kc, 1, "k") as k:
                row = row_start(k)
                out = b.at(panel, b.mul(k, _i64(nr)), self.elem)
                for r, offset in zip(range(0, nr, chunk), pieces):
                    value = b.load(b.at(row, offset, self.elem), typ=piece, align=self.itemsize)
                    b.store(value, b.at(out, _i64(r), self.elem), align=self.itemsize)
        rest = b.sub(nc, full_panels_end)
        with b.if_then(b.icmp_signed(">", rest, _i64(0))):
            panel = b.at(dst, b.mul(full_panels_end, kc), self.elem)
            self.zero_fill(b, panel, b.mul(kc, _i64(nr)))
            with b.loop(_i64(0), kc, 1, "k") as k:
                row = row_start(k)
                out = b.at(panel, b.mul(k, _i64(nr)), self.elem)
                with b.loop(_i64(0), rest, 1, "j") as j:
                    value = b.load(b.at(row, column(b.add(full_panels_end, j)), self.elem), typ=self.elem, align=self.itemsize)
                    b.store(value, b.at(out, j, self.elem), align=self.itemsize)
        b.ret_void()
        return fn

    def offset_table(self, b: _Builder, dst: ir.Value, axes: Axes, base: int) -> None:
        """dst[i] = base + Σ index_d·stride_d, i running over the axes in row-major order (int32)."""
        with ExitStack() as nest:
            flat, offset = _i64(0), _i64(base)
            for d, (size, stride) in enumerate(axes):
                index = nest.enter_context(b.loop(_i64(0), _i64(size), 1, f"table{d}"))
                flat = b.add(b.mul(flat, _i64(size)), index)
                offset = b.add(offset, b.mul(index, _i64(stride)))
            b.store(b.trunc(offset, I32), b.at(dst, flat, I32), align=4)

    def driver(self, kernels: dict[int, ir.Function], small: dict[int, ir.Function], read_b_in_place: bool,
               pack_a: ir.Function, pack_b: ir.Function) -> None:
        t = self.t
        fn, b = _define(self.module, self.name,
                        [("C", PTR), ("A", PTR), ("B", PTR), ("W", PTR), ("batch", I64), ("M", I64),
                         ("N", I64), ("K", I64), ("strideA", I64), ("strideB", I64), ("strideC", I64)],
                        internal=False)
        C, A, B, W, batch, M, N, K, stride_a, stride_b, stride_c = fn.args

        # The layout workspace_bytes describes, evaluated at run time.
        def round_up(value: ir.Value, multiple: int) -> ir.Value:
            return b.mul(b.sdiv(b.add(value, _i64(multiple - 1)), _i64(multiple)), _i64(multiple))
        kc_max = b.min(K, _i64(t.kc))
        nc_max = b.min(round_up(N, t.nr), _i64(t.nc))
        mc_max = b.min(round_up(M, t.mr), _i64(t.mc))
        a_offset = _i64(0) if self.prepacked else round_up(b.mul(b.mul(kc_max, nc_max), _i64(self.itemsize)), _ALIGN)
        tables_offset = b.add(a_offset, round_up(b.mul(b.mul(mc_max, kc_max), _i64(self.itemsize)), _ALIGN))
        b_packed, a_packed = W, b.at(W, a_offset, ir.IntType(8))
        strided = self.strided
        if strided is not None:
            row_table = b.at(W, tables_offset, ir.IntType(8))
            col_table = b.at(row_table, _i64(math.prod(size for size, _ in strided.rows)), I32)
            self.offset_table(b, row_table, strided.rows, strided.offset)
            self.offset_table(b, col_table, strided.cols, 0)
        is_small = b.icmp_signed("<=", M, _i64(t.mr))
        pack_b_now = b.not_(is_small) if read_b_in_place else ir.Constant(ir.IntType(1), 1)

        published = progress.word(self.module, self.name) if self.publish_progress else None
        with b.loop(_i64(0), batch, 1, "batch") as item:
            a_item = b.at(A, b.mul(item, stride_a), self.elem)
            b_item = b.at(B, b.mul(item, stride_b), self.elem)
            c_item = b.at(C, b.mul(item, stride_c), self.elem)
            with b.loop(_i64(0), N, t.nc, "jc") as jc:
                nc = b.min(b.sub(N, jc), _i64(t.nc))
                with b.loop(_i64(0), K, t.kc, "pc") as pc:
                    kc = b.min(b.sub(K, pc), _i64(t.kc))
                    accumulate = b.icmp_signed(">", pc, _i64(0))
                    b_block = b.at(b_item, b.add(b.mul(pc, N), jc), self.elem)
                    if self.prepacked:
                        b_source = self.packed_block(b, b_item, jc, pc, nc, K)
                    else:
                        with b.if_then(pack_b_now):
                            if strided is not None and strided.operand == "b":
                                b.call(pack_b, [b_packed, b_item, b.at(row_table, pc, I32), b.at(col_table, jc, I32), kc, nc])
                            else:
                                b.call(pack_b, [b_packed, b_block, N, kc, nc])
                        b_source = b_packed
                    with b.loop(_i64(0), M, t.mc, "ic") as ic:
                        if published is not None:  # per MC x KC x NC block: at most 2.7e8 flops (float32 tiling)
                            progress.bump(b, published)
                        mc = b.min(b.sub(M, ic), _i64(t.mc))
                        if strided is not None and strided.operand == "a":
                            b.call(pack_a, [a_packed, a_item, b.at(row_table, ic, I32), b.at(col_table, pc, I32), mc, kc])
                        else:
                            b.call(pack_a, [a_packed, b.at(a_item, b.add(b.mul(ic, K), pc), self.elem), K, mc, kc])
                        with b.if_else(is_small) as (then, otherwise):
                            with then:
                                self.small_loops(b, small, read_b_in_place, M, kc, nc, a_packed,
                                                 b_block if read_b_in_place else b_source, c_item, jc, N, accumulate)
                            with otherwise:
                                self.panel_loops(b, kernels, kc, nc, mc, a_packed, b_source, c_item, ic, jc, N, accumulate)
        b.ret_void()

    def small_loops(self, b: _Builder, kernels: dict[int, ir.Function], in_place: bool, M: ir.Value, kc: ir.Value,
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
        rows_per_sweep = b.select(b.icmp_signed("<", b.mul(nc, _i64(self.itemsize * t.direct_kc)), _i64(_SWEEP_BYTES)),
                                  _i64(t.direct_kc), b.sdiv(_i64(_SWEEP_BYTES), b.mul(nc, _i64(self.itemsize))))
        dkc = b.select(b.icmp_signed("<", rows_per_sweep, _i64(4)), b.min(_i64(4), _i64(t.direct_kc)), rows_per_sweep)

        def sweep(rows: int, first: ir.Value) -> None:
            kernel, width = kernels[rows], self.panels_for(rows) * t.nr
            a_rows, c_rows = b.at(a_packed, first, self.elem), b.at(c_item, b.add(b.mul(first, N), jc), self.elem)
            if in_place:
                with b.loop(_i64(0), kc, dkc, "kd") as kd:
                    with b.loop(_i64(0), nc, width, "jr") as jr:
                        b.call(kernel, [b.min(b.sub(kc, kd), dkc), b.at(a_rows, b.mul(kd, _i64(t.mr)), self.elem),
                                        b.at(b_source, b.add(b.mul(kd, N), jr), self.elem), N, _i64(t.nr),
                                        b.at(c_rows, jr, self.elem), N,
                                        b.or_(accumulate, b.icmp_signed(">", kd, _i64(0))), b.min(b.sub(nc, jr), _i64(width))])
            else:
                with b.loop(_i64(0), nc, width, "jr") as jr:
                    b.call(kernel, [kc, a_rows, b.at(b_source, b.mul(jr, kc), self.elem), _i64(t.nr), b.mul(kc, _i64(t.nr)),
                                    b.at(c_rows, jr, self.elem), N, accumulate, b.min(b.sub(nc, jr), _i64(width))])
        self.by_row_parts(b, M, sweep)

    def panel_loops(self, b: _Builder, kernels: dict[int, ir.Function], kc: ir.Value, nc: ir.Value, mc: ir.Value,
                    a_packed: ir.Value, b_packed: ir.Value, c_item: ir.Value, ic: ir.Value, jc: ir.Value, N: ir.Value,
                    accumulate: ir.Value) -> None:
        """The jr and ir loops over one packed MC×KC block of A and KC×NC block of B."""
        t = self.t
        with b.loop(_i64(0), nc, t.nr, "jr") as jr:
            cols = b.min(b.sub(nc, jr), _i64(t.nr))
            b_panel = b.at(b_packed, b.mul(jr, kc), self.elem)
            with b.loop(_i64(0), mc, t.mr, "ir") as ir_:
                rows = b.min(b.sub(mc, ir_), _i64(t.mr))
                c_tile = b.at(c_item, b.add(b.mul(b.add(ic, ir_), N), b.add(jc, jr)), self.elem)
                self.call_tile(b, rows, kernels, [kc, b.at(a_packed, b.mul(ir_, kc), self.elem),
                                                  b_panel, _i64(t.nr), b.mul(kc, _i64(t.nr)), c_tile, N, accumulate, cols])

    def call_tile(self, b: _Builder, rows: ir.Value, kernels: dict[int, ir.Function], args: list[ir.Value]) -> None:
        """The micro-kernel call(s) for a tile of `rows` rows, `args` as for a full one: an edge
        tile's rows go through the kernels of their parts, not a full tile into a buffer."""
        kc, a_panel, b_panel, ldb, pstride, c_tile, ldc, accumulate, cols = args

        def part(size: int, first: ir.Value) -> None:
            b.call(kernels[size], [kc, b.at(a_panel, first, self.elem), b_panel, ldb, pstride,
                                   b.at(c_tile, b.mul(first, ldc), self.elem), ldc, accumulate, cols])
        self.by_row_parts(b, rows, part)


def program_name(dtype: str, strided: StridedOperand | None = None, prepacked: bool = False) -> str:
    """The matmul kernel's name: one per dtype, and one per view a strided operand is read through."""
    name = f"tinydist_matmul_{dtype}" + ("_prepacked" if prepacked else "")
    if strided is not None:
        name += "_strided_" + hashlib.sha256(repr(strided).encode()).hexdigest()[:16]
    return name


def matmul_ir(name: str, dtype: str = "float32", tiling: Tiling | None = None,
              strided: StridedOperand | None = None, publish_progress: bool = True, prepacked: bool = False) -> str:
    """LLVM IR text defining ``void @<name>(C, A, B, W, batch, M, N, K, strideA, strideB, strideC)``;
    with `strided`, that operand is read through its view (M, N, K must match the view's sizes);
    with `prepacked`, B is the output of `pack_b_ir` (strideB counts its elements, a multiple of
    `packed_b_elements` keeps every item 64-byte aligned) and is not packed again.
    `publish_progress=False` leaves out the progress word (a program for a remote node)."""
    _dtype(dtype)
    return _Generator(name, dtype, tiling or DEFAULT_TILINGS[dtype], strided, publish_progress, prepacked).generate()


def pack_b_array(b: np.ndarray, tiling: Tiling | None = None) -> np.ndarray:
    """numpy's spelling of `pack_b_ir` (the same elements, bit for bit; a test compares): a
    constant K×N float32/float64 B packed at load, without compiling anything, as a 1-D array
    of `packed_b_elements(K, N)` elements. The kernel reads it with aligned vector loads: pass
    it at a 64-byte boundary (a device buffer is; a numpy array need not be)."""
    K, N = b.shape
    t = tiling or DEFAULT_TILINGS[str(b.dtype)]
    packed = np.zeros(packed_b_elements(K, N, str(b.dtype), t), b.dtype)
    for jc in range(0, N, t.nc):
        nc = min(N - jc, t.nc)
        padded = np.zeros((K, _round_up(nc, t.nr)), b.dtype)
        padded[:, :nc] = b[:, jc:jc + nc]
        for pc in range(0, K, t.kc):
            kc = min(K - pc, t.kc)
            # micro-panel q holds columns q*NR..q*NR+NR-1 of rows pc..pc+kc-1, row after row
            panels = padded[pc:pc + kc].reshape(kc, -1, t.nr).transpose(1, 0, 2).reshape(-1)
            start = jc * K + pc * padded.shape[1]
            packed[start:start + panels.size] = panels
    return packed


def pack_b_ir(name: str, dtype: str = "float32", tiling: Tiling | None = None) -> str:
    """LLVM IR text defining ``void @<name>(ptr dst, ptr B, i64 K, i64 N)``: row-major K×N B
    packed into `packed_b_elements(K, N)` elements at dst (64-byte aligned), the operand a
    prepacked `matmul_ir` with the same tiling reads. A weight is packed so once, not per call."""
    _dtype(dtype)
    return _Generator(name, dtype, tiling or DEFAULT_TILINGS[dtype], None, False).pack_b_entry()
