"""The clocks timelines run on: real time (`SystemClock`) and virtual time (`MockClock`)."""

from __future__ import annotations

import asyncio
import threading
import time

import anyio
import pytest

from tinydist.runtime.clock import SYSTEM_CLOCK, Clock
from tinydist.testing import MockClock

pytestmark = pytest.mark.anyio


def test_both_clocks_are_clocks() -> None:
    assert isinstance(SYSTEM_CLOCK, Clock) and isinstance(MockClock(), Clock)
    assert SYSTEM_CLOCK.now is time.monotonic  # the builtin itself: a signal reads it per batch


async def test_system_clock_alarm_past_its_deadline_fires_on_the_loop_not_inline() -> None:
    fired = asyncio.Event()
    SYSTEM_CLOCK.call_at(SYSTEM_CLOCK.now() - 1, fired.set)
    assert not fired.is_set()  # a timer of no delay: called from the loop, never from call_at
    with anyio.fail_after(5):
        await fired.wait()
    cancelled: list[str] = []
    SYSTEM_CLOCK.call_at(SYSTEM_CLOCK.now() - 1, cancelled.append, "late").cancel()
    await anyio.lowlevel.checkpoint()
    await anyio.lowlevel.checkpoint()
    assert cancelled == []


def test_system_clock_wait_returns_at_a_release_or_a_passed_deadline() -> None:
    released = SYSTEM_CLOCK.wakeup()
    released.release()
    assert SYSTEM_CLOCK.wait(released, SYSTEM_CLOCK.now() + 3600) is True
    assert SYSTEM_CLOCK.wait(SYSTEM_CLOCK.wakeup(), SYSTEM_CLOCK.now() - 1) is False


def test_mock_time_moves_only_forward_and_only_when_advanced() -> None:
    clock = MockClock(start=100.0)
    assert clock.now() == 100.0
    clock.advance(0)
    clock.advance(2.5)
    assert clock.now() == 102.5
    for bad in (-1, float("nan")):
        with pytest.raises(ValueError, match=r"time only moves forward; pass seconds >= 0"):
            clock.advance(bad)
    assert clock.now() == 102.5


async def test_mock_alarms_fire_on_their_loop_once_advanced_past_in_deadline_order() -> None:
    clock = MockClock()
    fired: list[str] = []
    clock.call_at(5, fired.append, "at 5")
    clock.call_at(2, fired.append, "at 2")
    clock.call_at(9, fired.append, "at 9").cancel()
    clock.call_at(7, fired.append, "at 7")
    assert clock.deadlines == [2, 5, 7] and clock.waiters == 3
    clock.advance(4.999)
    await anyio.lowlevel.checkpoint()
    assert fired == ["at 2"]
    clock.advance(10)
    assert clock.waiters == 0 and fired == ["at 2"]  # due, but called from the loop, not by advance
    await anyio.lowlevel.checkpoint()
    assert fired == ["at 2", "at 5", "at 7"]
    clock.call_at(clock.now(), fired.append, "already due")
    assert clock.waiters == 0
    await anyio.lowlevel.checkpoint()
    assert fired[-1] == "already due"


def test_mock_wait_wakes_at_a_release_or_when_advanced_to_its_deadline() -> None:
    clock = MockClock()
    outcomes: list[bool] = []
    wakeups = [clock.wakeup(), clock.wakeup()]
    threads = [threading.Thread(target=lambda w=w, d=d: outcomes.append(clock.wait(w, d)))
               for w, d in zip(wakeups, (10, 20))]
    for thread in threads:
        thread.start()
    clock.wait_for_waiters(2)
    assert clock.deadlines == [10, 20]
    clock.advance(10)  # the first deadline
    threads[0].join(10)
    assert outcomes == [False] and clock.deadlines == [20] and threads[1].is_alive()
    wakeups[1].release()
    threads[1].join(10)
    assert outcomes == [False, True] and clock.waiters == 0


def test_mock_wait_on_a_released_or_passed_wakeup_returns_without_blocking() -> None:
    clock = MockClock()
    released = clock.wakeup()
    released.release()
    assert clock.wait(released, 1) is True
    assert clock.wait(clock.wakeup(), 0) is False  # the deadline is now
    assert clock.waiters == 0


def test_wait_for_waiters_names_what_it_found_when_the_count_never_comes() -> None:
    clock = MockClock()
    with pytest.raises(AssertionError, match=r"MockClock\(now=0, waiters=0\): expected 1 armed waits, still 0"):
        clock.wait_for_waiters(1, timeout=0)


def test_native_code_reads_each_clock_as_python_does() -> None:
    """On the system clock native code reads CLOCK_MONOTONIC itself (no address); a MockClock's
    native reading gives its time in nanoseconds, as it moves, and counts each reading; a clock
    with no native reading is refused by name."""
    import ctypes

    from tinydist.runtime.clock import native_now

    assert native_now(SYSTEM_CLOCK) is None
    clock = MockClock(start=2.5)
    read = ctypes.CFUNCTYPE(ctypes.c_int64)(native_now(clock))
    assert (read(), clock.native_readings) == (2_500_000_000, 1)
    clock.advance(0.75)
    assert (read(), clock.native_readings) == (3_250_000_000, 2)
    clock.wait_for_native_readings(2, timeout=0)  # already there: returns at once

    class Wall:
        def now(self) -> float: return time.time()
        def call_at(self, deadline, callback, *args): raise NotImplementedError
        def wakeup(self): raise NotImplementedError
        def wait(self, wakeup, deadline) -> bool: raise NotImplementedError

    with pytest.raises(TypeError, match=r"has no native reading .* native waits cannot be timed on it"):
        native_now(Wall())


def _in_futex_wait_on(thread: threading.Thread, address: int) -> bool:
    """Whether `thread` is blocked in the futex system call on `address` (/proc/<tid>/syscall)."""
    from tinydist.codegen.stream_sync import futex_syscall

    with open(f"/proc/self/task/{thread.native_id}/syscall") as file:
        fields = file.read().split()
    return fields[:2] == [str(futex_syscall()), hex(address)]


def test_wait_for_native_readings_is_woken_by_the_reading() -> None:
    import ctypes

    clock = MockClock()
    read = ctypes.CFUNCTYPE(ctypes.c_int64)(clock.native_now_address)
    done = threading.Event()

    def waiter() -> None:
        clock.wait_for_native_readings(3, timeout=3600)
        done.set()

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    read(), read()
    readings = clock._native.ctypes.data + 8
    guard = time.monotonic() + 20
    while not _in_futex_wait_on(thread, readings):  # no event for "asleep in the kernel": read it, bounded
        assert time.monotonic() < guard, "the waiter never went to sleep on the count"
    assert not done.is_set() and clock.native_readings == 2
    read()
    assert done.wait(20), "the third reading did not wake the waiter (its own guard is an hour)"
    thread.join(10)
    with pytest.raises(AssertionError, match=r"expected 4 native readings, still 3"):
        clock.wait_for_native_readings(4, timeout=0)
