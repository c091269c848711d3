"""NonZero, Unique and Compress: ops whose output *shape* depends on input *values*.

A captured plan has static shapes, so these values are needed when the plan is made: the input
(Compress: the condition) must be constant, or computed from graph inputs small enough to be
value inputs (read at call time; each new value makes a new plan and capture, see
OnnxModel.value_inputs). The op then runs in numpy at plan time, on those values; anything else
is refused at load, saying why.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tinydist.frontend.tensor import Tensor
from tinydist.onnx.ops._common import Value, norm_axis
from tinydist.onnx.ops.shape import op_gather


def _values(ctx: Any, value: Value, what: str) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    raise ctx.error(f"the output shape depends on the values of input {what!r}, which are computed at run time: "
                    "tinydist plans static shapes, so that input must be constant or computed from graph inputs of at "
                    "most 64 elements (those are read at call time)")


def op_nonzero(ctx: Any, x: Value) -> np.ndarray:
    return np.array(np.nonzero(_values(ctx, x, "X")), dtype=np.int64).reshape(np.ndim(x) or 1, -1)


def op_unique(ctx: Any, x: Value) -> tuple[np.ndarray, ...]:
    data = _values(ctx, x, "X")
    axis = ctx.attr("axis", None)
    if axis is not None:
        axis = norm_axis(ctx, axis, data.ndim)
    y, first, inverse, counts = np.unique(data, True, True, True, axis=axis)
    if not ctx.attr("sorted", 1):  # order of first occurrence
        order = np.argsort(first, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        first, counts, inverse = first[order], counts[order], rank[inverse.reshape(-1)]
        y = np.take(data if axis is not None else data.reshape(-1), first, axis=axis or 0)
    results = (y, first.astype(np.int64), inverse.reshape(-1).astype(np.int64), counts.astype(np.int64))
    return results[:max(ctx.n_outputs, 1)]


def op_compress(ctx: Any, x: Value, condition: Value) -> Tensor | np.ndarray:
    keep = np.flatnonzero(_values(ctx, condition, "condition").reshape(-1).astype(bool)).astype(np.int64)
    if ctx.has_attr("axis"):
        axis = norm_axis(ctx, ctx.attr("axis"), x.ndim)
        if keep.size and keep[-1] >= x.shape[axis]:
            raise ctx.error(f"condition of length {np.size(condition)} selects past axis {axis} of shape {x.shape}")
        if isinstance(x, np.ndarray):
            return np.take(x, keep, axis=axis)
        return op_gather(ctx, x, keep)  # Compress's axis attribute is Gather's
    flat = x.reshape(-1)
    if isinstance(x, np.ndarray):
        return np.take(flat, keep)
    return op_gather(ctx, flat, keep)
