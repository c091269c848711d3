"""Elementwise ONNX ops that need more than one td.Tensor method (Div, Pow, Clip, Gelu, Cast …)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from tinydist.frontend.tensor import Tensor
from tinydist.graph import dtypes
from tinydist.onnx.ops._common import Value, as_tensor, erf, require_float, scalar_like, static, tanh


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
        if value == 3.0:  # onnxruntime's cube, (x * x) * x: the general POW is a scalar log/exp per element
            return (x * x * x)._broadcast_to(shape)
        if value == 1.0:
            return x._broadcast_to(shape)
    y = as_tensor(ctx, y, "exponent")
    if x.dtype.is_float:
        return x.pow(y.cast(x.dtype))
    if y.dtype.is_float:  # the result has the base's dtype: numpy's float64 power, truncated (the reference)
        return x.cast(dtypes.float64).pow(y.cast(dtypes.float64)).cast(x.dtype)
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


def log1p(u: Tensor) -> Tensor:
    """log(1 + u) without the rounding of 1 + u (Goldberg's trick: exact to a few ulp for small u)."""
    w = u + 1.0
    d = w - 1.0
    return (d == 0.0).where(u, w.log() * (u / d))


def op_softplus(ctx: Any, x: Tensor) -> Tensor:
    return x.maximum(0.0) + log1p((x.abs() * -1.0).exp())


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


def op_bitcast(ctx: Any, x: Tensor) -> Tensor:
    """BitCast (26): the same bits as dtype `to`, of the same size (numpy's view, onnx's reference)."""
    to = ctx.target_dtype(ctx.attr("to"))
    if to.itemsize != x.dtype.itemsize:
        raise ctx.error(f"BitCast from {x.dtype.name} ({8 * x.dtype.itemsize} bits) to {to.name} ({8 * to.itemsize} bits): "
                        "input and output types must have the same size")
    return x.bitcast(to)


def op_cast_like(ctx: Any, x: Tensor, like: Value) -> Tensor:
    dtype = like.dtype if isinstance(like, Tensor) else dtypes.to_dtype(like.dtype)
    return x.cast(dtype)


def op_identity(ctx: Any, x: Tensor) -> Tensor:
    return x


def op_dropout(ctx: Any, x: Tensor, ratio: Value = None, training: Value = None) -> Any:
    """Inference: the identity. The mask as onnxruntime gives it: all zeros of x's dtype in version 7,
    all false in 10, all true from 12 on (onnx's reference gives all true throughout)."""
    if training is not None and bool(static(ctx, training, "training_mode").reshape(-1)[0]):
        # training with ratio 0 drops nothing (the identity, an all-true mask); a random mask is not supported
        if ratio is None or not isinstance(ratio, np.ndarray) or float(ratio.reshape(-1)[0]) != 0.0:
            raise ctx.error("training_mode=True is supported with ratio 0 only (a random mask is not supported)")
        return (x, np.ones(x.shape, np.bool_)) if ctx.n_outputs > 1 else x
    if ctx.n_outputs > 1:
        if ctx.since < 12:
            return x, np.zeros(x.shape, np.bool_ if ctx.since >= 10 else x.dtype.np)
        return x, np.ones(x.shape, np.bool_)
    return x


# ---- rounding, sign, remainder -------------------------------------------------------------------

def ceil(x: Tensor) -> Tensor:
    return (x.neg().floor()).neg()


def round_half_even(x: Tensor) -> Tensor:
    """Round to nearest, ties to even (ONNX Round, numpy.round)."""
    low = x.floor()
    frac = x - low
    even = (low - (low * 0.5).floor() * 2.0) == 0.0
    up = (frac > 0.5) | ((frac == 0.5) & even.logical_not())
    return up.where(low + 1.0, low)


def op_sign(ctx: Any, x: Tensor) -> Tensor:
    if x.dtype.is_bool:
        raise ctx.error("Sign of bool is not defined")
    return (x > 0).where(scalar_like(x, 1), (x < 0).where(scalar_like(x, -1), x * scalar_like(x, 0)))


def op_mod(ctx: Any, a: Tensor, b: Tensor) -> Tensor:
    """fmod=0: the remainder with the divisor's sign (numpy's %; floats from version 28); fmod=1:
    with the dividend's sign (C fmod)."""
    fmod = bool(ctx.attr("fmod", 0))
    if not fmod and a.dtype.is_float and ctx.since < 28:  # version 28 defines it for floats (numpy's %)
        raise ctx.error("fmod=0 is defined for integer inputs only before version 28 (set fmod=1 for floats)")
    r = a % b
    if not fmod:
        return r
    return ((r != 0) & ((a < 0) != (b < 0))).where(r - b, r)


# ---- trigonometric and hyperbolic ------------------------------------------------------------------

def atan(x: Tensor) -> Tensor:
    """Cephes atanf: argument reduction to |x| <= tan(pi/8), a degree-9 odd polynomial (~2 ulp float32)."""
    ax = x.abs()
    big, mid = ax > 2.414213562373095, ax > 0.4142135623730950
    reduced = big.where(ax.maximum(1e-30).reciprocal().neg(), mid.where((ax - 1.0) / (ax + 1.0), ax))
    quarter = Tensor.full((), math.pi / 4, x.dtype, x.device)  # a tensor branch: where() of two Python floats is float64
    offset = big.where(quarter * 2.0, mid.where(quarter, 0.0))
    z = reduced * reduced
    poly = (((z * 8.05374449538e-2 - 1.38776856032e-1) * z + 1.99777106478e-1) * z - 3.33329491539e-1) * z * reduced + reduced
    y = offset + poly
    return (x < 0).where(y.neg(), y)


def asin(x: Tensor) -> Tensor:
    return atan(x / (1.0 - x * x).maximum(0.0).sqrt())


def acos(x: Tensor) -> Tensor:
    return asin(x).neg() + math.pi / 2


def op_trig(kind: str) -> Callable[..., Tensor]:
    def handler(ctx: Any, x: Tensor) -> Tensor:
        if not x.dtype.is_float:
            raise ctx.error(f"input dtype {x.dtype.name} is not supported (float16/float32/float64 only)")
        if kind == "tan":
            return x.sin() / x.cos()
        if kind == "atan":
            return atan(x)
        if kind == "asin":
            return asin(x)
        if kind == "acos":
            return acos(x)
        if kind == "sinh":
            return (x.exp() - x.neg().exp()) * 0.5
        if kind == "cosh":
            return (x.exp() + x.neg().exp()) * 0.5
        if kind == "asinh":
            ax = x.abs()
            y = (ax + (ax * ax + 1.0).sqrt()).log()
            return (x < 0).where(y.neg(), y)
        if kind == "acosh":
            return (x + (x * x - 1.0).sqrt()).log()
        if kind == "atanh":
            return ((x + 1.0) / (1.0 - x)).log() * 0.5
        raise AssertionError(kind)
    return handler


# ---- activations ---------------------------------------------------------------------------------

def op_prelu(ctx: Any, x: Tensor, slope: Value) -> Tensor:
    return (x < 0).where(x * as_tensor(ctx, slope, "slope"), x)


def op_selu(ctx: Any, x: Tensor) -> Tensor:
    alpha, gamma = ctx.attr("alpha", 1.67326319217681884765625), ctx.attr("gamma", 1.05070102214813232421875)
    return (x > 0).where(x * gamma, (x.exp() * alpha - alpha) * gamma)


def op_celu(ctx: Any, x: Tensor) -> Tensor:
    alpha = ctx.attr("alpha", 1.0)
    return x.maximum(0.0) + ((x / alpha).exp() - 1.0).minimum(0.0) * alpha


def op_mish(ctx: Any, x: Tensor) -> Tensor:
    return x * tanh(op_softplus(ctx, x))


def op_softsign(ctx: Any, x: Tensor) -> Tensor:
    return x / (x.abs() + 1.0)


def op_shrink(ctx: Any, x: Tensor) -> Tensor:
    lambd, bias = ctx.attr("lambd", 0.5), ctx.attr("bias", 0.0)
    if x.dtype.is_float:
        return (x < -lambd).where(x + bias, (x > lambd).where(x - bias, x * 0.0))
    lo, hi = scalar_like(x, bias), scalar_like(x, 0)
    return (x < -lambd).where(x + lo, (x > lambd).where(x - lo, x * hi))


def op_thresholded_relu(ctx: Any, x: Tensor) -> Tensor:
    return (x > ctx.attr("alpha", 1.0)).where(x, x * 0.0)


def op_swish(ctx: Any, x: Tensor) -> Tensor:
    return x * (x * ctx.attr("alpha", 1.0)).sigmoid()


def op_bit_shift(ctx: Any, x: Tensor, y: Tensor) -> Tensor:
    """The engine's shifts (numpy's, onnx's reference): a shift outside [0, bit width) gives 0
    (right shift of a negative x: -1)."""
    if x.dtype.is_float or x.dtype.is_bool:
        raise ctx.error(f"input dtype {x.dtype.name} is not supported (integers only)")
    y = y.cast(x.dtype)
    if ctx.attr("direction") == "LEFT":
        return x << y
    if ctx.attr("direction") == "RIGHT":
        return x >> y
    raise ctx.error(f"direction={ctx.attr('direction')!r} must be LEFT or RIGHT")


def op_swiglu(ctx: Any, a: Tensor, b: Tensor) -> Tensor:
    """Swish_alpha(a) · b, a and b of one shape (SwiGLU, 28)."""
    require_float(ctx, a)
    if a.shape != b.shape:
        raise ctx.error(f"A {a.shape} and B {b.shape} must have the same shape (no broadcasting)")
    return a * (a * ctx.attr("alpha", 1.0)).sigmoid() * b


def op_is_inf(ctx: Any, x: Tensor) -> Tensor:
    if not x.dtype.is_float:
        return Tensor.full(x.shape, False, dtypes.bool_, x.device)
    pos, neg = ctx.attr("detect_positive", 1), ctx.attr("detect_negative", 1)
    hit = (x == float("inf")) if pos else None
    if neg:
        hit = (x == float("-inf")) if hit is None else hit | (x == float("-inf"))
    return hit if hit is not None else Tensor.full(x.shape, False, dtypes.bool_, x.device)


def op_is_nan(ctx: Any, x: Tensor) -> Tensor:
    if not x.dtype.is_float:
        return Tensor.full(x.shape, False, dtypes.bool_, x.device)
    return x.isnan()
