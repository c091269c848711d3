"""Normalisations: Batch (inference, and training_mode's batch statistics), Layer, Instance, Group,
RMS, Lp, MeanVariance, LRN; and the block rearrangements DepthToSpace / SpaceToDepth."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tinydist.frontend.tensor import Tensor
from tinydist.onnx.ops._common import Value, as_tensor, norm_axes, norm_axis, pad_value, require_float


def _batch_norm_training(ctx: Any, x: Tensor, scale: Value, bias: Value, mean: Value, var: Value) -> Any:
    """training_mode=1 (14+): normalise with the batch's mean and (population) variance over every
    axis but the channels; running_mean / running_var = input · momentum + batch · (1 − momentum)."""
    require_float(ctx, x)
    eps, momentum = ctx.attr("epsilon", 1e-5), ctx.attr("momentum", 0.9)
    shape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
    axes = tuple(i for i in range(x.ndim) if i != 1)
    batch_mean = x.mean(axes, keepdim=True)
    centered = x - batch_mean
    batch_var = (centered * centered).mean(axes, keepdim=True)
    s, bi, m, v = (as_tensor(ctx, t, k).reshape(shape) for t, k in ((scale, "s"), (bias, "bi"), (mean, "m"), (var, "v")))
    y = centered / (batch_var + eps).sqrt() * s + bi
    running_mean = (m * momentum + batch_mean * (1.0 - momentum)).reshape(x.shape[1])
    running_var = (v * momentum + batch_var * (1.0 - momentum)).reshape(x.shape[1])
    return (y, running_mean, running_var)[:ctx.n_outputs] if ctx.n_outputs > 1 else y


def op_batch_norm(ctx: Any, x: Tensor, scale: Value, bias: Value, mean: Value, var: Value) -> Any:
    if ctx.attr("training_mode", 0):
        if ctx.since < 14:
            raise ctx.error("training_mode is an attribute of version 14 on")
        return _batch_norm_training(ctx, x, scale, bias, mean, var)
    if any(ctx.outputs_used[1:]):
        raise ctx.error("the training outputs (running mean/var) are not supported")
    require_float(ctx, x)
    eps = ctx.attr("epsilon", 1e-5)
    shape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
    if ctx.since < 9 and not ctx.attr("spatial", 1):  # version 7, spatial=0: parameters per (C, D1, …) element
        shape = (1,) + x.shape[1:]
    if all(isinstance(v, np.ndarray) for v in (scale, bias, mean, var)):
        a = (scale / np.sqrt(var + var.dtype.type(eps))).astype(x.dtype.np)
        b = (bias - mean * a).astype(x.dtype.np)
        return x * ctx.lift("a", a.reshape(shape)) + ctx.lift("b", b.reshape(shape))
    if ctx.since < 9 and not ctx.attr("spatial", 1):
        raise ctx.error("spatial=0 with parameters computed at run time is not supported")
    s, bi, m, v = (as_tensor(ctx, t, k).reshape(shape) for t, k in ((scale, "s"), (bias, "bi"), (mean, "m"), (var, "v")))
    return (x - m) / (v + eps).sqrt() * s + bi


def op_layer_norm(ctx: Any, x: Tensor, scale: Tensor, bias: Tensor | None = None) -> Any:
    require_float(ctx, x)
    if ctx.attr("stash_type", 1) != 1:
        raise ctx.error("stash_type other than 1 (float32) is not supported")
    axis = norm_axis(ctx, ctx.attr("axis", -1), x.ndim)
    eps = ctx.attr("epsilon", 1e-5)
    axes = tuple(range(axis, x.ndim))
    mean = x.mean(axes, keepdim=True)
    centered = x - mean
    inv = ((centered * centered).mean(axes, keepdim=True) + eps).sqrt().reciprocal()
    y = centered * inv * scale
    if bias is not None:
        y = y + bias
    if ctx.n_outputs == 1:
        return y
    return (y, mean, inv)[:ctx.n_outputs]



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
