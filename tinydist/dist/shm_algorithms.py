"""Collectives over a `tinydist.transports.shm_group.ShmGroup`: ranks read each other's regions directly.

A collective is a sequence of rounds; a round moves at most one slot (`slot_bytes`) per rank and
is one or two steps, each a post-and-wait on every peer (no data frames, no acknowledgements: the
next round uses the other slot, and every peer has finished reading it once it has reached the
next round's first step). The first step of a collective's first round also publishes its header
(`Session.sync` checks every rank's, so a mismatch is raised by every rank before data is used).

- allreduce, naive:    copy in; every rank reduces the whole chunk from every region in rank order
                       0..N-1 (bitwise the same result everywhere). One step per round.
- allreduce, all2all:  copy in; rank i reduces part i of the chunk from every region into its result
                       and its own region, then every rank copies the peers' parts out. Two steps per round.
  From SINGLE_COPY_MIN_BYTES on, where every rank may read and write the others' memory
  (`ShmGroup.single_copy_bytes`), no slot carries data: rank i reads part i of the peers' inputs straight
  from their memory and writes the reduced part straight into their results (`allreduce_single_copy`,
  one round of two steps, the memory floor's traffic).
- reduce-scatter:      copy in; rank i reduces part i straight into its result. One step.
- allgather:           copy my piece in; copy every piece out. One step.
- broadcast:           the root copies in; the others copy out. One step.

In all2all and reduce-scatter a rank does not copy in the part it reduces itself: it reads that from
its own input (naive copies everything: every peer reads all of it). Reductions of a part of 1 MiB
or more from more than two sources or into two destinations run as one compiled pass
(`tinydist.codegen.reduce`: every source read once, every destination written once) where the op
and dtype are compiled; numpy's ufuncs do the rest.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tinydist.codegen.reduce import supported
from tinydist.dist.errors import CollectiveMismatch, RankFailed
from tinydist.dist.shm_fast import clear_digest, fast_peer
from tinydist.graph.collectives import shard_bounds
from tinydist.graph.reduce_ops import ReduceOp
from tinydist.observability import tracing
from tinydist.runtime.compiler import host_reduce
from tinydist.transports import cma
from tinydist.transports.shm_group import ShmGroup

Verdict = Callable[[dict[int, bytes]], dict[int, dict[str, Any]]]


class Session:
    """One collective's rounds on the group segment, under one deadline.

    While tracing, `trace` names this rank's trace process (`rank0`) and every step (a post and
    the wait for every peer's) and every reduction is a span on its `collective steps` lane."""

    def __init__(self, grp: ShmGroup, header: bytes, verdict: Verdict, deadline: float,
                 check: Callable[[int], tuple[int, int] | None], trace: str | None = None) -> None:
        self.grp, self.header, self.verdict = grp, header, verdict
        self.deadline, self.check = deadline, check
        self.headers: dict[int, dict[str, Any]] | None = None   # every rank's header, once agreed
        self.parity = 0
        self.rounds = 0
        self.trace = trace

    def round(self) -> int:
        """Begin the next round; its slots have this parity. The collective's first round carries the header."""
        self.rounds += 1
        self.parity = self.grp.next_round()
        if self.headers is None:
            self.grp.write_header(self.parity, self.header)
            clear_digest(self.grp, self.parity)
        return self.parity

    def sync(self, meanwhile: Callable[[], None] | None = None) -> dict[int, dict[str, Any]]:
        """Post this step, run `meanwhile` (work that needs no peer), wait for every peer's step; the
        first time, agree on the headers (or raise)."""
        grp = self.grp
        started = tracing.clock() if self.trace is not None else 0
        step = grp.post()
        if meanwhile is not None:
            meanwhile()
        grp.wait(step, self.deadline, self.check)
        if self.headers is None and fast_peer(grp, self.parity):
            self._explain()
        if self.headers is None:
            blobs = {r: self.header if r == grp.rank else grp.read_header(r, self.parity) for r in range(grp.world)}
            self.headers = self.verdict(blobs)
        if self.trace is not None:
            tracing.record(f"step {step}", started, process=self.trace, lane="collective steps", cat="collective",
                           round=self.rounds, step=step, overlapped=meanwhile is not None)
        return self.headers

    def _explain(self) -> None:
        """A peer took the native path (`tinydist.dist.shm_fast`), which writes no header: one more step
        in which every rank writes its header, then the verdict every rank reaches (the calls differ)."""
        grp = self.grp
        parity = grp.next_round()
        grp.write_header(parity, self.header)
        grp.wait(grp.post(), self.deadline, self.check)
        blobs = {r: self.header if r == grp.rank else grp.read_header(r, parity) for r in range(grp.world)}
        self.verdict(blobs)
        raise CollectiveMismatch("the ranks' calls differ (a peer's call digest does), though their headers agree: "
                                 + "; ".join(f"rank {r} {b.decode(errors='replace')}" for r, b in sorted(blobs.items())))

    def reduce(self, op: ReduceOp, dsts: Sequence[np.ndarray], sources: Sequence[np.ndarray]) -> None:
        """`_reduce_into`, a span on the steps lane while tracing."""
        if self.trace is None:
            return _reduce_into(op, dsts, sources)
        started = tracing.clock()
        _reduce_into(op, dsts, sources)
        tracing.record(f"reduce {op.value}", started, process=self.trace, lane="collective steps", cat="collective",
                       round=self.rounds, bytes=dsts[0].nbytes, sources=len(sources), destinations=len(dsts))

    def elements(self, dtype: np.dtype) -> int:
        """How many elements of `dtype` one round moves per rank."""
        return max(1, self.grp.slot_bytes // dtype.itemsize)


def _rounds(n: int, per_round: int) -> list[tuple[int, int]]:
    """Element ranges of the rounds; an empty message still takes one (empty) round, the collective's barrier."""
    return [(a, min(a + per_round, n)) for a in range(0, n, per_round)] or [(0, 0)]


# Below this many bytes per destination numpy reduces: a compiled call costs ~5 us more to set up
# (ctypes addresses), and with the data in cache numpy's loops are as fast (measured on the 2-vCPU
# EPYC VM: at 1 MiB the two break even; at 2 MiB out of cache the fused pass wins). The kernel runs
# only where it fuses passes (a second destination, or more than two sources): one numpy
# `add(a, b, out=c)` is as fast as it (4 MiB in L3: numpy 149 us, the kernel 162 us).
COMPILED_MIN_BYTES = 1 << 20
# single copy reduces a part in pieces of this many bytes per source: the pieces read from the peers
# stay in the core's cache until reduced. Measured, 2 ranks, 64 MiB: 64 KiB 13.0 ms, 256 KiB 8.1, 512 KiB 7.3, 1 MiB 8.1.
PIECE_BYTES = 512 << 10
# all2all copies straight between the ranks' memory from this many bytes on, where the group may.
# Measured (2 and 4 ranks, 2-vCPU EPYC, 32 MiB L3): at 4 MiB the slots win (the exchange stays in L3,
# while process_vm_readv/writev pin every page per call: 1.16 vs 0.84 ms, 2 ranks); from 8 MiB single
# copy wins (1.03 vs 1.33 ms; at 64 MiB 7.3 vs 25.8 ms), its traffic being half the slots'.
SINGLE_COPY_MIN_BYTES = 8 << 20


def _reduce_into(op: ReduceOp, dsts: Sequence[np.ndarray], sources: Sequence[np.ndarray]) -> None:
    """Every `dsts[d][i]` = sources[0][i] op sources[1][i] op ... in source order (what numpy's binary
    ufuncs compute), in one compiled pass over the memory where that saves numpy passes, the op and
    dtype are compiled (`tinydist.codegen.reduce.supported`) and the part is big enough to pay, else
    as numpy passes."""
    dst = dsts[0]
    if (len(dsts) > 1 or len(sources) > 2) and dst.nbytes >= COMPILED_MIN_BYTES:   # cheap tests first: small calls
        if supported(op, dst.dtype):
            kernel = host_reduce(op, dst.dtype, len(sources), len(dsts)).cfunc
            kernel(*[a.ctypes.data for a in dsts], *[a.ctypes.data for a in sources], dst.size)
            return
    op.ufunc(sources[0], sources[1], out=dst)
    for src in sources[2:]:
        op.ufunc(dst, src, out=dst)
    for other in dsts[1:]:
        other[:] = dst


def allreduce_naive(s: Session, x: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
    """The reduction of every rank's flat `x` into `out` (which may be `x`: round k reads only x's chunk k,
    all of it into the slot, before writing out's chunk k)."""
    grp = s.grp
    for a, b in _rounds(x.size, s.elements(x.dtype)):
        p = s.round()
        grp.region(grp.rank, p, x.dtype, b - a)[:] = x[a:b]
        s.sync()
        s.reduce(op, [out[a:b]], [grp.region(r, p, x.dtype, b - a) for r in range(grp.world)])


def allreduce_all2all(s: Session, x: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
    """The reduction of every rank's flat `x` into `out` (which may be `x`: round k has read x's chunk k
    into the slot and reduced it before it writes out's chunk k)."""
    grp = s.grp
    rounds = _rounds(x.size, s.elements(x.dtype))
    filled: list[tuple[int, list[tuple[int, int]], np.ndarray]] = []

    def fill(a: int, b: int) -> None:
        """Begin a round and copy in all of its chunk but my part (which I read from `x` when reducing)."""
        p = s.round()
        parts = shard_bounds(b - a, grp.world)
        m0, m1 = parts[grp.rank]
        mine = grp.region(grp.rank, p, x.dtype, b - a)
        mine[:m0] = x[a:a + m0]
        mine[m1:] = x[a + m1:b]
        filled.append((p, parts, mine))

    fill(*rounds[0])
    for k, (a, b) in enumerate(rounds):
        p, parts, mine = filled[k]
        s.sync()            # every input of round k is in, and every peer has copied out round k-1
        m0, m1 = parts[grp.rank]
        peers = [grp.region(r, p, x.dtype, b - a)[m0:m1] for r in grp.peers]
        # my part goes to my result and to my slot, from where the peers copy it out
        s.reduce(op, [out[a + m0:a + m1], mine[m0:m1]], [x[a + m0:a + m1], *peers])
        # while the peers finish their parts, fill round k+1: its slot is round k-1's, which every
        # peer finished reading before it began round k
        s.sync(functools.partial(fill, *rounds[k + 1]) if k + 1 < len(rounds) else None)
        for r in grp.peers:
            c0, c1 = parts[r]
            out[a + c0:a + c1] = grp.region(r, p, x.dtype, b - a)[c0:c1]


def allreduce_single_copy(s: Session, x: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
    """The reduction of every rank's flat `x` into `out` (which may be `x`), copying straight between
    the ranks' memory (`tinydist.transports.cma`; the group agreed it may, `ShmGroup.single_copy_bytes`).

    Every rank publishes where its `x` and `out` are, then reduces its part piece by piece: it reads
    the peers' pieces into cache-sized scratch, reduces them with its own into its `out`, and writes
    the result into every peer's `out`. Each rank thus reads every input byte of its part once and
    writes each result byte once per rank: the memory floor, in one round of two steps. Only rank r
    touches part r of any rank's `x` or `out`, so `out` may be `x`; the second step keeps every rank
    here until the peers are done with its memory.
    """
    grp = s.grp
    p = s.round()
    grp.region(grp.rank, p, np.dtype(np.uint64), 2)[:] = (x.ctypes.data, out.ctypes.data)
    s.sync()
    where = {r: [int(a) for a in grp.region(r, p, np.dtype(np.uint64), 2)] for r in grp.peers}
    m0, m1 = shard_bounds(x.size, grp.world)[grp.rank]
    size = x.dtype.itemsize
    step = max(1, PIECE_BYTES // size)
    scratch = grp.scratch(len(grp.peers) * step * size).view(x.dtype)
    buffers = {r: scratch[k * step:(k + 1) * step] for k, r in enumerate(grp.peers)}
    for a in range(m0, m1, step):
        b = min(a + step, m1)
        at = a * size
        for r in grp.peers:
            _peer_copy(cma.read, grp, r, where[r][0] + at, buffers[r][:b - a])
        # my own piece first: `out` may be `x`, and the first pass reads it before writing there
        s.reduce(op, [out[a:b]], [x[a:b], *(buffers[r][:b - a] for r in grp.peers)])
        for r in grp.peers:
            _peer_copy(cma.write, grp, r, where[r][1] + at, out[a:b])
    s.sync()


def _peer_copy(copy: Callable[[int, int, np.ndarray], None], grp: ShmGroup, rank: int, address: int, local: np.ndarray) -> None:
    """`cma.read` or `cma.write` with rank `rank`; its process gone is that rank's failure."""
    try:
        copy(grp.pids[rank], address, local)
    except cma.PeerGone:
        raise RankFailed(rank, f"its process (pid {grp.pids[rank]}) is gone") from None


def reduce_scatter(s: Session, x: np.ndarray, bounds: Sequence[tuple[int, int]], op: ReduceOp) -> np.ndarray:
    """This rank's range `bounds[rank]` of the reduction of every rank's flat `x`."""
    grp = s.grp
    lo, hi = bounds[grp.rank]
    piece = np.empty(hi - lo, x.dtype)
    for a, b in _rounds(x.size, s.elements(x.dtype)):
        p = s.round()
        m0, m1 = min(max(lo, a), b) - a, min(max(hi, a), b) - a     # my range within this round
        mine = grp.region(grp.rank, p, x.dtype, b - a)
        mine[:m0] = x[a:a + m0]
        mine[m1:] = x[a + m1:b]
        s.sync()
        if m1 > m0:
            peers = [grp.region(r, p, x.dtype, b - a)[m0:m1] for r in grp.peers]
            s.reduce(op, [piece[a + m0 - lo:a + m1 - lo]], [x[a + m0:a + m1], *peers])
    return piece


def all_gather(s: Session, piece: np.ndarray, lengths: Callable[[dict[int, dict[str, Any]]], list[int]]
               ) -> tuple[np.ndarray, dict[int, dict[str, Any]]]:
    """Every rank's flat `piece`, concatenated in rank order, and the agreed headers. `lengths` reads the
    pieces' lengths from the headers: the number of rounds is known only once every header is in."""
    grp = s.grp
    per_round = s.elements(piece.dtype)
    out: np.ndarray | None = None
    headers: dict[int, dict[str, Any]] = {}
    sizes: list[int] = []
    starts: list[int] = []
    a = 0
    while out is None or a < max(sizes):
        p = s.round()
        grp.region(grp.rank, p, piece.dtype, max(0, min(piece.size, a + per_round) - a))[:] = piece[a:a + per_round]
        headers = s.sync()
        if out is None:
            sizes = lengths(headers)
            starts = [sum(sizes[:r]) for r in range(grp.world)]
            out = np.empty(sum(sizes), piece.dtype)
        for r in range(grp.world):
            n = max(0, min(sizes[r], a + per_round) - a)
            out[starts[r] + a:starts[r] + a + n] = piece[a:a + n] if r == grp.rank else grp.region(r, p, piece.dtype, n)
        a += per_round
    return out, headers


def broadcast(s: Session, src: int, data: np.ndarray | None, shape: Callable[[dict[int, dict[str, Any]]], tuple[tuple[int, ...], np.dtype]]) -> np.ndarray:
    """Rank `src`'s `data` on every rank; `shape` reads the root's shape and dtype from the agreed headers."""
    grp = s.grp
    out: np.ndarray | None = None
    a, n = 0, 0
    while out is None or a < n:
        p = s.round()
        if grp.rank == src and data is not None:    # a root without data has an error in its header
            flat = data.reshape(-1)
            part = flat[a:a + s.elements(flat.dtype)]
            grp.region(grp.rank, p, flat.dtype, part.size)[:] = part
        headers = s.sync()
        if out is None:
            dims, dtype = shape(headers)
            out = data.copy() if grp.rank == src and data is not None else np.empty(dims, dtype)
            n = out.size
        flat_out = out.reshape(-1)
        m = max(0, min(n, a + s.elements(out.dtype)) - a)
        if grp.rank != src:
            flat_out[a:a + m] = grp.region(src, p, out.dtype, m)
        a += s.elements(out.dtype)
    return out


def barrier(s: Session) -> None:
    s.round()
    s.sync()
