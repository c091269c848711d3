"""A plan: the closures one set of input shapes runs, each node a `step(env)` over a flat list of
value slots, and the template of each output (what the captured graph returns, and where)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tinydist.onnx.node import NodeCtx


class Plan:
    """Closures for one set of input shapes; per output, its slot (or constant value) and its
    template: the value with each run-time tensor replaced by `values.LEAF` (the order in which the
    captured graph returns them)."""

    __slots__ = ("steps", "n_slots", "input_slots", "outputs", "templates")

    def __init__(self, steps: list[Callable[[list[Any]], None]], n_slots: int, input_slots: list[int],
                 outputs: list[tuple[int, Any]], templates: list[Any]) -> None:
        self.steps, self.n_slots, self.input_slots, self.outputs = steps, n_slots, input_slots, outputs
        self.templates = templates


def make_step(fn: Callable[..., Any], ctx: NodeCtx, spec: list[tuple[int, Any]], out_slots: list[int],
              multi: bool) -> Callable[[list[Any]], None]:
    slots = tuple(s for s, _ in spec)
    consts = tuple(v for _, v in spec)
    if not multi:
        out = out_slots[0]
        if len(spec) == 1 and slots[0] >= 0:
            a = slots[0]

            def step1(env: list[Any]) -> None:
                env[out] = fn(ctx, env[a])
            return step1
        if len(spec) == 2 and slots[0] >= 0 and slots[1] >= 0:
            a, b = slots

            def step2(env: list[Any]) -> None:
                env[out] = fn(ctx, env[a], env[b])
            return step2

        def step(env: list[Any]) -> None:
            env[out] = fn(ctx, *[env[s] if s >= 0 else c for s, c in zip(slots, consts)])
        return step

    def step_multi(env: list[Any]) -> None:
        results = fn(ctx, *[env[s] if s >= 0 else c for s, c in zip(slots, consts)])
        for slot, value in zip(out_slots, results):
            if slot >= 0:
                env[slot] = value
    return step_multi
