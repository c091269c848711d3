"""A device queue: FIFO submissions run by one worker thread, each proven done by a timeline value.

A submission is a batch of commands, each a `(callable, args)` pair: a native kernel (a ctypes
function, which releases the GIL while it runs), a memmove, or a wait on another queue's timeline.
The hand-off to the worker — one put, one thread wake-up, one timeline signal — is paid per batch,
not per command. The worker records each batch's start and end on the monotonic clock.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tinydist.base.errors import DeviceClosed, DeviceFailed
from tinydist.base.logs import get_logger
from tinydist.runtime.timeline import Timeline

if TYPE_CHECKING:
    from tinydist.runtime.device import Device

Command = tuple[Callable[..., Any], tuple[Any, ...]]

# Observability hooks (tinydist.observability, tinydist.observability.metrics). TRACER is None unless tracing is on; the
# worker reads it once per batch, so tracing off costs one global load per batch and nothing per
# command. QUEUES lets the metrics collector read every live queue's counters at scrape time.
TRACER: Any = None
QUEUES: weakref.WeakSet[CommandQueue] = weakref.WeakSet()


@dataclass(frozen=True, slots=True)
class BatchTiming:
    value: int
    commands: int
    start_ns: int
    end_ns: int


@dataclass(frozen=True)
class QueueStatistics:
    submitted: int
    completed: int
    in_flight: int


_STOP = object()
# what `CommandQueue.run_if_idle` returns when it ran nothing (the caller submits instead)
BUSY: Any = object()


class CommandQueue:
    def __init__(self, device: Device, kind: str, history: int = 4096) -> None:
        self.device = device
        self.kind = kind
        self.name = f"{device.name}/{kind}"
        self.timeline = Timeline(self.name, device, device.clock)
        self.timings: deque[BatchTiming] = deque(maxlen=history)
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._submitted = 0
        self.bytes_copied = 0  # bytes submitted in copy commands (read by tinydist.observability.metrics)
        self._submit_lock = threading.Lock()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.log = get_logger(device=device.name, queue=kind, timeline=self.name)
        QUEUES.add(self)

    def __repr__(self) -> str:
        return f"CommandQueue({self.name!r}, submitted={self._submitted}, completed={self.timeline.value})"

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"tinydist:{self.name}", daemon=True)
            self._thread.start()

    def submit(self, commands: Sequence[Command], inline: bool = False, nbytes: int = 0) -> int:
        """Queue a batch; returns the timeline value that proves it completed.

        `inline=True` (for synchronous callers that wait right away anyway): if the queue is idle —
        everything submitted before has completed — run the batch on the calling thread instead,
        saving the two thread wake-ups of a hand-off. Order and timeline are exactly as if the
        worker had run it; if the queue is busy, the batch is queued as usual."""
        if self._closed:
            raise DeviceClosed(f"queue {self.name} is closed")
        failure = self.timeline.failure
        if failure is not None:
            raise failure
        with self._submit_lock:
            self._submitted += 1
            self.bytes_copied += nbytes
            value = self._submitted
            if inline and self.timeline.value == value - 1:
                self._execute(commands, value)
            else:
                self._inbox.put((commands, value))
        return value

    def run_if_idle(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """`fn(*args)` on the calling thread, now, when the queue is idle (everything submitted
        has completed): the inline run of `submit(inline=True)` without the submission. It holds
        the submit lock while it runs, so whatever is submitted meanwhile runs after it, as if it
        had been queued; it is over when this returns, so it takes no timeline value, no timing
        record and no access records — there is nothing for anyone to wait for. A captured
        replay's per-frame path: a submission costs ~3 us of Python, the frame ~1 us.

        Returns `fn`'s result, or BUSY, having run nothing, when the queue has unfinished work,
        is closed or failed, or a tracer wants to see every batch. An error in `fn` fails the
        device, as a failed batch does, and is raised as that failure (so is a failure that `fn`'s
        native code had host code record, `Device.mark_failed`); a KeyboardInterrupt is raised as it is."""
        timeline = self.timeline
        if TRACER is not None or self._closed:
            return BUSY
        with self._submit_lock:
            if timeline.value != self._submitted or timeline.failure is not None:
                return BUSY
            try:
                result = fn(*args)
            except KeyboardInterrupt:
                # Ctrl-C between two kernels of the caller's own run: nothing queued waits on it
                # (the run takes no timeline value), so the device stays usable and the user's
                # handler sees the interrupt, not a DeviceFailed
                raise
            except BaseException as exc:  # as in _execute: native work that fails fails the device
                self.log.error("run on the calling thread failed", error=f"{type(exc).__name__}: {exc}")
                raise self.device.mark_failed(
                    DeviceFailed(f"{self.name}: a run on the calling thread failed: {type(exc).__name__}: {exc}")) from exc
            if timeline.failure is not None:
                # host code that native code called failed the device without raising through it
                # (a process collective's program, tinydist.dist.lazy): its failure is this run's
                raise timeline.failure
            return result

    def count_copied(self, nbytes: int) -> None:
        """Count a copy of this queue's device made outside any batch (`Device.read_now`)."""
        with self._submit_lock:
            self.bytes_copied += nbytes

    @property
    def worker(self) -> threading.Thread | None:
        """The thread running this queue's batches (None before start)."""
        return self._thread

    @property
    def last_submitted(self) -> int:
        return self._submitted

    def statistics(self) -> QueueStatistics:
        completed = self.timeline.value
        return QueueStatistics(self._submitted, completed, self._submitted - completed)

    def stop(self, timeout: float) -> bool:
        """Stop taking work and let the worker finish what it has; True if it exited in time."""
        self._closed = True
        if self._thread is None:
            return True
        self._inbox.put(_STOP)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            item = self._inbox.get()
            if item is _STOP:
                return
            self._execute(*item)

    def _execute(self, commands: Sequence[Command], value: int) -> None:
        timeline = self.timeline
        if timeline.failure is not None:
            timeline.retire(value)  # a failed device runs nothing more: what the batch held goes back
            return
        start = time.perf_counter_ns()
        tracer = TRACER
        try:
            if tracer is not None:
                tracer.run_batch(self, commands, value)  # same loop, each command timed
            else:
                for fn, args in commands:
                    if timeline.failure is not None:
                        break  # failed mid-batch (a hang declared elsewhere): run no more of it
                    fn(*args)
        except DeviceFailed as exc:
            self.log.error("batch depended on failed work", value=value, error=str(exc))
            self.device.mark_failed(DeviceFailed(f"{self.name}: batch {value} depended on failed work: {exc}"))
        except BaseException as exc:  # noqa: BLE001 - any failure in native work fails the device
            self.log.error("batch failed", value=value, error=f"{type(exc).__name__}: {exc}")
            failure = DeviceFailed(f"{self.name}: batch {value} failed: {type(exc).__name__}: {exc}")
            failure.__cause__ = exc  # what failed (a remote node's TenantWorkerFailed, say) stays reachable
            self.device.mark_failed(failure)
        if timeline.failure is not None:
            timeline.retire(value)
            return
        self.timings.append(BatchTiming(value, len(commands), start, time.perf_counter_ns()))
        timeline.signal(value)
