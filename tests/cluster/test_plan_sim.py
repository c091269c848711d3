"""Planner, membership and the simulated cluster (virtual clock): no processes, fast."""

from __future__ import annotations

import pytest

from tinydist.scheduler.errors import MembershipError, NodeFailed, PlanError
from tinydist.scheduler.membership import Membership
from tinydist.scheduler.plan import plan_allreduce
from tinydist.scheduler.sim import SimCluster, format_table, scaling_table
from tinydist.scheduler.topology import NodeSpec, Topology


def topo(nodes: int, devices: int = 2, per_host: int = 1) -> Topology:
    return Topology([NodeSpec(f"n{i}", i, f"h{i // per_host}", [f"CPU:{d}" for d in range(devices)]) for i in range(nodes)])


def test_peer_groups_by_host_and_plan_is_hierarchical_and_explained():
    t = topo(4, 2, per_host=2)
    groups = t.groups()
    assert [g.kind for g in groups] == ["host", "host"] and groups[0].devices == ["n0/CPU:0", "n0/CPU:1", "n1/CPU:0", "n1/CPU:1"]
    plan = plan_allreduce(t, 64 << 20)
    assert plan.strategy == "hierarchical"
    assert [s.name for s in plan.stages] == ["reduce-in-group", "allreduce-across-groups", "broadcast-in-group"]
    text = plan.explain()
    for needle in ("reduce-in-group", "candidates:", "why:", "flat-ring", "group g0 (host", "shm"):
        assert needle in text, text


def test_cost_model_picks_latency_bound_algorithm_for_small_and_bandwidth_bound_for_large():
    t = topo(32, 8)
    small = plan_allreduce(t, 1024, log=False)
    large = plan_allreduce(t, 1 << 30, log=False)
    assert small.inter_algorithm in ("naive", "all2all")           # 2(G-1) latency steps of a ring lose
    assert large.inter_algorithm in ("ring", "all2all")            # naive moves (G-1)·n
    assert large.candidates["hierarchical/naive"] > large.candidates["hierarchical/ring"]
    # a forced algorithm is respected
    assert plan_allreduce(t, 1 << 30, inter="ring", log=False).inter_algorithm == "ring"


def test_dead_link_reorders_ring_and_drops_all2all():
    t = topo(6, 2)
    t.kill_link("n0", "n1")
    plan = plan_allreduce(t, 1 << 20, log=False)
    order = [g.leader.node_id for g in plan.groups]
    pairs = {frozenset(p) for p in zip(order, order[1:] + order[:1])}
    assert frozenset(("n0", "n1")) not in pairs
    assert "hierarchical/all2all" not in plan.candidates and plan.inter_algorithm == "ring"
    two = topo(2, 1)
    two.kill_link("n0", "n1")
    with pytest.raises(PlanError, match="dead"):
        plan_allreduce(two, 1 << 20, log=False)


def test_membership_ranks_supersede_and_sweep():
    now = [0.0]
    m = Membership(0.1, 3, clock=lambda: now[0])
    a = m.join("a", "h", ["CPU:0"], rank=0, world_size=2)
    b = m.join("b", "h", ["CPU:0"], world_size=2)
    assert (a.rank, b.rank) == (0, 1) and m.ready(2)
    with pytest.raises(MembershipError, match="held by live node a"):
        m.join("c", "h", ["CPU:0"], rank=0)
    now[0] = 0.25
    m.heartbeat("a", a.incarnation)
    now[0] = 0.35
    assert [r.node_id for r in m.sweep()] == ["b"] and "missed 3 heartbeats" in m.members["b"].reason
    assert [r.node_id for r in m.heartbeat("a", a.incarnation)] == ["b"]
    b2 = m.join("b", "h", ["CPU:0"], rank=1)            # a replacement takes the dead node's rank
    with pytest.raises(MembershipError, match="superseded"):
        m.heartbeat("b", b.incarnation)
    assert b2.rank == 1 and m.ready(2)


def test_simulated_1024x8_cluster_scaling_and_failures():
    rows = scaling_table((8, 64, 1024))
    assert [r["devices"] for r in rows] == [64, 512, 8192]
    big = rows[-1]
    assert big["plan_ms"] < 2000 and big["heartbeat_round_ms"] < 2000
    assert big["hier_ms"] < big["flat_ring_ms"]                     # hierarchy wins at scale
    for r in rows:                                                  # hung node: (miss_limit + 1) intervals
        assert 5.0 <= r["hang_detect_s"] <= 6.0 + 1e-9
    print(format_table(rows))


def test_simulated_kill_fails_survivors_naming_node_then_replans():
    sim = SimCluster(1024, 8, heartbeat_interval=1.0, miss_limit=5)
    sim.run(3)
    sim.kill("n0100")
    t0 = sim.clock.now
    with pytest.raises(NodeFailed, match="n0100.*process died") as info:
        sim.allreduce(64 << 20)
    assert info.value.node_id == "n0100" and sim.clock.now - t0 < 0.01
    sim.run(6)                                                      # the coordinator's sweep declares it dead
    result = sim.allreduce(64 << 20)
    assert "n0100" not in {n.node_id for g in result.plan.groups for n in g.nodes}
    assert any("excluded dead nodes: n0100" in note for note in result.plan.notes)
    sim.kill_link("n0001", "n0002")
    again = sim.allreduce(64 << 20)
    order = [g.leader.node_id for g in again.plan.groups]
    assert frozenset(("n0001", "n0002")) not in {frozenset(p) for p in zip(order, order[1:] + order[:1])}


def test_probe_fit_inverts_the_planners_stage_costs():
    """What the probe fits from its two timings (8 B and 4 MiB) is what the planner's formula needs to
    give those timings back: (g-1)(α + nβ) in a process of g devices, α + nβ for one exchange."""
    from tinydist.scheduler.plan import intra_cost
    from tinydist.scheduler.probe import LARGE, SMALL, _fit
    from tinydist.scheduler.topology import LinkModel
    g, t_small, t_large = 4, 3 * 85e-6, 3 * 0.9e-3        # naive over 4 devices: three reduction steps
    alpha, bandwidth = _fit([t_small, 2 * t_small, t_small / 2], [t_large] * 3, g - 1, LARGE)
    link = LinkModel("mem", alpha, 1 / bandwidth)
    assert intra_cost("naive", g, SMALL, link) == pytest.approx(t_small)
    assert intra_cost("naive", g, LARGE, link) == pytest.approx(t_large)
    alpha, bandwidth = _fit([2e-4], [4e-3], 1, LARGE)
    assert LinkModel("tcp", alpha, 1 / bandwidth).time(LARGE) == pytest.approx(4e-3)
