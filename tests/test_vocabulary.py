"""One vocabulary per concept: reduce ops, shard bounds and the allreduce chooser agree wherever used.

Checked against what nobody here wrote where there is such a thing: numpy.array_split for shard
bounds, numpy's ufuncs for the reduce ops, a brute-force minimum over the planner's own candidate
list for its choice.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tinydist as td
from tinydist.scheduler.plan import plan_allreduce
from tinydist.scheduler.topology import NodeSpec, Topology
from tinydist.base.config import Settings
from tinydist.base.config import settings as td_settings
from tinydist.dist import calls
from tinydist.dist.group import ProcessGroup
from tinydist.graph import collectives
from tinydist.graph.collectives import (Algorithm, Medium, choose, choose_partitioned, resolve, resolve_partitioned, shard_bounds,
                                        shard_sizes)
from tinydist.graph.lazy import Op
from tinydist.graph.reduce_ops import COLLECTIVE_OPS, REDUCE_OPS, ReduceOp, collective_op
from tinydist.multi import allreduce, shard


@contextlib.contextmanager
def _multi_choices() -> Iterator[list[str]]:
    """The algorithms tinydist.multi.allreduce logs while the block runs (its `allreduce` log line)."""
    module = importlib.import_module("tinydist.multi.allreduce")     # the package's `allreduce` is the function
    chosen: list[str] = []

    class Recorder:
        def info(self, event: str, **fields: Any) -> None:
            if event == "allreduce":
                chosen.append(fields["algorithm"])

    saved, module.log = module.log, Recorder()
    try:
        yield chosen
    finally:
        module.log = saved


# ---- shard bounds ------------------------------------------------------------------------------


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_shard_bounds_cover_the_length_and_match_numpy_array_split(n: int, parts: int) -> None:
    bounds = shard_bounds(n, parts)
    assert len(bounds) == parts
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))          # contiguous, in order
    sizes = shard_sizes(n, parts)
    assert max(sizes) - min(sizes) <= 1
    expected = np.array_split(np.arange(n), parts)
    assert [(int(p[0]), int(p[-1]) + 1) if p.size else (lo, lo) for p, (lo, _) in zip(expected, bounds)] == bounds
    assert sizes == [p.size for p in expected]


def test_shard_bounds_refuse_zero_parts() -> None:
    with pytest.raises(ValueError, match="at least one"):
        shard_bounds(10, 0)


def test_the_users_of_shard_bounds_cut_alike() -> None:
    """A MultiTensor's shards and an all2all's chunks (the one that used to round a linspace) are
    numpy.array_split's pieces."""
    x = np.arange(10, dtype=np.float32)
    devices = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
    sharded = shard(td.Tensor(x), devices)
    assert [s.shape[0] for s in sharded.shards] == [p.size for p in np.array_split(x, 4)]
    parts = [td.Tensor(x * (i + 1), device=d, requires_grad=True) for i, d in enumerate(devices)]
    with _multi_choices() as chosen:
        outs = allreduce(parts, "sum", "all2all")
    assert chosen == ["all2all"]
    np.testing.assert_array_equal(outs[2].numpy(), x * 10)


# ---- reduce ops --------------------------------------------------------------------------------


@pytest.mark.parametrize("op", list(ReduceOp))
def test_each_reduce_op_names_one_combination_everywhere(op: ReduceOp) -> None:
    a, b = np.array([3, -2, 5], np.int64), np.array([-1, 4, 5], np.int64)
    expected = {"sum": a + b, "prod": a * b, "max": np.maximum(a, b), "min": np.minimum(a, b)}[op.value]
    np.testing.assert_array_equal(op.ufunc(a, b), expected)
    graph = td.Tensor(a)._binary(td.Tensor(b), Op(op.binary))
    np.testing.assert_array_equal(graph.numpy(), expected)
    assert op.llvm("i") is not None and op.llvm("u") is not None
    assert (op.llvm("f") is None) == (op in (ReduceOp.MAX, ReduceOp.MIN))   # numpy's NaN rules stay numpy's


def test_reduce_op_lists_and_errors_are_the_one_list() -> None:
    assert REDUCE_OPS == ("sum", "prod", "max", "min") and COLLECTIVE_OPS == (*REDUCE_OPS, "mean")
    assert collective_op("mean") is ReduceOp.SUM
    with pytest.raises(ValueError, match="unknown op 'avg'; expected one of sum, prod, max, min, mean"):
        collective_op("avg")
    with pytest.raises(ValueError, match="unknown reduce op 'avg'"):
        allreduce([td.Tensor(np.ones(2), device=d) for d in ("CPU:0", "CPU:1")], "avg")


# ---- one chooser -------------------------------------------------------------------------------

_sizes = st.sampled_from([1, 4096, 64 << 10, (64 << 10) + 8, 128 << 10, (128 << 10) + 8, 1 << 20, (1 << 20) + 8,
                          (8 << 20) - 8, 8 << 20, 64 << 20])


def _group(world: int, same_host: bool) -> ProcessGroup:
    group = ProcessGroup(0, world)          # not opened: preparing a call needs no links
    group.same_host = same_host
    return group


@settings(max_examples=60, deadline=None)
@given(world=st.integers(1, 9), nbytes=_sizes, same_host=st.booleans(), forced=st.sampled_from(["auto", "naive", "ring", "all2all"]))
def test_the_process_group_asks_the_one_chooser(world: int, nbytes: int, same_host: bool, forced: str) -> None:
    medium = Medium.SHM if same_host else Medium.NETWORK
    x = np.zeros(nbytes // 8, np.float64)
    with td_settings.override(ALLREDUCE=forced):
        header = calls.all_reduce(_group(world, same_host), x, "sum", "auto").header
        assert header["error"] is None
        assert header["algorithm"] == resolve("auto", medium, world, x.nbytes)[0]
    expected = choose(medium, world, x.nbytes)[0] if forced == "auto" else forced
    assert header["algorithm"] == expected


@settings(max_examples=40, deadline=None)
@given(world=st.integers(1, 9), same_host=st.booleans(), forced=st.sampled_from(["auto", "naive", "ring", "all2all"]))
def test_reduce_scatter_asks_the_one_chooser(world: int, same_host: bool, forced: str) -> None:
    medium = Medium.SHM if same_host else Medium.NETWORK
    header = calls.reduce_scatter(_group(world, same_host), np.zeros((world * 3, 2)), "sum", 0, forced).header
    assert header["error"] is None
    assert header["algorithm"] == resolve_partitioned(forced, "reduce_scatter", medium, world)[0]
    expected = {"auto": choose_partitioned("reduce_scatter", medium, world)[0].value, "naive": "all2all"}.get(forced, forced)
    assert header["algorithm"] == expected


def test_the_partitioned_rule_is_ring_only_between_more_than_two_hosts() -> None:
    for collective, one_step in (("reduce_scatter", Algorithm.ALL2ALL), ("all_gather", Algorithm.DIRECT)):
        assert choose_partitioned(collective, Medium.NETWORK, 3)[0] is Algorithm.RING
        assert choose_partitioned(collective, Medium.NETWORK, 2)[0] is one_step
        assert choose_partitioned(collective, Medium.SHM, 8)[0] is one_step
    with pytest.raises(ValueError, match="reduce_scatter algorithm 'direct' does not run on"):
        resolve_partitioned("direct", "reduce_scatter", Medium.SHM, 4)
    with pytest.raises(ValueError, match="not 'all_reduce'"):
        choose_partitioned("all_reduce", Medium.SHM, 4)


@settings(max_examples=25, deadline=None)
@given(devices=st.integers(2, 4), elements=st.sampled_from([3, 1000, (1 << 20) - 1, 1 << 20]),
       grad=st.booleans(), forced=st.sampled_from(["auto", "naive", "ring", "all2all"]))
def test_multi_asks_the_one_chooser(devices: int, elements: int, grad: bool, forced: str) -> None:
    names = [f"CPU:{i}" for i in range(devices)]
    parts = [td.Tensor(np.zeros(elements, np.float64), device=d, requires_grad=grad) for d in names]
    with td_settings.override(ALLREDUCE=forced), _multi_choices() as chosen:
        allreduce(parts, "sum")
    expected = choose(Medium.DEVICES, devices, elements * 8, collectives.Topology(peers=not grad))[0]
    assert chosen == [expected if forced == "auto" else forced]


def _cluster(nodes: int, devices: int, per_host: int) -> Topology:
    return Topology([NodeSpec(f"n{i}", i, f"h{i // per_host}", [f"CPU:{d}" for d in range(devices)]) for i in range(nodes)])


@settings(max_examples=40, deadline=None)
@given(nodes=st.integers(1, 24), devices=st.integers(1, 8), per_host=st.integers(1, 3),
       nbytes=st.sampled_from([1, 1024, 1 << 20, 64 << 20, 1 << 30]))
def test_the_planner_picks_its_cheapest_candidate(nodes: int, devices: int, per_host: int, nbytes: int) -> None:
    plan = plan_allreduce(_cluster(nodes, devices, per_host), nbytes, log=False)
    hierarchical = {k.split("/")[1]: v for k, v in plan.candidates.items() if k.startswith("hierarchical/")}
    cheapest = min(hierarchical, key=lambda a: (hierarchical[a], a))
    assert plan.strategy == "hierarchical"
    assert plan.inter_algorithm == (cheapest if len(plan.groups) > 1 else "none")
    assert plan.intra_algorithm in ("naive", "ring")


def test_tinydist_allreduce_is_checked_against_the_medium(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve("ring", Medium.SHM, 4, 1 << 20) == (Algorithm.RING, "requested")
    with pytest.raises(ValueError, match="'direct' does not run on shm"):
        resolve("direct", Medium.SHM, 4, 1 << 20)
    with pytest.raises(ValueError, match="unknown allreduce algorithm 'tree'"):
        resolve("tree", Medium.NETWORK, 4, 1 << 20)
    with td_settings.override(ALLREDUCE="all2all"):
        assert resolve("auto", Medium.NETWORK, 4, 1) == (Algorithm.ALL2ALL, "TINYDIST_ALLREDUCE")
    header = calls.all_reduce(_group(2, True), np.zeros(4), "sum", "direct").header
    assert "'direct' does not run on shm" in header["error"]
    fresh = Settings()                     # the registry's own parse, read from the environment
    for declared in td_settings.declared():
        fresh.declare(declared)
    monkeypatch.setenv("TINYDIST_ALLREDUCE", "direct")
    with pytest.raises(ValueError, match="TINYDIST_ALLREDUCE='direct' is invalid: expected one of auto, naive, ring, all2all"):
        _ = fresh.ALLREDUCE


# ---- one launch-variables reader ---------------------------------------------------------------


def test_a_bad_rank_reads_the_same_everywhere(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from tinydist import dist
    from tinydist.dist.environment import apply, detect, launch
    from tinydist.base.errors import LaunchError, TinydistError
    from tinydist.observability.tracing import Tracer
    monkeypatch.setenv("TINYDIST_RANK", "one")
    monkeypatch.setenv("TINYDIST_WORLD_SIZE", "2")
    expected = "TINYDIST_RANK='one' is not a non-negative integer (TINYDIST_RANK: This process's rank"
    readers = [launch, dist.init, detect, apply, lambda: Tracer().write(tmp_path / "t.json")]
    for read in readers:
        with pytest.raises(LaunchError) as caught:
            read()
        assert str(caught.value).startswith(expected), (read, caught.value)
        assert isinstance(caught.value, TinydistError) and isinstance(caught.value, ValueError)
    assert not dist.is_initialized()


def test_an_unset_rank_says_how_to_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    from tinydist.dist.environment import launch
    from tinydist.base.errors import LaunchError
    for name in ("TINYDIST_RANK", "TINYDIST_WORLD_SIZE", "SLURM_PROCID", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(LaunchError, match=r"TINYDIST_RANK is not set; start the script with `tinydist launch --nproc N"):
        launch()
    assert launch(rank=1, world_size=3, env={}).coordinator == "127.0.0.1:29400"
    with pytest.raises(LaunchError, match="rank 3 is outside 0..1"):
        launch(env={"TINYDIST_RANK": "3", "TINYDIST_WORLD_SIZE": "2"})


# ---- one bind policy, the rendezvous included --------------------------------------------------


def test_the_rendezvous_binds_loopback_unless_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    from tinydist import dist
    from tinydist.dist.rendezvous import coordinator_listener
    from tinydist.base.errors import BindRefused
    with pytest.raises(BindRefused, match=r"non-loopback address 10\.1\.2\.3: .*TINYDIST_COORDINATOR_ALLOW_REMOTE=1"):
        coordinator_listener(("10.1.2.3", 0))
    with pytest.raises(BindRefused, match="non-loopback"):           # td.dist.init's rank 0 goes the same way
        dist.init(rank=0, world_size=2, coordinator="10.1.2.3:29400", timeout=5)
    assert not dist.is_initialized()
    with coordinator_listener(("localhost", 0)) as sock:
        assert sock.getsockname()[0] == "127.0.0.1"
    with td_settings.override(COORDINATOR_ALLOW_REMOTE="1"):
        with pytest.raises(BindRefused, match="wildcard"):
            coordinator_listener(("0.0.0.0", 0))
        with pytest.raises(OSError) as caught:                      # allowed: the kernel, not the policy, refuses
            coordinator_listener(("192.0.2.1", 0))                 # (TEST-NET-1: no interface has it)
        assert not isinstance(caught.value, BindRefused)


def test_every_server_parses_addresses_alike() -> None:
    from tinydist.observability import metrics
    from tinydist.dist.rendezvous import parse_coordinator
    from tinydist.base.errors import BindRefused
    from tinydist.security.bind import bind_address, parse_host_port
    for text in ("127.0.0.1:9464", "[::1]:9464"):
        assert metrics.parse_address(text) == parse_coordinator(text) == parse_host_port(text)
    assert parse_coordinator(":29400") == ("127.0.0.1", 29400) == metrics.parse_address(":29400")
    for bad in (metrics.parse_address, parse_coordinator, bind_address):
        with pytest.raises(BindRefused, match="must be HOST:PORT"):
            bad("nonsense")
    with pytest.raises(BindRefused, match="non-loopback"):
        metrics.serve_metrics("10.1.2.3", 0)


# ---- one event-loop portal ---------------------------------------------------------------------


def test_dist_runs_on_the_engines_loop() -> None:
    import threading

    from tinydist import dist
    from tinydist.runtime.engine import get_engine

    async def loop_thread() -> int:
        return threading.get_ident()
    dist.init(rank=0, world_size=1)
    try:
        assert dist.run_on_loop(loop_thread) == get_engine().run(loop_thread) != threading.get_ident()
        np.testing.assert_array_equal(dist.all_reduce(np.arange(3.0)).numpy(), np.arange(3.0))
    finally:
        dist.destroy()
    assert get_engine().run(loop_thread)            # the loop outlives the group
