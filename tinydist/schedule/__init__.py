"""Graph → Schedule: fusion, LINEAR order, memory plan; cached by graph structure.

`create_schedule(targets)` walks the unrealized graph once to compute its structural key and the
list of realized inputs (in walk order). A cache hit skips fusion, ordering and planning — and
says nothing about compiled kernels or allocated memory, which the executor looks after.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable

from tinydist.lazy import LazyNode, Op
from tinydist.logs import get_logger
from tinydist.schedule.fusion import fuse
from tinydist.schedule.items import BufferSpec, Call
from tinydist.schedule.linear import ScheduleCycleError, linearize
from tinydist.schedule.memory import MemoryPlan, plan_memory
from tinydist.walk import postorder

__all__ = ["Schedule", "ScheduleCycleError", "create_schedule", "schedule_cache"]

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

    def describe(self) -> list[str]:
        return [call.describe() for call in self.linear]


def _canonical_walk(targets: list[LazyNode]) -> tuple[Hashable, list[LazyNode]]:
    """The graph's structure as a flat key (nodes numbered in post-order, sources by number) and
    its realized inputs, in the same order; realized nodes are leaves. Iterative: any depth."""
    index: dict[int, int] = {}
    parts: list[Any] = []
    inputs: list[LazyNode] = []
    for node in postorder(targets, lambda node: () if node.realized else node.srcs):
        if node.realized:
            inputs.append(node)
            parts.append(("in", node.dtype.name, node.shape, node.device))
        else:
            srcs = tuple(index[id(src)] for src in node.srcs)
            arg = (type(node.arg).__name__, node.arg) if node.op is Op.CONST else node.arg
            parts.append((node.op, arg, node.dtype.name, node.shape, node.device, srcs))
        index[id(node)] = len(index)
    roots = tuple(index[id(t)] for t in targets)
    return (tuple(parts), roots), inputs


class ScheduleCache:
    def __init__(self, capacity: int = 512) -> None:
        self._lock = threading.Lock()
        self._entries: OrderedDict[Hashable, Schedule] = OrderedDict()
        self.capacity = capacity
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable) -> Schedule | None:
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                self.hits += 1
            else:
                self.misses += 1
            return found

    def put(self, key: Hashable, schedule: Schedule) -> None:
        with self._lock:
            self._entries[key] = schedule
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


schedule_cache = ScheduleCache()


def create_schedule(targets: list[LazyNode]) -> tuple[Schedule, list[LazyNode]]:
    """The schedule computing `targets`, and the realized input nodes it reads (numbered 0..)."""
    key, inputs = _canonical_walk(targets)
    schedule = schedule_cache.get(key)
    if schedule is None:
        schedule = _build(targets, inputs)
        schedule_cache.put(key, schedule)
        log.debug("scheduled", kernels=schedule.describe(), memory=schedule.plan.report())
    return schedule, inputs


def _build(targets: list[LazyNode], inputs: list[LazyNode]) -> Schedule:
    graph = fuse(targets, inputs)
    target_numbers = tuple(graph.number[id(t)] for t in targets)
    linear = linearize(graph.calls, graph.overwrites)
    held = set(range(len(inputs))) | set(target_numbers) | set(graph.aliases) | set(graph.aliases.values())
    planned = [n for n in range(len(graph.specs)) if n not in held and graph.specs[n].nbytes > 0]
    plan = plan_memory(linear, graph.specs, planned)
    return Schedule(tuple(graph.specs), tuple(linear), len(inputs), target_numbers, dict(graph.aliases), plan)
