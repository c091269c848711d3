"""Measure the links of a tinydist.dist group as the allreduce stages use them (the planner's α and β).

Between ranks: an exchange (both ranks of a pair send n bytes, receive n and add them in, as every
step of naive, ring and all2all does), each one a separate call from this thread onto the group's
loop (as every collective is), at 8 B (α) and 16 MiB (β = the extra time per byte). Inside a process
with several devices ("mem"): stages 1 and 3 as scheduler.execute runs them, tinydist.multi.allreduce
(naive) over its devices read back to the host, then the result copied to every device, at 8 B and
16 MiB, fitted to the planner's in-group plus copy-back formulas, g·α + (2g-1)·nβ; with one device
(neither stage runs), a host copy. And, sampled in turn with the exchanges, a real naive
dist.all_reduce over the whole group at both sizes, from which the planner takes what a dist call
costs beyond its links' steps (`tinydist.scheduler.plan.calibrate_call`).

Why 16 MiB, not 4 MiB: 4 MiB buffers stay in this machine's 32 MiB L3, and the rate measured there
does not hold beyond it: on two network-namespace hosts (bench/cluster.py, 2 shared cores) the
in-process stage ran 0.42 ns/B at 4 MiB and 0.92 ns/B at 16 MiB, and the 16 MiB plans were
predicted 2.4-9.8x too fast. Why stages 1 and 3 together: the copy back was priced on the reduce's
rate (0.38 ms predicted, 0.14-17 ms measured); timed with the reduce it is measured too.

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

# LARGE: several chunks of tinydist.dist's algorithms (CHUNK_BYTES), and with the buffers it is reduced
# between beyond a 32 MiB L3, so neither the kernel's socket buffers nor the CPU caches hide the rate
SMALL, LARGE = 8, 16 << 20
KINDS = ("mem", "shm", "tcp", "rdma_bnxt", "other")


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


def _between_ranks(group: Any, reps: int) -> tuple[dict[int, tuple[float, float]], list[float]]:
    """Every pair's exchange and the whole group's naive dist.all_reduce, sampled in turn (one sample
    of each per pass, both sizes), so a burst of load from elsewhere lands on all of them alike:
    ({peer: (α, bandwidth)}, [median call at SMALL, at LARGE])."""
    from tinydist import dist
    mine = {nbytes: np.ones(nbytes // 4, np.float32) for nbytes in (SMALL, LARGE)}
    into = {nbytes: np.zeros(nbytes // 4, np.float32) for nbytes in (SMALL, LARGE)}
    peers = [b if group.rank == a else a for pairs in rounds(group.world) for a, b in pairs if group.rank in (a, b)]
    exchanges: dict[tuple[int, int], list[float]] = {(p, n): [] for p in peers for n in (SMALL, LARGE)}
    calls: dict[int, list[float]] = {SMALL: [], LARGE: []}
    for i in range(reps + 1):                              # pass 0 is the warm-up
        for nbytes in (SMALL, LARGE) if i <= max(3, reps // 4) else (SMALL,):
            for peer in peers:                             # the round-robin order: every rank's the same
                # each exchange its own call from this thread, as each collective is: the hop onto the loop counts
                start = time.perf_counter()
                dist.run_on_loop(_exchange, group, peer, mine[nbytes], into[nbytes])
                if i:
                    exchanges[peer, nbytes].append(time.perf_counter() - start)
            dist.barrier()
            # as scheduler.execute's stage 2 calls it: read back to numpy
            start = time.perf_counter()
            dist.all_reduce(mine[nbytes], "sum", algorithm="naive").numpy()
            if i:
                calls[nbytes].append(time.perf_counter() - start)
    links = {peer: _fit(exchanges[peer, SMALL], exchanges[peer, LARGE], 1, 1, LARGE) for peer in peers}
    return links, [statistics.median(calls[SMALL]), statistics.median(calls[LARGE])]


def _in_process(devices: Sequence[str], reps: int) -> tuple[float, float]:
    """The in-process link: stages 1 and 3 as scheduler.execute runs them, multi.allreduce (naive)
    over `devices` read back to the host, then copied to every device; with fewer than two devices
    (neither stage runs) a host copy of LARGE bytes at 1 µs."""
    if len(devices) < 2:
        src = np.empty(LARGE // 8)
        dst = np.empty_like(src)
        copies = []
        for _ in range(5):
            start = time.perf_counter()
            np.copyto(dst, src)
            copies.append(time.perf_counter() - start)
        return 1e-6, LARGE / max(statistics.median(copies), 1e-9)
    from tinydist.frontend.tensor import Tensor
    from tinydist.multi import allreduce

    def stages(inputs: list[Tensor]) -> None:
        total = allreduce(inputs, "sum", "naive")[0].numpy()
        [Tensor(np.ascontiguousarray(total), device=d) for d in devices]

    timed: dict[int, list[float]] = {}
    for nbytes in (SMALL, LARGE):
        inputs = [Tensor(np.zeros(nbytes // 4, np.float32), device=d) for d in devices]
        stages(inputs)                                         # warm-up: the kernels compiled once
        timed[nbytes] = []
        for _ in range(max(3, reps // 4)):
            start = time.perf_counter()
            stages(inputs)
            timed[nbytes].append(time.perf_counter() - start)
    g = len(devices)
    return _fit(timed[SMALL], timed[LARGE], g, 2 * g - 1, LARGE)


@dataclass
class Measured:
    """What the probe measured: every link of the job, and a naive dist.all_reduce over the whole
    group at SMALL and at LARGE, `(bytes, seconds)` each, the median on the slowest rank (the input
    of `tinydist.scheduler.plan.calibrate_call`)."""
    links: list[LinkRecord]
    call_small: tuple[int, float]
    call_large: tuple[int, float]


def measure_links(node_ids: list[str], reps: int = 20, devices: Sequence[str] = ()) -> Measured:
    """Every rank calls this (with its own `devices`); returns the measurements of the whole job
    (the same on every rank)."""
    from tinydist import dist
    group = dist.get_group()
    dist.barrier()
    mine, calls = _between_ranks(group, reps) if group.world > 1 else ({}, [0.0, 0.0])
    mem_lat, mem_bw = _in_process(devices, reps)
    row = np.zeros((1, group.world + 1, 3))
    for peer, (lat, bw) in mine.items():
        kind = getattr(group.links[peer], "kind", "tcp")
        row[0, peer] = (lat, bw, KINDS.index(kind) if kind in KINDS else len(KINDS) - 1)
    row[0, group.rank] = (mem_lat, mem_bw, 0)
    row[0, group.world, :2] = calls                       # the last column: this rank's dist call times
    table = dist.all_gather(row, axis=0).numpy() if group.world > 1 else row
    records = []
    for i in range(group.world):
        for j in range(i, group.world):
            lat, bw, kind = table[i, j]
            if bw > 0:
                records.append(LinkRecord(node_ids[i], node_ids[j], KINDS[int(kind)], float(lat), float(bw)))
    slowest = table[:, group.world, :2].max(axis=0)
    return Measured(records, (SMALL, float(slowest[0])), (LARGE, float(slowest[1])))
