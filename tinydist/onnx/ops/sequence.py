"""Sequence and optional values: SequenceConstruct / Empty / Insert / Erase / At / Length,
SplitToSequence, ConcatFromSequence, SequenceMap, Optional.

A sequence is a Python list of values (Tensors, or numpy arrays where they are constant), built
when the graph is planned: its length and its elements' shapes are part of the plan's key, as a
tensor's shape is, so the captured graph stays straight-line code and a sequence op costs nothing
per call beyond the tensor ops it names. Positions (SequenceAt's, Insert's, Erase's) decide which
element flows where, so they must be known at plan time (constant or value inputs), as Loop's trip
count must. An optional holding a value is that value; the empty one is `EMPTY`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tinydist.frontend.movement import cat, stack
from tinydist.frontend.tensor import Tensor
from tinydist.onnx.ops._common import EMPTY, Value, ints, norm_axis, shrink_axis
from tinydist.onnx.ops.control import _run, _split_outer


def _sequence(ctx: Any, value: Value, what: str = "input_sequence") -> list[Value]:
    if not isinstance(value, list):
        raise ctx.error(f"{what} must be a sequence, got {type(value).__name__}")
    return value


def _position(ctx: Any, position: Value, length: int, insert: bool) -> int:
    """ONNX positions count from the back when negative; Insert also accepts `length` (append)."""
    pos = ints(ctx, position, "position")[0]
    high = length if insert else length - 1
    if not -length <= pos <= high:
        raise ctx.error(f"position {pos} is out of range for a sequence of length {length} "
                        f"(accepted: {-length} to {high})")
    return pos + length if pos < 0 else pos


def _tensor(ctx: Any, value: Value) -> Tensor:
    """A constant element as a Tensor, uploaded once per value (an element's position is no key:
    a loop body's node sees a different constant each iteration)."""
    if isinstance(value, Tensor):
        return value
    array = np.asarray(value)
    return ctx.lift(("element", array.dtype.str, array.shape, array.tobytes()), array)


def op_sequence_empty(ctx: Any) -> list[Value]:
    return []


def op_sequence_construct(ctx: Any, *inputs: Value) -> list[Value]:
    return list(inputs)


def op_sequence_insert(ctx: Any, seq: Value, tensor: Value, position: Value = None) -> list[Value]:
    out = list(_sequence(ctx, seq))
    out.insert(len(out) if position is None else _position(ctx, position, len(out), True), tensor)
    return out


def op_sequence_erase(ctx: Any, seq: Value, position: Value = None) -> list[Value]:
    out = list(_sequence(ctx, seq))
    if not out:
        raise ctx.error("cannot erase from an empty sequence")
    del out[len(out) - 1 if position is None else _position(ctx, position, len(out), False)]
    return out


def op_sequence_at(ctx: Any, seq: Value, position: Value) -> Value:
    items = _sequence(ctx, seq)
    if not items:
        raise ctx.error("SequenceAt on an empty sequence")
    return items[_position(ctx, position, len(items), False)]


def op_sequence_length(ctx: Any, seq: Value) -> np.ndarray:
    return np.array(len(_sequence(ctx, seq)), np.int64)


def op_split_to_sequence(ctx: Any, x: Tensor, split: Value = None) -> list[Value]:
    """Without `split`: pieces of 1 along the axis (squeezed unless keepdims=1); a scalar split:
    pieces of that size (the last one shorter); a 1-D split: those sizes."""
    axis = norm_axis(ctx, ctx.attr("axis", 0), x.ndim)
    dim = x.shape[axis]
    if split is None:
        sizes, squeeze = [1] * dim, not ctx.attr("keepdims", 1)
    else:
        values = ints(ctx, split, "split")
        squeeze = False
        if np.ndim(split) == 0:
            if values[0] <= 0:
                raise ctx.error(f"split {values[0]} must be positive")
            sizes = [min(values[0], dim - i) for i in range(0, dim, values[0])]
        else:
            sizes = values
    if sum(sizes) != dim or any(s < 0 for s in sizes):
        raise ctx.error(f"split sizes {sizes} do not add up to the axis length {dim}")
    out: list[Value] = []
    start = 0
    for size in sizes:
        piece = shrink_axis(x, axis, start, start + size)
        out.append(piece.reshape(x.shape[:axis] + x.shape[axis + 1:]) if squeeze else piece)
        start += size
    return out


def op_concat_from_sequence(ctx: Any, seq: Value) -> Value:
    items = _sequence(ctx, seq)
    if not items:
        raise ctx.error("ConcatFromSequence of an empty sequence: the output's shape is unknown")
    new_axis = bool(ctx.attr("new_axis", 0))
    rank = (np.ndim(items[0]) if isinstance(items[0], np.ndarray) else items[0].ndim) + new_axis
    axis = norm_axis(ctx, ctx.attr("axis"), rank)
    if all(isinstance(v, np.ndarray) for v in items):
        return np.stack(items, axis) if new_axis else np.concatenate(items, axis)
    tensors = [_tensor(ctx, v) for v in items]
    if new_axis:
        return stack(tensors, axis)
    return tensors[0] if len(tensors) == 1 else cat(tensors, axis)


def op_sequence_map(ctx: Any, *args: Value) -> Any:
    """The body once per element of the first sequence: each further input is a sequence of the
    same length (element i goes in) or a tensor (given to every iteration); every body output is
    collected into an output sequence."""
    declared, outer = _split_outer(ctx, args)
    body = ctx.attr("body")
    length = len(_sequence(ctx, declared[0]))
    for k, value in enumerate(declared[1:], 1):
        if isinstance(value, list) and len(value) != length:
            raise ctx.error(f"additional input {k} is a sequence of length {len(value)}, the input sequence's is {length}")
    outputs: list[list[Value]] = [[] for _ in body.outputs]
    for i in range(length):
        inputs = [v[i] if isinstance(v, list) else v for v in declared]
        for collected, value in zip(outputs, _run(ctx, body, inputs, outer)):
            collected.append(value)
    return tuple(outputs) if ctx.n_outputs > 1 else outputs[0]


def op_optional(ctx: Any, x: Value = None) -> Value:
    """Optional(x) is x; Optional() (with its `type` attribute) is the empty optional."""
    return EMPTY if x is None else x


def op_optional_has_element(ctx: Any, x: Value = None) -> np.ndarray:
    """False for an empty optional and for a left-out input (15 and 18 alike); true otherwise."""
    return np.array(x is not None and x is not EMPTY)


def op_optional_get_element(ctx: Any, x: Value) -> Value:
    """The optional's value (18+: a tensor or sequence input is returned as it is)."""
    if x is EMPTY:
        raise ctx.error("OptionalGetElement of an empty optional (check it with OptionalHasElement first)")
    return x
