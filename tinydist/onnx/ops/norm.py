"""Normalisations beyond BatchNorm/LayerNorm: Instance, Group, RMS, Lp, MeanVariance, LRN; and the
block rearrangements DepthToSpace / SpaceToDepth."""

from __future__ import annotations

import math
from typing import Any

from tinydist.frontend.tensor import Tensor
from tinydist.onnx.ops._common import (
    Value,
    as_tensor,
    norm_axes,
    norm_axis,
    require_float,
)
from tinydist.onnx.ops.nn import pad_value


def _normalise(x: Tensor, axes: tuple[int, ...], eps: float) -> Tensor:
    mean = x.mean(axes, keepdim=True)
    centered = x - mean
    return centered * ((centered * centered).mean(axes, keepdim=True) + eps).sqrt().reciprocal()


def _channel(ctx: Any, value: Value, key: str, ndim: int) -> Tensor:
    t = as_tensor(ctx, value, key)
    return t.reshape((1, t.shape[0]) + (1,) * (ndim - 2))


def op_instance_norm(ctx: Any, x: Tensor, scale: Value, bias: Value) -> Tensor:
    require_float(ctx, x)
    y = _normalise(x, tuple(range(2, x.ndim)), ctx.attr("epsilon", 1e-5))
    return y * _channel(ctx, scale, "scale", x.ndim) + _channel(ctx, bias, "bias", x.ndim)


def op_group_norm(ctx: Any, x: Tensor, scale: Value, bias: Value) -> Tensor:
    """Version 18: scale and bias per group; 21: per channel."""
    require_float(ctx, x)
    groups = ctx.attr("num_groups")
    n, c = x.shape[:2]
    if c % groups:
        raise ctx.error(f"{c} channels do not split into num_groups={groups}")
    grouped = x.reshape(n, groups, -1)
    y = _normalise(grouped, (2,), ctx.attr("epsilon", 1e-5))
    if ctx.since < 21:
        y = y.reshape(n, groups, c // groups, -1)
        s, b = (as_tensor(ctx, v, k).reshape(1, groups, 1, 1) for v, k in ((scale, "scale"), (bias, "bias")))
        return (y * s + b).reshape(x.shape)
    return y.reshape(x.shape) * _channel(ctx, scale, "scale", x.ndim) + _channel(ctx, bias, "bias", x.ndim)


def op_rms_norm(ctx: Any, x: Tensor, scale: Value) -> Tensor:
    require_float(ctx, x)
    axis = norm_axis(ctx, ctx.attr("axis", -1), x.ndim)
    axes = tuple(range(axis, x.ndim))
    inv = ((x * x).mean(axes, keepdim=True) + ctx.attr("epsilon", 1e-5)).sqrt().reciprocal()
    return x * inv * as_tensor(ctx, scale, "scale")


def op_lp_norm(ctx: Any, x: Tensor) -> Tensor:
    require_float(ctx, x)
    axis = norm_axis(ctx, ctx.attr("axis", -1), x.ndim)
    p = ctx.attr("p", 2)
    if p == 1:
        norm = x.abs().sum(axis, keepdim=True)
    elif p == 2:
        norm = (x * x).sum(axis, keepdim=True).sqrt()
    else:
        raise ctx.error(f"p={p} is not supported (1, 2)")
    return x / (norm == 0.0).where(1.0, norm)  # a zero vector stays zero


def op_mean_variance_norm(ctx: Any, x: Tensor) -> Tensor:
    """(x - mean) / (std + 1e-9) over `axes` (default 0, 2, 3), as onnx's function body."""
    require_float(ctx, x)
    axes = tuple(norm_axes(ctx, ctx.attr("axes", [0, 2, 3]), x.ndim))
    mean = x.mean(axes, keepdim=True)
    variance = (x * x).mean(axes, keepdim=True) - mean * mean
    return (x - mean) / (variance.sqrt() + 1e-9)


def op_lrn(ctx: Any, x: Tensor) -> Tensor:
    require_float(ctx, x)
    size = ctx.attr("size")
    alpha, beta, bias = ctx.attr("alpha", 1e-4), ctx.attr("beta", 0.75), ctx.attr("bias", 1.0)
    c = x.shape[1]
    lo, hi = (size - 1) // 2, math.ceil((size - 1) / 2)
    padded = pad_value(x * x, [(0, 0), (lo, hi)] + [(0, 0)] * (x.ndim - 2), 0)
    total = None
    for offset in range(size):
        bounds = [(0, s) for s in padded.shape]
        bounds[1] = (offset, offset + c)
        piece = padded.shrink(bounds)
        total = piece if total is None else total + piece
    return x / (total * (alpha / size) + bias).pow(beta)


def op_depth_to_space(ctx: Any, x: Tensor) -> Tensor:
    b = ctx.attr("blocksize")
    n, c, h, w = x.shape
    if c % (b * b):
        raise ctx.error(f"{c} channels are not a multiple of blocksize² = {b * b}")
    if ctx.attr("mode", "DCR") == "DCR":
        y = x.reshape(n, b, b, c // (b * b), h, w).permute((0, 3, 4, 1, 5, 2))
    else:
        y = x.reshape(n, c // (b * b), b, b, h, w).permute((0, 1, 4, 2, 5, 3))
    return y.reshape(n, c // (b * b), h * b, w * b)


def op_space_to_depth(ctx: Any, x: Tensor) -> Tensor:
    b = ctx.attr("blocksize")
    n, c, h, w = x.shape
    if h % b or w % b:
        raise ctx.error(f"spatial shape {(h, w)} is not a multiple of blocksize {b}")
    order = (0, 3, 5, 1, 2, 4) if ctx.attr("mode", "DCR") == "DCR" else (0, 1, 3, 5, 2, 4)
    y = x.reshape(n, c, h // b, b, w // b, b).permute(order)
    return y.reshape(n, c * b * b, h // b, w // b)
