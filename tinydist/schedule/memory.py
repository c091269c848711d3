"""The memory planner: intermediates share one arena per device and lane.

Lifetimes come from the LINEAR order: a buffer lives from the call that writes it to the last
call that reads it. Sizes are rounded up to 256-byte blocks; buffers are placed largest first at
the lowest offset where they overlap no placed buffer whose lifetime intersects theirs; a buffer
calls on several streams touch overlaps no other buffer at all. Buffers the user holds (inputs,
targets, assigned tensors) are never planned. The plan is a prediction: reuse is safe only
because the executor runs calls in LINEAR order (queue FIFO plus the access logs' waits across
queues).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tinydist.schedule.items import BufferSpec, Call

BLOCK = 256


def _round(nbytes: int) -> int:
    return (nbytes + BLOCK - 1) // BLOCK * BLOCK


@dataclass
class MemoryPlan:
    arena_bytes: dict[tuple[str, str], int] = field(default_factory=dict)   # (device, lane) -> bytes
    offsets: dict[int, int] = field(default_factory=dict)                    # buffer number -> byte offset
    arena_of: dict[int, tuple[str, str]] = field(default_factory=dict)       # buffer number -> (device, lane)
    lifetimes: dict[int, tuple[int, int]] = field(default_factory=dict)      # buffer number -> (first, last)
    planned_bytes: int = 0                                                   # sum of intermediate sizes

    @property
    def peak_bytes(self) -> int:
        return sum(self.arena_bytes.values())

    def report(self) -> str:
        ratio = self.peak_bytes / self.planned_bytes if self.planned_bytes else 1.0
        return f"planned peak {self.peak_bytes} bytes for {self.planned_bytes} bytes of intermediates ({ratio:.0%})"


def plan_memory(linear: Sequence[Call], specs: Sequence[BufferSpec], planned: Iterable[int]) -> MemoryPlan:
    planned = set(planned)
    plan = MemoryPlan()
    streams: dict[int, set[tuple[str, str]]] = {}
    for index, call in enumerate(linear):
        for number in (*call.writes, *call.reads):
            if number in planned:
                first, _ = plan.lifetimes.get(number, (index, index))
                plan.lifetimes[number] = (first, index)
                streams.setdefault(number, set()).add((call.device, call.queue))
    # Bytes that calls on several streams (devices, queues) touch are reused by no other buffer:
    # a replayed schedule (td.jit) would otherwise have to order every write to them after the
    # other stream's access in the previous replay, a wait and a tracked access per replay.
    shared = {number for number, touching in streams.items() if len(touching) > 1}
    by_arena: dict[tuple[str, str], list[int]] = {}
    for number in plan.lifetimes:
        spec = specs[number]
        by_arena.setdefault((spec.device, spec.lane), []).append(number)
    for arena, numbers in by_arena.items():
        placed: list[tuple[int, int, int, int, bool]] = []  # (offset, end, first, last, shared)
        numbers.sort(key=lambda n: (-_round(specs[n].nbytes), plan.lifetimes[n][0]))
        for number in numbers:
            size, (first, last) = _round(specs[number].nbytes), plan.lifetimes[number]
            alone = number in shared
            clashes = sorted((o, e) for o, e, f, l, s in placed if alone or s or (f <= last and first <= l))
            offset = 0
            for start, end in clashes:
                if offset + size <= start:
                    break
                offset = max(offset, end)
            placed.append((offset, offset + size, first, last, alone))
            plan.offsets[number] = offset
            plan.arena_of[number] = arena
            plan.planned_bytes += specs[number].nbytes
        plan.arena_bytes[arena] = max((end for _, end, _, _, _ in placed), default=0)
    return plan
