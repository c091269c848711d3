"""Helpers shared by the op handlers: static inputs, axes, dtypes, padding and windows, erf."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tinydist.frontend.tensor import Tensor
from tinydist.graph import dtypes

Value = Any  # np.ndarray | Tensor | None
OUTER = "\0outer"  # attrs key of a subgraph op (If / Loop / Scan): how many trailing inputs are outer-scope values

SUPPORTED_NP = {d.np for d in dtypes.SUPPORTED} | {dtypes.to_dtype("bfloat16").np}  # onnx imports ml_dtypes anyway


# ---- helpers -----------------------------------------------------------------------------------

def static(ctx: Any, value: Value, what: str) -> np.ndarray:
    """A param input that must be constant at load time."""
    if isinstance(value, np.ndarray):
        return value
    raise ctx.error(f"input '{what}' must be constant (computed from initializers, Constant nodes or static shapes); "
                    "data-dependent values there are not supported")


def ints(ctx: Any, value: Value, what: str) -> list[int]:
    return [int(v) for v in static(ctx, value, what).reshape(-1)]


def as_tensor(ctx: Any, value: Value, key: str) -> Tensor:
    return value if isinstance(value, Tensor) else ctx.lift(key, value)


def scalar_like(x: Tensor, value: float) -> Any:
    """A Python scalar of `x`'s kind (a weak operand: it adopts x's dtype)."""
    if x.dtype.is_float:
        return float(value)
    if x.dtype.is_bool:
        return bool(value)
    return int(value)


def norm_axis(ctx: Any, axis: int, ndim: int) -> int:
    if not -ndim <= axis < max(ndim, 1):
        raise ctx.error(f"axis {axis} is out of range for rank {ndim}")
    return axis % max(ndim, 1)


def norm_axes(ctx: Any, axes: Sequence[int], ndim: int) -> list[int]:
    return [norm_axis(ctx, int(a), ndim) for a in axes]


def require_float(ctx: Any, x: Tensor) -> None:
    if not x.dtype.is_float:
        raise ctx.error(f"input dtype {x.dtype.name} is not supported (float16/float32/float64 only)")


def shrink_axis(x: Tensor, axis: int, lo: int, hi: int) -> Tensor:
    bounds = [(0, s) for s in x.shape]
    bounds[axis] = (lo, hi)
    return x.shrink(bounds)


def pad_or_crop(x: Tensor, pairs: Sequence[tuple[int, int]], value: Any = 0) -> Tensor:
    """Pad (positive) or crop (negative) each axis by (before, after)."""
    crop = [(max(-b, 0), s - max(-a, 0)) for (b, a), s in zip(pairs, x.shape)]
    if any(lo >= hi for lo, hi in crop) and x.ndim:
        raise ValueError(f"cropping {pairs} removes every element of shape {x.shape}")
    x = x.shrink(crop)
    grow = [(max(b, 0), max(a, 0)) for b, a in pairs]
    return x.pad(grow, value) if any(b or a for b, a in grow) else x


def pad_value(x: Tensor, pairs: Sequence[tuple[int, int]], value: Any) -> Tensor:
    """pad_or_crop with a fill value of x's own dtype (Tensor.pad(value=) promotes float32 to float64)."""
    grow = [(max(b, 0), max(a, 0)) for b, a in pairs]
    cropped = pad_or_crop(x, [(min(b, 0), min(a, 0)) for b, a in pairs])
    if not any(b or a for b, a in grow):
        return cropped
    padded = cropped.pad(grow)
    if value == 0:
        return padded
    inside = Tensor.full(cropped.shape, True, dtypes.bool_, x.device).pad(grow)
    return inside.where(padded, Tensor.full((), value, x.dtype, x.device))


def spatial_args(ctx: Any, nd: int, in_sizes: Sequence[int],
                 kernel: Sequence[int]) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """A windowed op's (conv, pool) strides, dilations and (before, after) pads per spatial axis,
    from its attributes (auto_pad: SAME_UPPER / SAME_LOWER computed from the input sizes)."""
    strides = list(ctx.attr("strides", [1] * nd))
    dilations = list(ctx.attr("dilations", [1] * nd))
    if len(strides) != nd or len(dilations) != nd:
        raise ctx.error(f"strides {strides} / dilations {dilations} do not match {nd} spatial axes")
    auto_pad = ctx.attr("auto_pad", "NOTSET")
    if auto_pad == "NOTSET":
        pads = list(ctx.attr("pads", [0] * (2 * nd)))
        if len(pads) != 2 * nd:
            raise ctx.error(f"pads {pads} do not match {nd} spatial axes")
        pairs = [(pads[i], pads[i + nd]) for i in range(nd)]
    elif auto_pad == "VALID":
        pairs = [(0, 0)] * nd
    elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        pairs = []
        for size, k, s, d in zip(in_sizes, kernel, strides, dilations):
            out = -(-size // s)
            total = max(0, (out - 1) * s + (k - 1) * d + 1 - size)
            small = total // 2
            pairs.append((small, total - small) if auto_pad == "SAME_UPPER" else (total - small, small))
    else:
        raise ctx.error(f"auto_pad={auto_pad!r} is not supported")
    if any(p < 0 for pair in pairs for p in pair):
        raise ctx.error(f"negative pads {pairs} are not supported")
    return strides, dilations, pairs


def lowest(dtype: Any) -> Any:
    if dtype.is_float:
        return float("-inf")
    return 0 if dtype.kind in "bu" else -(1 << (dtype.itemsize * 8 - 1))


def highest(dtype: Any) -> Any:
    if dtype.is_float:
        return float("inf")
    if dtype.is_bool:
        return True
    return (1 << (dtype.itemsize * 8 - (dtype.kind != "u"))) - 1


def erf(x: Tensor) -> Tensor:
    """erf(x) as a rational approximation (Eigen's / XLA's float32 erf: a few ulp over float32)."""
    x = x.maximum(-4.0).minimum(4.0)
    x2 = x * x
    alpha = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
             -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
    beta = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
            -1.42647390514189e-02)
    p = x2 * alpha[0] + alpha[1]
    for c in alpha[2:]:
        p = p * x2 + c
    q = x2 * beta[0] + beta[1]
    for c in beta[2:]:
        q = q * x2 + c
    return (x * p) / q


def tanh(x: Tensor) -> Tensor:
    return x.tanh()


def gather_where(data: Tensor, mask: Tensor, axis: int, ind_ndim: int) -> Tensor:
    """out[pre, I, post] = sum_n mask[I, n] * data[pre, n, post] (exact: where, not multiply)."""
    pre, n, post = data.shape[:axis], data.shape[axis], data.shape[axis + 1:]
    d = data.reshape(pre + (1,) * ind_ndim + (n,) + post)
    m = mask.reshape((1,) * len(pre) + mask.shape + (1,) * len(post))
    picked = m.where(d, False if data.dtype.is_bool else 0)
    red = len(pre) + ind_ndim
    if data.dtype.is_bool:
        return picked.max(red)
    return picked.sum(red, dtype=data.dtype)


class EmptyOptional:
    """An optional value without an element (`Optional` with no input; None in a feed or a result).

    A sequence is a Python list of values and an optional that holds one is that value, so only
    the empty optional needs a type of its own: None already means an input left out."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "EMPTY_OPTIONAL"


EMPTY = EmptyOptional()
