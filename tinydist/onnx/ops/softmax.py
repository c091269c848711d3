"""Softmax, LogSoftmax and Hardmax: along one axis (13 on), or over x flattened to 2-D at it (1, 11)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tinydist.frontend.tensor import Tensor
from tinydist.onnx.ops._common import norm_axis, require_float


def softmax_like(ctx: Any, x: Tensor, log: bool) -> Tensor:
    """Versions 1 and 11: x flattened to 2-D at `axis` (default 1), normalised over the second
    axis; 13 on: one axis (default -1)."""
    require_float(ctx, x)
    if ctx.since < 13:
        axis = norm_axis(ctx, ctx.attr("axis", 1), x.ndim)
        flat = x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))
        y = flat.log_softmax(1) if log else flat.softmax(1)
        return y.reshape(x.shape)
    axis = norm_axis(ctx, ctx.attr("axis", -1), x.ndim)
    return x.log_softmax(axis) if log else x.softmax(axis)


def op_hardmax(ctx: Any, x: Tensor) -> Tensor:
    """1 at the first maximum along the axis, 0 elsewhere; versions 1 and 11 over x flattened to
    2-D at `axis` (default 1), as Softmax."""
    require_float(ctx, x)
    if ctx.since < 13:
        axis = norm_axis(ctx, ctx.attr("axis", 1), x.ndim)
        flat = x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))
        return _hardmax(ctx, flat, 1).reshape(x.shape)
    return _hardmax(ctx, x, norm_axis(ctx, ctx.attr("axis", -1), x.ndim))


def _hardmax(ctx: Any, x: Tensor, axis: int) -> Tensor:
    n = x.shape[axis]
    positions = ctx.lift(("pos", x.ndim, axis, n), np.arange(n, dtype=np.int64).reshape(
        tuple(-1 if i == axis else 1 for i in range(x.ndim))))
    first = (x == x.max(axis, keepdim=True)).where(positions, n).min(axis, keepdim=True)
    return (positions == first).cast(x.dtype)


def op_softmax(ctx: Any, x: Tensor) -> Tensor:
    return softmax_like(ctx, x, False)


def op_log_softmax(ctx: Any, x: Tensor) -> Tensor:
    return softmax_like(ctx, x, True)
