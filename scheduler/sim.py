"""A simulated cluster for scale: the real Membership and planner on a virtual clock and modelled links.

    sim = SimCluster(nodes=1024, devices_per_node=8)
    sim.run(seconds=2)                 # heartbeats every interval, sweeps, all on the virtual clock
    result = sim.allreduce(256 << 20)  # plan + modelled execution; raises NodeFailed naming a dead node
    sim.kill("n0005"); sim.hang("n0007"); sim.kill_link("n0001", "n0002")

Failure semantics (the same as the real executor): a killed process closes its sockets, so its
peers fail the collective after one link latency; a hung node is found by the coordinator's sweep
after `miss_limit` missed heartbeats and its peers learn at their next heartbeat. Either way every
survivor's error names the node and arrives within a bounded virtual time. A dead link makes the
planner reorder the ring around it and drop the all-to-all candidates.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tinydist.scheduler.errors import NodeFailed
from tinydist.scheduler.membership import Membership
from tinydist.scheduler.plan import Plan, plan_allreduce
from tinydist.scheduler.topology import DEFAULT_LINKS, LinkModel, Topology


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> None:
        self.now += dt


@dataclass
class SimResult:
    plan: Plan
    modelled_s: float
    started: float
    finished: float


@dataclass
class SimCluster:
    nodes: int = 16
    devices_per_node: int = 8
    nodes_per_host: int = 1
    heartbeat_interval: float = 1.0
    miss_limit: int = 5
    links: dict[str, LinkModel] = field(default_factory=lambda: dict(DEFAULT_LINKS))
    transports: tuple[str, ...] = ("mem", "shm", "tcp")

    def __post_init__(self) -> None:
        self.clock = VirtualClock()
        self.membership = Membership(self.heartbeat_interval, self.miss_limit, clock=self.clock)
        self.incarnation: dict[str, int] = {}
        self.killed: dict[str, float] = {}       # process gone: sockets closed
        self.hung: dict[str, float] = {}         # process alive but silent
        self.dead_links: set[tuple[str, str]] = set()
        self.detected: dict[str, float] = {}     # node -> virtual time the coordinator declared it dead
        devices = [f"GPU:{i}" for i in range(self.devices_per_node)]
        for i in range(self.nodes):
            node_id = f"n{i:04d}"
            rec = self.membership.join(node_id, f"host{i // self.nodes_per_host:04d}", devices, self.transports, i, self.nodes)
            self.incarnation[node_id] = rec.incarnation

    @property
    def node_ids(self) -> list[str]:
        return list(self.incarnation)

    # ---- faults ---------------------------------------------------------------------------------

    def kill(self, node_id: str) -> None:
        self.killed[node_id] = self.clock.now

    def hang(self, node_id: str) -> None:
        self.hung[node_id] = self.clock.now

    def kill_link(self, a: str, b: str) -> None:
        self.dead_links.add((a, b) if a <= b else (b, a))

    # ---- time ----------------------------------------------------------------------------------------

    def tick(self) -> list[str]:
        """One heartbeat interval: every live, responsive node heartbeats, then the coordinator sweeps."""
        self.clock.advance(self.heartbeat_interval)
        for node_id, inc in self.incarnation.items():
            if node_id in self.killed or node_id in self.hung:
                continue
            if self.membership.members[node_id].state == "alive":
                self.membership.heartbeat(node_id, inc)
        newly = [r.node_id for r in self.membership.sweep()]
        for node_id in newly:
            self.detected[node_id] = self.clock.now
        return newly

    def run(self, seconds: float) -> None:
        for _ in range(max(1, round(seconds / self.heartbeat_interval))):
            self.tick()

    def topology(self) -> Topology:
        topo = self.membership.topology()
        topo.defaults = dict(self.links)
        topo.dead_links = set(self.dead_links)
        return topo

    # ---- collectives ------------------------------------------------------------------------------

    def allreduce(self, nbytes: int, inter: str = "auto", executable: bool = True, log: bool = False) -> SimResult:
        """Plan on the coordinator's current view and 'run' the plan on the virtual clock. If a
        participant is dead (killed or hung), survivors raise NodeFailed at the time they would learn."""
        topo = self.topology()
        plan = plan_allreduce(topo, nbytes, executable=executable, inter=inter, log=log)
        start = self.clock.now
        participants = {n.node_id for g in plan.groups for n in g.nodes}
        bad = sorted(n for n in participants if n in self.killed or n in self.hung)
        if bad:
            node = bad[0]
            if node in self.killed:               # sockets closed: noticed after one link latency
                learn = start + topo.defaults["tcp"].alpha
                why = "its connections closed (process died)"
            else:                                 # silent: coordinator sweep, then the survivors' next heartbeat
                while node not in self.detected:
                    self.tick()
                learn = self.detected[node] + self.heartbeat_interval
                why = self.membership.members[node].reason
            self.clock.now = max(self.clock.now, learn)
            rank = self.membership.members[node].rank
            raise NodeFailed(node, rank, f"node {node!r} (rank {rank}) failed during allreduce at t={learn:.3f} s "
                                         f"(started {start:.3f} s): {why}")
        self.clock.advance(plan.modelled_s)
        return SimResult(plan, plan.modelled_s, start, self.clock.now)


def scaling_table(sizes: tuple[int, ...] = (8, 64, 256, 1024), devices_per_node: int = 8, nbytes: int = 256 << 20,
                  heartbeat_interval: float = 1.0, miss_limit: int = 5) -> list[dict[str, float | int | str]]:
    """Plan time (wall), modelled allreduce time (hierarchical vs flat ring), heartbeat round cost
    (wall) and failure-detection time (virtual) per cluster size."""
    rows: list[dict[str, float | int | str]] = []
    for n in sizes:
        t = time.perf_counter()
        sim = SimCluster(n, devices_per_node, heartbeat_interval=heartbeat_interval, miss_limit=miss_limit)
        join_s = time.perf_counter() - t
        t = time.perf_counter()
        sim.tick()
        tick_s = time.perf_counter() - t
        t = time.perf_counter()
        result = sim.allreduce(nbytes)
        plan_s = time.perf_counter() - t
        flat = result.plan.candidates["flat-ring"]
        victim = sim.node_ids[n // 2]
        sim.hang(victim)
        t0 = sim.clock.now
        try:
            sim.allreduce(nbytes)
            hang_s = float("nan")
        except NodeFailed:
            hang_s = sim.clock.now - t0
        t = time.perf_counter()
        replan = sim.allreduce(nbytes)
        replan_s = time.perf_counter() - t
        rows.append({"nodes": n, "devices": n * devices_per_node, "join_ms": join_s * 1e3, "heartbeat_round_ms": tick_s * 1e3,
                     "plan_ms": plan_s * 1e3, "strategy": f"{result.plan.strategy}/{result.plan.inter_algorithm}",
                     "hier_ms": result.modelled_s * 1e3, "flat_ring_ms": flat * 1e3, "hang_detect_s": hang_s,
                     "replan_ms": replan_s * 1e3, "after_loss_ms": replan.modelled_s * 1e3})
    return rows


def format_table(rows: list[dict[str, float | int | str]], nbytes: int = 256 << 20) -> str:
    head = ("| nodes | devices | join all (ms) | heartbeat round (ms) | plan (ms) | plan | modelled hierarchical "
            "(ms) | modelled flat ring (ms) | hung node → all survivors raise (virtual s) | replan (ms) | after loss (ms) |")
    lines = [f"allreduce of {nbytes >> 20} MiB float32; wall times on this machine, modelled times from the α–β links",
             head, "|" + "---|" * 11]
    for r in rows:
        lines.append(f"| {r['nodes']} | {r['devices']} | {r['join_ms']:.1f} | {r['heartbeat_round_ms']:.2f} | {r['plan_ms']:.2f} | "
                     f"{r['strategy']} | {r['hier_ms']:.1f} | {r['flat_ring_ms']:.1f} | {r['hang_detect_s']:.1f} | "
                     f"{r['replan_ms']:.2f} | {r['after_loss_ms']:.1f} |")
    return "\n".join(lines)
