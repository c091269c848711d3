"""`td.jit`: capture a tensor function once, replay it per call with microsecond overhead.

    @td.jit
    def step(x: td.Tensor) -> td.Tensor: ...
    step(x)   # call 1 runs normally, call 2 captures, later calls replay

Capture schedules the function's output graph once and hands it to the engine
(`tinydist.engine.capture`): every buffer bound once (inputs the caller passes are copied into
buffers the JIT owns; weights are bound where they live; intermediates get one arena), the
kernels compiled and linked into ONE native entry point that calls each kernel in order with its
buffer addresses baked in. A replay is then: check the signature, one batch of [copy inputs in,
call the entry point, copy outputs out], no Python graph at all. On host memory, with the queue
idle and the arguments computed, not even the batch: the replay runs on the caller's thread in
the queue's order (`tinydist.engine.replay.HostFrame`): for a 64-64-10 MLP, 12.2 us of CPU
through `step(x).numpy()` and 5.7 us through `call_numpy` where numpy's own forward took 6.5 us
(bench/replay.py, a loaded machine). This module is the frontend's
half: the Python function, its arguments and the Tensors it returns.

The signature is checked on every replay: argument names and count, shapes, dtypes, devices, and
the Python values that were baked in at capture (a changed scalar is an error, never the old
value silently). Inputs are copied in, so feeding an output back as the next input is safe; an
input the function assigns to is copied back out after the replay.

A graph over several host devices replays as one native call per device and queue, ordered
between them by waits baked at capture (`tinydist.engine.streams`); on other devices, as one batch
per run of calls, ordered by the runtime's access logs. `tinydist.engine.replay` says which
strategy applies when; `td.jit(replay=...)` forces one.

Each parameter is its own input of the captured graph, even when the same Tensor is passed for
two of them at capture; an output that is an argument or a weight, unchanged, is returned as it
is, as the function itself would.

A replay on several devices is queued, not waited for: a loop that never reads a result runs
ahead of the devices. At TINYDIST_JIT_RUN_AHEAD replays (64) queued, a call waits until the devices
have caught up, so the inputs, commands and bookkeeping held for queued work stay bounded — and
the feeding loop and the devices' workers take turns in bursts instead of contending for the GIL
at every step.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tinydist.base.config import settings
from tinydist.base.errors import TinydistError
from tinydist.engine.capture import Capture
from tinydist.engine.realize import realize
from tinydist.engine.replay import REPLAYS, Replay, ReplayUnfit
from tinydist.frontend.tensor import Tensor, observe_assigns
from tinydist.graph.lazy import LazyNode, buffer_node
from tinydist.runtime.buffer import Buffer
from tinydist.runtime import command_queue
from tinydist.runtime.command_queue import BUSY
from tinydist.runtime.device import Completion
from tinydist.runtime.registry import canonical_name
from tinydist.schedule import create_schedule

__all__ = ["REPLAYS", "JitError", "TinyJit", "jit"]


class JitError(TinydistError, ValueError):
    """A replay's arguments differ from the captured signature."""


@dataclass(frozen=True)
class _ArgSpec:
    name: str
    kind: str                 # "tensor" or "value"
    shape: tuple[int, ...] = ()
    dtype: str = ""
    device: str = ""
    value: Any = None

    @functools.cached_property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    def describe(self) -> str:
        if self.kind == "tensor":
            return f"Tensor {self.dtype}{list(self.shape)} on {self.device}"
        return f"{type(self.value).__name__} {self.value!r}"


def _flatten(result: Any) -> tuple[list[Tensor], Callable[[list[Any]], Any]]:
    """Output tensors of a result (a Tensor, or a tuple/list/dict of them) and how to rebuild it."""
    if isinstance(result, Tensor):
        return [result], lambda ts: ts[0]
    if isinstance(result, (tuple, list)) and all(isinstance(r, Tensor) for r in result):
        kind = type(result)
        return list(result), lambda ts: kind(ts)
    if isinstance(result, dict) and all(isinstance(r, Tensor) for r in result.values()):
        keys = list(result)
        return [result[k] for k in keys], lambda ts: dict(zip(keys, ts))
    raise JitError(f"a jitted function must return a Tensor or a tuple/list/dict of Tensors, got {type(result).__name__}")


class _Captured:
    """A capture and what the frontend adds: which outputs are computed, which are returned
    unchanged (an argument, by position, or a weight), and how to rebuild the result.

    `keys` (the arguments' shape, dtype and device, when every argument is a Tensor and the
    capture has a host frame) admit a call to the frame loop's paths: `replay_now` and
    `replay_arrays_now` check a call with one tuple compare per argument and run it on the
    caller's thread (`HostFrame`); anything else — a lazy or busy argument, another shape, a
    device with unfinished work — returns BUSY, and the general path checks, says what was
    wrong or queues the replay."""

    def __init__(self, capture: Capture, returned: list[tuple[str, Any]], rebuild: Callable[[list[Any]], Any],
                 tensors: list[Tensor] | None, positional: bool) -> None:
        self.capture, self.returned, self.rebuild = capture, returned, rebuild
        self.all_tensors = tensors is not None  # every argument a Tensor: call_numpy may take arrays for them all
        self.all_computed = all(kind == "computed" for kind, _ in returned)
        self.frame = capture.frame if tensors is not None else None
        # a call's positional arguments are the captured ones only for a plain positional signature
        self.tensor_frame = self.frame if positional else None
        self.keys = [(t.shape, t.dtype, t.device) for t in tensors or ()]
        self.array_keys = [(shape, dtype.np) for shape, dtype, _ in self.keys]

    @property
    def strategy(self) -> Replay:
        return self.capture.strategy

    def replay(self, args: list[Tensor], inline: bool) -> tuple[Any, list[Completion]]:
        buffers, completions = self.capture.replay([t.node.buffer for t in args], inline)  # type: ignore[misc]
        return self._result(buffers, args), completions

    def replay_now(self, args: tuple[Any, ...]) -> Any:
        """The result of a Tensor call replayed on this thread now, or BUSY (class docstring)."""
        frame, keys = self.tensor_frame, self.keys
        if frame is None or len(args) != len(keys):
            return BUSY
        buffers = []
        for arg, (shape, dtype, device) in zip(args, keys):
            if not isinstance(arg, Tensor):
                return BUSY
            node = arg.node
            buffer = node.buffer
            if buffer is None or node.shape != shape or node.dtype is not dtype or node.device != device:
                return BUSY
            buffers.append(buffer)
        outputs = frame.replay_now(buffers)
        return BUSY if outputs is BUSY else self._result(outputs, args)

    def _result(self, buffers: list[Buffer], args: Sequence[Tensor]) -> Any:
        computed = [Tensor(buffer_node(buffer, dtype, shape, device))
                    for buffer, (shape, dtype, device) in zip(buffers, self.capture.output_specs)]
        return self.rebuild(computed if self.all_computed else self._outputs(iter(computed), args))

    def replay_arrays_now(self, arrays: tuple[Any, ...]) -> Any:
        """The result of a call_numpy with the captured shapes and dtypes, run by the host
        frame; BUSY for anything else (class docstring)."""
        frame, keys = self.frame, self.array_keys
        if frame is None or len(arrays) != len(keys):
            return BUSY
        for array, (shape, dtype) in zip(arrays, keys):
            if not isinstance(array, np.ndarray) or array.shape != shape or array.dtype != dtype:
                return BUSY
        results = frame.run(arrays)
        return self.rebuild(results if self.all_computed else self._numpy_outputs(results, arrays))

    def replay_arrays(self, arrays: list[np.ndarray], devices: list[str]) -> Any:
        return self.rebuild(self._numpy_outputs(self.capture.replay_arrays(arrays, devices), arrays))

    def _numpy_outputs(self, computed: list[np.ndarray], arrays: Sequence[np.ndarray]) -> list[Any]:
        outputs = self._outputs(iter(computed), arrays)
        return [t.numpy() if isinstance(t, Tensor) else t for t in outputs]

    def _outputs(self, computed: Any, args: Sequence[Any]) -> list[Any]:
        outputs: list[Any] = []
        for kind, what in self.returned:
            outputs.append(next(computed) if kind == "computed" else args[what] if kind == "argument" else what)
        return outputs


class TinyJit:
    """A jitted function; see the module docstring."""

    def __init__(self, fn: Callable[..., Any], replay: str = "auto", threads: int = 1) -> None:
        if replay not in REPLAYS:
            raise ValueError(f"replay must be one of {', '.join(REPLAYS)}, got {replay!r}")
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise ValueError(f"threads must be a positive int (1: the calling thread alone), got {threads!r}")
        self.fn = fn
        self.replay = replay
        self.threads = threads
        self.signature = inspect.signature(fn)
        self.calls = 0
        self.queued = 0  # replays since the caller last waited for the devices to catch up
        self._tracing = False  # inside `_traced`: the call it wraps is not wrapped again
        self.captured: _Captured | None = None
        self.specs: tuple[_ArgSpec, ...] = ()
        # the parameter names, when every parameter is plain positional without a default: a call
        # passing exactly those binds by position (inspect's binding costs microseconds a call)
        plain = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        parameters = list(self.signature.parameters.values())
        simple = all(p.kind in plain and p.default is inspect.Parameter.empty for p in parameters)
        self._positional: tuple[str, ...] | None = tuple(p.name for p in parameters) if simple else None
        functools.update_wrapper(self, fn)

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, Any]]:
        names = self._positional
        if names is not None and not kwargs and len(args) == len(names):  # the per-frame call: nothing to bind
            return list(zip(names, args))
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise JitError(f"{self.fn.__name__}: {exc}") from None
        bound.apply_defaults()
        flat: list[tuple[str, Any]] = []
        for name, value in bound.arguments.items():
            kind = self.signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                flat.extend((f"{name}[{i}]", v) for i, v in enumerate(value))
            elif kind is inspect.Parameter.VAR_KEYWORD:
                flat.extend((f"{name}[{k!r}]", v) for k, v in value.items())
            else:
                flat.append((name, value))
        return flat

    @staticmethod
    def _spec(name: str, value: Any) -> _ArgSpec:
        if isinstance(value, Tensor):
            return _ArgSpec(name, "tensor", value.shape, value.dtype.name, value.device)
        return _ArgSpec(name, "value", value=value)

    def _check(self, flat: list[tuple[str, Any]]) -> None:
        if len(flat) != len(self.specs):
            raise JitError(f"{self.fn.__name__} was captured with {len(self.specs)} arguments "
                           f"({', '.join(s.name for s in self.specs)}), called with {len(flat)}")
        for spec, (name, value) in zip(self.specs, flat):
            if spec.kind == "tensor":
                if not isinstance(value, Tensor):
                    raise JitError(f"argument {name!r}: captured as {spec.describe()}, got {type(value).__name__}")
                got = (value.shape, value.dtype.name, value.device)
                if got != (spec.shape, spec.dtype, spec.device):
                    raise JitError(f"argument {name!r}: captured as {spec.describe()}, got {self._spec(name, value).describe()}")
            elif isinstance(value, Tensor) or type(value) is not type(spec.value) or not _same_value(value, spec.value):
                raise JitError(f"argument {name!r} was {spec.describe()} at capture and is {self._spec(name, value).describe()} now; "
                               "Python values are baked into the captured graph — pass a Tensor to vary it, or make a new jit")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if command_queue.TRACER is not None and not self._tracing:
            return self._traced(self.__call__, *args, **kwargs)
        captured = self.captured
        if captured is not None and not kwargs:
            result = captured.replay_now(args)  # the frame loop: done when it returns, nothing queued
            if result is not BUSY:
                self.calls += 1
                return result
        result, completions = self._call(args, kwargs, inline=True)
        self.queued += 1
        if self.queued >= settings.JIT_RUN_AHEAD:  # bounded run-ahead (module docstring)
            for completion in completions:  # this replay's, so every earlier one's too (queues are FIFO)
                completion.wait_blocking()
            self.queued = 0
        return result

    def call_numpy(self, *arrays: Any, device: str | None = None) -> Any:
        """numpy arrays in (positionally, in place of the function's Tensor arguments), numpy
        arrays out: the lowest-overhead replay, for a frame loop. Until the capture, each array
        becomes a Tensor on `device` (default: the default device); after it, on the device its
        argument was captured on, which `device`, when given, must name."""
        if command_queue.TRACER is not None and not self._tracing:
            return self._traced(self.call_numpy, *arrays, device=device)
        captured = self.captured
        if captured is not None and device is None:
            result = captured.replay_arrays_now(arrays)
            if result is not BUSY:
                self.calls += 1
                return result
        if captured is not None and len(arrays) == len(self.specs) and captured.all_tensors:
            if device is not None and any(spec.device != canonical_name(device) for spec in self.specs):
                raise JitError(f"{self.fn.__name__} was captured with arguments on "
                               f"{', '.join(sorted({s.device for s in self.specs}))}; call_numpy(device={device!r}) names another")
            checked = [_host_array(spec, array) for spec, array in zip(self.specs, arrays)]
            self.calls += 1
            return captured.replay_arrays(checked, [spec.device for spec in self.specs])
        result = self(*(Tensor(a, device) if isinstance(a, np.ndarray) else a for a in arrays))
        outputs, rebuild = _flatten(result)
        return rebuild([t.numpy() for t in outputs])

    def _traced(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`method(*args, **kwargs)` as a span on the host's `jit` lane: `jit run`, `jit capture`
        or `jit replay` and the function's name (a frame replay submits nothing the queues see)."""
        tracer = command_queue.TRACER
        phase = "replay" if self.captured is not None else "capture" if self.calls else "run"
        started = time.perf_counter_ns()
        self._tracing = True
        try:
            return method(*args, **kwargs)
        finally:
            self._tracing = False
            tracer.add_span("host", "jit", f"jit {phase} {getattr(self.fn, '__name__', 'fn')}", "python", started,
                            time.perf_counter_ns(), {"calls": self.calls})

    async def acall(self, *args: Any, **kwargs: Any) -> Any:
        """The same call for async code: replays without blocking the event loop and awaits it."""
        result, completions = self._call(args, kwargs, inline=False)
        for completion in completions:
            await completion.wait()
        return result

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any], inline: bool) -> tuple[Any, list[Completion]]:
        flat = self._bind(args, kwargs)
        tensors = [v for _, v in flat if isinstance(v, Tensor)]
        realize([t.node for t in tensors])
        self.calls += 1
        if self.captured is not None:
            self._check(flat)
            return self.captured.replay(tensors, inline)
        if self.calls == 1:  # a normal run first: lazily built state (weights …) gets realized
            result = self.fn(*args, **kwargs)
            outputs, _ = _flatten(result)
            return result, realize([t.node for t in outputs])
        return self._capture(args, kwargs, flat, tensors, inline)

    def _capture(self, args: tuple[Any, ...], kwargs: dict[str, Any], flat: list[tuple[str, Any]],
                 tensors: list[Tensor], inline: bool) -> tuple[Any, list[Completion]]:
        self.specs = tuple(self._spec(name, value) for name, value in flat)
        # Every parameter is an input of its own: a Tensor passed for two parameters reaches the
        # function as two Tensors over the same memory, so a replay may pass two different ones.
        given = [t.node for t in tensors]
        seen: set[int] = set()
        substitutes: dict[int, Tensor] = {}  # id of a repeated Tensor argument -> the Tensor the function gets
        for position, tensor in enumerate(tensors):
            if id(tensor.node) in seen:
                substitute = Tensor(buffer_node(tensor.node.buffer, tensor.dtype, tensor.shape, tensor.device))  # type: ignore[arg-type]
                substitutes[position] = substitute
                given[position] = substitute.node
            seen.add(id(tensor.node))
        if substitutes:
            args, kwargs = self._substituted(args, kwargs, substitutes)
        arg_nodes = {id(node): i for i, node in enumerate(given)}
        with observe_assigns() as assigns:
            result = self.fn(*args, **kwargs)
        outputs, rebuild = _flatten(result)
        returned: list[tuple[str, Any]] = []
        computed: list[LazyNode] = []
        for tensor in outputs:
            node = tensor.node
            if not node.realized:
                returned.append(("computed", None))
                computed.append(node)
            elif id(node) in arg_nodes:
                returned.append(("argument", arg_nodes[id(node)]))
            else:
                returned.append(("unchanged", tensor))
        # assigns made inside the function (e.g. an optimizer's weight updates) are part of the step
        side_effects = [a for a in assigns if not a.realized]
        if not computed and not side_effects:
            raise JitError(f"{self.fn.__name__} returns only inputs or already computed tensors, unchanged, and assigns "
                           "nothing; there is nothing to capture — return a computed value")
        schedule, inputs = create_schedule(computed + side_effects)
        arguments = {number: arg_nodes[id(node)] for number, node in enumerate(inputs) if id(node) in arg_nodes}
        try:
            capture = Capture(schedule, inputs, arguments, computed, self.replay, self.threads)
        except ReplayUnfit as exc:
            raise JitError(f"{self.fn.__name__}: {exc}") from None
        self.captured = _Captured(capture, returned, rebuild,
                                  tensors if all(spec.kind == "tensor" for spec in self.specs) else None,
                                  self._positional is not None)
        # An assigned weight now lives in the JIT's memory. An assigned argument keeps the caller's
        # buffer, which the replay below reads (the value before the call) and then writes back,
        # as every later replay does: it must not alias memory that later replays reuse.
        written = {number: position for position, number in capture.written_args}
        for node, number in zip(side_effects, schedule.targets[len(computed):]):
            memory = schedule.aliases.get(number, number)
            node.buffer = given[written[memory]].buffer if memory in written else capture.buffer(memory)
        return self.captured.replay(tensors, inline)

    def _substituted(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                     substitutes: dict[int, Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's arguments with the Tensor arguments numbered in `substitutes` (in `_bind`'s
        order) replaced."""
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        numbers = itertools.count()

        def swap(value: Any) -> Any:
            return substitutes.get(next(numbers), value) if isinstance(value, Tensor) else value
        for name, value in bound.arguments.items():
            kind = self.signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                bound.arguments[name] = tuple(swap(v) for v in value)
            elif kind is inspect.Parameter.VAR_KEYWORD:
                bound.arguments[name] = {k: swap(v) for k, v in value.items()}
            else:
                bound.arguments[name] = swap(value)
        return bound.args, bound.kwargs


def _host_array(spec: _ArgSpec, array: Any) -> np.ndarray:
    if not isinstance(array, np.ndarray):
        raise JitError(f"argument {spec.name!r}: call_numpy takes numpy arrays, got {type(array).__name__}")
    if array.shape != spec.shape or array.dtype != spec.np_dtype:
        raise JitError(f"argument {spec.name!r}: captured as {spec.describe()}, got ndarray {array.dtype.name}{list(array.shape)}")
    return array if array.flags.c_contiguous else np.asarray(array, order="C")


def _same_value(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) if not isinstance(a, float) or a == a else b != b
    except Exception:  # noqa: BLE001 - objects without a usable == compare by identity
        return a is b


def jit(fn: Callable[..., Any] | None = None, *, replay: str = "auto", threads: int = 1) -> Any:
    """Capture `fn` on its second call and replay it afterwards; see the module docstring.
    `@td.jit(replay="runs")` forces a replay strategy (one of REPLAYS) instead of choosing one;
    `threads=N` splits the big kernels of a one-entry-point replay across N threads (the caller's
    and the engine's intra-op workers: `tinydist.engine.parallel`)."""
    if replay not in REPLAYS:
        raise ValueError(f"replay must be one of {', '.join(REPLAYS)}, got {replay!r}")
    if fn is None:
        return lambda f: TinyJit(f, replay, threads)
    return TinyJit(fn, replay, threads)
