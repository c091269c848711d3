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
