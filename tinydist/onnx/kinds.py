"""A graph value's type as tinydist holds it: ONNX element types as numpy dtypes, and a value's
kind (a tensor, a sequence or an optional) read from its TypeProto. Imports nothing of `onnx`:
it reads the protobuf objects it is handed."""

from __future__ import annotations

from typing import Any

import numpy as np

from tinydist.graph import dtypes
from tinydist.onnx.errors import UnsupportedModelError

# a graph value's type: ("tensor", dims or None when the rank is unknown, dtype), ("sequence", element
# kind) or ("optional", element kind)
Kind = tuple[Any, ...]

# ONNX TensorProto element types that tinydist tensors can hold.
_ELEM_TO_NP = {1: np.float32, 2: np.uint8, 3: np.int8, 4: np.uint16, 5: np.int16, 6: np.int32, 7: np.int64, 9: np.bool_,
               10: np.float16, 11: np.float64, 12: np.uint32, 13: np.uint64}
SUPPORTED_NAMES = ", ".join(d.name for d in dtypes.SUPPORTED) + ", bfloat16"
_ELEM_NAMES = {0: "UNDEFINED", 1: "FLOAT", 2: "UINT8", 3: "INT8", 4: "UINT16", 5: "INT16", 6: "INT32", 7: "INT64",
               8: "STRING", 9: "BOOL", 10: "FLOAT16", 11: "DOUBLE", 12: "UINT32", 13: "UINT64", 14: "COMPLEX64",
               15: "COMPLEX128", 16: "BFLOAT16"}


def np_dtype_of(ctx: Any, elem_type: int) -> np.dtype:
    if elem_type == 16:  # BFLOAT16: ml_dtypes' (onnx depends on it)
        return dtypes.to_dtype("bfloat16").np
    if elem_type not in _ELEM_TO_NP:
        name = _ELEM_NAMES.get(elem_type, f"elem_type {elem_type}")
        raise ctx.error(f"dtype {name} is not supported ({SUPPORTED_NAMES})")
    return np.dtype(_ELEM_TO_NP[elem_type])


class GraphCtx:
    """The error context of a graph value that is no node's: a graph input or output, by name."""

    def __init__(self, what: str) -> None:
        self.what = what

    def error(self, message: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"{self.what}: {message}")


def kind_of(tp: Any, what: str) -> Kind:
    """A TypeProto as a Kind; a map (or an untyped value) is refused, naming the value."""
    field = tp.WhichOneof("value")
    if field == "tensor_type":
        tt = tp.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in tt.shape.dim) \
            if tt.HasField("shape") else None
        return ("tensor", dims, np_dtype_of(GraphCtx(what), tt.elem_type))
    if field == "sequence_type":
        return ("sequence", kind_of(tp.sequence_type.elem_type, f"{what} (its elements)"))
    if field == "optional_type":
        return ("optional", kind_of(tp.optional_type.elem_type, what))
    raise GraphCtx(what).error(f"{(field or 'untyped').replace('_type', '')} values are not supported "
                               "(tensors, sequences and optionals)")


def kind_text(kind: Kind) -> str:
    if kind[0] == "tensor":
        return f"{kind[2].name}{list(kind[1]) if kind[1] is not None else '[…]'}"
    return f"{kind[0]}({kind_text(kind[1])})"


def value_type(vi: Any, what: str, required: bool = True) -> tuple[Any, Any]:
    """A tensor ValueInfo's (dims, dtype); an unknown rank is refused where `required` (a graph input)."""
    ctx = GraphCtx(f"{what} {vi.name!r}")
    if not vi.type.HasField("tensor_type"):  # an untyped graph output (inputs of other kinds have a Kind)
        return None, None
    tt = vi.type.tensor_type
    dtype = np_dtype_of(ctx, tt.elem_type) if (required or tt.elem_type) else None
    if not tt.HasField("shape"):
        if required:
            raise ctx.error("the rank must be known")
        return None, dtype
    dims = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in tt.shape.dim)
    return dims, dtype
