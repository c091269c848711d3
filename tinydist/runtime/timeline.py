"""Timeline: a monotonic 64-bit counter that devices signal and hosts await.

A queue's worker thread signals the value of each finished submission; async code awaits a value
(`await timeline.wait(v)`) and device-side code (a worker thread executing a cross-queue wait)
blocks on it (`timeline.wait_blocking(v)`). Nothing polls: signalling wakes exactly the waiters
whose target was reached, async ones through their own event loop's thread-safe callback.

A wait whose deadline passes while neither the timeline nor any kernel of its device made
progress declares the device hung: the device is marked failed and every waiter on every timeline
of that device wakes with the same `DeviceHang`. Kernels publish progress through a word each
(`tinydist.codegen.progress`), read only when a deadline passes: a kernel that runs for minutes
keeps publishing and is waited for, a stuck one (a native loop or wait that publishes nothing) is
caught one to two timeouts after its last progress — two when the first deadline's reading is the
first to see a change made before the wait began — and its worker contained (`Device.contain`).
Progress is stamped, and deadlines armed, on the timeline's clock (`tinydist.runtime.clock`): real
time in production, a `tinydist.testing.MockClock` in tests (docs/hangs.md).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tinydist.base.config import settings
from tinydist.base.errors import DeviceFailed, DeviceHang
from tinydist.runtime.clock import SYSTEM_CLOCK, Clock, Wakeup, require_clock

if TYPE_CHECKING:
    from tinydist.runtime.device import Device

MAX_VALUE = (1 << 64) - 1


@dataclass(frozen=True)
class TimelineStatistics:
    value: int
    async_waiters: int
    blocked_threads: int
    failed: bool


class _BlockedThread:
    """A thread in `wait_blocking`: blocked on `wake` until a signal reaches `target`."""

    __slots__ = ("target", "wake")

    def __init__(self, target: int, wake: Wakeup) -> None:
        self.target = target
        self.wake = wake


class _AsyncWaiter:
    __slots__ = ("target", "loop", "future")

    def __init__(self, target: int, loop: asyncio.AbstractEventLoop, future: asyncio.Future[object]) -> None:
        self.target = target
        self.loop = loop
        self.future = future


_DEADLINE = object()


def _resolve(future: asyncio.Future[object], error: BaseException | None, result: object = None) -> None:
    if not future.done():
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)


class Timeline:
    """A monotonic counter owned by one device (usually one per queue), on `clock`: a queue's
    timeline is on its device's clock (`open_device(name, clock=...)`)."""

    def __init__(self, name: str, device: Device | None = None, clock: Clock = SYSTEM_CLOCK) -> None:
        self.name = name
        self.device = device
        self.clock = require_clock(clock)
        self._now = clock.now  # bound once: read on every signal
        self._value = 0
        self._progress_at = self._now()
        # set once, by `fail`; a plain attribute, not a property: every inline run of a replayed
        # frame reads it twice (before, and after the run for a failure host code recorded)
        self.failure: DeviceFailed | None = None
        self._lock = threading.Lock()
        self._waiters: list[_AsyncWaiter] = []
        # each woken only by the signal that reaches its target: a worker waiting for a later value
        # is not woken (and made to take the GIL) by every signal before it
        self._blocked: list[_BlockedThread] = []
        # the bound method, made once: a batch that waits on this timeline queues it as a command
        # (a new bound method per wait would be one more object per command for the collector)
        self.wait_command = self.wait_blocking
        # a heap of (target, registration number, callback): a signal takes only the due ones off
        # it, however many later ones a caller that runs ahead of the device has queued behind
        self._callbacks: list[tuple[int, int, Callable[[], None]]] = []
        self._registrations = itertools.count()
        # The highest value whose work is over — done, or skipped because the device failed.
        # Callbacks release what that work held, so they wait for this, never for the failure alone.
        self._retired = 0

    def __repr__(self) -> str:
        return f"Timeline({self.name!r}, value={self._value})"

    @property
    def value(self) -> int:
        return self._value

    def reached(self, value: int) -> bool:
        return self._value >= value

    def statistics(self) -> TimelineStatistics:
        return TimelineStatistics(self._value, len(self._waiters), len(self._blocked), self.failure is not None)

    # ---- signalling (any thread) -------------------------------------------------------------

    def signal(self, value: int) -> None:
        """Advance to `value`; wakes waiters whose target is reached. Safe from any thread."""
        if not 0 <= value <= MAX_VALUE:
            raise ValueError(f"timeline {self.name}: value {value} is outside 0..2**64-1")
        with self._lock:
            if value < self._value:
                raise ValueError(f"timeline {self.name} is monotonic: cannot move from {self._value} back to {value}")
            self._value = value
            self._retired = max(self._retired, value)
            self._progress_at = self._now()
            if not (self._waiters or self._blocked or self._callbacks):
                return  # nobody to wake, nothing due: the common case of a synchronous frame loop
            ready = [w for w in self._waiters if w.target <= value]
            if ready:
                self._waiters = [w for w in self._waiters if w.target > value]
            woken = [t for t in self._blocked if t.target <= value]
            if woken:
                self._blocked = [t for t in self._blocked if t.target > value]
            due = self._take_due(value)
        # Callbacks first (they give back memory and keep-alives held for the finished work), so a
        # waiter that wakes on this value also observes everything it released.
        for callback in due:
            callback()
        for thread in woken:
            thread.wake.release()
        for waiter in ready:
            _wake(waiter, None)

    def call_when_reached(self, value: int, callback: Callable[[], None]) -> None:
        """Run `callback()` once the work up to `value` is over (reached, or retired after a
        failure) — on the thread that finishes it, or now if it already has."""
        with self._lock:
            if self._retired < value:
                heapq.heappush(self._callbacks, (value, next(self._registrations), callback))
                return
        callback()

    def retire(self, value: int) -> None:
        """The work up to `value` is over without reaching it (skipped or aborted on a failed
        device): run the callbacks waiting for it, without moving the counter."""
        with self._lock:
            self._retired = max(self._retired, value)
            due = self._take_due(value)
        for callback in due:
            callback()

    def _take_due(self, value: int) -> list[Callable[[], None]]:
        """The callbacks for work up to `value`, in registration order per target (lock held)."""
        callbacks, due = self._callbacks, []
        while callbacks and callbacks[0][0] <= value:
            due.append(heapq.heappop(callbacks)[2])
        return due

    def fail(self, error: DeviceFailed) -> None:
        """Wake every waiter with `error`; later waits raise it. Callbacks wait for `retire`: a
        kernel may still be running, and what it holds must not be given back underneath it."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = error
            waiters, self._waiters = self._waiters, []
            blocked, self._blocked = self._blocked, []
        for thread in blocked:
            thread.wake.release()
        for waiter in waiters:
            _wake(waiter, error)

    # ---- waiting -----------------------------------------------------------------------------

    async def wait(self, value: int, timeout: float | None = None) -> None:
        """Return once the timeline reaches `value`.

        `timeout` (default TINYDIST_TIMELINE_TIMEOUT) bounds how long the timeline may stand still:
        if it makes no progress for that long the device is declared hung and `DeviceHang` raised.
        """
        if self._value >= value:
            await asyncio.sleep(0)  # always a checkpoint, as trio's design rules ask
            return
        if self.failure is not None:
            raise self.failure
        timeout = _default_timeout() if timeout is None else timeout
        loop = asyncio.get_running_loop()
        clock = self.clock
        window_start = self._now()
        while True:
            future: asyncio.Future[object] = loop.create_future()
            waiter = _AsyncWaiter(value, loop, future)
            with self._lock:
                if self._value >= value:
                    return
                if self.failure is not None:
                    raise self.failure
                self._waiters.append(waiter)
            deadline = clock.call_at(window_start + timeout, _resolve, future, None, _DEADLINE)
            try:
                outcome = await future
            finally:
                deadline.cancel()
                with self._lock:
                    if waiter in self._waiters:
                        self._waiters.remove(waiter)
            if outcome is not _DEADLINE or self._value >= value:
                return
            moved = self._moved_at()
            if moved <= window_start:
                raise self._declare_hang(value, timeout)
            window_start = moved  # it moved: the watchdog restarts from its last progress

    def wait_blocking(self, value: int, timeout: float | None = None) -> None:
        """Block this (worker) thread until `value`; same hang rule as `wait`. Never on an event loop."""
        timeout = _default_timeout() if timeout is None else timeout
        clock = self.clock
        window_start = self._now()
        while True:
            with self._lock:
                if self._value >= value:
                    return
                if self.failure is not None:
                    raise self.failure
                thread = _BlockedThread(value, clock.wakeup())
                self._blocked.append(thread)
            woken = False
            try:
                woken = clock.wait(thread.wake, window_start + timeout)
            finally:
                if not woken:  # timed out, or interrupted (Ctrl-C in the main thread): deregister
                    with self._lock:
                        if thread in self._blocked:
                            self._blocked.remove(thread)
            if woken or self._value >= value or self.failure is not None:
                # a signal reached the target, or the device failed: the top of the loop says which
                continue
            moved = self._moved_at()
            if moved <= window_start:
                raise self._declare_hang(value, timeout)
            window_start = moved  # it moved: the watchdog restarts from its last progress

    def _moved_at(self) -> float:
        """When this timeline, or a kernel of its device, last made progress (on the clock)."""
        if self.device is None:
            return self._progress_at
        return max(self._progress_at, self.device.progress_seen_at())

    def _declare_hang(self, value: int, timeout: float) -> DeviceFailed:
        error = DeviceHang(
            f"timeline {self.name} stayed at {self._value} for {timeout:g}s while waiting for {value}, and no "
            f"kernel of its device published progress; device {self.device.name if self.device else '?'} is "
            "marked failed — reopen it (Engine.reopen, or close it and open a new one)")
        if self.device is not None:
            first = self.device.mark_failed(error)
            if first is error:
                self.device.contain(self)
            return first
        self.fail(error)
        return self.failure or error


def _wake(waiter: _AsyncWaiter, error: BaseException | None) -> None:
    try:
        waiter.loop.call_soon_threadsafe(_resolve, waiter.future, error)
    except RuntimeError:
        pass  # that event loop is closed: nobody is left to wake


def _default_timeout() -> float:
    return settings.TIMELINE_TIMEOUT
