"""The cluster as the planner sees it: nodes, their devices, peer groups and modelled links.

A *node* is one process that owns devices (a `tinydist node` / a rank of a job). Devices of one
node share its memory; nodes on one host (same host key: hostname + boot id) reach each other
through shared memory. A *peer group* is the set of devices that reach each other's memory
directly: the devices of every node on one host. Groups are linked by network transports (TCP, or
BNXT RDMA where both ends have it).

Every link kind has an α–β model (`LinkModel`): sending n bytes costs α + n·β, and each extra
message a sender injects at once costs `overhead` (the per-message gap). Defaults are rough
figures; measured values (`tinydist.scheduler.probe`, reported to the coordinator) replace them per pair.

Measured links are piecewise: the probe times every link at 8 B, 1 MiB and 16 MiB, and a message
of at most 1 MiB is priced on the line through 8 B and 1 MiB, a larger one on the line through 8 B
and 16 MiB (`LinkModel.segments`, `LinkModel.at`): one α, the rate per byte by size. One line
through 8 B and 16 MiB priced 1 MiB at the rate of buffers beyond the CPU caches, which a 1 MiB
message does not pay (scheduler.probe, "Why three sizes"; docs/cluster.md).

`Topology.call` is what one tinydist.dist collective costs on top of its links' steps: the header
exchange that opens every call, its timeout guard, and the result's allocation and copy out (α per
call, β per byte of the tensor). Measured at join (`tinydist.scheduler.plan.calibrate_call`); zero
in a topology nobody measured (the simulated cluster).

`Topology.copy_back` is each node's last stage, the reduced host result copied to every one of its
devices (α + g·nβ), measured at join apart from the reduce (the "mem" link) because the two run at
different rates per byte; a node nobody measured is priced on its group's link.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LinkModel:
    kind: str
    alpha: float          # seconds per message (latency)
    beta: float           # seconds per byte (1 / bandwidth)
    overhead: float = 0.0  # seconds per additional message injected concurrently by one sender
    # (up to bytes, α, β) for messages of at most that many bytes, ascending; alpha and beta above are
    # the last segment's (beyond every bound): the probe's piecewise fit (module docstring)
    segments: tuple[tuple[float, float, float], ...] = ()

    def at(self, nbytes: float) -> LinkModel:
        """The (α, β) that prices a message of `nbytes`: the first segment that holds it, else the last."""
        for bound, alpha, beta in self.segments:
            if nbytes <= bound:
                return LinkModel(self.kind, alpha, beta, self.overhead)
        return LinkModel(self.kind, self.alpha, self.beta, self.overhead) if self.segments else self

    def time(self, nbytes: float, messages: int = 1) -> float:
        link = self.at(nbytes)
        return link.alpha + nbytes * link.beta + max(0, messages - 1) * link.overhead

    @property
    def bandwidth(self) -> float:
        return 1.0 / self.beta if self.beta > 0 else math.inf

    def describe(self) -> str:
        below = "".join(f" (≤{_size(bound)}: α={alpha * 1e6:.1f} µs, {1 / beta / 1e9 if beta > 0 else math.inf:.2f} GB/s)"
                        for bound, alpha, beta in self.segments)
        return f"{self.kind} α={self.alpha * 1e6:.1f} µs, {self.bandwidth / 1e9:.2f} GB/s{below}"


def _size(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):g} MiB" if nbytes >= 1 << 20 else f"{nbytes / 1024:g} KiB"


# Rough defaults; measured links override them. "mem": devices of one process (host memcpy for CPU
# devices, NVLink-class for GPUs in the simulated cluster).
DEFAULT_LINKS: dict[str, LinkModel] = {
    "mem": LinkModel("mem", 5e-6, 1 / 20e9, 1e-6),
    "shm": LinkModel("shm", 3e-5, 1 / 5e9, 5e-6),
    "rdma_bnxt": LinkModel("rdma_bnxt", 5e-6, 1 / 12.5e9, 1e-6),
    "tcp": LinkModel("tcp", 5e-5, 1 / 1.25e9, 1e-5),
}
NO_CALL = LinkModel("call", 0.0, 0.0)


@dataclass
class NodeSpec:
    node_id: str
    rank: int
    host_key: str
    devices: list[str]
    transports: tuple[str, ...] = ("mem", "shm", "tcp")
    alive: bool = True

    def device_names(self) -> list[str]:
        return [f"{self.node_id}/{d}" for d in self.devices]


@dataclass
class PeerGroup:
    group_id: str
    host_key: str
    nodes: list[NodeSpec]

    @property
    def kind(self) -> str:
        return "process" if len(self.nodes) == 1 else "host"

    @property
    def devices(self) -> list[str]:
        return [d for n in self.nodes for d in n.device_names()]

    @property
    def leader(self) -> NodeSpec:
        return self.nodes[0]


def _pair(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a <= b else (b, a)


@dataclass
class Topology:
    nodes: list[NodeSpec]
    measured: dict[tuple[str, str], LinkModel] = field(default_factory=dict)
    dead_links: set[tuple[str, str]] = field(default_factory=set)
    defaults: dict[str, LinkModel] = field(default_factory=lambda: dict(DEFAULT_LINKS))
    epoch: int = 0
    call: LinkModel = NO_CALL        # one tinydist.dist call's own cost (module docstring)
    copy_back: dict[str, LinkModel] = field(default_factory=dict)   # node id -> its copy back (module docstring)

    def __post_init__(self) -> None:
        self.nodes = sorted(self.nodes, key=lambda n: n.rank)
        self._by_id = {n.node_id: n for n in self.nodes}

    def node(self, node_id: str) -> NodeSpec:
        return self._by_id[node_id]

    @property
    def live_nodes(self) -> list[NodeSpec]:
        return [n for n in self.nodes if n.alive]

    def groups(self) -> list[PeerGroup]:
        """Peer groups of live nodes: one per host key, ordered by their lowest rank."""
        by_host: dict[str, list[NodeSpec]] = {}
        for node in self.live_nodes:
            by_host.setdefault(node.host_key, []).append(node)
        return [PeerGroup(f"g{i}", host, members) for i, (host, members) in enumerate(by_host.items())]

    def link_kind(self, a: NodeSpec, b: NodeSpec) -> str:
        if a.node_id == b.node_id:
            return "mem"
        if a.host_key == b.host_key and "shm" in a.transports and "shm" in b.transports:
            return "shm"
        if "rdma_bnxt" in a.transports and "rdma_bnxt" in b.transports:
            return "rdma_bnxt"
        return "tcp"

    def link(self, a: NodeSpec, b: NodeSpec) -> LinkModel:
        found = self.measured.get(_pair(a.node_id, b.node_id))
        return found if found is not None else self.defaults[self.link_kind(a, b)]

    def link_dead(self, a: str, b: str) -> bool:
        return _pair(a, b) in self.dead_links

    def set_measured(self, a: str, b: str, model: LinkModel) -> None:
        self.measured[_pair(a, b)] = model

    def kill_link(self, a: str, b: str) -> None:
        self.dead_links.add(_pair(a, b))

    def intra_link(self, group: PeerGroup) -> LinkModel:
        """The slowest link inside a group: memory for one node, else the slowest node pair (shm)."""
        if len(group.nodes) == 1:
            node = group.nodes[0]
            return self.measured.get(_pair(node.node_id, node.node_id), self.defaults["mem"])
        links = [self.link(a, b) for i, a in enumerate(group.nodes) for b in group.nodes[i + 1:]]
        return max(links, key=lambda m: (m.beta, m.alpha))

    def back_link(self, group: PeerGroup) -> LinkModel:
        """What the group's copy back runs at: its measured node's `copy_back`, else its intra link."""
        if len(group.nodes) == 1 and group.leader.node_id in self.copy_back:
            return self.copy_back[group.leader.node_id]
        return self.intra_link(group)

    def slowest(self, pairs: Iterable[tuple[NodeSpec, NodeSpec]]) -> LinkModel | None:
        worst: LinkModel | None = None
        for a, b in pairs:
            model = self.link(a, b)
            if worst is None or (model.beta, model.alpha) > (worst.beta, worst.alpha):
                worst = model
        return worst

    def all_pairs_slowest(self, leaders: Sequence[NodeSpec]) -> LinkModel | None:
        """Slowest link among all leader pairs, without visiting n² pairs: the default kind model
        (leaders are on different hosts) combined with every measured pair among them."""
        if len(leaders) < 2:
            return None
        ids = {n.node_id for n in leaders}
        found = [m for (a, b), m in self.measured.items() if a != b and a in ids and b in ids]
        if len(leaders) <= 64 or len(found) == len(leaders) * (len(leaders) - 1) // 2:
            if len(found) == len(leaders) * (len(leaders) - 1) // 2:
                return max(found, key=lambda m: (m.beta, m.alpha))
            return self.slowest((a, b) for i, a in enumerate(leaders) for b in leaders[i + 1:])
        kind = "rdma_bnxt" if all("rdma_bnxt" in n.transports for n in leaders) else "tcp"
        return max([self.defaults[kind], *found], key=lambda m: (m.beta, m.alpha))
