"""Clock: the one source of time for the runtime's waits and its hang rule.

A timeline measures how long it stood still and arms the deadline of every wait through its
clock; nothing in the runtime reads `time.monotonic` or arms `loop.call_later` itself. Production
runs on `SYSTEM_CLOCK` (the monotonic clock, exactly the calls the runtime made before the clock
was injectable); tests pass `tinydist.testing.MockClock` to `open_device(..., clock=)` or
`Timeline(..., clock=)` and move time by hand, so a 60 s hang is declared in microseconds of real
time and a test cannot pass or fail by how loaded the machine is (trio's `Clock`, passed to
`trio.run`, does the same for its run loop).

The four operations are the two kinds of wait a timeline has: an async wait arms an alarm on its
event loop (`call_at`); a worker thread blocks on a one-shot `Wakeup` that a signal releases
(`wakeup`, `wait`).

Native code that times a wait itself (a captured step's cross-stream waits,
`tinydist.codegen.stream_sync`) reads the same clock through `native_now`: on the system clock it
reads CLOCK_MONOTONIC directly, as `time.monotonic` does; another clock offers a native reading of
its own (`native_now_address`), or cannot time native waits.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, cast, runtime_checkable


class Alarm(Protocol):
    """An armed deadline (`Clock.call_at`); `asyncio.TimerHandle` is one."""

    def cancel(self) -> None:
        """Disarm: the callback will not be called (a no-op once it has been)."""


class Wakeup(Protocol):
    """A one-shot wake-up for one blocked thread; a pre-acquired `threading.Lock` is one."""

    def release(self) -> None:
        """Wake the thread blocked on this in `Clock.wait`. Called at most once, from any thread."""


@runtime_checkable
class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale (only differences mean anything)."""

    def call_at(self, deadline: float, callback: Callable[..., None], *args: Any) -> Alarm:
        """Call `callback(*args)` on the running event loop (the caller's) once `now()` reaches `deadline`."""

    def wakeup(self) -> Wakeup:
        """A new wake-up for a thread that is about to block in `wait`."""

    def wait(self, wakeup: Wakeup, deadline: float) -> bool:
        """Block this thread until `wakeup` is released (True) or `now()` reaches `deadline` (False)."""


class SystemClock:
    """Real time: `time.monotonic`, the event loop's timers and a lock's timed acquire."""

    # the builtin itself, not a method around it: a timeline's signal reads the clock on every
    # batch, and this keeps that read as cheap as it was before the clock was injectable
    now = staticmethod(time.monotonic)

    def __repr__(self) -> str:
        return "SystemClock()"

    def call_at(self, deadline: float, callback: Callable[..., None], *args: Any) -> Alarm:
        return asyncio.get_running_loop().call_later(max(deadline - time.monotonic(), 0.0), callback, *args)

    def wakeup(self) -> Wakeup:
        lock = threading.Lock()
        lock.acquire()
        return lock

    def wait(self, wakeup: Wakeup, deadline: float) -> bool:
        remaining = deadline - time.monotonic()
        lock = cast("threading.Lock", wakeup)  # made by `wakeup` above
        return remaining > 0 and lock.acquire(timeout=min(remaining, threading.TIMEOUT_MAX))


SYSTEM_CLOCK = SystemClock()


def native_now(clock: Clock) -> int | None:
    """How native code reads `clock`: None on the system clock (it calls clock_gettime(CLOCK_MONOTONIC),
    the clock `time.monotonic` reads, with no call into Python), else the address of the clock's
    native `i64 now()` in nanoseconds, its `native_now_address` (`tinydist.testing.MockClock` has one)."""
    if isinstance(clock, SystemClock):
        return None
    address = getattr(clock, "native_now_address", None)
    if not isinstance(address, int) or address == 0:
        raise TypeError(f"{clock!r} has no native reading (native_now_address, the address of a native "
                        "`i64 now()` in nanoseconds), so native waits cannot be timed on it; capture the step on "
                        "devices on the system clock or a tinydist.testing.MockClock")
    return address


def require_clock(clock: object) -> Clock:
    """`clock` if it is a `Clock`; otherwise a TypeError that says what one is."""
    if not isinstance(clock, Clock):
        raise TypeError(f"clock must be a tinydist.runtime.clock.Clock (now, call_at, wakeup, wait), got {clock!r}; "
                        "leave it out for real time, or pass tinydist.testing.MockClock() in tests")
    return clock
