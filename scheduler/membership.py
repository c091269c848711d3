"""Cluster membership: who is in, with which devices, and who is dead. Pure logic, clock injected.

The gRPC coordinator (scheduler.coordinator) wraps one `Membership` with the wall clock; the
simulated cluster (scheduler.sim) drives the same class with a virtual clock, 1,024 nodes at once.

- `join` gives a node its rank (the one it asked for, e.g. SLURM_PROCID / the pod index, or the
  lowest free one) and an incarnation number. A node that joins again under the same id (a restart,
  a replacement) supersedes the old incarnation, whose heartbeats are then refused.
- `heartbeat` records liveness and measured links and returns the dead members.
- `sweep` declares dead every member not heard from for `miss_limit` heartbeat intervals.
- `leave` marks a member as left (a clean exit; not a failure).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tinydist.scheduler.errors import MembershipError
from tinydist.scheduler.topology import LinkModel, NodeSpec, Topology


@dataclass
class MemberRecord:
    node_id: str
    rank: int
    host_key: str
    devices: list[str]
    transports: tuple[str, ...]
    info: dict[str, Any]
    incarnation: int
    last_seen: float
    state: str = "alive"            # alive | dead | left
    reason: str = ""
    died_at: float | None = None


@dataclass
class LinkRecord:
    src: str
    dst: str
    kind: str
    latency_s: float
    bandwidth_bps: float


@dataclass
class Membership:
    heartbeat_interval: float = 1.0
    miss_limit: int = 5
    clock: Callable[[], float] = time.monotonic
    members: dict[str, MemberRecord] = field(default_factory=dict)
    links: dict[tuple[str, str], LinkRecord] = field(default_factory=dict)
    epoch: int = 0
    world_size: int = 0
    _by_rank: dict[int, str] = field(default_factory=dict)

    @property
    def dead_after(self) -> float:
        return self.heartbeat_interval * self.miss_limit

    # ---- node calls ------------------------------------------------------------------------

    def join(self, node_id: str, host_key: str, devices: list[str], transports: tuple[str, ...] = ("mem", "shm", "tcp"),
             rank: int = -1, world_size: int = 0, info: dict[str, Any] | None = None) -> MemberRecord:
        if not node_id:
            raise MembershipError("a node must have a non-empty id")
        if world_size:
            if self.world_size and self.alive_count() and world_size != self.world_size:
                raise MembershipError(f"node {node_id} expects world size {world_size}, the cluster has {self.world_size}")
            self.world_size = world_size
        old = self.members.get(node_id)
        if rank < 0:
            rank = old.rank if old is not None else self._free_rank()
        if self.world_size and not 0 <= rank < self.world_size:
            raise MembershipError(f"node {node_id}: rank {rank} is outside 0..{self.world_size - 1}")
        holder = self._by_rank.get(rank)
        if holder is not None and holder != node_id:
            current = self.members[holder]
            if current.state == "alive":
                raise MembershipError(f"node {node_id} asks for rank {rank}, held by live node {holder}")
            del self.members[holder]          # a replacement takes a dead or departed node's rank
        if old is not None and old.rank != rank:
            self._by_rank.pop(old.rank, None)
        self.epoch += 1
        record = MemberRecord(node_id, rank, host_key, list(devices), tuple(transports), dict(info or {}),
                              incarnation=self.epoch, last_seen=self.clock())
        self.members[node_id] = record
        self._by_rank[rank] = node_id
        return record

    def heartbeat(self, node_id: str, incarnation: int, links: list[LinkRecord] = ()) -> list[MemberRecord]:  # type: ignore[assignment]
        record = self.members.get(node_id)
        if record is None:
            raise MembershipError(f"node {node_id} is not a member; join first")
        if record.incarnation != incarnation:
            raise MembershipError(f"node {node_id} incarnation {incarnation} was superseded by {record.incarnation}")
        if record.state != "alive":
            raise MembershipError(f"node {node_id} was declared {record.state}: {record.reason}")
        record.last_seen = self.clock()
        for link in links:
            self.links[(link.src, link.dst)] = link
        return self.dead()

    def leave(self, node_id: str) -> None:
        record = self.members.get(node_id)
        if record is not None and record.state == "alive":
            record.state, record.reason = "left", "left cleanly"
            self.epoch += 1

    # ---- coordinator calls -------------------------------------------------------------------

    def sweep(self) -> list[MemberRecord]:
        """Declare dead every live member silent for longer than miss_limit intervals."""
        now = self.clock()
        newly = []
        for record in self.members.values():
            if record.state == "alive" and now - record.last_seen > self.dead_after:
                record.state = "dead"
                record.died_at = now
                record.reason = (f"missed {self.miss_limit} heartbeats (last seen {now - record.last_seen:.2f} s ago, "
                                 f"interval {self.heartbeat_interval:g} s)")
                newly.append(record)
        if newly:
            self.epoch += 1
        return newly

    def dead(self) -> list[MemberRecord]:
        return [r for r in self.members.values() if r.state == "dead"]

    def alive_count(self) -> int:
        return sum(1 for r in self.members.values() if r.state == "alive")

    def ready(self, world_size: int) -> bool:
        ranks = {r.rank for r in self.members.values() if r.state == "alive"}
        return all(rank in ranks for rank in range(world_size))

    def ordered(self) -> list[MemberRecord]:
        return sorted(self.members.values(), key=lambda r: r.rank)

    def _free_rank(self) -> int:
        rank = 0
        while rank in self._by_rank and self.members[self._by_rank[rank]].state == "alive":
            rank += 1
        return rank

    def topology(self) -> Topology:
        nodes = [NodeSpec(r.node_id, r.rank, r.host_key, r.devices, r.transports, alive=r.state == "alive")
                 for r in self.ordered() if r.state != "left"]
        topo = Topology(nodes, epoch=self.epoch)
        for link in self.links.values():
            if link.bandwidth_bps > 0 and link.src in self.members and link.dst in self.members:
                topo.set_measured(link.src, link.dst, LinkModel(link.kind, link.latency_s, 1.0 / link.bandwidth_bps))
        return topo
