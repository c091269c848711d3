"""Measure the links of a tinydist.dist group as the allreduce stages use them (the planner's α and β).

Every pass of the probe samples, in turn, what one hierarchical allreduce does (at 8 B, 1 MiB and
16 MiB: every link is fitted to two lines, one up to MID = 1 MiB through the first two sizes, one
beyond it through the last two, `LinkModel.segments`), so a burst of load from elsewhere lands on all of them alike:
every pair's exchange (both ranks send n bytes, receive n and add them in, as every step of naive,
ring and all2all does; each one a separate call from this thread onto the group's loop, as every
collective is), then scheduler.execute's three stages chained as it runs them after a barrier:
stage 1, tinydist.multi.allreduce (naive) over the process's devices read back to the host (the
"mem" link, fitted to the planner's in-group formula (g-1)·(α + nγ), γ the reduce's time per
byte); stage 2, a real naive dist.all_reduce over the whole group of stage 1's result, right after
it, from which the planner takes what a dist call costs beyond its links' steps
(`tinydist.scheduler.plan.calibrate_call`); stage 3, the result copied to every device (the copy
back, α + g·nβ, `Topology.copy_back`). With one device (neither in-process stage runs) both are a
host copy.

Why three sizes: one line through 8 B and 16 MiB priced 1 MiB on an 8 B α that is mostly a fixed
cost and on the rate beyond the caches, which 1 MiB does not pay: on two network-namespace hosts
(bench/cluster.py) stage 1 at 1 MiB was predicted 1.06-1.44 ms and took 0.53-0.54 ms alone, the
copy back 0.94-1.38 ms against 0.19-0.21 ms, and the 1 MiB plan came out 0.47-1.33x; below 1 MiB
the reduce ran 0.24 ns/B and the copy 0.07-0.08 ns/B, beyond it 0.77-1.29 and 0.71-0.88 ns/B.
Why 16 MiB, not 4 MiB: 4 MiB buffers stay in this machine's 32 MiB L3, and the rate measured there
does not hold beyond it: on two network-namespace hosts (bench/cluster.py, 2 shared cores) the
in-process stage ran 0.42 ns/B at 4 MiB and 0.92 ns/B at 16 MiB, and the 16 MiB plans were
predicted 2.4-9.8x too fast. Why stages 1 and 3 apart: they run at different rates per byte, and
one rate fitted to both put the error on each: the reduce (two inputs read, one result written and
read back) predicted 3.1-6.6 ms where it took 6.1-14.9 ms at 16 MiB, the copy back 6.2-13.2 ms
where it took 3.5-8.5 ms (bench/cluster.py, four runs). Why LARGE on every other pass: under load
from elsewhere one 16 MiB sample on this machine ranged 26-70 ms (an exchange) and 40-113 ms (a
call) within one probe, and a median of five moved the 16 MiB prediction 33-131 ms between runs.
Why the call right after stage 1, with no barrier between: that is how the job makes it, and the
wait for the slower rank's stage 1 is in the job's call; timed after a barrier, the call was 1-12 ms
short of the job's at 16 MiB and the whole allreduce measured 1.07-1.29x its stages timed alone.

Pairs are measured in round-robin rounds (every rank in at most one pair per round), so every rank
runs the same schedule; `measure_links` must be called on every rank, between collectives. The
result is shared with all ranks (an allgather), so every rank plans on the same topology.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np

from tinydist.scheduler.membership import LinkRecord
from tinydist.scheduler.topology import LinkModel

# LARGE: several chunks of tinydist.dist's algorithms (CHUNK_BYTES), and with the buffers it is reduced
# between beyond a 32 MiB L3, so neither the kernel's socket buffers nor the CPU caches hide the rate
SMALL, LARGE = 8, 16 << 20
# MID: where the probe's two lines meet (module docstring, "Why three sizes")
MID = 1 << 20
SIZES = (SMALL, MID, LARGE)    # ascending (`_fit_pieces`, plan.calibrate_call)
KINDS = ("mem", "shm", "tcp", "rdma_bnxt", "other")


def _large_pass(i: int) -> bool:
    """Whether pass `i` (1..reps; 0 is the warm-up) samples LARGE too: every other one, so its
    samples spread over the whole probe as the small ones do."""
    return i % 2 == 0


def rounds(world: int) -> list[list[tuple[int, int]]]:
    """Circle-method round robin: each round pairs every rank with at most one other."""
    players = list(range(world)) + ([-1] if world % 2 else [])
    n = len(players)
    out = []
    for _ in range(n - 1):
        out.append([(min(a, b), max(a, b)) for a, b in zip(players[: n // 2], reversed(players[n // 2:])) if -1 not in (a, b)])
        players = [players[0], players[-1], *players[1:-1]]
    return out


async def _exchange(group: Any, peer: int, mine: np.ndarray, into: np.ndarray) -> None:
    """One exchange with `peer` as a step of naive's reducer runs it: both send `mine`, both add what
    arrives into `into`."""
    link = group.links[peer]
    async with anyio.create_task_group() as tg:
        tg.start_soon(link.send, mine)
        async with link.recv() as view:
            np.add(into, np.frombuffer(view, np.float32), out=into)


def _fit(small: list[float], large: list[float], per_alpha: int, per_beta: int, large_bytes: int) -> tuple[float, float]:
    """(α, bandwidth) of t(n) = per_alpha·α + per_beta·nβ from medians at SMALL and `large_bytes`."""
    t_small, t_large = statistics.median(small), statistics.median(large)
    beta = max(t_large - t_small, 1e-12) / (per_beta * (large_bytes - SMALL))   # a noisy large below the small: no slope
    return max(t_small - per_beta * SMALL * beta, 0.0) / per_alpha, 1.0 / beta


def _fit_pieces(samples: dict[int, list[float]], per_alpha: int, per_beta: int) -> tuple[float, float, float, float]:
    """(α, bandwidth) up to MID, on the line through SMALL and MID, then (α, bandwidth) beyond it, on
    the line through SMALL and LARGE: the two segments of `_model`. Both start at SMALL, so α (the
    fixed cost of a message) is never negative; only the rate per byte depends on the size. A line
    through MID and LARGE instead had a negative α here (-0.4 to -1.3 ms), and with it the planner
    chose the in-process ring at 16 MiB (2(g-1)·α, below naive's (g-1)·α) for what is an artefact of
    the fit: it ran 1.56-1.66x its prediction."""
    return (*_fit(samples[SMALL], samples[MID], per_alpha, per_beta, MID),
            *_fit(samples[SMALL], samples[LARGE], per_alpha, per_beta, LARGE))


def _model(kind: str, alpha_lo: float, bw_lo: float, alpha_hi: float, bw_hi: float) -> LinkModel:
    """The planner's link from `_fit_pieces`: messages of at most MID on the first line, larger on the second."""
    return LinkModel(kind, alpha_hi, 1.0 / bw_hi, segments=((float(MID), alpha_lo, 1.0 / bw_lo),))


@dataclass
class _Samples:
    """Each measurement's samples, by byte count: every pair's exchange (by peer), the in-process
    stages (stage 1 read back, stage 3 the copy back), the whole group's naive dist call."""
    exchanges: dict[tuple[int, int], list[float]]
    reduced: dict[int, list[float]]
    back: dict[int, list[float]]
    calls: dict[int, list[float]]


def _sample(group: Any, reps: int, devices: Sequence[str]) -> _Samples:
    """Every pass samples everything in turn (both sizes on every other pass, SMALL on the rest), so a
    burst of load from elsewhere lands on all of them alike: every pair's exchange, then
    scheduler.execute's stages as it runs them: stage 1 (multi.allreduce naive over this rank's
    `devices`, read back), the naive dist.all_reduce of its result right after it with no barrier
    between (so what the call waits for a slower rank's stage 1 is in it, as it is in the job), and
    stage 3 (the result copied to every device). Stages 1 and 3 run only with several devices, the
    exchanges and the call only with several ranks."""
    from tinydist import dist
    from tinydist.frontend.tensor import Tensor
    from tinydist.multi import allreduce
    sizes = SIZES
    mine = {nbytes: np.ones(nbytes // 4, np.float32) for nbytes in sizes}
    into = {nbytes: np.zeros(nbytes // 4, np.float32) for nbytes in sizes}
    local = {nbytes: [Tensor(mine[nbytes], device=d) for d in devices] for nbytes in sizes}
    peers = [b if group.rank == a else a for pairs in rounds(group.world) for a, b in pairs if group.rank in (a, b)]
    got = _Samples({(p, n): [] for p in peers for n in sizes}, {n: [] for n in sizes}, {n: [] for n in sizes},
                   {n: [] for n in sizes})

    def reduce_in_process(inputs: list[Tensor]) -> np.ndarray:
        return allreduce(inputs, "sum", "naive")[0].numpy()

    def across(contribution: np.ndarray) -> np.ndarray:
        return dist.all_reduce(contribution, "sum", algorithm="naive").numpy()   # read back, as execute's stage 2

    def copy_back(total: np.ndarray) -> list[Tensor]:
        return [Tensor(np.ascontiguousarray(total), device=d) for d in devices]

    def timed(samples: list[float], keep: bool, fn: Any, *args: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args)
        if keep:
            samples.append(time.perf_counter() - start)
        return out

    for i in range(reps + 1):                              # pass 0 is the warm-up (kernels compiled, links warm)
        for nbytes in sizes if _large_pass(i) else (SMALL, MID):
            if group.world > 1:
                # every rank starts its exchanges together: without this, a rank's first exchange waited
                # for its peer to finish the copy back before it, and that wait was priced as the link's
                # α (tcp at 8 B, load 7.6-20.7: 0.8-35.9 ms without the barrier, 1.2-7.7 ms with it)
                dist.barrier()
            for peer in peers:                             # the round-robin order: every rank's the same
                # each exchange its own call from this thread, as each collective is: the hop onto the loop counts
                timed(got.exchanges[peer, nbytes], i > 0, dist.run_on_loop, _exchange, group, peer, mine[nbytes], into[nbytes])
            if group.world > 1:
                dist.barrier()
            total = mine[nbytes]
            if len(devices) > 1:
                total = timed(got.reduced[nbytes], i > 0, reduce_in_process, local[nbytes])
            if group.world > 1:
                total = timed(got.calls[nbytes], i > 0, across, total)
            if len(devices) > 1:
                timed(got.back[nbytes], i > 0, copy_back, total)
    return got


def _host_copy() -> tuple[float, float]:
    """(α, bandwidth) of a host copy of LARGE bytes at 1 µs: a process of one device's "mem" link
    (neither in-process stage runs there)."""
    src = np.empty(LARGE // 8)
    dst = np.empty_like(src)
    copies = []
    for _ in range(5):
        start = time.perf_counter()
        np.copyto(dst, src)
        copies.append(time.perf_counter() - start)
    return 1e-6, LARGE / max(statistics.median(copies), 1e-9)


@dataclass
class Measured:
    """What the probe measured: every link of the job, each node's copy back to its devices (the
    planner's `Topology.copy_back`), and a naive dist.all_reduce over the whole group at each of
    SIZES, `(bytes, seconds)` each, the median on the rank that reached it last (the input of
    `tinydist.scheduler.plan.calibrate_call`). `links` are the records the coordinator keeps (the
    line beyond MID); `models` the planner's piecewise links by node pair."""
    links: list[LinkRecord]
    models: dict[tuple[str, str], LinkModel]
    copy_back: dict[str, LinkModel]
    calls: list[tuple[int, float]]


def measure_links(node_ids: list[str], reps: int = 20, devices: Sequence[str] = ()) -> Measured:
    """Every rank calls this (with its own `devices`); returns the measurements of the whole job
    (the same on every rank)."""
    from tinydist import dist
    group = dist.get_group()
    dist.barrier()
    got = _sample(group, reps, devices)
    g = len(devices)
    # the in-process stages fitted to the planner's formulas: stage 1 (g-1)·(α + nγ), stage 3 α + g·nβ
    mem, back = ((_fit_pieces(got.reduced, g - 1, g - 1), _fit_pieces(got.back, 1, g)) if g > 1
                 else (_host_copy() * 2,) * 2)
    calls = [statistics.median(got.calls[n]) for n in SIZES] if group.world > 1 else [0.0] * len(SIZES)
    # per rank: each peer's link (α, bandwidth up to MID, α, bandwidth beyond it, kind), its own mem link,
    # then its dist call times, then its copy back
    row = np.zeros((1, group.world + 2, 5))
    for peer in dict.fromkeys(p for p, _ in got.exchanges):
        pieces = _fit_pieces({n: got.exchanges[peer, n] for n in SIZES}, 1, 1)
        kind = getattr(group.links[peer], "kind", "tcp")
        row[0, peer] = (*pieces, KINDS.index(kind) if kind in KINDS else len(KINDS) - 1)
    row[0, group.rank] = (*mem, 0)
    row[0, group.world, :len(SIZES)] = calls
    row[0, group.world + 1, :4] = back
    table = dist.all_gather(row, axis=0).numpy() if group.world > 1 else row
    records, models = [], {}
    for i in range(group.world):
        for j in range(i, group.world):
            alpha_lo, bw_lo, alpha_hi, bw_hi, kind = (float(x) for x in table[i, j])
            if bw_hi > 0:
                # the coordinator keeps one line per link (LinkRecord): the one beyond MID, through SMALL and LARGE
                records.append(LinkRecord(node_ids[i], node_ids[j], KINDS[int(kind)], alpha_hi, bw_hi))
                models[node_ids[i], node_ids[j]] = _model(KINDS[int(kind)], alpha_lo, bw_lo, alpha_hi, bw_hi)
    copy_back = {node_ids[i]: _model("copy", *(float(x) for x in table[i, group.world + 1, :4])) for i in range(group.world)}
    # the call follows stage 1 with no barrier, so a rank that finished stage 1 early waits in its call for
    # the last one, and that wait is stage 1's, which the planner prices already; the last rank to arrive
    # waits for nobody: its call is the call's own time
    last_to_arrive = table[:, group.world, :len(SIZES)].min(axis=0)
    return Measured(records, models, copy_back, [(n, float(t)) for n, t in zip(SIZES, last_to_arrive)])
