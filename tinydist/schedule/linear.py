"""Ordering calls into a LINEAR list: RAW edges (a producer before its readers) and WAR edges
(every reader of a buffer's old contents before the assign that overwrites that memory).

An assign creates a new *version* of the target's buffer: a new buffer number whose memory is
the target's (`aliases`). Readers of the old version must run before the overwrite; readers of
the new version after it. A cycle (say, two tensors assigned from each other in one realize) has
no valid order and is an error, never a best-effort order.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from tinydist.errors import TinydistError
from tinydist.schedule.items import Call


class ScheduleCycleError(TinydistError, ValueError):
    """The requested computation has no valid order (e.g. tensors assigned from each other)."""


def linearize(calls: Sequence[Call], overwrites: dict[int, int]) -> list[Call]:
    """`overwrites` maps an assign's output buffer number to the version number it overwrites."""
    producers: dict[int, list[int]] = {}  # several calls write disjoint ranges of one buffer (SliceCall)
    readers: dict[int, list[int]] = {}
    for i, call in enumerate(calls):
        for number in call.writes:
            producers.setdefault(number, []).append(i)
        for number in call.reads:
            readers.setdefault(number, []).append(i)
    edges: list[set[int]] = [set() for _ in calls]
    for i, call in enumerate(calls):
        for number in call.reads:
            for producer in producers.get(number, ()):
                if producer != i:
                    edges[producer].add(i)                    # RAW
        for old in (overwrites[n] for n in call.writes if n in overwrites):
            for reader in readers.get(old, ()):
                if reader != i:
                    edges[reader].add(i)                      # WAR
            for producer in producers.get(old, ()):
                if producer != i:
                    edges[producer].add(i)                    # WAW: the older version is written first
    indegree = [0] * len(calls)
    for targets in edges:
        for j in targets:
            indegree[j] += 1
    # Ready calls per stream (device, queue). Staying on the stream of the previous call while it
    # has ready work makes each device's calls few long runs (submissions) instead of a run per
    # interleaving. Within a stream, calls another stream waits for come first, then the lowest
    # index (the fuser's order, when it is valid).
    streams = [(call.device, call.queue) for call in calls]
    feeds_other = [any(streams[j] != streams[i] for j in edges[i]) for i in range(len(calls))]
    ready: dict[tuple[str, str], list[tuple[bool, int]]] = {}

    def push(i: int) -> None:
        heapq.heappush(ready.setdefault(streams[i], []), (not feeds_other[i], i))
    for i, d in enumerate(indegree):
        if d == 0:
            push(i)
    order: list[int] = []
    stream: tuple[str, str] | None = None
    while any(ready.values()):
        if stream is None or not ready[stream]:
            stream = min((s for s in ready if ready[s]), key=lambda s: ready[s][0])
        _, i = heapq.heappop(ready[stream])
        order.append(i)
        for j in edges[i]:
            indegree[j] -= 1
            if indegree[j] == 0:
                push(j)
    if len(order) != len(calls):
        stuck = [calls[i].describe() for i, d in enumerate(indegree) if d > 0]
        raise ScheduleCycleError(
            f"the schedule has a cycle through {len(stuck)} call(s): {'; '.join(stuck[:4])}. "
            "Each overwrites memory another still has to read (e.g. a.assign(b) with b.assign(a)); "
            "realize one of them first or assign from a copy (.contiguous()).")
    return [calls[i] for i in order]
