"""Tensor factories as module functions, under torch's and numpy's names: `td.zeros(2, 3)`,
`td.full((2, 3), 7)`, `td.zeros_like(x)`, `td.arange(10)`, `td.randn(4, 4, device="CPU:1")`.

Each is the `Tensor` static method of the same name (the values, dtypes and validation are
there), with torch's `requires_grad=` keyword and the `*_like` forms, which take the shape,
dtype and device of a tensor (or the shape and dtype of a numpy array) unless told otherwise.
Default dtypes are the Tensor's, numpy's where it has one: `zeros`, `ones`, `empty`, `rand`,
`randn`, `eye` give float32 as torch does; `full` and `arange` take the type of their values
(`arange(0, 1, 0.25)` is float64, torch's is float32: pass `dtype=td.float32`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tinydist.graph import dtypes
from tinydist.graph.dtypes import to_dtype
from tinydist.frontend.tensor import Scalar, Tensor

__all__ = ["arange", "empty", "empty_like", "eye", "full", "full_like", "ones", "ones_like", "rand", "randn", "zeros",
           "zeros_like"]


def _leaf(tensor: Tensor, requires_grad: bool) -> Tensor:
    return tensor.requires_grad_() if requires_grad else tensor


def zeros(*shape: Any, dtype: Any = dtypes.float32, device: str | None = None, requires_grad: bool = False) -> Tensor:
    return _leaf(Tensor.zeros(*shape, dtype=dtype, device=device), requires_grad)


def ones(*shape: Any, dtype: Any = dtypes.float32, device: str | None = None, requires_grad: bool = False) -> Tensor:
    return _leaf(Tensor.ones(*shape, dtype=dtype, device=device), requires_grad)


def empty(*shape: Any, dtype: Any = dtypes.float32, device: str | None = None, requires_grad: bool = False) -> Tensor:
    """torch's `empty`: contents unspecified there; here zeros, since an unrealized constant costs
    no memory and no kernel until something reads it, so uninitialised memory would save nothing."""
    return zeros(*shape, dtype=dtype, device=device, requires_grad=requires_grad)


def full(shape: Sequence[int] | int, fill_value: Scalar | np.number | np.bool_, dtype: Any = None,
         device: str | None = None, requires_grad: bool = False) -> Tensor:
    return _leaf(Tensor.full(shape, fill_value, dtype, device), requires_grad)


def arange(start: Scalar, end: Scalar | None = None, step: Scalar = 1, dtype: Any = None, device: str | None = None,
           requires_grad: bool = False) -> Tensor:
    """`arange(end)` or `arange(start, end, step)`: numpy's values and dtype (int64 for integers)."""
    return _leaf(Tensor.arange(start, end, step, dtype, device), requires_grad)


def eye(n: int, m: int | None = None, dtype: Any = dtypes.float32, device: str | None = None,
        requires_grad: bool = False) -> Tensor:
    return _leaf(Tensor.eye(n, m, dtype, device), requires_grad)


def rand(*shape: Any, dtype: Any = dtypes.float32, device: str | None = None, requires_grad: bool = False) -> Tensor:
    """Uniform on [0, 1) from the generator `td.manual_seed` seeds (numpy's `default_rng(seed).random`)."""
    return _leaf(Tensor.rand(*shape, dtype=dtype, device=device), requires_grad)


def randn(*shape: Any, dtype: Any = dtypes.float32, device: str | None = None, requires_grad: bool = False) -> Tensor:
    """Standard normal from the generator `td.manual_seed` seeds (numpy's `default_rng(seed).standard_normal`)."""
    return _leaf(Tensor.randn(*shape, dtype=dtype, device=device), requires_grad)


def _like(like: Tensor | np.ndarray, value: Scalar | np.number | np.bool_, dtype: Any, device: str | None, requires_grad: bool) -> Tensor:
    if not isinstance(like, (Tensor, np.ndarray)):
        raise TypeError(f"expected a Tensor or a numpy array to take the shape of, got {type(like).__name__}")
    dtype = to_dtype(dtype) if dtype is not None else to_dtype(like.dtype)
    if device is None and isinstance(like, Tensor):
        device = like.device
    return _leaf(Tensor.full(tuple(like.shape), value, dtype, device), requires_grad)


def zeros_like(like: Tensor | np.ndarray, dtype: Any = None, device: str | None = None,
               requires_grad: bool = False) -> Tensor:
    return _like(like, 0, dtype, device, requires_grad)


def ones_like(like: Tensor | np.ndarray, dtype: Any = None, device: str | None = None,
              requires_grad: bool = False) -> Tensor:
    return _like(like, 1, dtype, device, requires_grad)


def empty_like(like: Tensor | np.ndarray, dtype: Any = None, device: str | None = None,
               requires_grad: bool = False) -> Tensor:
    """Zeros of `like`'s shape (see `empty`)."""
    return _like(like, 0, dtype, device, requires_grad)


def full_like(like: Tensor | np.ndarray, fill_value: Scalar | np.number | np.bool_, dtype: Any = None,
              device: str | None = None, requires_grad: bool = False) -> Tensor:
    """`like`'s shape filled with `fill_value`, in `like`'s dtype unless `dtype` is given (as numpy
    and torch: `full_like(int_tensor, 2.5)` is 2)."""
    return _like(like, fill_value, dtype, device, requires_grad)
