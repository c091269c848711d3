"""numpy implementations used when every input of a node is constant (shape arithmetic)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from tinydist.onnx.kinds import np_dtype_of
from tinydist.onnx.ops._common import ints, norm_axis
from tinydist.onnx.ops.shape import (
    _squeeze_axes, expand_shape, op_constant, op_constant_of_shape, op_range, op_shape, op_size,
    reshape_target, slice_inputs, slice_plan, split_sizes, squeeze_shape, unsqueeze_shape,
)


# ---- numpy folds (all inputs constant) --------------------------------------------------------

def _np_binary(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Callable[..., np.ndarray]:
    def fold(ctx: Any, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        with np.errstate(all="ignore"):
            return np.asarray(fn(a, b)).astype(a.dtype if fn not in _CMP else np.bool_)
    return fold


def _np_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.dtype.kind in "iu":
        q = np.abs(a) // np.abs(b)
        return np.where((a < 0) != (b < 0), -q, q)
    return a / b


_CMP = (np.equal, np.less, np.greater, np.less_equal, np.greater_equal)


def _fold_gather(ctx: Any, data: np.ndarray, idx: np.ndarray) -> np.ndarray:
    axis = norm_axis(ctx, ctx.attr("axis", 0), data.ndim)
    n = data.shape[axis]
    idx = idx.astype(np.int64)
    if ((idx < -n) | (idx >= n)).any():
        raise ctx.error(f"indices out of range for axis of size {n}")
    return np.take(data, np.where(idx < 0, idx + n, idx), axis=axis)


def _fold_slice(ctx: Any, x: np.ndarray, starts: Any = None, ends: Any = None, axes: Any = None, steps: Any = None) -> np.ndarray:
    plan = slice_plan(ctx, x.shape, *slice_inputs(ctx, starts, ends, axes, steps))
    return x[tuple(slice(s, s + p * c, p) if p > 0 else (slice(s, s + p * c if s + p * c >= 0 else None, p))
                   for s, p, c in plan)]


def _fold_concat(ctx: Any, *xs: np.ndarray) -> np.ndarray:
    return np.concatenate(xs, axis=ctx.attr("axis"))


def _fold_cast(ctx: Any, x: np.ndarray) -> np.ndarray:
    """numpy's cast, quietly: a float -inf / nan cast to an integer is the integer's lowest value
    here as in onnxruntime (x86's conversion), and graphs rely on masking it afterwards — T5's
    relative-position buckets take log(0) = -inf at distance 0, cast it, then Where it away."""
    with np.errstate(invalid="ignore"):
        return x.astype(np_dtype_of(ctx, ctx.attr("to")))


def _fold_split(ctx: Any, x: np.ndarray, split: Any = None) -> tuple[np.ndarray, ...]:
    axis = norm_axis(ctx, ctx.attr("axis", 0), x.ndim)
    bounds = np.cumsum(split_sizes(ctx, x.shape[axis], split))[:-1]
    return tuple(np.split(x, bounds, axis=axis))


FOLDS: dict[str, Callable[..., Any]] = {
    "Identity": lambda ctx, x: x,
    "Add": _np_binary(np.add), "Sub": _np_binary(np.subtract), "Mul": _np_binary(np.multiply),
    "Div": _np_binary(_np_div),
    "Equal": _np_binary(np.equal), "Less": _np_binary(np.less), "Greater": _np_binary(np.greater),
    "LessOrEqual": _np_binary(np.less_equal), "GreaterOrEqual": _np_binary(np.greater_equal),
    "And": lambda ctx, a, b: np.logical_and(a, b), "Or": lambda ctx, a, b: np.logical_or(a, b),
    "Not": lambda ctx, a: np.logical_not(a),
    "Neg": lambda ctx, a: -a, "Abs": lambda ctx, a: np.abs(a),
    "Min": lambda ctx, *xs: np.minimum.reduce(np.broadcast_arrays(*xs)),
    "Max": lambda ctx, *xs: np.maximum.reduce(np.broadcast_arrays(*xs)),
    "Where": lambda ctx, c, a, b: np.where(c, a, b),
    "Cast": _fold_cast,
    "CastLike": lambda ctx, x, like: x.astype(like.dtype),
    "Gather": _fold_gather,
    "Concat": _fold_concat,
    "Slice": _fold_slice,
    "Split": _fold_split,
    "Reshape": lambda ctx, x, s: x.reshape(reshape_target(ctx, x.shape, ints(ctx, s, "shape"), bool(ctx.attr("allowzero", 0)))),
    "Squeeze": lambda ctx, x, axes=None: x.reshape(squeeze_shape(ctx, x.shape, _squeeze_axes(ctx, axes))),
    "Unsqueeze": lambda ctx, x, axes=None: x.reshape(unsqueeze_shape(ctx, x.shape, _squeeze_axes(ctx, axes) or [])),
    "Flatten": lambda ctx, x: x.reshape(math.prod(x.shape[:ctx.attr("axis", 1) % (x.ndim + 1)]), -1),
    "Transpose": lambda ctx, x: np.ascontiguousarray(np.transpose(x, ctx.attr("perm", None))),
    "Expand": lambda ctx, x, s: np.ascontiguousarray(np.broadcast_to(x, expand_shape(ctx, x.shape, ints(ctx, s, "shape")))),
    "Tile": lambda ctx, x, r: np.tile(x, ints(ctx, r, "repeats")),
    "Shape": op_shape, "Size": op_size, "ConstantOfShape": op_constant_of_shape, "Range": op_range,
    "Constant": op_constant,
}
