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

import bisect
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
        placed = _Placed(len(linear))
        numbers.sort(key=lambda n: (-_round(specs[n].nbytes), plan.lifetimes[n][0]))
        for number in numbers:
            size, (first, last) = _round(specs[number].nbytes), plan.lifetimes[number]
            alone = number in shared
            offset = 0
            for start, end in sorted(placed.all() if alone else placed.clashing(first, last)):
                if offset + size <= start:
                    break
                offset = max(offset, end)
            placed.add(offset, offset + size, first, last, alone)
            plan.offsets[number] = offset
            plan.arena_of[number] = arena
            plan.planned_bytes += specs[number].nbytes
        plan.arena_bytes[arena] = max((end for _, end in placed.all()), default=0)
    return plan


class _Placed:
    """The byte ranges placed in one arena, found by lifetime in time proportional to what is found.

    A schedule of a deep graph has tens of thousands of short-lived buffers: comparing each with
    every one placed before it took minutes. Lifetimes are call-index ranges within [0, calls).
    Those meeting [first, last] are the ones alive at `first` (a stabbing query on a segment tree
    over call indices: each range is stored at the O(log calls) nodes that tile it) and the ones
    starting in (first, last] (a list sorted by first call)."""

    def __init__(self, calls: int) -> None:
        self._leaves = 1 << max(calls - 1, 0).bit_length()
        self._tree: dict[int, list[tuple[int, int]]] = {}   # segment-tree node -> ranges tiled by it
        self._starts: list[tuple[int, int, int]] = []       # (first call, offset, end), sorted
        self._everywhere: list[tuple[int, int]] = []        # ranges of buffers several streams touch
        self._ranges: list[tuple[int, int]] = []

    def add(self, offset: int, end: int, first: int, last: int, everywhere: bool) -> None:
        self._ranges.append((offset, end))
        if everywhere:  # clashes with every buffer placed after it
            self._everywhere.append((offset, end))
            return
        bisect.insort(self._starts, (first, offset, end))
        lo, hi = first + self._leaves, last + self._leaves + 1
        while lo < hi:
            if lo & 1:
                self._tree.setdefault(lo, []).append((offset, end))
                lo += 1
            if hi & 1:
                hi -= 1
                self._tree.setdefault(hi, []).append((offset, end))
            lo, hi = lo >> 1, hi >> 1

    def all(self) -> list[tuple[int, int]]:
        return self._ranges

    def clashing(self, first: int, last: int) -> list[tuple[int, int]]:
        """The ranges of placed buffers alive at some call in [first, last], and of those several
        streams touch (each once: the same ranges as a scan over every placed buffer)."""
        found = list(self._everywhere)
        node = first + self._leaves
        while node:
            found += self._tree.get(node, ())
            node >>= 1
        lo = bisect.bisect_right(self._starts, (first, _AFTER, _AFTER))
        hi = bisect.bisect_right(self._starts, (last, _AFTER, _AFTER))
        found += ((offset, end) for _, offset, end in self._starts[lo:hi])
        return found


_AFTER = 1 << 62  # sorts after every offset: (call, _AFTER, _AFTER) follows every entry of that call
