"""Sharded tensors over devices of one process: per-shard ops, allreduce algorithms, gather."""

from __future__ import annotations

import numpy as np
import pytest

import tinydist as td
from tinydist.codegen.lowering import STREAMING_STORE_BYTES
from tinydist.multi import ALGORITHMS, ShardError, allreduce
from tinydist.engine.realize import realize
from tinydist.schedule import create_schedule
from tinydist.schedule.items import CopyCall, GatherCall, KernelCall, SliceCall
from tests.runtime.helpers import Gate

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


@pytest.mark.parametrize("ndev", [2, 3, 4])
@pytest.mark.parametrize("elements", [0, 1, 10007, (1 << 18) + 3])  # empty, one, prime, 1 MiB + odd
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_allreduce_equals_numpy_for_every_size(ndev: int, elements: int, algorithm: str) -> None:
    devices = [f"CPU:{i}" for i in range(ndev)]
    arrays = [rng.standard_normal(elements).astype(np.float32) for _ in devices]
    for op in ("sum", "max", "min", "prod"):
        parts = [td.Tensor(a, device=d) for a, d in zip(arrays, devices)]
        expected = getattr(np, op)(np.stack(arrays), axis=0)
        for out, device in zip(allreduce(parts, op, algorithm), devices):
            assert out.device == device
            np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_ring_reads_only_between_ring_neighbours_in_reduce_scatter() -> None:
    devices = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
    parts = [td.Tensor(np.ones(64, np.float32), device=d) for d in devices]
    outs = allreduce(parts, "sum", "ring")
    schedule, inputs = create_schedule([o.node for o in outs])
    # CPU devices of one process share memory: kernels read their peers' chunks, nothing is copied
    assert not any(isinstance(c, CopyCall) for c in schedule.linear)
    gathers = [c for c in schedule.linear if isinstance(c, GatherCall)]
    assert sorted(c.device for c in gathers) == devices
    for call in gathers:  # allgather: every device copies all n reduced chunks from where they are
        assert {schedule.specs[i].device for i in call.srcs} == set(devices)
    for call in schedule.linear:
        if isinstance(call, KernelCall):  # reduce-scatter: a device reads only itself and its ring predecessor
            previous = devices[(devices.index(call.device) - 1) % 4]
            assert {schedule.specs[i].device for i in call.inputs} <= {call.device, previous}
    for out in outs:
        np.testing.assert_array_equal(out.numpy(), np.full(64, 4, np.float32))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_allreduce_reads_peers_after_their_writers_and_before_later_writes(algorithm: str) -> None:
    """The allreduce's kernels read the other devices' buffers in place: they wait for the work
    that produces them (RAW, across device queues), and a later overwrite of a source waits for
    them (WAR): the result is the sum of the values as they were when it was built."""
    devices = ["CPU:0", "CPU:1", "CPU:2"]
    x = rng.standard_normal((3, 4099)).astype(np.float32)
    m = td.Tensor(x).shard(devices, axis=0).realize()
    td.synchronize()
    engine = td.get_engine()
    gates = [Gate() for _ in devices]
    try:
        for gate, device in zip(gates, devices):  # hold every device's compute queue
            engine.device(device).queues["compute"].submit([gate.command])
        doubled = (m * 2).realize()               # producers, queued behind the gates
        total = doubled.sum(axis=0, algorithm=algorithm).realize()
        for shard in m.shards:                    # overwrite the sources the doubling reads...
            shard.assign(shard * 0 - 1).realize()
        for shard in doubled.shards:              # ...and the partials the allreduce reads
            shard.assign(shard * 0 + 100).realize()
    finally:
        for gate in gates:
            gate.open()
    for replica in total.shards:
        np.testing.assert_allclose(replica.numpy(), (2 * x).sum(axis=0), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(doubled.numpy(), np.full_like(x, 100))


def test_copy_to_a_peer_as_a_result_is_a_real_copy() -> None:
    source = td.Tensor(np.arange(10, dtype=np.float32), device="CPU:0").realize()
    moved = source.to("CPU:1")
    schedule, _ = create_schedule([moved.node])
    assert [type(c) for c in schedule.linear] == [CopyCall]
    moved.realize()
    source.assign(source * 0).realize()  # the copy has its own memory: later writes do not reach it
    np.testing.assert_array_equal(moved.numpy(), np.arange(10, dtype=np.float32))
    np.testing.assert_array_equal(source.numpy(), np.zeros(10, np.float32))


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


def test_gather_along_the_first_axis_copies_each_shard_into_place() -> None:
    x = rng.standard_normal((8, 5)).astype(np.float32)
    m = td.Tensor(x).shard(DEVICES3, axis=0).realize()
    gathered = m.to("CPU:3")
    schedule, inputs = create_schedule([gathered.node])
    (gather,) = schedule.linear  # one call: each shard's bytes copied from its device's memory
    assert isinstance(gather, GatherCall) and gather.device == "CPU:3"
    assert [schedule.specs[i].device for i in gather.srcs] == DEVICES3
    np.testing.assert_array_equal(gathered.numpy(), x)


def test_gather_bigger_than_the_cache_streams_each_shard_into_place() -> None:
    rows = (STREAMING_STORE_BYTES // 4) // 3 + 7  # three odd-sized pieces at unaligned offsets
    x = rng.standard_normal(3 * rows + 2).astype(np.float32)
    m = td.Tensor(x).shard(DEVICES3, axis=0).realize()
    gathered = m.to("CPU:3")
    assert isinstance(create_schedule([gathered.node])[0].linear[0], GatherCall)
    np.testing.assert_array_equal(gathered.numpy(), x)
    moved = gathered.to("CPU:0")  # one copy bigger than the cache, between peers
    assert isinstance(create_schedule([moved.node])[0].linear[0], CopyCall)
    np.testing.assert_array_equal(moved.numpy(), x)


def test_gather_to_one_device_reads_each_shard_in_place() -> None:
    x = rng.standard_normal((8, 5)).astype(np.float32)
    m = td.Tensor(x).shard(DEVICES3, axis=1).realize()
    gathered = m.to("CPU:3")
    assert gathered.device == "CPU:3"
    schedule, inputs = create_schedule([gathered.node])
    # kernels on CPU:3 only, the one writing the result reading the three shards from their
    # devices' memory: no copies
    assert all(isinstance(c, KernelCall) and c.device == "CPU:3" for c in schedule.linear)
    join = schedule.linear[-1]
    assert sorted(schedule.specs[i].device for i in join.inputs if i < len(inputs)) == DEVICES3
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


def test_jit_replays_a_gather_that_reads_a_peer() -> None:
    @td.jit
    def join(a: td.Tensor, b: td.Tensor) -> td.Tensor:
        return td.cat([a * 2, b.to("CPU:0") + 1], 0)

    for k in range(4):  # capture, then replays over new inputs
        a = td.Tensor(np.arange(6, dtype=np.float32).reshape(2, 3) + k)
        b = td.Tensor(np.full((1, 3), k, np.float32), device="CPU:1")
        np.testing.assert_array_equal(join(a, b).numpy(), np.concatenate([a.numpy() * 2, b.numpy() + 1]))
    schedule, _ = create_schedule([td.cat([a * 2, b.to("CPU:0") + 1], 0).node])
    assert isinstance(schedule.linear[-1], GatherCall)


@pytest.mark.parametrize("ndev", [2, 3, 4])
def test_direct_allreduce_is_one_slice_kernel_per_device_writing_every_output(ndev: int) -> None:
    """Device d reduces range d of every input where it lives and writes it into every output:
    the ranges are disjoint, cover the buffers, start on whole 64-byte vectors, nothing is copied."""
    devices = [f"CPU:{i}" for i in range(ndev)]
    elements = 10007
    parts = [td.Tensor(rng.standard_normal(elements).astype(np.float32), device=d).realize() for d in devices]
    outs = allreduce(parts, "sum", "direct")
    schedule, inputs = create_schedule([o.node for o in outs])
    assert all(isinstance(c, SliceCall) for c in schedule.linear)
    assert [c.device for c in schedule.linear] == devices
    targets = set(schedule.targets)
    ranges = []
    for call in schedule.linear:
        assert set(call.outs) == targets and call.ast.outputs == ndev
        assert [schedule.specs[i].device for i in call.inputs] == devices  # peers' inputs read in place
        assert call.start % 64 == 0
        ranges.append((call.start, call.start + call.nbytes))
    assert ranges[0][0] == 0 and ranges[-1][1] == elements * 4
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    expected = sum(p.numpy() for p in parts)
    for out in outs:
        np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.float64])
@pytest.mark.parametrize("op", ["sum", "max", "min", "prod"])
def test_direct_allreduce_of_other_dtypes_equals_numpy(dtype: type, op: str) -> None:
    arrays = [rng.integers(-3, 4, 1031).astype(dtype) for _ in DEVICES3]
    parts = [td.Tensor(a, device=d) for a, d in zip(arrays, DEVICES3)]
    expected = getattr(np, op)(np.stack(arrays), axis=0)
    for out in allreduce(parts, op, "direct"):
        assert out.dtype.np == np.dtype(dtype)
        np.testing.assert_array_equal(out.numpy(), expected)


def test_direct_allreduce_outputs_realized_one_at_a_time_or_feeding_kernels() -> None:
    arrays = [rng.standard_normal(3001).astype(np.float32) for _ in DEVICES3]
    expected = np.sum(arrays, axis=0)
    parts = [td.Tensor(a, device=d) for a, d in zip(arrays, DEVICES3)]
    outs = allreduce([p * 1 for p in parts], "sum", "direct")  # inputs computed in the same graph
    np.testing.assert_allclose(outs[1].numpy(), expected, rtol=1e-5, atol=1e-5)  # alone: only its output
    later = [out * 2 + 1 for out in outs]  # readers on every device, after every device's writes
    realize([out.node for out in later])  # one schedule
    for out, device in zip(later, DEVICES3):
        assert out.device == device
        np.testing.assert_allclose(out.numpy(), expected * 2 + 1, rtol=1e-5, atol=1e-5)


def test_auto_is_direct_for_peers_and_graph_algorithms_under_autograd() -> None:
    parts = [td.Tensor(np.ones(8, np.float32), device=d) for d in DEVICES3]
    outs = allreduce(parts, "sum")
    assert all(o.node.op.name == "ALLREDUCE" for o in outs)
    trained = [td.Tensor(np.ones(8, np.float32), device=d, requires_grad=True) for d in DEVICES3]
    outs = allreduce(trained, "sum")
    assert not any(o.node.op.name == "ALLREDUCE" for o in outs)  # autograd differentiates the graph ones
    outs[0].sum().backward()
    np.testing.assert_array_equal(trained[1].grad.numpy(), np.ones(8, np.float32))
    with pytest.raises(ValueError, match="'direct' needs inputs on devices of one peer group"):
        allreduce(trained, "sum", "direct")


def test_jit_replays_a_direct_allreduce() -> None:
    @td.jit
    def reduce(a: td.Tensor, b: td.Tensor) -> list[td.Tensor]:
        return [o + 1 for o in allreduce([a * 2, b], "sum", "direct")]

    for k in range(4):  # capture, then replays over new inputs
        a = td.Tensor(np.arange(1037, dtype=np.float32) + k)
        b = td.Tensor(np.full(1037, k, np.float32), device="CPU:1")
        first, second = reduce(a, b)
        assert (first.device, second.device) == ("CPU:0", "CPU:1")
        for out in (first, second):
            np.testing.assert_array_equal(out.numpy(), a.numpy() * 2 + b.numpy() + 1)


def test_direct_allreduce_bigger_than_the_cache_streams_its_outputs() -> None:
    elements = (STREAMING_STORE_BYTES // 4) // 4 + 5  # odd: ranges end mid-vector, a scalar tail
    arrays = [rng.standard_normal(elements).astype(np.float32) for _ in range(2)]
    parts = [td.Tensor(a, device=f"CPU:{i}") for i, a in enumerate(arrays)]
    outs = allreduce(parts, "max", "direct")
    schedule, _ = create_schedule([o.node for o in outs])
    assert all(call.ast.stream_stores for call in schedule.linear)
    for out in outs:
        np.testing.assert_array_equal(out.numpy(), np.maximum(*arrays))
