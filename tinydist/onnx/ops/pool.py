"""Pooling: Max (with its indices), Average, Lp and the global pools over strided window views; MaxUnpool."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tinydist.frontend.tensor import Tensor
from tinydist.graph import dtypes
from tinydist.onnx.ops._common import Value, ints, lowest, pad_value, require_float, spatial_args


def _out_size(size: int, k: int, s: int, d: int, pad: tuple[int, int], ceil_mode: bool) -> int:
    span = size + pad[0] + pad[1] - ((k - 1) * d + 1)
    if not ceil_mode:
        return span // s + 1
    out = -(-span // s) + 1
    if (out - 1) * s >= size + pad[0]:  # the last window must start inside the input or left padding
        out -= 1
    return out


def _pool_setup(ctx: Any, x: Tensor, dilation_ok: bool) -> tuple[Tensor, list[int], list[int], list[int], list[tuple[int, int]], list[int], int]:
    nd = x.ndim - 2
    if nd not in (1, 2, 3):
        raise ctx.error(f"{nd}-D pooling is not supported (1-D, 2-D and 3-D only)")
    kernel = list(ctx.attr("kernel_shape"))
    if len(kernel) != nd:
        raise ctx.error(f"kernel_shape {kernel} does not match {nd} spatial axes")
    if not dilation_ok and ctx.has_attr("dilations"):
        raise ctx.error("dilations are not supported for this op and opset")
    strides, dilations, pairs = spatial_args(ctx, nd, x.shape[2:], kernel)
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
