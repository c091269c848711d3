"""A realize runs its schedule's lowering (`tinydist.engine.lowered`): stretches of kernels as
one command of the native interpreter (command by command while tracing). Every test runs its
graph a few times over new values, against queues held up by gates: what another queue, device
or the caller sees must stay ordered exactly as a call-by-call realize orders it."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import tinydist as td
from tinydist.engine.lowered import Lowered
from tinydist.engine.realize import realize
from tinydist.multi import ALGORITHMS
from tinydist.schedule import Schedule, create_schedule, schedule_cache
from tinydist.schedule.items import KernelCall
from tests.runtime.helpers import Gate

ROUNDS = 3  # lowered, then from the schedule cache
rng = np.random.default_rng(11)


def chain(t: td.Tensor, steps: int = 10) -> td.Tensor:
    for i in range(steps):
        t = t - t.max(1, keepdim=True) if i % 2 == 0 else t - t.mean(0, keepdim=True)
    return t


def chain_np(x: np.ndarray, steps: int = 10) -> np.ndarray:
    for i in range(steps):
        x = x - x.max(1, keepdims=True) if i % 2 == 0 else x - x.mean(0, keepdims=True)
    return x


def lowered(schedule: Schedule) -> Lowered:
    found = schedule.derived.get("realize")
    assert isinstance(found, Lowered), found
    return found


def _forget_lowerings() -> None:
    for _, schedule in schedule_cache._entries.values():
        schedule.derived.clear()


@pytest.fixture(autouse=True, params=["lowered", "call by call"])
def path(request, monkeypatch) -> Iterator[str]:
    """Every test also runs with realize going call by call, as it does where `lower` does not apply."""
    if request.param == "call by call":
        monkeypatch.setattr("tinydist.engine.realize.lower", lambda *args: None)
        _forget_lowerings()
    yield request.param
    if request.param == "call by call":
        _forget_lowerings()  # no schedule stays marked call by call for the tests after this one


class Gates:
    """Hold the compute (or copy) queues of `devices` until `open()`."""

    def __init__(self, devices: list[str], queue: str = "compute") -> None:
        self.gates = [Gate() for _ in devices]
        engine = td.get_engine()
        for gate, device in zip(self.gates, devices):
            engine.device(device).queues[queue].submit([gate.command])

    def open(self) -> None:
        for gate in self.gates:
            gate.open()


def test_a_schedule_is_lowered_once_its_kernels_one_interpreter_command(path: str) -> None:
    if path != "lowered":
        pytest.skip("about the lowering")
    queue = td.get_engine().device("CPU:0").queues["compute"]
    forms = []
    for _ in range(ROUNDS):
        x = rng.standard_normal((6, 5)).astype(np.float32)
        t = chain(td.Tensor(x))
        schedule = create_schedule([t.node])[0]
        t.realize()
        td.synchronize()
        forms.append(lowered(schedule))
        assert queue.timings[-1].commands == 1
        np.testing.assert_allclose(t.numpy(), chain_np(x), rtol=1e-5, atol=1e-5)
    assert all(form is forms[0] for form in forms)  # lowered once


def test_the_interpreter_passes_every_argument_count_and_integers() -> None:
    """Kernels of 2 to 41 buffers (a sum of n inputs; past MAX_ARGUMENTS a command of their own),
    and a matmul's integer arguments."""
    for n in (1, 2, 3, 7, 31, 32, 40):
        xs = [rng.standard_normal(9).astype(np.float32) for _ in range(n)]
        total = td.Tensor(xs[0]) * 1
        for x in xs[1:]:
            total = total + td.Tensor(x)
        want = sum(xs)
        np.testing.assert_allclose((total - total.max()).numpy(), want - want.max(), rtol=1e-5, atol=1e-5)  # 3 kernels
    a, b = rng.standard_normal((2, 33, 17)).astype(np.float32), rng.standard_normal((2, 17, 9)).astype(np.float32)
    for _ in range(2):
        out = ((td.Tensor(a) + 1) @ td.Tensor(b)).exp() * 0.5
        np.testing.assert_allclose(out.numpy(), np.exp((a + 1) @ b) * 0.5, rtol=1e-4, atol=1e-5)


def test_a_small_realize_runs_on_the_calling_thread_only_when_its_queue_is_idle(path: str) -> None:
    if path != "lowered":
        pytest.skip("about the lowering")
    x = td.Tensor(rng.standard_normal((6, 5)).astype(np.float32)).realize()
    td.synchronize()
    done = [c.done() for c in realize([chain(x).node])]
    assert done == [True]  # 10 kernels over 6x5: less work than a hand-off to the worker
    gates = Gates(["CPU:0"])
    try:
        held = realize([chain(x).node])
        assert not any(c.done() for c in held)  # queued behind the gate, in order
    finally:
        gates.open()
    td.synchronize()
    assert all(c.done() for c in held)


def test_a_device_error_while_lowering_is_not_kept_with_the_schedule(path: str, monkeypatch) -> None:
    """The realize goes call by call; the next one lowers (the device may have been reopened)."""
    if path != "lowered":
        pytest.skip("about the lowering")
    import tinydist.engine.lowered as module
    from tinydist.base.errors import DeviceFailed
    x = td.Tensor(rng.standard_normal((6, 5)).astype(np.float32))
    t = chain(x)
    schedule = create_schedule([t.node])[0]
    schedule.derived.clear()
    real = module._lower
    monkeypatch.setattr(module, "_lower", lambda *args: (_ for _ in ()).throw(DeviceFailed("lost for a moment")))
    np.testing.assert_allclose(t.numpy(), chain_np(x.numpy()), rtol=1e-5, atol=1e-5)
    assert "realize" not in schedule.derived
    monkeypatch.setattr(module, "_lower", real)
    chain(x).realize()
    assert isinstance(schedule.derived["realize"], Lowered)


def test_tracing_sees_each_kernel_of_a_realize() -> None:
    x = td.Tensor(rng.standard_normal((6, 5)).astype(np.float32))
    chain(x).realize()
    td.synchronize()
    t = chain(x)
    kernels = sum(isinstance(c, KernelCall) for c in create_schedule([t.node])[0].linear)
    with td.trace() as tracer:
        t.realize()
    traced = [e for e in tracer.chrome()["traceEvents"] if e.get("cat") == "kernel"]
    assert len(traced) == kernels


def test_intermediates_are_held_not_recorded_and_given_back_when_done() -> None:
    """Inputs and targets are recorded where the caller and other queues see them; the arena is
    one hold per batch: its memory stays allocated until the kernels that use it have run."""
    engine = td.get_engine()
    device = engine.device("CPU:0")
    x = td.Tensor(rng.standard_normal((6, 5)).astype(np.float32)).realize()
    chain(x).realize()
    td.synchronize()
    t = chain(x)
    arena = sum(create_schedule([t.node])[0].plan.arena_bytes.values())
    assert arena > 0
    before = sorted(device.allocator.outstanding().values())
    gates = Gates(["CPU:0"])
    try:
        t.realize()
        compute = device.queues["compute"].timeline
        assert compute in x.node.buffer.accesses.pending() and compute in t.node.buffer.accesses.pending()
        held = sorted(device.allocator.outstanding().values())
        assert len(held) == len(before) + 2 and arena in held  # the arena was freed, not given back
    finally:
        gates.open()
    td.synchronize()
    assert len(device.allocator.outstanding()) == len(before) + 1  # only the target is left
    np.testing.assert_allclose(t.numpy(), chain_np(x.numpy()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_allreduce_reads_peers_after_their_writers_and_before_later_writes(algorithm: str) -> None:
    devices = ["CPU:0", "CPU:1", "CPU:2"]
    for round in range(ROUNDS):
        x = rng.standard_normal((3, 1031)).astype(np.float32) + round
        m = td.Tensor(x).shard(devices, axis=0).realize()
        td.synchronize()
        gates = Gates(devices)
        try:
            doubled = (m * 2).realize()
            total = doubled.sum(axis=0, algorithm=algorithm).realize()
            for shard in m.shards:                # overwrite what the doubling reads...
                shard.assign(shard * 0 - 1).realize()
            for shard in doubled.shards:          # ...and what the allreduce reads
                shard.assign(shard * 0 + 100).realize()
        finally:
            gates.open()
        for replica in total.shards:
            np.testing.assert_allclose(replica.numpy(), (2 * x).sum(axis=0), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(doubled.numpy(), np.full_like(x, 100))


@pytest.mark.parametrize("held", ["CPU:0/compute", "CPU:1/copy", "CPU:1/compute"])
def test_an_intermediate_copied_to_another_device_waits_for_its_writer(held: str) -> None:
    """`(a * 2).to("CPU:1") + 1`: CPU:0 computes into its arena, CPU:1's copy queue copies that,
    CPU:1's kernel reads the copy: three streams in one realize, ordered by the access logs; a
    later overwrite of the source waits for the read."""
    device, queue = held.split("/")
    for round in range(ROUNDS):
        source = rng.standard_normal(257).astype(np.float32) + round
        a = td.Tensor(source, device="CPU:0").realize()
        td.synchronize()
        gates = Gates([device], queue)
        try:
            out = ((a * 2).to("CPU:1") + 1).realize()
            a.assign(a * 0).realize()
        finally:
            gates.open()
        np.testing.assert_array_equal(out.numpy(), source * 2 + 1)
        np.testing.assert_array_equal(a.numpy(), np.zeros_like(source))


def test_a_gather_reads_a_peers_copy_after_it_lands() -> None:
    for round in range(ROUNDS):
        a = td.Tensor(rng.standard_normal((2, 3)).astype(np.float32) + round).realize()
        b = td.Tensor(np.full((1, 3), round, np.float32), device="CPU:1").realize()
        want = np.concatenate([a.numpy() * 2, b.numpy() + 1])
        gates = Gates(["CPU:1"])
        try:
            joined = td.cat([a * 2, (b * 1).to("CPU:0") + 1], 0).realize()
        finally:
            gates.open()
        np.testing.assert_array_equal(joined.numpy(), want)


def test_readers_of_an_overwritten_buffer_see_the_old_value_every_time() -> None:
    for round in range(ROUNDS):
        start = rng.standard_normal(5).astype(np.float32)
        x = td.Tensor(start).realize()
        reader = x * 3 + 1
        x.assign(x * 0 + round)
        gates = Gates(["CPU:0"])
        try:
            x.realize()  # realizes the reader too, from the old value
        finally:
            gates.open()
        np.testing.assert_array_equal(reader.numpy(), start * 3 + 1)
        np.testing.assert_array_equal(x.numpy(), np.full(5, round, np.float32))
