"""Matmul and Gemm, convolution and pooling, normalisation, softmax and Resize."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from tinydist.codegen.matmul_packing import pack_b_array
from tinydist.frontend.functional import conv2d, matmul_prepacked, prepacked_matmul_applies
from tinydist.frontend.movement import cat, stack
from tinydist.frontend.tensor import Tensor
from tinydist.graph import dtypes
from tinydist.onnx.ops._common import (
    Value, as_tensor, gather_where, ints, lowest, norm_axes, norm_axis, pad_or_crop, require_float,
    scalar_like, shrink_axis, static,
)
from tinydist.onnx.ops.elementwise import round_half_even
from tinydist.runtime.registry import peer_group


# ---- matmul, gemm --------------------------------------------------------------------------------

def _times_weight(ctx: Any, a: Tensor, b: np.ndarray) -> Tensor:
    """a (…, M, K) @ a constant K×N weight. On a host device, where the native kernel runs, B is
    packed once here, at load, into the layout the kernel reads (not again on every call:
    packing cost the product ~1/M of its multiply-adds, all of it at small M). Otherwise B is
    uploaded as (1, K, N), so the kernel reads it in place."""
    k, n = b.shape
    if (peer_group(a.device) == "host" and a.dtype == dtypes.to_dtype(b.dtype) and not a.requires_grad
            and prepacked_matmul_applies(math.prod(a.shape[:-1]), k, n, a.dtype)):
        return matmul_prepacked(a, ctx.lift_made("B packed", lambda: pack_b_array(np.ascontiguousarray(b))), k, n)
    b3 = ctx.lift("B3", np.ascontiguousarray(b.reshape((1,) + b.shape)))
    return a.matmul(b3).reshape(a.shape[:-1] + (n,))


def op_matmul(ctx: Any, a: Tensor, b: Value) -> Tensor:
    if isinstance(b, np.ndarray) and b.ndim == 2 and a.ndim >= 2 and a.dtype.is_float:
        return _times_weight(ctx, a, b)
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
        y = _times_weight(ctx, a, b.T if ctx.attr("transB", 0) else b)
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


def _conv3d(x: Tensor, w: Tensor, strides: Sequence[int], dilations: Sequence[int], groups: int) -> Tensor:
    """A 3-D convolution of an already padded x as a sum over the kernel's depth of 2-D ones: tap
    kd reads the depth slices kd·d, kd·d + s, …, folded into the batch, with w[:, :, kd]."""
    n, c, depth = x.shape[:3]
    oc, kd_size = w.shape[0], w.shape[2]
    (sd, *s2), (dd, *d2) = strides, dilations
    out_d = (depth - (kd_size - 1) * dd - 1) // sd + 1
    total: Tensor | None = None
    for kd in range(kd_size):
        start = kd * dd
        part = x[:, :, start:start + (out_d - 1) * sd + 1:sd]                     # (N, C, D', H, W)
        flat = part.permute(0, 2, 1, 3, 4).reshape(n * out_d, c, part.shape[3], part.shape[4])
        y = conv2d(flat, w[:, :, kd], None, tuple(s2), 0, tuple(d2), groups)
        total = y if total is None else total + y
    assert total is not None
    return total.reshape(n, out_d, oc, total.shape[2], total.shape[3]).permute(0, 2, 1, 3, 4)


def op_conv(ctx: Any, x: Tensor, w: Value, b: Value = None) -> Tensor:
    nd = x.ndim - 2
    if nd not in (1, 2, 3):
        raise ctx.error(f"{nd}-D convolution is not supported (1-D, 2-D and 3-D only)")
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
    if nd == 3:
        out = _conv3d(x, as_tensor(ctx, w, "W"), strides, dilations, groups)
    else:
        out = conv2d(x, as_tensor(ctx, w, "W"), None, tuple(strides), 0, tuple(dilations), groups)
    if b is not None:
        out = out + as_tensor(ctx, b, "bias").reshape((1, oc) + (1,) * (out.ndim - 2))
    return out.reshape(out.shape[:2] + out.shape[3:]) if nd == 1 else out


def op_conv_transpose(ctx: Any, x: Tensor, w: Value, b: Value = None) -> Tensor:
    nd = x.ndim - 2
    if nd not in (1, 2, 3):
        raise ctx.error(f"{nd}-D ConvTranspose is not supported (1-D, 2-D and 3-D only)")
    require_float(ctx, x)
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
        # a negative total (output_shape past the full output) is a negative crop: zeros appended at the end
        totals = [f - t for f, t in zip(full, target)]
        upper = auto_pad == "SAME_UPPER"
        pairs = [(t // 2, t - t // 2) if upper else (t - t // 2, t // 2) for t in totals]
    elif auto_pad in ("NOTSET", "VALID"):
        pads = list(ctx.attr("pads", [0] * (2 * nd))) if auto_pad == "NOTSET" else [0] * (2 * nd)
        pairs = [(pads[i], pads[i + nd]) for i in range(nd)]
    else:
        raise ctx.error(f"auto_pad={auto_pad!r} is not supported")
    # ConvTranspose = zero-stuffed input, padded by d(k-1) - pad, convolved with the flipped kernel
    regroup = ((groups, cin // groups, ocg) + tuple(kernel), (oc, cin // groups) + tuple(kernel))
    if isinstance(w, np.ndarray):  # constant: flipped and regrouped once, at load
        wflip = w[(slice(None), slice(None)) + (slice(None, None, -1),) * nd]
        wconv: Value = wflip.reshape(regroup[0]).swapaxes(1, 2).reshape(regroup[1])
    else:  # run-time weights: the flip is a negative-stride view, the regroup a permute
        wconv = _flip_spatial(w, nd).reshape(regroup[0]).permute((0, 2, 1) + tuple(range(3, 3 + nd))).reshape(regroup[1])
    if nd == 1:
        x = _to_2d(x)
        wconv = wconv.reshape(wconv.shape[:2] + (1,) + wconv.shape[2:])
        kernel, strides, dilations, out_pad, pairs = [1] + kernel, [1] + strides, [1] + dilations, [0] + out_pad, [(0, 0)] + pairs
    if any(st != 1 for st in strides):  # zero-stuff: s - 1 zeros after each input element of every axis
        n, c, *sizes = x.shape
        x = x.reshape([n, c] + [v for size in sizes for v in (size, 1)])
        x = x.pad([(0, 0), (0, 0)] + [p for st in strides for p in ((0, 0), (0, st - 1))])
        x = x.reshape([n, c] + [size * st for size, st in zip(sizes, strides)])
        x = x.shrink([(0, n), (0, c)] + [(0, (size - 1) * st + 1) for size, st in zip(sizes, strides)])
    edge = [(d * (k - 1) - pb, d * (k - 1) - pe + op) for d, k, (pb, pe), op in zip(dilations, kernel, pairs, out_pad)]
    x = pad_or_crop(x, [(0, 0), (0, 0)] + edge)
    if len(kernel) == 3:
        out = _conv3d(x, as_tensor(ctx, wconv, "W"), [1, 1, 1], dilations, groups)
    else:
        out = conv2d(x, as_tensor(ctx, wconv, "W"), None, 1, 0, tuple(dilations), groups)
    if b is not None:
        out = out + as_tensor(ctx, b, "bias").reshape((1, oc) + (1,) * (out.ndim - 2))
    return out.reshape(out.shape[:2] + out.shape[3:]) if nd == 1 else out


def op_causal_conv_with_state(ctx: Any, x: Tensor, w: Value, b: Value = None, past: Value = None) -> tuple[Tensor, Tensor]:
    """Depthwise causal 1-D conv (27): [past_state or zeros | input] convolved per channel with a
    kernel of k, optional SiLU; present_state = the last k - 1 steps of that concatenation."""
    require_float(ctx, x)
    if x.ndim != 3 or w.ndim != 3 or w.shape[1] != 1 or w.shape[0] != x.shape[1]:
        raise ctx.error(f"input (N, C, L) {x.shape} and weight (C, 1, k) {w.shape} do not match")
    activation = ctx.attr("activation", "none")
    if activation not in ("none", "silu", "swish"):
        raise ctx.error(f"activation={activation!r} is not supported (none, silu, swish)")
    n, c, _ = x.shape
    k = w.shape[2]
    state = as_tensor(ctx, past, "past_state") if past is not None else Tensor.zeros((n, c, k - 1), dtype=x.dtype, device=x.device)
    padded = cat([state, x], 2) if k > 1 else x
    out = conv2d(_to_2d(padded), as_tensor(ctx, w, "W").reshape(c, 1, 1, k), None, 1, 0, 1, c)
    out = out.reshape(out.shape[:2] + out.shape[3:])
    if b is not None:
        out = out + as_tensor(ctx, b, "bias").reshape(1, c, 1)
    if activation != "none":
        out = out * out.sigmoid()
    length = padded.shape[2]
    present = padded[:, :, length - (k - 1):] if k > 1 else Tensor.zeros((n, c, 0), dtype=x.dtype, device=x.device)
    return out, present


def _flip_spatial(w: Tensor, nd: int) -> Tensor:
    """w reversed along its last `nd` axes (a strided view with negative strides)."""
    strides, acc = [], 1
    for size in reversed(w.shape):
        strides.append(acc)
        acc *= size
    strides.reverse()
    offset = sum((size - 1) * st for size, st in zip(w.shape[2:], strides[2:]))
    return w._as_strided(w.shape, tuple(strides[:2]) + tuple(-st for st in strides[2:]), offset)


def _pool_setup(ctx: Any, x: Tensor, dilation_ok: bool) -> tuple[Tensor, list[int], list[int], list[int], list[tuple[int, int]], list[int], int]:
    nd = x.ndim - 2
    if nd not in (1, 2, 3):
        raise ctx.error(f"{nd}-D pooling is not supported (1-D, 2-D and 3-D only)")
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


def _pool_windows(x: Tensor, kernel: list[int], strides: list[int], dilations: list[int], pairs: list[tuple[int, int]],
                  outs: list[int], value: Any) -> tuple[Tensor, tuple[int, ...]]:
    """Every window of x padded with `value`, as one strided view, and its window axes.

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
    shape = list(dims[:2]) + list(outs) + list(kernel)
    view_strides = contiguous[:2] + [st * s for st, s in zip(contiguous[2:], strides)] + \
        [st * d for st, d in zip(contiguous[2:], dilations)]
    keep = [i for i, size in enumerate(shape) if size != 1]
    window = padded._as_strided(tuple(shape[i] for i in keep), tuple(view_strides[i] for i in keep))
    return window, tuple(keep.index(i) for i in range(2 + len(outs), len(shape)) if i in keep)


def _pool_reduce(x: Tensor, kernel: list[int], strides: list[int], dilations: list[int], pairs: list[tuple[int, int]],
                 outs: list[int], value: Any, op: str) -> Tensor:
    """Reduce (max/sum) every window of x padded with `value` → (N, C, *outs)."""
    window, axes = _pool_windows(x, kernel, strides, dilations, pairs, outs, value)
    if axes:
        window = window.max(axes) if op == "max" else window.sum(axes)
    return window.reshape(tuple(list(x.shape[:2]) + list(outs)))


def _max_pool_indices(ctx: Any, x: Tensor, y: Tensor, kernel: list[int], strides: list[int], dilations: list[int],
                      pairs: list[tuple[int, int]], outs: list[int]) -> Tensor:
    """MaxPool's Indices: the flat index into x (batch and channel included, as onnxruntime;
    spatial axes row-major, or column-major under storage_order=1) of each window's first maximum — the smallest such index, since a window is
    scanned in the index order; padding never wins (its index is past every real one)."""
    n_total = math.prod(x.shape)
    index = ctx.lift(("indices", x.shape), np.arange(n_total, dtype=np.int64).reshape(x.shape))
    values, axes = _pool_windows(x, kernel, strides, dilations, pairs, outs, lowest(x.dtype))
    indices, _ = _pool_windows(index, kernel, strides, dilations, pairs, outs, n_total)
    out_shape = tuple(list(x.shape[:2]) + list(outs))
    if axes:
        best = y.reshape(tuple(1 if i in axes else s for i, s in enumerate(values.shape)))
        found = (values == best).where(indices, n_total).min(axes).reshape(out_shape)
    else:
        found = indices.reshape(out_shape)
    if not ctx.attr("storage_order", 0):
        return found
    # column-major spatial order (storage_order=1): the first spatial axis varies fastest
    sizes = x.shape[2:]
    step = math.prod(sizes)
    column, rest, below = (found // step) * step, found % step, 1
    for axis, size in enumerate(sizes):
        after = math.prod(sizes[axis + 1:])
        column = column + (rest // after) % size * below
        below *= size
    return column


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
    x, kernel, strides, dilations, pairs, outs, nd = _pool_setup(ctx, x, True)
    y = _pool_reduce(x, kernel, strides, dilations, pairs, outs, lowest(x.dtype), "max")
    if ctx.n_outputs == 1 or not ctx.outputs_used[1]:
        return (y, None) if ctx.n_outputs > 1 else y
    return y, _max_pool_indices(ctx, x, y, kernel, strides, dilations, pairs, outs)


def op_lp_pool(ctx: Any, x: Tensor) -> Tensor:
    """(Σ |x|^p over the window, zero padding)^(1/p); p=2 as x·x and sqrt (the exact path)."""
    require_float(ctx, x)
    p = ctx.attr("p", 2)
    if p <= 0:
        raise ctx.error(f"p={p} must be positive")
    x, kernel, strides, dilations, pairs, outs, nd = _pool_setup(ctx, x, ctx.since >= 18)
    powered = x * x if p == 2 else x.abs().pow(float(p))
    total = _pool_reduce(powered, kernel, strides, dilations, pairs, outs, 0, "sum")
    return total.sqrt() if p == 2 else total.pow(1.0 / p)


def op_average_pool(ctx: Any, x: Tensor) -> Tensor:
    require_float(ctx, x)
    x, kernel, strides, dilations, pairs, outs, nd = _pool_setup(ctx, x, ctx.since >= 19)
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


def _softmax_like(ctx: Any, x: Tensor, log: bool) -> Tensor:
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



# ---- resize --------------------------------------------------------------------------------

def _resize_coords(ctx: Any, mode: str, size: int, out: int, scale: float) -> np.ndarray:
    i = np.arange(out, dtype=np.float64)
    if mode == "half_pixel":
        return (i + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return (i + 0.5) / scale - 0.5 if out > 1 else np.zeros(out)
    if mode == "align_corners":  # over the output length, as onnxruntime (onnx's reference: size·scale unrounded)
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


def op_upsample(ctx: Any, x: Tensor, scales: Value = None) -> Tensor:
    """Upsample 7 (scales attribute) and 9 (scales input): Resize 10's semantics."""
    if ctx.since < 9:
        scales = np.array(ctx.attr("scales"), np.float32)
    elif scales is None:
        raise ctx.error("the scales input is required")
    return _resize(ctx, x, scales, None, legacy=True)


def op_resize(ctx: Any, x: Tensor, roi: Value = None, scales: Value = None, sizes: Value = None) -> Tensor:
    if ctx.since < 11:  # version 10: inputs (X, scales)
        return _resize(ctx, x, roi, None, legacy=True)
    return _resize(ctx, x, scales, sizes, legacy=False, roi=roi)


def _resize(ctx: Any, x: Tensor, scales: Value, sizes: Value, legacy: bool, roi: Value = None) -> Tensor:
    """Resize. `legacy` (Resize 10, Upsample): asymmetric coordinates, and nearest as onnxruntime's
    rule for those versions: the floor when an axis grows, the ceiling when it shrinks."""
    mode = ctx.attr("mode", "nearest")
    if mode not in ("nearest", "linear", "cubic"):
        raise ctx.error(f"mode={mode!r} is not supported (nearest, linear, cubic)")
    antialias = bool(ctx.attr("antialias", 0)) and mode != "nearest"
    policy = ctx.attr("keep_aspect_ratio_policy", "stretch")
    if policy not in ("stretch", "not_larger", "not_smaller"):
        raise ctx.error(f"keep_aspect_ratio_policy={policy!r} is not supported (stretch, not_larger, not_smaller)")
    ctm = "asymmetric" if legacy else ctx.attr("coordinate_transformation_mode", "half_pixel")
    if mode != "nearest":
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
        if policy == "stretch":
            outs = size_v
            scale_list = [o / x.shape[a] for a, o in zip(axes, outs)]
        else:  # one scale for every axis, the smallest (not_larger) or largest (not_smaller); sizes rounded half up
            ratios = [o / x.shape[a] for a, o in zip(axes, size_v)]
            common = min(ratios) if policy == "not_larger" else max(ratios)
            outs = [int(common * x.shape[a] + 0.5) for a in axes]
            scale_list = [common] * len(axes)
    else:
        raise ctx.error("one of scales and sizes must be given")
    rule = ctx.attr("nearest_mode", "round_prefer_floor")
    crop = None
    if ctm == "tf_crop_and_resize":
        crop = static(ctx, roi, "roi").astype(np.float64).reshape(-1) if roi is not None else np.zeros(0)
        if crop.size != 2 * len(axes):
            raise ctx.error(f"roi {crop.tolist()} must hold a start and an end for each of the {len(axes)} axes")
    for k, (a, out, scale) in enumerate(zip(axes, outs, scale_list)):
        size = x.shape[a]
        outside = None
        if crop is not None:  # sample the roi [start, end] (fractions of size - 1); outside it: extrapolation_value
            lo, hi = crop[k] * (size - 1), crop[k + len(axes)] * (size - 1)
            coords = lo + np.arange(out) * (hi - lo) / (out - 1) if out > 1 else np.full(out, (lo + hi) / 2)
            outside = (coords < 0) | (coords > size - 1)
        elif out == size and scale == 1.0:
            continue
        else:
            coords = _resize_coords(ctx, ctm, size, out, scale)
        if mode == "nearest":
            idx = _nearest(ctx, ("ceil" if scale < 1 else "floor") if legacy else rule, coords, size)
            if out % size == 0 and np.array_equal(idx, np.arange(out) // (out // size)):
                k = out // size  # plain repeat: an expand, no gather
                shape = x.shape
                x = x.reshape(shape[:a + 1] + (1,) + shape[a + 1:]).expand(shape[:a + 1] + (k,) + shape[a + 1:])
                x = x.reshape(shape[:a] + (out,) + shape[a + 1:])
            else:
                mask = ctx.lift(("rmask", a), idx[:, None] == np.arange(size))
                x = gather_where(x, mask, a, 1)
        elif mode == "cubic" or antialias:
            matrix = _kernel_matrix(mode, coords, size, scale, float(ctx.attr("cubic_coeff_a", -0.75)),
                                    bool(ctx.attr("exclude_outside", 0)), antialias)
            x = _apply_matrix(ctx, x, a, matrix)
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
            x = _apply_matrix(ctx, x, a, matrix)
        if outside is not None and outside.any():
            mask = ctx.lift(("outside", a), outside.reshape(tuple(out if i == a else 1 for i in range(x.ndim))))
            x = mask.where(Tensor.full((), float(ctx.attr("extrapolation_value", 0.0)), x.dtype, x.device), x)
    return x


def _apply_matrix(ctx: Any, x: Tensor, a: int, matrix: np.ndarray) -> Tensor:
    """y[..., i, ...] = Σ_j matrix[i, j] · x[..., j, ...] along axis a (one matmul)."""
    out, size = matrix.shape
    m = ctx.lift(("rmat", a), np.ascontiguousarray(matrix.T.astype(x.dtype.np)).reshape(1, size, out))
    order = [i for i in range(x.ndim) if i != a] + [a]
    moved = x.permute(tuple(order))
    y = moved.reshape(1, -1, size).matmul(m).reshape(moved.shape[:-1] + (out,))
    back = [0] * x.ndim
    for pos, src in enumerate(order):
        back[src] = pos
    return y.permute(tuple(back))


def _kernel_matrix(mode: str, coords: np.ndarray, size: int, scale: float, a: float, exclude_outside: bool,
                   antialias: bool) -> np.ndarray:
    """(out, size) interpolation weights, as onnx's reference: the cubic kernel with coefficient `a`
    over the 4 neighbours, or with antialias (downscaling) the linear / cubic kernel stretched by
    1/scale and normalised; neighbours past an edge read the edge (or, with exclude_outside, drop
    out and the rest is renormalised)."""
    s = min(scale, 1.0) if antialias else 1.0
    reach = 2 if mode == "cubic" else 1
    start = int(np.floor(-reach / s) + 1) if antialias else (-1 if mode == "cubic" else 0)
    offsets = np.arange(start, 2 - start if antialias or mode == "cubic" else 2)
    matrix = np.zeros((len(coords), size), np.float64)
    for i, x in enumerate(coords):
        base = int(np.ceil(x)) - 1          # the left neighbour: ratio in (0, 1]
        ratio = x - base
        d = np.abs(s * (offsets - ratio))
        if mode == "cubic":
            w = np.where(d <= 1, ((a + 2) * d - (a + 3)) * d * d + 1,
                         np.where(d < 2, ((a * d - 5 * a) * d + 8 * a) * d - 4 * a, 0.0))
        else:
            w = np.clip(1 - d, 0, 1)
        idx = base + offsets
        if exclude_outside:
            w = np.where((idx < 0) | (idx >= size), 0.0, w)
        if antialias or exclude_outside:
            w = w / w.sum()
        np.add.at(matrix[i], np.clip(idx, 0, size - 1), w)
    return matrix


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


# ---- DFT --------------------------------------------------------------------------------------

def _dft_matrix(n_in: int, length: int, inverse: bool, onesided: bool) -> np.ndarray:
    """The transform as a real (2·n_in, 2·n_out) matrix on [re | im] (irfft: (2·n_in, n_out)),
    found by transforming each basis vector with numpy's FFT once, at load (it is linear)."""
    rows = []
    for part in (1.0, 1j):
        for j in range(n_in):
            e = np.zeros(n_in, np.complex128)
            e[j] = part
            if inverse and onesided:
                rows.append(np.fft.irfft(e, n=length))
                continue
            r = np.fft.ifft(e, n=length) if inverse else np.fft.fft(e, n=length)
            if onesided:
                r = r[:length // 2 + 1]
            rows.append(np.concatenate([r.real, r.imag]))
    return np.array(rows)


def op_dft(ctx: Any, x: Tensor, dft_length: Value = None, axis_in: Value = None) -> Tensor:
    """DFT 17 (axis attribute, default 1) and 20 (axis input, default -2): real (…, 1) or complex
    (…, 2) input along `axis`, as one matmul with a constant matrix (O(n²), no FFT)."""
    require_float(ctx, x)
    if x.ndim < 2 or x.shape[-1] not in (1, 2):
        raise ctx.error(f"input must end in a real (1) or complex (2) axis, got shape {x.shape}")
    if ctx.since >= 20:
        axis = ints(ctx, axis_in, "axis")[0] if axis_in is not None else -2
    else:
        axis = ctx.attr("axis", 1)
    axis = norm_axis(ctx, axis, x.ndim)
    if axis == x.ndim - 1:
        raise ctx.error("axis must not be the last (real / imaginary) axis")
    inverse, onesided = bool(ctx.attr("inverse", 0)), bool(ctx.attr("onesided", 0))
    n_in = x.shape[axis]
    length = ints(ctx, dft_length, "dft_length")[0] if dft_length is not None else (
        2 * (n_in - 1) if inverse and onesided else n_in)
    if length <= 0:
        raise ctx.error(f"dft_length {length} must be positive")
    order = [i for i in range(x.ndim - 1) if i != axis] + [axis, x.ndim - 1]
    moved = x.permute(tuple(order))                                    # (…, n_in, 1|2)
    lead = moved.shape[:-2]
    parts = moved.permute(tuple(range(len(lead))) + (len(lead) + 1, len(lead)))   # (…, 1|2, n_in)
    if x.shape[-1] == 1:
        parts = cat([parts, Tensor.zeros(parts.shape, dtype=x.dtype, device=x.device)], -2)
    matrix = _dft_matrix(n_in, length, inverse, onesided)
    m = ctx.lift(("dft", n_in, length, inverse, onesided), np.ascontiguousarray(matrix.astype(x.dtype.np)).reshape((1,) + matrix.shape))
    y = parts.reshape(1, -1, 2 * n_in).matmul(m)
    out_n = matrix.shape[1] if inverse and onesided else matrix.shape[1] // 2
    comps = 1 if inverse and onesided else 2
    y = y.reshape(lead + (comps, out_n)).permute(tuple(range(len(lead))) + (len(lead) + 1, len(lead)))  # (…, n_out, c)
    back = [0] * x.ndim
    for pos, src in enumerate(order):
        back[src] = pos
    return y.permute(tuple(back))


def op_affine_grid(ctx: Any, theta: Tensor, size: Value) -> Tensor:
    """AffineGrid (20): the sampling grid theta · (x, y[, z], 1) over normalised output coordinates
    in [-1, 1] (pixel centres, or corners under align_corners), as one batched matmul with a
    constant (H·W, 3) or (D·H·W, 4) base grid."""
    dims = ints(ctx, size, "size")
    spatial = dims[2:]
    if len(spatial) not in (2, 3) or theta.shape[1:] != (len(spatial), len(spatial) + 1):
        raise ctx.error(f"size {dims} and theta of shape {theta.shape} do not describe a 2-D or 3-D grid")
    align = bool(ctx.attr("align_corners", 0))

    def axis(n: int) -> np.ndarray:
        if align:
            return np.linspace(-1.0, 1.0, n) if n > 1 else np.zeros(1)
        return (2.0 * np.arange(n) + 1.0) / n - 1.0

    coords = np.meshgrid(*[axis(n) for n in spatial], indexing="ij")  # (D,) H, W
    base = np.stack([c.reshape(-1) for c in reversed(coords)] + [np.ones(math.prod(spatial))], axis=1)
    grid = ctx.lift(("grid", tuple(dims), align), base.astype(theta.dtype.np).reshape((1,) + base.shape))
    out = grid.matmul(theta.permute(0, 2, 1))  # (N, points, rank)
    return out.reshape((theta.shape[0],) + tuple(spatial) + (len(spatial),))


def _reflect(v: Tensor, low: float, high: float) -> Tensor:
    """Reflect coordinates by the near border until they lie in [low, high] (onnx's _gs_reflect)."""
    span = high - low
    if span <= 0:
        return v * 0.0 + low
    below, above = low - v, v - high
    out = v
    for dist, near, far, sign in ((below, low, high, 1.0), (above, high, low, -1.0)):
        folds = (dist / span).floor()
        rest = dist - folds * span
        even = (folds - (folds * 0.5).floor() * 2.0) == 0.0
        moved = even.where(rest * sign + near, far - rest * sign)
        out = (dist > 0.0).where(moved, out)
    return out


def _cubic_coeffs(t: Tensor) -> list[Tensor]:
    a = -0.75
    x0, x1, x2, x3 = t + 1.0, t, 1.0 - t, 2.0 - t
    return [((x0 * a - 5 * a) * x0 + 8 * a) * x0 - 4 * a, ((x1 * (a + 2)) - (a + 3)) * x1 * x1 + 1.0,
            ((x2 * (a + 2)) - (a + 3)) * x2 * x2 + 1.0, ((x3 * a - 5 * a) * x3 + 8 * a) * x3 - 4 * a]


def op_grid_sample(ctx: Any, x: Tensor, grid: Tensor) -> Tensor:
    """GridSample (16, 20, 22) as onnx's reference: per spatial axis, the sampled coordinates'
    neighbours (1 nearest, 2 linear, 4 cubic) with their weights and padded pixel indices become
    an (N, points, size) weight matrix; the axes' matrices multiply into one (N, points, pixels)
    matrix, applied to x with one batched matmul. O(points × pixels): for the small images and
    grids of spatial transformers, not for resampling large images. Cubic with border padding
    clamps only its taps, not the coordinate, as onnxruntime and PyTorch (the reference clamps
    both; its node cases agree either way)."""
    require_float(ctx, x)
    spatial = x.shape[2:]
    nd = len(spatial)
    if grid.ndim != nd + 2 or grid.shape[-1] != nd or grid.shape[0] != x.shape[0]:
        raise ctx.error(f"grid of shape {grid.shape} does not match input of shape {x.shape}")
    raw_mode = ctx.attr("mode", "linear" if ctx.since >= 20 else "bilinear")
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(raw_mode, raw_mode)  # version 16's names
    padding = ctx.attr("padding_mode", "zeros")
    if mode not in ("nearest", "linear", "cubic") or padding not in ("zeros", "border", "reflection"):
        raise ctx.error(f"mode={mode!r} / padding_mode={padding!r} is not supported")
    align = bool(ctx.attr("align_corners", 0))
    n, out_spatial = x.shape[0], grid.shape[1:-1]
    points = math.prod(out_spatial)
    g = grid.reshape(n, points, nd).cast(x.dtype)
    total: Tensor | None = None
    for i, size in enumerate(spatial):
        coord = shrink_axis(g, 2, nd - 1 - i, nd - i)  # (N, P, 1): the grid lists x (width) first
        v = (coord + 1.0) * 0.5 * (size - 1) if align else ((coord + 1.0) * size - 1.0) * 0.5
        low, high = (0.0, size - 1.0) if align else (-0.5, size - 0.5)
        if mode == "nearest":
            v = round_half_even(v)
        outside = (v < low) | (v > high)
        if padding == "border" and mode != "cubic":  # cubic clamps its taps only (onnxruntime, PyTorch)
            v = outside.where(v.maximum(0.0).minimum(size - 1.0), v)
        elif padding == "reflection":
            v = outside.where(_reflect(v, low, high), v)
        base = v.floor()
        frac = v - base
        taps: list[tuple[Tensor, Tensor | None]]
        if mode == "nearest":
            taps = [(v, None)]
        elif mode == "linear":
            taps = [(base, 1.0 - frac), (base + 1.0, frac)]
        else:
            taps = list(zip([base - 1.0, base, base + 1.0, base + 2.0], _cubic_coeffs(frac)))
        pixels = ctx.lift(("pixels", size, x.dtype.name), np.arange(size, dtype=x.dtype.np).reshape(1, 1, size))
        weights: Tensor | None = None
        for j, w in taps:
            if padding == "border":
                j = j.maximum(0.0).minimum(size - 1.0)
            elif padding == "reflection":
                j = _reflect(j, low, high)
            j = j.cast(dtypes.int64).cast(x.dtype)  # the reference's int(): toward zero
            hit = j == pixels  # (N, P, size); out of range hits nothing: zero padding
            term = hit.cast(x.dtype) if w is None else hit.where(w, 0.0)
            weights = term if weights is None else weights + term
        assert weights is not None
        total = weights if total is None else (total.reshape(n, points, -1, 1) * weights.reshape(n, points, 1, size)).reshape(
            n, points, -1)
    assert total is not None
    y = x.reshape(n, x.shape[1], -1).matmul(total.permute(0, 2, 1))  # (N, C, P)
    return y.reshape((n, x.shape[1]) + tuple(out_spatial))


def op_col2im(ctx: Any, x: Tensor, image_shape: Value, block_shape: Value) -> Tensor:
    """Col2Im (18): the inverse of im2col — every column's block values added at their image
    positions (overlaps summed), as one matmul with a constant 0/1 (blocks·columns, pixels) matrix."""
    image, block = ints(ctx, image_shape, "image_shape"), ints(ctx, block_shape, "block_shape")
    nd = len(image)
    if len(block) != nd:
        raise ctx.error(f"image_shape {image} and block_shape {block} differ in rank")
    dilations = list(ctx.attr("dilations", [1] * nd))
    strides = list(ctx.attr("strides", [1] * nd))
    pads = list(ctx.attr("pads", [0] * (2 * nd)))
    counts = [(size + pads[i] + pads[i + nd] - (dilations[i] * (block[i] - 1) + 1)) // strides[i] + 1
              for i, size in enumerate(image)]
    k, n_cols = math.prod(block), math.prod(counts)
    if x.ndim != 3 or x.shape[1] % k or x.shape[2] != n_cols:
        raise ctx.error(f"input of shape {x.shape} does not hold C·{k} block values for {n_cols} columns")

    def matrix() -> np.ndarray:
        scatter = np.zeros((k * n_cols, math.prod(image)), x.dtype.np)
        for b, offsets in enumerate(np.ndindex(*block)):
            for c, column in enumerate(np.ndindex(*counts)):
                pos = [column[i] * strides[i] - pads[i] + offsets[i] * dilations[i] for i in range(nd)]
                if all(0 <= p < s for p, s in zip(pos, image)):
                    scatter[b * n_cols + c, np.ravel_multi_index(pos, image)] = 1
        return scatter.reshape((1,) + scatter.shape)

    scatter = ctx.lift(("col2im", tuple(image), tuple(block), tuple(x.shape)), matrix())
    channels = x.shape[1] // k
    y = x.reshape(x.shape[0], channels, k * n_cols).matmul(scatter)
    return y.reshape((x.shape[0], channels) + tuple(image))


def op_max_unpool(ctx: Any, x: Tensor, indices: Tensor, output_shape: Value = None) -> Tensor:
    """MaxUnpool (9, 11, 22): x's values at their (run-time) flat indices into the output, zeros
    elsewhere, as a one-hot select (O(input × output) elements), indices into the pooling's
    inverse shape ((in − 1)·stride − pads + kernel); a larger output_shape pads it with zeros
    after (the reference's placement)."""
    kernel = list(ctx.attr("kernel_shape"))
    nd = len(kernel)
    strides = list(ctx.attr("strides", [1] * nd))
    pads = list(ctx.attr("pads", [0] * (2 * nd)))
    inferred = tuple(x.shape[:2]) + tuple((size - 1) * strides[i] - pads[i] - pads[i + nd] + kernel[i]
                                          for i, size in enumerate(x.shape[2:]))
    total = math.prod(inferred)
    positions = ctx.lift(("positions", total), np.arange(total, dtype=np.int64).reshape(1, total))
    onehot = indices.cast(dtypes.int64).reshape(-1, 1) == positions  # (input elements, output elements)
    y = onehot.where(x.reshape(-1, 1), 0).sum(0, dtype=x.dtype).reshape(inferred)
    if output_shape is None:
        return y
    shape = ints(ctx, output_shape, "output_shape")
    if len(shape) != len(inferred) or any(s < i for s, i in zip(shape, inferred)):
        raise ctx.error(f"output_shape {shape} is smaller than the unpooled shape {inferred}")
    return pad_value(y, [(0, s - i) for s, i in zip(shape, inferred)], 0)  # the unpooled values at the origin


def op_det(ctx: Any, x: Tensor) -> Tensor:
    """Det over the last two axes by the Leibniz formula (n! products of n entries): exact
    arithmetic order for the small matrices it is for; n > 6 is refused."""
    require_float(ctx, x)
    n = x.shape[-1]
    if x.ndim < 2 or x.shape[-2] != n:
        raise ctx.error(f"input of shape {x.shape} is not a (batch of) square matrices")
    if n > 6:
        raise ctx.error(f"a {n}x{n} determinant is not supported (the Leibniz formula is used, up to 6x6)")
    import itertools

    rows = [shrink_axis(x, x.ndim - 2, i, i + 1).reshape(x.shape[:-2] + (n,)) for i in range(n)]
    entries = [[shrink_axis(row, row.ndim - 1, j, j + 1).reshape(x.shape[:-2]) for j in range(n)] for row in rows]
    total: Tensor | None = None
    for perm in itertools.permutations(range(n)):
        inversions = sum(perm[i] > perm[j] for i in range(n) for j in range(i + 1, n))
        term = entries[0][perm[0]]
        for i in range(1, n):
            term = term * entries[i][perm[i]]
        if total is None:
            total = term if inversions % 2 == 0 else term * -1.0
        else:
            total = total - term if inversions % 2 else total + term
    assert total is not None
    return total


def op_stft(ctx: Any, x: Tensor, frame_step: Value, window: Value = None, frame_length: Value = None) -> Tensor:
    """STFT (17): frames of frame_length every frame_step samples, times the window, each through
    the DFT matrix (onesided by default: n // 2 + 1 bins) → (batch, frames, bins, 2)."""
    require_float(ctx, x)
    if x.ndim != 3 or x.shape[-1] not in (1, 2):
        raise ctx.error(f"signal must be (batch, length, 1 or 2), got shape {x.shape}")
    step = ints(ctx, frame_step, "frame_step")[0]
    if frame_length is not None:
        n = ints(ctx, frame_length, "frame_length")[0]
    elif window is not None:
        n = window.shape[0]
    else:
        raise ctx.error("needs a window or a frame_length")
    onesided = bool(ctx.attr("onesided", 1))
    if x.shape[-1] == 2 and onesided:
        raise ctx.error("onesided=1 needs a real signal")
    length = x.shape[1]
    if step <= 0 or n <= 0 or n > length:
        raise ctx.error(f"frame_step {step} / frame_length {n} do not fit a signal of length {length}")
    count = (length - n) // step + 1
    frames = stack([shrink_axis(x, 1, f * step, f * step + n) for f in range(count)], 1)  # (B, F, n, c)
    if window is not None:
        w = as_tensor(ctx, window, "window").cast(x.dtype)
        frames = frames * w.reshape(1, 1, n, 1)
    parts = frames.permute(0, 1, 3, 2)  # (B, F, c, n)
    if x.shape[-1] == 1:
        parts = cat([parts, Tensor.zeros(parts.shape, dtype=x.dtype, device=x.device)], 2)
    matrix = _dft_matrix(n, n, False, onesided)
    m = ctx.lift(("stft", n, onesided), np.ascontiguousarray(matrix.astype(x.dtype.np)).reshape((1,) + matrix.shape))
    bins = matrix.shape[1] // 2
    y = parts.reshape(1, -1, 2 * n).matmul(m)  # (1, B·F, 2·bins): [re | im]
    return y.reshape(x.shape[0], count, 2, bins).permute(0, 1, 3, 2)
