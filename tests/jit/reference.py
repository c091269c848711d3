"""The numpy reference of a random program, and how its results are compared with tinydist's.

`run_numpy` interprets a `Program`'s steps with numpy in float64 (ints in int64, bools as bool),
independently of tinydist, so a bug shared by the eager path and the JIT still shows.

Floats are compared against it within the error bound the generator carries for every value
(`Meta.err`), derived op by op from the dtype's unit roundoff and the value's magnitude bound
(`Meta.hi`). Rounding can still flip a comparison whose operands are closer than their error
bounds: the reference raises `NearTie` for such inputs and the test draws others, so a flipped
comparison is never mistaken for an engine bug and a real mismatch is never excused by a tolerance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .program import Meta, Program, Step, common_dtype

# tinydist and the reference may each be off by a value's error bound: results are compared, and
# comparisons called near ties, within this many bounds
TOLERANCE = 4.0
NUMPY_OF = {"float32": np.float64, "float64": np.float64, "int64": np.int64, "bool": np.bool_}  # reference storage


class NearTie(Exception):
    """A comparison in the numpy reference whose operands are within rounding error of each other."""


@dataclass(frozen=True)
class Reference:
    outputs: list[np.ndarray]
    arguments: list[np.ndarray]   # each parameter's argument after the call (assigns applied), in the reference's storage


def run_numpy(program: Program, arrays: Sequence[np.ndarray]) -> Reference:
    """The program interpreted by numpy in float64 (ints in int64, bools as bool). Value semantics
    throughout: an assign makes a new array, so readers of the old value keep it, as in tinydist."""
    metas = program.metas
    values: list[np.ndarray] = [_cast_numpy(np.asarray(a), m.dtype) for a, m in zip(arrays, program.params)]
    for number, step in enumerate(program.steps, start=program.n_params):
        xs = [values[i] for i in step.args]
        ms = [metas[i] for i in step.args]
        values.append(numpy_step(step, xs, ms, metas[number]))
    return Reference([values[i] for i in program.outputs],
                     [values[program.final_value(p)] for p in range(program.n_params)])


def numpy_step(step: Step, xs: list[np.ndarray], ms: list[Meta], out: Meta) -> np.ndarray:
    """One step's value from its operands' (`xs`, described by `ms`; the result by `out`). The generator
    runs it too, on index arrays, to see which argument element each element of a view shows."""
    op, attr = step.op, step.attr
    if op in ("add", "sub", "mul", "div", "maximum"):
        a, b = (_cast_numpy(x, out.dtype) for x in xs)
        ufunc = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.true_divide, "maximum": np.maximum}[op]
        return ufunc(a, b)
    if op in ("lt", "eq", "ge"):
        common = common_dtype(*ms)
        a, b = (_cast_numpy(x, common) for x in xs)
        margin = TOLERANCE * (ms[0].err + ms[1].err)
        # the same value on both sides compares exactly in tinydist too: only distinct values can flip
        if margin and step.args[0] != step.args[1] and np.any(np.abs(a - b) <= margin):
            raise NearTie(f"{op} of operands within {margin:.3g} of each other")
        return {"lt": np.less, "eq": np.equal, "ge": np.greater_equal}[op](a, b)
    if op == "where":
        return np.where(xs[0], _cast_numpy(xs[1], out.dtype), _cast_numpy(xs[2], out.dtype))
    if op == "cast":
        return _cast_numpy(xs[0], attr)
    if op in ("exp", "log"):
        return np.exp(xs[0]) if op == "exp" else np.log(xs[0])
    if op in ("sum", "max"):
        axis, keepdim = attr
        x = _cast_numpy(xs[0], out.dtype) if op == "sum" else xs[0]
        return np.asarray(np.sum(x, axis=axis, keepdims=keepdim) if op == "sum" else np.max(x, axis=axis, keepdims=keepdim))
    if op == "matmul":
        return xs[0] @ (xs[1].T if attr else xs[1])
    if op == "reshape":
        return xs[0].reshape(attr)
    if op == "permute":
        return np.transpose(xs[0], attr)
    if op == "slice":
        return xs[0][tuple(slice(*b) for b in attr)]
    if op == "expand":
        return np.broadcast_to(xs[0], attr)
    if op == "to":
        return xs[0]
    assert op == "assign", op
    return np.broadcast_to(_cast_numpy(xs[1], out.dtype), out.shape).copy()


def _cast_numpy(x: np.ndarray, dtype: str) -> np.ndarray:
    """numpy's (and tinydist's) cast into the reference's storage: floats in float64, float→int truncates."""
    if dtype == "bool":
        return x != 0
    return x.astype(NUMPY_OF[dtype])


def describe_mismatch(got: np.ndarray, want: np.ndarray, err: float) -> str:
    """The first few elements that differ, for an assertion message."""
    bad = np.argwhere(~_close(got, want, err))
    shown = ", ".join(f"[{', '.join(map(str, i))}] got {got[tuple(i)]!r} want {want[tuple(i)]!r}" for i in bad[:4])
    return f"{len(bad)} of {want.size} elements differ (allowed error {err:.3g}): {shown}"


def _close(got: np.ndarray, want: np.ndarray, err: float) -> np.ndarray:
    if want.dtype.kind == "f":
        return np.abs(got.astype(np.float64) - want) <= err
    return got == want


def matches(got: np.ndarray, want: np.ndarray, err: float) -> bool:
    return got.shape == want.shape and bool(np.all(_close(got, want, err)))
