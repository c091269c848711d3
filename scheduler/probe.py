"""Measure the links of a tinydist.dist group: latency (ping-pong of 8 bytes) and bandwidth (1 MiB).

Pairs are measured in round-robin rounds (every rank in at most one pair per round), so every rank
runs the same schedule; `measure_links` must be called on every rank, between collectives. The
result is shared with all ranks (an allgather), so every rank plans on the same topology.
In-process ("mem") links are measured as a host copy of the same size.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from tinydist.scheduler.membership import LinkRecord

SMALL, LARGE = 8, 1 << 20
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


async def _pingpong(group: Any, peer: int, first: bool, nbytes: int, reps: int) -> list[float]:
    link = group.links[peer]
    buf = bytearray(nbytes)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        if first:
            await link.send(buf)
            async with link.recv() as view:
                pass
        else:
            async with link.recv() as view:
                n = len(view)
            await link.send(buf[:n] if n != nbytes else buf)
        times.append(time.perf_counter() - start)
    return times


async def _measure(group: Any, reps: int) -> dict[int, tuple[float, float]]:
    out: dict[int, tuple[float, float]] = {}
    for pairs in rounds(group.world):
        for a, b in pairs:
            if group.rank not in (a, b):
                continue
            peer = b if group.rank == a else a
            first = group.rank == a
            small = await _pingpong(group, peer, first, SMALL, reps)
            large = await _pingpong(group, peer, first, LARGE, max(3, reps // 4))
            latency = statistics.median(small) / 2
            per_large = statistics.median(large) / 2
            out[peer] = (latency, LARGE / max(per_large - latency, 1e-9))
    return out


def measure_links(node_ids: list[str], reps: int = 20) -> list[LinkRecord]:
    """Every rank calls this; returns the measured links of the whole job (the same list on every rank)."""
    from tinydist import dist
    group = dist.get_group()
    dist.barrier()
    mine = dist.run_on_loop(_measure, group, reps) if group.world > 1 else {}
    src = np.empty(LARGE // 8)
    dst = np.empty_like(src)
    copies = []
    for _ in range(5):
        start = time.perf_counter()
        np.copyto(dst, src)
        copies.append(time.perf_counter() - start)
    mem_bw = LARGE / max(statistics.median(copies), 1e-9)
    row = np.zeros((1, group.world, 3))
    for peer, (lat, bw) in mine.items():
        kind = getattr(group.links[peer], "kind", "tcp")
        row[0, peer] = (lat, bw, KINDS.index(kind) if kind in KINDS else len(KINDS) - 1)
    row[0, group.rank] = (1e-6, mem_bw, 0)
    table = dist.all_gather(row, axis=0).numpy() if group.world > 1 else row
    records = []
    for i in range(group.world):
        for j in range(i, group.world):
            lat, bw, kind = table[i, j]
            if bw > 0:
                records.append(LinkRecord(node_ids[i], node_ids[j], KINDS[int(kind)], float(lat), float(bw)))
    return records
