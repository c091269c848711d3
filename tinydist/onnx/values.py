"""A plan's values and how they cross between load and call: a constant lifted onto the device,
a folded result brought to the host, a sequence input rebuilt from its key, and an output's
template (its run-time tensors as `LEAF`s) filled from what the capture returns.

A value is a Tensor (computed at run time), a numpy array (a constant of the plan), a list of
values (a sequence), or `EMPTY` (an empty optional)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tinydist.frontend.tensor import Tensor
from tinydist.graph import dtypes
from tinydist.onnx.kinds import SUPPORTED_NAMES, Kind
from tinydist.onnx.ops._common import EMPTY, SUPPORTED_NP

LEAF = object()  # in an output's template: a tensor the captured graph returns


def lift(ctx: Any, array: np.ndarray, device: str) -> Tensor:
    if array.dtype not in SUPPORTED_NP:
        raise ctx.error(f"constant of dtype {array.dtype} is not supported ({SUPPORTED_NAMES})")
    if array.size == 1:
        return Tensor.full(array.shape, array.reshape(-1)[0].item(), dtypes.to_dtype(array.dtype), device)
    return Tensor(np.ascontiguousarray(array), device).realize()


def host(value: Any) -> Any:
    """A folded result as a constant of the plan: numpy arrays, sequences of them, EMPTY, None."""
    if isinstance(value, Tensor):
        return value.numpy()
    if isinstance(value, list):
        return [host(v) for v in value]
    return value if value is None or value is EMPTY else np.asarray(value)


def dynamic(value: Any) -> bool:
    """Computed at run time: a Tensor, or a sequence holding one (else a constant of the plan)."""
    return isinstance(value, Tensor) or (isinstance(value, list) and any(dynamic(v) for v in value))


def is_const(value: Any) -> bool:
    return isinstance(value, np.ndarray) or value is EMPTY or (isinstance(value, list) and all(is_const(v) for v in value))


def arrays(value: Any) -> list[np.ndarray]:
    """A fed sequence's / optional's arrays, depth first (an empty optional has none)."""
    if isinstance(value, list):
        return [a for v in value for a in arrays(v)]
    return [] if value is EMPTY else [value]


def leaves(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    return [t for v in value for t in leaves(v)] if isinstance(value, list) else []


def nest(key: Any, kind: Kind, leaf: Callable[[Any, np.dtype], Any]) -> Any:
    """A sequence / optional input's value from its key (see `model._Key`): `leaf(shape, dtype)` per tensor."""
    if kind[0] == "optional":
        return EMPTY if key == ("none",) else nest(key, kind[1], leaf)
    if kind[0] == "sequence":
        return [nest(k, kind[1], leaf) for k in key[1:]]
    return leaf(key, kind[2])


def template(value: Any) -> Any:
    if isinstance(value, Tensor):
        return LEAF
    return [template(v) for v in value] if isinstance(value, list) else value


def fill(template: Any, leaves: Any) -> Any:
    """An output from its template: `LEAF`s from `leaves` (an iterator of arrays), constants copied
    (an empty optional: None, as onnxruntime gives it)."""
    if template is LEAF:
        return next(leaves)
    if isinstance(template, list):
        return [fill(t, leaves) for t in template]
    return None if template is EMPTY else np.array(template, copy=True)
