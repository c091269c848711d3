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
k it loads NR/V vectors of packed B, broadcasts MR scalars of packed A and issues MR*NR/V fused
multiply-adds (on AVX-512: 2 aligned vmovaps, 8 vbroadcastss and 16 vfmadd231ps zmm, nothing
spilled). Packing pads partial micro-panels with zeros, so the micro-kernel always computes a full
tile; an edge tile goes through a small MR×NR buffer in the workspace instead of C.

A strided operand (`StridedOperand`, for a batch of one): A or B is not a contiguous matrix but a
view of another buffer, e.g. a convolution's im2col columns over its padded input. Its packing
gathers straight from that view, through tables of row and column offsets the driver fills in
the workspace first, so the (often large) matrix is never written out and read back.

Numerics: no fast-math flags are used; the multiply-adds are explicit ``llvm.fma`` calls (what
``contract`` would produce: one rounding per multiply-add). The reduction order is *not* changed:
the tile is reloaded from C at the start of every KC block and each element accumulates
k = 0, 1, ..., K-1 in sequence, so C[i, j] is exactly the FMA chain
fma(a[i,K-1], b[K-1,j], ... fma(a[i,0], b[0,j], 0)) — bitwise what a naive k loop using fma
gives, whatever the tile sizes. numpy/OpenBLAS sum K in a different order, so the two agree to
ordinary rounding error (worst case O(K·eps) relative), not bitwise.
"""

from __future__ import annotations

import hashlib
import math
from contextlib import ExitStack, contextmanager
from collections.abc import Iterator
from dataclasses import dataclass

import llvmlite.ir as ir

from tinydist.codegen import progress

SIGNATURE = ("w", "r", "r", "w", "i64", "i64", "i64", "i64", "i64", "i64", "i64")

_VECTOR_BYTES = 64   # one zmm register: AVX-512 is the target (znver4 has 32 of them)
_ALIGN = 64          # workspace regions start on cache lines, so packed-B vector loads are aligned


@dataclass(frozen=True)
class Tiling:
    """Micro-tile MR×NR (NR a multiple of the vector width) and the cache blocks KC, MC, NC."""

    mr: int
    nr: int
    kc: int
    mc: int
    nc: int

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
# the MC×KC block of A (192 KiB) share the L2; a long KC also means the C tile is loaded and stored
# only once per K/KC. The KC×NC panel of B (8 MiB at most) lives in L3.
# KC chosen by measurement on znver4 at 1024³ float32: KC=128..256 gave 87-94 GFLOP/s, KC=1024
# 105-110 (with MR=8 on the CNN's conv matmuls KC=768 measured the same as 1024).
DEFAULT_TILINGS: dict[str, Tiling] = {
    "float32": Tiling(mr=8, nr=32, kc=1024, mc=48, nc=2048),
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
                    strided: StridedOperand | None = None) -> int:
    """Bytes of workspace the kernel for (M, N, K) needs.

    Layout (mirrored in the generated driver): the packed KC×NC block of B at offset 0, the packed
    MC×KC block of A, then one MR×NR edge tile, then a strided operand's offset tables (int32,
    rows then columns); each region starts on a 64-byte boundary. Blocks shrink to the problem, so
    small problems need little.
    """
    tables = 4 * strided.table_entries if strided is not None else 0
    _, itemsize = _dtype(dtype)
    t = tiling or DEFAULT_TILINGS[dtype]
    kc, nc, mc = min(K, t.kc), min(_round_up(N, t.nr), t.nc), min(_round_up(M, t.mr), t.mc)
    regions = (kc * nc * itemsize, mc * kc * itemsize, t.mr * t.nr * itemsize)
    return sum(_round_up(size, _ALIGN) for size in regions) + tables


I32, I64 = ir.IntType(32), ir.IntType(64)
PTR = ir.PointerType()


def _i64(value: int) -> ir.Constant:
    return ir.Constant(I64, value)


class _Builder(ir.IRBuilder):
    """IRBuilder plus the few structured helpers the generator needs."""

    @contextmanager
    def loop(self, start: ir.Value, stop: ir.Value, step: int, name: str) -> Iterator[ir.Value]:
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
        index.add_incoming(self.add(index, _i64(step), name=f"{name}.next"), self.block)
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
                 publish_progress: bool = True) -> None:
        self.publish_progress = publish_progress
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

    def generate(self) -> str:
        kernel = self.micro_kernel()
        gathered = self.strided.operand if self.strided is not None else None
        pack_a = self.pack_a_gathered() if gathered == "a" else self.pack_a()
        pack_b = self.pack_b_gathered() if gathered == "b" else self.pack_b()
        self.driver(kernel, pack_a, pack_b)
        return str(self.module)

    def zero_fill(self, b: _Builder, dst: ir.Value, elements: ir.Value) -> None:
        nbytes = b.mul(elements, _i64(self.itemsize))
        b.call(self.memset, [dst, ir.Constant(ir.IntType(8), 0), nbytes, ir.Constant(ir.IntType(1), 0)])

    def micro_kernel(self) -> ir.Function:
        """C[0:MR, 0:NR] (+)= Apanel @ Bpanel, with the tile held in MR * NR/V vector registers.

        a: MR-tall packed micro-panel (a[k*MR + i]); b: NR-wide packed micro-panel (b[k*NR + j]),
        64-byte aligned; c: the tile, leading dimension ldc; accumulate: start from C, not zero.
        """
        mr, nv, lanes = self.t.mr, self.t.nr // self.lanes, self.lanes
        fn, b = _define(self.module, f"{self.name}.kernel",
                        [("kc", I64), ("a", PTR), ("b", PTR), ("c", PTR), ("ldc", I64), ("accumulate", ir.IntType(1))])
        kc, a_panel, b_panel, c, ldc, accumulate = fn.args
        # Keep LLVM from inlining this into the loop nest: a standalone function gets the whole
        # register file for the tile, and the hot loop's layout does not depend on the callers.
        fn.attributes.add("noinline")

        def c_row(i: int) -> ir.Value:
            return b.at(c, b.mul(_i64(i), ldc), self.elem)

        load_c, zero_c, loop = (fn.append_basic_block(n) for n in ("load_c", "zero_c", "loop"))
        b.cbranch(accumulate, load_c, zero_c)
        b.position_at_end(load_c)
        loaded = [[b.load(b.at(c_row(i), _i64(v * lanes), self.elem), typ=self.vec, align=self.itemsize)
                   for v in range(nv)] for i in range(mr)]
        b.branch(loop)
        b.position_at_end(zero_c)
        b.branch(loop)

        b.position_at_end(loop)
        k = b.phi(I64, name="k")
        k.add_incoming(_i64(0), load_c)
        k.add_incoming(_i64(0), zero_c)
        acc = [[b.phi(self.vec, name=f"c{i}_{v}") for v in range(nv)] for i in range(mr)]
        for i in range(mr):
            for v in range(nv):
                acc[i][v].add_incoming(loaded[i][v], load_c)
                acc[i][v].add_incoming(ir.Constant(self.vec, None), zero_c)
        b_row = b.at(b_panel, b.mul(k, _i64(self.t.nr)), self.elem)
        b_vecs = [b.load(b.at(b_row, _i64(v * lanes), self.elem), typ=self.vec, align=_ALIGN) for v in range(nv)]
        a_col = b.at(a_panel, b.mul(k, _i64(mr)), self.elem)
        new_acc = []
        for i in range(mr):
            a_scalar = b.load(b.at(a_col, _i64(i), self.elem), typ=self.elem, align=self.itemsize)
            splat = b.shuffle_vector(b.insert_element(ir.Constant(self.vec, ir.Undefined), a_scalar, _i64(0)),
                                     ir.Constant(self.vec, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), lanes), None))
            new_acc.append([b.call(self.fma, [splat, b_vecs[v], acc[i][v]]) for v in range(nv)])
        k_next = b.add(k, _i64(1), name="k.next")
        for i in range(mr):
            for v in range(nv):
                acc[i][v].add_incoming(new_acc[i][v], b.block)
        k.add_incoming(k_next, b.block)
        store = fn.append_basic_block("store")
        b.cbranch(b.icmp_signed("<", k_next, kc), loop, store)

        b.position_at_end(store)
        for i in range(mr):
            for v in range(nv):
                b.store(new_acc[i][v], b.at(c_row(i), _i64(v * lanes), self.elem), align=self.itemsize)
        b.ret_void()
        return fn

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

    def copy_tile(self, b: _Builder, dst: ir.Value, ld_dst: ir.Value, src: ir.Value, ld_src: ir.Value,
                  rows: ir.Value, cols: ir.Value) -> None:
        with b.loop(_i64(0), rows, 1, "ti") as i:
            dst_row = b.at(dst, b.mul(i, ld_dst), self.elem)
            src_row = b.at(src, b.mul(i, ld_src), self.elem)
            with b.loop(_i64(0), cols, 1, "tj") as j:
                value = b.load(b.at(src_row, j, self.elem), typ=self.elem, align=self.itemsize)
                b.store(value, b.at(dst_row, j, self.elem), align=self.itemsize)

    def driver(self, kernel: ir.Function, pack_a: ir.Function, pack_b: ir.Function) -> None:
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
        a_offset = round_up(b.mul(b.mul(kc_max, nc_max), _i64(self.itemsize)), _ALIGN)
        tile_offset = b.add(a_offset, round_up(b.mul(b.mul(mc_max, kc_max), _i64(self.itemsize)), _ALIGN))
        b_packed, a_packed = W, b.at(W, a_offset, ir.IntType(8))
        tile = b.at(W, tile_offset, ir.IntType(8))
        tile_ld = _i64(t.nr)
        strided = self.strided
        if strided is not None:
            row_table = b.at(tile, _i64(_round_up(t.mr * t.nr * self.itemsize, _ALIGN)), ir.IntType(8))
            col_table = b.at(row_table, _i64(math.prod(size for size, _ in strided.rows)), I32)
            self.offset_table(b, row_table, strided.rows, strided.offset)
            self.offset_table(b, col_table, strided.cols, 0)

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
                    if strided is not None and strided.operand == "b":
                        b.call(pack_b, [b_packed, b_item, b.at(row_table, pc, I32), b.at(col_table, jc, I32), kc, nc])
                    else:
                        b.call(pack_b, [b_packed, b.at(b_item, b.add(b.mul(pc, N), jc), self.elem), N, kc, nc])
                    with b.loop(_i64(0), M, t.mc, "ic") as ic:
                        if published is not None:  # per MC x KC x NC block: at most 2e8 flops (float32 tiling)
                            progress.bump(b, published)
                        mc = b.min(b.sub(M, ic), _i64(t.mc))
                        if strided is not None and strided.operand == "a":
                            b.call(pack_a, [a_packed, a_item, b.at(row_table, ic, I32), b.at(col_table, pc, I32), mc, kc])
                        else:
                            b.call(pack_a, [a_packed, b.at(a_item, b.add(b.mul(ic, K), pc), self.elem), K, mc, kc])
                        with b.loop(_i64(0), nc, t.nr, "jr") as jr:
                            nr = b.min(b.sub(nc, jr), _i64(t.nr))
                            b_panel = b.at(b_packed, b.mul(jr, kc), self.elem)
                            with b.loop(_i64(0), mc, t.mr, "ir") as ir_:
                                mr = b.min(b.sub(mc, ir_), _i64(t.mr))
                                a_panel = b.at(a_packed, b.mul(ir_, kc), self.elem)
                                row = b.add(ic, ir_)
                                col = b.add(jc, jr)
                                c_tile = b.at(c_item, b.add(b.mul(row, N), col), self.elem)
                                full = b.and_(b.icmp_signed("==", mr, _i64(t.mr)), b.icmp_signed("==", nr, _i64(t.nr)))
                                with b.if_else(full, likely=True) as (then, otherwise):
                                    with then:
                                        b.call(kernel, [kc, a_panel, b_panel, c_tile, N, accumulate])
                                    with otherwise:
                                        # Partial tile: compute a full one in the workspace buffer,
                                        # seeded from C after the first KC block, and copy back the
                                        # part that exists.
                                        self.zero_fill(b, tile, _i64(t.mr * t.nr))
                                        with b.if_then(accumulate):
                                            self.copy_tile(b, tile, tile_ld, c_tile, N, mr, nr)
                                        b.call(kernel, [kc, a_panel, b_panel, tile, tile_ld, ir.Constant(ir.IntType(1), 1)])
                                        self.copy_tile(b, c_tile, N, tile, tile_ld, mr, nr)
        b.ret_void()


def program_name(dtype: str, strided: StridedOperand | None = None) -> str:
    """The matmul kernel's name: one per dtype, and one per view a strided operand is read through."""
    name = f"tinydist_matmul_{dtype}"
    if strided is not None:
        name += "_strided_" + hashlib.sha256(repr(strided).encode()).hexdigest()[:16]
    return name


def matmul_ir(name: str, dtype: str = "float32", tiling: Tiling | None = None,
              strided: StridedOperand | None = None, publish_progress: bool = True) -> str:
    """LLVM IR text defining ``void @<name>(C, A, B, W, batch, M, N, K, strideA, strideB, strideC)``;
    with `strided`, that operand is read through its view (M, N, K must match the view's sizes).
    `publish_progress=False` leaves out the progress word (a program for a remote node)."""
    _dtype(dtype)
    return _Generator(name, dtype, tiling or DEFAULT_TILINGS[dtype], strided, publish_progress).generate()
