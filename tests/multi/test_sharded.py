"""Sharded tensors over devices of one process: per-shard ops, allreduce algorithms, gather."""

from __future__ import annotations

import numpy as np
import pytest

import tinydist as td
from tinydist.multi import ALGORITHMS, ShardError, allreduce
from tinydist.schedule import create_schedule
from tinydist.schedule.items import CopyCall

DEVICES3 = ["CPU:0", "CPU:1", "CPU:2"]
rng = np.random.default_rng(3)


def test_uneven_shards_follow_array_split() -> None:
    x = np.arange(30, dtype=np.float32).reshape(10, 3)
    m = td.Tensor(x).shard(DEVICES3, axis=0)
    assert m.devices == tuple(DEVICES3)
    assert m.bounds == [(0, 4), (4, 7), (7, 10)]
    assert [s.shape for s in m.shards] == [(4, 3), (3, 3), (3, 3)]
    assert [s.device for s in m.shards] == DEVICES3
    np.testing.assert_array_equal(m.numpy(), x)
    assert m.shape == (10, 3)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("op", ["sum", "max", "min", "prod"])
def test_reduce_over_the_sharded_axis_is_an_allreduce(algorithm: str, op: str) -> None:
    x = rng.uniform(0.5, 1.5, (7, 5)).astype(np.float64)
    m = td.Tensor(x).shard(DEVICES3, axis=0)
    result = getattr(m, op)(axis=0, algorithm=algorithm)
    assert result.axis is None and result.devices == tuple(DEVICES3)
    expected = getattr(np, op)(x, axis=0)
    for replica in result.shards:  # every device holds the full result
        np.testing.assert_allclose(replica.numpy(), expected, rtol=1e-12)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_allreduce_with_more_devices_than_comfortable_chunks(algorithm: str) -> None:
    devices = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
    parts = [td.Tensor(rng.standard_normal(13).astype(np.float32), device=d) for d in devices]
    expected = sum(p.numpy() for p in parts)
    for out, device in zip(allreduce(parts, "sum", algorithm), devices):
        assert out.device == device
        np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_ring_copies_only_between_ring_neighbours_in_reduce_scatter() -> None:
    devices = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
    parts = [td.Tensor(np.ones(64, np.float32), device=d) for d in devices]
    outs = allreduce(parts, "sum", "ring")
    schedule, inputs = create_schedule([o.node for o in outs])
    copies = [c for c in schedule.linear if isinstance(c, CopyCall)]
    # reduce-scatter (n-1 steps × n devices) + allgather (each device fetches n-1 chunks)
    assert len(copies) == 2 * 4 * 3
    for out in outs:
        np.testing.assert_array_equal(out.numpy(), np.full(64, 4, np.float32))


def test_elementwise_runs_per_shard_with_broadcast_operands() -> None:
    x = rng.standard_normal((9, 4)).astype(np.float32)
    row = rng.standard_normal(4).astype(np.float32)
    col = rng.standard_normal((9, 1)).astype(np.float32)
    m = td.Tensor(x).shard(DEVICES3, axis=0)
    out = (m.exp() * td.Tensor(row) + td.Tensor(col)).relu()
    assert out.axis == 0 and out.devices == tuple(DEVICES3)
    np.testing.assert_allclose(out.numpy(), np.maximum(np.exp(x) * row + col, 0), rtol=1e-5, atol=1e-6)


def test_reduce_over_other_axes_keeps_the_sharding() -> None:
    x = rng.standard_normal((3, 10, 4)).astype(np.float32)
    m = td.Tensor(x).shard(DEVICES3, axis=1)
    out = m.sum(axis=(0, 2))
    assert out.axis == 0
    np.testing.assert_allclose(out.numpy(), x.sum(axis=(0, 2)), rtol=1e-5, atol=1e-5)
    mean = m.mean(axis=1)
    np.testing.assert_allclose(mean.numpy(), x.mean(axis=1), rtol=1e-5, atol=1e-6)


def test_gather_to_one_device_is_each_shard_copied_once() -> None:
    x = rng.standard_normal((8, 5)).astype(np.float32)
    m = td.Tensor(x).shard(DEVICES3, axis=1).realize()
    gathered = m.to("CPU:3")
    assert gathered.device == "CPU:3"
    schedule, _ = create_schedule([gathered.node])
    assert sum(isinstance(c, CopyCall) for c in schedule.linear) == 3
    np.testing.assert_array_equal(gathered.numpy(), x)


def test_matmul_with_rows_sharded() -> None:
    x = rng.standard_normal((10, 6)).astype(np.float32)
    w = rng.standard_normal((6, 3)).astype(np.float32)
    out = td.Tensor(x).shard(DEVICES3, axis=0) @ td.Tensor(w)
    np.testing.assert_allclose(out.numpy(), x @ w, rtol=1e-4, atol=1e-5)


def test_movement_that_moves_elements_between_shards_is_refused() -> None:
    m = td.Tensor(np.zeros((6, 4), np.float32)).shard(DEVICES3, axis=0)
    with pytest.raises(ShardError, match="move elements between shards"):
        m.reshape(4, 6)
    np.testing.assert_array_equal(m.reshape(6, 2, 2).numpy(), np.zeros((6, 2, 2)))
    other = td.Tensor(np.zeros((6, 4), np.float32)).shard(DEVICES3, axis=1)
    with pytest.raises(ShardError, match="sharded differently"):
        m + other
    with pytest.raises(ShardError, match="contracts the sharded axis"):
        td.Tensor(np.zeros((4, 6), np.float32)).shard(DEVICES3, axis=1) @ td.Tensor(np.zeros((6, 2), np.float32))


def test_bad_algorithm_and_op_are_named() -> None:
    parts = [td.Tensor(np.ones(4, np.float32), device=d) for d in DEVICES3[:2]]
    with pytest.raises(ValueError, match="unknown allreduce algorithm 'tree'"):
        allreduce(parts, "sum", "tree")
    with pytest.raises(ValueError, match="unknown reduce op 'avg'"):
        allreduce(parts, "avg")


def test_shards_run_concurrently_on_their_devices() -> None:
    x = rng.standard_normal((2, 1 << 20)).astype(np.float32)
    m = td.Tensor(x).shard(["CPU:0", "CPU:1"], axis=0)
    out = ((m * 0.5).exp().sqrt() * 3).realize()
    td.synchronize()
    np.testing.assert_allclose(out.numpy(), np.sqrt(np.exp(x * 0.5)) * 3, rtol=1e-5)
    engine = td.get_engine()
    t0, t1 = (engine.device(d).queues["compute"].timings[-1] for d in ("CPU:0", "CPU:1"))
    assert t0.value and t1.value  # both devices ran a batch of this graph on their own workers
