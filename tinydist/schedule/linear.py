"""Ordering calls into a LINEAR list: RAW edges (a producer before its readers) and WAR edges
(every reader of a buffer's old contents before the assign that overwrites that memory).

An assign creates a new *version* of the target's buffer: a new buffer number whose memory is
the target's (`aliases`). Readers of the old version must run before the overwrite; readers of
the new version after it. Where those edges form a cycle (two tensors assigned from each other in
one realize), the old version a reader needs is copied aside first (`linearize`); a cycle no copy
can break is an error, never a best-effort order.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

from tinydist.base.errors import TinydistError
from tinydist.schedule.items import BufferSpec, Call, CollectiveCall, CopyCall, KernelCall, MatmulCall, SliceCall


class ScheduleCycleError(TinydistError, ValueError):
    """The requested computation has no valid order (e.g. tensors assigned from each other)."""


def linearize(calls: Sequence[Call], overwrites: dict[int, int], specs: list[BufferSpec]) -> list[Call]:
    """`overwrites` maps an assign's output buffer number to the version number it overwrites.

    Where readers of an old version and the assigns overwriting it form a cycle (``old = t + t;
    t.assign(u); old + t`` reads t before and after the assign in one kernel; ``a.assign(b)`` with
    ``b.assign(a + a)`` each reads what the other overwrites), numpy semantics still have an
    answer: the reader sees the old value. The old version is then copied to a buffer of its own
    before it is overwritten and the reader reads the copy — one more buffer (appended to
    `specs`) and one copy per broken edge, only in a schedule that has no order otherwise."""
    working = list(calls)
    for _ in range(len(working) * len(working) + 1):   # each round removes a WAR edge for good
        graph = _Graph(working, overwrites)
        if graph.place_collectives(specs):
            working = graph.calls
        order, stuck = graph.order()
        if not stuck:
            return [working[i] for i in order]
        edge = graph.breakable_edge(stuck)
        if edge is None:
            break
        reader, old = edge
        working = _snapshot(working, reader, old, specs)
    stuck_calls = [working[i].describe() for i in stuck]
    raise ScheduleCycleError(
        f"the schedule has a cycle through {len(stuck_calls)} call(s): {'; '.join(stuck_calls[:4])}. "
        "Each must run before another that it also waits for; realize one of the tensors first.")


class _Graph:
    """RAW, WAR and WAW edges between calls; a WAR edge is the only kind a copy can remove."""

    def __init__(self, calls: list[Call], overwrites: dict[int, int]) -> None:
        self.calls = calls
        producers: dict[int, list[int]] = {}  # several calls write disjoint ranges of one buffer (SliceCall)
        readers: dict[int, list[int]] = {}
        for i, call in enumerate(calls):
            for number in call.writes:
                producers.setdefault(number, []).append(i)
            for number in call.reads:
                readers.setdefault(number, []).append(i)
        self.edges: list[set[int]] = [set() for _ in calls]
        self.ordered: set[tuple[int, int]] = set()                # edges a copy cannot remove (RAW, WAW)
        self.war: dict[tuple[int, int], int] = {}                 # (reader, writer) -> old version read
        for i, call in enumerate(calls):
            for number in call.reads:
                for producer in producers.get(number, ()):
                    if producer != i:
                        self._add(producer, i)                    # RAW
            for old in (overwrites[n] for n in call.writes if n in overwrites):
                for reader in readers.get(old, ()):
                    if reader != i:
                        self._add(reader, i, old)                 # WAR
                for producer in producers.get(old, ()):
                    if producer != i:
                        self._add(producer, i)                    # WAW: the older version is written first

    def place_collectives(self, specs: Sequence[BufferSpec]) -> bool:
        """Move each process collective to its device's compute queue where the compute calls of
        that device independent of it (neither making its input nor reading its result) write
        fewer bytes than it reduces: one bucket all-reduced after the whole backward has beside
        it only the optimizer's scalar bookkeeping, too little to hide a queue hop, and on the
        compute queue a capture links it into one entry point with the kernels. Elsewhere it stays
        on the copy queue (CollectiveCall's), beside the calls that need not wait for it. Whether
        any moved (edges do not depend on queues)."""
        moved = False
        before: list[set[int]] = [set() for _ in self.calls]
        for i, targets in enumerate(self.edges):
            for j in targets:
                before[j].add(i)
        for c, call in enumerate(self.calls):
            if not isinstance(call, CollectiveCall) or call.queue == "compute":
                continue
            related = _reach(c, self.edges) | _reach(c, before)
            beside = sum(specs[n].nbytes for i, other in enumerate(self.calls)
                         if i not in related and other.device == call.device and other.queue == "compute" for n in other.writes)
            if beside < specs[call.src].nbytes:
                self.calls[c] = dataclasses.replace(call, queue="compute")
                moved = True
        return moved

    def _add(self, before: int, after: int, war_version: int | None = None) -> None:
        self.edges[before].add(after)
        if war_version is None:
            self.ordered.add((before, after))
        else:
            self.war.setdefault((before, after), war_version)

    def order(self) -> tuple[list[int], list[int]]:
        """A valid order, and the calls left out of it (those on or behind a cycle)."""
        calls, edges = self.calls, self.edges
        indegree = [0] * len(calls)
        for targets in edges:
            for j in targets:
                indegree[j] += 1
        # Ready calls per stream (device, queue). Staying on the stream of the previous call while it
        # has ready work makes each device's calls few long runs (submissions) instead of a run per
        # interleaving. Within a stream, calls another stream waits for come first, then the lowest
        # index (the fuser's order, when it is valid).
        # A process collective (and the call making its input) is taken as soon as it is ready,
        # from whichever stream: submitted then, it runs on its own queue while the calls after
        # it in this order (the rest of a backward) run on theirs; the readers of its result come
        # after the other ready calls of their stream, which would otherwise wait behind them.
        streams = [(call.device, call.queue) for call in calls]
        feeds_other = [any(streams[j] != streams[i] for j in edges[i]) for i in range(len(calls))]
        urgent = [isinstance(call, CollectiveCall) or any(isinstance(calls[j], CollectiveCall) for j in edges[i])
                  for i, call in enumerate(calls)]
        behind = [False] * len(calls)
        for i, call in enumerate(calls):
            if isinstance(call, CollectiveCall):
                for j in edges[i]:
                    behind[j] = streams[j] != streams[i]
        ready: dict[tuple[str, str], list[tuple[bool, bool, bool, int]]] = {}
        ready_urgent: list[int] = []

        def push(i: int) -> None:
            heapq.heappush(ready.setdefault(streams[i], []), (not urgent[i], behind[i], not feeds_other[i], i))
            if urgent[i]:
                ready_urgent.append(i)
        for i, d in enumerate(indegree):
            if d == 0:
                push(i)
        order: list[int] = []
        stream: tuple[str, str] | None = None
        while any(ready.values()):
            if ready_urgent:
                stream = streams[ready_urgent.pop()]
            if stream is None or not ready[stream]:
                stream = min((s for s in ready if ready[s]), key=lambda s: ready[s][0])
            *_, i = heapq.heappop(ready[stream])
            if urgent[i] and i in ready_urgent:
                ready_urgent.remove(i)
            order.append(i)
            for j in edges[i]:
                indegree[j] -= 1
                if indegree[j] == 0:
                    push(j)
        return order, [i for i, d in enumerate(indegree) if d > 0]

    def breakable_edge(self, stuck: list[int]) -> tuple[int, int] | None:
        """(reader, old version) of a WAR edge on a cycle among `stuck`, or None if every cycle
        found is RAW/WAW only (no copy helps). Walking back from a stuck call along stuck
        predecessors must repeat a call: the repeated stretch is a cycle."""
        stuck_set = set(stuck)
        preds: dict[int, list[int]] = {i: [] for i in stuck}
        for i in stuck:
            for j in self.edges[i]:
                if j in stuck_set:
                    preds[j].append(i)
        path: list[int] = [stuck[0]]
        seen = {stuck[0]: 0}
        while True:
            node = path[-1]
            pred = preds[node][0]
            if pred in seen:
                cycle = path[seen[pred]:]
                break
            seen[pred] = len(path)
            path.append(pred)
        # path runs against the edges: cycle[k + 1] -> cycle[k]
        for k, after in enumerate(cycle):
            before = cycle[(k + 1) % len(cycle)]
            if (before, after) in self.war and (before, after) not in self.ordered:
                return before, self.war[(before, after)]
        return None


def _reach(start: int, edges: Sequence[set[int]]) -> set[int]:
    """`start` and every call reachable from it along `edges`."""
    seen, stack = {start}, [start]
    while stack:
        for j in edges[stack.pop()]:
            if j not in seen:
                seen.add(j)
                stack.append(j)
    return seen


def _snapshot(calls: list[Call], reader: int, old: int, specs: list[BufferSpec]) -> list[Call]:
    """`calls` with `old` copied to a new buffer first, and `reader` reading the copy instead."""
    spec = specs[old]
    copy_number = len(specs)
    specs.append(BufferSpec(spec.nbytes, spec.dtype, spec.shape, spec.device, lane="copy"))
    swapped = _reading(calls[reader], old, copy_number)
    return [CopyCall(copy_number, old, spec.nbytes, spec.device), *calls[:reader], swapped, *calls[reader + 1:]]


def _reading(call: Call, old: int, new: int) -> Call:
    """`call` with every read of buffer `old` made a read of buffer `new`."""
    def swap(number: int) -> int:
        return new if number == old else number
    if isinstance(call, (KernelCall, SliceCall)):
        return dataclasses.replace(call, inputs=tuple(swap(n) for n in call.inputs))
    if isinstance(call, MatmulCall):
        return dataclasses.replace(call, a=swap(call.a), b=swap(call.b))
    if isinstance(call, (CopyCall, CollectiveCall)):
        return dataclasses.replace(call, src=swap(call.src))
    return dataclasses.replace(call, srcs=tuple(swap(n) for n in call.srcs))
