"""Control flow: If, Loop and Scan, unrolled when the graph is planned.

A body is evaluated like the main graph (constants fold, the rest builds Tensor ops), once per
branch taken or iteration, so the captured graph is straight-line code. That needs what decides
the control flow at plan time: If's condition, Loop's trip count and its per-iteration condition
must be constant (computed from initializers, shapes or value inputs), and Scan's sequence
length is a static shape. A run-time If condition selects between both branches with `where`
when their outputs agree in shape and dtype; otherwise each of these is refused, saying which
value decides the control flow.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tinydist.frontend.movement import stack
from tinydist.frontend.tensor import Tensor, where
from tinydist.onnx.ops._common import OUTER, Value, norm_axis, shrink_axis


def _split_outer(ctx: Any, args: tuple[Value, ...]) -> tuple[tuple[Value, ...], dict[str, Value]]:
    """The declared inputs and the outer-scope values (by name) the bodies read."""
    n_outer = ctx.attrs[OUTER]
    declared = args[:len(args) - n_outer]
    names = [n for body in (v for v in ctx.attrs.values() if hasattr(v, "outer")) for n in body.outer]
    unique = list(dict.fromkeys(names))
    return declared, dict(zip(unique, args[len(args) - n_outer:]))


def _run(ctx: Any, body: Any, inputs: list[Value], outer: dict[str, Value]) -> list[Value]:
    bound = dict(outer)
    bound.update(zip(body.inputs, inputs))
    return ctx.run_body(body, bound)


def _flag(ctx: Any, value: Value, what: str) -> bool:
    if isinstance(value, Tensor):
        raise ctx.error(f"{what} is computed from tensor values at run time: the control flow must be known when "
                        "the graph is planned (from initializers, shapes or small graph inputs)")
    return bool(np.asarray(value).reshape(-1)[0])


def op_if(ctx: Any, cond: Value, *rest: Value) -> Any:
    _, outer = _split_outer(ctx, (cond,) + rest)
    then_body, else_body = ctx.attr("then_branch"), ctx.attr("else_branch")
    if not isinstance(cond, Tensor):
        results = _run(ctx, then_body if _flag(ctx, cond, "the condition") else else_body, [], outer)
    else:
        taken, other = _run(ctx, then_body, [], outer), _run(ctx, else_body, [], outer)
        results = []
        for a, b in zip(taken, other):
            if not all(isinstance(v, (Tensor, np.ndarray)) for v in (a, b)):
                raise ctx.error("the condition is a run-time value and a branch gives a sequence or optional: "
                                "the taken branch must be known when the graph is planned")
            a = a if isinstance(a, Tensor) else ctx.lift(("then", id(a)), a)
            b = b if isinstance(b, Tensor) else ctx.lift(("else", id(b)), b)
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ctx.error(f"the condition is a run-time value and the branches' outputs differ ({a.dtype.name}{a.shape} "
                                f"vs {b.dtype.name}{b.shape}): the taken branch must be known when the graph is planned")
            results.append(where(cond.reshape(()), a, b))
    return tuple(results) if ctx.n_outputs > 1 else results[0]


def _stacked(ctx: Any, values: list[Value], axis: int = 0) -> Value:
    if all(isinstance(v, np.ndarray) for v in values):
        return np.stack(values, axis)
    return stack([v if isinstance(v, Tensor) else ctx.lift(("scan", id(v)), v) for v in values], axis)


def op_loop(ctx: Any, trip_count: Value = None, cond: Value = None, *rest: Value) -> Any:
    declared, outer = _split_outer(ctx, (trip_count, cond) + rest)
    carried = list(declared[2:])
    body = ctx.attr("body")
    limit = None if trip_count is None else int(np.asarray(_static_count(ctx, trip_count)).reshape(-1)[0])
    going = True if cond is None else _flag(ctx, cond, "the loop's initial condition")
    n_scan = len(body.outputs) - 1 - len(carried)
    scans: list[list[Value]] = [[] for _ in range(n_scan)]
    i = 0
    while going and (limit is None or i < limit):
        if limit is None and i >= 1 << 16:
            raise ctx.error("the loop has no trip count and ran 65536 iterations without its condition turning false")
        out = _run(ctx, body, [np.array(i, np.int64), np.array(going)] + carried, outer)
        going = _flag(ctx, out[0], "the loop condition") if body.outputs[0] else True
        carried = list(out[1:1 + len(carried)])
        for k, v in enumerate(out[1 + len(carried):]):
            scans[k].append(v)
        i += 1
    if n_scan and i == 0:
        raise ctx.error("the loop runs no iteration: its scan outputs' shapes are unknown")
    results = carried + [_stacked(ctx, s) for s in scans]
    return tuple(results) if ctx.n_outputs > 1 else results[0]


def _static_count(ctx: Any, value: Value) -> np.ndarray:
    if isinstance(value, Tensor):
        raise ctx.error("the trip count M is computed from tensor values at run time: it must be known when the graph "
                        "is planned (from initializers, shapes or small graph inputs)")
    return value


def op_scan(ctx: Any, *args: Value) -> Any:
    """Scan 9+: states carried through the iterations, scan inputs sliced along their axes (each
    forward or reverse), scan outputs stacked along theirs. Scan 8: every value has a leading
    batch axis, the scan axis is 1, and each batch entry is scanned on its own."""
    declared, outer = _split_outer(ctx, args)
    n_in = int(ctx.attr("num_scan_inputs"))
    if ctx.since >= 9:
        return _scan(ctx, list(declared), outer, n_in, ctx.attr("scan_input_axes", [0] * n_in),
                     ctx.attr("scan_input_directions", [0] * n_in))
    if declared[0] is not None:
        raise ctx.error("Scan 8's sequence_lens input is not supported (leave it empty: full-length sequences)")
    values = [v if isinstance(v, Tensor) else ctx.lift(("batch", k), v) for k, v in enumerate(declared[1:])]
    batch = values[0].shape[0]
    per_entry = [_scan(ctx, [shrink_axis(v, 0, b, b + 1).reshape(v.shape[1:]) for v in values], outer, n_in,
                       [0] * n_in, ctx.attr("directions", [0] * n_in), outputs_tuple=True) for b in range(batch)]
    results = [_stacked(ctx, [entry[k] for entry in per_entry]) for k in range(len(per_entry[0]))]
    return tuple(results) if ctx.n_outputs > 1 else results[0]


def _scan(ctx: Any, declared: list[Value], outer: dict[str, Value], n_in: int, axes: list[int], in_dirs: list[int],
          outputs_tuple: bool = False) -> Any:
    body = ctx.attr("body")
    states = list(declared[:len(declared) - n_in])
    scanned = [v if isinstance(v, Tensor) else ctx.lift(("scan_in", k), v) for k, v in enumerate(declared[len(states):])]
    in_axes = [norm_axis(ctx, a, t.ndim) for a, t in zip(axes, scanned)]
    lengths = {t.shape[a] for t, a in zip(scanned, in_axes)}
    if len(lengths) != 1:
        raise ctx.error(f"the scan inputs' sequence lengths differ: {sorted(lengths)}")
    length = lengths.pop()
    n_out = len(body.outputs) - len(states)
    scans: list[list[Value]] = [[] for _ in range(n_out)]
    for i in range(length):
        slices = []
        for t, a, d in zip(scanned, in_axes, in_dirs):
            j = length - 1 - i if d else i
            piece = shrink_axis(t, a, j, j + 1)
            slices.append(piece.reshape(t.shape[:a] + t.shape[a + 1:]))
        out = _run(ctx, body, states + slices, outer)
        states = list(out[:len(states)])
        for k, v in enumerate(out[len(states):]):
            scans[k].append(v)
    if length == 0:
        raise ctx.error("the scan inputs are empty: the scan outputs' shapes are unknown")
    out_dirs = ctx.attr("scan_output_directions", [0] * n_out)
    out_axes = ctx.attr("scan_output_axes", [0] * n_out)
    results: list[Value] = list(states)
    for values, d, a in zip(scans, out_dirs, out_axes):
        ordered = values[::-1] if d else values
        rank = np.ndim(ordered[0]) if isinstance(ordered[0], np.ndarray) else ordered[0].ndim
        results.append(_stacked(ctx, ordered, norm_axis(ctx, a, rank + 1)))
    return tuple(results) if ctx.n_outputs > 1 or outputs_tuple else results[0]
