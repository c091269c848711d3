"""The matmul's micro-kernel: an MR×NR tile of C held in vector registers over a KC-long panel
of A and B, one `llvm.fma` per vector per step of k (on AVX-512 at MR=8, NR=32: 2 aligned
vmovaps, 8 vbroadcastss and 16 vfmadd231ps zmm per step, nothing spilled, and 3 prefetches of
B; K_UNROLL steps per loop iteration), with masked loads and stores of C only on an edge tile. The loops around it are the driver's (`tinydist.codegen.matmul`).
"""

from __future__ import annotations

import llvmlite.ir as ir

from tinydist.codegen.matmul_emit import I32, I64, PTR, MatmulModule, define, i64
from tinydist.codegen.matmul_tiling import ALIGN

BYTE = ir.IntType(8)
LINE = 64               # bytes per cache line
# How far ahead of its loads packed B is prefetched into L1. 1024, 2048, 4096 and 8192 bytes (8
# to 64 steps of k at NR = 32 float32), with the next-panel prefetch, ran alike at M = 64,
# K = N = 4096 (164-167 GFLOP/s medians) and 512 x 1536 (174-175); 4096 was best at M = 8, 1536.
PREFETCH_BYTES = 4096
PREFETCH_MIN_KC = 128   # steps of k below which a packed panel's loop prefetches nothing
# Steps of k per iteration of the k loop (the rest, kc % K_UNROLL, one at a time): the loop's
# counter adds and compare-and-branch run once per group, not per step; on this Sapphire Rapids
# core they share issue ports with the FMAs. Same-process A/B against one step per iteration
# (bench/gemm.py's prepacked shapes, CPU clock, load 13-16): 64x384x384 77 / 73 %, 64x768x768
# 75 / 68 %, 64x4096x4096 69 / 65 %, 512x4096x4096 77 / 74 % of peak; 8 steps ran no faster than 4.
K_UNROLL = 4


def micro_kernel(m: MatmulModule, rows: int, panels: int = 1, direct: bool = False) -> ir.Function:
    """C[0:rows, 0:cols] (+)= Apanel @ Bpanels, the tile held in rows × panels·NR/V registers.

    a: an MR-tall packed micro-panel (a[k*MR + i], rows ≥ `rows` unused; A is packed even for
    M <= MR, where it costs 1/N of the multiply-adds: strides known at compile time keep the
    row addresses out of the hot loop, which with run-time strides became a chain of adds as
    long as the FMAs and compiled the module in 0.78 s instead of 0.49). b: `panels` NR-wide
    micro-panels side by side, panel p's row k at b[p*pstride + k*ldb]: packed (ldb = NR,
    pstride = kc*NR, 64-byte aligned, zero-padded past the operand's last column) or, `direct`,
    B itself (ldb = N, pstride = NR). A packed single panel is prefetched ahead of its loads,
    and step k also prefetches next[k*next_step] (bytes) into L2: the caller's share of the
    micro-panel of B read after this one. c: the tile, leading dimension ldc; accumulate: start
    from C, not zero. Columns ≥ `cols` are neither read nor written (masked vector loads and
    stores): an edge tile needs no buffer and no scalar loop, and nothing past B's last
    column is read. Several panels give a tile of few rows enough independent FMA chains to
    cover the FMA latency (one row × one panel is 2 chains: a quarter of the FMA rate).
    """
    mr, nv, lanes = rows, panels * m.t.nr // m.lanes, m.lanes
    per_panel = m.t.nr // lanes
    fn, b = define(m.module, f"{m.name}.kernel{rows}x{panels}{'d' if direct else ''}",
                    [("kc", I64), ("a", PTR), ("b", PTR), ("ldb", I64), ("pstride", I64),
                     ("c", PTR), ("ldc", I64), ("accumulate", ir.IntType(1)), ("cols", I64),
                     ("next", PTR), ("next_step", I64)])
    kc, a_panel, b_panel, ldb, pstride, c, ldc, accumulate, cols, next_b, next_step = fn.args
    # Keep LLVM from inlining this into the loop nest: a standalone function gets the whole
    # register file for the tile, and the hot loop's layout does not depend on the callers.
    fn.attributes.add("noinline")
    lane_type = ir.VectorType(I64, lanes)
    splat_cols = b.shuffle_vector(b.insert_element(ir.Constant(lane_type, ir.Undefined), cols, i64(0)),
                                  ir.Constant(lane_type, ir.Undefined), ir.Constant(ir.VectorType(I32, lanes), None))
    masks = [b.icmp_signed("<", ir.Constant(lane_type, [v * lanes + j for j in range(lanes)]), splat_cols)
             for v in range(nv)]
    panel_starts = [b.at(b_panel, b.mul(i64(p), pstride), m.elem) for p in range(panels)]
    zero = ir.Constant(m.vec, None)

    def c_row(i: int) -> ir.Value:
        return b.at(c, b.mul(i64(i), ldc), m.elem)

    # C moves with masked loads and stores only at an edge: a full tile's are plain ones
    # (12x64x32x64, kc = 32: all moves masked ran 67 GFLOP/s median, plain full-tile moves 134, in
    # runs minutes apart on the loaded 2-core machine; the old kernel ran 92-142 alongside them).
    full = b.icmp_signed("==", cols, i64(nv * lanes))
    long_kc = b.icmp_signed(">=", kc, i64(PREFETCH_MIN_KC))
    # A full tile's lines are asked for (for writing) before the k loop, so their misses overlap
    # it rather than the stores' queueing at the end: that weighs where kc is short (attention's
    # 32). An edge tile's are not: its row may end inside a line another writer owns.
    with b.if_then(full):
        for i in range(mr):
            for line in range(0, nv * lanes * m.itemsize, LINE):
                m.prefetch(b, b.gep(c_row(i), [i64(line)], source_etype=BYTE), 3, write=True)
    blocks = {n: fn.append_basic_block(n) for n in ("load_c", "load_full", "load_masked", "zero_c", "start")}
    # A packed panel's k loop prefetches B (below), but not a short one's (kc < PREFETCH_MIN_KC,
    # e.g. attention's 32): that is in L1 already, and the three prefetches per step cost it 3-4 %.
    prefetching = not direct and panels == 1
    b.cbranch(accumulate, blocks["load_c"], blocks["zero_c"])
    b.position_at_end(blocks["load_c"])
    b.cbranch(full, blocks["load_full"], blocks["load_masked"])
    starts: dict[str, list[list[ir.Value]]] = {}
    for name, masked in (("load_full", False), ("load_masked", True)):
        b.position_at_end(blocks[name])
        starts[name] = [[m.masked_load(b, b.at(c_row(i), i64(v * lanes), m.elem), masks[v]) if masked
                         else b.load(b.at(c_row(i), i64(v * lanes), m.elem), typ=m.vec, align=m.itemsize)
                         for v in range(nv)] for i in range(mr)]
        b.branch(blocks["start"])
    b.position_at_end(blocks["zero_c"])
    starts["zero_c"] = [[zero] * nv for _ in range(mr)]
    b.branch(blocks["start"])
    b.position_at_end(blocks["start"])
    tile = [[b.phi(m.vec, name=f"start.c{i}_{v}") for v in range(nv)] for i in range(mr)]
    for name, values in starts.items():
        for i in range(mr):
            for v in range(nv):
                tile[i][v].add_incoming(values[i][v], blocks[name])

    def step(k: ir.Value, acc: list[list[ir.Value]], prefetch: bool) -> list[list[ir.Value]]:
        """One step of k: the tile after acc += A[:, k] * B[k, :]."""
        b_rows = [b.at(start, b.mul(k, ldb), m.elem) for start in panel_starts]
        b_addresses = [b.at(b_rows[v // per_panel], i64(v % per_panel * lanes), m.elem) for v in range(nv)]
        if direct or panels > 1:   # a panel may lie (partly) past B's last column
            b_vecs = [m.masked_load(b, address, mask) for address, mask in zip(b_addresses, masks)]
        else:
            b_vecs = [b.load(address, typ=m.vec, align=ALIGN) for address in b_addresses]
        if prefetch:
            # Packed B streams through L1 PREFETCH_BYTES ahead of its loads (a 128 KiB micro-panel
            # does not fit in L1, so every call reads it from L2), and the next micro-panel is
            # brought into L2 meanwhile, each call of the ir loop its share (`next`, `next_step`
            # bytes per step of k): B is read once per MC block, from L3 or memory, and no call
            # waits on it.
            for line in range(0, m.t.nr * m.itemsize, LINE):
                m.prefetch(b, b.gep(b_rows[0], [i64(PREFETCH_BYTES + line)], source_etype=BYTE), 3)
            m.prefetch(b, b.gep(next_b, [b.mul(k, next_step)], source_etype=BYTE), 2)
        a_col = b.at(a_panel, b.mul(k, i64(m.t.mr)), m.elem)
        new_acc = []
        for i in range(mr):
            a_scalar = b.load(b.at(a_col, i64(i), m.elem), typ=m.elem, align=m.itemsize)
            splat = b.shuffle_vector(b.insert_element(ir.Constant(m.vec, ir.Undefined), a_scalar, i64(0)),
                                     ir.Constant(m.vec, ir.Undefined), ir.Constant(ir.VectorType(I32, lanes), None))
            new_acc.append([b.call(m.fma, [splat, b_vecs[v], acc[i][v]]) for v in range(nv)])
        return new_acc

    def k_loop(name: str, first: ir.Value, acc: list[list[ir.Value]], unroll: int, prefetch: bool
               ) -> tuple[ir.Value, list[list[ir.Value]]]:
        """Steps first, first+1, ... of k while a whole group of `unroll` fits below kc, `unroll`
        steps per iteration: the k where it stopped and the tile then (the loop's exit block is current)."""
        entry = b.block
        header, body, done = (fn.append_basic_block(f"{name}.{part}") for part in ("header", "body", "exit"))
        b.branch(header)
        b.position_at_end(header)
        k = b.phi(I64, name=f"{name}.k")
        k.add_incoming(first, entry)
        phis = [[b.phi(m.vec, name=f"{name}.c{i}_{v}") for v in range(nv)] for i in range(mr)]
        for i in range(mr):
            for v in range(nv):
                phis[i][v].add_incoming(acc[i][v], entry)
        b.cbranch(b.icmp_signed("<=", b.add(k, i64(unroll)), kc), body, done)
        b.position_at_end(body)
        new_acc = phis
        for u in range(unroll):
            new_acc = step(b.add(k, i64(u)) if u else k, new_acc, prefetch)
        k.add_incoming(b.add(k, i64(unroll), name=f"{name}.k.next"), b.block)
        for i in range(mr):
            for v in range(nv):
                phis[i][v].add_incoming(new_acc[i][v], b.block)
        b.branch(header)
        b.position_at_end(done)
        return k, phis

    ends: list[tuple[list[list[ir.Value]], ir.Block]] = []

    # A full-height tile's loop takes K_UNROLL steps per iteration, the last kc % K_UNROLL one at a
    # time; the edge and small-M kernels one (unrolling them too made the float32 module compile
    # in 745-762 ms instead of 590-673, for tiles that carry little of the work).
    unroll = K_UNROLL if rows == m.t.mr and not direct else 1

    def loops(name: str, prefetch: bool) -> None:
        k, acc = k_loop(f"{name}.unrolled" if unroll > 1 else name, i64(0), tile, unroll, prefetch)
        if unroll > 1:
            _, acc = k_loop(f"{name}.rest", k, acc, 1, prefetch)
        ends.append((acc, b.block))
        b.branch(store)

    store = fn.append_basic_block("store")
    if prefetching:
        long_kc = b.icmp_signed(">=", kc, i64(PREFETCH_MIN_KC))
        with b.if_else(long_kc) as (with_prefetch, without):
            with with_prefetch:
                loops("prefetching", True)
            with without:
                loops("loop", False)
        b.unreachable()
    else:
        loops("loop", False)
    b.position_at_end(store)
    new_acc = [[b.phi(m.vec, name=f"c{i}_{v}") for v in range(nv)] for i in range(mr)]
    for values, block in ends:
        for i in range(mr):
            for v in range(nv):
                new_acc[i][v].add_incoming(values[i][v], block)

    b.position_at_end(store)
    with b.if_else(full, likely=True) as (whole, edge):
        with whole:
            for i in range(mr):
                for v in range(nv):
                    b.store(new_acc[i][v], b.at(c_row(i), i64(v * lanes), m.elem), align=m.itemsize)
        with edge:
            for i in range(mr):
                for v in range(nv):
                    b.call(m.masked_store, [new_acc[i][v], b.at(c_row(i), i64(v * lanes), m.elem),
                                               ir.Constant(I32, m.itemsize), masks[v]])
    b.ret_void()
    return fn
