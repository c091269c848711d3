"""The one binder: a schedule, its inputs and the arguments a capture owns → bound buffers.

Every buffer number of a schedule gets memory: an input is bound where it lives, unless it is an
argument the caller owns a copy of (a capture copies the caller's arguments into buffers of its
own at every replay); an intermediate is a view into one arena per device and lane, laid out by
the memory plan; a target gets a buffer of its own (the user holds it); an assign's version
shares the memory it overwrites. Realize and capture both bind here, and a failure half way —
out of memory on the third device — gives back everything already taken before it propagates.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from tinydist.graph.lazy import LazyNode
from tinydist.runtime.buffer import Buffer
from tinydist.runtime.engine import get_engine
from tinydist.runtime.faults import faults
from tinydist.schedule import Schedule


@dataclass
class Bound:
    """A schedule's buffers by number (None: a buffer of no bytes), and what binding took."""
    schedule: Schedule
    buffers: list[Buffer | None]
    arenas: list[Buffer] = field(default_factory=list)
    views: list[Buffer] = field(default_factory=list)       # the arenas' views
    allocated: list[Buffer] = field(default_factory=list)   # owned arguments and targets

    def buffer(self, number: int) -> Buffer:
        found = self.buffers[number]
        assert found is not None, f"buffer {number} has no bytes"
        return found

    def release_arenas(self) -> None:
        """Give the intermediates' memory back; the runtime frees it once the last kernel using
        it has completed, so this may follow submission at once."""
        for view in self.views:
            view.release()
        for arena in self.arenas:
            arena.free()
        self.views, self.arenas = [], []

    def release(self) -> None:
        """Give back everything binding took (a failed binding, or a capture that is dropped)."""
        self.release_arenas()
        for buffer in self.allocated:
            buffer.free()
        self.allocated = []


def bind(schedule: Schedule, inputs: Sequence[LazyNode], owned: Collection[int] = ()) -> Bound:
    """Memory for every buffer of `schedule`; the input numbers in `owned` get buffers of their
    own instead of the input's. On any failure nothing allocated here stays allocated."""
    engine = get_engine()
    bound = Bound(schedule, [None] * len(schedule.specs))
    buffers = bound.buffers
    try:
        for number, node in enumerate(inputs):
            if number in owned:
                faults.check("engine.bind.argument")
                buffers[number] = engine.device(node.device).allocator.alloc(node.nbytes)
                bound.allocated.append(buffers[number])  # type: ignore[arg-type]
            else:
                buffers[number] = node.buffer
        plan = schedule.plan
        for (device_name, lane), size in plan.arena_bytes.items():
            if size:
                faults.check("engine.bind.arena")
                arena = engine.device(device_name).allocator.alloc(size)
                bound.arenas.append(arena)
                for number, where in plan.arena_of.items():
                    if where == (device_name, lane):
                        view = buffers[number] = arena.view(plan.offsets[number], schedule.specs[number].nbytes)
                        bound.views.append(view)
        for number in range(schedule.n_inputs, len(schedule.specs)):
            spec = schedule.specs[number]
            if buffers[number] is None and number not in schedule.aliases and spec.nbytes:
                faults.check("engine.bind.target")
                buffers[number] = engine.device(spec.device).allocator.alloc(spec.nbytes)
                bound.allocated.append(buffers[number])  # type: ignore[arg-type]
    except BaseException:
        bound.release()
        raise
    for version, memory in schedule.aliases.items():
        buffers[version] = buffers[memory]
    return bound
