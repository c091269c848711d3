"""Hang detection: one waiter's deadline fails the whole device and wakes every waiter with one error.

The devices run on a `MockClock`: a deadline passes when the test advances it — never before,
however slow the machine — and a 60 s hang costs no real time.
"""

from __future__ import annotations

import threading

import anyio
import numpy as np
import pytest

from tinydist.base.errors import DeviceFailed, DeviceHang
from tinydist.runtime.clock import SYSTEM_CLOCK
from tinydist.runtime.device import DeviceState
from tinydist.runtime.registry import open_device
from tinydist.testing import MockClock

from .helpers import Gate, advance_once_armed, armed

pytestmark = pytest.mark.anyio


def _worker_threads(device: object) -> list[str]:
    """Names of the device's own worker threads that are still running."""
    return sorted(q.worker.name for q in device.queues.values() if q.worker is not None and q.worker.is_alive())


def _when_retired(timeline, value: int) -> threading.Event:
    """Set once the work up to `value` on `timeline` is over (and what it held given back)."""
    over = threading.Event()
    timeline.call_when_reached(value, over.set)
    return over


async def test_hang_wakes_every_waiter_with_the_same_error(gate, clock: MockClock) -> None:
    dev = open_device("CPU:2", clock=clock)
    await dev.open()
    compute, copy = dev.queues["compute"], dev.queues["copy"]
    stall_compute: Gate = gate()
    stall_copy: Gate = gate()
    buf = dev.allocator.alloc(64)
    try:
        assert compute.submit([stall_compute.command]) == 1
        assert copy.submit([stall_copy.command]) == 1
        doomed = dev.allocator.alloc(256)       # freed while work on it is queued: given back late
        dev.copyin(doomed, np.ones(256, np.uint8))
        doomed.free()
        copy_given_back = _when_retired(copy.timeline, 2)  # runs after what the copy held is freed
        assert dev.allocator.statistics().live_buffers == 2
        errors: dict[str, BaseException] = {}

        async def waiter(label: str, timeline, timeout: float) -> None:
            try:
                await timeline.wait(1, timeout=timeout)
            except BaseException as exc:  # noqa: BLE001 - collected and compared below
                errors[label] = exc

        def blocking_waiter() -> None:
            try:
                copy.timeline.wait_blocking(1, timeout=3600)
            except BaseException as exc:  # noqa: BLE001
                errors["thread"] = exc

        thread = threading.Thread(target=blocking_waiter)
        thread.start()
        with anyio.fail_after(20):  # every waiter must wake long before its own hour-long deadline
            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter, "compute-a", compute.timeline, 3600)
                tg.start_soon(waiter, "compute-b", compute.timeline, 3600)
                tg.start_soon(waiter, "copy", copy.timeline, 3600)
                await armed(clock, 4)
                assert compute.timeline.statistics().async_waiters == 2
                assert copy.timeline.statistics().async_waiters == 1 and copy.timeline.statistics().blocked_threads == 1
                tg.start_soon(waiter, "short", compute.timeline, 60)
                await armed(clock, 5)
                clock.advance(59.5)
                await anyio.lowlevel.checkpoint()
                assert errors == {} and dev.state is DeviceState.OPEN and clock.waiters == 5  # 0.5 s short
                clock.advance(0.5)
            await anyio.to_thread.run_sync(thread.join, 20)
        assert not thread.is_alive()
        assert clock.now() == 60 and clock.waiters == 0

        hang = errors["short"]
        assert isinstance(hang, DeviceHang)
        assert isinstance(hang, TimeoutError)
        assert isinstance(hang, DeviceFailed)
        assert "timeline CPU:2/compute stayed at 0 for 60s while waiting for 1" in str(hang)
        assert "CPU:2" in str(hang) and "marked failed" in str(hang)
        assert set(errors) == {"short", "compute-a", "compute-b", "copy", "thread"}
        for label, error in errors.items():
            assert error is hang, label

        assert dev.state is DeviceState.FAILED
        assert dev.failure is hang
        for timeline in (compute.timeline, copy.timeline):
            stats = timeline.statistics()
            assert stats.failed and stats.async_waiters == 0 and stats.blocked_threads == 0

        # the copy queue's worker is still inside a command, so what the queued copy holds stays
        # put until the worker is done with it: never given back underneath running work
        assert dev.allocator.statistics().live_buffers == 2

        # every later use refuses with that same error, and takes nothing
        before = dev.allocator.statistics()
        with pytest.raises(DeviceHang) as refused:
            compute.submit([])
        assert refused.value is hang
        with pytest.raises(DeviceHang) as refused:
            dev.batch()
        assert refused.value is hang
        with pytest.raises(DeviceHang) as refused:
            dev.allocator.alloc(128)
        assert refused.value is hang
        with pytest.raises(DeviceHang) as refused:
            dev.copyin(buf, np.zeros(64, np.uint8))
        assert refused.value is hang
        with pytest.raises(DeviceHang) as refused:
            await compute.timeline.wait(1, timeout=3600)
        assert refused.value is hang
        assert dev.allocator.statistics() == before
        assert compute.last_submitted == 1 and copy.last_submitted == 2

        # once the stalled command returns, the failed device skips the queued copy and gives back
        # what it held
        stall_copy.open()
        assert await anyio.to_thread.run_sync(copy_given_back.wait, 20)
        assert dev.allocator.statistics().live_buffers == 1
        assert list(dev.allocator.outstanding().values()) == [64]
    finally:
        stall_compute.open()
        stall_copy.open()
        with anyio.fail_after(20):
            await dev.aclose()
    assert dev.state is DeviceState.CLOSED
    assert dev.allocator.statistics().live_buffers == 0
    assert dev.allocator.outstanding() == {}
    assert _worker_threads(dev) == []
    await dev.aclose()  # still idempotent after a failure
    assert dev.state is DeviceState.CLOSED


async def test_hang_on_a_cross_queue_wait_fails_the_device(gate, clock: MockClock) -> None:
    """A queue blocked on another queue's timeline (a dependency wait) is woken by the hang too."""
    async with open_device("CPU:3", clock=clock) as dev:
        compute, copy = dev.queues["compute"], dev.queues["copy"]
        stall: Gate = gate()
        copy.submit([stall.command])
        # compute waits (on its worker thread) for the copy queue, exactly as Batch inserts waits
        compute.submit([(copy.timeline.wait_blocking, (1, 3600))])
        compute_over = _when_retired(compute.timeline, 1)
        await anyio.to_thread.run_sync(stall.entered.wait, 10)
        await armed(clock, 1)
        assert copy.timeline.statistics().blocked_threads == 1
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(advance_once_armed, clock, 2, 60)
                with pytest.raises(DeviceHang) as info:
                    await copy.timeline.wait(1, timeout=60)
        assert dev.state is DeviceState.FAILED
        # the compute worker woke from its blocking wait with the hang and gave its batch up
        assert await anyio.to_thread.run_sync(compute_over.wait, 10)
        assert copy.timeline.statistics().blocked_threads == 0 and clock.waiters == 0
        assert compute.timeline.value == 0  # the batch that depended on failed work did not complete
        assert dev.failure is info.value
        stall.open()
    assert dev.state is DeviceState.CLOSED
    assert _worker_threads(dev) == []


async def test_work_after_the_failure_point_is_not_run(gate, clock: MockClock) -> None:
    """A failed device does no more work, including the rest of the batch that was running."""
    async with open_device("CPU:2", clock=clock) as dev:
        compute = dev.queues["compute"]
        stall: Gate = gate()
        ran: list[str] = []
        compute.submit([stall.command, (ran.append, ("same batch",))])
        compute.submit([(ran.append, ("next batch",))])
        await anyio.to_thread.run_sync(stall.entered.wait, 10)
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(advance_once_armed, clock, 1, 60)
                with pytest.raises(DeviceHang):
                    await compute.timeline.wait(1, timeout=60)
        stall.open()
        with anyio.fail_after(20):
            await dev.aclose()  # joins the worker: everything it was going to do is done
        assert ran == []


async def test_a_failing_command_fails_the_device_and_wakes_waiters(clock: MockClock) -> None:
    """The failure, not a deadline, wakes the waiter: on the mock clock no deadline ever passes."""

    def broken() -> None:
        raise RuntimeError("kernel exploded")

    async with open_device("CPU:2", clock=clock) as dev:
        compute = dev.queues["compute"]
        value = compute.submit([(broken, ())])
        with anyio.fail_after(20):
            with pytest.raises(DeviceFailed, match=r"CPU:2/compute: batch 1 failed: RuntimeError: kernel exploded") as info:
                await compute.timeline.wait(value, timeout=60)
        assert not isinstance(info.value, DeviceHang)
        assert dev.state is DeviceState.FAILED
        with pytest.raises(DeviceFailed) as refused:
            dev.allocator.alloc(8)
        assert refused.value is info.value
    assert dev.state is DeviceState.CLOSED


async def test_a_device_times_its_waits_on_the_clock_it_was_opened_with(clock: MockClock) -> None:
    assert open_device("CPU:1").clock is SYSTEM_CLOCK  # real time unless a test says otherwise
    async with open_device("CPU:1", clock=clock) as dev:
        assert {q.timeline.clock for q in dev.queues.values()} == {clock}
    with pytest.raises(TypeError, match=r"clock must be a tinydist\.runtime\.clock\.Clock .*got 60"):
        open_device("CPU:1", clock=60)  # type: ignore[arg-type]
