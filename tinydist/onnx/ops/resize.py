"""Resize (10, 11, 13, 18, 19) and Upsample (7, 9): per resized axis, nearest as an expand or a
one-hot gather, linear / cubic / antialiased as one matmul with a constant (out, size) weight matrix
built at load."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tinydist.frontend.tensor import Tensor
from tinydist.onnx.ops._common import Value, gather_where, ints, norm_axes, require_float, static


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
