"""Measure the links of a tinydist.dist group as the allreduce stages use them (the planner's α and β).

Between ranks: an exchange (both ranks of a pair send n bytes, receive n and add them in, as every
step of naive, ring and all2all does), each one a separate call from this thread onto the group's
loop (as every collective is), at 8 B (α) and 4 MiB (β = the extra time per byte). Inside a process with
several devices ("mem", the in-group reduce and the copy back): tinydist.multi.allreduce (naive)
over its devices at 8 B and 4 MiB, fitted to the planner's (g-1)·(α + nβ); with one device, a host
copy. Why not a ping-pong and a memcpy, as before: on two network-namespace hosts over a veth (2
shared cores, bench/cluster.py) the ping-pong's one-way time put a 1 MiB exchange at 0.7 ms where
it took 1.9 ms, and the memcpy priced the in-process stage of 1 MiB at 0.03 ms where
multi.allreduce took 2.3 ms: the plans were predicted 2.4-8x too fast.

Pairs are measured in round-robin rounds (every rank in at most one pair per round), so every rank
runs the same schedule; `measure_links` must be called on every rank, between collectives. The
result is shared with all ranks (an allgather), so every rank plans on the same topology.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import anyio
import numpy as np

from tinydist.scheduler.membership import LinkRecord

# LARGE: one chunk of tinydist.dist's algorithms (CHUNK_BYTES), large enough that neither the kernel's
# socket buffers nor the CPU caches hide the rate (at 1 MiB the probe priced 16 MiB allreduces 2.3x too fast)
SMALL, LARGE = 8, 4 << 20
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


def _fit(small: list[float], large: list[float], per: int, large_bytes: int) -> tuple[float, float]:
    """(α, bandwidth) of t(n) = per·(α + nβ) from medians at SMALL and `large_bytes`."""
    t_small, t_large = statistics.median(small) / per, statistics.median(large) / per
    beta = max(t_large - t_small, 1e-12) / (large_bytes - SMALL)     # a noisy large below the small: no slope
    return max(t_small - SMALL * beta, 0.0), 1.0 / beta


def _between_ranks(group: Any, reps: int) -> dict[int, tuple[float, float]]:
    from tinydist import dist
    out: dict[int, tuple[float, float]] = {}
    for pairs in rounds(group.world):
        for a, b in pairs:
            if group.rank not in (a, b):
                continue
            peer = b if group.rank == a else a
            timed: dict[int, list[float]] = {}
            for nbytes, count in ((SMALL, reps), (LARGE, max(3, reps // 4))):
                mine, into = np.ones(nbytes // 4, np.float32), np.zeros(nbytes // 4, np.float32)
                timed[nbytes] = []
                for _ in range(count):
                    # each exchange its own call from this thread, as each collective is: the hop onto the loop counts
                    start = time.perf_counter()
                    dist.run_on_loop(_exchange, group, peer, mine, into)
                    timed[nbytes].append(time.perf_counter() - start)
            out[peer] = _fit(timed[SMALL], timed[LARGE], 1, LARGE)
    return out


def _in_process(devices: Sequence[str], reps: int) -> tuple[float, float]:
    """The in-process link: multi.allreduce (naive) over `devices`, as stage 1 runs it and reads it back;
    with fewer than two devices (nothing to reduce) a host copy of LARGE bytes at 1 µs."""
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
    timed: dict[int, list[float]] = {}
    for nbytes in (SMALL, LARGE):
        inputs = [Tensor(np.zeros(nbytes // 4, np.float32), device=d) for d in devices]
        allreduce(inputs, "sum", "naive")[0].numpy()          # warm-up: the kernels compiled once
        timed[nbytes] = []
        for _ in range(max(3, reps // 4)):
            start = time.perf_counter()
            allreduce(inputs, "sum", "naive")[0].numpy()
            timed[nbytes].append(time.perf_counter() - start)
    return _fit(timed[SMALL], timed[LARGE], len(devices) - 1, LARGE)


def measure_links(node_ids: list[str], reps: int = 20, devices: Sequence[str] = ()) -> list[LinkRecord]:
    """Every rank calls this (with its own `devices`); returns the measured links of the whole job
    (the same list on every rank)."""
    from tinydist import dist
    group = dist.get_group()
    dist.barrier()
    mine = _between_ranks(group, reps) if group.world > 1 else {}
    mem_lat, mem_bw = _in_process(devices, reps)
    row = np.zeros((1, group.world, 3))
    for peer, (lat, bw) in mine.items():
        kind = getattr(group.links[peer], "kind", "tcp")
        row[0, peer] = (lat, bw, KINDS.index(kind) if kind in KINDS else len(KINDS) - 1)
    row[0, group.rank] = (mem_lat, mem_bw, 0)
    table = dist.all_gather(row, axis=0).numpy() if group.world > 1 else row
    records = []
    for i in range(group.world):
        for j in range(i, group.world):
            lat, bw, kind = table[i, j]
            if bw > 0:
                records.append(LinkRecord(node_ids[i], node_ids[j], KINDS[int(kind)], float(lat), float(bw)))
    return records
