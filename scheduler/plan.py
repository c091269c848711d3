"""Hierarchical collective planning with an α–β cost model per link.

An allreduce over the cluster's devices is planned in up to three stages:

  1. reduce inside each peer group      (tinydist.multi.allreduce over a process's devices;
                                          shared memory between nodes of one host)
  2. allreduce across groups            (tinydist.dist between one leader per group: naive, ring or all2all)
  3. broadcast back inside each group   (copies from the leader's result to every device)

and compared with a flat ring over every device. Each candidate's modelled time comes from the
links it uses (the slowest one bounds each stage); the cheapest executable candidate wins. With
n bytes, g devices per group, G groups, link (α, β, o) and the dist call's own cost c (α_c, β_c):

  in group     naive   (g-1)·(α + nβ)                ring  2(g-1)·(α + nβ/g)
  across       naive   α + (G-1)·nβ + (G-1)·o        ring  2(G-1)·(α + nβ/G)
               all2all 2·(α + (G-1)·o) + 2(G-1)/G·nβ
               each of them + α_c + nβ_c             (one tinydist.dist call: headers, guard, result)
  back         α + g·nβ          (scheduler.execute copies the host result to every device, the leader's too,
                                 on the node's measured copy back, Topology.copy_back)
  flat ring    2(D-1)·(α + nβ/D) over D devices, (α, β) of the slowest link on the ring

Every term is measured at join (scheduler.probe): each link's α and β by an exchange between the
two ranks (8 B, 1 MiB and 16 MiB: one line up to 1 MiB, one beyond, each step priced on the line its
message falls on, `LinkModel.at`), the in-process link and the copy back by stages 1 and 3 as
execute runs them, each timed alone, and c by
`calibrate_call`: a real naive dist.all_reduce at the same sizes, less what its links' steps
explain. Why c: on two network-namespace hosts (bench/cluster.py, 2 shared cores) a 2-rank
dist.all_reduce of 8 B took 0.75 ms where one exchange took 0.32 ms (the header exchange is a
second round trip), and of 16 MiB 24.6 ms where the exchange took 17.3 ms (a fresh result, its
copy out); without it every across stage was predicted 1.4-2.3x too fast.

`Plan.explain()` prints the stages, the links, each candidate's modelled time and why the winner
won; planning logs one `scheduler.plan` line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tinydist.scheduler.errors import PlanError
from tinydist.scheduler.topology import NO_CALL, LinkModel, PeerGroup, Topology
from tinydist.base.logs import get_logger
from tinydist.graph import collectives
from tinydist.graph.collectives import AUTO, LEGAL, Algorithm, Medium, check, choose

# what the stages run: tinydist.multi naive or ring inside a group (the formulas below), tinydist.dist
# between the group leaders
INTRA_ALGORITHMS = (Algorithm.NAIVE, Algorithm.RING)
INTER_ALGORITHMS = LEGAL[Medium.NETWORK]


@dataclass
class Stage:
    name: str
    algorithm: str
    link: LinkModel | None
    participants: int
    modelled_s: float
    detail: str = ""


@dataclass
class Plan:
    collective: str
    nbytes: int
    strategy: str                      # "hierarchical" or "flat-ring"
    stages: list[Stage]
    groups: list[PeerGroup]
    ring_order: list[str]              # group ids, in inter-group ring order
    candidates: dict[str, float]       # candidate name -> modelled seconds
    reason: str
    epoch: int = 0
    plan_time_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def modelled_s(self) -> float:
        return sum(s.modelled_s for s in self.stages)

    @property
    def intra_algorithm(self) -> str:
        return next((s.algorithm for s in self.stages if s.name == "reduce-in-group"), "none")

    @property
    def inter_algorithm(self) -> str:
        return next((s.algorithm for s in self.stages if s.name == "allreduce-across-groups"), "none")

    def explain(self) -> str:
        devices = sum(len(g.devices) for g in self.groups)
        lines = [f"{self.collective} of {_bytes(self.nbytes)} over {devices} devices in {len(self.groups)} peer groups "
                 f"(epoch {self.epoch}): {self.strategy}, modelled {_secs(self.modelled_s)}"]
        for i, stage in enumerate(self.stages, 1):
            link = stage.link.describe() if stage.link else "no link"
            lines.append(f"  {i}. {stage.name:<24} {stage.algorithm:<8} x{stage.participants:<5} over {link:<32} "
                         f"{_secs(stage.modelled_s):>10}  {stage.detail}".rstrip())
        ranked = sorted(self.candidates.items(), key=lambda kv: kv[1])
        lines.append("  candidates: " + ", ".join(f"{name} {_secs(t)}" for name, t in ranked))
        lines.append(f"  why: {self.reason}")
        shown = self.groups[:8]
        for g in shown:
            lines.append(f"  group {g.group_id} ({g.kind}, host {g.host_key}): {', '.join(n.node_id for n in g.nodes)} "
                         f"[{len(g.devices)} devices]")
        if len(self.groups) > len(shown):
            lines.append(f"  ... {len(self.groups) - len(shown)} more groups")
        if len(self.ring_order) > 1:
            order = self.ring_order if len(self.ring_order) <= 16 else [*self.ring_order[:8], "...", *self.ring_order[-4:]]
            lines.append(f"  ring order: {' -> '.join(order)}")
        lines.extend(f"  note: {n}" for n in self.notes)
        lines.append(f"  planned in {_secs(self.plan_time_s)}")
        return "\n".join(lines)

    def summary(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "intra": self.intra_algorithm, "inter": self.inter_algorithm,
                "nbytes": self.nbytes, "groups": len(self.groups), "modelled_s": self.modelled_s, "epoch": self.epoch}


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _secs(t: float) -> str:
    if t >= 1:
        return f"{t:.3g} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} µs"


# ---- cost model -------------------------------------------------------------------------------

def intra_cost(algorithm: str, g: int, n: float, link: LinkModel) -> float:
    if g <= 1:
        return 0.0
    if algorithm == "naive":
        return (g - 1) * link.time(n)
    return 2 * (g - 1) * link.time(n / g)


def inter_cost(algorithm: str, G: int, n: float, link: LinkModel, call: LinkModel = NO_CALL) -> float:
    """The across-groups stage: `algorithm`'s steps over `link`, plus one dist call's own cost `call`."""
    if G <= 1:
        return 0.0
    if algorithm == "naive":                   # every step a message of n bytes
        step = link.at(n)
        steps = step.alpha + (G - 1) * n * step.beta + (G - 1) * step.overhead
    elif algorithm == "ring":
        steps = 2 * (G - 1) * link.time(n / G)
    else:                                      # every step a message of n/G bytes
        step = link.at(n / G)
        steps = 2 * (step.alpha + (G - 1) * step.overhead) + 2 * (G - 1) / G * n * step.beta
    return steps + call.time(n)


def calibrate_call(topology: Topology, world: int, *timings: tuple[int, float]) -> LinkModel:
    """A tinydist.dist call's own cost (α_c per call, β_c per byte) from a naive all_reduce over
    `world` ranks timed at two or more sizes, `(bytes, seconds)` each, ascending: what the naive steps
    over the slowest measured link between the ranks do not explain, as the probe fits the links
    (`scheduler.probe._fit_pieces`): a line from the smallest size to each larger one, a message
    priced on the line to the first size at or above it (the last beyond). Negative leftovers
    (noise) count as zero."""
    nodes = topology.live_nodes
    link = topology.slowest((a, b) for i, a in enumerate(nodes) for b in nodes[i + 1:])
    if world <= 1 or link is None:
        return NO_CALL
    (n0, r0), *rest = [(n, max(t - inter_cost("naive", world, n, link), 0.0)) for n, t in timings]
    lines = []
    for n1, r1 in rest:
        beta = max(r1 - r0, 0.0) / (n1 - n0)
        lines.append((float(n1), max(r0 - n0 * beta, 0.0), beta))
    *segments, (_, alpha, beta) = lines
    return LinkModel("call", alpha, beta, segments=tuple(segments))


def broadcast_cost(g: int, n: float, link: LinkModel) -> float:
    step = link.at(n)                          # g copies of n bytes each
    return 0.0 if g <= 1 else step.alpha + g * n * step.beta


def flat_ring_cost(D: int, n: float, link: LinkModel) -> float:
    return 0.0 if D <= 1 else 2 * (D - 1) * link.time(n / D)


# ---- ring order avoiding dead links -------------------------------------------------------------

def ring_order(topology: Topology, groups: list[PeerGroup]) -> list[PeerGroup]:
    """Groups in rank order, reordered (greedily, bounded) so that no two ring neighbours' leaders
    have a dead link between them. Raises PlanError if no such order is found."""
    if len(groups) <= 2 or not topology.dead_links:
        if len(groups) == 2 and topology.link_dead(groups[0].leader.node_id, groups[1].leader.node_id):
            raise PlanError(f"the link between {groups[0].leader.node_id} and {groups[1].leader.node_id} is dead")
        return list(groups)
    dead_ids = {x for pair in topology.dead_links for x in pair}
    for start in range(min(len(groups), 8)):               # bounded restarts
        rest = groups[:start] + groups[start + 1:]
        order = [groups[start]]
        ok = True
        while rest:
            cur = order[-1].leader.node_id
            pick = None
            if cur in dead_ids:
                for i, cand in enumerate(rest):
                    if not topology.link_dead(cur, cand.leader.node_id):
                        pick = i
                        break
            else:
                pick = 0
            if pick is None:
                ok = False
                break
            order.append(rest.pop(pick))
        if ok and not topology.link_dead(order[-1].leader.node_id, order[0].leader.node_id):
            return order
    raise PlanError("no ring order of the peer groups avoids the dead links "
                    f"{sorted(topology.dead_links)[:4]}")


# ---- the planner ----------------------------------------------------------------------------------

def plan_allreduce(topology: Topology, nbytes: int, *, executable: bool = True, inter: str = "auto",
                   log: bool = True) -> Plan:
    """The cheapest plan for an allreduce of `nbytes` on `topology`'s live nodes.

    `executable=True` keeps to what scheduler.execute runs between processes (hierarchical); the
    flat ring over every device is still modelled and listed among the candidates. `inter` forces
    the across-groups algorithm.
    """
    started = time.perf_counter()
    groups = topology.groups()
    if not groups:
        raise PlanError("no live nodes to plan over")
    dead = [n.node_id for n in topology.nodes if not n.alive]
    order = ring_order(topology, groups)
    G = len(order)
    g = max(len(grp.devices) for grp in order)
    D = sum(len(grp.devices) for grp in order)
    intra = max((topology.intra_link(grp) for grp in order), key=lambda m: (m.beta, m.alpha))
    leaders = [grp.leader for grp in order]
    ring_link = topology.slowest(zip(leaders, leaders[1:] + leaders[:1])) if G > 1 else None
    mesh_link = topology.all_pairs_slowest(leaders) if G > 1 else None
    mesh_ok = G <= 1 or not any(topology.link_dead(a.node_id, b.node_id) for (a, b) in _dead_pairs(topology, leaders))

    try:
        forced = check(inter, Medium.NETWORK, what="inter-group algorithm")
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    # the one chooser (tinydist.graph.collectives.choose), on this model's times for each stage
    best_intra = choose(Medium.DEVICES, g, nbytes,
                        collectives.Topology(modelled_s={a: intra_cost(a, g, nbytes, intra) for a in INTRA_ALGORITHMS}))[0]
    back = max((topology.back_link(grp) for grp in order), key=lambda m: (m.beta, m.alpha))
    bcast = broadcast_cost(g, nbytes, back)
    base = intra_cost(best_intra, g, nbytes, intra) + bcast
    inter_s: dict[str, float] = {}
    for algorithm in INTER_ALGORITHMS:
        if G > 1 and algorithm is not Algorithm.RING and not mesh_ok:
            continue
        link = ring_link if algorithm is Algorithm.RING else mesh_link
        inter_s[algorithm] = inter_cost(algorithm, G, nbytes, link, topology.call) if link else 0.0
    candidates = {f"hierarchical/{a}": base + seconds for a, seconds in inter_s.items()}
    flat_link = intra if ring_link is None else max([intra, ring_link], key=lambda m: (m.beta, m.alpha))  # None: one group
    candidates["flat-ring"] = flat_ring_cost(D, nbytes, flat_link)

    if forced is not None and forced not in inter_s:
        raise PlanError(f"inter-group algorithm {inter!r} cannot run: a link between group leaders is dead")
    across = forced or choose(Medium.NETWORK, G, nbytes, collectives.Topology(modelled_s=inter_s))[0]
    winner = f"hierarchical/{across}"
    usable = {winner: candidates[winner]}
    if not executable and inter == AUTO and (candidates["flat-ring"], "flat-ring") < (usable[winner], winner):
        winner = "flat-ring"
        usable[winner] = candidates[winner]
    if winner == "flat-ring":
        stages = [Stage("ring-over-all-devices", "ring", flat_link, D, candidates["flat-ring"],
                        f"2(D-1) steps of n/D = {_bytes(nbytes / max(D, 1))}")]
        strategy = "flat-ring"
    else:
        algorithm = across
        link = ring_link if algorithm is Algorithm.RING else mesh_link
        stages = [Stage("reduce-in-group", best_intra.value, intra, g, intra_cost(best_intra, g, nbytes, intra),
                        "tinydist.multi.allreduce" if all(len(grp.nodes) == 1 for grp in order) else "in-process + shared memory"),
                  Stage("allreduce-across-groups", algorithm.value if G > 1 else "none", link, G,
                        inter_cost(algorithm, G, nbytes, link, topology.call) if link else 0.0,
                        "tinydist.dist between group leaders"),
                  Stage("broadcast-in-group", "direct", back, g, bcast, "leader's result copied to each device")]
        strategy = "hierarchical"
    # the why compares the winner with what it was chosen from (the flat ring only when executable is
    # off), so the numbers it quotes never contradict it; a cheaper flat ring it could not run is named apart
    rivals = sorted((v, k) for k, v in candidates.items() if k != winner and (k != "flat-ring" or not executable))
    if forced is not None:
        reason = f"{winner}: the across-groups algorithm was forced (inter={inter!r})"
    else:
        reason = f"{winner} is the cheapest {'executable ' if executable else ''}candidate under the α–β model"
    if rivals:
        reason += f" ({_secs(usable[winner])} vs {rivals[0][1]} {_secs(rivals[0][0])})"
    if executable and candidates["flat-ring"] < usable[winner]:
        reason += (f"; flat-ring would be cheaper ({_secs(candidates['flat-ring'])}) but is not executable "
                   "between multi-device processes")
    notes = []
    if dead:
        notes.append(f"excluded dead nodes: {', '.join(dead[:8])}{' ...' if len(dead) > 8 else ''}")
    if topology.dead_links:
        notes.append(f"dead links avoided: {len(topology.dead_links)}; " + ("all-to-all excluded" if not mesh_ok else "ring reordered"))
    multi_node = [grp.group_id for grp in order if len(grp.nodes) > 1]
    if multi_node and executable:
        notes.append(f"groups {multi_node[:4]} span several processes on one host: scheduler.execute folds their "
                     "shared-memory stage into the across-process tinydist.dist allreduce (dist uses shm for those pairs)")
    plan = Plan("allreduce", int(nbytes), strategy, stages, order, [grp.group_id for grp in order], candidates, reason,
                topology.epoch, 0.0, notes)
    plan.plan_time_s = time.perf_counter() - started
    if log:
        get_logger(component="scheduler").info("scheduler.plan", **plan.summary(), reason=reason)
    return plan


def _dead_pairs(topology: Topology, leaders: list[Any]) -> list[tuple[Any, Any]]:
    """Leader pairs whose link is dead (visits the dead-link set, not all pairs)."""
    by_id = {n.node_id: n for n in leaders}
    return [(by_id[a], by_id[b]) for a, b in topology.dead_links if a in by_id and b in by_id]


def explain(topology: Topology, nbytes: int, **kw: Any) -> str:
    """`plan_allreduce(...).explain()`."""
    return plan_allreduce(topology, nbytes, **kw).explain()


