"""Timelines: monotonic 64-bit counters, awaited without polling, signalled from any thread.

Every wait here runs on a `MockClock`: deadlines pass only when a test advances it, so no test
sleeps or depends on real time, and each asserts both sides of a deadline.
"""

from __future__ import annotations

import threading
import time

import anyio
import pytest

import tinydist.runtime.timeline as timeline_module
from tinydist.base.errors import DeviceFailed, DeviceHang
from tinydist.runtime.clock import SYSTEM_CLOCK
from tinydist.runtime.timeline import MAX_VALUE, Timeline
from tinydist.testing import MockClock

from .helpers import armed

pytestmark = pytest.mark.anyio


async def test_wait_returns_once_value_reached(clock: MockClock) -> None:
    tl = Timeline("t", clock=clock)
    done: list[int] = []

    async def waiter() -> None:
        await tl.wait(3, timeout=30)
        done.append(tl.value)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await armed(clock, 1)
            tl.signal(1)
            tl.signal(2)
            await anyio.lowlevel.checkpoint()
            await anyio.lowlevel.checkpoint()
            assert done == []  # not yet reached: still waiting, its deadline still armed
            assert tl.statistics().async_waiters == 1 and clock.waiters == 1
            tl.signal(5)
    assert done == [5]
    assert tl.statistics().async_waiters == 0
    assert clock.waiters == 0  # the deadline was disarmed, not left to fire


async def test_wait_for_reached_value_returns_immediately(clock: MockClock) -> None:
    """A reached value returns however long ago it was reached: that is no hang."""
    tl = Timeline("t", clock=clock)
    tl.signal(7)
    clock.advance(3600)  # an hour without progress, on a one-second timeout
    with anyio.fail_after(5):
        await tl.wait(7, timeout=1)
        await tl.wait(3, timeout=1)
        await tl.wait(0, timeout=1)
    assert tl.statistics().async_waiters == 0
    assert clock.waiters == 0  # nothing was armed
    assert tl.failure is None


async def test_signal_from_another_thread_wakes_async_waiter(clock: MockClock) -> None:
    tl = Timeline("t", clock=clock)

    async def waiter() -> None:
        await tl.wait(1, timeout=30)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await armed(clock, 1)
            thread = threading.Thread(target=tl.signal, args=(1,))
            thread.start()
        thread.join(5)
    assert tl.value == 1
    assert tl.statistics().async_waiters == 0


def test_timeline_is_monotonic() -> None:
    tl = Timeline("mono")
    tl.signal(5)
    tl.signal(5)  # the same value again is allowed
    with pytest.raises(ValueError, match=r"mono is monotonic: cannot move from 5 back to 4"):
        tl.signal(4)
    assert tl.value == 5


def test_timeline_is_64_bit() -> None:
    tl = Timeline("wide")
    with pytest.raises(ValueError, match=r"outside 0\.\.2\*\*64-1"):
        tl.signal(-1)
    with pytest.raises(ValueError, match=r"outside 0\.\.2\*\*64-1"):
        tl.signal(MAX_VALUE + 1)
    assert tl.value == 0
    tl.signal(2**63)  # beyond a signed 64-bit counter
    tl.signal(MAX_VALUE)
    assert tl.value == MAX_VALUE == 2**64 - 1
    assert tl.reached(MAX_VALUE)


def test_wait_blocking_from_a_thread(clock: MockClock) -> None:
    tl = Timeline("t", clock=clock)
    outcome: list[object] = []

    def worker() -> None:
        try:
            tl.wait_blocking(2, timeout=30)
            outcome.append(tl.value)
        except BaseException as exc:  # noqa: BLE001 - reported through `outcome`
            outcome.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    clock.wait_for_waiters(1)
    assert tl.statistics().blocked_threads == 1
    tl.signal(1)
    # 1 < 2: the signal released nothing (a release takes the wait off the clock at once)
    assert clock.waiters == 1 and tl.statistics().blocked_threads == 1
    tl.signal(2)
    thread.join(10)
    assert not thread.is_alive()
    assert outcome == [2]
    assert tl.statistics().blocked_threads == 0 and clock.waiters == 0


def test_a_signal_wakes_only_the_blocked_threads_whose_target_it_reached(clock: MockClock) -> None:
    tl = Timeline("t", clock=clock)
    returned: list[int] = []
    threads = [threading.Thread(target=lambda v=v: (tl.wait_blocking(v, timeout=30), returned.append(v))) for v in (2, 5)]
    for thread in threads:
        thread.start()
    clock.wait_for_waiters(2)
    tl.signal(3)
    threads[0].join(10)
    assert returned == [2]
    # the waiter for 5 was never woken: it still holds its registration, its wake-up untouched
    (later,) = tl._blocked
    assert later.target == 5 and not later.wake.released and clock.waiters == 1
    tl.signal(5)
    threads[1].join(10)
    assert returned == [2, 5] and tl.statistics().blocked_threads == 0


def test_an_interrupted_blocking_wait_leaves_no_registration() -> None:
    class Interrupted(MockClock):
        def wait(self, wakeup: object, deadline: float) -> bool:
            raise KeyboardInterrupt  # what Ctrl-C raises in a main thread blocked there

    tl = Timeline("t", clock=Interrupted())
    with pytest.raises(KeyboardInterrupt):
        tl.wait_blocking(5, timeout=30)
    assert tl.statistics().blocked_threads == 0
    tl.signal(5)  # nothing left to wake


def test_wait_blocking_reached_value_returns_immediately(clock: MockClock) -> None:
    tl = Timeline("t", clock=clock)
    tl.signal(4)
    clock.advance(3600)
    tl.wait_blocking(4, timeout=1)
    assert tl.failure is None and clock.waiters == 0


def test_blocking_wait_declares_the_hang_at_its_deadline_and_not_before(clock: MockClock) -> None:
    tl = Timeline("stuck", clock=clock)
    outcome: list[BaseException] = []

    def worker() -> None:
        try:
            tl.wait_blocking(1, timeout=60)
        except BaseException as exc:  # noqa: BLE001 - reported through `outcome`
            outcome.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    clock.wait_for_waiters(1)
    clock.advance(59.5)
    assert clock.waiters == 1 and tl.failure is None and thread.is_alive()  # 0.5 s short: still waiting
    clock.advance(0.5)
    thread.join(10)
    (hang,) = outcome
    assert isinstance(hang, DeviceHang)
    assert str(hang).startswith("timeline stuck stayed at 0 for 60s while waiting for 1")
    assert tl.failure is hang


def test_call_when_reached() -> None:
    tl = Timeline("t")
    calls: list[str] = []
    tl.call_when_reached(2, lambda: calls.append("at 2"))
    tl.call_when_reached(5, lambda: calls.append("at 5"))
    tl.signal(1)
    assert calls == []
    tl.signal(3)
    assert calls == ["at 2"]
    tl.call_when_reached(3, lambda: calls.append("already"))  # reached: runs now
    assert calls == ["at 2", "already"]
    tl.signal(5)
    assert calls == ["at 2", "already", "at 5"]
    tl.signal(9)
    assert calls == ["at 2", "already", "at 5"]  # each runs once


def test_callbacks_wait_for_retire_not_for_failure() -> None:
    """A failure alone releases nothing (a kernel may still run); retiring the work does."""
    tl = Timeline("t")
    calls: list[str] = []
    tl.call_when_reached(10, lambda: calls.append("released"))
    tl.fail(DeviceFailed("boom"))
    assert calls == []
    tl.retire(10)
    assert calls == ["released"]
    assert tl.value == 0  # retiring does not claim the work completed
    tl.call_when_reached(5, lambda: calls.append("late"))  # already retired: runs now
    assert calls == ["released", "late"]


def test_each_signal_runs_exactly_the_callbacks_now_due_in_registration_order() -> None:
    """Callbacks registered out of target order (a caller far ahead of the device queues many):
    a signal runs those whose target it reached — in registration order for one target — and
    leaves the rest for later signals or a retire."""
    tl = Timeline("t")
    calls: list[tuple[int, int]] = []
    for i, target in enumerate([5, 2, 9, 2, 7, 5, 1000]):
        tl.call_when_reached(target, lambda target=target, i=i: calls.append((target, i)))
    tl.signal(2)
    assert calls == [(2, 1), (2, 3)]
    tl.signal(7)
    assert calls[2:] == [(5, 0), (5, 5), (7, 4)]
    tl.signal(9)
    assert calls[5:] == [(9, 2)]
    tl.retire(1000)
    assert calls[6:] == [(1000, 6)] and tl.value == 9


async def test_callbacks_run_before_waiters_wake(clock: MockClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """A waiter that sees the value also sees what completion released (memory, keep-alives):
    the signal runs the callbacks before it wakes a blocked thread or an async waiter."""
    tl = Timeline("t", clock=clock)
    order: list[object] = []
    real_wake = timeline_module._wake
    monkeypatch.setattr(timeline_module, "_wake", lambda waiter, error: (order.append("async waiter woken"),
                                                                       real_wake(waiter, error)))
    # both waits still armed on the clock while the callback runs: nobody was woken yet
    tl.call_when_reached(1, lambda: order.append(("callback", clock.waiters)))
    blocked = threading.Thread(target=tl.wait_blocking, args=(1, 30))
    blocked.start()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(tl.wait, 1, 30)
            await armed(clock, 2)
            tl.signal(1)
        blocked.join(5)
    assert order == [("callback", 2), "async waiter woken"]
    assert not blocked.is_alive() and clock.waiters == 0


async def test_hang_without_device_raises_and_fails_timeline(clock: MockClock) -> None:
    tl = Timeline("lonely", clock=clock)
    outcome: list[BaseException] = []

    async def waiter() -> None:
        try:
            await tl.wait(1, timeout=60)
        except DeviceHang as exc:
            outcome.append(exc)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await armed(clock, 1)
            clock.advance(59.5)
            await anyio.lowlevel.checkpoint()
            assert outcome == [] and tl.failure is None and clock.waiters == 1  # not yet: 0.5 s to go
            clock.advance(0.5)
    (hang,) = outcome
    assert str(hang).startswith("timeline lonely stayed at 0 for 60s while waiting for 1")
    assert tl.failure is hang
    with pytest.raises(DeviceHang) as again:
        await tl.wait(1, timeout=30)
    assert again.value is hang
    with pytest.raises(DeviceHang) as blocked:
        tl.wait_blocking(1, timeout=30)
    assert blocked.value is hang


async def test_progress_resets_the_watchdog(clock: MockClock) -> None:
    """A slow but moving timeline is never declared hung, for async and blocking waiters alike.

    Each step signals 6 s after the one before, 240 s in all, on a 10 s timeout: every deadline
    from the second step on (10 s after the signal before) passes before that step's signal and
    finds progress. Without the progress rule both waiters would be declared hung at 10 s.
    """
    tl = Timeline("slow", clock=clock)
    steps, interval, timeout = 40, 6.0, 10.0
    blocking_outcome: list[object] = []

    def blocking_waiter() -> None:
        try:
            tl.wait_blocking(steps, timeout=timeout)
            blocking_outcome.append(tl.value)
        except BaseException as exc:  # noqa: BLE001 - reported through the list
            blocking_outcome.append(exc)

    blocked = threading.Thread(target=blocking_waiter)
    blocked.start()
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(tl.wait, steps, timeout)
            await armed(clock, 2)
            for value in range(1, steps + 1):
                clock.advance(interval)
                await armed(clock, 2)  # both waiting again (those whose deadline passed re-armed)
                last_progress = (value - 1) * interval
                # each counted from the last signal, so 4 s ahead: from step 2 on the one before passed
                assert clock.deadlines == [last_progress + timeout] * 2
                tl.signal(value)
        blocked.join(10)
    assert tl.value == steps
    assert tl.failure is None
    assert blocking_outcome == [steps]


async def test_the_watchdog_restarts_from_the_last_progress(clock: MockClock) -> None:
    """A deadline that finds progress moves the next one to `timeout` after the last signal —
    not after the deadline that noticed it — for async and blocking waiters alike."""
    tl = Timeline("paused", clock=clock)
    errors: list[BaseException] = []

    async def waiter() -> None:
        try:
            await tl.wait(2, timeout=10)
        except DeviceHang as exc:
            errors.append(exc)

    def blocking_waiter() -> None:
        try:
            tl.wait_blocking(2, timeout=10)
        except DeviceHang as exc:
            errors.append(exc)

    blocked = threading.Thread(target=blocking_waiter)
    blocked.start()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await armed(clock, 2)
            clock.advance(4)
            tl.signal(1)      # progress at 4
            clock.advance(6)  # 10: the first deadline finds that progress
            await armed(clock, 2)
            assert clock.deadlines == [14, 14]
            clock.advance(3.5)
            await anyio.lowlevel.checkpoint()
            assert errors == [] and tl.failure is None  # 13.5: within 10 s of the progress at 4
            clock.advance(0.5)  # 14: 10 s after the last progress
        blocked.join(10)
    assert len(errors) == 2 and errors[0] is errors[1] is tl.failure
    assert str(errors[0]).startswith("timeline paused stayed at 1 for 10s while waiting for 2")


def test_timelines_default_to_real_time_and_refuse_what_is_not_a_clock() -> None:
    assert Timeline("t").clock is SYSTEM_CLOCK
    with pytest.raises(TypeError, match=r"clock must be a tinydist\.runtime\.clock\.Clock .*got <built-in function monotonic>"):
        Timeline("t", clock=time.monotonic)  # type: ignore[arg-type]
