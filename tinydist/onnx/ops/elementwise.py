"""Elementwise ONNX ops that need more than one td.Tensor method (Div, Pow, Clip, Gelu, Cast …)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from tinydist import dtypes
from tinydist.onnx.ops._common import Value, as_tensor, erf, scalar_like, static, tanh
from tinydist.tensor import Tensor


# ---- elementwise -------------------------------------------------------------------------------

def _variadic(fn: Callable[[Tensor, Tensor], Tensor]) -> Callable[..., Tensor]:
    def handler(ctx: Any, *xs: Tensor) -> Tensor:
        result = xs[0]
        for x in xs[1:]:
            result = fn(result, x)
        return result
    return handler


def op_div(ctx: Any, a: Tensor, b: Tensor) -> Tensor:
    if a.dtype.is_float:
        return a / b
    q = a // b
    inexact = (a % b) != 0
    return ((inexact & ((a < 0) != (b < 0)))).where(q + 1, q)


def op_pow(ctx: Any, x: Tensor, y: Value) -> Tensor:
    if isinstance(y, np.ndarray) and y.size == 1 and y.ndim <= x.ndim:
        value = float(y.reshape(-1)[0])
        shape = np.broadcast_shapes(x.shape, y.shape)
        if value == 2.0:
            return (x * x)._broadcast_to(shape)
        if value == 1.0:
            return x._broadcast_to(shape)
    y = as_tensor(ctx, y, "exponent")
    if x.dtype.is_float:
        return x.pow(y.cast(x.dtype))
    return x.pow(y)


def op_mean(ctx: Any, *xs: Tensor) -> Tensor:
    return _variadic(lambda a, b: a + b)(ctx, *xs) / scalar_like(xs[0], len(xs))


def op_clip(ctx: Any, x: Tensor, low: Value = None, high: Value = None) -> Tensor:
    if ctx.since < 11:  # version 6: float attributes, absent meaning unbounded
        low = np.array(ctx.attr("min"), x.dtype.np) if ctx.has_attr("min") else None
        high = np.array(ctx.attr("max"), x.dtype.np) if ctx.has_attr("max") else None
    for bound, fn in ((low, Tensor.maximum), (high, Tensor.minimum)):
        if bound is None or (isinstance(bound, np.ndarray) and bound.size == 0):
            continue
        if isinstance(bound, np.ndarray):
            x = fn(x, scalar_like(x, bound.reshape(-1)[0]))
        else:
            x = fn(x, bound.reshape(()) if bound.ndim else bound)
    return x


def op_leaky_relu(ctx: Any, x: Tensor) -> Tensor:
    alpha = ctx.attr("alpha", 0.01)
    return (x >= 0).where(x, x * alpha)


def op_elu(ctx: Any, x: Tensor) -> Tensor:
    alpha = ctx.attr("alpha", 1.0)
    return (x > 0).where(x, (x.exp() - 1) * alpha)


def op_hard_sigmoid(ctx: Any, x: Tensor) -> Tensor:
    return (x * ctx.attr("alpha", 0.2) + ctx.attr("beta", 0.5)).maximum(0.0).minimum(1.0)


def op_hard_swish(ctx: Any, x: Tensor) -> Tensor:
    return x * (x * (1.0 / 6.0) + 0.5).maximum(0.0).minimum(1.0)


def op_softplus(ctx: Any, x: Tensor) -> Tensor:
    return x.maximum(0.0) + ((x.abs() * -1.0).exp() + 1.0).log()


def op_gelu(ctx: Any, x: Tensor) -> Tensor:
    approximate = ctx.attr("approximate", "none")
    if approximate == "tanh":
        inner = (x + x * x * x * 0.044715) * math.sqrt(2.0 / math.pi)
        return x * 0.5 * (tanh(inner) + 1.0)
    if approximate != "none":
        raise ctx.error(f"approximate={approximate!r} is not supported (none, tanh)")
    return x * 0.5 * (erf(x * (1.0 / math.sqrt(2.0))) + 1.0)


def op_cast(ctx: Any, x: Tensor) -> Tensor:
    return x.cast(ctx.target_dtype(ctx.attr("to")))


def op_cast_like(ctx: Any, x: Tensor, like: Value) -> Tensor:
    dtype = like.dtype if isinstance(like, Tensor) else dtypes.to_dtype(like.dtype)
    return x.cast(dtype)


def op_identity(ctx: Any, x: Tensor) -> Tensor:
    return x


def op_dropout(ctx: Any, x: Tensor, ratio: Value = None, training: Value = None) -> Any:
    """Inference: the identity. The mask as onnxruntime gives it: all zeros of x's dtype in version 7,
    all false in 10, all true from 12 on (onnx's reference gives all true throughout)."""
    if training is not None and bool(static(ctx, training, "training_mode").reshape(-1)[0]):
        raise ctx.error("training_mode=True is not supported (inference only)")
    if ctx.n_outputs > 1:
        if ctx.since < 12:
            return x, np.zeros(x.shape, np.bool_ if ctx.since >= 10 else x.dtype.np)
        return x, np.ones(x.shape, np.bool_)
    return x
