"""A cached schedule lowered once, for every later realize of it: commands over its memory.

The schedule cache spares a realize the fusion, ordering and planning of a graph it has seen;
this spares it the lowering. Each run of consecutive calls on one device and queue (one batch)
keeps its commands as a native callable and where each argument comes from: an input, an arena
or a buffer of the schedule's own, at an offset, or an integer. A realize takes memory (inputs
where they live, one arena per device and lane, a buffer per target), makes the table of
addresses, and each command's arguments are one C-level lookup into it — no lowering, no program
looked up by its kernel's AST, no views, no checks of memory this module allocated itself. On a
device running host code of this process, each stretch of kernels between two points where the
batch may have to wait is one command of a native interpreter over the stretch's code (each
kernel's address and its arguments as memory number and offset, made once): the queue's worker
makes one call, the host fills a table of a few base addresses, however many kernels (not while
tracing, which shows the kernels one by one).

The access logs see only what another queue, another device or the caller can see: the inputs,
the schedule's own buffers (the targets: the caller gets them) and the arena bytes that a call on
another device or queue of the schedule also touches, one of the two writing (bytes, not buffer
numbers: the memory plan reuses bytes). The rest are intermediates one queue writes and reads in
its FIFO order; each access to them was a record in the arena's log before, and every record
scanned all the others. A batch orders an access before the command that makes it only where it
may have to wait: inputs, and bytes another stream of the schedule touches; a buffer of the
schedule's own that no other stream touches has nothing recorded but this queue's own work, so
its access is recorded from the batch's start. Each batch holds the arenas it uses
(`AccessLog.hold`), so their memory goes back only after the last of those batches is done.
A batch of little work (`INLINE_WORK`) that waits for nothing runs on the calling thread when its
queue is idle: cheaper than waking the queue's worker and being woken by it.

Where this does not apply (a buffer of no bytes in a call, anything `lower_call` refuses; for
one realize: an input on a device the engine knows by another object, a device error) realize
binds and issues call by call as it always has, which also raises the errors a bad call deserves.
"""

from __future__ import annotations

import ctypes
import functools
import math
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, cast

from tinydist.base.errors import DeviceError, TinydistError
from tinydist.base.logs import get_logger
from tinydist.codegen.compile_cache import compile_portable_glue
from tinydist.engine.commands import Launch, compile_ahead, lower_call
from tinydist.graph.lazy import LazyNode
from tinydist.runtime import command_queue
from tinydist.runtime.buffer import Buffer
from tinydist.runtime.device import Completion, Device, DeviceState
from tinydist.runtime.engine import Engine
from tinydist.runtime.faults import faults
from tinydist.runtime.program import Program
from tinydist.schedule import Schedule
from tinydist.schedule.items import Call, KernelCall, MatmulCall

log = get_logger(layer="lowered")

# (memory number, byte offset in it, bytes, writes?)
Access = tuple[int, int, int, bool]
# the arguments of one command: made from the address table, or (for the interpreter) where its
# stretch starts in the run's code and how many kernels it has
Getter = Callable[[Sequence[int]], tuple[int, ...]] | tuple[int, int]


class _Unfit(TinydistError):
    """This schedule is realized call by call (the message says why)."""


class _NotNow(TinydistError):
    """This realize goes call by call; the next may be lowered (the message says why)."""


class _Place:
    """Where a bound buffer would be while the schedule is lowered: `nbytes` at `offset` in memory
    number `memory`, on `device`. `lower_call` takes it for the buffer, and views of it (a
    gather's pieces, a slice kernel's ranges) as it would take views of a buffer."""

    __slots__ = ("memory", "offset", "nbytes", "device")

    def __init__(self, memory: int, offset: int, nbytes: int, device: Device) -> None:
        self.memory, self.offset, self.nbytes, self.device = memory, offset, nbytes, device

    def view(self, offset: int, nbytes: int) -> _Place:
        if offset < 0 or nbytes < 0 or offset > self.nbytes or nbytes > self.nbytes - offset:
            raise _Unfit(f"a view [{offset}, {offset}+{nbytes}) outside {self.nbytes} bytes")
        return _Place(self.memory, self.offset + offset, nbytes, self.device)


@dataclass(frozen=True, slots=True)
class _Command:
    fn: Any                  # the native callable
    args: tuple[Any, ...]    # _Place or int, in its signature's order
    program: Program | None  # the kernel the interpreter calls (None: a copy, which stays a command)


@dataclass(frozen=True, slots=True)
class _Plan:
    """Consecutive calls on one device and queue, lowered: one batch."""
    device: Device
    queue: str
    commands: tuple[_Command, ...]
    tracked: tuple[tuple[int, tuple[Access, ...]], ...]  # (command index, the accesses ordered before it)
    holds: tuple[int, ...]                               # the arenas its commands touch
    copied: int                                          # bytes its copies move
    small: bool                                          # little work: see INLINE_WORK


@dataclass(frozen=True, slots=True)
class _Run:
    """A plan as a realize submits it."""
    device: Device
    queue: str
    commands: tuple[tuple[Any, Getter], ...]
    tracked: tuple[tuple[int, tuple[Access, ...]], ...]
    holds: tuple[int, ...]
    copied: int
    small: bool
    code: Any = None  # the interpreter's code for the run's stretches (an int64 array), if any
    # every command of the run as one interpreter command (where each is a kernel): submitted
    # when no tracked access has anything to wait for (see `_submit`)
    whole: tuple[Any, int, int] | None = None  # (the interpreter, where in `code`, how many kernels)
    calls: tuple[Program, ...] = ()  # the kernels `code` calls by address: kept loaded while the run is


@dataclass(frozen=True)
class Lowered:
    """A schedule's commands over memory numbered inputs, then arenas, then buffers of its own,
    then one that is all zeros (integers are offsets into it)."""
    devices: tuple[tuple[str, Device], ...]   # every device it was lowered for, by name
    inputs: tuple[tuple[Device, int], ...]    # each input's device and bytes
    arenas: tuple[tuple[Device, int], ...]
    owned: tuple[tuple[Device, int], ...]     # the targets' buffers (and any other unplanned one)
    places: tuple[tuple[int, int], ...]       # the address table: (memory, offset)
    runs: tuple[_Run, ...]                    # command by command
    results: tuple[int | None, ...]           # the memory each target is (None: no bytes)
    linked: tuple[_Run, ...]                  # the runs, stretches of kernels one interpreter command each
    linked_table: bool                        # whether a command of the linked runs reads the address table

    def current(self) -> bool:
        """Whether the devices this was lowered for are still the engine's: still open (the
        engine closes a device before it opens another under its name)."""
        return all(device.state is DeviceState.OPEN for _, device in self.devices)

    def run(self, inputs: Sequence[LazyNode]) -> tuple[list[Completion], list[Buffer | None]] | None:
        """Allocate, submit every run; the completions and each target's buffer. None, with
        nothing done, when an input is not on the device or of the size it was lowered for."""
        memory: list[Buffer] = []
        for node, (device, nbytes) in zip(inputs, self.inputs):
            buffer = node.buffer
            if buffer is None or buffer.device is not device or buffer.nbytes != nbytes:
                return None
            memory.append(buffer)
        arenas: list[Buffer] = []
        owned: list[Buffer] = []
        try:  # as `bind` does: the same fault points, nothing kept on failure
            for device, nbytes in self.arenas:
                faults.check("engine.bind.arena")
                arenas.append(device.allocator.alloc(nbytes))
            for device, nbytes in self.owned:
                faults.check("engine.bind.target")
                owned.append(device.allocator.alloc(nbytes))
        except BaseException:
            for buffer in (*arenas, *owned):
                buffer.free()
            raise
        memory += arenas
        memory += owned
        try:
            completions = self._submit(memory)
        finally:
            for arena in arenas:
                arena.free()  # given back once the holds of the batches using it are reached
        return completions, [None if m is None else memory[m] for m in self.results]

    def _submit(self, memory: list[Buffer]) -> list[Completion]:
        bases = [buffer.address for buffer in memory]  # checks the inputs are alive
        bases.append(0)
        runs = self.runs if command_queue.TRACER is not None else self.linked
        table = [bases[m] + offset for m, offset in self.places] if runs is self.runs or self.linked_table else ()
        array: Any = None
        completions = []
        for run in runs:
            batch = run.device.batch(run.queue)
            if run.code is not None:
                if array is None:
                    array = (ctypes.c_int64 * len(bases))(*bases)
                batch.keep_alive(array, run.code)  # read by the interpreter when the batch runs
                at, code = ctypes.addressof(array), ctypes.addressof(run.code)
            if run.whole is not None and not any(batch.would_wait(memory[m], offset, nbytes, write)
                                                 for _, accesses in run.tracked for m, offset, nbytes, write in accesses):
                # nothing to wait for: the stops between stretches order nothing, so the whole run
                # is one native call — the queue's worker takes the GIL back once per batch, not
                # once per stretch (each time waiting up to the switch interval, 5 ms, while
                # this thread builds the next graph)
                for _, accesses in run.tracked:
                    for m, offset, nbytes, write in accesses:
                        batch.track_range(memory[m], offset, nbytes, write)
                interpreter, start, count = run.whole
                batch.extend([(interpreter, (at, code + 8 * start, count))], run.copied)
            else:
                if run.code is None:
                    commands = [(fn, args(table)) for fn, args in run.commands]  # type: ignore[operator]
                else:
                    commands = [(fn, (at, code + 8 * args[0], args[1]) if isinstance(args, tuple) else args(table))
                                for fn, args in run.commands]
                start = 0
                for index, accesses in run.tracked:
                    if index > start:
                        batch.extend(commands[start:index])
                        start = index
                    for m, offset, nbytes, write in accesses:
                        batch.track_range(memory[m], offset, nbytes, write)
                batch.extend(commands[start:] if start else commands, run.copied)
            if not len(batch):
                continue
            # a small batch that waits for nothing runs on this thread if its queue is idle
            completion = batch.submit(inline=run.small and not batch.waits)
            completions.append(completion)
            if run.holds and not completion.done():
                for m in run.holds:
                    memory[m].accesses.hold(completion.timeline, completion.value)
        return completions


def lower(schedule: Schedule, inputs: Sequence[LazyNode], engine: Engine) -> Lowered | str | None:
    """`schedule` lowered for the engine's devices; or why realize goes call by call for it, a
    reason to keep with the schedule; or None where it does only this time (a device error —
    the device may be reopened — or inputs unlike the schedule's usual ones)."""
    try:
        return _lower(schedule, inputs, engine)
    except (DeviceError, _NotNow) as exc:
        log.debug("realized call by call this time", reason=f"{type(exc).__name__}: {exc}")
        return None
    except Exception as exc:  # noqa: BLE001 - the call-by-call path raises what deserves raising
        log.debug("realized call by call", reason=f"{type(exc).__name__}: {exc}")
        return f"{type(exc).__name__}: {exc}"


def _getter(slots: tuple[int, ...]) -> Getter:
    """The arguments `slots` of an address table, as a tuple, in one C call."""
    if len(slots) == 1:
        (slot,) = slots
        return lambda table: (table[slot],)
    return itemgetter(*slots)


def _lower(schedule: Schedule, inputs: Sequence[LazyNode], engine: Engine) -> Lowered:
    devices: dict[str, Device] = {}

    def device(name: str) -> Device:
        found = devices.get(name)
        if found is None:
            found = devices[name] = engine.device(name)
        return found

    # every buffer number's place, as `bind` would bind it
    specs, plan = schedule.specs, schedule.plan
    where: list[_Place | None] = [None] * len(specs)
    input_memory = []
    for number, node in enumerate(inputs):
        buffer, on = node.buffer, device(node.device)
        if buffer is None or buffer.device is not on:
            raise _NotNow(f"input {number} is not on {on.name}")
        where[number] = _Place(number, 0, buffer.nbytes, on)
        input_memory.append((on, buffer.nbytes))
    arenas: list[tuple[Device, int]] = []
    for (name, lane), size in plan.arena_bytes.items():
        if size:
            memory = len(inputs) + len(arenas)
            arenas.append((device(name), size))
            for number, at in plan.arena_of.items():
                if at == (name, lane):
                    where[number] = _Place(memory, plan.offsets[number], specs[number].nbytes, device(name))
    first_owned = len(inputs) + len(arenas)
    owned: list[tuple[Device, int]] = []
    for number in range(schedule.n_inputs, len(specs)):
        spec = specs[number]
        if where[number] is None and number not in schedule.aliases and spec.nbytes:
            where[number] = _Place(first_owned + len(owned), 0, spec.nbytes, device(spec.device))
            owned.append((device(spec.device), spec.nbytes))
    for version, memory in schedule.aliases.items():
        where[version] = where[memory]
    zero = first_owned + len(owned)

    # every call's commands, checked as `Batch.launch` and `Batch.copy` check them (their programs built first, in parallel)
    compile_ahead(schedule.linear, device, (_interpreter,) if _CALLING_CONVENTION_FITS else ())
    runs: list[_Building] = []
    for call in schedule.linear:
        on = device(call.device)
        if not runs or runs[-1].device is not on or runs[-1].queue != call.queue:
            runs.append(_Building(on, call.queue))
        run = runs[-1]
        run.work += _work(call)
        for command in lower_call(call, cast(list[Any], where), on, []):  # a _Place stands in for each buffer
            if not isinstance(command, Launch) and not command.streaming:
                dst, src = cast(_Place, command.dst), cast(_Place, command.src)
                if dst.nbytes != src.nbytes:
                    raise _Unfit("a copy between sizes")
                run.add(_Command(on.copy_command("d2d", src.device), (dst, src, dst.nbytes), None), [(src, False), (dst, True)])
                run.copied += dst.nbytes
                continue
            if isinstance(command, Launch):
                program, args = command.program, command.args
            else:
                program, args = on.compiler.stream_copy(), (command.dst, command.src, command.dst.nbytes)
            if len(args) != len(program.signature):
                raise _Unfit(f"{program.name} takes {len(program.signature)} arguments, got {len(args)}")
            buffers = dict(program.buffer_args)
            for i, (kind, arg) in enumerate(zip(program.signature, args)):
                if i in buffers:
                    if not isinstance(arg, _Place) or (arg.device is not on and not on.reads_directly(arg.device)):
                        raise _Unfit(f"{program.name} argument {i} is not a buffer {on.name} reads")
                elif type(arg) is not int or kind != "i64":
                    raise _Unfit(f"{program.name} argument {i} is a {kind} {type(arg).__name__}")
            run.add(_Command(program.cfunc, tuple(args), program), [(args[i], write) for i, write in program.buffer_args])

    results = []
    for number in schedule.targets:
        place = where[schedule.aliases.get(number, number)]
        if place is not None and (place.offset or len(inputs) <= place.memory < first_owned):
            raise _Unfit(f"target {number} is part of an arena")
        results.append(None if place is None else place.memory)

    slots: dict[tuple[int, int], int] = {}

    def slot(arg: Any) -> int:
        key = (arg.memory, arg.offset) if isinstance(arg, _Place) else (zero, arg)
        return slots.setdefault(key, len(slots))

    plans = tuple(_Plan(run.device, run.queue, tuple(run.commands), tracked, holds, run.copied,
                        run.device.native_code and run.work <= INLINE_WORK)
                  for run, (tracked, holds) in zip(runs, _tracked(runs, lambda m: m < len(inputs), first_owned)))
    python = tuple(_Run(p.device, p.queue, tuple((c.fn, _getter(tuple(slot(a) for a in c.args))) for c in p.commands),
                        p.tracked, p.holds, p.copied, p.small) for p in plans)
    linked = tuple(_link(plan, run) for plan, run in zip(plans, python))
    table = any(type(args) is not tuple for run in linked for _, args in run.commands)
    return Lowered(tuple(devices.items()), tuple(input_memory), tuple(arenas), tuple(owned), tuple(slots), python,
                   tuple(results), linked, table)


class _Building:
    """A run being lowered: its commands, what each touches, the bytes its copies move and its work."""

    def __init__(self, device: Device, queue: str) -> None:
        self.device, self.queue = device, queue
        self.commands: list[_Command] = []
        self.accesses: list[list[tuple[_Place, bool]]] = []
        self.copied = 0
        self.work: float = 0

    def add(self, command: _Command, accesses: list[tuple[_Place, bool]]) -> None:
        self.commands.append(command)
        self.accesses.append(accesses)


def _work(call: Call) -> float:
    """Roughly how long `call` runs, in iterations of an elementwise kernel: a kernel's iteration
    space, a matmul's multiply-adds at MATMUL_MAC_WORK each; copies and slice kernels are taken
    as long (they are a copy lane's or an allreduce's work, which a batch of its own overlaps)."""
    if isinstance(call, KernelCall):
        return math.prod(call.ast.shape)
    if isinstance(call, MatmulCall):
        return call.batch * call.m * call.n * call.k * MATMUL_MAC_WORK
    return math.inf


def _tracked(runs: Sequence[_Building], is_input: Callable[[int], bool],
             first_owned: int) -> list[tuple[tuple[tuple[int, tuple[Access, ...]], ...], tuple[int, ...]]]:
    """For each run: the accesses the access logs order, by the index of the command they come
    before (each range once per batch, as `Batch` orders it: again only when a write follows
    reads), and the arenas it holds. Inputs are always ordered; the schedule's own memory where
    a call on another stream touches the same bytes too, one of the two writing; arena bytes
    only then. The schedule's own buffers are recorded in any case, from the batch's start when
    no other stream touches them (nothing else is recorded on them: nothing to wait for)."""
    streams = [(run.device.name, run.queue) for run in runs]
    # memory -> stream -> the byte ranges it touches there, and whether it writes them
    touched: dict[int, dict[tuple[str, str], list[tuple[int, int, bool]]]] = {}
    for run, stream in zip(runs, streams):
        for command in run.accesses:
            for place, write in command:
                by_stream = touched.setdefault(place.memory, {})
                by_stream.setdefault(stream, []).append((place.offset, place.offset + place.nbytes, write))

    def shared(place: _Place, write: bool, stream: tuple[str, str]) -> bool:
        start, end = place.offset, place.offset + place.nbytes
        return any((write or w) and start < e and s < end
                   for other, ranges in touched[place.memory].items() if other != stream for s, e, w in ranges)

    result = []
    for run, stream in zip(runs, streams):
        seen: dict[tuple[int, int, int], bool] = {}
        due: dict[int, list[Access]] = {}
        holds: dict[int, None] = {}
        for index, command in enumerate(run.accesses):
            for place, write in command:
                m = place.memory
                if is_input(m) or shared(place, write, stream):
                    at = index
                elif m >= first_owned:
                    at = 0
                else:  # arena bytes only this stream touches: its FIFO orders them
                    holds[m] = None
                    continue
                if not is_input(m) and m < first_owned:
                    holds[m] = None
                key = (m, place.offset, place.nbytes)
                before = seen.get(key)
                if before is None or (write and not before):
                    due.setdefault(at, []).append((m, place.offset, place.nbytes, write))
                seen[key] = write or bool(before)
        result.append((tuple((index, tuple(due[index])) for index in sorted(due)), tuple(holds)))
    return result


def _link(plan: _Plan, run: _Run) -> _Run:
    """`run` with each stretch of two or more kernels between the points where the batch may wait
    one command of the interpreter, on a device whose kernels are code of this process."""
    if not (plan.device.compiler.links and _CALLING_CONVENTION_FITS):
        return run
    stops = {index for index, _ in plan.tracked}
    fits = [command.program is not None and len(command.args) <= MAX_ARGUMENTS for command in plan.commands]
    groups: list[list[int]] = []
    for index in range(len(plan.commands)):
        if not fits[index] or index in stops or not groups or not fits[groups[-1][-1]]:
            groups.append([index])
        else:
            groups[-1].append(index)
    if all(len(group) == 1 for group in groups):
        return run
    interpreter = plan.device.load_program(_interpreter(), _INTERPRETER, ["r", "r", "i64"]).cfunc
    code: list[int] = []
    commands: list[tuple[Any, Getter]] = []
    moved: dict[int, int] = {}

    def encode(index: int) -> None:
        command = plan.commands[index]
        assert command.program is not None
        code.extend((command.program.address, len(command.args)))
        for arg in command.args:
            code.extend((arg.memory, arg.offset) if isinstance(arg, _Place) else (-1, arg))

    for group in groups:
        moved[group[0]] = len(commands)
        if len(group) == 1:
            commands.append(run.commands[group[0]])
            continue
        commands.append((interpreter, (len(code), len(group))))
        for index in group:
            encode(index)
    whole = None
    if len(commands) > 1 and all(fits):
        whole = (interpreter, len(code), len(plan.commands))
        for index in range(len(plan.commands)):
            encode(index)
    tracked = tuple((moved[index], accesses) for index, accesses in plan.tracked)
    calls = tuple({id(c.program): c.program for c in plan.commands if c.program is not None}.values())
    return _Run(plan.device, plan.queue, tuple(commands), tracked, plan.holds, plan.copied, plan.small,
                (ctypes.c_int64 * len(code))(*code), whole, calls)


# A batch of kernels iterating this often in all (in `_work`'s units) runs on the calling thread
# when its queue is idle and it waits for nothing (`CommandQueue.submit`'s inline), on a device
# whose kernels are code of this process (not a remote node's). Handed to the queue's worker, a
# batch this short overlaps little: the worker takes the GIL to start it and again to finish it,
# each time waiting until this thread releases it — up to the interpreter's switch interval (5 ms)
# while this thread builds the next graph in Python — so an eager loop whose batches are short
# ran its host work and its kernels one after the other anyway, plus the hand-offs (the digits
# MLP's step, batch 256: about 0.8M units, ~0.2 ms of kernels, and ~0.5 ms of waiting for the GIL
# and the run-ahead bound per step on a quiet machine). 2**21 units are ~0.5 ms of elementwise
# float32 work (4 iterations/ns on this machine's core), ~1.6 ms at worst (transcendentals,
# 1.3/ns); the small CNN's step (~20M units, ~10 ms) still overlaps the host on the worker. A
# realize of the graph in bench/tensor.py (97 kernels over 8x8) is 6208.
INLINE_WORK = 1 << 21
# A matmul's multiply-add in elementwise iterations: the packed kernel does ~44 per ns on one
# core (512x512x512 float32 in 3.1 ms), an elementwise kernel ~4 iterations per ns; 1/8 leaves
# room for packing, which dominates small products.
MATMUL_MAC_WORK = 1 / 8


# The command interpreter: `tinydist_commands(bases, code, count)` calls `count` kernels, each
# encoded in `code` (int64s) as its address, its argument count n, then n (memory, offset) pairs:
# the argument is bases[memory] + offset, or offset itself where memory is -1 (an integer). On
# x86-64 and AArch64 a pointer and an int64 are passed alike (integer registers, then 8-byte
# stack slots), so a call with n int64 arguments calls any kernel of n pointer and int64
# arguments. Compiled once per process: the commands of a schedule are data, not code.
_INTERPRETER = "tinydist_commands"
MAX_ARGUMENTS = 32
_CALLING_CONVENTION_FITS = platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64")


@functools.cache
def _interpreter() -> bytes:
    cases = " ".join(f"i64 {n}, label %call{n}" for n in range(1, MAX_ARGUMENTS + 1))
    calls = []
    for n in range(1, MAX_ARGUMENTS + 1):
        loads = [f"  %c{n}.a{k}.at = getelementptr i64, ptr %args, i64 {k}\n  %c{n}.a{k} = load i64, ptr %c{n}.a{k}.at"
                 for k in range(n)]
        operands = ", ".join(f"i64 %c{n}.a{k}" for k in range(n))
        calls.append(f"call{n}:\n" + "\n".join(loads) + f"\n  call void %fn({operands})\n  br label %next")
    ir = f"""define void @{_INTERPRETER}(ptr %bases, ptr %code, i64 %count) {{
entry:
  %args = alloca [{MAX_ARGUMENTS} x i64]
  br label %head
head:
  %i = phi i64 [0, %entry], [%i.next, %next]
  %pos = phi i64 [0, %entry], [%pos.next, %next]
  %more = icmp ult i64 %i, %count
  br i1 %more, label %command, label %exit
command:
  %fn.at = getelementptr i64, ptr %code, i64 %pos
  %fn.int = load i64, ptr %fn.at
  %fn = inttoptr i64 %fn.int to ptr
  %n.pos = add i64 %pos, 1
  %n.at = getelementptr i64, ptr %code, i64 %n.pos
  %n = load i64, ptr %n.at
  br label %arg
arg:
  %j = phi i64 [0, %command], [%j.next, %value]
  %more.args = icmp ult i64 %j, %n
  br i1 %more.args, label %fetch, label %dispatch
fetch:
  %twice = shl i64 %j, 1
  %m.pos0 = add i64 %pos, 2
  %m.pos = add i64 %m.pos0, %twice
  %m.at = getelementptr i64, ptr %code, i64 %m.pos
  %m = load i64, ptr %m.at
  %o.pos = add i64 %m.pos, 1
  %o.at = getelementptr i64, ptr %code, i64 %o.pos
  %o = load i64, ptr %o.at
  %scalar = icmp slt i64 %m, 0
  br i1 %scalar, label %value, label %based
based:
  %b.at = getelementptr i64, ptr %bases, i64 %m
  %b = load i64, ptr %b.at
  %sum = add i64 %b, %o
  br label %value
value:
  %v = phi i64 [%o, %fetch], [%sum, %based]
  %slot = getelementptr i64, ptr %args, i64 %j
  store i64 %v, ptr %slot
  %j.next = add i64 %j, 1
  br label %arg
dispatch:
  switch i64 %n, label %next [ {cases} ]
{chr(10).join(calls)}
next:
  %twice.n = shl i64 %n, 1
  %size = add i64 %twice.n, 2
  %pos.next = add i64 %pos, %size
  %i.next = add i64 %i, 1
  br label %head
exit:
  ret void
}}
"""
    return compile_portable_glue(ir)
