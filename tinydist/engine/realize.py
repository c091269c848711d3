"""Running a schedule: bind buffers, compile what is new, submit, hand results to the graph.

Targets get buffers of their own (the user holds them); intermediates are views into one arena
per device and lane, laid out by the memory plan (`tinydist.engine.binding`). Consecutive calls
on the same device and queue go into one batch (one worker hand-off); cross-queue and
cross-device order comes from the runtime's access logs, so a batch is submitted before another
batch that reads its outputs is built. The arena is freed right after submission — the runtime
gives its memory back only once the last kernel using it has completed.

Run-ahead is bounded: at most TINYDIST_REALIZE_RUN_AHEAD (4) realizes per queue of a device
that runs host code may be unfinished; the next waits for the oldest first. An eager training
loop can build steps faster than the device runs them (the small CNN, after the optimizer kept
its update: ~6 ms of host work against ~10 ms of kernels), and with nothing to stop it queued
hundreds of steps, each holding an arena of its own (the CNN: a 539 MB peak of arenas, each new
one mapped and page-faulted by the kernels that first touch it; bounded: 21 MB). Bounded, the
arenas freed by finished realizes are the ones the next reuse. Never on a thread running an
event loop, and never for longer than HELD_S on a queue that finishes nothing meanwhile.

One walk of the graph gives the schedule cache its key and the WAR check its assigns. A schedule
is lowered once (`tinydist.engine.lowered`) and every realize of it runs that lowering with fresh
memory; where it does not apply, the calls are bound and issued one by one (`submit`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, NamedTuple

from tinydist.base.config import settings
from tinydist.base.logs import get_logger
from tinydist.engine.binding import Bound, bind
from tinydist.engine.commands import issue, lower_call
from tinydist.engine.lowered import Lowered, lower
from tinydist.graph.lazy import LazyNode, Op
from tinydist.runtime import command_queue
from tinydist.runtime.buffer import Buffer
from tinydist.runtime.device import Batch, Completion
from tinydist.runtime.engine import get_engine
from tinydist.schedule import Schedule, Walk, canonical_walk, create_schedule

log = get_logger(layer="realize")


def _with_readers_of_overwritten(targets: list[LazyNode]) -> list[LazyNode]:
    """Add every assign in this graph, and the live, unrealized readers of every buffer one
    overwrites, so they are computed from the old value in the same schedule (before the
    overwrite: WAR). An assign the graph reads is a target too: it runs here, and is then
    realized — else the tensor assigned to would run it a second time when it is read."""
    result = list(targets)
    while True:
        in_graph: set[int] = set()
        assigns: list[LazyNode] = []
        stack = list(result)
        while stack:
            node = stack.pop()
            if id(node) in in_graph or node.realized:
                continue
            in_graph.add(id(node))
            if node.op is Op.ASSIGN:
                assigns.append(node)
            stack.extend(node.srcs)
        targeted = {id(node) for node in result}
        extra = [a for a in assigns if id(a) not in targeted]
        extra += [reader for a in assigns for reader in a.srcs[0].live_readers()
                  if id(reader) not in in_graph and reader is not a]
        if not extra:
            return result
        result.extend(dict.fromkeys(extra))


def _adds_targets(walk: Walk, targets: list[LazyNode]) -> bool:
    """Whether `_with_readers_of_overwritten` would add to `targets`: an assign of the walked
    graph that is not a target, or a live, unrealized node outside the graph that still reads a
    buffer one overwrites. From the walk made for the schedule's key: no second walk when not."""
    if not walk.assigns:
        return False
    targeted = {id(node) for node in targets}
    for assign in walk.assigns:
        if id(assign) not in targeted:
            return True
        for reader in assign.srcs[0].live_readers():
            if reader not in walk.nodes and reader is not assign:
                return True
    return False


class Realized(NamedTuple):
    """What one realize ran: its schedule, the realized nodes it read (the schedule's inputs, in
    order) and the nodes it computed (the targets asked for, then any the WAR check added)."""
    schedule: Schedule
    inputs: list[LazyNode]
    targets: list[LazyNode]


def realize(targets: Sequence[LazyNode], ran: list[Realized] | None = None) -> list[Completion]:
    """Compute every unrealized target and set its `buffer`; returns the submissions' completions.
    `ran`, if given, gets what was run appended (nothing when every target was realized)."""
    pending = list(dict.fromkeys(t for t in targets if not t.realized))
    if not pending:
        return []
    tracer = command_queue.TRACER
    started = _host_gap(tracer) if tracer is not None else 0
    walk = canonical_walk(pending)  # the schedule's key, and the assigns the WAR check needs: one walk
    if _adds_targets(walk, pending):
        pending = _with_readers_of_overwritten(pending)
        walk = canonical_walk(pending)
    schedule, inputs = create_schedule(pending, walk)
    if tracer is not None:
        scheduled = time.perf_counter_ns()
        tracer.add_span("host", "host", "schedule", "schedule", started, scheduled,
                        {"calls": len(schedule.linear), "targets": len(pending)})
    completions, buffers = run_schedule(schedule, inputs)
    if tracer is not None:
        _last_realize.end = end = time.perf_counter_ns()
        tracer.add_span("host", "host", "bind + submit", "schedule", scheduled, end,
                        {"calls": len(schedule.linear), "batches": len(completions)})
    for node, buffer in zip(pending, buffers):
        node.buffer = buffer
        # autograd hook: backward() walks srcs. An empty node gets no buffer (None): it keeps its
        # sources, or it would be an unrealized view of nothing (a later reshape of it failed)
        if buffer is not None and (not node.requires_grad or node.op in (Op.BUFFER, Op.ASSIGN)):
            node.srcs = ()  # the graph below is no longer needed: let it be collected
    if ran is not None:
        ran.append(Realized(schedule, inputs, pending))
    return completions


# While tracing, the host lane shows a realize's two halves (`schedule`: the graph walk and the
# schedule, cached or new; `bind + submit`: lowering, compiling what is new, binding and submitting)
# and, between two realizes on one thread, `python`: the caller's own code, building the next graph.
_last_realize = threading.local()


def _host_gap(tracer: Any) -> int:
    """Now; and the `python` span since this thread's last realize ended (when it was traced by `tracer`)."""
    now = time.perf_counter_ns()
    last = getattr(_last_realize, "end", None)
    same = getattr(_last_realize, "tracer", None) is tracer
    if last is not None and same:
        tracer.add_span("host", "host", "python", "python", last, now, {"thread": threading.current_thread().name})
    _last_realize.tracer = tracer
    return now


def run_schedule(schedule: Schedule, inputs: Sequence[LazyNode]) -> tuple[list[Completion], list[Buffer | None]]:
    """Run `schedule` over the realized `inputs` (its input numbers, in order): the submissions'
    completions and each target's buffer. A caller that keeps a schedule runs it again here with
    other inputs of the same devices, dtypes and shapes, building and walking no graph."""
    _bound_run_ahead(schedule)
    lowered = schedule.derived.get("realize")  # its lowering, or why it goes call by call
    if lowered is None or (isinstance(lowered, Lowered) and not lowered.current()):
        lowered = lower(schedule, inputs, get_engine())
        if lowered is not None:
            schedule.derived["realize"] = lowered
    ran = lowered.run(inputs) if isinstance(lowered, Lowered) else None
    if ran is not None:
        completions, buffers = ran
    else:
        bound = bind(schedule, inputs)
        try:
            completions = submit(bound)
        finally:
            bound.release_arenas()
        buffers = [bound.buffers[schedule.aliases.get(number, number)] for number in schedule.targets]
    log.debug("realized", calls=len(schedule.linear), batches=len(completions), lowered=ran is not None)
    _note_in_flight(completions)
    return completions, buffers


# Per queue (its timeline's name, "CPU:0/compute"), the unfinished batches of recent realizes on
# host-code devices, oldest first (module docstring)
_in_flight: dict[str, deque[Completion]] = {}
_in_flight_lock = threading.Lock()
_POLL_S = 0.0002    # the wait sleeps (the GIL released: the worker can finish) in steps of this
HELD_S = 1.0        # a queue that has not finished a realize in this long is left to run behind


def _note_in_flight(completions: list[Completion]) -> None:
    with _in_flight_lock:
        for completion in completions:
            timeline = completion.timeline
            if not completion.done() and timeline.device is not None and timeline.device.native_code:
                _in_flight.setdefault(timeline.name, deque()).append(completion)


def _bound_run_ahead(schedule: Schedule) -> None:
    """Wait until each queue this schedule submits to has fewer than REALIZE_RUN_AHEAD realizes
    unfinished. The wait is for work queued ahead of this realize's own on the same queue, so
    it never delays the device; it gives up on a queue that finishes nothing for HELD_S (a
    queue held by something this thread releases later must not deadlock it)."""
    if not _in_flight or asyncio._get_running_loop() is not None:
        return
    streams = schedule.derived.get("streams")
    if streams is None:
        streams = schedule.derived["streams"] = tuple(dict.fromkeys(f"{call.device}/{call.queue}" for call in schedule.linear))
    limit = settings.REALIZE_RUN_AHEAD
    for stream in streams:
        while True:
            with _in_flight_lock:
                queued = _in_flight.get(stream)
                while queued and queued[0].done():
                    queued.popleft()
                if not queued or len(queued) < limit:
                    break
                oldest = queued[0]
            if not _await(oldest):
                break


def _await(completion: Completion) -> bool:
    """Whether `completion` was reached within HELD_S (a failed device counts as finished)."""
    deadline = time.monotonic() + HELD_S
    while not completion.done():
        if completion.timeline.failure is not None:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)
    return True


def submit(bound: Bound) -> list[Completion]:
    """Every call of the bound schedule, one batch per consecutive run on a device and queue."""
    engine = get_engine()
    completions: list[Completion] = []
    batch: Batch | None = None
    views: list[Buffer] = []
    for call in bound.schedule.linear:
        device = engine.device(call.device)
        if batch is None or batch.device is not device or batch.queue.kind != call.queue:
            if batch is not None and len(batch):
                completions.append(batch.submit())
            batch = device.batch(call.queue)
        for command in lower_call(call, bound.buffers, device, views):
            issue(batch, command)
        for view in views:
            view.release()  # the batch keeps the address and the access record, not the view
        views.clear()
    if batch is not None and len(batch):
        completions.append(batch.submit())
    return completions
