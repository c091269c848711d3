"""Element types: one table linking numpy dtypes, LLVM types and promotion rules.

Promotion follows numpy (NEP 50): `np.result_type` decides, with Python scalars as "weak" values
that adopt the tensor's kind when they can (uint64 with int64 is float64, as in numpy).

Every ONNX tensor type but strings, complex and the sub-byte / 8-bit floats: bool, int8–int64,
uint8–uint64, float16, float32, float64 (bfloat16 below). The narrow floats are *storage* types:
kernels hold them in float32 registers and round to the storage type after every op, which is
what numpy's own float16 loops do (convert, compute in float32, round), so results match numpy's
bit for bit on elementwise ops; a sum accumulates in float32, as numpy's pairwise sum does.

bfloat16 is numpy's through the ml_dtypes package (what onnx and jax use), registered on first
use (`dtypes.bfloat16`, `to_dtype("bfloat16")`, or the first bfloat16 array): importing ml_dtypes
costs several times numpy's own import, which `import tinydist` does not pay.
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
    kind: str  # numpy's: "f" float, "i" signed int, "u" unsigned int, "b" bool

    def __repr__(self) -> str:
        return f"td.{self.name}"

    @property
    def is_float(self) -> bool:
        return self.kind == "f"

    @property
    def is_int(self) -> bool:
        """Signed or unsigned integer."""
        return self.kind in "iu"

    @property
    def is_unsigned(self) -> bool:
        return self.kind == "u"

    @property
    def is_signed_wide(self) -> bool:
        """int32 or int64: the widths a float converts into with saturation (see lowering's cast)."""
        return self.kind == "i" and self.itemsize >= 4

    @property
    def is_narrow_float(self) -> bool:
        """A float stored narrower than it is computed (float16, bfloat16: float32 registers)."""
        return self.kind == "f" and self.itemsize == 2

    @property
    def is_bool(self) -> bool:
        return self.kind == "b"


float16 = DType("float16", np.dtype(np.float16), 2, "f")
float32 = DType("float32", np.dtype(np.float32), 4, "f")
float64 = DType("float64", np.dtype(np.float64), 8, "f")
int8 = DType("int8", np.dtype(np.int8), 1, "i")
int16 = DType("int16", np.dtype(np.int16), 2, "i")
int32 = DType("int32", np.dtype(np.int32), 4, "i")
int64 = DType("int64", np.dtype(np.int64), 8, "i")
uint8 = DType("uint8", np.dtype(np.uint8), 1, "u")
uint16 = DType("uint16", np.dtype(np.uint16), 2, "u")
uint32 = DType("uint32", np.dtype(np.uint32), 4, "u")
uint64 = DType("uint64", np.dtype(np.uint64), 8, "u")
bool_ = DType("bool", np.dtype(np.bool_), 1, "b")

SUPPORTED: tuple[DType, ...] = (float16, float32, float64, int8, int16, int32, int64, uint8, uint16, uint32, uint64, bool_)
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
    if isinstance(spec, str) and spec == "bfloat16":
        return _bfloat16()
    try:
        numpy_dtype = np.dtype(spec)
    except TypeError:
        numpy_dtype = None
    found = _BY_NUMPY.get(numpy_dtype) if numpy_dtype is not None else None
    if found is None and numpy_dtype is not None and numpy_dtype.name == "bfloat16":
        found = _bfloat16()
    if found is None:
        names = ", ".join(d.name for d in SUPPORTED)
        raise TypeError(f"dtype {spec!r} is not supported; supported: {names}, bfloat16 (with ml_dtypes)")
    return found


def _bfloat16() -> DType:
    """The bfloat16 DType, made and registered on first use (see the module's docstring)."""
    found = _BY_NAME.get("bfloat16")
    if found is None:
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError("dtype bfloat16 needs the ml_dtypes package (pip install ml_dtypes)") from None
        found = DType("bfloat16", np.dtype(ml_dtypes.bfloat16), 2, "f")
        _BY_NAME[found.name], _BY_NUMPY[found.np], _UFUNC_FLOAT[found] = found, found, found
    return found


def __getattr__(name: str) -> Any:
    if name == "bfloat16":
        return _bfloat16()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    """What numpy's true divide and mean return for `dtype` inputs (ints and bool → float64)."""
    return dtype if dtype.is_float else float64


def ufunc_float_result(dtype: DType) -> DType:
    """What numpy's exp/log/sqrt/sin/… return for `dtype` inputs: the smallest float holding
    every value exactly (bool, int8, uint8 → float16; int16, uint16 → float32; wider → float64)."""
    return _UFUNC_FLOAT[dtype]


def sum_result(dtype: DType) -> DType:
    """numpy's accumulator type for sum/prod: signed ints and bool widen to int64, unsigned to uint64."""
    return int64 if dtype.kind in ("i", "b") else uint64 if dtype.kind == "u" else dtype


_UFUNC_FLOAT = {d: d if d.is_float else _BY_NUMPY[np.exp(np.zeros(0, d.np)).dtype] for d in SUPPORTED}
