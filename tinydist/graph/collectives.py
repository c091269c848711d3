"""Collective algorithms: their names, how a length splits into shards, and the one rule that picks one.

Three places run an allreduce, each over its own medium:

    devices   the devices of one process (tinydist.multi): graph ops; `direct` between peers
    shm       processes on one host (tinydist.dist over its shared-memory group segment)
    network   processes on several hosts (tinydist.dist over TCP or RDMA links)

and the cluster planner (scheduler.plan) picks the in-group and across-group algorithms of a
hierarchical allreduce from its α–β cost model. All of them ask `choose(medium, world, nbytes,
topology)` for `auto`, and `resolve(...)` for a call's `algorithm=` (explicit, else
TINYDIST_ALLREDUCE, else `choose`), so one set of inputs gets one algorithm wherever it is asked.

Shards: `shard_bounds(n, parts)` is numpy.array_split's rule (the first n % parts shards one longer),
used for MultiTensor shards, data-parallel batches, the chunks of ring and all2all in both
tinydist.multi and tinydist.dist, reduce_scatter's pieces and the ranges of a direct allreduce.
"""

from __future__ import annotations

import enum
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from tinydist.base.config import settings


class Algorithm(str, enum.Enum):
    """An allreduce algorithm; a `str` enum, so `Algorithm.RING == "ring"` and headers carry the name."""

    DIRECT = "direct"      # devices of one peer group: each reduces its range of every input in place (2·N·S bytes)
    NAIVE = "naive"        # every participant reduces all N inputs: one step
    RING = "ring"          # reduce-scatter then allgather around a ring: 2(N-1) steps of S/N
    ALL2ALL = "all2all"    # participant i reduces shard i reading everyone, then all gather the shards

    def __str__(self) -> str:
        return self.value


class Medium(str, enum.Enum):
    DEVICES = "devices"
    SHM = "shm"
    NETWORK = "network"

    def __str__(self) -> str:
        return self.value


AUTO = "auto"
# Every algorithm runs on every medium but one: `direct` reads and writes other devices' memory, so
# only the devices of one process (one peer group) have it.
LEGAL: dict[Medium, tuple[Algorithm, ...]] = {
    Medium.DEVICES: (Algorithm.DIRECT, Algorithm.NAIVE, Algorithm.RING, Algorithm.ALL2ALL),
    Medium.SHM: (Algorithm.NAIVE, Algorithm.RING, Algorithm.ALL2ALL),
    Medium.NETWORK: (Algorithm.NAIVE, Algorithm.RING, Algorithm.ALL2ALL),
}
_LEGAL_BY_NAME: dict[Medium, dict[str, Algorithm]] = {m: {a.value: a for a in legal} for m, legal in LEGAL.items()}

# ---- thresholds of the rule (bytes of the whole tensor), measured -------------------------------
# devices: below this the extra graph of all2all (N chunks, N gathers: milliseconds of Python at 4
# devices) costs more than the traffic it saves (bench/multidevice.py: 2**21 float32 elements).
DEVICES_ALL2ALL_MIN_BYTES = 8 << 20
# network: one naive step of small messages beats ring's 2(N-1) steps (bench/allreduce.py).
NETWORK_SMALL_BYTES = 64 * 1024
# shm: naive's single step beats all2all's two while every rank has a CPU up to SHM_SMALL_BYTES
# (2 ranks, 2 vCPUs: 64 KiB naive 0.043 ms vs all2all 0.051; 256 KiB 0.096 vs 0.076; 1 MiB 0.17 vs 0.11),
# and, where ranks outnumber CPUs and every step waits for the scheduler to run them all, up to
# SHM_CROWDED_SMALL_BYTES (4 ranks, 2 vCPUs: 512 KiB 0.45 vs 0.63 ms; 1 MiB 0.49-0.72 vs 0.45-0.52).
# Past it all2all's smaller share of the work wins, as the ranks take turns on the CPUs: at 1 MiB each
# rank of naive reads 4 MiB, of all2all 1 MiB (plus 3/4 MiB in and out), and the CPU time of a call
# summed over the 4 ranks (counted, paired call by call in one job, 3 jobs at load 12-14) was
# all2all 1.51 / 1.31 / 2.06 ms against naive 1.95 / 1.73 / 2.03 (768 KiB: 1.14 / 1.04 / 1.80 vs
# 1.28 / 1.22 / 1.68); naive's 1 MiB missed Open MPI on an idle machine (0.657 vs 0.503 ms).
SHM_SMALL_BYTES = 128 * 1024
SHM_CROWDED_SMALL_BYTES = 512 * 1024


@dataclass(frozen=True)
class Topology:
    """What a choice depends on besides the medium, the participants and the bytes.

    `peers`: (devices) every input lives on one peer group and needs no gradient, so `direct` can run.
    `cpus`: (shm) the host's CPU count (the same for every rank of the host); None reads os.cpu_count().
    `modelled_s`: a cost model's seconds per runnable algorithm (the planner's α–β model over the
    measured links); when given, the cheapest of them is chosen, whatever the medium.
    """

    peers: bool = False
    cpus: int | None = None
    modelled_s: Mapping[str, float] = field(default_factory=dict)


def check(requested: str, medium: Medium, *, what: str = "allreduce algorithm") -> Algorithm | None:
    """`requested` as an Algorithm legal on `medium` (None for auto), or a ValueError naming the choices."""
    if requested == AUTO:
        return None
    algorithm = _LEGAL_BY_NAME[medium].get(requested) if isinstance(requested, str) else None
    if algorithm is not None:    # every collective's case: a dict lookup, not enum's Python __call__
        return algorithm
    legal = LEGAL[medium]
    try:
        algorithm = Algorithm(requested)
    except ValueError:
        raise ValueError(f"unknown {what} {requested!r}; choose one of {', '.join(legal)} or 'auto'") from None
    if algorithm not in legal:
        raise ValueError(f"{what} {requested!r} does not run on {medium} (it reads and writes other devices' memory, "
                         f"only devices of one process have it); choose one of {', '.join(legal)} or 'auto'")
    return algorithm


@functools.cache
def host_cpus() -> int:
    """This host's CPU count, read once: `os.cpu_count()` costs ~6 us here (measured: 6.3 us a call,
    a sixth of a 4 KiB two-process allreduce), and `choose` asks on every collective."""
    return os.cpu_count() or 1


def choose(medium: Medium, world: int, nbytes: int, topology: Topology = Topology()) -> tuple[Algorithm, str]:
    """The algorithm `auto` picks for an allreduce of `nbytes` among `world` participants, and why.
    Deterministic in its inputs, so every rank (and every caller) asked the same question agrees.

    With a cost model (`topology.modelled_s`), its cheapest algorithm (ties by name). Otherwise the
    measured rule (bench/multidevice.py, bench/allreduce.py, docs/collectives.md):
      devices  `direct` where it can run (peers): the 2·N·S traffic floor, one kernel per device at
               every size; else naive for two devices (N·(N+1) = 6 < 3·N+1 = 7 bytes of traffic per
               input byte) or small inputs (one kernel per device), all2all beyond (traffic linear in N)
      shm      naive for small messages (one step; each rank reads every input), else all2all: each
               rank reduces 1/N of the data straight from the peers' memory (at 4-8 MiB naive is
               1.7-2.2x slower)
      network  naive for small messages (one step instead of 2(N-1)), else ring (bandwidth-optimal)
    """
    if topology.modelled_s:
        costs = {Algorithm(name): seconds for name, seconds in topology.modelled_s.items()}
        winner = min(costs, key=lambda a: (costs[a], a.value))
        others = sorted((seconds, a.value) for a, seconds in costs.items() if a is not winner)
        reason = f"cheapest under the cost model ({costs[winner]:.3g} s"
        return winner, reason + (f" vs {others[0][1]} {others[0][0]:.3g} s)" if others else ")")
    if world <= 1:
        return Algorithm.NAIVE, "one participant"
    if medium is Medium.DEVICES:
        if topology.peers:
            return Algorithm.DIRECT, "one peer group: each device reduces its range of every input in place"
        if world <= 2:
            return Algorithm.NAIVE, "two devices: naive moves 6 bytes per input byte, all2all 7"
        if nbytes < DEVICES_ALL2ALL_MIN_BYTES:
            return Algorithm.NAIVE, f"{nbytes} B < {DEVICES_ALL2ALL_MIN_BYTES} B: all2all's extra graph costs more than it saves"
        return Algorithm.ALL2ALL, "traffic linear in the devices, not quadratic"
    if medium is Medium.SHM:
        cpus = host_cpus() if topology.cpus is None else topology.cpus
        small = SHM_CROWDED_SMALL_BYTES if world > cpus else SHM_SMALL_BYTES
        if nbytes <= small:
            return Algorithm.NAIVE, (f"{nbytes} B <= {small} B on shared memory ({world} ranks, {cpus} CPUs): one step, "
                                     f"each rank reads every input")
        return Algorithm.ALL2ALL, "shared memory: each rank reduces 1/N of the data straight from the peers' memory, two steps"
    if nbytes <= NETWORK_SMALL_BYTES:
        return Algorithm.NAIVE, f"{nbytes} B <= {NETWORK_SMALL_BYTES} B: one step of small messages beats 2(N-1) steps"
    return Algorithm.RING, "network: bandwidth-optimal 2(N-1)/N of the bytes, one neighbour per step"


def choose_partitioned(collective: str, medium: Medium, world: int) -> tuple[Algorithm, str]:
    """The algorithm `auto` picks for a reduce_scatter or an all_gather among `world` processes,
    and why: each rank's part goes straight to (or is reduced straight from) every peer in one
    step (`all2all` for reduce_scatter, `direct` for all_gather) on one host, or between two
    ranks, where one step moves no more than a ring would; a ring between more ranks on a network
    (one neighbour per step, (N-1)/N of the bytes each way: the bandwidth-optimal choice)."""
    if collective not in PARTITIONED:
        raise ValueError(f"choose_partitioned is for {' and '.join(PARTITIONED)}, not {collective!r}")
    if medium is Medium.NETWORK and world > 2:
        return Algorithm.RING, f"network, {world} ranks: one neighbour per step, bandwidth-optimal"
    one_step = PARTITIONED[collective]
    where = "two ranks" if medium is Medium.NETWORK else "one host"
    return one_step, f"{where}: one step, each part straight to or from every rank"


def resolve_partitioned(requested: str, collective: str, medium: Medium, world: int) -> tuple[Algorithm, str]:
    """A reduce_scatter's or all_gather's `algorithm=`: itself when explicit (`naive` is the one-step
    algorithm), checked against the medium, else `choose_partitioned`. TINYDIST_ALLREDUCE is the
    allreduce's setting only."""
    forced = check(requested, medium, what=f"{collective} algorithm")
    if forced is None:
        return choose_partitioned(collective, medium, world)
    if forced is Algorithm.NAIVE:
        return PARTITIONED[collective], "requested naive: the one-step algorithm"
    return forced, "requested"


# the one-step algorithm of each partitioned collective (its `naive`)
PARTITIONED = {"reduce_scatter": Algorithm.ALL2ALL, "all_gather": Algorithm.DIRECT}


def resolve(requested: str, medium: Medium, world: int, nbytes: int,
            topology: Topology = Topology()) -> tuple[Algorithm, str]:
    """A call's `algorithm=`: itself when explicit (checked against the medium), else TINYDIST_ALLREDUCE
    when set (checked the same way), else `choose`. `direct` needs `topology.peers`."""
    forced = check(requested, medium)
    reason = "requested"
    if forced is None and settings.ALLREDUCE != AUTO:
        forced, reason = check(settings.ALLREDUCE, medium, what="TINYDIST_ALLREDUCE"), "TINYDIST_ALLREDUCE"
    if forced is None:
        return choose(medium, world, nbytes, topology)
    if forced is Algorithm.DIRECT and not topology.peers:
        raise ValueError("allreduce 'direct' needs inputs on devices of one peer group, without gradients")
    return forced, reason


def shard_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous [start, stop) ranges covering 0..n: numpy.array_split's rule, the first
    n % parts ranges one longer than the rest (so sizes differ by at most one)."""
    if parts < 1:
        raise ValueError(f"cannot split a length into {parts} shards; need at least one")
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def shard_sizes(n: int, parts: int) -> list[int]:
    """The lengths of `shard_bounds(n, parts)`."""
    return [stop - start for start, stop in shard_bounds(n, parts)]
