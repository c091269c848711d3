"""Differential test of `td.jit`: every replay, through every entry, equals eager tinydist and numpy.

Each example is a random program (drawn by `tests/jit/generator.py`; the program as data and as
Tensor code: `program.py`) jitted once per replay strategy in `tinydist.frontend.jit.REPLAYS` and
called 12 times with fresh arguments, through one entry: `f(*tensors)`,
`f.call_numpy(*arrays)` or `await f.acall(*tensors)`. Call 1 runs the function, call 2 captures,
calls 3-12 replay. Every call's outputs must equal the same function run eagerly on the same
arguments and a float64 numpy interpretation of the program: exactly for ints and bools, within
the error bound the generator derives for each float value (see reference.py). An argument the
program assigns to must hold its new value afterwards (a Tensor) or be left alone (an ndarray
given to `call_numpy`, which the function only ever sees a copy of).

A strategy that does not apply to a graph refuses it at capture with a JitError ("entry" needs one
device of kernels only; "streams" needs host devices): that combination is skipped. "auto" and
"runs" must apply to every graph.

Examples: a fixed set sized for CI by default; `make differential-long` (HYPOTHESIS_PROFILE=long)
draws thousands of new ones and prints a reproduction blob for any failure.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, reject, settings
from hypothesis import strategies as st

import tinydist as td
from tinydist.engine.realize import realize  # one realize of several tensors: the one Tensor.realize calls
from tinydist.frontend.jit import REPLAYS, JitError, TinyJit

from .generator import ASSIGN_CYCLE, ASSIGN_TWICE, READ_ASSIGNED, RETURN_ARGUMENT, STALE_VIEW, programs
from .program import Program, as_function, draw_arguments, outputs_of
from .reference import TOLERANCE, NearTie, Reference, describe_mismatch, matches, run_numpy

CALLS = 12
ENTRIES = ("call", "call_numpy", "acall")
# the strategies that may refuse a graph at capture, and how they say so; any other JitError fails
NOT_APPLICABLE = {name: re.compile(rf"replay='{name}' (needs|does not apply)") for name in ("entry", "streams")}

_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("differential-ci", max_examples=50, derandomize=True, deadline=None, database=None,
                          suppress_health_check=_HEALTH, print_blob=True)
settings.register_profile("long", max_examples=2000, derandomize=False, deadline=None, database=None,
                          suppress_health_check=_HEALTH, print_blob=True)
PROFILE = settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "differential-ci"))


class _NotApplicable(Exception):
    """The forced replay strategy refused the graph at capture."""


@dataclass
class Observed:
    """One call's results as numpy arrays: the outputs, and every argument as the caller sees it after."""

    outputs: list[np.ndarray]
    arguments: list[np.ndarray]


def _arguments(program: Program, arrays: list[np.ndarray]) -> list[td.Tensor]:
    """Tensors for one call, on each parameter's device; a parameter given an earlier one's
    argument gets the same Tensor object."""
    tensors: list[td.Tensor] = []
    for i, (array, meta) in enumerate(zip(arrays, program.params)):
        tensors.append(tensors[program.shared[i]] if program.shared[i] != i else td.Tensor(array, device=meta.device))
    return tensors


def _draw_calls(program: Program, seed: int) -> list[tuple[list[np.ndarray], Reference]]:
    """Fresh arguments for every call, with the numpy reference's results for them. Arguments that
    put a comparison within rounding error of a tie are drawn again (see programs.NearTie)."""
    rng = np.random.default_rng(seed)
    calls = []
    for _ in range(CALLS):
        for _attempt in range(8):
            arrays = draw_arguments(program, rng)
            try:
                calls.append((arrays, run_numpy(program, arrays)))
                break
            except NearTie:
                continue
        else:  # a comparison of values that are equal by construction, e.g. (a + b) == (b + a)
            event("rejected: a comparison within rounding error of a tie, whatever the arguments")
            reject()
    return calls


def _eager(program: Program, arrays: list[np.ndarray], entry: str) -> Observed:
    """The un-jitted function on the arguments as the entry gives them (call_numpy: copies)."""
    tensors = [td.Tensor(a) for a in arrays] if entry == "call_numpy" else _arguments(program, arrays)
    outputs = outputs_of(as_function(program)(*tensors))
    realize([t.node for t in (*outputs, *tensors)])  # one schedule, as the JIT captures it
    after = [a.copy() for a in arrays] if entry == "call_numpy" else [t.numpy() for t in tensors]
    return Observed([t.numpy() for t in outputs], after)


def _replayed(program: Program, replay: str, entry: str, calls: list[list[np.ndarray]], read_each: bool) -> list[Observed] | None:
    """The jitted function called once per argument list; None when `replay` refuses the graph.
    With `read_each` off, every result is read after the last call: replays queue up unread."""
    f: TinyJit = td.jit(replay=replay)(as_function(program))
    unread: list[tuple[Any, list[Any]]] = []
    observed: list[Observed] = []

    def read(result: Any, given: list[Any]) -> Observed:
        if entry == "call_numpy":
            return Observed([np.asarray(o) for o in outputs_of(result)], [np.array(g) for g in given])
        return Observed([o.numpy() for o in outputs_of(result)], [g.numpy() for g in given])

    def record(result: Any, given: list[Any]) -> None:
        unread.append((result, given))
        if read_each:
            observed.append(read(*unread.pop()))

    @contextlib.contextmanager
    def calling(k: int) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            refusal = NOT_APPLICABLE.get(replay)
            if k == 1 and isinstance(exc, JitError) and refusal is not None and refusal.search(str(exc)):
                raise _NotApplicable() from exc
            exc.add_note(f"at call {k + 1} of {CALLS}")
            raise

    async def drive() -> None:
        for k, arrays in enumerate(calls):
            given = _arguments(program, arrays)
            with calling(k):
                record(await f.acall(*given), given)

    try:
        if entry == "acall":
            anyio.run(drive)
        else:
            for k, arrays in enumerate(calls):
                given: list[Any] = list(arrays) if entry == "call_numpy" else _arguments(program, arrays)
                with calling(k):
                    record(f.call_numpy(*given) if entry == "call_numpy" else f(*given), given)
    except _NotApplicable:
        return None
    assert f.captured is not None, f"{CALLS} calls and nothing captured"
    return observed + [read(result, given) for result, given in unread]


def _check(program: Program, replay: str, entry: str, k: int, got: Observed, eager: Observed, want: Reference) -> None:
    where = f"replay={replay!r} via {entry}, call {k + 1} of {CALLS} ({'capture' if k == 1 else 'replay' if k else 'first run'})"
    context = f"{where}\n{program.source()}"
    assert len(got.outputs) == len(program.outputs), f"{len(got.outputs)} outputs, want {len(program.outputs)}\n{context}"
    for i, (out, ref, number) in enumerate(zip(got.outputs, want.outputs, program.outputs)):
        meta = program.metas[number]
        assert out.dtype == np.dtype(meta.dtype) and out.shape == meta.shape, \
            f"output {i}: {out.dtype}{list(out.shape)}, want {meta.describe()}\n{context}"
        # eager and a replay may round differently (one Tensor passed twice is one buffer eagerly, two
        # in a capture): both are within the error bound of the exact value
        allowed = TOLERANCE * meta.err
        assert matches(out, eager.outputs[i], allowed), f"output {i} differs from eager: {describe_mismatch(out, eager.outputs[i], allowed)}\n{context}"
        assert matches(out, ref, allowed), f"output {i} differs from numpy: {describe_mismatch(out, ref, allowed)}\n{context}"
    for p, (arg, before) in enumerate(zip(got.arguments, eager.arguments)):
        # eager.arguments: the argument after the eager call, or (call_numpy) the untouched array
        allowed = TOLERANCE * program.metas[program.final_value(p)].err if entry != "call_numpy" else 0.0
        assert matches(arg, before, allowed), f"argument p{p} afterwards: {describe_mismatch(arg, before, allowed)}\n{context}"
        if entry != "call_numpy":
            assert matches(arg, want.arguments[p], allowed), \
                f"argument p{p} afterwards, against numpy: {describe_mismatch(arg, want.arguments[p], allowed)}\n{context}"


def _differential(program: Program, entry: str, seed: int, read_each: bool) -> None:
    calls = _draw_calls(program, seed)
    with _noted(f"eager via {entry}", program):
        eager = [_eager(program, arrays, entry) for arrays, _ in calls]
    for k, (observed, (_, want)) in enumerate(zip(eager, calls)):
        _check(program, "eager", entry, k, observed, observed, want)
    for replay in REPLAYS:
        with _noted(f"replay={replay!r} via {entry}", program):
            results = _replayed(program, replay, entry, [arrays for arrays, _ in calls], read_each)
        if results is None:
            event(f"replay={replay} not applicable")
            continue
        for k, (got, ref, (_, want)) in enumerate(zip(results, eager, calls)):
            _check(program, replay, entry, k, got, ref, want)


@contextlib.contextmanager
def _noted(where: str, program: Program) -> Iterator[None]:
    """An error raised inside says which run of which program raised it."""
    try:
        yield
    except Exception as exc:
        exc.add_note(f"{where}\n{program.source()}")
        raise


def _programs_for(entry: str, allow: frozenset[str] = frozenset(), force: str | None = None) -> st.SearchStrategy[Program]:
    """Programs an entry can be called with: call_numpy gives copies of ndarrays, on CPU:0."""
    tensors = entry != "call_numpy"
    return programs(shared_tensors=tensors, several_devices=tensors, allow=allow, force=force)


# the shapes the engine once got wrong (each found here) and that every entry now runs as eager does
_FIXED = frozenset({RETURN_ARGUMENT, ASSIGN_TWICE, READ_ASSIGNED, STALE_VIEW, ASSIGN_CYCLE})
_ALLOWED = {entry: _FIXED for entry in ENTRIES}


@pytest.mark.parametrize("entry", ENTRIES)
@PROFILE
@given(data=st.data())
def test_every_replay_equals_eager_and_numpy(entry: str, data: st.DataObject) -> None:
    program = data.draw(_programs_for(entry, _ALLOWED[entry]), label="program")
    seed = data.draw(st.integers(0, 2 ** 32 - 1), label="argument seed")
    read_each = data.draw(st.booleans(), label="read each result before the next call")
    _differential(program, entry, seed, read_each)


# Each shape the engine once got wrong, forced through every entry: random programs reach some
# of them rarely.
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("shape", sorted(_FIXED))
@settings(PROFILE, max_examples=6)
@given(data=st.data())
def test_each_fixed_shape(shape: str, entry: str, data: st.DataObject) -> None:
    program = data.draw(_programs_for(entry, force=shape), label="program")
    _differential(program, entry, data.draw(st.integers(0, 2 ** 32 - 1), label="argument seed"), True)
