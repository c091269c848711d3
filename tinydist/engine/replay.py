"""How a capture replays: four strategies behind one small protocol.

    entry    one device whose compiler links: every call in ONE native entry point, one batch
             [copy arguments in, call the entry, copy outputs out]
    streams  several host devices: one native call per device and queue, the ordering between
             them baked at capture (`tinydist.engine.streams`)
    runs     anything else (copies, a remote device, no futex): one batch per run of calls on a
             device and queue, ordered by the runtime's access logs as a realize is
    frame    the frame loop over an `entry` replay on host memory, run on the caller's thread
             while the queue is idle: numpy copies in and out of views of the capture's buffers
             (call_numpy), or one native frame function over the Tensors' buffers (a Tensor
             replay); no submission at all

`choose` takes the first of entry → streams → runs that applies (streams only while
TINYDIST_JIT_NATIVE_STREAMS is on), or the one a caller forces, and logs which and why. Each
strategy is built from the capture's bound buffers and the one lowering of schedule items
(`tinydist.engine.commands`), so the way a call runs is written once for all of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from tinydist.base.config import settings
from tinydist.base.errors import TinydistError
from tinydist.base.logs import get_logger
from tinydist.engine.commands import Launch, lower_call
from tinydist.engine.parallel import split
from tinydist.engine.streams import NativeStreams, overlap, span
from tinydist.runtime import command_queue
from tinydist.runtime.buffer import Buffer
from tinydist.runtime.command_queue import BUSY
from tinydist.runtime.device import Completion, Device, host_address
from tinydist.runtime.engine import get_engine
from tinydist.schedule.items import Call, CollectiveCall, KernelCall, MatmulCall

if TYPE_CHECKING:
    from tinydist.engine.capture import Capture

log = get_logger(layer="replay")

# the calls an entry point links (a process collective's program is host code called by address);
# copies, gathers and slice kernels replay as commands
_LINKABLE = (KernelCall, MatmulCall, CollectiveCall)

class ReplayUnfit(TinydistError, ValueError):
    """A strategy that was forced does not apply to this capture (the message says why)."""


class Replay(Protocol):
    """One way of replaying a capture."""
    name: ClassVar[str]

    def replay(self, args: Sequence[Buffer], inline: bool) -> tuple[list[Buffer], list[Completion]]:
        """Queue one replay of the caller's argument buffers (by argument position): its fresh
        output buffers and the completions to wait for."""
        ...


def _link(device: Device, capture: Capture, calls: Sequence[Call]) -> Any:
    """One program running `calls` in order on `device`, every buffer bound."""
    launches = []
    for call in calls:
        for command in lower_call(call, capture.buffers, device, []):
            assert isinstance(command, Launch), command
            launches.append((command.program, command.bound(device)[1]))
    return device.compiler.link(launches)


class EntryReplay:
    """One device, kernels and matmuls only, linked into one native entry point."""
    name: ClassVar[str] = "entry"

    @staticmethod
    def unfit(capture: Capture) -> str | None:
        devices = capture.devices
        kinds = sorted({type(c).__name__ for c in capture.schedule.linear if not isinstance(c, _LINKABLE)})
        if len(devices) != 1:
            return f"it runs on {len(devices)} devices ({', '.join(sorted(devices))})"
        if kinds:
            return f"it has calls an entry point cannot link ({', '.join(kinds)})"
        queues = sorted({c.queue for c in capture.schedule.linear})
        if len(queues) > 1:  # a process collective on the copy queue runs beside the kernels after it
            return f"it runs on {len(queues)} queues ({', '.join(queues)}); an entry point runs them in turn"
        device = get_engine().device(next(iter(devices)))
        if not device.compiler.links:
            return f"{device.name}'s compiler does not link launches (it runs no host code of this process)"
        return None

    def __init__(self, capture: Capture) -> None:
        self.capture = capture
        self.device = get_engine().device(next(iter(capture.devices)))
        # over several threads when asked, on host memory, and some call is big enough to split
        self.workspaces: list[np.ndarray] = []  # the split matmuls' extra workspaces
        self.phases = split(capture.schedule.linear, capture.buffers, self.device, capture.threads, self.workspaces) \
            if capture.threads > 1 and self.device.host_visible else None
        self.entry = self.device.compiler.link_parallel(capture.threads, self.phases) if self.phases \
            else _link(self.device, capture, capture.schedule.linear)
        b = capture.buffer
        self.arg_copies = [(position, b(number).address, b(number).nbytes) for position, number in capture.arg_slots]
        self.output_copies = [(b(n).address, b(n).nbytes) for n in capture.output_numbers]
        self.written_copies = [(position, b(number).address, b(number).nbytes) for position, number in capture.written_args]
        self.copy = self.device.host_copy()
        self.recycled = self.device.allocator.recycled

    def outputs(self) -> list[Buffer]:
        """A buffer per output, recycled (`Allocator.recycled`): one the caller dropped the
        Tensor of, as it is. A frame loop then allocates nothing; its buffers were freed and
        allocated again at every replay before — the better part of a replay's cost."""
        recycled = self.recycled
        return [recycled(nbytes) for nbytes in self.capture.output_bytes]

    def replay(self, args: Sequence[Buffer], inline: bool) -> tuple[list[Buffer], list[Completion]]:
        copy = self.copy
        outputs = self.outputs()
        accesses = [(args[position], False) for position, _, _ in self.arg_copies]
        accesses += self.capture.accesses
        accesses += [(out, True) for out in outputs]
        accesses += [(args[position], True) for position, _, _ in self.written_copies]
        commands: list[tuple[Any, tuple[int, ...]]] = [(copy, (address, args[position].address, nbytes))
                                                       for position, address, nbytes in self.arg_copies]
        commands.append((self.entry.cfunc, ()))
        commands.extend((copy, (out.address, address, nbytes)) for out, (address, nbytes) in zip(outputs, self.output_copies))
        commands.extend((copy, (args[position].address, address, nbytes)) for position, address, nbytes in self.written_copies)
        return outputs, [self.device.submit_commands("compute", commands, accesses, inline)]


class HostFrame:
    """The frame loop over an entry replay on host memory, run on the caller's thread.

    numpy arrays in, numpy arrays out (`run`): numpy copies the arrays into views of the
    capture's argument buffers, the entry point runs, numpy copies the outputs out of views of
    its output buffers into new arrays — all while the compute queue is idle and holds its
    submit lock (`Device.run_now`), so no submission, no buffers and no Tensors are made.
    Buffers in, new buffers out (`replay_now`, the Tensor API's replay): one native frame
    function (`DeviceCompiler.link_frame`) copies the argument buffers in, calls the entry point
    and copies the outputs into buffers from the entry replay's pool, the same way.

    When the queue has unfinished work, `run` queues the frame function with the arrays'
    addresses and waits for it (the arrays stay referenced until then); `replay_now` returns
    BUSY and the caller replays through the queue. An argument the function assigns to is not
    written back into the caller's array, as an array given to `Tensor(...)` is not: the array
    is input only; a Tensor replay of such a function goes through the queue (its copy back)."""
    name: ClassVar[str] = "frame"

    @staticmethod
    def unfit(capture: Capture) -> str | None:
        if not isinstance(capture.strategy, EntryReplay):
            return f"it replays by {capture.strategy.name}, not one entry point"
        if not capture.strategy.device.host_visible:
            return f"{capture.strategy.device.name}'s memory is not the host's"
        return None

    def __init__(self, entry: EntryReplay) -> None:
        capture = entry.capture
        self.entry, self.device = entry, entry.device
        self.accesses = capture.accesses
        self.output_specs = [(shape, dtype.np) for shape, dtype, _ in capture.output_specs]
        self.positions = [position for position, _, _ in entry.arg_copies]
        self.writes_args = bool(capture.written_args)
        self.recycled, self.output_bytes = entry.recycled, capture.output_bytes
        self.frame = self.device.compiler.link_frame(entry.entry, [(address, nbytes) for _, address, nbytes in entry.arg_copies],
                                                     entry.output_copies).cfunc
        host, b = self.device.host_array, capture.buffer
        self.staging = [(position, host(b(number), dtype.np, shape)) for position, number, (shape, dtype) in capture.arg_layouts]
        self.results = [host(b(number), dtype, shape) for number, (shape, dtype) in zip(capture.output_numbers, self.output_specs)]

    def run(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The outputs for `arrays` (by argument position, of the captured shapes and dtypes)."""
        outputs = self.device.run_now("compute", self.accesses, self._run_here, (arrays,))
        return self._run_queued(arrays) if outputs is BUSY else outputs

    def _run_here(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        for position, view in self.staging:
            view[...] = arrays[position]
        self.entry.entry.cfunc()
        return [view.copy() for view in self.results]

    def _run_queued(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        inputs = [np.ascontiguousarray(arrays[position]) for position in self.positions]
        outputs = [np.empty(shape, dtype) for shape, dtype in self.output_specs]
        addresses = tuple(host_address(array) for array in (*inputs, *outputs))
        completion = self.device.submit_commands("compute", [(self.frame, addresses)], self.accesses, inline=True)
        if not completion.done():
            completion.wait_blocking()
        return outputs

    def replay_now(self, args: Sequence[Buffer]) -> list[Buffer] | Any:
        """New output buffers for the argument buffers `args` (by argument position), computed
        on this thread now; BUSY, with nothing run, when unfinished work touches any of them or
        the function assigns to an argument — replay through the queue then."""
        if self.writes_args:
            return BUSY
        recycled = self.recycled
        outputs = [recycled(nbytes) for nbytes in self.output_bytes]  # (EntryReplay.outputs, without the call)
        accesses: list[tuple[Buffer, bool]] = []
        addresses = []  # (`address` checks each buffer is alive)
        for position in self.positions:
            buffer = args[position]
            accesses.append((buffer, False))
            addresses.append(buffer.address)
        accesses += self.accesses
        for buffer in outputs:
            accesses.append((buffer, True))
            addresses.append(buffer.address)
        return BUSY if self.device.run_now("compute", accesses, self.frame, tuple(addresses)) is BUSY else outputs


class _Run:
    """Consecutive calls of a captured graph on one device and queue, replayed as one batch."""

    def __init__(self, device: Device, queue: str) -> None:
        self.device, self.queue = device, queue
        self.calls: list[Call] = []
        self.commands: list[tuple[Any, tuple[Any, ...]]] = []
        self._touched: dict[int, tuple[Buffer, bool]] = {}

    def add(self, fn: Any, args: tuple[int, ...], accesses: list[tuple[Buffer, bool]]) -> None:
        """One command, `fn(*args)`, touching `accesses`."""
        for buffer, write in accesses:
            seen = self._touched.get(id(buffer))
            self._touched[id(buffer)] = (buffer, write or (seen is not None and seen[1]))
        self.commands.append((fn, args))

    @property
    def accesses(self) -> list[tuple[Buffer, bool]]:
        return list(self._touched.values())

    def keep(self, tracked: Callable[[Buffer, bool], bool]) -> None:
        """Track only the accesses `tracked(buffer, write)` accepts."""
        self._touched = {key: (buffer, write) for key, (buffer, write) in self._touched.items() if tracked(buffer, write)}


def _bind_runs(capture: Capture) -> list[_Run]:
    """The schedule as runs of calls on one device and queue, every argument bound once, each
    command native and every buffer it touches tracked."""
    engine = get_engine()
    runs: list[_Run] = []
    # a run ends after a call whose output another device or queue reads: a run's completion is
    # the only signal other queues wait for, so the reader starts then, not at the end of a longer run
    read_on: dict[int, set[tuple[str, str]]] = {}
    for call in capture.schedule.linear:
        for number in call.reads:
            read_on.setdefault(number, set()).add((call.device, call.queue))
    ends_run = False
    views: list[Buffer] = []  # kept: the commands replay their addresses as long as the capture lives
    for call in capture.schedule.linear:
        device = engine.device(call.device)
        if ends_run or not runs or runs[-1].device is not device or runs[-1].queue != call.queue:
            runs.append(_Run(device, call.queue))
        ends_run = any(read_on.get(n, set()) - {(call.device, call.queue)} for n in call.writes)
        runs[-1].calls.append(call)
        for command in lower_call(call, capture.buffers, device, views):
            runs[-1].add(*command.bound(device))
    capture.keep_alive.extend(views)
    return runs


class StreamsReplay:
    """Several host devices, one native call per device and queue (`tinydist.engine.streams`)."""
    name: ClassVar[str] = "streams"

    def __init__(self, capture: Capture, streams: NativeStreams) -> None:
        self.capture, self.streams = capture, streams

    @classmethod
    def build(cls, capture: Capture) -> StreamsReplay | str:
        """The replay, or why there is none: a part that is not native code, or no futex."""
        engine, b = get_engine(), capture.buffer
        streams = NativeStreams.build(
            _bind_runs(capture), [(position, b(number)) for position, number in capture.arg_slots],
            [(b(n), engine.device(device)) for n, (_, _, device) in zip(capture.output_numbers, capture.output_specs)],
            [(position, b(number)) for position, number in capture.written_args],
            [buffer for buffer, _ in capture.accesses])
        if streams is None:
            return "it needs host devices whose calls are native code, on a machine with a futex"
        return cls(capture, streams)

    def replay(self, args: Sequence[Buffer], inline: bool) -> tuple[list[Buffer], list[Completion]]:
        return self.streams.replay(args)


class RunsReplay:
    """One batch per run of calls on a device and queue; the runtime's access logs order the runs
    across queues and devices exactly as they order a realize."""
    name: ClassVar[str] = "runs"

    def __init__(self, capture: Capture) -> None:
        self.capture = capture
        runs = _bind_runs(capture)
        # the argument copies made at the start of run k, the outputs copied out at its end; the
        # rest get batches of their own (see _place_copies)
        self.args_into: dict[int | None, list[tuple[int, int]]] = {}
        self.outputs_from: dict[int | None, list[int]] = {}
        self._place_copies(runs)
        self._track_only_shared(runs)
        for run in runs:
            # a run of kernels is linked into one native call: the queue's worker takes the GIL
            # once per run instead of after every kernel (another thread feeding the devices holds it)
            if len(run.calls) > 1 and all(isinstance(call, _LINKABLE) for call in run.calls) and run.device.compiler.links:
                run.commands = [(_link(run.device, capture, run.calls).cfunc, ())]
        self.runs = runs

    def _track_only_shared(self, runs: list[_Run]) -> None:
        """Keep in each run's tracked accesses only those the runtime's access logs must order:
        memory another queue of this capture also touches (in a conflicting way), and buffers the
        caller sees (arguments, weights, outputs). The rest are ordered by their own queue's FIFO,
        across replays too — and each tracked access costs a scan of its base's pending records
        at every replay, on the thread that feeds the devices."""
        capture = self.capture
        b = capture.buffers
        # by memory, not by object: a gather or a slice kernel writes views of the caller's outputs
        private = {number for _, number in capture.arg_slots}
        seen = [span(b[n]) for n in range(capture.schedule.n_inputs) if b[n] is not None and n not in private]  # type: ignore[arg-type]
        touched = [(span(buffer), write, (run.device.name, run.queue)) for run in runs for buffer, write in run.accesses]
        # the capture's own argument and output buffers: written by the copy in, read by the copy out,
        # on their device's compute queue (in a run there or in a batch of their own)
        touched += [(span(b[n]), True, (b[n].device.name, "compute")) for _, n in capture.arg_slots]  # type: ignore[union-attr,arg-type]
        touched += [(span(b[n]), False, (b[n].device.name, "compute")) for n in capture.output_numbers]  # type: ignore[union-attr,arg-type]

        def tracked(buffer: Buffer, write: bool, stream: tuple[str, str]) -> bool:
            memory = span(buffer)
            if any(overlap(memory, other) for other in seen):
                return True
            return any(other != stream and (write or w) and overlap(memory, where) for where, w, other in touched)
        for run in runs:
            run.keep(partial(tracked, stream=(run.device.name, run.queue)))

    def _place_copies(self, runs: list[_Run]) -> None:
        """Copy each argument in at the start of the first run on its buffer's compute queue, when
        no earlier run touches it; copy each output out at the end of the last run on its
        device's compute queue, when no later run writes it. A batch of its own would cost the
        feeding thread a submission and the queue's worker a wake-up, every replay. Arguments
        the function assigns to keep their own batches (their copy back reads the same buffer),
        and so do arguments a run on another queue reads: a run signals only when all of it is
        done, and that reader (a data-parallel replica's half of the batch) would wait for it."""
        capture = self.capture
        streams = [(run.device.name, run.queue) for run in runs]
        assigned = {number for _, number in capture.written_args}
        memory = capture.schedule.aliases

        def touching(number: int) -> list[int]:
            return [k for k, run in enumerate(runs)
                    if any(memory.get(n, n) == number for call in run.calls for n in (*call.reads, *call.writes))]
        for position, number in capture.arg_slots:
            stream = (capture.buffer(number).device.name, "compute")
            users = touching(number)
            first = streams.index(stream) if stream in streams and number not in assigned else None
            if first is not None and users and (users[0] < first or any(streams[k] != stream for k in users)):
                first = None
            self.args_into.setdefault(first, []).append((position, number))
        for i, number in enumerate(capture.output_numbers):
            stream = (capture.output_specs[i][2], "compute")
            last = len(streams) - 1 - streams[::-1].index(stream) if stream in streams else None
            writers = [k for k in touching(number) if any(memory.get(n, n) == number for call in runs[k].calls for n in call.writes)]
            if last is not None and writers and writers[-1] > last:
                last = None
            self.outputs_from.setdefault(last, []).append(i)

    def replay(self, args: Sequence[Buffer], inline: bool) -> tuple[list[Buffer], list[Completion]]:
        capture = self.capture
        engine = get_engine()
        completions: list[Completion] = []
        outputs: list[Buffer] = [None] * len(capture.output_numbers)  # type: ignore[list-item]

        def copy_out(batch: Any, i: int) -> None:
            shape, dtype, name = capture.output_specs[i]
            out = outputs[i] = engine.device(name).allocator.alloc(math.prod(shape) * dtype.itemsize)
            batch.copy(out, capture.buffer(capture.output_numbers[i]))
        own: dict[Device, Any] = {}  # the argument copies that are not part of a run: one batch per device
        for position, number in self.args_into.get(None, ()):
            target = capture.buffer(number)
            if target.device not in own:
                own[target.device] = target.device.batch("compute")
            own[target.device].copy(target, args[position])
        completions.extend(batch.submit() for batch in own.values())
        for k, run in enumerate(self.runs):
            batch = run.device.batch(run.queue)
            for position, number in self.args_into.get(k, ()):
                batch.copy(capture.buffer(number), args[position])
            for buffer, write in run.accesses:
                batch.track(buffer, write)
            for fn, call_args in run.commands:
                batch.command(fn, call_args)
            for i in self.outputs_from.get(k, ()):
                copy_out(batch, i)
            completions.append(batch.submit())
        for i in self.outputs_from.get(None, ()):
            batch = engine.device(capture.output_specs[i][2]).batch("compute")
            copy_out(batch, i)
            completions.append(batch.submit())
        for position, number in capture.written_args:
            caller = args[position]
            batch = caller.device.batch("compute")
            batch.copy(caller, capture.buffer(number))
            completions.append(batch.submit())
        return outputs, completions


REPLAYS = ("auto", EntryReplay.name, StreamsReplay.name, RunsReplay.name)


def choose(capture: Capture, forced: str = "auto") -> Replay:
    """The replay of `capture`: the first of entry → streams → runs that applies (streams only
    while TINYDIST_JIT_NATIVE_STREAMS is on), or the one `forced` names; logged with the reasons."""
    if forced not in REPLAYS:
        raise ValueError(f"replay must be one of {', '.join(REPLAYS)}, got {forced!r}")
    passed: list[str] = []
    if forced in ("auto", EntryReplay.name):
        why = EntryReplay.unfit(capture)
        if why is None:
            return _chosen(EntryReplay(capture), forced, passed)
        if forced != "auto":
            raise ReplayUnfit(f"replay='entry' does not apply: {why}")
        passed.append(f"not entry: {why}")
    if forced == "auto" and command_queue.TRACER is not None:
        # captured while tracing: each kernel a command of its own, which the trace names and
        # times (entry and streams run a device's calls as one native call; `links` says no to
        # entry while tracing already)
        passed.append("not streams: tracing")
    elif forced == StreamsReplay.name or (forced == "auto" and settings.JIT_NATIVE_STREAMS == "on"):
        found = StreamsReplay.build(capture)
        if not isinstance(found, str):
            return _chosen(found, forced, passed)
        if forced != "auto":
            raise ReplayUnfit(f"replay='streams' does not apply: {found}")
        passed.append(f"not streams: {found}")
    elif forced == "auto":
        passed.append("not streams: TINYDIST_JIT_NATIVE_STREAMS=off")
    return _chosen(RunsReplay(capture), forced, passed)


def _chosen(replay: Replay, forced: str, passed: list[str]) -> Replay:
    log.debug("replay chosen", strategy=replay.name, forced=forced != "auto", reasons=passed)
    return replay
