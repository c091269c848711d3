"""Cluster membership: who is in, with which devices, and who is dead. Pure logic, clock injected.

The gRPC coordinator (scheduler.coordinator) wraps one `Membership` with the wall clock; the
simulated cluster (scheduler.sim) drives the same class with a virtual clock, 1,024 nodes at once.

- `join` gives a node its rank (the one it asked for, e.g. SLURM_PROCID / the pod index, or the
  lowest free one) and an incarnation number. A node that joins again under the same id (a restart,
  a replacement) supersedes the old incarnation, whose heartbeats are then refused.
- `heartbeat` records liveness and measured links and returns the dead members.
- `sweep` declares dead every member not heard from for `miss_limit` heartbeat intervals.
- `leave` marks a member as left (a clean exit; not a failure).
- `join(..., incarnation=N)` re-registers a node that lost its coordinator: it keeps the rank and
  incarnation it had, without an epoch bump when the coordinator still knows it (recovered from its
  journal), or enters the membership under them when it does not (a coordinator without state).

Elastic rendezvous (`rendezvous` / `round_result`, torchelastic's rounds): a job whose world size
may change asks for a round with min/max sizes. A round counts only the incarnations that asked
for it since it opened, so a restarted job is never handed a table naming the crashed job's
incarnations (which stay "alive" here until their heartbeats are missed). It closes at max_size,
or once min_size are in and `last_call` seconds passed without another arrival; a participant that
dies, leaves or is superseded while it is open drops out. Once closed it is the job's world: its
members get ranks 0..n-1 in the order of their join ranks. An incarnation not in the closed round
(a restarted process, a new node) opens the next round; the running members join it when they
restart. Rounds live in memory only: a coordinator restarted mid-round opens a fresh one when the
nodes ask again.

With a `store` (scheduler.store: the journal of scheduler.journal, or etcd), every change is
appended (membership changes fsynced) before the method returns, and `recover()` rebuilds members, ranks, incarnations, epoch, world size and
links from the snapshot and the records after it. Recovered live members count as seen at recovery
plus one extra `dead_after`: they get twice the usual window to re-register, since their nodes are
backing off while the coordinator was away (scheduler.node).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tinydist.scheduler.errors import MembershipError
from tinydist.scheduler.store import MembershipStore
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
class Round:
    number: int
    opened_at: float
    min_size: int
    max_size: int
    last_call: float
    participants: dict[str, int] = field(default_factory=dict)    # node id -> incarnation, in arrival order
    last_arrival: float = 0.0
    ranks: dict[str, int] | None = None                           # round rank of each member, once closed

    @property
    def closed(self) -> bool:
        return self.ranks is not None


@dataclass
class Membership:
    heartbeat_interval: float = 1.0
    miss_limit: int = 5
    clock: Callable[[], float] = time.monotonic
    members: dict[str, MemberRecord] = field(default_factory=dict)
    links: dict[tuple[str, str], LinkRecord] = field(default_factory=dict)
    epoch: int = 0
    world_size: int = 0
    store: MembershipStore | None = None
    _by_rank: dict[int, str] = field(default_factory=dict)
    round: Round | None = None

    @property
    def dead_after(self) -> float:
        return self.heartbeat_interval * self.miss_limit

    # ---- node calls ------------------------------------------------------------------------

    def join(self, node_id: str, host_key: str, devices: list[str], transports: tuple[str, ...] = ("mem", "shm", "tcp"),
             rank: int = -1, world_size: int = 0, info: dict[str, Any] | None = None,
             incarnation: int = 0) -> MemberRecord:
        if not node_id:
            raise MembershipError("a node must have a non-empty id")
        if world_size:
            if self.world_size and self.alive_count() and world_size != self.world_size:
                raise MembershipError(f"node {node_id} expects world size {world_size}, the cluster has {self.world_size}")
            self.world_size = world_size
        old = self.members.get(node_id)
        if incarnation and old is not None:
            return self._resume(old, rank, incarnation, info)
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
            removed = [holder]
        else:
            removed = []
        if old is not None and old.rank != rank:
            self._by_rank.pop(old.rank, None)
        # a re-registering node unknown here keeps its incarnation; later ones must stay above it
        self.epoch = max(self.epoch, incarnation) + 1
        record = MemberRecord(node_id, rank, host_key, list(devices), tuple(transports), dict(info or {}),
                              incarnation=incarnation or self.epoch, last_seen=self.clock())
        self.members[node_id] = record
        self._by_rank[rank] = node_id
        self._persist(members=[record], removed=removed)
        return record

    def _resume(self, old: MemberRecord, rank: int, incarnation: int, info: dict[str, Any] | None) -> MemberRecord:
        """A known node re-registering after an outage: the same incarnation, rank and state, or refused."""
        if old.incarnation != incarnation:
            raise MembershipError(f"node {old.node_id} incarnation {incarnation} was superseded by {old.incarnation}")
        if old.state != "alive":
            raise MembershipError(f"node {old.node_id} was declared {old.state}: {old.reason}")
        if rank >= 0 and rank != old.rank:
            raise MembershipError(f"node {old.node_id} re-registers as rank {rank}, but holds rank {old.rank}")
        old.last_seen = self.clock()
        if info:
            old.info.update(info)
        return old

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
        if links:
            self._persist(links=list(links), sync=False)    # a measurement the next report repeats
        return self.dead()

    def leave(self, node_id: str) -> None:
        record = self.members.get(node_id)
        if record is not None and record.state == "alive":
            record.state, record.reason = "left", "left cleanly"
            self.epoch += 1
            self._persist(members=[record])

    # ---- elastic rendezvous ------------------------------------------------------------------

    def rendezvous(self, node_id: str, incarnation: int, min_size: int, max_size: int, last_call: float,
                   info: dict[str, Any] | None = None) -> Round:
        """Enter this incarnation into the current round, or the next one (module docstring).
        Returns the round it is in, closed or still open (`round_result` once closed)."""
        record = self.members.get(node_id)
        if record is None or record.incarnation != incarnation or record.state != "alive":
            held = "not a member" if record is None else f"incarnation {record.incarnation}, {record.state}"
            raise MembershipError(f"node {node_id} incarnation {incarnation} cannot enter a rendezvous round: the "
                                  f"coordinator holds it as {held}; join first")
        if not 1 <= min_size <= max_size:
            raise MembershipError(f"node {node_id}: rendezvous sizes min {min_size}, max {max_size}: need "
                                  f"1 <= min <= max")
        if last_call < 0:
            raise MembershipError(f"node {node_id}: last call {last_call:g} s must be >= 0")
        if info:
            record.info.update(info)
        r = self.round
        if r is not None and r.participants.get(node_id) == incarnation:
            return r                                 # asked again (a retry): the same round
        now = self.clock()
        if r is None or r.closed:
            r = self.round = Round((r.number if r else 0) + 1, now, min_size, max_size, last_call)
        elif (r.min_size, r.max_size) != (min_size, max_size):
            raise MembershipError(f"node {node_id} asks for a round of {min_size}..{max_size} members, round "
                                  f"{r.number} is for {r.min_size}..{r.max_size}: every member must ask for the same")
        r.participants.pop(node_id, None)            # an older incarnation of the same node gives way
        r.participants[node_id] = incarnation
        r.last_arrival = now
        self.close_round()
        return r

    def close_round(self) -> bool:
        """Drop participants no longer alive under their incarnation; close the open round at max
        size, or at min size once last call has passed. Returns whether it is closed."""
        r = self.round
        if r is None:
            return False
        if r.closed:
            return True
        for node_id, inc in list(r.participants.items()):
            record = self.members.get(node_id)
            if record is None or record.incarnation != inc or record.state != "alive":
                del r.participants[node_id]
        n = len(r.participants)
        if n >= r.max_size or (n >= r.min_size and self.clock() - r.last_arrival >= r.last_call):
            order = sorted(r.participants, key=lambda node: (self.members[node].rank, node))
            r.ranks = {node: i for i, node in enumerate(order)}
        return r.closed

    def round_members(self, ranks: dict[str, int]) -> list[MemberRecord]:
        """A closed round's members (its `ranks`, node id -> round rank) in round-rank order."""
        return [self.members[node] for node in sorted(ranks, key=ranks.__getitem__)]

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
            self._persist(members=newly)
        return newly

    # ---- persistence ---------------------------------------------------------------------------

    def _persist(self, *, members: list[MemberRecord] = (), removed: list[str] = (),  # type: ignore[assignment]
                 links: list[LinkRecord] = (), sync: bool = True) -> None:  # type: ignore[assignment]
        if self.store is None:
            return
        self.store.append({"epoch": self.epoch, "world_size": self.world_size,
                             "members": [_member_state(r) for r in members], "removed": list(removed),
                             "links": [vars(x) for x in links]}, sync=sync)
        if self.store.due():
            self.store.compact(self.state())

    def state(self) -> dict[str, Any]:
        """Everything recovery needs, as JSON-ready data (the journal's snapshot)."""
        return {"epoch": self.epoch, "world_size": self.world_size,
                "members": [_member_state(r) for r in self.ordered()], "links": [vars(x) for x in self.links.values()]}

    def recover(self) -> int:
        """Load the store (snapshot + records) into this empty membership, then compact it.
        Returns how many records were replayed after the snapshot."""
        if self.store is None:
            return 0
        snapshot, records = self.store.load()
        seen = self.clock() + self.dead_after              # twice the window to re-register (module docstring)
        for change in ([snapshot] if snapshot else []) + records:
            self.epoch, self.world_size = int(change["epoch"]), int(change["world_size"])
            for node_id in change.get("removed", []):
                gone = self.members.pop(node_id, None)
                if gone is not None and self._by_rank.get(gone.rank) == node_id:
                    del self._by_rank[gone.rank]
            for m in change.get("members", []):
                old = self.members.get(m["node_id"])
                if old is not None and old.rank != m["rank"] and self._by_rank.get(old.rank) == old.node_id:
                    del self._by_rank[old.rank]
                self.members[m["node_id"]] = MemberRecord(
                    m["node_id"], int(m["rank"]), m["host_key"], list(m["devices"]), tuple(m["transports"]),
                    dict(m["info"]), int(m["incarnation"]), last_seen=seen, state=m["state"], reason=m["reason"])
                self._by_rank[int(m["rank"])] = m["node_id"]
            for x in change.get("links", []):
                self.links[(x["src"], x["dst"])] = LinkRecord(**x)
        self.store.compact(self.state())
        return len(records)

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


def _member_state(r: MemberRecord) -> dict[str, Any]:
    # last_seen / died_at are this process's monotonic clock: meaningless after a restart
    return {"node_id": r.node_id, "rank": r.rank, "host_key": r.host_key, "devices": list(r.devices),
            "transports": list(r.transports), "info": dict(r.info), "incarnation": r.incarnation,
            "state": r.state, "reason": r.reason}
