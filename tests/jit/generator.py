"""Random tensor programs for the differential JIT test: the hypothesis strategy `programs`.

A program grows step by step from families of ops (elementwise, views, comparisons, reductions,
unary ops, where, matmul, assign, device moves), each applied only where its operands are valid,
while every value's `Meta` tracks a magnitude bound and an error bound, op by op, from the dtype's
unit roundoff (the first-order rules of floating-point error analysis). Values stay within limits
that keep those bounds meaningful (`FLOAT_LIMIT`, `INT_LIMIT`, `MAX_ELEMENTS`). Shapes of program
the engine is known to get wrong are left out unless a test allows or forces them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
from hypothesis import assume
from hypothesis import strategies as st

from .program import Meta, Program, Step, common_dtype
from .reference import numpy_step

DTYPES = ("float32", "float64", "int64", "bool")
DEVICES = ("CPU:0", "CPU:1")
# the unit roundoff of each dtype's arithmetic; 0: exact (the generator keeps ints far from overflow)
ROUNDOFF = {"float32": 2.0 ** -24, "float64": 2.0 ** -53, "int64": 0.0, "bool": 0.0}
# exp and log are not correctly rounded: allow this many units of the result's magnitude bound
TRANSCENDENTAL_ULPS = 8
FLOAT_LIMIT = 1e5       # no value may grow past this: float32 keeps ~2 significant digits of headroom in sums
INT_LIMIT = 2.0 ** 40   # int64 products stay exact and far from wrapping
MAX_ELEMENTS = 96


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
    dtype = common_dtype(a, b)
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
    dtype = common_dtype(mx, my)
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
    dtype = common_dtype(ma, mb)
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
    layout = numpy_step(step, [b.layouts[x]], [m], m) if x in b.layouts else None
    if layout is not None and layout.shape == b.metas[b.layout_of[x]].shape and \
            np.array_equal(layout, b.layouts[b.layout_of[x]]):
        return
    number = b.add(step, replace(m, shape=numpy_step(step, [np.empty(m.shape)], [m], m).shape))
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
