"""Views and shape trackers: movement ops without moving data.

A `View` maps an index over its `shape` to an element offset in the memory below it:
`offset + sum(i * stride)`, valid only where every index lies inside `mask` (elements outside
read as zero — that is how `pad` works). A `ShapeTracker` is a stack of views: when a reshape
cannot be expressed by re-striding the top view (e.g. reshaping a transposed matrix), a new view
is pushed and indexing goes through both (the lower view sees the flat index of the upper one).

Every movement op validates its arguments here, so a bad axis or shape fails when the op is
built, naming the shapes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

Shape = tuple[int, ...]
Mask = tuple[tuple[int, int], ...] | None


@functools.lru_cache(maxsize=4096)
def contiguous_strides(shape: Shape) -> tuple[int, ...]:
    """Row-major strides of `shape` (size-1 axes 0). Cached: every view asks whether it is
    contiguous, and an eager step asks for the same few shapes ~50 times."""
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc if size != 1 else 0)
        acc *= size
    return tuple(reversed(strides))


def _fields_only(state: dict[str, object]) -> dict[str, object]:
    """A view's or tracker's pickled state: its fields, not what it keeps computed (a hash of
    None differs between processes)."""
    return {name: value for name, value in state.items() if name not in ("_hash", "contiguous", "contiguous_base")}


def prod(values: Sequence[int]) -> int:
    return math.prod(values)


@dataclass(frozen=True)
class View:
    shape: Shape
    strides: tuple[int, ...]
    offset: int = 0
    mask: Mask = None

    def __hash__(self) -> int:
        """The fields' hash, computed once: a view is a key of the movement and scalar caches
        that every movement op of a step looks up (the generated __hash__ rebuilt the tuple)."""
        found = self.__dict__.get("_hash")
        if found is None:
            found = self.__dict__["_hash"] = hash((self.shape, self.strides, self.offset, self.mask))
        return found

    def __getstate__(self) -> dict[str, object]:
        return _fields_only(self.__dict__)

    @staticmethod
    def create(shape: Shape, strides: tuple[int, ...] | None = None, offset: int = 0, mask: Mask = None) -> View:
        shape = tuple(shape)
        strides = contiguous_strides(shape) if strides is None else tuple(strides)
        strides = tuple(0 if size == 1 else stride for size, stride in zip(shape, strides))
        if mask is not None:
            if any(lo >= hi for lo, hi in mask):  # nothing valid: every element reads as zero
                mask = tuple((0, 0) for _ in shape)
                strides, offset = (0,) * len(shape), 0
            elif all(lo == 0 and hi == size for (lo, hi), size in zip(mask, shape)):
                mask = None
        return View(shape, strides, offset, mask)

    @functools.cached_property
    def contiguous(self) -> bool:
        return self.offset == 0 and self.mask is None and self.strides == contiguous_strides(self.shape)

    def permute(self, order: tuple[int, ...]) -> View:
        mask = tuple(self.mask[i] for i in order) if self.mask else None
        return View.create(tuple(self.shape[i] for i in order), tuple(self.strides[i] for i in order), self.offset, mask)

    def expand(self, shape: Shape) -> View:
        mask = None
        if self.mask:
            mask = tuple(m if old == new else ((0, new) if m == (0, 1) else (0, 0))
                         for m, old, new in zip(self.mask, self.shape, shape))
        return View.create(shape, self.strides, self.offset, mask)

    def shrink(self, bounds: tuple[tuple[int, int], ...]) -> View:
        offset = self.offset + sum(lo * stride for (lo, _), stride in zip(bounds, self.strides))
        mask = None
        if self.mask:
            mask = tuple((max(mlo, lo) - lo, min(mhi, hi) - lo) for (mlo, mhi), (lo, hi) in zip(self.mask, bounds))
        return View.create(tuple(hi - lo for lo, hi in bounds), self.strides, offset, mask)

    def pad(self, padding: tuple[tuple[int, int], ...]) -> View:
        offset = self.offset - sum(before * stride for (before, _), stride in zip(padding, self.strides))
        old_mask = self.mask or tuple((0, size) for size in self.shape)
        mask = tuple((lo + before, hi + before) for (lo, hi), (before, _) in zip(old_mask, padding))
        shape = tuple(size + before + after for size, (before, after) in zip(self.shape, padding))
        return View.create(shape, self.strides, offset, mask)

    def step(self, steps: tuple[int, ...]) -> View:
        """Every `steps[i]`-th element along each axis (positive steps)."""
        shape = tuple((size + s - 1) // s for size, s in zip(self.shape, steps))
        mask = None
        if self.mask:
            mask = tuple(((lo + s - 1) // s, (hi + s - 1) // s) for (lo, hi), s in zip(self.mask, steps))
        return View.create(shape, tuple(st * s for st, s in zip(self.strides, steps)), self.offset, mask)

    def reshape(self, shape: Shape) -> View | None:
        """The same elements re-strided to `shape`, or None when one view cannot express it."""
        if self.shape == shape:
            return self
        if 0 in shape or 0 in self.shape:
            return View.create(shape)
        if self.mask is not None:
            # Only dropping/adding unit axes keeps a mask expressible without analysis.
            if tuple(s for s in self.shape if s != 1) != tuple(s for s in shape if s != 1):
                return None
            kept = iter([(m, st) for m, st, s in zip(self.mask, self.strides, self.shape) if s != 1])
            mask, strides = [], []
            for size in shape:
                m, st = next(kept) if size != 1 else ((0, 1), 0)
                mask.append(m)
                strides.append(st)
            if any(s == 1 and m != (0, 1) for m, s in zip(self.mask, self.shape)):
                return None  # a unit axis that is masked out cannot be dropped
            return View.create(shape, tuple(strides), self.offset, tuple(mask))
        restrided = _restride(self.shape, self.strides, shape)
        return None if restrided is None else View.create(shape, restrided, self.offset)


def _restride(old_shape: Shape, old_strides: tuple[int, ...], new_shape: Shape) -> tuple[int, ...] | None:
    """numpy's no-copy reshape: strides for `new_shape` over the same memory, if they exist."""
    old = [(size, stride) for size, stride in zip(old_shape, old_strides) if size != 1]
    new_dims = [size for size in new_shape if size != 1]
    new_strides = [0] * len(new_dims)
    oi = ni = 0
    while ni < len(new_dims) and oi < len(old):
        oj, nj = oi + 1, ni + 1
        np_, op = new_dims[ni], old[oi][0]
        while np_ != op:
            if np_ < op:
                np_ *= new_dims[nj]
                nj += 1
            else:
                op *= old[oj][0]
                oj += 1
        for k in range(oi, oj - 1):
            if old[k][1] != old[k + 1][0] * old[k + 1][1]:
                return None
        new_strides[nj - 1] = old[oj - 1][1]
        for k in range(nj - 1, ni, -1):
            new_strides[k - 1] = new_strides[k] * new_dims[k]
        oi, ni = oj, nj
    it = iter(new_strides)
    return tuple(0 if size == 1 else next(it) for size in new_shape)


@dataclass(frozen=True)
class ShapeTracker:
    views: tuple[View, ...]

    def __hash__(self) -> int:
        """Computed once, as View's (a tracker keys the movement cache)."""
        found = self.__dict__.get("_hash")
        if found is None:
            found = self.__dict__["_hash"] = hash(self.views)
        return found

    def __getstate__(self) -> dict[str, object]:
        return _fields_only(self.__dict__)

    @staticmethod
    def contiguous(shape: Shape) -> ShapeTracker:
        return ShapeTracker((View.create(tuple(shape)),))

    @property
    def shape(self) -> Shape:
        return self.views[-1].shape

    @functools.cached_property
    def contiguous_base(self) -> bool:
        """True when indexing is the identity over the base's contiguous memory (kept: every
        view node made asks it of its tracker)."""
        return len(self.views) == 1 and self.views[0].contiguous

    def is_reshape_of(self, shape: Shape) -> bool:
        """True when this tracker reads every element of contiguous memory of `shape`, in order:
        the same bytes with another shape (so no copy is needed to make it contiguous)."""
        return self.contiguous_base and self.numel == prod(shape)

    @property
    def numel(self) -> int:
        return prod(self.shape)

    def _top(self, view: View) -> ShapeTracker:
        return ShapeTracker(self.views[:-1] + (view,))

    def reshape(self, shape: Shape) -> ShapeTracker:
        merged = self.views[-1].reshape(shape)
        if merged is not None:
            return self._top(merged)
        return ShapeTracker(self.views + (View.create(shape),))

    def permute(self, order: tuple[int, ...]) -> ShapeTracker:
        return self._top(self.views[-1].permute(order))

    def expand(self, shape: Shape) -> ShapeTracker:
        return self._top(self.views[-1].expand(shape))

    def shrink(self, bounds: tuple[tuple[int, int], ...]) -> ShapeTracker:
        return self._top(self.views[-1].shrink(bounds))

    def pad(self, padding: tuple[tuple[int, int], ...]) -> ShapeTracker:
        return self._top(self.views[-1].pad(padding))

    def step(self, steps: tuple[int, ...]) -> ShapeTracker:
        return self._top(self.views[-1].step(steps))

    def as_strided(self, shape: Shape, strides: tuple[int, ...], offset: int = 0) -> ShapeTracker:
        """An arbitrary strided window over contiguous memory (pooling, convolution)."""
        if not self.contiguous_base:
            raise ValueError("as_strided needs a contiguous tensor; call .contiguous() first")
        return ShapeTracker((View.create(shape, strides, offset),))
