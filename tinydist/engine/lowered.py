"""A cached schedule lowered once, for every later realize of it: commands over its memory.

The schedule cache spares a realize the fusion, ordering and planning of a graph it has seen;
this spares it the lowering. Each run of consecutive calls on one device and queue (one batch)
keeps its commands as a native callable and where each argument comes from: an input, an arena
or a buffer of the schedule's own, at an offset, or an integer. A realize takes memory (inputs
where they live, one arena per device and lane, a buffer per target), makes the table of
addresses, and each command's arguments are one C-level lookup into it — no lowering, no program
looked up by its kernel's AST, no views, no checks of memory this module allocated itself.

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

`lower` returns None where this does not apply (a buffer of no bytes in a call, an input on a
device the engine knows by another object, anything `lower_call` refuses): realize then binds
and issues call by call as it always has, which also raises the errors a bad call deserves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from tinydist.engine.commands import Launch, lower_call
from tinydist.lazy import LazyNode
from tinydist.logs import get_logger
from tinydist.runtime.buffer import Buffer
from tinydist.runtime.device import Completion, Device, DeviceState
from tinydist.runtime.engine import Engine
from tinydist.runtime.faults import faults
from tinydist.schedule import Schedule

log = get_logger(layer="lowered")

# (memory number, byte offset in it, bytes, writes?)
Access = tuple[int, int, int, bool]
# the arguments of one command, from the address table
Getter = Callable[[Sequence[int]], tuple[int, ...]]


class _Unfit(Exception):
    """This schedule is realized call by call (the message says why)."""


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


@dataclass(frozen=True, slots=True)
class _Plan:
    """Consecutive calls on one device and queue, lowered: one batch."""
    device: Device
    queue: str
    commands: tuple[_Command, ...]
    tracked: tuple[tuple[int, tuple[Access, ...]], ...]  # (command index, the accesses ordered before it)
    holds: tuple[int, ...]                               # the arenas its commands touch
    copied: int                                          # bytes its copies move


@dataclass(frozen=True, slots=True)
class _Run:
    """A plan as a realize submits it."""
    device: Device
    queue: str
    commands: tuple[tuple[Any, Getter], ...]
    tracked: tuple[tuple[int, tuple[Access, ...]], ...]
    holds: tuple[int, ...]
    copied: int


@dataclass(frozen=True)
class Lowered:
    """A schedule's commands over memory numbered inputs, then arenas, then buffers of its own,
    then one that is all zeros (integers are offsets into it)."""
    devices: tuple[tuple[str, Device], ...]   # every device it was lowered for, by name
    inputs: tuple[tuple[Device, int], ...]    # each input's device and bytes
    arenas: tuple[tuple[Device, int], ...]
    owned: tuple[tuple[Device, int], ...]     # the targets' buffers (and any other unplanned one)
    places: tuple[tuple[int, int], ...]       # the address table: (memory, offset)
    runs: tuple[_Run, ...]
    results: tuple[int | None, ...]           # the memory each target is (None: no bytes)

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
        table = [bases[m] + offset for m, offset in self.places]
        completions = []
        for run in self.runs:
            batch = run.device.batch(run.queue)
            commands = [(fn, args(table)) for fn, args in run.commands]
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
            completion = batch.submit()
            completions.append(completion)
            if run.holds and not completion.done():
                for m in run.holds:
                    memory[m].accesses.hold(completion.timeline, completion.value)
        return completions


def lower(schedule: Schedule, inputs: Sequence[LazyNode], engine: Engine) -> Lowered | None:
    """`schedule` lowered for the engine's devices, or None where realize must go call by call."""
    try:
        return _lower(schedule, inputs, engine)
    except Exception as exc:  # noqa: BLE001 - the call-by-call path raises what deserves raising
        log.debug("realized call by call", reason=f"{type(exc).__name__}: {exc}")
        return None


def _getter(slots: tuple[int, ...]) -> Getter:
    """The arguments `slots` of an address table, as a tuple, in one C call."""
    if len(slots) == 1:
        (slot,) = slots
        return lambda table: (table[slot],)
    return itemgetter(*slots)  # type: ignore[return-value]


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
            raise _Unfit(f"input {number} is not on {on.name}")
        where[number] = _Place(number, 0, buffer.nbytes, on)
        input_memory.append((on, buffer.nbytes))
    arenas = []
    for (name, lane), size in plan.arena_bytes.items():
        if size:
            memory = len(inputs) + len(arenas)
            arenas.append((device(name), size))
            for number, at in plan.arena_of.items():
                if at == (name, lane):
                    where[number] = _Place(memory, plan.offsets[number], specs[number].nbytes, device(name))
    first_owned = len(inputs) + len(arenas)
    owned = []
    for number in range(schedule.n_inputs, len(specs)):
        spec = specs[number]
        if where[number] is None and number not in schedule.aliases and spec.nbytes:
            where[number] = _Place(first_owned + len(owned), 0, spec.nbytes, device(spec.device))
            owned.append((device(spec.device), spec.nbytes))
    for version, memory in schedule.aliases.items():
        where[version] = where[memory]
    zero = first_owned + len(owned)

    # every call's commands, checked as `Batch.launch` and `Batch.copy` check them
    runs: list[tuple[Device, str, list[_Command], list[list[tuple[_Place, bool]]], int]] = []
    for call in schedule.linear:
        on = device(call.device)
        if not runs or runs[-1][0] is not on or runs[-1][1] != call.queue:
            runs.append((on, call.queue, [], [], 0))
        _, queue, commands, accesses, copied = runs[-1]
        for command in lower_call(call, where, on, []):
            if not isinstance(command, Launch) and not command.streaming:
                dst, src = command.dst, command.src
                if dst.nbytes != src.nbytes:
                    raise _Unfit("a copy between sizes")
                commands.append(_Command(on.copy_command("d2d", src.device), (dst, src, dst.nbytes)))
                accesses.append([(src, False), (dst, True)])
                copied += dst.nbytes
                runs[-1] = (on, queue, commands, accesses, copied)
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
            commands.append(_Command(program.cfunc, tuple(args)))
            accesses.append([(args[i], write) for i, write in program.buffer_args])

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

    plans = tuple(_Plan(on, queue, tuple(commands), tracked, holds, copied)
                  for (on, queue, commands, _, copied), (tracked, holds)
                  in zip(runs, _tracked(runs, lambda m: m < len(inputs), first_owned)))
    python = tuple(_Run(p.device, p.queue, tuple((c.fn, _getter(tuple(slot(a) for a in c.args))) for c in p.commands),
                        p.tracked, p.holds, p.copied) for p in plans)
    return Lowered(tuple(devices.items()), tuple(input_memory), tuple(arenas), tuple(owned), tuple(slots), python,
                   tuple(results))


def _tracked(runs: Sequence[tuple[Device, str, Any, list[list[tuple[_Place, bool]]], int]], is_input: Callable[[int], bool],
             first_owned: int) -> list[tuple[tuple[tuple[int, tuple[Access, ...]], ...], tuple[int, ...]]]:
    """For each run: the accesses the access logs order, by the index of the command they come
    before (each range once per batch, as `Batch` orders it: again only when a write follows
    reads), and the arenas it holds. Inputs are always ordered; the schedule's own memory where
    a call on another stream touches the same bytes too, one of the two writing; arena bytes
    only then. The schedule's own buffers are recorded in any case, from the batch's start when
    no other stream touches them (nothing else is recorded on them: nothing to wait for)."""
    streams = [(on.name, queue) for on, queue, _, _, _ in runs]
    # memory -> stream -> the byte ranges it touches there, and whether it writes them
    touched: dict[int, dict[tuple[str, str], list[tuple[int, int, bool]]]] = {}
    for (_, _, _, accesses, _), stream in zip(runs, streams):
        for command in accesses:
            for place, write in command:
                by_stream = touched.setdefault(place.memory, {})
                by_stream.setdefault(stream, []).append((place.offset, place.offset + place.nbytes, write))

    def shared(place: _Place, write: bool, stream: tuple[str, str]) -> bool:
        start, end = place.offset, place.offset + place.nbytes
        return any((write or w) and start < e and s < end
                   for other, ranges in touched[place.memory].items() if other != stream for s, e, w in ranges)

    result = []
    for (_, _, _, accesses, _), stream in zip(runs, streams):
        seen: dict[tuple[int, int, int], bool] = {}
        due: dict[int, list[Access]] = {}
        holds: dict[int, None] = {}
        for index, command in enumerate(accesses):
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
