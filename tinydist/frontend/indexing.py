"""Tensor indexing: `x[1, ::2, None, ...]` as shrink, step and reshape views (basic indexing only).

`__getitem__` and `__setitem__` are attached in the class body of `tinydist.frontend.tensor`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from tinydist.frontend.tensor import Tensor


def getitem(x: Tensor, index: Any) -> Tensor:
    items = index if isinstance(index, tuple) else (index,)
    ellipses = sum(1 for i in items if i is Ellipsis)
    if ellipses > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
    if consumed > x.ndim:
        raise IndexError(f"too many indices for tensor of dimension {x.ndim}")
    if ellipses:
        at = next(k for k, i in enumerate(items) if i is Ellipsis)
        items = items[:at] + (slice(None),) * (x.ndim - consumed) + items[at + 1:]
    else:
        items = items + (slice(None),) * (x.ndim - consumed)
    bounds, steps, final_shape, axis = [], [], [], 0
    for item in items:
        if item is None:
            final_shape.append(1)
            continue
        size = x.shape[axis]
        if isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            i = int(item)
            if not -size <= i < size:
                raise IndexError(f"index {i} is out of bounds for axis {axis} with size {size}")
            i %= size
            bounds.append((i, i + 1))
            steps.append(1)
        elif isinstance(item, slice):
            start, stop, step = item.indices(size)
            if step <= 0:
                raise IndexError(f"slice step {item.step} is not supported: only positive steps")
            stop = max(stop, start)
            bounds.append((start, stop))
            steps.append(step)
            final_shape.append(len(range(start, stop, step)))
        else:
            raise IndexError(f"unsupported index {item!r}: use ints, slices with positive steps, None and ...")
        axis += 1
    result = x.shrink(bounds)
    if any(s != 1 for s in steps):
        result = result._view("step", tuple(steps))
    return result.reshape(tuple(final_shape))


def setitem(self: Tensor, index: Any, value: Any) -> None:
    raise TypeError("item assignment is not supported; build the new tensor and use assign()")
