"""NonZero, Unique and Compress: ops whose output *shape* depends on input *values*.

A captured plan has static shapes, so these values are needed when the plan is made: the input
(Compress: the condition) must be constant, or computed from graph inputs small enough to be
value inputs (read at call time; each new value makes a new plan and capture, see
OnnxModel.value_inputs). The op then runs in numpy at plan time, on those values; anything else
is refused at load, saying why.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tinydist.frontend.tensor import Tensor
from tinydist.onnx.ops._common import Value, norm_axis
from tinydist.onnx.ops.shape import op_gather


def _values(ctx: Any, value: Value, what: str) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    raise ctx.error(f"the output shape depends on the values of input {what!r}, which are computed at run time: "
                    "tinydist plans static shapes, so that input must be constant or computed from graph inputs of at "
                    "most 64 elements (those are read at call time)")


def op_nonzero(ctx: Any, x: Value) -> np.ndarray:
    return np.array(np.nonzero(_values(ctx, x, "X")), dtype=np.int64).reshape(np.ndim(x) or 1, -1)


def op_unique(ctx: Any, x: Value) -> tuple[np.ndarray, ...]:
    data = _values(ctx, x, "X")
    axis = ctx.attr("axis", None)
    if axis is not None:
        axis = norm_axis(ctx, axis, data.ndim)
    y, first, inverse, counts = np.unique(data, True, True, True, axis=axis)
    if not ctx.attr("sorted", 1):  # order of first occurrence
        order = np.argsort(first, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        first, counts, inverse = first[order], counts[order], rank[inverse.reshape(-1)]
        y = np.take(data if axis is not None else data.reshape(-1), first, axis=axis or 0)
    results = (y, first.astype(np.int64), inverse.reshape(-1).astype(np.int64), counts.astype(np.int64))
    return results[:max(ctx.n_outputs, 1)]


def op_compress(ctx: Any, x: Value, condition: Value) -> Tensor | np.ndarray:
    keep = np.flatnonzero(_values(ctx, condition, "condition").reshape(-1).astype(bool)).astype(np.int64)
    if ctx.has_attr("axis"):
        axis = norm_axis(ctx, ctx.attr("axis"), x.ndim)
        if keep.size and keep[-1] >= x.shape[axis]:
            raise ctx.error(f"condition of length {np.size(condition)} selects past axis {axis} of shape {x.shape}")
        if isinstance(x, np.ndarray):
            return np.take(x, keep, axis=axis)
        return op_gather(ctx, x, keep)  # Compress's axis attribute is Gather's
    flat = x.reshape(-1)
    if isinstance(x, np.ndarray):
        return np.take(flat, keep)
    return op_gather(ctx, flat, keep)


def _extent(box: np.ndarray, center_point_box: int) -> tuple[Any, Any, Any, Any]:
    """(x_min, x_max, y_min, y_max) of a [y1, x1, y2, x2] box (corners in any order) or of an
    [x_center, y_center, width, height] one; numpy scalars, in the boxes' dtype."""
    if center_point_box:
        return box[0] - box[2] / 2, box[0] + box[2] / 2, box[1] - box[3] / 2, box[1] + box[3] / 2
    return min(box[1], box[3]), max(box[1], box[3]), min(box[0], box[2]), max(box[0], box[2])


def _overlaps(a: np.ndarray, b: np.ndarray, center_point_box: int, iou_threshold: Any) -> bool:
    ax0, ax1, ay0, ay1 = _extent(a, center_point_box)
    bx0, bx1, by0, by1 = _extent(b, center_point_box)
    ix0, ix1, iy0, iy1 = max(ax0, bx0), min(ax1, bx1), max(ay0, by0), min(ay1, by1)
    if ix1 <= ix0 or iy1 <= iy0:
        return False
    inter = (ix1 - ix0) * (iy1 - iy0)
    area_a, area_b = (ax1 - ax0) * (ay1 - ay0), (bx1 - bx0) * (by1 - by0)
    union = area_a + area_b - inter
    if inter <= 0 or area_a <= 0 or area_b <= 0 or union <= 0:
        return False
    return bool(inter / union > iou_threshold)


def op_non_max_suppression(ctx: Any, boxes: Value, scores: Value, max_per_class: Value = None, iou_threshold: Value = None,
                           score_threshold: Value = None) -> np.ndarray:
    """Greedy per (batch, class): boxes by descending score (ties: lower index first), each kept
    unless its IoU with a kept one exceeds iou_threshold, at most max_output_boxes_per_class
    (default 0: none); with a score_threshold only scores above it are candidates. Rows
    [batch, class, box] (int64), in that order, as onnx's reference and onnxruntime."""
    box_values, score_values = _values(ctx, boxes, "boxes"), _values(ctx, scores, "scores")
    limit = max(int(_values(ctx, max_per_class, "max_output_boxes_per_class").reshape(-1)[0]), 0) \
        if max_per_class is not None and np.size(max_per_class) else 0
    iou = _values(ctx, iou_threshold, "iou_threshold").reshape(-1)[0] \
        if iou_threshold is not None and np.size(iou_threshold) else box_values.dtype.type(0)
    threshold = _values(ctx, score_threshold, "score_threshold").reshape(-1)[0] \
        if score_threshold is not None and np.size(score_threshold) else None
    center = int(ctx.attr("center_point_box", 0))
    if box_values.ndim != 3 or box_values.shape[2] != 4 or score_values.ndim != 3 or \
            score_values.shape[0] != box_values.shape[0] or score_values.shape[2] != box_values.shape[1]:
        raise ctx.error(f"boxes {box_values.shape} and scores {score_values.shape} must be (B, N, 4) and (B, C, N)")
    selected: list[tuple[int, int, int]] = []
    for b in range(box_values.shape[0]):
        for c in range(score_values.shape[1]):
            class_scores = score_values[b, c]
            order = sorted((i for i in range(class_scores.size) if threshold is None or class_scores[i] > threshold),
                           key=lambda i: (-class_scores[i], i))
            kept: list[int] = []
            for i in order:
                if len(kept) >= limit:
                    break
                if not any(_overlaps(box_values[b, i], box_values[b, k], center, iou) for k in kept):
                    kept.append(i)
                    selected.append((b, c, i))
    return np.array(selected, np.int64).reshape(-1, 3)
