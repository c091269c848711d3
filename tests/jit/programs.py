"""Random tensor programs for the differential JIT test, and the two interpreters that run them.

A `Program` is data: parameters, a list of steps over numbered values, and the values returned.
`as_function` turns it into the Python function a user would write (tinydist ops on Tensors), which
the test runs eagerly and through `td.jit`. `run_numpy` interprets the same steps with numpy in
float64, independently of tinydist, so a bug shared by the eager path and the JIT still shows.

Floats are compared against the numpy reference within an error bound the generator carries for
every value (`Meta.err`), derived op by op from the dtype's unit roundoff and the value's magnitude
bound (`Meta.hi`). Rounding can still flip a comparison whose operands are closer than their error
bounds: the reference raises `NearTie` for such inputs and the test draws others, so a flipped
comparison is never mistaken for an engine bug and a real mismatch is never excused by a tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from hypothesis import assume
from hypothesis import strategies as st

import tinydist as td

DTYPES = ("float32", "float64", "int64", "bool")
DEVICES = ("CPU:0", "CPU:1")
# the unit roundoff of each dtype's arithmetic; 0: exact (the generator keeps ints far from overflow)
ROUNDOFF = {"float32": 2.0 ** -24, "float64": 2.0 ** -53, "int64": 0.0, "bool": 0.0}
# exp and log are not correctly rounded: allow this many units of the result's magnitude bound
TRANSCENDENTAL_ULPS = 8
FLOAT_LIMIT = 1e5       # no value may grow past this: float32 keeps ~2 significant digits of headroom in sums
INT_LIMIT = 2.0 ** 40   # int64 products stay exact and far from wrapping
MAX_ELEMENTS = 96
# tinydist and the reference may each be off by a value's error bound: results are compared, and
# comparisons called near ties, within this many bounds
TOLERANCE = 4.0
NUMPY_OF = {"float32": np.float64, "float64": np.float64, "int64": np.int64, "bool": np.bool_}  # reference storage


class NearTie(Exception):
    """A comparison in the numpy reference whose operands are within rounding error of each other."""


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


# ---- the two interpreters -------------------------------------------------------------------------

def _cast_numpy(x: np.ndarray, dtype: str) -> np.ndarray:
    """numpy's (and tinydist's) cast into the reference's storage: floats in float64, float→int truncates."""
    if dtype == "bool":
        return x != 0
    return x.astype(NUMPY_OF[dtype])


def _common(*metas: Meta) -> str:
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
        values.append(_numpy_step(step, xs, ms, metas[number]))
    return Reference([values[i] for i in program.outputs],
                     [values[program.final_value(p)] for p in range(program.n_params)])


def _numpy_step(step: Step, xs: list[np.ndarray], ms: list[Meta], out: Meta) -> np.ndarray:
    op, attr = step.op, step.attr
    if op in ("add", "sub", "mul", "div", "maximum"):
        a, b = (_cast_numpy(x, out.dtype) for x in xs)
        ufunc = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.true_divide, "maximum": np.maximum}[op]
        return ufunc(a, b)
    if op in ("lt", "eq", "ge"):
        common = _common(*ms)
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


# ---- the generator --------------------------------------------------------------------------------

def _rounded(dtype: str, hi: float) -> float:
    """The error one rounding to `dtype` may add to a value of magnitude <= hi."""
    return ROUNDOFF[dtype] * hi


def _within_limits(meta: Meta) -> bool:
    size_ok = math.prod(meta.shape) <= MAX_ELEMENTS
    if meta.is_float:
        # relative error past 1e-3 would make the tolerance too loose to mean anything
        return size_ok and meta.hi <= FLOAT_LIMIT and meta.err <= 1e-3 * max(meta.hi, 1.0)
    return size_ok and meta.hi <= INT_LIMIT


def _cast_meta(meta: Meta, dtype: str) -> Meta | None:
    """The value cast to `dtype`, or None when the cast is not continuous on an inexact value
    (float → int truncates and float → bool tests zero: rounding could change the result)."""
    if dtype == meta.dtype:
        return meta
    if meta.is_float and dtype in ("int64", "bool") and meta.err:
        return None
    if dtype == "bool":
        return Meta(meta.shape, dtype, meta.device, 1.0)
    if dtype == "int64":
        return Meta(meta.shape, dtype, meta.device, math.floor(meta.hi))
    err = meta.err + (_rounded(dtype, meta.hi) if dtype == "float32" and (meta.dtype == "float64" or meta.hi > 2 ** 24) else 0.0)
    return Meta(meta.shape, dtype, meta.device, meta.hi, err, meta.low * (1 - 2 ** -20))


def _broadcast(*shapes: tuple[int, ...]) -> tuple[int, ...] | None:
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        return None


def _arithmetic(op: str, a: Meta, b: Meta, shape: tuple[int, ...]) -> Meta | None:
    """Result bound and error of a broadcasting binary op, by the standard first-order rules."""
    dtype = _common(a, b)
    if op == "div":
        dtype = dtype if dtype in ("float32", "float64") else "float64"
    if op == "sub" and dtype == "bool":
        return None  # numpy and tinydist both refuse boolean subtract
    ea, eb = (m.err for m in (a, b))
    if op in ("add", "sub"):
        hi, err = a.hi + b.hi, ea + eb
        low = a.low + b.low if op == "add" and a.low and b.low else 0.0
    elif op == "mul":
        hi, err = a.hi * b.hi, ea * b.hi + eb * a.hi + ea * eb
        low = a.low * b.low
    elif op == "div":
        if not b.low or eb >= b.low / 2:
            return None  # only positive denominators, well away from zero
        hi, err = a.hi / b.low, ea / b.low + a.hi * eb / (b.low * (b.low - eb))
        low = a.low / b.hi if a.low else 0.0
    else:
        assert op == "maximum", op
        hi, err, low = max(a.hi, b.hi), max(ea, eb), max(a.low, b.low)
    if dtype == "bool":
        hi = 1.0
    return Meta(shape, dtype, a.device, hi, err + (_rounded(dtype, hi) if op != "maximum" else 0.0), low)


class _Builder:
    """The program under construction: value metadata, which values are live, the steps so far."""

    def __init__(self, params: list[Meta], shared: list[int], boxes: list[int], max_assigns: int, cycles: bool) -> None:
        self.metas: list[Meta] = list(params)
        self.max_assigns, self.cycles = max_assigns, cycles
        self.n_params = len(params)
        self.shared, self.boxes = shared, boxes
        self.steps: list[Step] = []
        # the (box, version) pairs each value reads: version n is an argument after its n-th assign
        self.reads: list[frozenset[tuple[int, int]]] = [frozenset({(box, 0)}) for box in boxes]
        # views of a parameter: which of its elements each element shows (see _view), and which parameter
        self.layouts: dict[int, np.ndarray] = {p: np.arange(math.prod(m.shape)).reshape(m.shape) for p, m in enumerate(params)}
        self.layout_of: dict[int, int] = {p: p for p in range(len(params))}
        # values a later step may read: an assign retires its target's old Tensor (the object now
        # holds the new value), so reading "the parameter" after that reads the assign's result
        self.live: list[int] = list(range(len(params)))

    def add(self, step: Step, meta: Meta | None) -> int | None:
        """Append `step` and return its value's number; None, and nothing appended, when the step is
        out of bounds (meta None: its operands do not allow it) or, unless `cycles`, could close a
        cycle of overwrites (see ASSIGN_CYCLE)."""
        if meta is None or not _within_limits(meta):
            return None
        if step.op == "assign":
            box = self.box_of(step.args[0])
            version = self.assigns(box) + 1
            value_reads = self.reads[step.args[1]]
            # the assign's kernel reads the old value where it writes the new one: that is no mix
            reads = frozenset({(box, version)}) | (value_reads - {(box, version - 1)})
            stale = any(v < self.assigns(other) for other, v in value_reads)
        else:
            reads = frozenset().union(*(self.reads[a] for a in step.args))
            stale = False
        mixed = len({box for box, _ in reads}) < len(reads)
        if (mixed or stale) and not self.cycles:
            return None
        number = len(self.metas)
        self.metas.append(meta)
        self.steps.append(step)
        self.reads.append(reads)
        if step.op == "assign":
            box = self.box_of(step.args[0])
            self.live = [v for v in self.live if not (self.is_argument(v) and self.box_of(v) == box)]
        self.live.append(number)
        return number

    def is_argument(self, value: int) -> bool:
        """Is `value` the caller's argument Tensor itself (a parameter, or what an assign returns)?"""
        return value < self.n_params or self.steps[value - self.n_params].op == "assign"

    def box_of(self, value: int) -> int:
        while value >= self.n_params:
            value = self.steps[value - self.n_params].args[0]
        return self.boxes[value]

    def assigns(self, box: int) -> int:
        return sum(1 for step in self.steps if step.op == "assign" and self.box_of(step.args[0]) == box)

    def stale_view(self, value: int) -> bool:
        """Is `value` a view of an argument (no kernel between them) that was assigned to since?"""
        return value in self.layout_of and self.assigns(self.boxes[self.layout_of[value]]) > 0

    def computed(self) -> list[int]:
        """Live values a function may return without returning an argument unchanged."""
        return [v for v in self.live if v >= self.n_params]

    def program(self, outputs: tuple[int, ...], container: str) -> Program:
        return Program(tuple(self.metas), self.n_params, tuple(self.shared), tuple(self.boxes),
                       tuple(self.steps), outputs, container)


_Draw = Callable[[st.SearchStrategy[Any]], Any]


def _pick(draw: _Draw, values: list[int]) -> int:
    return draw(st.sampled_from(values))


def _partners(b: _Builder, a: int) -> list[int]:
    """Live values on a's device whose shape broadcasts with a's (a itself always does)."""
    ma = b.metas[a]
    return [v for v in b.live if b.metas[v].device == ma.device and _broadcast(ma.shape, b.metas[v].shape) is not None]


def _elementwise(draw: _Draw, b: _Builder) -> None:
    op = draw(st.sampled_from(("add", "sub", "mul", "maximum", "div")))
    if op == "div":
        denominators = [v for v in b.live if b.metas[v].is_float and b.metas[v].low]
        if not denominators:
            return
        y = _pick(draw, denominators)
        x = _pick(draw, _partners(b, y))
    else:
        x = _pick(draw, b.live)
        y = _pick(draw, _partners(b, x))
    ma, mb = b.metas[x], b.metas[y]
    shape = _broadcast(ma.shape, mb.shape)
    assert shape is not None
    b.add(Step(op, (x, y)), _arithmetic(op, ma, mb, shape))


def _compare(draw: _Draw, b: _Builder) -> None:
    op = draw(st.sampled_from(("lt", "eq", "ge")))
    x = _pick(draw, b.live)
    y = _pick(draw, _partners(b, x))
    ma, mb = b.metas[x], b.metas[y]
    shape = _broadcast(ma.shape, mb.shape)
    assert shape is not None
    b.add(Step(op, (x, y)), Meta(shape, "bool", ma.device, 1.0))


def _where(draw: _Draw, b: _Builder) -> None:
    conditions = [v for v in b.live if b.metas[v].dtype == "bool"]
    if not conditions:
        return
    c = _pick(draw, conditions)
    x = _pick(draw, _partners(b, c))
    mc, mx = b.metas[c], b.metas[x]
    y = _pick(draw, [v for v in _partners(b, x) if _broadcast(mc.shape, mx.shape, b.metas[v].shape) is not None])
    my = b.metas[y]
    shape = _broadcast(mc.shape, mx.shape, my.shape)
    assert shape is not None
    dtype = _common(mx, my)
    branches = [_cast_meta(m, dtype) for m in (mx, my)]
    if None in branches:
        return
    bx, by = branches
    assert bx is not None and by is not None
    low = min(bx.low, by.low) if bx.low and by.low else 0.0
    b.add(Step("where", (c, x, y)), Meta(shape, dtype, mc.device, max(bx.hi, by.hi), max(bx.err, by.err), low))


def _unary(draw: _Draw, b: _Builder) -> None:
    op = draw(st.sampled_from(("cast", "exp", "log")))
    # exp of bounded values only (no overflow); log of positive ones, well away from zero
    fits = {"cast": lambda m: True, "exp": lambda m: m.is_float and m.hi <= 8,
            "log": lambda m: m.is_float and m.low > 0 and m.err < m.low / 2}[op]
    candidates = [v for v in b.live if fits(b.metas[v])]
    if not candidates:
        return
    x = _pick(draw, candidates)
    m = b.metas[x]
    if op == "cast":
        dtype = draw(st.sampled_from([d for d in DTYPES if d != m.dtype]))
        b.add(Step("cast", (x,), dtype), _cast_meta(m, dtype))
    elif op == "exp":
        hi = math.exp(m.hi)
        err = hi * m.err * 1.01 + TRANSCENDENTAL_ULPS * _rounded(m.dtype, hi)
        b.add(Step("exp", (x,)), Meta(m.shape, m.dtype, m.device, hi, err, math.exp(-m.hi) * 0.99))
    else:
        hi = max(abs(math.log(m.low)), abs(math.log(m.hi)))
        err = m.err / (m.low - m.err) + TRANSCENDENTAL_ULPS * _rounded(m.dtype, max(hi, 1.0))
        b.add(Step("log", (x,)), Meta(m.shape, m.dtype, m.device, hi, err, 0.99 * math.log(m.low) if m.low > 1.01 else 0.0))


def _reduce(draw: _Draw, b: _Builder) -> None:
    op = draw(st.sampled_from(("sum", "max")))
    candidates = [v for v in b.live if b.metas[v].shape]
    if not candidates:
        return
    x = _pick(draw, candidates)
    m = b.metas[x]
    ndim = len(m.shape)
    axes = draw(st.none() | st.lists(st.integers(0, ndim - 1), min_size=1, max_size=ndim, unique=True).map(tuple))
    keepdim = draw(st.booleans())
    reduced = range(ndim) if axes is None else axes
    shape = tuple(1 if i in reduced else s for i, s in enumerate(m.shape)) if keepdim else \
        tuple(s for i, s in enumerate(m.shape) if i not in reduced)
    n = math.prod(m.shape[i] for i in reduced)
    if op == "max":
        b.add(Step("max", (x,), (axes, keepdim)), replace(m, shape=shape))
        return
    dtype = m.dtype if m.is_float else "int64"
    hi = n * m.hi
    b.add(Step("sum", (x,), (axes, keepdim)), Meta(shape, dtype, m.device, hi, n * m.err + n * _rounded(dtype, hi), n * m.low))


def _matmul(draw: _Draw, b: _Builder) -> None:
    matrices = [v for v in b.live if b.metas[v].is_float and len(b.metas[v].shape) == 2]
    if not matrices:
        return
    x = _pick(draw, matrices)
    ma = b.metas[x]
    k = ma.shape[1]
    # (y, transpose): y (k, n) as is, or y (n, k) transposed; x @ x.T always qualifies
    pairs = [(v, t) for v in matrices for t in (False, True)
             if b.metas[v].device == ma.device and b.metas[v].shape[1 if t else 0] == k]
    y, transpose = draw(st.sampled_from(pairs))
    mb = b.metas[y]
    dtype = _common(ma, mb)
    hi = k * ma.hi * mb.hi
    err = k * (ma.err * mb.hi + mb.err * ma.hi + ma.err * mb.err) + k * _rounded(dtype, hi)
    n = mb.shape[0 if transpose else 1]
    b.add(Step("matmul", (x, y), transpose), Meta((ma.shape[0], n), dtype, ma.device, hi, err, k * ma.low * mb.low))


def _reshapes(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every shape of up to 3 axes with the same number of elements, other than `shape` itself."""
    n = math.prod(shape)
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    found: set[tuple[int, ...]] = {(n,)} | {(d, n // d) for d in divisors} | {(d, e, n // (d * e)) for d in divisors for e in divisors if n % (d * e) == 0}
    if n == 1:
        found.add(())
    return sorted(found - {shape})


def _view(draw: _Draw, b: _Builder) -> None:
    """A movement op. One that lands back on an argument's own layout (p.reshape(6).reshape(2, 3))
    is that argument's node, so returning it returns the argument unchanged: it is not generated."""
    op = draw(st.sampled_from(("reshape", "permute", "slice", "expand")))
    x = _pick(draw, b.live)
    m = b.metas[x]
    ndim = len(m.shape)
    if op == "reshape":
        attr: Any = draw(st.sampled_from(_reshapes(m.shape)))
    elif op == "permute" and ndim >= 2:
        order = tuple(draw(st.permutations(range(ndim))))
        attr = order if order != tuple(range(ndim)) else order[::-1]  # never the identity
    elif op == "slice" and any(s > 1 for s in m.shape):
        bounds = []
        for size in m.shape:
            lo = draw(st.integers(0, size - 1))
            bounds.append((lo, draw(st.integers(lo + 1, size)), draw(st.integers(1, 2))))
        attr = tuple(bounds)
    elif op == "expand":
        attr = tuple(draw(st.integers(2, 3)) if s == 1 and draw(st.booleans()) else s for s in m.shape)
        if ndim < 3 and (attr == m.shape or draw(st.booleans())):
            attr = (draw(st.integers(2, 3)),) + attr
    else:
        return
    step = Step(op, (x,), attr)
    # which element of the argument each element shows, for views of an argument
    layout = _numpy_step(step, [b.layouts[x]], [m], m) if x in b.layouts else None
    if layout is not None and layout.shape == b.metas[b.layout_of[x]].shape and \
            np.array_equal(layout, b.layouts[b.layout_of[x]]):
        return
    number = b.add(step, replace(m, shape=_numpy_step(step, [np.empty(m.shape)], [m], m).shape))
    if number is not None and layout is not None:
        b.layouts[number], b.layout_of[number] = layout, b.layout_of[x]


def _to_device(draw: _Draw, b: _Builder) -> None:
    x = _pick(draw, b.live)
    m = b.metas[x]
    device = next(d for d in DEVICES if d != m.device)
    b.add(Step("to", (x,), device), replace(m, device=device))


def _assign(draw: _Draw, b: _Builder, target: int | None = None) -> None:
    """`t.assign(v)` on an argument Tensor t (at most `max_assigns` times per argument)."""
    targets = [v for v in b.live if b.is_argument(v) and b.assigns(b.box_of(v)) < b.max_assigns]
    if not targets:
        return
    t = _pick(draw, targets) if target is None else target
    mt = b.metas[t]
    values = [v for v in b.live if b.metas[v].device == mt.device and _broadcast(b.metas[v].shape, mt.shape) == mt.shape]
    v = _pick(draw, values)
    cast = _cast_meta(b.metas[v], mt.dtype)
    b.add(Step("assign", (t, v)), None if cast is None else replace(cast, shape=mt.shape))


# ordered simplest first: hypothesis shrinks a failing program toward the front of this list;
# the common families are listed twice, so that about half the steps compute or move values
_FAMILIES = (_elementwise, _elementwise, _view, _view, _compare, _reduce, _unary, _where, _matmul, _assign, _to_device)


def _param_shapes(draw: _Draw, base: tuple[int, ...], n: int) -> list[tuple[int, ...]]:
    """Shapes that broadcast with `base`: some leading axes dropped, some axes set to 1."""
    shapes = []
    for _ in range(n):
        shape = base[draw(st.integers(0, len(base))):] if draw(st.booleans()) else base
        shapes.append(tuple(1 if s > 1 and draw(st.integers(0, 3)) == 0 else s for s in shape))
    return shapes


# Shapes of program the engine gets wrong at this commit (the tests that force them name the bugs).
# `programs` leaves each out unless it is allowed, so that the other failures stay visible.
RETURN_ARGUMENT = "return-argument"   # an output is an argument, returned unchanged
ASSIGN_TWICE = "assign-twice"         # one argument is assigned to twice
# a step reads an argument both before and after an assign to it, or an assign's value reads an
# argument another assign has overwritten (a.assign(b); b.assign(old a)): the scheduler refuses both
ASSIGN_CYCLE = "assign-cycle"
READ_ASSIGNED = "read-assigned"       # a step reads an assign's result, and that result is not returned
STALE_VIEW = "stale-view"             # an output is a view of an argument taken before an assign to it


@st.composite
def programs(draw: _Draw, *, shared_tensors: bool, several_devices: bool,
             allow: frozenset[str] = frozenset(), force: str | None = None) -> Program:
    """Random programs of 1-4 parameters and 1-8 steps.

    `shared_tensors`: a parameter given the same argument as an earlier one shares its memory (a
    Tensor passed twice) rather than getting a copy (an ndarray passed twice to `call_numpy`).
    `several_devices`: parameters may live on CPU:1 (`call_numpy` feeds CPU:0 only); `.to()` steps
    cross devices either way. `allow`: the shapes above that a program may have; `force`: one that
    every program has.
    """
    allow = allow | ({force} if force else set())
    base = draw(st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple))
    n_params = draw(st.integers(1, 4))
    params: list[Meta] = []
    shared: list[int] = []
    for i, shape in enumerate(_param_shapes(draw, base, n_params)):
        if i and draw(st.integers(0, 4)) == 0:
            earlier = draw(st.integers(0, i - 1))
            shared.append(shared[earlier])
            params.append(params[earlier])
            continue
        dtype = draw(st.sampled_from(DTYPES))
        device = draw(st.sampled_from(DEVICES)) if several_devices else DEVICES[0]
        hi = {"bool": 1.0, "int64": 4.0}.get(dtype, 2.0)
        low = 0.5 if dtype in ("float32", "float64") and draw(st.booleans()) else 0.0
        shared.append(i)
        params.append(Meta(shape, dtype, device, hi, 0.0, low))
    boxes = list(shared) if shared_tensors else list(range(n_params))
    b = _Builder(params, shared, boxes, max_assigns=2 if ASSIGN_TWICE in allow else 1, cycles=ASSIGN_CYCLE in allow)
    witnesses = _witness(draw, b, force) if force in (ASSIGN_TWICE, ASSIGN_CYCLE, READ_ASSIGNED, STALE_VIEW) else []
    length = len(b.steps) + draw(st.sampled_from(range(1, 9)))  # uniform: integers() would favour the shortest
    for _ in range(3 * length):  # a family drawn may not apply to the values so far: try another
        if len(b.steps) >= length:
            break
        draw(st.sampled_from(_FAMILIES))(draw, b)
    if not b.computed():  # every family drawn happened not to apply: add the one step that always does
        x = _pick(draw, b.live)
        b.add(Step("maximum", (x, x)), b.metas[x])
    returnable = [v for v in b.computed() if STALE_VIEW in allow or not b.stale_view(v)]
    assume(returnable)  # (only stale views computed: rare)
    outputs = draw(st.lists(st.sampled_from(returnable), min_size=1, max_size=3)) + witnesses
    if RETURN_ARGUMENT in allow:  # arguments returned unchanged, among the computed outputs
        untouched = [p for p in b.live if p < n_params]
        assume(untouched or force != RETURN_ARGUMENT)  # (every argument was assigned to)
        for p in draw(st.lists(st.sampled_from(untouched), min_size=force == RETURN_ARGUMENT, max_size=2)) if untouched else ():
            outputs.insert(draw(st.integers(0, len(outputs))), p)
    if READ_ASSIGNED not in allow:  # return every assign's result that a step reads
        read = {a for step in b.steps for a in (step.args[1:] if step.op == "assign" else step.args)}
        outputs += [v for v in b.live if v in read and v >= n_params and b.is_argument(v) and v not in outputs]
    container = draw(st.sampled_from(("tuple", "tensor", "list", "dict") if len(outputs) == 1 else ("tuple", "list", "dict")))
    return b.program(tuple(outputs), container)


def _witness(draw: _Draw, b: _Builder, shape: str) -> list[int]:
    """First steps that give the program `shape`; returns the values it must return to show it.
    An assign doubles its target: applied twice, or not at all, the value shows it."""
    numbers = [v for v in b.live if b.metas[v].dtype != "bool"]
    assume(numbers)  # bool has no op that changes a value applied twice (or: x or x is x)

    def added(number: int | None) -> int:
        assert number is not None, "a witness step is always in bounds: it runs first, on the parameters"
        return number

    def double(x: int) -> int:
        return added(b.add(Step("add", (x, x)), _arithmetic("add", b.metas[x], b.metas[x], b.metas[x].shape)))

    def assign_double(x: int) -> int:
        value = double(x)
        return added(b.add(Step("assign", (x, value)), b.metas[value]))

    t = _pick(draw, numbers)
    if shape == ASSIGN_TWICE:  # return t.assign(t + t).assign(t + t)
        return [assign_double(assign_double(t))]
    if shape == ASSIGN_CYCLE:  # old = t + t; t.assign(t + t); return old + t
        old = double(t)
        new = assign_double(t)
        return [added(b.add(Step("add", (old, new)), _arithmetic("add", b.metas[old], b.metas[new], b.metas[t].shape)))]
    if shape == STALE_VIEW:  # v = t.reshape(...); t.assign(t + t); return v
        view = added(b.add(Step("reshape", (t,), _reshapes(b.metas[t].shape)[0]), replace(b.metas[t], shape=_reshapes(b.metas[t].shape)[0])))
        b.layouts[view], b.layout_of[view] = b.layouts[t].reshape(b.metas[view].shape), t
        assign_double(t)
        return [view]
    new = assign_double(t)  # READ_ASSIGNED: t.assign(t + t); return t + t, not t
    return [double(new)]


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

