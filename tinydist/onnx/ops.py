"""ONNX op handlers: each maps one node onto td.Tensor ops.

A handler is `fn(ctx, *inputs) -> value | tuple[value, ...]`. Inputs at the op's *param* positions
(shape, axes, pads, scales, weights worth preparing once, ...) arrive as numpy arrays when they are
constant and as Tensors when they are not; every other input arrives as a Tensor (constants lifted
once at load). A handler may return numpy arrays: those outputs are constants (e.g. `Shape`).

Work that depends only on attributes and static shapes (index maps, divisors, re-laid-out weights)
goes through `ctx.memo` / `ctx.lift` so it happens once, at load, not on every call.

`FOLDS` holds numpy implementations used when every input of a node is constant (shape arithmetic
such as Shape→Gather→Concat→Reshape chains); other all-constant nodes are folded by running the
handler once at load and reading the result back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import tinydist as td
from tinydist import dtypes
from tinydist.functional import conv2d
from tinydist.tensor import Tensor

Value = Any  # np.ndarray | Tensor | None

SUPPORTED_NP = {np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.bool_)}


# ---- helpers -----------------------------------------------------------------------------------

def static(ctx: Any, value: Value, what: str) -> np.ndarray:
    """A param input that must be constant at load time."""
    if isinstance(value, np.ndarray):
        return value
    raise ctx.error(f"input '{what}' must be constant (computed from initializers, Constant nodes or static shapes); "
                    "data-dependent values there are not supported")


def ints(ctx: Any, value: Value, what: str) -> list[int]:
    return [int(v) for v in static(ctx, value, what).reshape(-1)]


def as_tensor(ctx: Any, value: Value, key: str) -> Tensor:
    return value if isinstance(value, Tensor) else ctx.lift(key, value)


def scalar_like(x: Tensor, value: float) -> Any:
    """A Python scalar of `x`'s kind (a weak operand: it adopts x's dtype)."""
    if x.dtype.is_float:
        return float(value)
    if x.dtype.is_bool:
        return bool(value)
    return int(value)


def norm_axis(ctx: Any, axis: int, ndim: int) -> int:
    if not -ndim <= axis < max(ndim, 1):
        raise ctx.error(f"axis {axis} is out of range for rank {ndim}")
    return axis % max(ndim, 1)


def norm_axes(ctx: Any, axes: Sequence[int], ndim: int) -> list[int]:
    return [norm_axis(ctx, int(a), ndim) for a in axes]


def require_float(ctx: Any, x: Tensor) -> None:
    if not x.dtype.is_float:
        raise ctx.error(f"input dtype {x.dtype.name} is not supported (float32/float64 only)")


def shrink_axis(x: Tensor, axis: int, lo: int, hi: int) -> Tensor:
    bounds = [(0, s) for s in x.shape]
    bounds[axis] = (lo, hi)
    return x.shrink(bounds)


def pad_or_crop(x: Tensor, pairs: Sequence[tuple[int, int]], value: Any = 0) -> Tensor:
    """Pad (positive) or crop (negative) each axis by (before, after)."""
    crop = [(max(-b, 0), s - max(-a, 0)) for (b, a), s in zip(pairs, x.shape)]
    if any(lo >= hi for lo, hi in crop) and x.ndim:
        raise ValueError(f"cropping {pairs} removes every element of shape {x.shape}")
    x = x.shrink(crop)
    grow = [(max(b, 0), max(a, 0)) for b, a in pairs]
    return x.pad(grow, value) if any(b or a for b, a in grow) else x


def lowest(dtype: Any) -> Any:
    if dtype.is_float:
        return float("-inf")
    return -(1 << (dtype.itemsize * 8 - 1))


def erf(x: Tensor) -> Tensor:
    """erf(x) as a rational approximation (Eigen's / XLA's float32 erf: a few ulp over float32)."""
    x = x.maximum(-4.0).minimum(4.0)
    x2 = x * x
    alpha = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
             -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
    beta = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
            -1.42647390514189e-02)
    p = x2 * alpha[0] + alpha[1]
    for c in alpha[2:]:
        p = p * x2 + c
    q = x2 * beta[0] + beta[1]
    for c in beta[2:]:
        q = q * x2 + c
    return (x * p) / q


def tanh(x: Tensor) -> Tensor:
    return x.tanh()


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
    if training is not None and bool(static(ctx, training, "training_mode").reshape(-1)[0]):
        raise ctx.error("training_mode=True is not supported (inference only)")
    if ctx.n_outputs > 1:
        return x, np.ones(x.shape, np.bool_)
    return x


# ---- matmul, gemm --------------------------------------------------------------------------------

def op_matmul(ctx: Any, a: Tensor, b: Value) -> Tensor:
    if isinstance(b, np.ndarray) and b.ndim == 2 and a.ndim >= 2 and a.dtype.is_float:
        # a (…, M, K) @ constant (K, N): upload B as (1, K, N) so the kernel reads it in place
        out_shape = a.shape[:-1] + (b.shape[1],)
        b3 = ctx.lift("B3", np.ascontiguousarray(b.reshape((1,) + b.shape)))
        return a.matmul(b3).reshape(out_shape)
    return a.matmul(as_tensor(ctx, b, "B"))


def op_gemm(ctx: Any, a: Tensor, b: Value, c: Value = None) -> Tensor:
    alpha, beta = ctx.attr("alpha", 1.0), ctx.attr("beta", 1.0)
    if a.ndim != 2:
        raise ctx.error(f"A must be 2-D, got shape {a.shape}")
    if ctx.attr("transA", 0):
        a = a.permute(1, 0)
    if isinstance(b, np.ndarray):
        if b.ndim != 2:
            raise ctx.error(f"B must be 2-D, got shape {b.shape}")
        bm = b.T if ctx.attr("transB", 0) else b
        y = a.matmul(ctx.lift("B3", np.ascontiguousarray(bm.reshape((1,) + bm.shape)))).reshape(a.shape[0], bm.shape[1])
    else:
        y = a.matmul(b.permute(1, 0) if ctx.attr("transB", 0) else b)
    if alpha != 1.0:
        y = y * scalar_like(y, alpha)
    if c is not None and beta != 0.0:
        if isinstance(c, np.ndarray):
            ct = ctx.lift("C", (c * c.dtype.type(beta)).astype(c.dtype) if beta != 1.0 else c)
        else:
            ct = c * scalar_like(c, beta) if beta != 1.0 else c
        y = y + ct
    return y


# ---- convolution and pooling ------------------------------------------------------------------

def _spatial_args(ctx: Any, nd: int, in_sizes: Sequence[int], kernel: Sequence[int], default_dil: bool = True,
                  ceil_mode: bool = False) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    strides = list(ctx.attr("strides", [1] * nd))
    dilations = list(ctx.attr("dilations", [1] * nd))
    if len(strides) != nd or len(dilations) != nd:
        raise ctx.error(f"strides {strides} / dilations {dilations} do not match {nd} spatial axes")
    auto_pad = ctx.attr("auto_pad", "NOTSET")
    if auto_pad == "NOTSET":
        pads = list(ctx.attr("pads", [0] * (2 * nd)))
        if len(pads) != 2 * nd:
            raise ctx.error(f"pads {pads} do not match {nd} spatial axes")
        pairs = [(pads[i], pads[i + nd]) for i in range(nd)]
    elif auto_pad == "VALID":
        pairs = [(0, 0)] * nd
    elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        pairs = []
        for size, k, s, d in zip(in_sizes, kernel, strides, dilations):
            out = -(-size // s)
            total = max(0, (out - 1) * s + (k - 1) * d + 1 - size)
            small = total // 2
            pairs.append((small, total - small) if auto_pad == "SAME_UPPER" else (total - small, small))
    else:
        raise ctx.error(f"auto_pad={auto_pad!r} is not supported")
    if any(p < 0 for pair in pairs for p in pair):
        raise ctx.error(f"negative pads {pairs} are not supported")
    return strides, dilations, pairs


def _out_size(size: int, k: int, s: int, d: int, pad: tuple[int, int], ceil_mode: bool) -> int:
    span = size + pad[0] + pad[1] - ((k - 1) * d + 1)
    if not ceil_mode:
        return span // s + 1
    out = -(-span // s) + 1
    if (out - 1) * s >= size + pad[0]:  # the last window must start inside the input or left padding
        out -= 1
    return out


def _to_2d(x: Tensor) -> Tensor:
    return x.reshape(x.shape[:2] + (1,) + x.shape[2:]) if x.ndim == 3 else x


def op_conv(ctx: Any, x: Tensor, w: Value, b: Value = None) -> Tensor:
    nd = x.ndim - 2
    if nd not in (1, 2):
        raise ctx.error(f"{nd}-D convolution is not supported (1-D and 2-D only)")
    require_float(ctx, x)
    if w.ndim != x.ndim:
        raise ctx.error(f"weight shape {w.shape} does not match input rank {x.ndim}")
    groups = ctx.attr("group", 1)
    oc, cg = w.shape[0], w.shape[1]
    kernel = list(w.shape[2:])
    if list(ctx.attr("kernel_shape", kernel)) != kernel:
        raise ctx.error(f"kernel_shape {ctx.attr('kernel_shape')} does not match weight shape {w.shape}")
    if x.shape[1] != cg * groups or oc % groups:
        raise ctx.error(f"input channels {x.shape[1]}, weight shape {w.shape} and group={groups} do not match")
    strides, dilations, pairs = _spatial_args(ctx, nd, x.shape[2:], kernel)
    if nd == 1:
        x, kernel, strides, dilations, pairs = _to_2d(x), [1] + kernel, [1] + strides, [1] + dilations, [(0, 0)] + pairs
        w = w.reshape(w.shape[:2] + (1,) + w.shape[2:])
    x = pad_or_crop(x, [(0, 0), (0, 0)] + pairs)
    out = conv2d(x, as_tensor(ctx, w, "W"), None, tuple(strides), 0, tuple(dilations), groups)
    if b is not None:
        out = out + as_tensor(ctx, b, "bias").reshape(1, oc, 1, 1)
    return out.reshape(out.shape[:2] + out.shape[3:]) if nd == 1 else out


def op_conv_transpose(ctx: Any, x: Tensor, w: Value, b: Value = None) -> Tensor:
    nd = x.ndim - 2
    if nd not in (1, 2):
        raise ctx.error(f"{nd}-D ConvTranspose is not supported (1-D and 2-D only)")
    require_float(ctx, x)
    w = static(ctx, w, "W")  # flipping the kernel needs its values at load
    groups = ctx.attr("group", 1)
    cin, ocg = w.shape[0], w.shape[1]
    oc = ocg * groups
    kernel = list(w.shape[2:])
    if x.shape[1] != cin or cin % groups:
        raise ctx.error(f"input channels {x.shape[1]}, weight shape {w.shape} and group={groups} do not match")
    strides = list(ctx.attr("strides", [1] * nd))
    dilations = list(ctx.attr("dilations", [1] * nd))
    out_pad = list(ctx.attr("output_padding", [0] * nd))
    in_sizes = x.shape[2:]
    auto_pad = ctx.attr("auto_pad", "NOTSET")
    full = [(i - 1) * s + (k - 1) * d + 1 + op for i, s, k, d, op in zip(in_sizes, strides, kernel, dilations, out_pad)]
    if ctx.has_attr("output_shape") or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        if ctx.has_attr("output_shape"):
            target = list(ctx.attr("output_shape"))[-nd:]
        else:
            target = [i * s for i, s in zip(in_sizes, strides)]
        totals = [f - t for f, t in zip(full, target)]
        if any(t < 0 for t in totals):
            raise ctx.error(f"output_shape {target} is larger than the full output {full}")
        upper = auto_pad == "SAME_UPPER"
        pairs = [(t // 2, t - t // 2) if upper else (t - t // 2, t // 2) for t in totals]
    elif auto_pad in ("NOTSET", "VALID"):
        pads = list(ctx.attr("pads", [0] * (2 * nd))) if auto_pad == "NOTSET" else [0] * (2 * nd)
        pairs = [(pads[i], pads[i + nd]) for i in range(nd)]
    else:
        raise ctx.error(f"auto_pad={auto_pad!r} is not supported")
    # ConvTranspose = zero-stuffed input, padded by d(k-1) - pad, convolved with the flipped kernel
    wflip = w[(slice(None), slice(None)) + (slice(None, None, -1),) * nd]
    wconv = wflip.reshape((groups, cin // groups, ocg) + tuple(kernel)).swapaxes(1, 2).reshape((oc, cin // groups) + tuple(kernel))
    if nd == 1:
        x = _to_2d(x)
        wconv = wconv.reshape(wconv.shape[:2] + (1,) + wconv.shape[2:])
        kernel, strides, dilations, out_pad, pairs = [1] + kernel, [1] + strides, [1] + dilations, [0] + out_pad, [(0, 0)] + pairs
    n, c, h, wd = x.shape
    if strides != [1, 1]:
        sh, sw = strides
        x = x.reshape(n, c, h, 1, wd, 1).pad(((0, 0), (0, 0), (0, 0), (0, sh - 1), (0, 0), (0, sw - 1)))
        x = x.reshape(n, c, h * sh, wd * sw).shrink(((0, n), (0, c), (0, (h - 1) * sh + 1), (0, (wd - 1) * sw + 1)))
    edge = [(d * (k - 1) - pb, d * (k - 1) - pe + op) for d, k, (pb, pe), op in zip(dilations, kernel, pairs, out_pad)]
    x = pad_or_crop(x, [(0, 0), (0, 0)] + edge)
    out = conv2d(x, as_tensor(ctx, wconv, "W"), None, 1, 0, tuple(dilations), groups)
    if b is not None:
        out = out + as_tensor(ctx, b, "bias").reshape(1, oc, 1, 1)
    return out.reshape(out.shape[:2] + out.shape[3:]) if nd == 1 else out


def _pool_setup(ctx: Any, x: Tensor, dilation_ok: bool) -> tuple[Tensor, list[int], list[int], list[int], list[tuple[int, int]], list[int], int]:
    nd = x.ndim - 2
    if nd not in (1, 2):
        raise ctx.error(f"{nd}-D pooling is not supported (1-D and 2-D only)")
    kernel = list(ctx.attr("kernel_shape"))
    if len(kernel) != nd:
        raise ctx.error(f"kernel_shape {kernel} does not match {nd} spatial axes")
    if not dilation_ok and ctx.has_attr("dilations"):
        raise ctx.error("dilations are not supported for this op and opset")
    strides, dilations, pairs = _spatial_args(ctx, nd, x.shape[2:], kernel)
    ceil_mode = bool(ctx.attr("ceil_mode", 0))
    outs = [_out_size(size, k, s, d, p, ceil_mode) for size, k, s, d, p in zip(x.shape[2:], kernel, strides, dilations, pairs)]
    if any(o <= 0 for o in outs):
        raise ctx.error(f"pooling window {kernel} does not fit input shape {x.shape}")
    return x, kernel, strides, dilations, pairs, outs, nd


def _pool_reduce(x: Tensor, kernel: list[int], strides: list[int], dilations: list[int], pairs: list[tuple[int, int]],
                 outs: list[int], value: Any, op: str) -> Tensor:
    """Reduce (max/sum) every window of x padded with `value` → (N, C, *outs).

    The strided window view leaves out every size-1 axis: a view with a size-1 axis between two
    others is mis-collapsed by codegen (see docs/onnx.md, core issues)."""
    edge = [(pb, max((o - 1) * s + (k - 1) * d + 1 - size - pb, 0))
            for size, k, s, d, (pb, _), o in zip(x.shape[2:], kernel, strides, dilations, pairs, outs)]
    padded = pad_value(x, [(0, 0), (0, 0)] + edge, value)
    dims = padded.shape
    contiguous, acc = [], 1
    for size in reversed(dims):
        contiguous.append(acc)
        acc *= size
    contiguous.reverse()
    n, c = dims[:2]
    shape = [n, c] + list(outs) + list(kernel)
    view_strides = contiguous[:2] + [st * s for st, s in zip(contiguous[2:], strides)] + \
        [st * d for st, d in zip(contiguous[2:], dilations)]
    keep = [i for i, size in enumerate(shape) if size != 1]
    window = padded._as_strided(tuple(shape[i] for i in keep), tuple(view_strides[i] for i in keep))
    axes = tuple(keep.index(i) for i in range(2 + len(outs), len(shape)) if i in keep)
    if axes:
        window = window.max(axes) if op == "max" else window.sum(axes)
    return window.reshape(tuple([n, c] + list(outs)))


def pad_value(x: Tensor, pairs: Sequence[tuple[int, int]], value: Any) -> Tensor:
    """pad_or_crop with a fill value of x's own dtype (Tensor.pad(value=) promotes float32 to float64)."""
    grow = [(max(b, 0), max(a, 0)) for b, a in pairs]
    cropped = pad_or_crop(x, [(min(b, 0), min(a, 0)) for b, a in pairs])
    if not any(b or a for b, a in grow):
        return cropped
    padded = cropped.pad(grow)
    if value == 0:
        return padded
    inside = Tensor.full(cropped.shape, True, dtypes.bool_, x.device).pad(grow)
    return inside.where(padded, Tensor.full((), value, x.dtype, x.device))


def op_max_pool(ctx: Any, x: Tensor) -> Any:
    if ctx.n_outputs > 1 and ctx.outputs_used[1]:
        raise ctx.error("the Indices output is not supported")
    if ctx.attr("storage_order", 0):
        raise ctx.error("storage_order=1 is not supported")
    x, kernel, strides, dilations, pairs, outs, nd = _pool_setup(ctx, x, True)
    y = _pool_reduce(x, kernel, strides, dilations, pairs, outs, lowest(x.dtype), "max")
    return (y, None) if ctx.n_outputs > 1 else y


def op_average_pool(ctx: Any, x: Tensor) -> Tensor:
    require_float(ctx, x)
    x, kernel, strides, dilations, pairs, outs, nd = _pool_setup(ctx, x, ctx.opset >= 19)
    include_pad = bool(ctx.attr("count_include_pad", 0))

    def divisor() -> np.ndarray:
        div = np.ones((), np.float64)
        for size, k, s, d, (pb, pe), o in zip(x.shape[2:], kernel, strides, dilations, pairs, outs):
            pos = (np.arange(o)[:, None] * s - pb) + np.arange(k)[None, :] * d
            lo, hi = (-pb, size + pe) if include_pad else (0, size)
            div = np.multiply.outer(div, ((pos >= lo) & (pos < hi)).sum(axis=1))
        return div.astype(x.dtype.np)

    total = _pool_reduce(x, kernel, strides, dilations, pairs, outs, 0, "sum")
    return total / ctx.lift(("div", x.shape), divisor())


def op_global_average_pool(ctx: Any, x: Tensor) -> Tensor:
    require_float(ctx, x)
    return x.mean(axis=tuple(range(2, x.ndim)), keepdim=True)


def op_global_max_pool(ctx: Any, x: Tensor) -> Tensor:
    return x.max(axis=tuple(range(2, x.ndim)), keepdim=True)


# ---- normalisation --------------------------------------------------------------------------

def op_batch_norm(ctx: Any, x: Tensor, scale: Value, bias: Value, mean: Value, var: Value) -> Tensor:
    if ctx.attr("training_mode", 0):
        raise ctx.error("training_mode=1 is not supported (inference only)")
    if any(ctx.outputs_used[1:]):
        raise ctx.error("the training outputs (running mean/var) are not supported")
    require_float(ctx, x)
    eps = ctx.attr("epsilon", 1e-5)
    shape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
    if all(isinstance(v, np.ndarray) for v in (scale, bias, mean, var)):
        a = (scale / np.sqrt(var + var.dtype.type(eps))).astype(x.dtype.np)
        b = (bias - mean * a).astype(x.dtype.np)
        return x * ctx.lift("a", a.reshape(shape)) + ctx.lift("b", b.reshape(shape))
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


def _softmax_like(ctx: Any, x: Tensor, log: bool) -> Tensor:
    require_float(ctx, x)
    if ctx.opset < 13:
        axis = norm_axis(ctx, ctx.attr("axis", 1), x.ndim)
        flat = x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))
        y = flat.log_softmax(1) if log else flat.softmax(1)
        return y.reshape(x.shape)
    axis = norm_axis(ctx, ctx.attr("axis", -1), x.ndim)
    return x.log_softmax(axis) if log else x.softmax(axis)


# ---- reductions -----------------------------------------------------------------------------

def _reduce(kind: str, axes_input_since: int) -> Callable[..., Tensor]:
    def handler(ctx: Any, x: Tensor, axes_in: Value = None) -> Tensor:
        keep = bool(ctx.attr("keepdims", 1))
        if ctx.opset >= axes_input_since:
            axes = ints(ctx, axes_in, "axes") if axes_in is not None else []
        else:
            axes = list(ctx.attr("axes", []))
        if not axes:
            if ctx.attr("noop_with_empty_axes", 0):
                return x
            axes = list(range(x.ndim))
        axes = norm_axes(ctx, axes, x.ndim)
        if kind == "sum":
            return x.sum(axes, keepdim=keep, dtype=x.dtype)
        if kind == "mean":
            if not x.dtype.is_float:
                raise ctx.error(f"integer ReduceMean ({x.dtype.name}) is not supported")
            return x.mean(axes, keepdim=keep)
        if kind == "prod":
            return x.prod(axes, keepdim=keep, dtype=x.dtype)
        if kind == "sumsquare":
            return (x * x).sum(axes, keepdim=keep, dtype=x.dtype)
        if kind == "l2":
            require_float(ctx, x)
            return (x * x).sum(axes, keepdim=keep).sqrt()
        if kind == "l1":
            return x.abs().sum(axes, keepdim=keep, dtype=x.dtype)
        if kind == "logsumexp":
            require_float(ctx, x)
            m = x.max(axes, keepdim=True)
            out = (x - m).exp().sum(axes, keepdim=True).log() + m
            return out if keep else out.reshape(tuple(s for i, s in enumerate(x.shape) if i not in axes))
        return x.max(axes, keepdim=keep) if kind == "max" else x.min(axes, keepdim=keep)
    return handler


def _arg(kind: str) -> Callable[..., Tensor]:
    def handler(ctx: Any, x: Tensor) -> Tensor:
        axis = norm_axis(ctx, ctx.attr("axis", 0), x.ndim)
        keep = bool(ctx.attr("keepdims", 1))
        last = bool(ctx.attr("select_last_index", 0))
        extreme = x.max(axis, keepdim=True) if kind == "max" else x.min(axis, keepdim=True)
        hit = x == extreme
        if x.dtype.is_float:
            hit = hit | x.isnan()
        n = x.shape[axis]
        positions = ctx.lift(("pos", x.ndim, axis, n), np.arange(n, dtype=np.int64).reshape(
            tuple(-1 if i == axis else 1 for i in range(x.ndim))))
        if last:
            out = hit.where(positions, -1).max(axis, keepdim=True)
        else:
            out = hit.where(positions, n).min(axis, keepdim=True)
        return out if keep else out.reshape(tuple(s for i, s in enumerate(x.shape) if i != axis))
    return handler


# ---- movement ------------------------------------------------------------------------------

def reshape_target(ctx: Any, in_shape: Sequence[int], shape: list[int], allowzero: bool) -> tuple[int, ...]:
    out = [in_shape[i] if (s == 0 and not allowzero) else s for i, s in enumerate(shape)]
    if out.count(-1) > 1:
        raise ctx.error(f"shape {shape} has more than one -1")
    if -1 in out:
        known = math.prod(s for s in out if s != -1)
        total = math.prod(in_shape)
        if known == 0 or total % known:
            raise ctx.error(f"cannot reshape {tuple(in_shape)} into {shape}")
        out[out.index(-1)] = total // known
    if math.prod(out) != math.prod(in_shape):
        raise ctx.error(f"cannot reshape {tuple(in_shape)} into {shape}")
    return tuple(out)


def op_reshape(ctx: Any, x: Tensor, shape: Value) -> Tensor:
    return x.reshape(reshape_target(ctx, x.shape, ints(ctx, shape, "shape"), bool(ctx.attr("allowzero", 0))))


def op_flatten(ctx: Any, x: Tensor) -> Tensor:
    axis = ctx.attr("axis", 1)
    axis = axis + x.ndim if axis < 0 else axis
    if not 0 <= axis <= x.ndim:
        raise ctx.error(f"axis {ctx.attr('axis', 1)} is out of range for rank {x.ndim}")
    return x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))


def op_transpose(ctx: Any, x: Tensor) -> Tensor:
    perm = ctx.attr("perm", list(reversed(range(x.ndim))))
    return x.permute(tuple(perm))


def _squeeze_axes(ctx: Any, axes_in: Value) -> list[int] | None:
    if ctx.opset >= 13:
        return ints(ctx, axes_in, "axes") if axes_in is not None else None
    return list(ctx.attr("axes")) if ctx.has_attr("axes") else None


def squeeze_shape(ctx: Any, shape: Sequence[int], axes: list[int] | None) -> tuple[int, ...]:
    if axes is None:
        return tuple(s for s in shape if s != 1)
    axes = norm_axes(ctx, axes, len(shape))
    for a in axes:
        if shape[a] != 1:
            raise ctx.error(f"cannot squeeze axis {a} of shape {tuple(shape)}")
    return tuple(s for i, s in enumerate(shape) if i not in axes)


def unsqueeze_shape(ctx: Any, shape: Sequence[int], axes: list[int]) -> tuple[int, ...]:
    rank = len(shape) + len(axes)
    axes = sorted(norm_axes(ctx, axes, rank))
    out, it = [], iter(shape)
    for i in range(rank):
        out.append(1 if i in axes else next(it))
    return tuple(out)


def op_squeeze(ctx: Any, x: Tensor, axes: Value = None) -> Tensor:
    return x.reshape(squeeze_shape(ctx, x.shape, _squeeze_axes(ctx, axes)))


def op_unsqueeze(ctx: Any, x: Tensor, axes: Value = None) -> Tensor:
    found = _squeeze_axes(ctx, axes)
    if found is None:
        raise ctx.error("Unsqueeze needs axes")
    return x.reshape(unsqueeze_shape(ctx, x.shape, found))


def op_concat(ctx: Any, *xs: Tensor) -> Tensor:
    xs = tuple(x for x in xs if x.numel() or x.ndim != 1)  # ONNX allows empty 1-D pieces
    axis = norm_axis(ctx, ctx.attr("axis"), xs[0].ndim)
    return xs[0] if len(xs) == 1 else td.cat(list(xs), axis)


def split_sizes(ctx: Any, dim: int, split: Value) -> list[int]:
    if ctx.opset >= 13:
        sizes = ints(ctx, split, "split") if split is not None else None
    else:
        sizes = list(ctx.attr("split")) if ctx.has_attr("split") else None
    if sizes is None:
        count = ctx.attr("num_outputs", ctx.n_outputs) if ctx.opset >= 18 else ctx.n_outputs
        if ctx.opset >= 18 and ctx.has_attr("num_outputs"):
            chunk = -(-dim // count)
            sizes = [min(chunk, dim - i * chunk) for i in range(count)]
        else:
            if dim % count:
                raise ctx.error(f"axis of size {dim} does not split evenly into {count} outputs")
            sizes = [dim // count] * count
    if sum(sizes) != dim or len(sizes) != ctx.n_outputs:
        raise ctx.error(f"split {sizes} does not match axis size {dim} and {ctx.n_outputs} outputs")
    return sizes


def op_split(ctx: Any, x: Tensor, split: Value = None) -> tuple[Tensor, ...]:
    axis = norm_axis(ctx, ctx.attr("axis", 0), x.ndim)
    outs, start = [], 0
    for size in split_sizes(ctx, x.shape[axis], split):
        outs.append(shrink_axis(x, axis, start, start + size))
        start += size
    return tuple(outs)


def slice_plan(ctx: Any, shape: Sequence[int], starts: Value, ends: Value, axes: Value, steps: Value
               ) -> list[tuple[int, int, int]]:
    """Per axis (start, step, count), ONNX clamping rules (those of Python slices)."""
    st, en = ints(ctx, starts, "starts"), ints(ctx, ends, "ends")
    ax = ints(ctx, axes, "axes") if axes is not None else list(range(len(st)))
    sp = ints(ctx, steps, "steps") if steps is not None else [1] * len(st)
    if not len(st) == len(en) == len(ax) == len(sp):
        raise ctx.error(f"starts {st}, ends {en}, axes {ax}, steps {sp} differ in length")
    plan = [(0, 1, s) for s in shape]
    for s, e, a, p in zip(st, en, norm_axes(ctx, ax, len(shape)), sp):
        if p == 0:
            raise ctx.error("slice step 0 is not allowed")
        start, stop, step = slice(s, e, p).indices(shape[a])
        plan[a] = (start, step, len(range(start, stop, step)))
    return plan


def op_slice(ctx: Any, x: Tensor, starts: Value, ends: Value, axes: Value = None, steps: Value = None) -> Tensor:
    plan = slice_plan(ctx, x.shape, starts, ends, axes, steps)
    out_shape = tuple(c for _, _, c in plan)
    if 0 in out_shape:
        return Tensor.full(out_shape, 0, x.dtype)
    if all(step > 0 for _, step, _ in plan):
        index = tuple(slice(start, start + step * (count - 1) + 1, step) for start, step, count in plan)
        return x[index]
    strides, acc = [], 1
    for size in reversed(x.shape):
        strides.append(acc)
        acc *= size
    strides.reverse()
    offset = sum(start * s for (start, _, _), s in zip(plan, strides))
    return x._as_strided(out_shape, tuple(s * step for (_, step, _), s in zip(plan, strides)), offset)


def _gather_where(data: Tensor, mask: Tensor, axis: int, ind_ndim: int) -> Tensor:
    """out[pre, I, post] = sum_n mask[I, n] * data[pre, n, post] (exact: where, not multiply)."""
    pre, n, post = data.shape[:axis], data.shape[axis], data.shape[axis + 1:]
    d = data.reshape(pre + (1,) * ind_ndim + (n,) + post)
    m = mask.reshape((1,) * len(pre) + mask.shape + (1,) * len(post))
    picked = m.where(d, False if data.dtype.is_bool else 0)
    red = len(pre) + ind_ndim
    if data.dtype.is_bool:
        return picked.max(red)
    return picked.sum(red, dtype=data.dtype)


def op_gather(ctx: Any, data: Value, indices: Value) -> Tensor:
    n_dims = data.ndim
    axis = norm_axis(ctx, ctx.attr("axis", 0), n_dims)
    n = data.shape[axis]
    if isinstance(indices, np.ndarray):
        idx = indices.astype(np.int64)
        if ((idx < -n) | (idx >= n)).any():
            raise ctx.error(f"indices {idx.reshape(-1).tolist()[:8]} are out of range for axis of size {n}")
        idx = np.where(idx < 0, idx + n, idx)
        x = as_tensor(ctx, data, "data")
        flat = idx.reshape(-1)
        if flat.size and (flat.size == 1 or (np.all(np.diff(flat) == flat[1] - flat[0]) and flat[1] > flat[0])):
            step = int(flat[1] - flat[0]) if flat.size > 1 else 1
            index = (slice(None),) * axis + (slice(int(flat[0]), int(flat[-1]) + 1, step),)
            picked = x[index]
            return picked.reshape(x.shape[:axis] + idx.shape + x.shape[axis + 1:])
        mask = ctx.lift(("mask", idx.shape, n), idx[..., None] == np.arange(n))
        return _gather_where(x, mask, axis, idx.ndim)
    if indices.dtype.is_float or indices.dtype.is_bool:
        raise ctx.error(f"indices dtype {indices.dtype.name} is not supported")
    idx = (indices < 0).where(indices + n, indices)
    positions = ctx.lift(("ar", n, indices.dtype.name), np.arange(n, dtype=indices.dtype.np))
    mask = idx.reshape(idx.shape + (1,)) == positions
    if isinstance(data, np.ndarray) and axis == 0 and data.dtype.kind == "f" and np.isfinite(data).all():
        # constant, finite table (an embedding): one-hot @ table is exact and runs the native matmul
        table = ctx.lift("table", np.ascontiguousarray(data.reshape(1, n, -1)))
        rows = mask.cast(dtypes.to_dtype(data.dtype)).reshape(1, -1, n).matmul(table)
        return rows.reshape(idx.shape + data.shape[1:])
    return _gather_where(as_tensor(ctx, data, "data"), mask, axis, idx.ndim)


def expand_shape(ctx: Any, in_shape: Sequence[int], shape: list[int]) -> tuple[int, ...]:
    try:
        return tuple(np.broadcast_shapes(tuple(in_shape), tuple(shape)))
    except ValueError:
        raise ctx.error(f"cannot expand shape {tuple(in_shape)} to {shape}") from None


def op_expand(ctx: Any, x: Tensor, shape: Value) -> Tensor:
    return x._broadcast_to(expand_shape(ctx, x.shape, ints(ctx, shape, "shape")))


def op_tile(ctx: Any, x: Tensor, repeats: Value) -> Tensor:
    reps = ints(ctx, repeats, "repeats")
    if len(reps) != x.ndim:
        raise ctx.error(f"repeats {reps} do not match rank {x.ndim}")
    if all(r == 1 for r in reps):
        return x
    inter = tuple(v for s in x.shape for v in (1, s))
    expanded = x.reshape(inter).expand(tuple(v for r, s in zip(reps, x.shape) for v in (r, s)))
    return expanded.reshape(tuple(r * s for r, s in zip(reps, x.shape)))


def pad_pairs(ctx: Any, ndim: int, pads: Value, axes: Value) -> list[tuple[int, int]]:
    p = ints(ctx, pads, "pads")
    ax = norm_axes(ctx, ints(ctx, axes, "axes"), ndim) if axes is not None else list(range(ndim))
    if len(p) != 2 * len(ax):
        raise ctx.error(f"pads {p} do not match {len(ax)} axes")
    pairs = [(0, 0)] * ndim
    for i, a in enumerate(ax):
        pairs[a] = (p[i], p[i + len(ax)])
    return pairs


def op_pad(ctx: Any, x: Tensor, pads: Value = None, value: Value = None, axes: Value = None) -> Tensor:
    mode = ctx.attr("mode", "constant")
    pairs = pad_pairs(ctx, x.ndim, pads, axes)
    if mode == "constant":
        v = 0 if value is None or static(ctx, value, "constant_value").size == 0 else static(ctx, value, "constant_value").reshape(-1)[0]
        return pad_value(x, pairs, scalar_like(x, v))
    if mode not in ("edge", "reflect", "wrap"):
        raise ctx.error(f"mode={mode!r} is not supported")
    crop = [(max(-b, 0), max(-a, 0)) for b, a in pairs]
    x = pad_or_crop(x, [(-b, -a) for b, a in crop])
    for axis, (before, after) in enumerate(pairs):
        before, after = max(before, 0), max(after, 0)
        if not before and not after:
            continue
        size = x.shape[axis]
        if mode == "edge":
            sources = [0] * before + list(range(size)) + [size - 1] * after
        elif mode == "reflect":
            if size < 2 or before >= size or after >= size:
                raise ctx.error(f"reflect padding {pairs[axis]} needs an axis longer than the pad (size {size})")
            sources = list(range(before, 0, -1)) + list(range(size)) + list(range(size - 2, size - 2 - after, -1))
        else:
            sources = [(i - before) % size for i in range(size + before + after)]
        pieces = []
        for s in sources:
            if pieces and pieces[-1][1] == s and pieces[-1][2] == 1:
                pieces[-1] = (pieces[-1][0], s + 1, 1)
            else:
                pieces.append((s, s + 1, 1))
        x = td.cat([shrink_axis(x, axis, lo, hi) for lo, hi, _ in pieces], axis) if len(pieces) > 1 else shrink_axis(x, axis, pieces[0][0], pieces[0][1])
    return x


# ---- resize --------------------------------------------------------------------------------

def _resize_coords(ctx: Any, mode: str, size: int, out: int, scale: float) -> np.ndarray:
    i = np.arange(out, dtype=np.float64)
    if mode == "half_pixel":
        return (i + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return (i + 0.5) / scale - 0.5 if out > 1 else np.zeros(out)
    if mode == "align_corners":
        return i * (size - 1) / (out - 1) if out > 1 else np.zeros(out)
    if mode == "asymmetric":
        return i / scale
    if mode == "half_pixel_symmetric":
        adjustment = out / (scale * size)
        center = size / 2
        offset = center * (1 - adjustment)
        return offset + (i + 0.5) / scale - 0.5
    raise ctx.error(f"coordinate_transformation_mode={mode!r} is not supported")


def _nearest(ctx: Any, rule: str, coords: np.ndarray, size: int) -> np.ndarray:
    if rule == "round_prefer_floor":
        idx = np.where(coords - np.floor(coords) == 0.5, np.floor(coords), np.round(coords))
    elif rule == "round_prefer_ceil":
        idx = np.where(coords - np.floor(coords) == 0.5, np.ceil(coords), np.round(coords))
    elif rule == "floor":
        idx = np.floor(coords)
    elif rule == "ceil":
        idx = np.ceil(coords)
    else:
        raise ctx.error(f"nearest_mode={rule!r} is not supported")
    return np.clip(idx, 0, size - 1).astype(np.int64)


def op_resize(ctx: Any, x: Tensor, roi: Value = None, scales: Value = None, sizes: Value = None) -> Tensor:
    mode = ctx.attr("mode", "nearest")
    if mode not in ("nearest", "linear"):
        raise ctx.error(f"mode={mode!r} is not supported (nearest, linear)")
    if ctx.attr("antialias", 0):
        raise ctx.error("antialias=1 is not supported")
    if ctx.attr("keep_aspect_ratio_policy", "stretch") != "stretch":
        raise ctx.error(f"keep_aspect_ratio_policy={ctx.attr('keep_aspect_ratio_policy')!r} is not supported (stretch)")
    ctm = ctx.attr("coordinate_transformation_mode", "half_pixel")
    if ctm == "tf_crop_and_resize":
        raise ctx.error("coordinate_transformation_mode='tf_crop_and_resize' is not supported")
    if mode == "linear":
        require_float(ctx, x)
    axes = norm_axes(ctx, ctx.attr("axes", list(range(x.ndim))), x.ndim)
    scale_v = static(ctx, scales, "scales").astype(np.float64).reshape(-1) if scales is not None else np.zeros(0)
    size_v = ints(ctx, sizes, "sizes") if sizes is not None else []
    if scale_v.size and size_v:
        raise ctx.error("only one of scales and sizes may be given")
    if scale_v.size:
        if scale_v.size != len(axes) or (scale_v <= 0).any():
            raise ctx.error(f"scales {scale_v.tolist()} do not match {len(axes)} axes")
        scale_list = scale_v.astype(np.float32).astype(np.float64).tolist()
        outs = [int(math.floor(x.shape[a] * s)) for a, s in zip(axes, scale_list)]
    elif size_v:
        if len(size_v) != len(axes):
            raise ctx.error(f"sizes {size_v} do not match {len(axes)} axes")
        outs = size_v
        scale_list = [o / x.shape[a] for a, o in zip(axes, outs)]
    else:
        raise ctx.error("one of scales and sizes must be given")
    rule = ctx.attr("nearest_mode", "round_prefer_floor")
    for a, out, scale in zip(axes, outs, scale_list):
        size = x.shape[a]
        if out == size and scale == 1.0:
            continue
        coords = _resize_coords(ctx, ctm, size, out, scale)
        if mode == "nearest":
            idx = _nearest(ctx, rule, coords, size)
            if out % size == 0 and np.array_equal(idx, np.arange(out) // (out // size)):
                k = out // size  # plain repeat: an expand, no gather
                shape = x.shape
                x = x.reshape(shape[:a + 1] + (1,) + shape[a + 1:]).expand(shape[:a + 1] + (k,) + shape[a + 1:])
                x = x.reshape(shape[:a] + (out,) + shape[a + 1:])
            else:
                mask = ctx.lift(("rmask", a), idx[:, None] == np.arange(size))
                x = _gather_where(x, mask, a, 1)
        else:
            c = np.clip(coords, 0, size - 1)
            i0 = np.minimum(np.floor(c).astype(np.int64), size - 1)
            i1 = np.minimum(i0 + 1, size - 1)
            w1 = c - i0
            w0 = 1 - w1
            same = i0 == i1
            w0, w1 = np.where(same, 0.5, w0), np.where(same, 0.5, w1)
            matrix = np.zeros((out, size), np.float64)
            np.add.at(matrix, (np.arange(out), i0), w0)
            np.add.at(matrix, (np.arange(out), i1), w1)
            m = ctx.lift(("rmat", a), np.ascontiguousarray(matrix.T.astype(x.dtype.np)).reshape(1, size, out))
            order = [i for i in range(x.ndim) if i != a] + [a]
            moved = x.permute(tuple(order))
            y = moved.reshape(1, -1, size).matmul(m).reshape(moved.shape[:-1] + (out,))
            back = [0] * x.ndim
            for pos, src in enumerate(order):
                back[src] = pos
            x = y.permute(tuple(back))
    return x


# ---- generators ----------------------------------------------------------------------------

def op_shape(ctx: Any, x: Value) -> np.ndarray:
    shape = np.array(x.shape, dtype=np.int64)
    start, end = ctx.attr("start", 0), ctx.attr("end", None)
    return shape[start:end] if ctx.opset >= 15 else shape


def op_size(ctx: Any, x: Value) -> np.ndarray:
    return np.array(math.prod(x.shape), dtype=np.int64)


def op_constant_of_shape(ctx: Any, shape: Value) -> np.ndarray:
    dims = ints(ctx, shape, "input")
    value = ctx.attr("value", np.zeros(1, np.float32))
    return np.full(dims, value.reshape(-1)[0], dtype=value.dtype)


def op_range(ctx: Any, start: Value, limit: Value, delta: Value) -> np.ndarray:
    s, l, d = (static(ctx, v, n) for v, n in ((start, "start"), (limit, "limit"), (delta, "delta")))
    count = max(int(math.ceil((l.item() - s.item()) / d.item())), 0)
    return (s.item() + np.arange(count) * d.item()).astype(s.dtype)


def op_constant(ctx: Any) -> np.ndarray:
    for name in ("value", "value_float", "value_floats", "value_int", "value_ints"):
        if ctx.has_attr(name):
            v = ctx.attr(name)
            if name == "value":
                return v
            return np.array(v, dtype=np.float32 if "float" in name else np.int64)
    raise ctx.error("only value, value_float(s) and value_int(s) are supported")


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


def _fold_slice(ctx: Any, x: np.ndarray, starts: Any, ends: Any, axes: Any = None, steps: Any = None) -> np.ndarray:
    plan = slice_plan(ctx, x.shape, starts, ends, axes, steps)
    return x[tuple(slice(s, s + p * c, p) if p > 0 else (slice(s, s + p * c if s + p * c >= 0 else None, p))
                   for s, p, c in plan)]


def _fold_concat(ctx: Any, *xs: np.ndarray) -> np.ndarray:
    return np.concatenate(xs, axis=ctx.attr("axis"))


def _fold_cast(ctx: Any, x: np.ndarray) -> np.ndarray:
    from tinydist.onnx.model import np_dtype_of
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


# ---- the table -----------------------------------------------------------------------------

class OpSpec:
    __slots__ = ("fn", "params", "attrs", "min_inputs")

    def __init__(self, fn: Callable[..., Any], params: Sequence[int] = (), attrs: Sequence[str] = (), min_inputs: int = 1):
        self.fn, self.params, self.attrs, self.min_inputs = fn, frozenset(params), frozenset(attrs), min_inputs


def _u(fn: Callable[[Tensor], Tensor]) -> Callable[..., Tensor]:
    return lambda ctx, x: fn(x)


def _uf(fn: Callable[[Tensor], Tensor]) -> Callable[..., Tensor]:
    def handler(ctx: Any, x: Tensor) -> Tensor:
        require_float(ctx, x)
        return fn(x)
    return handler


def _b(fn: Callable[[Tensor, Tensor], Tensor]) -> Callable[..., Tensor]:
    return lambda ctx, a, b: fn(a, b)


_POOL = ("auto_pad", "ceil_mode", "kernel_shape", "pads", "strides")
_REDUCE = ("keepdims", "noop_with_empty_axes", "axes")

OPS: dict[str, OpSpec] = {
    "Add": OpSpec(_b(lambda a, b: a + b), min_inputs=2), "Sub": OpSpec(_b(lambda a, b: a - b), min_inputs=2),
    "Mul": OpSpec(_b(lambda a, b: a * b), min_inputs=2), "Div": OpSpec(op_div, min_inputs=2),
    "Pow": OpSpec(op_pow, params=(1,), min_inputs=2),
    "Neg": OpSpec(_u(lambda x: x.neg())), "Abs": OpSpec(_u(lambda x: x.abs())),
    "Sqrt": OpSpec(_uf(lambda x: x.sqrt())), "Exp": OpSpec(_uf(lambda x: x.exp())), "Log": OpSpec(_uf(lambda x: x.log())),
    "Reciprocal": OpSpec(_uf(lambda x: x.reciprocal())), "Floor": OpSpec(_uf(lambda x: x.floor())),
    "Relu": OpSpec(_u(lambda x: x.maximum(scalar_like(x, 0)))),
    "LeakyRelu": OpSpec(op_leaky_relu, attrs=("alpha",)), "Elu": OpSpec(op_elu, attrs=("alpha",)),
    "Sigmoid": OpSpec(_uf(lambda x: x.sigmoid())), "HardSigmoid": OpSpec(op_hard_sigmoid, attrs=("alpha", "beta")),
    "HardSwish": OpSpec(op_hard_swish), "Tanh": OpSpec(_uf(tanh)), "Softplus": OpSpec(op_softplus),
    "Gelu": OpSpec(op_gelu, attrs=("approximate",)), "Erf": OpSpec(_uf(erf)),
    "Sin": OpSpec(_uf(lambda x: x.sin())), "Cos": OpSpec(_uf(lambda x: x.cos())),
    "Clip": OpSpec(op_clip, params=(1, 2)),
    "Min": OpSpec(_variadic(Tensor.minimum)), "Max": OpSpec(_variadic(Tensor.maximum)),
    "Sum": OpSpec(_variadic(lambda a, b: a + b)), "Mean": OpSpec(op_mean),
    "Where": OpSpec(lambda ctx, c, a, b: td.where(c, a, b), min_inputs=3),
    "Equal": OpSpec(_b(lambda a, b: a == b), min_inputs=2), "Less": OpSpec(_b(lambda a, b: a < b), min_inputs=2),
    "Greater": OpSpec(_b(lambda a, b: a > b), min_inputs=2),
    "LessOrEqual": OpSpec(_b(lambda a, b: a <= b), min_inputs=2), "GreaterOrEqual": OpSpec(_b(lambda a, b: a >= b), min_inputs=2),
    "Not": OpSpec(_u(lambda x: x.logical_not())), "And": OpSpec(_b(lambda a, b: a & b), min_inputs=2),
    "Or": OpSpec(_b(lambda a, b: a | b), min_inputs=2), "Xor": OpSpec(_b(lambda a, b: a ^ b), min_inputs=2),
    "Cast": OpSpec(op_cast, attrs=("to", "saturate")), "CastLike": OpSpec(op_cast_like, params=(1,), attrs=("saturate",), min_inputs=2),
    "Identity": OpSpec(op_identity),
    "Dropout": OpSpec(op_dropout, params=(1, 2), attrs=("ratio", "seed", "is_test")),
    "MatMul": OpSpec(op_matmul, params=(1,), min_inputs=2),
    "Gemm": OpSpec(op_gemm, params=(1, 2), attrs=("alpha", "beta", "transA", "transB"), min_inputs=2),
    "Conv": OpSpec(op_conv, params=(1, 2), attrs=("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"), min_inputs=2),
    "ConvTranspose": OpSpec(op_conv_transpose, params=(1, 2), attrs=("auto_pad", "dilations", "group", "kernel_shape", "output_padding",
                                                                      "output_shape", "pads", "strides"), min_inputs=2),
    "MaxPool": OpSpec(op_max_pool, attrs=_POOL + ("dilations", "storage_order")),
    "AveragePool": OpSpec(op_average_pool, attrs=_POOL + ("count_include_pad", "dilations")),
    "GlobalAveragePool": OpSpec(op_global_average_pool), "GlobalMaxPool": OpSpec(op_global_max_pool),
    "BatchNormalization": OpSpec(op_batch_norm, params=(1, 2, 3, 4), attrs=("epsilon", "momentum", "training_mode"), min_inputs=5),
    "LayerNormalization": OpSpec(op_layer_norm, attrs=("axis", "epsilon", "stash_type"), min_inputs=2),
    "Softmax": OpSpec(lambda ctx, x: _softmax_like(ctx, x, False), attrs=("axis",)),
    "LogSoftmax": OpSpec(lambda ctx, x: _softmax_like(ctx, x, True), attrs=("axis",)),
    "ReduceSum": OpSpec(_reduce("sum", 13), params=(1,), attrs=_REDUCE),
    "ReduceMean": OpSpec(_reduce("mean", 18), params=(1,), attrs=_REDUCE),
    "ReduceMax": OpSpec(_reduce("max", 18), params=(1,), attrs=_REDUCE),
    "ReduceMin": OpSpec(_reduce("min", 18), params=(1,), attrs=_REDUCE),
    "ReduceProd": OpSpec(_reduce("prod", 18), params=(1,), attrs=_REDUCE),
    "ReduceSumSquare": OpSpec(_reduce("sumsquare", 18), params=(1,), attrs=_REDUCE),
    "ReduceL1": OpSpec(_reduce("l1", 18), params=(1,), attrs=_REDUCE),
    "ReduceL2": OpSpec(_reduce("l2", 18), params=(1,), attrs=_REDUCE),
    "ReduceLogSumExp": OpSpec(_reduce("logsumexp", 18), params=(1,), attrs=_REDUCE),
    "ArgMax": OpSpec(_arg("max"), attrs=("axis", "keepdims", "select_last_index")),
    "ArgMin": OpSpec(_arg("min"), attrs=("axis", "keepdims", "select_last_index")),
    "Reshape": OpSpec(op_reshape, params=(1,), attrs=("allowzero",), min_inputs=2),
    "Flatten": OpSpec(op_flatten, attrs=("axis",)),
    "Transpose": OpSpec(op_transpose, attrs=("perm",)),
    "Squeeze": OpSpec(op_squeeze, params=(1,), attrs=("axes",)),
    "Unsqueeze": OpSpec(op_unsqueeze, params=(1,), attrs=("axes",)),
    "Concat": OpSpec(op_concat, attrs=("axis",)),
    "Split": OpSpec(op_split, params=(1,), attrs=("axis", "split", "num_outputs")),
    "Slice": OpSpec(op_slice, params=(1, 2, 3, 4), min_inputs=3),
    "Gather": OpSpec(op_gather, params=(0, 1), attrs=("axis",), min_inputs=2),
    "Expand": OpSpec(op_expand, params=(1,), min_inputs=2),
    "Tile": OpSpec(op_tile, params=(1,), min_inputs=2),
    "Pad": OpSpec(op_pad, params=(1, 2, 3), attrs=("mode",), min_inputs=2),
    "Resize": OpSpec(op_resize, params=(1, 2, 3), attrs=("antialias", "axes", "coordinate_transformation_mode", "cubic_coeff_a",
                                                         "exclude_outside", "extrapolation_value", "keep_aspect_ratio_policy",
                                                         "mode", "nearest_mode")),
    "Shape": OpSpec(op_shape, params=(0,), attrs=("start", "end")),
    "Size": OpSpec(op_size, params=(0,)),
    "ConstantOfShape": OpSpec(op_constant_of_shape, params=(0,), attrs=("value",)),
    "Range": OpSpec(op_range, params=(0, 1, 2), min_inputs=3),
    "Constant": OpSpec(op_constant, attrs=("value", "value_float", "value_floats", "value_int", "value_ints", "sparse_value",
                                           "value_string", "value_strings"), min_inputs=0),
}
