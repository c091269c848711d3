"""Tensor movement: reshape, view, permute, transpose, expand, flatten, squeeze, unsqueeze, pad,
shrink, and `cat` / `stack`, which join tensors through padded views.

The methods are attached in the class body of `tinydist.frontend.tensor`; each checks its
arguments and makes one VIEW node through `Tensor._view` (views of views fold into one there).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from tinydist.frontend.arguments import normalize_axes, normalize_axis, shape_arg
from tinydist.graph import dtypes

if TYPE_CHECKING:
    from tinydist.frontend.tensor import Scalar, Tensor


def reshape(self: Tensor, *shape: Any) -> Tensor:
    checked = shape_arg(shape)
    if -1 not in checked:  # most reshapes: the element count is all there is to check
        if checked == self.node.shape:
            return self
        if math.prod(checked) != self.node.numel:
            raise ValueError(f"cannot reshape tensor of shape {self.shape} into shape {checked}")
        return self._view("reshape", checked)
    new = list(checked)
    if new.count(-1) > 1:
        raise ValueError(f"can only specify one unknown dimension, got shape {tuple(new)}")
    if -1 in new:
        known = math.prod(s for s in new if s != -1)
        if known == 0 or self.numel() % known:
            raise ValueError(f"cannot reshape tensor of shape {self.shape} into shape {tuple(new)}")
        new[new.index(-1)] = self.numel() // known
    if math.prod(new) != self.numel():
        raise ValueError(f"cannot reshape tensor of shape {self.shape} into shape {tuple(new)}")
    return self if tuple(new) == self.shape else self._view("reshape", tuple(new))


def view(self: Tensor, *shape: Any) -> Tensor:
    """torch's `view`: `view(2, -1)` is `reshape(2, -1)`, `view(dtype)` is `bitcast(dtype)`.

    torch refuses a view whose strides cannot express the new shape (a transposed tensor's
    `view(-1)`) because the view must share the input's memory. No Tensor here aliases
    memory a caller can write through (`assign()` refuses views; ops never write their
    inputs), so sharing is never observable and every reshape is a valid view: the graph
    moves data only where a kernel needs it contiguous."""
    if len(shape) == 1 and not isinstance(shape[0], (int, np.integer, tuple, list)):
        return self.bitcast(shape[0])
    return self.reshape(*shape)


def permute(self: Tensor, *order: Any) -> Tensor:
    if len(order) == 1 and isinstance(order[0], (tuple, list)):
        order = tuple(order[0])
    ndim = len(self.node.shape)
    if not all([type(a) is int and 0 <= a < ndim for a in order]):  # else: negative axes, or an error to name
        order = tuple(normalize_axis(a, ndim) for a in order)
    if sorted(order) != list(range(ndim)):
        raise ValueError(f"permute order {order} is not a permutation of the axes of shape {self.shape}")
    return self if order == tuple(range(self.ndim)) else self._view("permute", order)


def transpose(self: Tensor, *axes: int) -> Tensor:
    """No axes: reverse them (numpy). Two axes: swap them (torch). Otherwise: a permutation."""
    if not axes:
        return self.permute(tuple(reversed(range(self.ndim))))
    if len(axes) == 2 and self.ndim != 2:
        a, b = (normalize_axis(x, self.ndim) for x in axes)
        order = list(range(self.ndim))
        order[a], order[b] = order[b], order[a]
        return self.permute(tuple(order))
    return self.permute(*axes)


def expand(self: Tensor, *shape: Any) -> Tensor:
    new = shape_arg(shape)
    if len(new) < self.ndim:
        raise ValueError(f"cannot expand shape {self.shape} to {new}: fewer dimensions")
    x = self.reshape((1,) * (len(new) - self.ndim) + self.shape) if len(new) > self.ndim else self
    target = tuple(old if want == -1 else want for old, want in zip(x.shape, new))
    for old, want in zip(x.shape, target):
        if old != want and old != 1:
            raise ValueError(f"cannot expand shape {self.shape} to {new}: only size-1 axes can expand")
    return x if target == x.shape else x._view("expand", target)


def broadcast_to(self: Tensor, *shape: Any) -> Tensor:
    return self.expand(*shape)


def flatten(self: Tensor, start_axis: int = 0, end_axis: int = -1) -> Tensor:
    if self.ndim == 0:
        return self.reshape(1)
    start, end = normalize_axis(start_axis, self.ndim), normalize_axis(end_axis, self.ndim)
    return self.reshape(self.shape[:start] + (math.prod(self.shape[start:end + 1]),) + self.shape[end + 1:])


def squeeze(self: Tensor, axis: int | Sequence[int] | None = None) -> Tensor:
    if axis is None:
        return self.reshape(tuple(s for s in self.shape if s != 1))
    axes = normalize_axes(axis, self.ndim)
    for a in axes:
        if self.shape[a] != 1:
            raise ValueError(f"cannot squeeze axis {a} of shape {self.shape}: its size is {self.shape[a]}, not 1")
    return self.reshape(tuple(s for i, s in enumerate(self.shape) if i not in axes))


def unsqueeze(self: Tensor, axis: int) -> Tensor:
    axis = normalize_axis(axis, self.ndim + 1)
    return self.reshape(self.shape[:axis] + (1,) + self.shape[axis:])


def pad(self: Tensor, padding: Any, value: Scalar = 0) -> Tensor:
    """Constant padding; `padding` as numpy's pad_width: int, (before, after), or one pair per axis."""
    pairs = np.broadcast_to(np.asarray(padding, dtype=np.int64), (self.ndim, 2)) if self.ndim else np.zeros((0, 2), np.int64)
    if (pairs < 0).any():
        raise ValueError(f"negative padding {padding!r} is not supported")
    pairs_t = tuple((int(b), int(a)) for b, a in pairs)
    if not any(b or a for b, a in pairs_t):
        return self
    padded = self._view("pad", pairs_t)
    if value == 0:
        return padded
    inside = self._like(True, dtypes.bool_)._view("pad", pairs_t)
    return inside.where(padded, self.full((), value, self.dtype, self.device))


def shrink(self: Tensor, bounds: Sequence[tuple[int, int]]) -> Tensor:
    bounds = tuple((int(lo), int(hi)) for lo, hi in bounds)
    if len(bounds) != self.ndim or any(not 0 <= lo <= hi <= s for (lo, hi), s in zip(bounds, self.shape)):
        raise ValueError(f"shrink bounds {bounds} do not fit shape {self.shape}")
    return self if all(b == (0, s) for b, s in zip(bounds, self.shape)) else self._view("shrink", bounds)


def as_strided(self: Tensor, shape: tuple[int, ...], strides: tuple[int, ...], offset: int = 0) -> Tensor:
    return self.contiguous()._view("as_strided", (shape, strides, offset))


def cat(tensors: Sequence[Tensor], axis: int = 0) -> Tensor:
    """Join tensors along an existing axis (each piece is a padded view; one fused kernel adds them)."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("cat() needs at least one tensor")
    first = tensors[0]
    axis = normalize_axis(axis, first.ndim)
    for t in tensors[1:]:
        if t.ndim != first.ndim or any(s != f for i, (s, f) in enumerate(zip(t.shape, first.shape)) if i != axis):
            raise ValueError(f"cat(): shapes {[x.shape for x in tensors]} differ outside axis {axis}")
        if t.device != first.device:
            raise ValueError(f"cat(): tensors are on different devices: {sorted({x.device for x in tensors})}")
    dtype = dtypes.result_type(*(t.dtype for t in tensors))   # empty pieces take part, as in numpy
    total = sum(t.shape[axis] for t in tensors)
    if total == 0 or any(s == 0 for i, s in enumerate(first.shape) if i != axis):
        shape = list(first.shape)
        shape[axis] = total
        return first.zeros(tuple(shape), dtype=dtype, device=first.device)
    result: Tensor | None = None
    offset = 0
    for t in (t for t in tensors if t.shape[axis]):   # an empty piece adds nothing
        pads = [(0, 0)] * first.ndim
        pads[axis] = (offset, total - offset - t.shape[axis])
        piece = t.cast(dtype).pad(pads)
        if result is None:
            result = piece
        else:  # select, not add: -0.0 and NaN payloads come through unchanged
            inside = t._like(True, dtypes.bool_).pad(pads)
            result = inside.where(piece, result)
        offset += t.shape[axis]
    assert result is not None
    return result


def stack(tensors: Sequence[Tensor], axis: int = 0) -> Tensor:
    tensors = list(tensors)
    if not tensors:
        raise ValueError("stack() needs at least one tensor")
    if len({t.shape for t in tensors}) != 1:
        raise ValueError(f"stack(): all tensors must have the same shape, got {[t.shape for t in tensors]}")
    axis = normalize_axis(axis, tensors[0].ndim + 1)
    return cat([t.unsqueeze(axis) for t in tensors], axis)
