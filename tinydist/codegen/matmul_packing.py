"""The matmul's packing: A into MR-tall and B into NR-wide micro-panels, the layout the
micro-kernel reads with aligned vector loads (B zero-padded past its last column).

- `pack_a` / `pack_b`: one MC×KC block of A, one KC×NC block of B, per call of the driver's loops;
- `pack_a_gathered` / `pack_b_gathered`: the same from a `StridedOperand` (e.g. a convolution's
  im2col columns over its padded input), through tables of row and column offsets
  (`offset_table`) the driver fills in the workspace first, so the matrix is never written out;
- `pack_b_ir` / `pack_b_array`: a whole constant B (a weight) packed once at load, in native code
  or in numpy, bit for bit the same; `packed_block` finds a block in it;
- `pack_a_array`: a whole constant A (a convolution's weight) packed once at load, in numpy;
  `pack_b_array_of_transpose`: a convolution's weight packed as B for its product turned around.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack

import llvmlite.ir as ir
import numpy as np

from tinydist.codegen.matmul_emit import I32, I64, PTR, Builder, MatmulModule, define, i64
from tinydist.codegen.matmul_tiling import (ALIGN, DEFAULT_TILINGS, Tiling, itemsize, packed_a_elements, packed_b_elements,
                                            round_up)

PACK_B_SIGNATURE = ("w", "r", "i64", "i64")


def pack_a(m: MatmulModule) -> ir.Function:
    """dst[p*kc*MR + k*MR + i] = src[(p*MR + i)*lda + k] for a mc×kc block; rows ≥ mc are zero."""
    mr = m.t.mr
    fn, b = define(m.module, f"{m.name}.pack_a",
                    [("dst", PTR), ("src", PTR), ("lda", I64), ("mc", I64), ("kc", I64)])
    dst, src, lda, mc, kc = fn.args
    full_panels_end = b.mul(b.sdiv(mc, i64(mr)), i64(mr))
    lanes = m.lanes
    vector_steps = mr & (mr - 1) == 0 and lanes % mr == 0
    with b.loop(i64(0), full_panels_end, mr, "p") as p:
        # MR row streams read in step, written as one contiguous MR-wide column per k: a vector
        # of each row at a time, transposed in registers (`_transpose`), then one at a time.
        panel = b.at(dst, b.mul(p, kc), m.elem)
        rows = [b.at(src, b.mul(b.add(p, i64(i)), lda), m.elem) for i in range(mr)]
        vector_end = b.mul(b.sdiv(kc, i64(lanes)), i64(lanes)) if vector_steps else i64(0)
        with b.loop(i64(0), vector_end, lanes, "kv") as k:
            loaded = [b.load(b.at(rows[i], k, m.elem), typ=m.vec, align=m.itemsize) for i in range(mr)]
            out = b.at(panel, b.mul(k, i64(mr)), m.elem)
            for j, value in enumerate(_transpose(b, loaded, lanes)):
                b.store(value, b.at(out, i64(j * lanes), m.elem), align=m.itemsize)
        with b.loop(vector_end, kc, 1, "k") as k:
            column = b.at(panel, b.mul(k, i64(mr)), m.elem)
            for i in range(mr):
                value = b.load(b.at(rows[i], k, m.elem), typ=m.elem, align=m.itemsize)
                b.store(value, b.at(column, i64(i), m.elem), align=m.itemsize)
    rest = b.sub(mc, full_panels_end)
    with b.if_then(b.icmp_signed(">", rest, i64(0))):
        panel = b.at(dst, b.mul(full_panels_end, kc), m.elem)
        m.zero_fill(b, panel, b.mul(kc, i64(mr)))
        with b.loop(i64(0), rest, 1, "i") as i:
            row = b.at(src, b.mul(b.add(full_panels_end, i), lda), m.elem)
            with b.loop(i64(0), kc, 1, "k") as k:
                value = b.load(b.at(row, k, m.elem), typ=m.elem, align=m.itemsize)
                b.store(value, b.at(panel, b.add(b.mul(k, i64(mr)), i), m.elem), align=m.itemsize)
    b.ret_void()
    return fn


def _transpose(b: Builder, rows: list[ir.Value], lanes: int) -> list[ir.Value]:
    """`rows` (a power of two of them, dividing `lanes`): vectors of `lanes` consecutive columns
    k of one row each, as vectors of the columns (row index fastest: (0, k), (1, k), ...) in k
    order. log2(rows) stages of two-input shuffles (one vpermt2ps each on AVX-512), each merging
    pairs of row groups into vectors of twice the rows and half the columns: 24 shuffles for an
    8x16 block, where the element-wise copy spent 128 loads and 128 stores."""
    # each vector as the (row, column) it holds per lane
    groups: list[list[tuple[ir.Value, list[tuple[int, int]]]]] = [
        [(row, [(i, k) for k in range(lanes)])] for i, row in enumerate(rows)]
    while len(groups) > 1:
        merged = []
        for low, high in zip(groups[0::2], groups[1::2]):
            out = []
            for (x, x_tags), (y, y_tags) in zip(low, high):
                where = {tag: n for n, tag in enumerate(x_tags + y_tags)}
                members = sorted({i for i, _ in x_tags} | {i for i, _ in y_tags})
                columns = sorted({k for _, k in x_tags})
                step = lanes // len(members)
                for start in range(0, len(columns), step):
                    tags = [(i, k) for k in columns[start:start + step] for i in members]
                    mask = ir.Constant(ir.VectorType(I32, lanes), [where[tag] for tag in tags])
                    out.append((b.shuffle_vector(x, y, mask), tags))
            merged.append(out)
        groups = merged
    return [value for value, _ in groups[0]]


def pack_b(m: MatmulModule) -> ir.Function:
    """dst[q*kc*NR + k*NR + j] = src[k*ldb + q*NR + j] for a kc×nc block; columns ≥ nc are zero."""
    nr, lanes = m.t.nr, m.lanes
    fn, b = define(m.module, f"{m.name}.pack_b",
                    [("dst", PTR), ("src", PTR), ("ldb", I64), ("kc", I64), ("nc", I64)])
    dst, src, ldb, kc, nc = fn.args
    full_panels_end = b.mul(b.sdiv(nc, i64(nr)), i64(nr))
    with b.loop(i64(0), full_panels_end, nr, "q") as q:
        panel = b.at(dst, b.mul(q, kc), m.elem)
        with b.loop(i64(0), kc, 1, "k") as k:
            row = b.at(src, b.add(b.mul(k, ldb), q), m.elem)
            out = b.at(panel, b.mul(k, i64(nr)), m.elem)
            for v in range(nr // lanes):
                value = b.load(b.at(row, i64(v * lanes), m.elem), typ=m.vec, align=m.itemsize)
                b.store(value, b.at(out, i64(v * lanes), m.elem), align=ALIGN)
    rest = b.sub(nc, full_panels_end)
    with b.if_then(b.icmp_signed(">", rest, i64(0))):
        panel = b.at(dst, b.mul(full_panels_end, kc), m.elem)
        m.zero_fill(b, panel, b.mul(kc, i64(nr)))
        with b.loop(i64(0), kc, 1, "k") as k:
            row = b.at(src, b.add(b.mul(k, ldb), full_panels_end), m.elem)
            out = b.at(panel, b.mul(k, i64(nr)), m.elem)
            with b.loop(i64(0), rest, 1, "j") as j:
                value = b.load(b.at(row, j, m.elem), typ=m.elem, align=m.itemsize)
                b.store(value, b.at(out, j, m.elem), align=m.itemsize)
    b.ret_void()
    return fn


def pack_a_gathered(m: MatmulModule) -> ir.Function:
    """pack_a from a strided operand: row r starts at src[rows[r]], its column k is at
    [cols[k]] from there (the tables are offset to this block's first row and column)."""
    mr = m.t.mr
    fn, b = define(m.module, f"{m.name}.pack_a_gathered",
                    [("dst", PTR), ("src", PTR), ("rows", PTR), ("cols", PTR), ("mc", I64), ("kc", I64)])
    dst, src, rows, cols, mc, kc = fn.args

    def row_start(r: ir.Value) -> ir.Value:
        return b.at(src, b.sext(b.load(b.at(rows, r, I32), typ=I32), I64), m.elem)

    def element(row: ir.Value, k: ir.Value) -> ir.Value:
        column = b.sext(b.load(b.at(cols, k, I32), typ=I32), I64)
        return b.load(b.at(row, column, m.elem), typ=m.elem, align=m.itemsize)

    # Every KC block starts on a multiple of KC and K is a multiple of the run, so a block's
    # columns come in whole pieces of `chunk` consecutive ones: one table lookup per piece.
    assert m.strided is not None
    chunk = m.strided.chunk
    full_panels_end = b.mul(b.sdiv(mc, i64(mr)), i64(mr))
    with b.loop(i64(0), full_panels_end, mr, "p") as p:
        panel = b.at(dst, b.mul(p, kc), m.elem)
        starts = [row_start(b.add(p, i64(i))) for i in range(mr)]
        with b.loop(i64(0), kc, chunk, "k") as k:
            # MR rows × chunk columns: one vector load per row, transposed in registers into
            # chunk MR-wide columns
            column = b.sext(b.load(b.at(cols, k, I32), typ=I32), I64)
            piece = ir.VectorType(m.elem, chunk)
            loaded = [b.load(b.at(starts[i], column, m.elem), typ=piece, align=m.itemsize) for i in range(mr)]
            for kk in range(chunk):
                out = ir.Constant(ir.VectorType(m.elem, mr), ir.Undefined)
                for i in range(mr):
                    out = b.insert_element(out, b.extract_element(loaded[i], i64(kk)), i64(i))
                b.store(out, b.at(panel, b.mul(b.add(k, i64(kk)), i64(mr)), m.elem), align=m.itemsize)
    rest = b.sub(mc, full_panels_end)
    with b.if_then(b.icmp_signed(">", rest, i64(0))):
        panel = b.at(dst, b.mul(full_panels_end, kc), m.elem)
        m.zero_fill(b, panel, b.mul(kc, i64(mr)))
        with b.loop(i64(0), rest, 1, "i") as i:
            start = row_start(b.add(full_panels_end, i))
            with b.loop(i64(0), kc, 1, "k") as k:
                b.store(element(start, k), b.at(panel, b.add(b.mul(k, i64(mr)), i), m.elem), align=m.itemsize)
    b.ret_void()
    return fn


def pack_b_gathered(m: MatmulModule, chunk: int) -> ir.Function:
    """pack_b from a strided operand (tables as pack_a_gathered's). A full micro-panel is
    copied in pieces of `chunk` columns (a power of two dividing NR and the view's run, its
    consecutive columns: e.g. one output row of a convolution): one column-table lookup per
    piece and row. The driver has one per chunk and calls the one the view's run allows."""
    assert m.strided is not None
    nr = m.t.nr
    piece = ir.VectorType(m.elem, chunk) if chunk > 1 else m.elem
    fn, b = define(m.module, f"{m.name}.pack_b_gathered{chunk}",
                    [("dst", PTR), ("src", PTR), ("rows", PTR), ("cols", PTR), ("kc", I64), ("nc", I64)])
    dst, src, rows, cols, kc, nc = fn.args

    def row_start(k: ir.Value) -> ir.Value:
        return b.at(src, b.sext(b.load(b.at(rows, k, I32), typ=I32), I64), m.elem)

    def column(j: ir.Value) -> ir.Value:
        return b.sext(b.load(b.at(cols, j, I32), typ=I32), I64)

    full_panels_end = b.mul(b.sdiv(nc, i64(nr)), i64(nr))
    with b.loop(i64(0), full_panels_end, nr, "q") as q:
        panel = b.at(dst, b.mul(q, kc), m.elem)
        pieces = [column(b.add(q, i64(r))) for r in range(0, nr, chunk)]
        with b.loop(i64(0), kc, 1, "k") as k:
            row = row_start(k)
            out = b.at(panel, b.mul(k, i64(nr)), m.elem)
            for r, offset in zip(range(0, nr, chunk), pieces):
                value = b.load(b.at(row, offset, m.elem), typ=piece, align=m.itemsize)
                b.store(value, b.at(out, i64(r), m.elem), align=m.itemsize)
    rest = b.sub(nc, full_panels_end)
    with b.if_then(b.icmp_signed(">", rest, i64(0))):
        panel = b.at(dst, b.mul(full_panels_end, kc), m.elem)
        m.zero_fill(b, panel, b.mul(kc, i64(nr)))
        with b.loop(i64(0), kc, 1, "k") as k:
            row = row_start(k)
            out = b.at(panel, b.mul(k, i64(nr)), m.elem)
            with b.loop(i64(0), rest, 1, "j") as j:
                value = b.load(b.at(row, column(b.add(full_panels_end, j)), m.elem), typ=m.elem, align=m.itemsize)
                b.store(value, b.at(out, j, m.elem), align=m.itemsize)
    b.ret_void()
    return fn


def offset_table(m: MatmulModule, b: Builder, dst: ir.Value, axes: Sequence[tuple[ir.Value, ir.Value]], base: ir.Value) -> None:
    """dst[i] = base + Σ index_d·stride_d, i running over the axes (size, stride: the kernel's
    view arguments) in row-major order (int32)."""
    with ExitStack() as nest:
        flat, offset = i64(0), base
        for d, (size, stride) in enumerate(axes):
            index = nest.enter_context(b.loop(i64(0), size, 1, f"table{d}"))
            flat = b.add(b.mul(flat, size), index)
            offset = b.add(offset, b.mul(index, stride))
        b.store(b.trunc(offset, I32), b.at(dst, flat, I32), align=4)


def packed_block(m: MatmulModule, b: Builder, packed: ir.Value, jc: ir.Value, pc: ir.Value, nc: ir.Value, K: ir.Value) -> ir.Value:
    """Where block (jc, pc) starts in a prepacked B: the jc blocks before it are NC wide and
    K tall (jc·K elements), then pc rows of this block's micro-panels (rounded to NR)."""
    nc_padded = b.mul(b.sdiv(b.add(nc, i64(m.t.nr - 1)), i64(m.t.nr)), i64(m.t.nr))
    return b.at(packed, b.add(b.mul(jc, K), b.mul(pc, nc_padded)), m.elem)


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
        padded = np.zeros((K, round_up(nc, t.nr)), b.dtype)
        padded[:, :nc] = b[:, jc:jc + nc]
        for pc in range(0, K, t.kc):
            kc = min(K - pc, t.kc)
            # micro-panel q holds columns q*NR..q*NR+NR-1 of rows pc..pc+kc-1, row after row
            panels = padded[pc:pc + kc].reshape(kc, -1, t.nr).transpose(1, 0, 2).reshape(-1)
            start = jc * K + pc * padded.shape[1]
            packed[start:start + panels.size] = panels
    return packed


def pack_b_array_of_transpose(a: np.ndarray, tiling: Tiling | None = None) -> np.ndarray:
    """`pack_b_array(a.T)` of an N×K `a` (a convolution's weight, its product turned around),
    the same elements, read from `a` as it lies: where N is a multiple of NR within one NC block,
    each KC block is one transpose of a's columns into NR-wide panels, with no transposed copy
    and no zero padding first (resnet18's 12 turned weights at load, CPU time: 63.7 -> 9.0 ms; pack_a_array of
    the same weights 12.7 ms)."""
    N, K = a.shape
    t = tiling or DEFAULT_TILINGS[str(a.dtype)]
    if N % t.nr or N > t.nc:
        return pack_b_array(np.ascontiguousarray(a.T), tiling)
    packed = np.empty(K * N, a.dtype)
    for pc in range(0, K, t.kc):
        kc = min(K - pc, t.kc)
        # micro-panel q: rows pc..pc+kc-1 of B = a's columns, NR of a's rows side by side
        block = packed[pc * N:(pc + kc) * N].reshape(N // t.nr, kc, t.nr)
        block[...] = a[:, pc:pc + kc].reshape(N // t.nr, t.nr, kc).transpose(0, 2, 1)
    return packed


def pack_a_array(a: np.ndarray, tiling: Tiling | None = None) -> np.ndarray:
    """A constant M×K float32/float64 A packed at load for `matmul_ir(prepacked="a")`, as a 1-D
    array of `packed_a_elements(M, K)`: MR-tall micro-panels the whole length of K, panel p
    (rows p·MR…, zero past M) at p·MR·K, its element (i, k) at k·MR + i — the layout `pack_a`
    writes per MC×KC block, so any KC and MC blocking reads its blocks in place. Only MR
    matters (the same for the default and the gathered-B tilings)."""
    M, K = a.shape
    mr = (tiling or DEFAULT_TILINGS[str(a.dtype)]).mr
    padded = np.ascontiguousarray(a)
    if M % mr:
        # rows past M are zero; where MR divides M (every resnet18 layer) there is no copy to pay:
        # at load each fresh buffer costs its page faults (resnet18's 44 MB of weights, ~0.1 s)
        padded = np.zeros((round_up(M, mr), K), a.dtype)
        padded[:M] = a
    packed = np.ascontiguousarray(padded.reshape(-1, mr, K).transpose(0, 2, 1)).reshape(-1)
    assert packed.size == packed_a_elements(M, K, str(a.dtype), tiling)
    return packed


def pack_b_ir(name: str, dtype: str = "float32", tiling: Tiling | None = None) -> str:
    """LLVM IR text defining ``void @<name>(ptr dst, ptr B, i64 K, i64 N)``: row-major K×N B
    packed into `packed_b_elements(K, N)` elements at dst (64-byte aligned), the operand a
    prepacked `matmul_ir` with the same tiling reads. A weight is packed so once, not per call."""
    itemsize(dtype)
    m = MatmulModule(name, dtype, tiling or DEFAULT_TILINGS[dtype], None)
    pack = pack_b(m)
    t = m.t
    fn, b = define(m.module, m.name, [("dst", PTR), ("src", PTR), ("K", I64), ("N", I64)], internal=False)
    dst, src, K, N = fn.args
    with b.loop(i64(0), N, t.nc, "jc") as jc:
        nc = b.min(b.sub(N, jc), i64(t.nc))
        with b.loop(i64(0), K, t.kc, "pc") as pc:
            kc = b.min(b.sub(K, pc), i64(t.kc))
            b.call(pack, [packed_block(m, b, dst, jc, pc, nc, K), b.at(src, b.add(b.mul(pc, N), jc), m.elem), N, kc, nc])
    b.ret_void()
    return str(m.module)
