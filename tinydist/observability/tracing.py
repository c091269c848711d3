"""Tracing device work: every command of every batch on every queue, host syncs, and named spans.

Off by default and free when off: the runtime's one hook is `command_queue.TRACER`, read once per
batch by the queue worker (and once per `Completion.wait`); nothing is allocated per command.
When on, the worker runs the batch through `Tracer.run_batch`, which times each command on the
monotonic clock (`time.perf_counter_ns`) and keeps one tuple per command; names, categories, flows
and counters are worked out only when the trace is exported.

    with tinydist.trace("run.json"):           # one scope
        ...
    TINYDIST_TRACE=run.json python job.py      # a whole program (written at exit)
    tinydist profile job.py                    # the same, plus a summary table (and --png)

Other layers (collectives, transports, the node daemon's RPCs) record their own spans:

    from tinydist.observability import span
    with span("allreduce", process="rank0", lane="collective", cat="collective", bytes=n):
        ...
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tinydist.base.config import launch_int, settings
from tinydist.base.errors import DeviceError, TinydistError
from tinydist.runtime import command_queue as _hooks
from tinydist.runtime.timeline import Timeline

clock = time.perf_counter_ns  # CLOCK_MONOTONIC on Linux: one clock for every process of a host

_WAIT_BLOCKING = Timeline.wait_blocking


class _QueueInfo:
    __slots__ = ("device", "kind", "timeline", "copy_fn")

    def __init__(self, device: str, kind: str, timeline: str, copy_fn: Any) -> None:
        self.device, self.kind, self.timeline, self.copy_fn = device, kind, timeline, copy_fn


class Tracer:
    """Collects raw records; `chrome()` turns them into Trace Event Format, `write()` saves them."""

    def __init__(self, max_events: int | None = None) -> None:
        self.origin_ns = clock()
        self.origin_wall_ns = time.time_ns()
        self.max_events = settings.TRACE_MAX_EVENTS if max_events is None else max_events
        # (queue info, timeline value, start, end, failed?, [(start, end, fn, args), ...])
        self.batches: list[tuple[_QueueInfo, int, int, int, bool, list[tuple[int, int, Any, tuple[Any, ...]]]]] = []
        # (device, timeline name, value, start, end, thread name, ok?)
        self.host_waits: list[tuple[str, str, int, int, int, str, bool]] = []
        # (process, lane, name, category, start, end, args)
        self.spans: list[tuple[str, str, str, str, int, int, dict[str, Any]]] = []
        self.events = 0
        self.dropped = 0
        self.stopped_ns: int | None = None
        self._queues: dict[str, _QueueInfo] = {}

    def __repr__(self) -> str:
        return f"Tracer(batches={len(self.batches)}, events={self.events}, dropped={self.dropped})"

    # ---- recording (worker threads, hosts) ---------------------------------------------------

    def _queue_info(self, queue: Any) -> _QueueInfo:
        info = self._queues.get(queue.name)
        if info is None:
            try:
                copy_fn = queue.device.host_copy()
            except DeviceError:
                copy_fn = None
            info = _QueueInfo(queue.device.name, queue.kind, queue.timeline.name, copy_fn)
            self._queues[queue.name] = info
        return info

    def run_batch(self, queue: Any, commands: Sequence[tuple[Any, tuple[Any, ...]]], value: int) -> None:
        """Run `commands` exactly as CommandQueue._execute does, timing each one."""
        timeline = queue.timeline
        timed: list[tuple[int, int, Any, tuple[Any, ...]]] = []
        append = timed.append
        failed = True
        start = clock()
        try:
            for fn, args in commands:
                if timeline.failure is not None:
                    break
                t0 = clock()
                try:
                    fn(*args)
                finally:
                    append((t0, clock(), fn, args))
            failed = timeline.failure is not None
        finally:
            end = clock()
            n = len(timed) + 1
            if self.events + n <= self.max_events:
                self.events += n
                self.batches.append((self._queue_info(queue), value, start, end, failed, timed))
            else:
                self.dropped += n

    def _host_record(self, timeline: Timeline, value: int, start: int, ok: bool) -> None:
        if self.events < self.max_events:
            self.events += 1
            device = timeline.device.name if timeline.device is not None else "host"
            self.host_waits.append((device, timeline.name, value, start, clock(), threading.current_thread().name, ok))
        else:
            self.dropped += 1

    async def host_wait(self, timeline: Timeline, value: int, timeout: float | None) -> None:
        if timeline.reached(value):
            return await timeline.wait(value, timeout)  # nothing to wait for: no sync to record
        start, ok = clock(), False
        try:
            await timeline.wait(value, timeout)
            ok = True
        finally:
            self._host_record(timeline, value, start, ok)

    def host_wait_blocking(self, timeline: Timeline, value: int, timeout: float | None) -> None:
        if timeline.reached(value):
            return timeline.wait_blocking(value, timeout)
        start, ok = clock(), False
        try:
            timeline.wait_blocking(value, timeout)
            ok = True
        finally:
            self._host_record(timeline, value, start, ok)

    def add_span(self, process: str, lane: str, name: str, cat: str, start: int, end: int, args: dict[str, Any]) -> None:
        if self.events < self.max_events:
            self.events += 1
            self.spans.append((process, lane, name, cat, start, end, args))
        else:
            self.dropped += 1

    # ---- export ------------------------------------------------------------------------------

    def chrome(self, rank: int | None = None) -> dict[str, Any]:
        """The trace as a Trace Event Format object (`{"traceEvents": [...], ...}`)."""
        from tinydist.observability.chrome import build
        return build(self, rank)

    def write(self, path: str | os.PathLike[str], rank: int | None = None) -> Path:
        """Write the trace to `path` (with `.rank{N}` before the suffix in a multi-process job)."""
        rank = launch_int("TINYDIST_RANK", required=False) if rank is None else rank
        target = rank_path(Path(path), rank)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        with open(tmp, "w") as f:
            json.dump(self.chrome(rank), f, separators=(",", ":"))
        os.replace(tmp, target)
        return target


def rank_path(path: Path, rank: int | None) -> Path:
    """`trace.json` → `trace.rank3.json` for rank 3; unchanged outside a multi-process job."""
    if rank is None:
        return path
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix or '.json'}")


def host_name() -> str:
    return socket.gethostname()


# ---- switching on and off ----------------------------------------------------------------------

_stack: list[Tracer] = []
_stack_lock = threading.Lock()


def active_tracer() -> Tracer | None:
    return _hooks.TRACER


def start(tracer: Tracer | None = None) -> Tracer:
    """Start recording into `tracer` (a new one by default); nested starts stack."""
    tracer = Tracer() if tracer is None else tracer
    with _stack_lock:
        _stack.append(tracer)
        _hooks.TRACER = tracer
    return tracer


def flush(timeout: float = 30.0) -> None:
    """Wait (bounded) until every live queue has finished what was submitted to it, so that the
    trace holds it. Failed or closed queues are skipped."""
    deadline = time.monotonic() + timeout
    for queue in list(_hooks.QUEUES):
        try:
            queue.timeline.wait_blocking(queue.last_submitted, max(deadline - time.monotonic(), 0.001))
        except TinydistError:
            pass


def stop(tracer: Tracer, wait: bool = True) -> Tracer:
    """Stop recording into `tracer` (after letting submitted work finish, if `wait`)."""
    if wait:
        flush()
    with _stack_lock:
        if tracer in _stack:
            _stack.remove(tracer)
        _hooks.TRACER = _stack[-1] if _stack else None
    tracer.stopped_ns = clock()
    return tracer


@contextlib.contextmanager
def trace(path: str | os.PathLike[str] | None = None, *, wait: bool = True) -> Iterator[Tracer]:
    """Trace everything the devices run inside the block; write it to `path` (if given) at exit.

    Work submitted inside the block is waited for at exit (`wait=True`), so it is all recorded."""
    tracer = start()
    try:
        yield tracer
    finally:
        stop(tracer, wait=wait)
        if path is not None:
            tracer.write(path)


# ---- spans recorded by other layers ------------------------------------------------------------

class _Span:
    __slots__ = ("tracer", "process", "lane", "name", "cat", "args", "start")

    def __init__(self, tracer: Tracer, process: str, lane: str, name: str, cat: str, args: dict[str, Any]) -> None:
        self.tracer, self.process, self.lane, self.name, self.cat, self.args = tracer, process, lane, name, cat, args
        self.start = 0

    def __enter__(self) -> _Span:
        self.start = clock()
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None:
            self.args["error"] = getattr(exc_type, "__name__", str(exc_type))
        self.tracer.add_span(self.process, self.lane, self.name, self.cat, self.start, clock(), self.args)


_NULL = contextlib.nullcontext()


def span(name: str, *, process: str = "host", lane: str = "host", cat: str = "span",
         **args: Any) -> contextlib.AbstractContextManager[Any]:
    """A timed region on lane `lane` of process `process` (a device, a rank, a node); `args`
    (e.g. bytes=, method=, status=) are kept with it. When tracing is off this returns a shared
    no-op context manager: the cost is one global read and the call itself."""
    tracer = _hooks.TRACER
    if tracer is None:
        return _NULL
    return _Span(tracer, process, lane, name, cat, args)


def record(name: str, start_ns: int, *, process: str = "host", lane: str = "host", cat: str = "span",
           **args: Any) -> None:
    """A span from `start_ns` (a `clock()` reading) until now, for code whose region is not one
    `with` block (an RPC handler's try/finally, a receive that hands its message out). Nothing when
    tracing is off."""
    tracer = _hooks.TRACER
    if tracer is not None:
        tracer.add_span(process, lane, name, cat, start_ns, clock(), args)


# ---- TINYDIST_TRACE ----------------------------------------------------------------------------

def _finish_env(tracer: Tracer, path: Path) -> None:
    stop(tracer, wait=True)
    written = tracer.write(path)
    import sys
    print(f"tinydist: trace written to {written} ({tracer.events} events"
          f"{f', {tracer.dropped} dropped' if tracer.dropped else ''})", file=sys.stderr)


_ENVIRONMENT_TRACE: tuple[Tracer, Path] | None = None


def start_from_environment() -> Tracer | None:
    """If TINYDIST_TRACE names a path, trace the whole program and write it at exit."""
    global _ENVIRONMENT_TRACE
    path = settings.TRACE
    if not path:
        return None
    tracer = start()
    _ENVIRONMENT_TRACE = (tracer, Path(path))
    atexit.register(_finish_env, tracer, Path(path))
    return tracer


def take_environment_trace() -> Path | None:
    """Stop the TINYDIST_TRACE trace of this process without writing it and return its path (None
    if there is none): `tinydist launch` does this, since its own process runs no tensor work and
    the path is the ranks' (each writes `path.rankN.json`; the launcher merges them into `path`)."""
    global _ENVIRONMENT_TRACE
    if _ENVIRONMENT_TRACE is None:
        return None
    tracer, path = _ENVIRONMENT_TRACE
    _ENVIRONMENT_TRACE = None
    atexit.unregister(_finish_env)
    stop(tracer, wait=True)
    return path
