"""Argument checks shared by the Tensor's modules: axes, shapes, broadcasting and dtype promotion.

Each gives numpy's answer or numpy's error (AxisError, "operands could not be broadcast ...")
when an op is built, so a mistake names the shapes instead of surfacing in codegen.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from tinydist.graph import dtypes
from tinydist.graph.dtypes import DType

if TYPE_CHECKING:
    from tinydist.frontend.tensor import Tensor


def normalize_axis(axis: int, ndim: int) -> int:
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise TypeError(f"axis must be an int, got {type(axis).__name__}")
    if not -max(ndim, 1) <= axis < max(ndim, 1):   # a 0-d tensor has axis 0 (or -1), as in numpy
        raise np.exceptions.AxisError(f"axis {axis} is out of bounds for tensor of dimension {ndim}")
    return int(axis) % max(ndim, 1)


def normalize_axes(axis: int | Sequence[int] | None, ndim: int) -> tuple[int, ...]:
    """The axes a reduction runs over, sorted. As numpy's ufunc reductions, a 0-d tensor accepts
    axis 0 or -1 and reduces over nothing."""
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    result = tuple(sorted(normalize_axis(a, ndim) for a in axes))
    if ndim == 0:
        return ()
    if len(set(result)) != len(result):
        raise ValueError(f"duplicate value in axis {axis}")
    return result


MAX_ELEMENTS = 1 << 48   # past this a kernel's loop would run for days, or its int64 offsets overflow


def shape_arg(shape: Sequence[Any], infer: bool = True) -> tuple[int, ...]:
    """Dimensions given as `f(2, 3)` or `f((2, 3))`: integers, at least 0; `infer` allows one -1
    (reshape's "whatever is left")."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = shape[0]
    if type(shape) is tuple and all([type(s) is int and s >= 0 for s in shape]) and math.prod(shape) <= MAX_ELEMENTS:
        return shape  # the common case (the shapes a step's ops pass each other): one pass, nothing to convert
    for s in shape:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
            raise TypeError(f"dimensions must be integers, got {s!r} ({type(s).__name__}) in shape {tuple(shape)}")
    result = tuple(int(s) for s in shape)
    if any(s < 0 for s in result if not (infer and s == -1)):
        what = "negative dimensions are not allowed" + ("" if infer else " (-1 is reshape's, not a factory's)")
        raise ValueError(f"{what}: {result}")
    count = abs(math.prod(result))   # reshape's -1 only flips the sign
    if count > MAX_ELEMENTS:
        raise ValueError(f"shape {result} has {count:,} elements, more than the "
                         f"{MAX_ELEMENTS:,} a kernel can index (2**48): split the work into smaller tensors")
    return result


def broadcast_shapes(x: tuple[int, ...], y: tuple[int, ...], a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """numpy's broadcast of two shapes (`a`, `b`: the operands' own, for the error), without
    numpy's machinery for any number of arrays (~5 us a call; a step's ops broadcast ~20 times)."""
    if len(x) < len(y):
        x = (1,) * (len(y) - len(x)) + x
    elif len(y) < len(x):
        y = (1,) * (len(x) - len(y)) + y
    result = []
    for p, q in zip(x, y):
        if p == q or q == 1:
            result.append(p)
        elif p == 1:
            result.append(q)
        else:
            raise ValueError(f"operands could not be broadcast together with shapes {a} {b}")
    return tuple(result)


def promote(a: Tensor, b: Tensor) -> DType:
    """numpy promotion; a 0-d tensor made from a Python scalar already carries its weak dtype."""
    return dtypes.result_type(a.dtype, b.dtype)
