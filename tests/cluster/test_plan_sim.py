"""Planner, membership and the simulated cluster (virtual clock): no processes, fast."""

from __future__ import annotations

import numpy as np
import pytest

from tinydist.scheduler.errors import MembershipError, NodeFailed, PlanError
from tinydist.scheduler.membership import Membership
from tinydist.scheduler.plan import plan_allreduce
from tinydist.scheduler.sim import SimCluster, format_table, scaling_table
from tinydist.scheduler.topology import LinkModel, NodeSpec, Topology


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
    """What the probe fits from its two timings (8 B and 16 MiB) is what the planner's formulas need
    to give those timings back: stage 1 alone, (g-1)(α + nγ), and stage 3 alone, α + g·nβ, in a
    process of g devices; α + nβ for one exchange."""
    from tinydist.scheduler.plan import broadcast_cost, intra_cost
    from tinydist.scheduler.probe import LARGE, SMALL, _fit
    from tinydist.scheduler.topology import LinkModel
    g = 4
    for (t_small, t_large), per_alpha, per_beta, cost in (
            ((3 * 120e-6, 3 * 2.1e-3), g - 1, g - 1, lambda n, link: intra_cost("naive", g, n, link)),
            ((15e-6, 4 * 1.4e-3), 1, g, lambda n, link: broadcast_cost(g, n, link))):
        alpha, bandwidth = _fit([t_small, 2 * t_small, t_small / 2], [t_large] * 3, per_alpha, per_beta, LARGE)
        link = LinkModel("mem", alpha, 1 / bandwidth)
        for n, t in ((SMALL, t_small), (LARGE, t_large)):
            assert cost(n, link) == pytest.approx(t)
    alpha, bandwidth = _fit([2e-4], [4e-3], 1, 1, LARGE)
    assert LinkModel("tcp", alpha, 1 / bandwidth).time(LARGE) == pytest.approx(4e-3)


def test_probe_prices_a_cache_resident_size_on_its_own_line_not_on_the_streaming_one():
    """Timings shaped like bench/cluster.py's (2 devices per process, 2 hosts): a fixed cost at 8 B
    that 1 MiB hardly adds to, and a per-byte rate beyond the caches 3-10x the one below them. The
    probe's three sizes give one line up to MID and one beyond it, and every stage priced at each
    probed size gives its timing back; the old single line through 8 B and 16 MiB priced 1 MiB
    2.1x (stage 1), 3.9x (the copy back) and 1.8x (an exchange) too slow. The planner picks the line by
    each step's message: naive's n, ring's and all2all's n/G, the call's n."""
    from tinydist.scheduler.plan import broadcast_cost, calibrate_call, inter_cost, intra_cost
    from tinydist.scheduler.probe import LARGE, MID, SMALL, _fit, _fit_pieces, _model
    g = 2
    for timings, per_alpha, per_beta, cost in (
            ((300e-6, 550e-6, 14e-3), g - 1, g - 1, lambda n, link: intra_cost("naive", g, n, link)),
            ((19e-6, 190e-6, 12e-3), 1, g, lambda n, link: broadcast_cost(g, n, link)),
            ((700e-6, 1.5e-3, 25e-3), 1, 1, lambda n, link: link.time(n))):
        samples = {n: [t, 2 * t, t / 2] for n, t in zip((SMALL, MID, LARGE), timings)}
        link = _model("mem", *_fit_pieces(samples, per_alpha, per_beta))
        for n, t in zip((SMALL, MID, LARGE), timings):
            assert cost(n, link) == pytest.approx(t)
        alpha, bandwidth = _fit(samples[SMALL], samples[LARGE], per_alpha, per_beta, LARGE)
        assert cost(MID, LinkModel("mem", alpha, 1 / bandwidth)) / timings[1] > 1.3      # the old fit at 1 MiB
    # one step's message picks the line: naive's n = 1 MiB and all2all's n/2 = 512 KiB on the first,
    # naive's 16 MiB on the second; ring over 2 groups is 2 steps of n/2
    tcp = LinkModel("tcp", 0.0, 2e-9, segments=((float(MID), 700e-6, 0.7e-9),))
    assert inter_cost("naive", 2, MID, tcp) == pytest.approx(700e-6 + MID * 0.7e-9)
    assert inter_cost("all2all", 2, MID, tcp) == pytest.approx(2 * 700e-6 + MID * 0.7e-9)
    assert inter_cost("ring", 2, LARGE, tcp) == pytest.approx(2 * (LARGE / 2) * 2e-9)
    assert inter_cost("naive", 2, LARGE, tcp) == pytest.approx(LARGE * 2e-9)
    # the call's leftover fitted the same way, one line per pair of neighbouring sizes
    t = two_by_two(tcp, LinkModel("mem", 1e-6, 1e-10), LinkModel("call", 0.0, 0.0))
    rest = {SMALL: 300e-6, MID: 300e-6 + MID * 0.1e-9, LARGE: 300e-6 + MID * 0.1e-9 + (LARGE - MID) * 2e-9}
    call = calibrate_call(t, 2, *((n, inter_cost("naive", 2, n, tcp) + r) for n, r in rest.items()))
    for n, r in rest.items():
        assert call.time(n) == pytest.approx(r)


def test_every_probe_exchange_starts_after_a_barrier_not_behind_the_peers_copy_back(monkeypatch):
    """The exchanges time the link alone: between the stage before (a rank's copy back, which ends
    at different times on different ranks) and every exchange there is a barrier, so no exchange
    is priced with the wait for a peer still copying."""
    from types import SimpleNamespace

    import tinydist.frontend.tensor as tensor_module
    import tinydist.multi as multi
    from tinydist import dist
    from tinydist.scheduler import probe
    events: list[str] = []
    result = SimpleNamespace(numpy=lambda: np.zeros(2, np.float32))
    monkeypatch.setattr(dist, "barrier", lambda: events.append("barrier"))
    monkeypatch.setattr(dist, "run_on_loop", lambda *a: events.append("exchange"))
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: events.append("call") or result)
    monkeypatch.setattr(multi, "allreduce", lambda *a, **k: events.append("reduce") or [result])
    monkeypatch.setattr(tensor_module, "Tensor", lambda *a, **k: events.append("copy") or result)
    probe._sample(SimpleNamespace(rank=0, world=2, links={1: None}), 4, ["CPU:0", "CPU:1"])
    assert events.count("exchange") == 13         # one peer; passes 0-4 at SMALL and MID, the even ones at LARGE too
    assert events.index("copy", events.index("exchange")) < len(events) - 1   # copies back between exchanges
    last = None
    for event in events:
        if event == "exchange":
            assert last in ("barrier", "exchange"), events
        last = event


def two_by_two(tcp: LinkModel, mem: LinkModel, call: LinkModel) -> Topology:
    """bench/cluster.py's case: two hosts, one node of two devices on each, links as if measured."""
    t = topo(2, 2)
    t.set_measured("n0", "n1", tcp)
    for node in ("n0", "n1"):
        t.set_measured(node, node, mem)
    t.call = call
    return t


def test_cost_model_arithmetic_matches_hand_computed_times():
    """The 2x2 hierarchical plan's stages on measured links, against the formulas worked by hand:
    tcp α=100 µs, β=1 ns/B; mem α=10 µs, β=0.25 ns/B; dist call α_c=50 µs, β_c=0.5 ns/B; n=1 MiB."""
    n = 1 << 20
    t = two_by_two(LinkModel("tcp", 100e-6, 1e-9), LinkModel("mem", 10e-6, 0.25e-9), LinkModel("call", 50e-6, 0.5e-9))
    plan = plan_allreduce(t, n, inter="naive", log=False)
    inside, across, back = (s.modelled_s for s in plan.stages)
    assert inside == pytest.approx(10e-6 + 262144e-9)                     # (g-1)(α + nβ), g=2
    assert across == pytest.approx(100e-6 + 1048576e-9 + 50e-6 + 524288e-9)   # α + nβ + α_c + nβ_c
    assert back == pytest.approx(10e-6 + 524288e-9)                       # α + g·nβ
    assert plan.modelled_s == pytest.approx(0.000272144 + 0.001722864 + 0.000534288)
    # ring over 2 groups: 2(α + nβ/2) + the call; all2all: 2α + nβ + the call
    assert plan.candidates["hierarchical/ring"] - plan.candidates["hierarchical/naive"] == pytest.approx(100e-6)
    assert plan.candidates["hierarchical/all2all"] == pytest.approx(plan.candidates["hierarchical/ring"])


def test_copy_back_is_priced_on_each_nodes_measured_copy_not_on_the_reduce():
    """Stage 3 runs at the copy rate the probe measured for it (Topology.copy_back), not at the
    reduce's (the mem link): mem α=10 µs, γ=0.5 ns/B; copy α=2 µs, β=0.1 ns/B on n0, 0.2 ns/B on
    n1 (the slowest group's bounds the stage); n=1 MiB, g=2. A node nobody measured keeps its mem link."""
    n = 1 << 20
    t = two_by_two(LinkModel("tcp", 100e-6, 1e-9), LinkModel("mem", 10e-6, 0.5e-9), LinkModel("call", 0.0, 0.0))
    unmeasured = plan_allreduce(t, n, inter="naive", log=False).stages[2]
    assert unmeasured.modelled_s == pytest.approx(10e-6 + 2 * n * 0.5e-9)
    t.copy_back = {"n0": LinkModel("copy", 2e-6, 0.1e-9), "n1": LinkModel("copy", 2e-6, 0.2e-9)}
    plan = plan_allreduce(t, n, inter="naive", log=False)
    inside, _, back = plan.stages
    assert inside.modelled_s == pytest.approx(10e-6 + n * 0.5e-9)          # stage 1 still on the mem link
    assert (back.link.kind, back.modelled_s) == ("copy", pytest.approx(2e-6 + 2 * n * 0.2e-9))
    assert "copy α=2.0 µs" in plan.explain()


def test_calibrate_call_keeps_what_the_links_do_not_explain():
    """A naive dist.all_reduce timed at two sizes, less the naive model on the measured link: the
    call's own α and β back (10 µs + 2 ns/B exchange, 300 µs + 0.5 ns/B call), and noise that puts
    a call below its links counted as no cost, never a negative one."""
    from tinydist.scheduler.plan import calibrate_call
    t = two_by_two(LinkModel("tcp", 10e-6, 2e-9), LinkModel("mem", 1e-6, 1e-10), LinkModel("call", 0.0, 0.0))
    small, large = 8, 16 << 20
    call = calibrate_call(t, 2, (small, 10e-6 + small * 2e-9 + 300e-6 + small * 0.5e-9),
                          (large, 10e-6 + large * 2e-9 + 300e-6 + large * 0.5e-9))
    assert (call.alpha, call.beta) == (pytest.approx(300e-6), pytest.approx(0.5e-9))
    faster = calibrate_call(t, 2, (small, 5e-6), (large, 0.5 * large * 2e-9))
    assert (faster.alpha, faster.beta) == (0.0, 0.0)
    assert calibrate_call(topo(1, 2), 1, (small, 1e-3), (large, 1.0)).time(large) == 0.0     # one rank: no call


def test_planner_choice_follows_the_measured_links():
    """Same topology and size, only the measured α/β differ, and the plan changes: across 4 hosts at
    64 KiB naive wins on a high-latency link (α + 3nβ against all2all's 2α + 1.5nβ), all2all on a
    low-latency one; inside a process of 4 devices ring wins when its β dominates, naive when α does."""
    n = 64 << 10

    def measured(tcp: LinkModel, mem: LinkModel) -> Topology:
        t = topo(4, 4)
        for i in range(4):
            t.set_measured(f"n{i}", f"n{i}", mem)
            for j in range(i + 1, 4):
                t.set_measured(f"n{i}", f"n{j}", tcp)
        return t

    mem = LinkModel("mem", 1e-6, 1e-9)
    assert plan_allreduce(measured(LinkModel("tcp", 1e-3, 1e-9), mem), n, log=False).inter_algorithm == "naive"
    assert plan_allreduce(measured(LinkModel("tcp", 10e-6, 1e-9), mem), n, log=False).inter_algorithm == "all2all"
    tcp = LinkModel("tcp", 10e-6, 1e-9)
    # in a group of 4: naive 3(α + nβ), ring 6(α + nβ/4)
    assert plan_allreduce(measured(tcp, LinkModel("mem", 1e-6, 1e-9)), n, log=False).intra_algorithm == "ring"
    assert plan_allreduce(measured(tcp, LinkModel("mem", 1e-3, 1e-9)), n, log=False).intra_algorithm == "naive"
