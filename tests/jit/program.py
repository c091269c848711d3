"""A random tensor program of the differential JIT test, as data, and as the Tensor code it stands for.

A `Program` is data: parameters, a list of steps over numbered values, and the values returned;
each value carries what the generator (`generator.py`) knows of it (`Meta`: shape, dtype, device,
a magnitude bound and an error bound). `as_function` turns it into the Python function a user
would write (tinydist ops on Tensors), which the test runs eagerly and through `td.jit`;
`Program.source` prints that function when a check fails; `draw_arguments` gives one call's
inputs. The numpy interpretation it is checked against is `reference.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import tinydist as td


@dataclass(frozen=True)
class Meta:
    """What the generator knows about a value: enough to pick valid operands and to bound its error."""

    shape: tuple[int, ...]
    dtype: str
    device: str
    hi: float          # |value| <= hi
    err: float = 0.0   # |tinydist's value - the exact value| <= err (floats only; 0: computed exactly)
    low: float = 0.0   # > 0: value >= low everywhere (positive, so it may be divided by or logged)

    @property
    def is_float(self) -> bool:
        return self.dtype in ("float32", "float64")

    def describe(self) -> str:
        return f"{self.dtype}{list(self.shape)} on {self.device}"


@dataclass(frozen=True)
class Step:
    """`values.append(op(*(values[i] for i in args), attr))`; an assign's new value is its target Tensor."""

    op: str
    args: tuple[int, ...]
    attr: Any = None


@dataclass(frozen=True)
class Program:
    """A generated tensor function. Values are numbered: the parameters first, then one per step."""

    metas: tuple[Meta, ...]
    n_params: int
    shared: tuple[int, ...]   # parameter i is given the argument of parameter shared[i] (the same Tensor, or ndarray)
    boxes: tuple[int, ...]    # parameter i's memory: the same box for one Tensor passed twice, else its own
    steps: tuple[Step, ...]
    outputs: tuple[int, ...]
    container: str            # how the outputs are returned: "tensor", "tuple", "list" or "dict"

    @property
    def params(self) -> tuple[Meta, ...]:
        return self.metas[:self.n_params]

    def final_value(self, param: int) -> int:
        """The value number parameter `param`'s argument holds after the call (its last assign's)."""
        final = param
        for number, step in enumerate(self.steps, start=self.n_params):
            if step.op == "assign" and self.boxes[self._param_of(step.args[0])] == self.boxes[param]:
                final = number
        return final

    def _param_of(self, value: int) -> int:
        """The parameter whose argument `value` is (a parameter, or an assign's result)."""
        while value >= self.n_params:
            value = self.steps[value - self.n_params].args[0]
        return value

    def source(self) -> str:
        """The program as the Python a user would write: shown when a check fails."""
        names = [f"p{i}" for i in range(self.n_params)] + [f"v{i}" for i in range(self.n_params, len(self.metas))]
        lines = [f"def f({', '.join(names[:self.n_params])}):"]
        for i, meta in enumerate(self.params):
            given = f" (the same argument as p{self.shared[i]})" if self.shared[i] != i else ""
            lines.append(f"    # p{i}: {meta.describe()}{given}")
        for number, step in enumerate(self.steps, start=self.n_params):
            lines.append(f"    {names[number]} = {_SOURCE[step.op](*(names[i] for i in step.args), step.attr)}"
                         f"  # {self.metas[number].describe()}")
        outs = [names[i] for i in self.outputs]
        returned = {"tensor": outs[0], "tuple": f"({', '.join(outs)},)", "list": f"[{', '.join(outs)}]",
                    "dict": "{" + ", ".join(f"'o{k}': {o}" for k, o in enumerate(outs)) + "}"}[self.container]
        lines.append(f"    return {returned}")
        return "\n".join(lines)


def common_dtype(*metas: Meta) -> str:
    """numpy's promotion (NEP 50) of the operands' dtypes."""
    return np.result_type(*(np.dtype(m.dtype) for m in metas)).name


# tinydist: (operand Tensors..., attr) -> Tensor
_TINYDIST: dict[str, Callable[..., td.Tensor]] = {
    "add": lambda a, b, _: a + b,
    "sub": lambda a, b, _: a - b,
    "mul": lambda a, b, _: a * b,
    "div": lambda a, b, _: a / b,
    "maximum": lambda a, b, _: a.maximum(b),
    "lt": lambda a, b, _: a < b,
    "eq": lambda a, b, _: a == b,
    "ge": lambda a, b, _: a >= b,
    "where": lambda c, a, b, _: c.where(a, b),
    "cast": lambda x, dtype: x.cast(dtype),
    "exp": lambda x, _: x.exp(),
    "log": lambda x, _: x.log(),
    "sum": lambda x, attr: x.sum(attr[0], keepdim=attr[1]),
    "max": lambda x, attr: x.max(attr[0], keepdim=attr[1]),
    "matmul": lambda a, b, transpose: a @ (b.T if transpose else b),
    "reshape": lambda x, shape: x.reshape(shape),
    "permute": lambda x, order: x.permute(order),
    "slice": lambda x, bounds: x[tuple(slice(*b) for b in bounds)],
    "expand": lambda x, shape: x.expand(shape),
    "to": lambda x, device: x.to(device),
    "assign": lambda target, value, _: target.assign(value),
}

_SOURCE: dict[str, Callable[..., str]] = {
    "add": lambda a, b, _: f"{a} + {b}",
    "sub": lambda a, b, _: f"{a} - {b}",
    "mul": lambda a, b, _: f"{a} * {b}",
    "div": lambda a, b, _: f"{a} / {b}",
    "maximum": lambda a, b, _: f"{a}.maximum({b})",
    "lt": lambda a, b, _: f"{a} < {b}",
    "eq": lambda a, b, _: f"{a} == {b}",
    "ge": lambda a, b, _: f"{a} >= {b}",
    "where": lambda c, a, b, _: f"{c}.where({a}, {b})",
    "cast": lambda x, dtype: f"{x}.cast({dtype!r})",
    "exp": lambda x, _: f"{x}.exp()",
    "log": lambda x, _: f"{x}.log()",
    "sum": lambda x, attr: f"{x}.sum({attr[0]}, keepdim={attr[1]})",
    "max": lambda x, attr: f"{x}.max({attr[0]}, keepdim={attr[1]})",
    "matmul": lambda a, b, transpose: f"{a} @ {b}{'.T' if transpose else ''}",
    "reshape": lambda x, shape: f"{x}.reshape({shape})",
    "permute": lambda x, order: f"{x}.permute({order})",
    "slice": lambda x, bounds: f"{x}[{', '.join(f'{lo}:{hi}:{step}' for lo, hi, step in bounds)}]",
    "expand": lambda x, shape: f"{x}.expand({shape})",
    "to": lambda x, device: f"{x}.to({device!r})",
    "assign": lambda target, value, _: f"{target}.assign({value})",
}


def as_function(program: Program) -> Callable[..., Any]:
    """The program as a Python function of Tensors, as a user would write it (and `td.jit` it)."""
    def f(*args: td.Tensor) -> Any:
        values: list[td.Tensor] = list(args)
        for step in program.steps:
            values.append(_TINYDIST[step.op](*(values[i] for i in step.args), step.attr))
        outs = [values[i] for i in program.outputs]
        if program.container == "tensor":
            return outs[0]
        if program.container == "dict":
            return {f"o{k}": out for k, out in enumerate(outs)}
        return tuple(outs) if program.container == "tuple" else list(outs)
    return f


def outputs_of(result: Any) -> list[Any]:
    """A function's result (a Tensor or array, or a tuple/list/dict of them) as a list of outputs."""
    if isinstance(result, dict):
        return list(result.values())
    return list(result) if isinstance(result, (tuple, list)) else [result]


def draw_arguments(program: Program, rng: np.random.Generator) -> list[np.ndarray]:
    """Fresh arguments for one call: parameters given the same argument get the same ndarray."""
    arrays: list[np.ndarray] = []
    for i, meta in enumerate(program.params):
        if program.shared[i] != i:
            arrays.append(arrays[program.shared[i]])
            continue
        value: np.ndarray
        if meta.dtype == "bool":
            value = rng.random(meta.shape) < 0.5
        elif meta.dtype == "int64":
            value = rng.integers(-int(meta.hi), int(meta.hi) + 1, size=meta.shape, dtype=np.int64)
        else:
            value = rng.uniform(meta.low or -meta.hi, meta.hi, size=meta.shape).astype(meta.dtype)
        arrays.append(np.asarray(value))  # a 0-d draw is a numpy scalar: an argument must be an array
    return arrays
