"""Reductions, movement (Reshape … Pad, Gather, Slice) and generators (Shape, Range, Constant …)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tinydist.frontend.movement import cat
from tinydist.frontend.tensor import Tensor
from tinydist.graph import dtypes
from tinydist.onnx.ops._common import (
    Value, as_tensor, gather_where, highest, ints, lowest, norm_axes, norm_axis, pad_or_crop, pad_value, require_float,
    scalar_like, shrink_axis, static,
)


# ---- reductions -----------------------------------------------------------------------------

def _reduce(kind: str, axes_input_since: int) -> Callable[..., Tensor]:
    """Reduce* before `axes_input_since` (13 for ReduceSum, 18 for the others): an `axes` attribute;
    from then on an optional `axes` input and `noop_with_empty_axes`."""
    def handler(ctx: Any, x: Tensor, axes_in: Value = None) -> Tensor:
        keep = bool(ctx.attr("keepdims", 1))
        if ctx.since >= axes_input_since:
            axes = ints(ctx, axes_in, "axes") if axes_in is not None else []
        else:
            axes = list(ctx.attr("axes", []))
        if not axes:
            if ctx.attr("noop_with_empty_axes", 0):
                return x
            axes = list(range(x.ndim))
        axes = norm_axes(ctx, axes, x.ndim)
        if any(x.shape[a] == 0 for a in axes) and kind in ("max", "min", "logsumexp"):
            # an empty reduction has no element to compare: the identity (-inf / lowest, +inf / highest)
            shape = tuple(1 if i in axes else s for i, s in enumerate(x.shape)) if keep else \
                tuple(s for i, s in enumerate(x.shape) if i not in axes)
            if x.dtype.is_bool:
                fill: Any = kind == "min"
            else:
                fill = highest(x.dtype) if kind == "min" else lowest(x.dtype)
            return Tensor.full(shape, fill, x.dtype, x.device)
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
        if kind == "logsum":
            require_float(ctx, x)
            return x.sum(axes, keepdim=keep, dtype=x.dtype).log()
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
    if ctx.since >= 13:  # versions 1 and 11: the axes attribute
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
    return xs[0] if len(xs) == 1 else cat(list(xs), axis)


def split_sizes(ctx: Any, dim: int, split: Value) -> list[int]:
    if ctx.since >= 13:  # versions 2 and 11: the split attribute
        sizes = ints(ctx, split, "split") if split is not None else None
    else:
        sizes = list(ctx.attr("split")) if ctx.has_attr("split") else None
    if sizes is None:
        count = ctx.attr("num_outputs", ctx.n_outputs) if ctx.since >= 18 else ctx.n_outputs
        if ctx.since >= 18 and ctx.has_attr("num_outputs"):
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


def slice_inputs(ctx: Any, starts: Value, ends: Value, axes: Value, steps: Value) -> tuple[Value, Value, Value, Value]:
    """Version 1: starts, ends and axes are attributes (no steps); 10 on: inputs."""
    if ctx.since >= 10:
        if starts is None or ends is None:
            raise ctx.error("the starts and ends inputs are required")
        return starts, ends, axes, steps
    axes_attr = ctx.attr("axes", None)
    return (np.array(ctx.attr("starts"), np.int64), np.array(ctx.attr("ends"), np.int64),
            None if axes_attr is None else np.array(axes_attr, np.int64), None)


def op_slice(ctx: Any, x: Tensor, starts: Value = None, ends: Value = None, axes: Value = None, steps: Value = None) -> Tensor:
    plan = slice_plan(ctx, x.shape, *slice_inputs(ctx, starts, ends, axes, steps))
    out_shape = tuple(c for _, _, c in plan)
    if 0 in out_shape:
        return Tensor.full(out_shape, 0, x.dtype, x.device)  # on x's device: it meets x's neighbours
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
        return gather_where(x, mask, axis, idx.ndim)
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
    return gather_where(as_tensor(ctx, data, "data"), mask, axis, idx.ndim)


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
    if ctx.since < 11:  # version 2: pads and the (float) fill value are attributes
        pads, value = np.array(ctx.attr("pads"), np.int64), np.array(ctx.attr("value", 0.0))
    elif pads is None:
        raise ctx.error("the pads input is required")
    pairs = pad_pairs(ctx, x.ndim, pads, axes)
    if mode == "constant":
        if isinstance(value, Tensor):  # a fill computed at run time: select it outside the input
            inside = pad_value(Tensor.full(x.shape, True, dtypes.bool_, x.device), pairs, False)
            return inside.where(pad_value(x, pairs, 0), value.reshape(()).cast(x.dtype))
        v = 0 if value is None or value.size == 0 else value.reshape(-1)[0]
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
        pieces: list[tuple[int, int, int]] = []  # (start, stop, step) runs of consecutive sources
        for s in sources:
            if pieces and pieces[-1][1] == s and pieces[-1][2] == 1:
                pieces[-1] = (pieces[-1][0], s + 1, 1)
            else:
                pieces.append((s, s + 1, 1))
        x = cat([shrink_axis(x, axis, lo, hi) for lo, hi, _ in pieces], axis) if len(pieces) > 1 else shrink_axis(x, axis, pieces[0][0], pieces[0][1])
    return x


# ---- generators ----------------------------------------------------------------------------

def op_shape(ctx: Any, x: Value) -> np.ndarray:
    shape = np.array(x.shape, dtype=np.int64)
    start, end = ctx.attr("start", 0), ctx.attr("end", None)
    return shape[start:end] if ctx.since >= 15 else shape


def op_size(ctx: Any, x: Value) -> np.ndarray:
    return np.array(math.prod(x.shape), dtype=np.int64)


def op_constant_of_shape(ctx: Any, shape: Value) -> np.ndarray:
    dims = ints(ctx, shape, "input")
    value = ctx.attr("value", np.zeros(1, np.float32))
    return np.full(dims, value.reshape(-1)[0], dtype=value.dtype)


def op_range(ctx: Any, start: Value, limit: Value, delta: Value) -> np.ndarray:
    s, lim, d = (static(ctx, v, n) for v, n in ((start, "start"), (limit, "limit"), (delta, "delta")))
    count = max(int(math.ceil((lim.item() - s.item()) / d.item())), 0)
    return (s.item() + np.arange(count) * d.item()).astype(s.dtype)


def op_constant(ctx: Any) -> np.ndarray:
    for name in ("value", "value_float", "value_floats", "value_int", "value_ints"):
        if ctx.has_attr(name):
            v = ctx.attr(name)
            if name == "value":
                return v
            return np.array(v, dtype=np.float32 if "float" in name else np.int64)
    raise ctx.error("only value, value_float(s) and value_int(s) are supported")


def op_eye_like(ctx: Any, x: Value) -> np.ndarray:
    """A constant: it depends only on x's static shape (and dtype, when no `dtype` attribute)."""
    if len(x.shape) != 2:
        raise ctx.error(f"input must be 2-D, got shape {x.shape}")
    dtype = ctx.target_dtype(ctx.attr("dtype")).np if ctx.has_attr("dtype") else x.dtype.np if isinstance(x, Tensor) \
        else x.dtype
    return np.eye(x.shape[0], x.shape[1], k=ctx.attr("k", 0), dtype=dtype)


def op_center_crop_pad(ctx: Any, x: Tensor, shape: Value) -> Tensor:
    """Crop (start (d - s) // 2) or zero-pad (before (s - d) // 2) each listed axis to shape."""
    target = ints(ctx, shape, "shape")
    axes = norm_axes(ctx, ctx.attr("axes", list(range(x.ndim))), x.ndim)
    if len(axes) != len(target):
        raise ctx.error(f"shape {target} does not match axes {axes}")
    pairs = [(0, 0)] * x.ndim
    for a, s in zip(axes, target):
        d = x.shape[a]
        before = (s - d) // 2 if s >= d else -((d - s) // 2)
        pairs[a] = (before, s - d - before)
    return pad_or_crop(x, pairs)
