"""Timelines: monotonic 64-bit counters, awaited without polling, signalled from any thread."""

from __future__ import annotations

import threading

import anyio
import pytest

from tinydist.errors import DeviceFailed, DeviceHang
from tinydist.runtime.timeline import MAX_VALUE, Timeline
from tinydist.testing import MockClock

from .helpers import until

pytestmark = pytest.mark.anyio


async def test_wait_returns_once_value_reached() -> None:
    tl = Timeline("t")
    done: list[int] = []

    async def waiter() -> None:
        await tl.wait(3, timeout=30)
        done.append(tl.value)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await until(lambda: tl.statistics().async_waiters == 1)
            tl.signal(1)
            tl.signal(2)
            await anyio.sleep(0)
            await anyio.sleep(0)
            assert done == []  # not yet reached: still waiting
            assert tl.statistics().async_waiters == 1
            tl.signal(5)
    assert done == [5]
    assert tl.statistics().async_waiters == 0


async def test_wait_for_reached_value_returns_immediately() -> None:
    tl = Timeline("t")
    tl.signal(7)
    with anyio.fail_after(5):
        await tl.wait(7, timeout=0.01)
        await tl.wait(3, timeout=0.01)
        await tl.wait(0, timeout=0.01)
    assert tl.statistics().async_waiters == 0
    assert tl.failure is None  # a tiny timeout on a reached value is not a hang


async def test_signal_from_another_thread_wakes_async_waiter() -> None:
    tl = Timeline("t")

    async def waiter() -> None:
        await tl.wait(1, timeout=30)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await until(lambda: tl.statistics().async_waiters == 1)
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


def test_wait_blocking_from_a_thread() -> None:
    tl = Timeline("t")
    outcome: list[object] = []

    def worker() -> None:
        try:
            tl.wait_blocking(2, timeout=30)
            outcome.append(tl.value)
        except BaseException as exc:  # noqa: BLE001 - reported through `outcome`
            outcome.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    for _ in range(5000):
        if tl.statistics().blocked_threads == 1:
            break
        thread.join(0.002)
    assert tl.statistics().blocked_threads == 1
    tl.signal(1)
    thread.join(0.05)
    assert thread.is_alive() and outcome == []  # 1 < 2: still blocked
    tl.signal(2)
    thread.join(10)
    assert not thread.is_alive()
    assert outcome == [2]
    assert tl.statistics().blocked_threads == 0


def test_a_signal_wakes_only_the_blocked_threads_whose_target_it_reached() -> None:
    tl = Timeline("t")
    returned: list[int] = []
    threads = [threading.Thread(target=lambda v=v: (tl.wait_blocking(v, timeout=30), returned.append(v))) for v in (2, 5)]
    for thread in threads:
        thread.start()
    for _ in range(5000):
        if tl.statistics().blocked_threads == 2:
            break
        threads[0].join(0.002)
    tl.signal(3)
    threads[0].join(10)
    assert returned == [2]
    # the waiter for 5 was never woken: it still holds its registration, its wake lock untouched
    (later,) = tl._blocked
    assert later.target == 5 and later.wake.locked()
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


def test_wait_blocking_reached_value_returns_immediately() -> None:
    tl = Timeline("t")
    tl.signal(4)
    tl.wait_blocking(4, timeout=0.001)
    assert tl.failure is None


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


async def test_callbacks_run_before_waiters_wake() -> None:
    """A waiter that sees the value also sees what completion released (memory, keep-alives).

    The callback holds the signalling thread for a bounded while; if waiters were woken before
    callbacks ran, the waiter would wake during that window and the callback would see it.
    """
    tl = Timeline("t")
    waiter_woke = threading.Event()
    woke_during_callback: list[bool] = []
    tl.call_when_reached(1, lambda: woke_during_callback.append(waiter_woke.wait(0.3)))

    async def waiter() -> None:
        await tl.wait(1, timeout=30)
        waiter_woke.set()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await until(lambda: tl.statistics().async_waiters == 1)
            await anyio.to_thread.run_sync(tl.signal, 1)
    assert woke_during_callback == [False]
    assert waiter_woke.is_set()


async def test_hang_without_device_raises_and_fails_timeline() -> None:
    tl = Timeline("lonely")
    with anyio.fail_after(10):
        with pytest.raises(DeviceHang, match=r"timeline lonely stayed at 0 .* waiting for 1") as info:
            await tl.wait(1, timeout=0.05)
    assert tl.failure is info.value
    with pytest.raises(DeviceHang) as again:
        await tl.wait(1, timeout=30)
    assert again.value is info.value
    with pytest.raises(DeviceHang) as blocked:
        tl.wait_blocking(1, timeout=30)
    assert blocked.value is info.value


async def test_progress_resets_the_watchdog() -> None:
    """A slow but moving timeline is never declared hung, for async and blocking waiters alike.

    The signaller advances in steps far shorter than the timeout, for far longer than the
    timeout in total: without the progress rule the waiters would time out half way.
    """
    tl = Timeline("slow")
    steps, interval, timeout = 40, 0.02, 0.3
    stop = threading.Event()
    blocking_outcome: list[object] = []

    def signaller() -> None:
        for value in range(1, steps + 1):
            if stop.wait(interval):
                return
            tl.signal(value)

    def blocking_waiter() -> None:
        try:
            tl.wait_blocking(steps, timeout=timeout)
            blocking_outcome.append(tl.value)
        except BaseException as exc:  # noqa: BLE001 - reported through the list
            blocking_outcome.append(exc)

    blocked = threading.Thread(target=blocking_waiter)
    blocked.start()
    feeder = threading.Thread(target=signaller)
    feeder.start()
    try:
        with anyio.fail_after(30):
            await tl.wait(steps, timeout=timeout)
    finally:
        stop.set()
        feeder.join(10)
        blocked.join(10)
    assert tl.value == steps
    assert tl.failure is None
    assert blocking_outcome == [steps]
