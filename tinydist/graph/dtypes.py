"""Element types: one table linking numpy dtypes, LLVM types and promotion rules.

Promotion follows numpy (NEP 50): `np.result_type` decides, with Python scalars as "weak" values
that adopt the tensor's kind when they can.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class DType:
    name: str
    np: np.dtype
    itemsize: int
    kind: str  # "f" float, "i" signed int, "b" bool

    def __repr__(self) -> str:
        return f"td.{self.name}"

    @property
    def is_float(self) -> bool:
        return self.kind == "f"

    @property
    def is_int(self) -> bool:
        return self.kind == "i"

    @property
    def is_bool(self) -> bool:
        return self.kind == "b"


float32 = DType("float32", np.dtype(np.float32), 4, "f")
float64 = DType("float64", np.dtype(np.float64), 8, "f")
int32 = DType("int32", np.dtype(np.int32), 4, "i")
int64 = DType("int64", np.dtype(np.int64), 8, "i")
bool_ = DType("bool", np.dtype(np.bool_), 1, "b")

SUPPORTED: tuple[DType, ...] = (float32, float64, int32, int64, bool_)
_BY_NUMPY = {d.np: d for d in SUPPORTED}
_BY_NAME = {d.name: d for d in SUPPORTED}


def of_numpy(dtype: np.dtype) -> DType | None:
    """The DType of a numpy dtype, None when unsupported: one dict lookup (every frame's upload asks)."""
    return _BY_NUMPY.get(dtype)


def to_dtype(spec: Any) -> DType:
    """A DType from a DType, numpy dtype/type, or name; TypeError naming what is supported."""
    if isinstance(spec, DType):
        return spec
    if isinstance(spec, str) and spec in _BY_NAME:
        return _BY_NAME[spec]
    try:
        found = _BY_NUMPY.get(np.dtype(spec))
    except TypeError:
        found = None
    if found is None:
        raise TypeError(f"dtype {spec!r} is not supported; supported: {', '.join(d.name for d in SUPPORTED)}")
    return found


def result_type(*operands: Any) -> DType:
    """numpy's promotion of DTypes and Python scalars (which are weak, per NEP 50). Under NEP 50
    a Python scalar promotes by its type, never its value (int8 with 300 is int8): the result of
    DTypes and bool/int/float is cached by their types (np.result_type is ~1 µs of every op)."""
    key = tuple(op if type(op) is DType else type(op) for op in operands)
    found = _PROMOTED.get(key)
    if found is None:
        args = [op.np if isinstance(op, DType) else op for op in operands]
        found = to_dtype(np.result_type(*args))
        if all(type(op) in (DType, bool, int, float) for op in operands):
            _PROMOTED[key] = found
    return found


_PROMOTED: dict[tuple[Any, ...], DType] = {}


def float_result(dtype: DType) -> DType:
    """What numpy's true divide and mean return for `dtype` inputs (ints and bool → float64).

    numpy's exp/sqrt/… of bool return float16, which tinydist does not have: float64 is used."""
    return dtype if dtype.is_float else float64


def sum_result(dtype: DType) -> DType:
    """numpy's accumulator type for sum/prod: small ints and bool widen to int64."""
    return int64 if dtype.kind in ("i", "b") else dtype
