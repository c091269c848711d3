"""Ordering between queues and devices, keyed by (base buffer, byte range).

Each base buffer owns an `AccessLog`, so the key's first half is the log's owner. Every submitted
access to a base buffer is recorded as (byte range, read/write, timeline, value).
A new access must wait for earlier overlapping accesses that conflict with it — a read waits for
writes (RAW), a write waits for reads and writes (WAR, WAW) — unless they were submitted on the
same queue, whose FIFO order already guarantees it. Disjoint ranges of one base never wait on each
other: writing bytes [0,4) and then reading [8,12) runs unordered, reading [2,6) waits.

Records whose timeline has passed their value are pruned; a newer record on the same timeline that
covers an older one's range (and writes if the older one wrote) replaces it, so a hot buffer keeps
a short list.

A captured step repeats the same accesses on every replay. A `StandingAccess` keeps one record per
(buffer, queue) and moves it forward in place, and skips the scan for what to wait for while
nothing else was recorded on the buffer since its last replay.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tinydist.runtime.timeline import Timeline

if TYPE_CHECKING:
    from tinydist.runtime.buffer import Buffer


@dataclass(slots=True)  # not frozen: a frozen dataclass costs 3x to construct, once per access
class Access:
    start: int
    end: int
    write: bool
    timeline: Timeline
    value: int


class AccessLog:
    """The unfinished accesses to one base buffer."""

    __slots__ = ("_lock", "records", "generation")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # unfinished accesses (finished ones pruned lazily): empty means nothing to wait for, which
        # the per-frame paths read without a call or the lock (`Device.run_now`)
        self.records: list[Access] = []
        self.generation = 0  # counts records added: unchanged means nobody accessed the buffer since

    def waits_for(self, start: int, end: int, write: bool, queue_timeline: Timeline) -> dict[Timeline, int]:
        """Timeline values an access to bytes [start, end) from the queue of `queue_timeline` must wait for."""
        waits: dict[Timeline, int] = {}
        if not self.records:  # nothing recorded: nothing to wait for (read without the lock, as in conflicts)
            return waits
        with self._lock:
            finished = 0
            for r in self.records:
                if r.timeline.value >= r.value:
                    finished += 1
                elif (r.timeline is not queue_timeline and (write or r.write) and r.start < end and start < r.end
                        and waits.get(r.timeline, -1) < r.value):
                    waits[r.timeline] = r.value
            if finished:
                self.records = [r for r in self.records if r.timeline.value < r.value]
        return waits

    def record(self, start: int, end: int, write: bool, timeline: Timeline, value: int) -> None:
        new = Access(start, end, write, timeline, value)
        with self._lock:
            self._add(new)

    def hold(self, timeline: Timeline, value: int) -> None:
        """The memory is in use until `timeline` reaches `value`, by work whose accesses to it
        need no ordering (one queue's own, in its FIFO order): a record over no bytes, which
        conflicts with nothing but keeps the memory from being given back before then."""
        self.record(0, 0, False, timeline, value)

    def _add(self, new: Access) -> None:
        kept = [new]
        for r in self.records:
            if r.timeline.value < r.value and not (
                    r.timeline is new.timeline and new.start <= r.start and r.end <= new.end and (new.write or not r.write)):
                kept.append(r)
        self.records = kept
        self.generation += 1

    def renew(self, access: Access | None, start: int, end: int, write: bool, timeline: Timeline,
              value: int) -> tuple[Access, int]:
        """Move `access` (an earlier record of the same range, mode and timeline) to `value` in
        place while it is still recorded, else record anew; returns the record and the generation."""
        with self._lock:
            if access is not None and any(r is access for r in self.records):
                access.value = value
            else:
                access = Access(start, end, write, timeline, value)
                self._add(access)
            return access, self.generation

    def conflicts(self, start: int, end: int, write: bool) -> bool:
        """Whether unfinished work conflicts with accessing bytes [start, end) now, from any thread
        (a read conflicts with pending writes; a write with any pending access)."""
        if not self.records:  # the common case, without the lock: nothing recorded, nothing to conflict
            return False
        with self._lock:
            unfinished = [r for r in self.records if r.timeline.value < r.value]
            if len(unfinished) < len(self.records):  # as waits_for does: the next look needs no lock
                self.records = unfinished
            return any((write or r.write) and r.start < end and start < r.end for r in unfinished)

    def pending(self) -> dict[Timeline, int]:
        """The latest unfinished value per timeline that touches this base (any range, any mode)."""
        result: dict[Timeline, int] = {}
        if not self.records:  # read without the lock, as in conflicts: every freed buffer asks
            return result
        with self._lock:
            for r in self.records:
                if r.timeline.value < r.value and result.get(r.timeline, -1) < r.value:
                    result[r.timeline] = r.value
        return result

    def __len__(self) -> int:
        return len(self.records)


class StandingAccess:
    """One queue's access to a buffer that a captured step makes on every replay (see the module
    docstring): `unchanged` says no other access was recorded on the buffer since the last
    `renew`, so the next replay has nothing new to wait for."""

    __slots__ = ("buffer", "write", "_access", "_generation")

    def __init__(self, buffer: Buffer, write: bool) -> None:
        self.buffer, self.write = buffer, write
        self._access: Access | None = None
        self._generation = -1

    @property
    def unchanged(self) -> bool:
        return self.buffer.accesses.generation == self._generation

    def renew(self, timeline: Timeline, value: int) -> None:
        """The replay submitted as `value` on `timeline` makes this access."""
        buffer = self.buffer
        self._access, self._generation = buffer.accesses.renew(
            self._access, buffer.offset, buffer.offset + buffer.nbytes, self.write, timeline, value)
