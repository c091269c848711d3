"""Index ops as one-hot selects over static shapes: GatherElements, GatherND, ScatterElements,
ScatterND, OneHot; masks fixed by shape: Trilu, CumSum; rank counting: TopK.

Every index is compared with a position vector (`idx == arange(n)`) and the selected values summed
(`where`, never multiply: exact, NaN/Inf in unselected elements stay out). The cost is
O(indices × axis size × rest): meant for the index sizes exported graphs use (positions, masks,
small k), not for large scatters. Run-time indices out of range select nothing (zeros / no update);
onnxruntime raises."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from tinydist.frontend.tensor import Tensor
from tinydist.graph import dtypes
from tinydist.onnx.ops._common import Value, as_tensor, highest, ints, lowest, norm_axis, pad_value, static


def _index_tensor(ctx: Any, indices: Value, key: str) -> Tensor:
    idx = as_tensor(ctx, indices, key)
    if idx.dtype.is_float or idx.dtype.is_bool:
        raise ctx.error(f"indices dtype {idx.dtype.name} is not supported (int32, int64)")
    return idx


def _positions(ctx: Any, n: int, dtype: Any, shape: Sequence[int] | None = None) -> Tensor:
    values = np.arange(n, dtype=dtype.np)
    return ctx.lift(("pos", n, dtype.name, tuple(shape or ())), values.reshape(shape) if shape else values)


def _wrap(idx: Tensor, n: Any) -> Tensor:
    return (idx < 0).where(idx + n, idx)


def _to_last(x: Tensor, axis: int) -> tuple[Tensor, tuple[int, ...]]:
    order = tuple(a for a in range(x.ndim) if a != axis) + (axis,)
    back = [0] * x.ndim
    for pos, src in enumerate(order):
        back[src] = pos
    return x.permute(order), tuple(back)


def _select_sum(mask: Tensor, values: Tensor, axis: int, dtype: Any) -> Tensor:
    """sum over `axis` of values where mask (bool: any)."""
    if dtype.is_bool:
        return mask.where(values, False).any(axis)
    return mask.where(values, 0).sum(axis, dtype=dtype)


def op_gather_elements(ctx: Any, data: Value, indices: Value) -> Tensor:
    data = as_tensor(ctx, data, "data")
    idx = _index_tensor(ctx, indices, "indices")
    axis = norm_axis(ctx, ctx.attr("axis", 0), data.ndim)
    if idx.ndim != data.ndim or any(i > d for a, (i, d) in enumerate(zip(idx.shape, data.shape)) if a != axis):
        raise ctx.error(f"indices shape {idx.shape} does not fit data shape {data.shape} on axis {axis}")
    n = data.shape[axis]
    bounds = [(0, n) if a == axis else (0, i) for a, i in enumerate(idx.shape)]
    moved, back = _to_last(data.shrink(bounds), axis)
    im, _ = _to_last(_wrap(idx, n), axis)
    mask = im.reshape(im.shape + (1,)) == _positions(ctx, n, idx.dtype)
    picked = _select_sum(mask, moved.reshape(moved.shape[:-1] + (1, n)), -1, data.dtype)
    return picked.permute(back)


def _linear_index(ctx: Any, idx: Tensor, dims: Sequence[int]) -> Tensor:
    """Row-major linear index of the last axis of idx (k coordinates into `dims`), negatives wrapped."""
    k = len(dims)
    strides = [math.prod(dims[j + 1:]) for j in range(k)]
    dims_t = ctx.lift(("dims", tuple(dims), idx.dtype.name), np.array(dims, idx.dtype.np))
    strides_t = ctx.lift(("strides", tuple(dims), idx.dtype.name), np.array(strides, idx.dtype.np))
    return (_wrap(idx, dims_t) * strides_t).sum(-1, dtype=idx.dtype)


def op_gather_nd(ctx: Any, data: Value, indices: Value) -> Tensor:
    data = as_tensor(ctx, data, "data")
    idx = _index_tensor(ctx, indices, "indices")
    b = ctx.attr("batch_dims", 0)
    k = idx.shape[-1]
    if data.shape[:b] != idx.shape[:b] or b + k > data.ndim:
        raise ctx.error(f"indices shape {idx.shape} does not fit data shape {data.shape} with batch_dims={b}")
    batch, rest = data.shape[:b], data.shape[b + k:]
    n, nb, m, r = math.prod(data.shape[b:b + k]), math.prod(batch), math.prod(idx.shape[b:-1]), math.prod(rest)
    lin = _linear_index(ctx, idx, data.shape[b:b + k]).reshape(nb, m, 1)
    mask = (lin == _positions(ctx, n, idx.dtype)).reshape(nb, m, n, 1)
    picked = _select_sum(mask, data.reshape(nb, 1, n, r), 2, data.dtype)
    return picked.reshape(batch + idx.shape[b:-1] + rest)


def _reduce_into(ctx: Any, base: Tensor, mask: Tensor, updates: Tensor, axis: int, hit: Tensor) -> Tensor:
    """base with the masked updates (summed over `axis`) applied by the node's `reduction`."""
    reduction = ctx.attr("reduction", "none")
    dtype = base.dtype
    if reduction == "none":
        return hit.where(_select_sum(mask, updates, axis, dtype), base)
    if reduction == "add":
        return base + _select_sum(mask, updates, axis, dtype) if not dtype.is_bool else base | _select_sum(mask, updates, axis, dtype)
    if reduction == "mul":
        return hit.where(base * mask.where(updates, 1).prod(axis, dtype=dtype), base)
    if reduction == "max":
        return hit.where(base.maximum(mask.where(updates, lowest(dtype)).max(axis)), base)
    if reduction == "min":
        return hit.where(base.minimum(mask.where(updates, highest(dtype)).min(axis)), base)
    raise ctx.error(f"reduction={reduction!r} is not supported (none, add, mul, max, min)")


def op_scatter_elements(ctx: Any, data: Value, indices: Value, updates: Value) -> Tensor:
    data, updates = as_tensor(ctx, data, "data"), as_tensor(ctx, updates, "updates")
    idx = _index_tensor(ctx, indices, "indices")
    axis = norm_axis(ctx, ctx.attr("axis", 0), data.ndim)
    if idx.shape != updates.shape or idx.ndim != data.ndim or \
            any(i > d for a, (i, d) in enumerate(zip(idx.shape, data.shape)) if a != axis):
        raise ctx.error(f"indices {idx.shape} / updates {updates.shape} do not fit data {data.shape} on axis {axis}")
    n = data.shape[axis]
    dm, back = _to_last(data, axis)
    im, _ = _to_last(_wrap(idx, n), axis)
    um, _ = _to_last(updates, axis)
    mask = im.reshape(im.shape + (1,)) == _positions(ctx, n, idx.dtype)    # (P…, k, n)
    grow = [(0, d - i) for d, i in zip(dm.shape[:-1], im.shape[:-1])] + [(0, 0), (0, 0)]
    if any(after for _, after in grow):  # indices cover fewer positions on the other axes
        mask = pad_value(mask, grow, False)
        um = pad_value(um, grow[:-1], 0)
    hit = mask.any(-2)
    return _reduce_into(ctx, dm, mask, um.reshape(um.shape + (1,)), -2, hit).permute(back)


def op_scatter_nd(ctx: Any, data: Value, indices: Value, updates: Value) -> Tensor:
    data, updates = as_tensor(ctx, data, "data"), as_tensor(ctx, updates, "updates")
    idx = _index_tensor(ctx, indices, "indices")
    k = idx.shape[-1]
    if k > data.ndim or updates.shape != idx.shape[:-1] + data.shape[k:]:
        raise ctx.error(f"indices {idx.shape} / updates {updates.shape} do not fit data {data.shape}")
    n, q, r = math.prod(data.shape[:k]), math.prod(idx.shape[:-1]), math.prod(data.shape[k:])
    lin = _linear_index(ctx, idx, data.shape[:k]).reshape(q, 1)
    mask = lin == _positions(ctx, n, idx.dtype)                              # (q, n)
    hit = mask.any(0).reshape(n, 1)
    out = _reduce_into(ctx, data.reshape(n, r), mask.reshape(q, n, 1), updates.reshape(q, 1, r), 0, hit)
    return out.reshape(data.shape)


def op_one_hot(ctx: Any, indices: Value, depth: Value, values: Value) -> Tensor:
    d = static(ctx, depth, "depth").reshape(-1)
    n = int(d[0])
    idx = as_tensor(ctx, indices, "indices")
    if idx.dtype.is_float:
        idx = idx.cast(dtypes.int64)  # float indices truncate, as onnxruntime
    axis = norm_axis(ctx, ctx.attr("axis", -1), idx.ndim + 1)
    idx = _wrap(idx, n)
    shape = idx.shape[:axis] + (1,) + idx.shape[axis:]
    mask = idx.reshape(shape) == _positions(ctx, n, idx.dtype, tuple(-1 if a == axis else 1 for a in range(idx.ndim + 1)))
    if isinstance(values, np.ndarray):
        off, on = (Tensor.full((), v.item(), dtypes.to_dtype(values.dtype), idx.device) for v in values.reshape(-1)[:2])
    else:
        off, on = values[0].reshape(()), values[1].reshape(())
    return mask.where(on, off)


def op_trilu(ctx: Any, x: Tensor, k: Value = None) -> Tensor:
    if x.ndim < 2:
        raise ctx.error(f"input of rank {x.ndim} has no matrix to take a triangle of")
    offset = ints(ctx, k, "k")[0] if k is not None else 0
    rows, cols = x.shape[-2:]
    diff = np.arange(cols)[None, :] - np.arange(rows)[:, None]
    keep = diff >= offset if ctx.attr("upper", 1) else diff <= offset
    return ctx.lift(("tri", rows, cols, offset), keep).where(x, False if x.dtype.is_bool else 0)


def op_cumsum(ctx: Any, x: Tensor, axis: Value) -> Tensor:
    return _cumulative(ctx, x, axis, "sum")


def op_cumprod(ctx: Any, x: Tensor, axis: Value) -> Tensor:
    return _cumulative(ctx, x, axis, "prod")


def _cumulative(ctx: Any, x: Tensor, axis: Value, kind: str) -> Tensor:
    """CumSum / CumProd as a masked reduction over an (n, n) triangle of which inputs reach each
    output: O(n²) along the axis, exact (masked-out terms are the identity, 0 or 1)."""
    a = norm_axis(ctx, ints(ctx, axis, "axis")[0], x.ndim)
    n = x.shape[a]
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    exclusive, reverse = ctx.attr("exclusive", 0), ctx.attr("reverse", 0)
    take = (j > i if exclusive else j >= i) if reverse else (j < i if exclusive else j <= i)
    moved, back = _to_last(x, a)
    mask = ctx.lift(("cum", n, bool(exclusive), bool(reverse)), take)
    values = moved.reshape(moved.shape[:-1] + (1, n))
    if kind == "prod":
        return mask.where(values, 1).prod(-1, dtype=x.dtype).permute(back)
    return _select_sum(mask, values, -1, x.dtype).permute(back)


def op_top_k(ctx: Any, x: Tensor, k: Value = None) -> tuple[Tensor, Tensor]:
    """Ranks by counting (rank_i = #{j: x_j before x_i}; ties: the lower index first, as onnxruntime),
    then a one-hot select per output position: O(n²) along the axis."""
    count = ctx.attr("k") if ctx.since < 10 else ints(ctx, k, "K")[0]  # version 1: the k attribute
    axis = norm_axis(ctx, ctx.attr("axis", -1), x.ndim)
    n = x.shape[axis]
    if not 0 <= count <= n:
        raise ctx.error(f"K={count} is out of range for an axis of size {n}")
    largest = bool(ctx.attr("largest", 1))
    moved, back = _to_last(x, axis)
    a = moved.reshape(moved.shape + (1,))            # x_i along axis -2
    b = moved.reshape(moved.shape[:-1] + (1, n))     # x_j along axis -1
    earlier = ctx.lift(("earlier", n), np.arange(n)[None, :] < np.arange(n)[:, None])
    before = ((b > a) if largest else (b < a)) | ((b == a) & earlier)
    rank = before.sum(-1, dtype=dtypes.int64)        # (P…, n)
    onehot = rank.reshape(rank.shape + (1,)) == _positions(ctx, count, dtypes.int64)   # (P…, n, K)
    values = _select_sum(onehot, a, -2, x.dtype)
    index = onehot.where(_positions(ctx, n, dtypes.int64, (n, 1)), 0).sum(-2, dtype=dtypes.int64)
    return values.permute(back), index.permute(back)


def op_reverse_sequence(ctx: Any, x: Tensor, lens: Value) -> Tensor:
    """Reverses the first lens[b] steps along time_axis of each batch entry: a one-hot select
    over (batch, time out, time in); run-time lengths stay tensors (no value input needed)."""
    batch_axis, time_axis = ctx.attr("batch_axis", 1), ctx.attr("time_axis", 0)
    if {batch_axis, time_axis} != {0, 1} or x.ndim < 2:
        raise ctx.error(f"batch_axis {batch_axis} / time_axis {time_axis} must be 0 and 1 (in either order) of a rank ≥ 2 input")
    moved = x if batch_axis == 0 else x.permute((1, 0) + tuple(range(2, x.ndim)))   # (B, T, …)
    b, t = moved.shape[:2]
    steps = np.arange(t, dtype=np.int64)
    if isinstance(lens, np.ndarray):
        n = lens.astype(np.int64).reshape(b, 1)
        src = np.where(steps[None, :] < n, n - 1 - steps[None, :], steps[None, :])
        onehot = ctx.lift(("rev", b, t), src[:, :, None] == steps[None, None, :])
    else:
        n = lens.cast(dtypes.int64).reshape(b, 1)
        out_t = ctx.lift(("steps", t), steps.reshape(1, t))
        src = (out_t < n).where(n - 1 - out_t, out_t)
        onehot = src.reshape(b, t, 1) == ctx.lift(("steps_in", t), steps.reshape(1, 1, t))
    rest = moved.shape[2:]
    mask = onehot.reshape((b, t, t) + (1,) * len(rest))
    picked = _select_sum(mask, moved.reshape((b, 1, t) + rest), 2, x.dtype)
    return picked if batch_axis == 0 else picked.permute((1, 0) + tuple(range(2, x.ndim)))


def op_tensor_scatter(ctx: Any, cache: Tensor, update: Tensor, write_indices: Tensor | None = None) -> Tensor:
    """TensorScatter (24): each batch entry's update written into the cache along `axis` (default
    -2, the sequence) from its write index on — `linear`, or wrapping around under `circular`.
    Run-time indices: a where-select over (cache position, update position) pairs."""
    axis = norm_axis(ctx, ctx.attr("axis", -2), cache.ndim)
    if axis == 0:
        raise ctx.error("axis must not be the batch axis 0")
    circular = ctx.attr("mode", "linear") == "circular"
    if ctx.attr("mode", "linear") not in ("linear", "circular"):
        raise ctx.error(f"mode={ctx.attr('mode')!r} is not supported (linear, circular)")
    b, s_len, t_len = cache.shape[0], cache.shape[axis], update.shape[axis]
    pre, post = math.prod(cache.shape[1:axis]), math.prod(cache.shape[axis + 1:])
    start = write_indices.cast(dtypes.int64).reshape(b, 1, 1) if write_indices is not None else Tensor.zeros(
        b, 1, 1, dtype=dtypes.int64, device=cache.device)
    target = start + ctx.lift("t", np.arange(t_len, dtype=np.int64).reshape(1, 1, t_len))
    if circular:
        target = target % s_len
    hits = target == ctx.lift("s", np.arange(s_len, dtype=np.int64).reshape(1, s_len, 1))  # (B, S, T)
    upd = update.reshape(b, pre, 1, t_len, post)
    picked = hits.reshape(b, 1, s_len, t_len, 1).where(upd, 0).sum(3, dtype=cache.dtype)  # (B, pre, S, post)
    written = hits.any(2)
    out = written.reshape(b, 1, s_len, 1).where(picked, cache.reshape(b, pre, s_len, post))
    return out.reshape(cache.shape)
