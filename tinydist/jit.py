"""`td.jit`: capture a tensor function once, replay it per call with microsecond overhead.

    @td.jit
    def step(x: td.Tensor) -> td.Tensor: ...
    step(x)   # call 1 runs normally, call 2 captures, later calls replay

Capture schedules the function's output graph once, binds every buffer once (inputs the caller
passes are copied into buffers the JIT owns; weights are bound where they live; intermediates get
one arena), compiles the kernels and links them into ONE native entry point that calls each kernel in order with its buffer addresses
baked in. A replay is then: check the signature, one batch of [copy inputs in, call the entry
point, copy outputs out], no Python graph at all.

The signature is checked on every replay: argument names and count, shapes, dtypes, devices, and
the Python values that were baked in at capture (a changed scalar is an error, never the old
value silently). Inputs are copied in, so feeding an output back as the next input is safe; an
input the function assigns to is copied back out after the replay.

A graph over several host devices replays as one native call per device and queue, ordered
between them by waits baked at capture (`tinydist.jit_streams`); on other devices, as one batch
per run of calls, ordered by the runtime's access logs.

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
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tinydist.codegen.compile_cache import CompileCache
from tinydist.codegen.compiler import HostCompiler
from tinydist.config import settings
from tinydist.errors import TinydistError
from tinydist.jit_streams import NativeStreams, overlap, span
from tinydist.lazy import LazyNode, buffer_node
from tinydist.realize import programs, realize
from tinydist.runtime.buffer import Buffer
from tinydist.runtime.device import Completion, Device
from tinydist.runtime.engine import get_engine
from tinydist.runtime.program import Program
from tinydist.schedule import Schedule, create_schedule
from tinydist.schedule.items import Call, GatherCall, KernelCall, MatmulCall, SliceCall
from tinydist.tensor import Tensor, observe_assigns

_entry_ids = itertools.count()
# the calls `_link` turns into one native entry; copies, gathers and slice kernels replay as commands
_LINKABLE = (KernelCall, MatmulCall)
# how a capture replays: "auto" picks the first that applies, the others force one (tests use them)
REPLAYS = ("auto", "entry", "runs", "streams")


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

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    def describe(self) -> str:
        if self.kind == "tensor":
            return f"Tensor {self.dtype}{list(self.shape)} on {self.device}"
        return f"{type(self.value).__name__} {self.value!r}"


def _flatten(result: Any) -> tuple[list[Tensor], Callable[[list[Tensor]], Any]]:
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


class _Run:
    """Consecutive calls of a captured graph on one device and queue, replayed as one batch."""

    def __init__(self, device: Device, queue: str) -> None:
        self.device, self.queue = device, queue
        self.calls: list[Call] = []
        self.commands: list[tuple[Any, tuple[Any, ...]]] = []
        self._touched: dict[int, tuple[Buffer, bool]] = {}

    def add(self, fn: Any, writes: list[Buffer], reads: list[Buffer], scalars: tuple[Any, ...],
            order: tuple[int, ...] | None = None) -> None:
        """One command: `fn(*written addresses, *read addresses, *scalars)` (or in `order`)."""
        for buffer, write in [(w, True) for w in writes] + [(r, False) for r in reads]:
            seen = self._touched.get(id(buffer))
            self._touched[id(buffer)] = (buffer, write or (seen is not None and seen[1]))
        addresses = [b.address for b in (*writes, *reads)]
        if order is not None:
            addresses = [addresses[i] for i in order]
        self.commands.append((fn, (*addresses, *scalars)))

    @property
    def accesses(self) -> list[tuple[Buffer, bool]]:
        return list(self._touched.values())

    def keep(self, tracked: Callable[[Buffer, bool], bool]) -> None:
        """Track only the accesses `tracked(buffer, write)` accepts."""
        self._touched = {key: (buffer, write) for key, (buffer, write) in self._touched.items() if tracked(buffer, write)}


class _Captured:
    """One captured graph: buffers bound, kernels compiled, entry point linked."""

    def __init__(self, schedule: Schedule, inputs: list[LazyNode], arg_nodes: dict[int, int],
                 outputs: list[LazyNode], rebuild: Callable[[list[Tensor]], Any], replay: str = "auto") -> None:
        engine = get_engine()
        self.schedule = schedule
        self.rebuild = rebuild
        self.output_specs = [(node.shape, node.dtype) for node in outputs]
        self.output_bytes = [node.nbytes for node in outputs]
        self.output_devices = [node.device for node in outputs]
        devices = set(self.output_devices) | {call.device for call in schedule.linear}
        # One device with only linkable calls links into one entry point; anything else replays in runs.
        single = len(devices) == 1 and all(isinstance(c, _LINKABLE) for c in schedule.linear)
        if replay == "entry" and not single:
            raise JitError("replay='entry' needs a graph on one device of kernels and matmuls only; "
                           f"this one runs on {sorted(devices)} with {sorted({type(c).__name__ for c in schedule.linear})}")
        single = single and replay in ("auto", "entry")
        self.device: Device | None = engine.device(devices.pop()) if single else None
        self.buffers: list[Buffer | None] = [None] * len(schedule.specs)
        self.arg_slots: list[tuple[int, int]] = []      # (argument index, buffer number)
        for number, node in enumerate(inputs):
            position = arg_nodes.get(id(node))
            if position is None:
                self.buffers[number] = node.buffer    # a weight: bound where it lives
            else:
                self.buffers[number] = engine.device(node.device).allocator.alloc(node.nbytes)
                self.arg_slots.append((position, number))
        self.arenas: list[Buffer] = []
        for (device_name, lane), size in schedule.plan.arena_bytes.items():
            if size:
                arena = engine.device(device_name).allocator.alloc(size)
                self.arenas.append(arena)
                for number, where in schedule.plan.arena_of.items():
                    if where == (device_name, lane):
                        self.buffers[number] = arena.view(schedule.plan.offsets[number], schedule.specs[number].nbytes)
        for number in range(schedule.n_inputs, len(schedule.specs)):
            spec = schedule.specs[number]
            if self.buffers[number] is None and number not in schedule.aliases and spec.nbytes:
                self.buffers[number] = engine.device(spec.device).allocator.alloc(spec.nbytes)
        for version, memory in schedule.aliases.items():
            self.buffers[version] = self.buffers[memory]
        self.output_numbers = [schedule.aliases.get(n, n) for n in schedule.targets[:len(outputs)]]
        # inputs the function assigned to: their new value is copied back to the caller's tensor
        self.written_args = [(position, number) for position, number in self.arg_slots
                             if number in schedule.aliases.values()]
        self.entry = self._link(self.device, self.schedule.linear) if self.device is not None else None
        # Buffers the JIT owns are touched only by its replays, in FIFO order on one queue: only
        # the weights it shares with the rest of the program need ordering against other work.
        private = {number for _, number in self.arg_slots}
        shared: dict[int, tuple[Buffer, bool]] = {}
        for number in range(len(inputs)):
            buffer = self.buffers[number]
            if number not in private and buffer is not None:
                written = number in schedule.aliases.values()
                shared[id(buffer)] = (buffer, written or shared.get(id(buffer), (buffer, False))[1])
        self.accesses = list(shared.values())
        # for a replay in runs: the argument copies made at the start of run k, the outputs copied
        # out at its end; the rest get batches of their own (see _place_copies)
        self.args_into: dict[int | None, list[tuple[int, int]]] = {}
        self.outputs_from: dict[int | None, list[int]] = {}
        self.runs: list[_Run] = []
        self.streams: NativeStreams | None = None  # several host devices: one native call per queue
        if self.device is None:
            runs = self._bind_runs()
            if replay == "streams" or (replay == "auto" and settings.JIT_NATIVE_STREAMS == "on"):
                b = self.buffers
                self.streams = NativeStreams.build(
                    runs, [(position, b[number]) for position, number in self.arg_slots],
                    [(b[n], engine.device(name)) for n, name in zip(self.output_numbers, self.output_devices)],
                    [(position, b[number]) for position, number in self.written_args],
                    [buffer for buffer, _ in self.accesses])
                if self.streams is None and replay == "streams":
                    raise JitError("replay='streams' needs host devices whose calls are native code, on a machine with a futex")
            if self.streams is None:
                self._prepare_runs(runs)
                self.runs = runs
        self.arg_copies = [(position, self.buffers[number].address, self.buffers[number].nbytes)
                           for position, number in self.arg_slots]
        self.output_copies = [(self.buffers[n].address, self.buffers[n].nbytes) for n in self.output_numbers]
        self.written_copies = [(position, self.buffers[number].address, self.buffers[number].nbytes)
                               for position, number in self.written_args]

    def _bind_runs(self) -> list[_Run]:
        """The LINEAR as runs of calls on one device and queue, every argument bound once, each
        call a command of its own and every buffer it touches tracked."""
        engine = get_engine()
        runs: list[_Run] = []
        # a run ends after a call whose output another device or queue reads: a run's completion is
        # the only signal other queues wait for, so the reader starts then, not at the end of a longer run
        read_on: dict[int, set[tuple[str, str]]] = {}
        for call in self.schedule.linear:
            for number in call.reads:
                read_on.setdefault(number, set()).add((call.device, call.queue))
        ends_run = False
        for call in self.schedule.linear:
            device = engine.device(call.device)
            if ends_run or not runs or runs[-1].device is not device or runs[-1].queue != call.queue:
                runs.append(_Run(device, call.queue))
            ends_run = any(read_on.get(n, set()) - {(call.device, call.queue)} for n in call.writes)
            run, b = runs[-1], self.buffers
            run.calls.append(call)
            if isinstance(call, KernelCall):
                run.add(programs.kernel(call.ast, device).cfunc, [b[call.out]], [b[i] for i in call.inputs], ())
            elif isinstance(call, MatmulCall):
                scalars = (call.batch, call.m, call.n, call.k, call.a_batch_stride, call.b_batch_stride, call.m * call.n)
                run.add(programs.matmul(call.dtype, device, call.strided).cfunc, [b[call.out], b[call.workspace]],
                        [b[call.a], b[call.b]], scalars, order=(0, 2, 3, 1))
            elif isinstance(call, SliceCall):
                run.add(programs.kernel(call.ast, device).cfunc, [b[n].view(call.start, call.nbytes) for n in call.outs],
                        [b[n].view(call.start, call.nbytes) for n in call.inputs], ())
            elif isinstance(call, GatherCall):
                for src, offset in zip(call.srcs, call.offsets):
                    source = b[src]
                    run.add(device.copy_command("d2d", source.device), [b[call.out].view(offset, source.nbytes)],
                            [source], (source.nbytes,))
            else:
                source = b[call.src]
                run.add(device.copy_command("d2d", source.device), [b[call.out]], [source], (call.nbytes,))
        return runs

    def _prepare_runs(self, runs: list[_Run]) -> None:
        """Runs replayed as batches: place the argument and output copies, track only the accesses
        the access logs must order, and link each run of kernels into one entry point."""
        self._place_copies(runs)
        self._track_only_shared(runs)
        for run in runs:
            # a run of kernels is linked into one native call: the queue's worker takes the GIL
            # once per run instead of after every kernel (another thread feeding the devices holds it)
            if len(run.calls) > 1 and all(isinstance(call, _LINKABLE) for call in run.calls):
                run.commands = [(self._link(run.device, run.calls).cfunc, ())]

    def _track_only_shared(self, runs: list[_Run]) -> None:
        """Keep in each run's tracked accesses only those the runtime's access logs must order:
        memory another queue of this capture also touches (in a conflicting way), and buffers the
        caller sees (arguments, weights, outputs). The rest are ordered by their own queue's FIFO,
        across replays too — and each tracked access costs a scan of its base's pending records
        at every replay, on the thread that feeds the devices."""
        # by memory, not by object: a gather or a slice kernel writes views of the caller's outputs
        private = {number for _, number in self.arg_slots}
        seen = [span(self.buffers[n]) for n in range(self.schedule.n_inputs)
                if self.buffers[n] is not None and n not in private]
        touched = [(span(buffer), write, (run.device.name, run.queue)) for run in runs for buffer, write in run.accesses]
        # the JIT's own argument and output buffers: written by the copy in, read by the copy out,
        # on their device's compute queue (in a run there or in a batch of their own)
        touched += [(span(self.buffers[n]), True, (self.buffers[n].device.name, "compute")) for _, n in self.arg_slots]
        touched += [(span(self.buffers[n]), False, (self.buffers[n].device.name, "compute")) for n in self.output_numbers]

        def tracked(buffer: Buffer, write: bool, stream: tuple[str, str]) -> bool:
            memory = span(buffer)
            if any(overlap(memory, other) for other in seen):
                return True
            return any(other != stream and (write or w) and overlap(memory, where) for where, w, other in touched)
        for run in runs:
            stream = (run.device.name, run.queue)
            run.keep(lambda buffer, write: tracked(buffer, write, stream))

    def _place_copies(self, runs: list[_Run]) -> None:
        """Copy each argument in at the start of the first run on its buffer's compute queue, when
        no earlier run touches it; copy each output out at the end of the last run on its
        device's compute queue, when no later run writes it. A batch of its own would cost the
        feeding thread a submission and the queue's worker a wake-up, every replay. Arguments
        the function assigns to keep their own batches (their copy back reads the same buffer),
        and so do arguments a run on another queue reads: a run signals only when all of it is
        done, and that reader (a data-parallel replica's half of the batch) would wait for it."""
        streams = [(run.device.name, run.queue) for run in runs]
        assigned = {number for _, number in self.written_args}

        def touching(number: int) -> list[int]:
            memory = self.schedule.aliases
            return [k for k, run in enumerate(runs)
                    if any(memory.get(n, n) == number for call in run.calls for n in (*call.reads, *call.writes))]
        for position, number in self.arg_slots:
            stream = (self.buffers[number].device.name, "compute")
            users = touching(number)
            first = streams.index(stream) if stream in streams and number not in assigned else None
            if first is not None and users and (users[0] < first or any(streams[k] != stream for k in users)):
                first = None
            self.args_into.setdefault(first, []).append((position, number))
        for i, number in enumerate(self.output_numbers):
            stream = (self.output_devices[i], "compute")
            last = len(streams) - 1 - streams[::-1].index(stream) if stream in streams else None
            writers = [k for k in touching(number)
                       if any(self.schedule.aliases.get(n, n) == number for call in runs[k].calls for n in call.writes)]
            if last is not None and writers and writers[-1] > last:
                last = None
            self.outputs_from.setdefault(last, []).append(i)

    def _link(self, device: Device, calls: Sequence[Call]) -> Program:
        """One native function calling every kernel of `calls` in order, addresses bound."""
        lines = []
        launches = []  # (program, arguments) for devices that link launches themselves (CUDA)
        for call in calls:
            if isinstance(call, KernelCall):
                program = programs.kernel(call.ast, device)
                args = [self.buffers[call.out], *(self.buffers[i] for i in call.inputs)]
                launches.append((program, [b.address for b in args]))
                operands = [f"ptr inttoptr (i64 {b.address} to ptr)" for b in args]
            else:
                assert isinstance(call, MatmulCall)
                program = programs.matmul(call.dtype, device, call.strided)
                pointers = [self.buffers[n] for n in (call.out, call.a, call.b, call.workspace)]
                scalars = (call.batch, call.m, call.n, call.k, call.a_batch_stride, call.b_batch_stride, call.m * call.n)
                launches.append((program, [*(b.address for b in pointers), *scalars]))
                operands = [f"ptr inttoptr (i64 {b.address} to ptr)" for b in pointers] + [f"i64 {v}" for v in scalars]
            lines.append(f"  call void inttoptr (i64 {program.address} to ptr)({', '.join(operands)})")
        if hasattr(device, "link_launches"):  # kernels that are not host code: the device links them
            return device.link_launches(launches)
        name = f"jit_entry_{next(_entry_ids)}_{id(self):x}"
        ir_text = f"define void @{name}() {{\nentry:\n" + "\n".join(lines) + "\n  ret void\n}\n"
        object_code = CompileCache(HostCompiler(opt_level=1), enabled=False).compile(ir_text)
        return device.load_program(object_code, name, [])

    def replay(self, args: list[Tensor], inline: bool) -> tuple[Any, list[Completion]]:
        if self.streams is not None:
            buffers, completions = self.streams.replay(args)
            return self.rebuild([Tensor(buffer_node(buffer, dtype, shape, name)) for buffer, (shape, dtype), name
                                 in zip(buffers, self.output_specs, self.output_devices)]), completions
        if self.device is None:
            return self._replay_runs(args)
        device = self.device
        out_buffers = [device.allocator.alloc(nbytes) for nbytes in self.output_bytes]
        batch = device.batch("compute")
        copy = device.host_copy()
        for position, address, nbytes in self.arg_copies:
            batch.command(copy, (address, batch.track(args[position].node.buffer, False), nbytes))
        for buffer, write in self.accesses:
            batch.track(buffer, write)
        batch.command(self.entry.cfunc, ())
        for out, (address, nbytes) in zip(out_buffers, self.output_copies):
            batch.command(copy, (batch.track(out, True), address, nbytes))
        for position, address, nbytes in self.written_copies:
            batch.command(copy, (batch.track(args[position].node.buffer, True), address, nbytes))
        completion = batch.submit(inline=inline)
        outputs = [Tensor(buffer_node(buffer, dtype, shape, device.name))
                   for buffer, (shape, dtype) in zip(out_buffers, self.output_specs)]
        return self.rebuild(outputs), [completion]

    def _replay_runs(self, args: list[Tensor]) -> tuple[Any, list[Completion]]:
        """Several devices (or copies): one batch per run; the runtime's access logs order the
        runs across queues and devices exactly as they order a realize."""
        engine = get_engine()
        completions = []
        outputs: list[Tensor] = [None] * len(self.output_numbers)  # type: ignore[list-item]

        def copy_out(batch: Any, i: int) -> None:
            (shape, dtype), name = self.output_specs[i], self.output_devices[i]
            out = engine.device(name).allocator.alloc(math.prod(shape) * dtype.itemsize)
            batch.copy(out, self.buffers[self.output_numbers[i]])
            outputs[i] = Tensor(buffer_node(out, dtype, shape, name))
        own: dict[Device, Any] = {}  # the argument copies that are not part of a run: one batch per device
        for position, number in self.args_into.get(None, ()):
            target = self.buffers[number]
            if target.device not in own:
                own[target.device] = target.device.batch("compute")
            own[target.device].copy(target, args[position].node.buffer)
        completions.extend(batch.submit() for batch in own.values())
        for k, run in enumerate(self.runs):
            batch = run.device.batch(run.queue)
            for position, number in self.args_into.get(k, ()):
                batch.copy(self.buffers[number], args[position].node.buffer)
            for buffer, write in run.accesses:
                batch.track(buffer, write)
            for fn, call_args in run.commands:
                batch.command(fn, call_args)
            for i in self.outputs_from.get(k, ()):
                copy_out(batch, i)
            completions.append(batch.submit())
        for i in self.outputs_from.get(None, ()):
            with engine.device(self.output_devices[i]).batch("compute") as batch:
                copy_out(batch, i)
            completions.append(batch.completion)
        for position, number in self.written_args:
            caller = args[position].node.buffer
            with caller.device.batch("compute") as batch:
                batch.copy(caller, self.buffers[number])
            completions.append(batch.completion)
        return self.rebuild(outputs), completions


    def replay_host(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """The frame-loop path on a host-memory device: copy the caller's arrays straight into
        the JIT's input buffers, run the entry point, copy the outputs into new arrays — one
        submission, run inline when the queue is idle, no Tensor objects made. The caller's
        arrays stay referenced here until the work is done: this call waits for it."""
        copy = self.device.host_copy()
        outputs = [np.empty(shape, dtype.np) for shape, dtype in self.output_specs]
        commands = [(copy, (address, array.__array_interface__["data"][0], nbytes))
                    for (_, address, nbytes), array in zip(self.arg_copies, arrays)]
        commands.append((self.entry.cfunc, ()))
        commands.extend((copy, (out.__array_interface__["data"][0], address, nbytes))
                        for out, (address, nbytes) in zip(outputs, self.output_copies))
        if any(buffer.accesses.conflicts(buffer.offset, buffer.offset + buffer.nbytes, write) for buffer, write in self.accesses):
            batch = self.device.batch("compute")  # shared weights are busy elsewhere: order after that work
            for buffer, write in self.accesses:
                batch.track(buffer, write)
            for fn, args in commands:
                batch.command(fn, args)
            completion = batch.submit(inline=True)
            timeline, value = completion.timeline, completion.value
        else:
            queue = self.device.queues["compute"]
            timeline, value = queue.timeline, queue.submit(commands, inline=True)
            if not timeline.reached(value):  # queued behind busy work: let other queues order after it
                for buffer, write in self.accesses:
                    buffer.accesses.record(buffer.offset, buffer.offset + buffer.nbytes, write, timeline, value)
        if not timeline.reached(value):
            timeline.wait_blocking(value)
        return outputs


class TinyJit:
    """A jitted function; see the module docstring."""

    def __init__(self, fn: Callable[..., Any], replay: str = "auto") -> None:
        if replay not in REPLAYS:
            raise ValueError(f"replay must be one of {', '.join(REPLAYS)}, got {replay!r}")
        self.fn = fn
        self.replay = replay
        self.signature = inspect.signature(fn)
        self.calls = 0
        self.queued = 0  # replays since the caller last waited for the devices to catch up
        self.captured: _Captured | None = None
        self.specs: tuple[_ArgSpec, ...] = ()
        self.tensor_positions: list[int] = []
        functools.update_wrapper(self, fn)

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, Any]]:
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
        result, completions = self._call(args, kwargs, inline=True)
        self.queued += 1
        if self.queued >= settings.JIT_RUN_AHEAD:  # bounded run-ahead (module docstring)
            for completion in completions:  # this replay's, so every earlier one's too (queues are FIFO)
                completion.wait_blocking()
            self.queued = 0
        return result

    def call_numpy(self, *arrays: Any) -> Any:
        """numpy arrays in (positionally, in place of the function's Tensor arguments), numpy
        arrays out: the lowest-overhead replay, for a frame loop. Captures like a normal call."""
        captured = self.captured
        if (captured is not None and captured.device is not None and captured.device.host_visible
                and len(arrays) == len(self.specs)
                and all(spec.kind == "tensor" for spec in self.specs)):
            checked = [_host_array(spec, array) for spec, array in zip(self.specs, arrays)]
            self.calls += 1
            return captured.rebuild(captured.replay_host(checked))
        result = self(*(Tensor(a) if isinstance(a, np.ndarray) else a for a in arrays))
        outputs, rebuild = _flatten(result)
        return rebuild([t.numpy() for t in outputs])

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
        self.specs = tuple(self._spec(name, value) for name, value in flat)
        # before the call: an argument the function assigns to gets a new node
        given = [t.node for t in tensors]
        arg_nodes = {id(node): i for i, node in enumerate(given)}
        with observe_assigns() as assigns:
            result = self.fn(*args, **kwargs)
        outputs, rebuild = _flatten(result)
        nodes = [t.node for t in outputs]
        if any(node.realized for node in nodes):
            raise JitError(f"{self.fn.__name__} returns an input or an already computed tensor unchanged; "
                           "there is nothing to capture — return a computed value")
        # assigns made inside the function (e.g. an optimizer's weight updates) are part of the step
        side_effects = [a for a in assigns if not a.realized]
        schedule, inputs = create_schedule(nodes + side_effects)
        self.captured = _Captured(schedule, inputs, arg_nodes, nodes, rebuild, self.replay)
        # An assigned weight now lives in the JIT's memory. An assigned argument keeps the caller's
        # buffer, which the replay below reads (the value before the call) and then writes back,
        # as every later replay does: it must not alias memory that later replays reuse.
        written = {number: position for position, number in self.captured.written_args}
        for node, number in zip(side_effects, schedule.targets[len(nodes):]):
            memory = schedule.aliases.get(number, number)
            node.buffer = given[written[memory]].buffer if memory in written else self.captured.buffers[memory]
        return self.captured.replay(tensors, inline)


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


def jit(fn: Callable[..., Any] | None = None, *, replay: str = "auto") -> Any:
    """Capture `fn` on its second call and replay it afterwards; see the module docstring.
    `@td.jit(replay="runs")` forces a replay strategy (one of REPLAYS) instead of choosing one."""
    if fn is None:
        return lambda f: TinyJit(f, replay)
    return TinyJit(fn, replay)
