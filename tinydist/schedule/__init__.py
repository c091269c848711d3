"""Graph → Schedule: fusion, LINEAR order, memory plan; cached by graph structure.

`create_schedule(targets)` walks the unrealized graph once to compute its structural key and the
list of realized inputs (in walk order). A cache hit skips fusion, ordering and planning — and
says nothing about compiled kernels or allocated memory, which the executor looks after.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Hashable, NamedTuple

from tinydist.base.logs import get_logger
from tinydist.graph.lazy import LazyNode, Op
from tinydist.schedule.fusion import fuse
from tinydist.schedule.items import BufferSpec, Call
from tinydist.schedule.linear import ScheduleCycleError, linearize
from tinydist.schedule.memory import MemoryPlan, plan_memory

__all__ = ["Schedule", "ScheduleCycleError", "Walk", "canonical_walk", "create_schedule", "schedule_cache"]

log = get_logger(layer="schedule")


@dataclass(frozen=True)
class Schedule:
    """A replayable plan over numbered buffers (no node identities inside)."""

    specs: tuple[BufferSpec, ...]
    linear: tuple[Call, ...]
    n_inputs: int
    targets: tuple[int, ...]           # buffer number of each target, in the caller's order
    aliases: dict[int, int]            # assign versions -> the buffer number whose memory they use
    plan: MemoryPlan
    # what the engine derives from the plan once and keeps with it (realize's lowering): no part of the plan
    derived: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def describe(self) -> list[str]:
        return [call.describe() for call in self.linear]


class Walk(NamedTuple):
    """One walk of an unrealized graph: its structural key, the realized inputs (in walk order),
    the assigns it makes, and every node it met (realized ones too)."""
    key: Hashable
    inputs: list[LazyNode]
    assigns: list[LazyNode]
    nodes: dict[LazyNode, int]


class _Key:
    """A graph's structure as one tuple of per-node tuples, its hash computed once: the cache's
    lookup and its move to the end would hash the whole graph twice otherwise."""

    __slots__ = ("parts", "hash")

    def __init__(self, parts: tuple[Any, ...]) -> None:
        self.parts = parts
        self.hash = hash(parts)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Key) and self.hash == other.hash and self.parts == other.parts


_VIEW, _CONST, _ASSIGN = Op.VIEW, Op.CONST, Op.ASSIGN


def _part(node: LazyNode, numbers: tuple[int, ...]) -> tuple[Any, ...]:
    """An unrealized node's part of the key, its sources numbered `numbers`."""
    op = node.op
    if op is _VIEW:
        views = node.arg.views
        if len(views) == 1:
            v = views[0]
            arg: Any = ((v.shape, v.strides, v.offset, v.mask),)
        else:
            arg = tuple([(v.shape, v.strides, v.offset, v.mask) for v in views])
    else:
        arg = node.arg
        if op is _CONST:
            arg = (type(arg).__name__, arg)
    return (op._name_, arg, node.dtype.name, node.shape, node.device, numbers)


def canonical_walk(targets: list[LazyNode]) -> Walk:
    """The graph's structure as a flat key — nodes numbered in post-order (`tinydist.base.walk`'s
    order), each unrealized node's part its op's name, arg, dtype, shape, device and its sources'
    numbers, a realized one's ("in", dtype, shape, device) — and its realized inputs in the same
    order. Every part is plain tuples of strings and numbers (a view's ShapeTracker as its views'
    fields): hashing and comparing the key run no Python code.

    This runs once per node of every realize, so it recurses — a fresh graph's nodes are then
    looked at once, not twice as on a stack of its own (~30% faster) — and a graph too deep for
    the interpreter's recursion limit is walked again with a stack of its own (`_deep_walk`),
    in the same order: any depth, no raised limit."""
    index: dict[LazyNode, int] = {}
    parts: list[Any] = []
    inputs: list[LazyNode] = []
    assigns: list[LazyNode] = []
    known, add = index.get, parts.append

    def visit(node: LazyNode) -> int:
        found = known(node)
        if found is not None:
            return found
        if node.buffer is not None:
            inputs.append(node)
            add(("in", node.dtype.name, node.shape, node.device))
        else:
            srcs = node.srcs
            if len(srcs) == 1:
                numbers: tuple[int, ...] = (visit(srcs[0]),)  # noqa: F821 (ruff#7733, the del below)
            elif len(srcs) == 2:
                numbers = (visit(srcs[0]), visit(srcs[1]))  # noqa: F821 (ruff#7733, the del below)
            else:
                numbers = tuple([visit(src) for src in srcs])  # noqa: F821 (ruff#7733, the del below)
            op = node.op  # _part, written out: this is the hot loop
            if op is _VIEW:
                views = node.arg.views
                if len(views) == 1:
                    v = views[0]
                    arg: Any = ((v.shape, v.strides, v.offset, v.mask),)
                else:
                    arg = tuple([(v.shape, v.strides, v.offset, v.mask) for v in views])
            else:
                arg = node.arg
                if op is _CONST:
                    arg = (type(arg).__name__, arg)
                elif op is _ASSIGN:
                    assigns.append(node)
            add((op._name_, arg, node.dtype.name, node.shape, node.device, numbers))
        number = index[node] = len(index)
        return number

    try:
        roots = tuple([visit(t) for t in targets])
    except RecursionError:
        return _deep_walk(targets)
    finally:
        del visit  # a recursive closure is a reference cycle: break it, or the graph outlives this call
    return Walk(_Key((tuple(parts), roots)), inputs, assigns, index)


def _deep_walk(targets: list[LazyNode]) -> Walk:
    """`canonical_walk` for any depth: a node is numbered when it is on top of the stack with
    every source numbered (unnumbered sources go on the stack, the leftmost on top)."""
    index: dict[LazyNode, int] = {}
    parts: list[Any] = []
    inputs: list[LazyNode] = []
    assigns: list[LazyNode] = []
    for root in targets:
        stack = [root]
        while stack:
            node = stack[-1]
            if node in index:  # on the stack twice, or a root met before: numbered already
                stack.pop()
                continue
            if node.buffer is not None:
                inputs.append(node)
                parts.append(("in", node.dtype.name, node.shape, node.device))
            else:
                missing = [src for src in node.srcs if src not in index]
                if missing:
                    stack.extend(reversed(missing))
                    continue
                if node.op is _ASSIGN:
                    assigns.append(node)
                parts.append(_part(node, tuple([index[src] for src in node.srcs])))
            index[node] = len(index)
            stack.pop()
    roots = tuple([index[t] for t in targets])
    return Walk(_Key((tuple(parts), roots)), inputs, assigns, index)


class ScheduleCache:
    def __init__(self, capacity: int = 512) -> None:
        self._lock = threading.Lock()
        # each entry keeps the key it was stored under: moving it to the end by that very object
        # finds it by identity, not by comparing the whole graph's key a second time
        self._entries: OrderedDict[Hashable, tuple[Hashable, Schedule]] = OrderedDict()
        self.capacity = capacity
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable) -> Schedule | None:
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(found[0])
                self.hits += 1
                return found[1]
            self.misses += 1
            return None

    def put(self, key: Hashable, schedule: Schedule) -> None:
        with self._lock:
            self._entries[key] = (key, schedule)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


schedule_cache = ScheduleCache()


def create_schedule(targets: list[LazyNode], walk: Walk | None = None) -> tuple[Schedule, list[LazyNode]]:
    """The schedule computing `targets`, and the realized input nodes it reads (numbered 0..);
    `walk` is `canonical_walk(targets)` when the caller has already made it."""
    key, inputs, _, _ = canonical_walk(targets) if walk is None else walk
    schedule = schedule_cache.get(key)
    if schedule is None:
        schedule = _build(targets, inputs)
        schedule_cache.put(key, schedule)
        log.debug("scheduled", kernels=schedule.describe(), memory=schedule.plan.report())
    return schedule, inputs


def _build(targets: list[LazyNode], inputs: list[LazyNode]) -> Schedule:
    graph = fuse(targets, inputs)
    target_numbers = tuple(graph.number[id(t)] for t in targets)
    linear = linearize(graph.calls, graph.overwrites, graph.specs)
    held = set(range(len(inputs))) | set(target_numbers) | set(graph.aliases) | set(graph.aliases.values())
    planned = [n for n in range(len(graph.specs)) if n not in held and graph.specs[n].nbytes > 0]
    plan = plan_memory(linear, graph.specs, planned)
    return Schedule(tuple(graph.specs), tuple(linear), len(inputs), target_numbers, dict(graph.aliases), plan)
