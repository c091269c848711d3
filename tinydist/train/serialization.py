"""`td.save` / `td.load`: checkpoints in the safetensors format.

    td.save(model.state_dict(), "ckpt.tdz")
    td.save({"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3}, "ckpt.tdz")
    model.load_state_dict(td.load("ckpt.tdz"))

File layout (https://github.com/huggingface/safetensors, readable by its loaders):

    8 bytes       N, the header length, unsigned 64-bit little-endian
    N bytes       a JSON object, space-padded to a multiple of 8 bytes:
                    {"<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
                     "__metadata__": {"format": "tinydist", "tinydist.tree": "<JSON>"}}
    the rest      every tensor's raw little-endian bytes, C order; offsets are relative to here

dtypes: F32, F64, I32, I64, BOOL. A flat `{str: Tensor}` (a state dict) is stored under its own
keys. Nested dicts/lists/tuples and plain values (ints, floats, strings, None) are kept in the
"tinydist.tree" metadata, which names each tensor's entry; dict keys keep their type (int or str),
so an optimizer's state_dict round-trips exactly. Values are bit-for-bit (no conversion).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from tinydist.base.errors import TinydistError
from tinydist.frontend.tensor import Tensor
from tinydist.graph import dtypes

__all__ = ["CheckpointError", "load", "save"]


class CheckpointError(TinydistError, ValueError):
    """The file is not a checkpoint `save` (or a safetensors writer) wrote completely; the message
    names the file and what does not fit."""

# safetensors' dtype names (BF16 and the float8s are the ones tinydist has no numpy type for)
_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64", "int8": "I8", "int16": "I16", "int32": "I32",
           "int64": "I64", "uint8": "U8", "uint16": "U16", "uint32": "U32", "uint64": "U64", "bool": "BOOL"}
_NUMPY = {"F16": "<f2", "F32": "<f4", "F64": "<f8", "I8": "|i1", "I16": "<i2", "I32": "<i4", "I64": "<i8", "U8": "|u1",
          "U16": "<u2", "U32": "<u4", "U64": "<u8", "BOOL": "|b1"}


def _numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a safetensors dtype name (BF16 through ml_dtypes, loaded only for it)."""
    return dtypes.to_dtype("bfloat16").np if name == "BF16" else np.dtype(_NUMPY[name])


def _flatten(obj: Any, path: str, tensors: dict[str, np.ndarray]) -> Any:
    if isinstance(obj, (Tensor, np.ndarray)):
        array = obj.numpy() if isinstance(obj, Tensor) else obj
        if array.dtype.name not in _DTYPES:
            raise TypeError(f"td.save: {path or 'value'} has dtype {array.dtype}, supported: {', '.join(_DTYPES)}")
        name = path or "tensor"
        while name in tensors:
            name += "_"
        tensors[name] = np.asarray(array, order="C")
        return {"tensor": name, "numpy": isinstance(obj, np.ndarray)}
    if isinstance(obj, dict):
        items = []
        for key, value in obj.items():
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise TypeError(f"td.save: dict keys must be str or int, got {key!r}")
            child = f"{path}.{key}" if path else str(key)
            items.append([key, _flatten(value, child, tensors)])
        return {"dict": items}
    if isinstance(obj, (list, tuple)):
        kind = "list" if isinstance(obj, list) else "tuple"
        return {kind: [_flatten(v, f"{path}.{i}" if path else str(i), tensors) for i, v in enumerate(obj)]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"value": obj}
    if isinstance(obj, np.generic):
        return {"value": obj.item()}
    raise TypeError(f"td.save cannot store {type(obj).__name__} at {path or 'the top level'}")


def save(obj: Any, path: str | os.PathLike[str]) -> None:
    """Write tensors (a state dict, or nested dicts/lists of tensors and plain values) to `path`."""
    tensors: dict[str, np.ndarray] = {}
    tree = _flatten(obj, "", tensors)
    header: dict[str, Any] = {}
    offset = 0
    for name, array in tensors.items():
        header[name] = {"dtype": _DTYPES[array.dtype.name], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    header["__metadata__"] = {"format": "tinydist", "tinydist.tree": json.dumps(tree)}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = Path(f"{path}.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for array in tensors.values():
            f.write(array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes())
    os.replace(tmp, path)


def _rebuild(tree: dict[str, Any], tensors: dict[str, np.ndarray], device: str | None) -> Any:
    if "tensor" in tree:
        array = tensors[tree["tensor"]]
        return array if tree.get("numpy") else Tensor(array, device=device)
    if "dict" in tree:
        return {key: _rebuild(value, tensors, device) for key, value in tree["dict"]}
    if "list" in tree:
        return [_rebuild(v, tensors, device) for v in tree["list"]]
    if "tuple" in tree:
        return tuple(_rebuild(v, tensors, device) for v in tree["tuple"])
    return tree["value"]


def load(path: str | os.PathLike[str], device: str | None = None) -> Any:
    """Read what `save` wrote (or any safetensors file: a flat {name: Tensor} dict). A file that is
    not one raises CheckpointError naming it; the decoder's own error (json, numpy) is its cause."""
    data = Path(path).read_bytes()
    if len(data) < 8:
        raise CheckpointError(f"{path}: not a checkpoint (shorter than its 8-byte header length)")
    (length,) = struct.unpack("<Q", data[:8])
    if 8 + length > len(data):
        raise CheckpointError(f"{path}: header length {length} runs past the end of the file ({len(data)} bytes)")
    try:
        header = json.loads(data[8:8 + length])
        body = memoryview(data)[8 + length:]
        metadata = header.pop("__metadata__", None) or {}
        tensors: dict[str, np.ndarray] = {}
        for name, entry in header.items():
            begin, end = entry["data_offsets"]
            dtype = _numpy_dtype(entry["dtype"])
            array = np.frombuffer(body[begin:end], dtype=dtype).reshape(entry["shape"])
            tensors[name] = array.astype(dtype.newbyteorder("="), copy=True)
        tree = json.loads(metadata["tinydist.tree"]) if "tinydist.tree" in metadata else None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:   # json, numpy, or a header of another shape
        raise CheckpointError(f"{path}: the header does not describe its tensors ({type(exc).__name__}: {exc}); "
                              "was the file written completely, by td.save or a safetensors writer?") from exc
    if tree is not None:
        return _rebuild(tree, tensors, device)
    return {name: Tensor(array, device=device) for name, array in tensors.items()}
