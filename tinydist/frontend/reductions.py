"""Tensor reductions: sum, prod, max, min, mean, var, std, any, all, argmax, argmin.

Each is a `Tensor` method (attached in the class body of `tinydist.frontend.tensor`), built on the
one REDUCE primitive `Tensor._reduce`; numpy's result dtypes, empty-axis rules and errors.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from tinydist.frontend.arguments import normalize_axes, normalize_axis
from tinydist.graph import dtypes
from tinydist.graph.dtypes import to_dtype

if TYPE_CHECKING:
    from tinydist.frontend.tensor import Tensor


def sum(self: Tensor, axis: int | Sequence[int] | None = None, keepdim: bool = False, dtype: Any = None) -> Tensor:
    return self._reduce("sum", axis, keepdim, to_dtype(dtype) if dtype is not None else dtypes.sum_result(self.dtype))


def prod(self: Tensor, axis: int | Sequence[int] | None = None, keepdim: bool = False, dtype: Any = None) -> Tensor:
    return self._reduce("prod", axis, keepdim, to_dtype(dtype) if dtype is not None else dtypes.sum_result(self.dtype))


def max(self: Tensor, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
    return self._reduce("max", axis, keepdim)


def min(self: Tensor, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
    return self._reduce("min", axis, keepdim)


def mean(self: Tensor, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
    if self.ndim == 0 and axis is not None:   # numpy's mean, unlike its sum, has no axis 0 there
        raise np.exceptions.AxisError(f"axis {axis} is out of bounds for a 0-d tensor (it has no axes; use axis=None)")
    axes = normalize_axes(axis, self.ndim)
    count = math.prod(self.shape[a] for a in axes)
    dtype = dtypes.float_result(self.dtype)
    total = self.cast(dtype)._reduce("sum", axis, keepdim)
    return total / count if count else total * float("nan")


def var(self: Tensor, axis: int | Sequence[int] | None = None, keepdim: bool = False, correction: float | None = None,
        *, ddof: float | None = None) -> Tensor:
    """The variance, sum((x - mean)²) / (N - correction), in numpy's float result type.

    `correction` is torch's name and `ddof` numpy's for the same number; the default is
    numpy's, 0 (the population variance), where torch's is 1: pass `correction=1` for
    torch's `x.var()`. Where N - correction <= 0 the result is inf (nan for an all-equal
    or empty input), as in both."""
    return _centered_square_mean(self, axis, keepdim, _correction(correction, ddof, "var"))


def std(self: Tensor, axis: int | Sequence[int] | None = None, keepdim: bool = False, correction: float | None = None,
        *, ddof: float | None = None) -> Tensor:
    """The standard deviation, sqrt of `var` with the same arguments (numpy's default correction 0)."""
    return _centered_square_mean(self, axis, keepdim, _correction(correction, ddof, "std")).sqrt()


def _centered_square_mean(self: Tensor, axis: int | Sequence[int] | None, keepdim: bool, correction: float) -> Tensor:
    axes = normalize_axes(axis, self.ndim)
    count = math.prod(self.shape[a] for a in axes)
    centered = self - self.mean(axis, keepdim=True)
    return (centered * centered).sum(axis, keepdim) / builtins.max(count - correction, 0)


def any(self: Tensor, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
    return _truth(self, "max", axis, keepdim)


def all(self: Tensor, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
    return _truth(self, "min", axis, keepdim)


def _truth(self: Tensor, op: str, axis: int | Sequence[int] | None, keepdim: bool) -> Tensor:
    """any (max) / all (min) of truth values; over no elements False / True, as numpy."""
    axes = normalize_axes(axis, self.ndim)
    if builtins.any(self.shape[a] == 0 for a in axes):  # (this module's any and max are the methods)
        kept = tuple(1 if i in axes else s for i, s in enumerate(self.shape))
        empty = self.full(kept, op == "min", dtypes.bool_, self.device)
        return empty if keepdim else empty.reshape(tuple(s for i, s in enumerate(self.shape) if i not in axes))
    return self.cast(dtypes.bool_)._reduce(op, axis, keepdim)


def _arg_reduce(self: Tensor, op: str, axis: int | None, keepdim: bool) -> Tensor:
    flat = axis is None
    x = self.reshape(-1) if flat else self
    axis = normalize_axis(axis if axis is not None else 0, x.ndim)
    if x.shape[axis] == 0:
        raise ValueError(f"attempt to get arg{op} of an empty sequence")
    extreme = x._reduce(op, axis, keepdim=True)
    hit = (x == extreme) | x.isnan() if x.dtype.is_float else x == extreme
    positions = self.arange(x.shape[axis], dtype=dtypes.int64, device=self.device)
    positions = positions.reshape(tuple(-1 if i == axis else 1 for i in range(x.ndim)))
    first = hit.where(positions, x.shape[axis]).min(axis, keepdim=True)
    if keepdim:
        return first.reshape((1,) * self.ndim) if flat else first
    return first.reshape(tuple(s for i, s in enumerate(x.shape) if i != axis))


def argmax(self: Tensor, axis: int | None = None, keepdim: bool = False) -> Tensor:
    return _arg_reduce(self, "max", axis, keepdim)


def argmin(self: Tensor, axis: int | None = None, keepdim: bool = False) -> Tensor:
    return _arg_reduce(self, "min", axis, keepdim)


def _correction(correction: float | None, ddof: float | None, what: str) -> float:
    """One number from torch's `correction` or numpy's `ddof` (0 when neither is given)."""
    if correction is not None and ddof is not None:
        raise TypeError(f"{what}() got both correction={correction!r} and ddof={ddof!r}: they are the same "
                        "number (torch's and numpy's name); pass one")
    value = correction if correction is not None else ddof if ddof is not None else 0
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{what}() correction must be a number, got {value!r} ({type(value).__name__})")
    return value
