"""A captured step over several host devices, replayed as one native call per queue.

A capture binds a multi-device step into runs of calls, one device and queue each. Replayed as a
batch per run, every replay costs the feeding thread a batch, its tracked accesses and a
submission per run, and each queue's worker the GIL at every run boundary and every cross-queue
wait — on a 2-core machine, CPU taken from the devices at every step.

Here the ordering is baked at capture instead, as CUDA graphs do: the step's parts (argument
copies in, runs, output copies out) are grouped by queue ("stream"), every pair of parts on
different streams that touch the same memory in a conflicting way becomes a wait — on the same
replay's part when it comes first in the step, else on the previous replay's — and each stream's
parts are linked with their waits and signals into one native function
(`tinydist.codegen.stream_sync`, its memory in `tinydist.runtime.cpu.stream_control`). A replay writes the addresses that change (the caller's
arguments, the fresh outputs) into its row of a ring, and submits one batch per stream whose
only command is that function. The runtime's access logs still order the step against the rest
of the program through the memory the caller sees (arguments, weights, outputs); waits on the
capture's own queues are left to the native code while no other work was queued on them, and the
weights are standing accesses (one record per buffer and queue, moved forward per replay).

A replay that waits for nothing else is marked ready in its ring row once all its batches are
queued; a step function that finishes the replay before it runs it straight on (see
`step_function_ir`), so while the caller runs ahead a worker takes the GIL once per chain.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from tinydist.base.config import settings
from tinydist.base.errors import DeviceFailed, DeviceHang
from tinydist.codegen.compile_cache import compile_glue
from tinydist.codegen.stream_sync import ABORTED, OK, Part, Slot, Wait, futex_syscall, step_function_ir
from tinydist.runtime.buffer import Buffer
from tinydist.runtime.clock import native_now
from tinydist.runtime.command_queue import CommandQueue
from tinydist.runtime.cpu.loader import native_loader
from tinydist.runtime.cpu.stream_control import ControlBlock, native_address, publish
from tinydist.runtime.dependencies import StandingAccess
from tinydist.runtime.device import Completion, Device

RING = 128  # rows of per-replay addresses; a replay waits for the one RING before it to finish
# How long a stream's step function may run queued replays back to back before it returns to its
# worker (which then signals them): bounds how late a replay's completion is seen.
CHAIN_NS = 20_000_000
_names = itertools.count()

Span = tuple[int, int, int]  # (id of the base buffer, start, end)


def span(buffer: Buffer) -> Span:
    return id(buffer.base), buffer.offset, buffer.offset + buffer.nbytes


def overlap(a: Span, b: Span) -> bool:
    """Whether two spans share a byte of the same base buffer."""
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


class StepRun(Protocol):
    """A run of the captured step: consecutive commands on one device and queue, with every
    buffer they touch (and whether they write it)."""
    device: Device
    queue: str
    commands: list[tuple[Any, tuple[Any, ...]]]

    @property
    def accesses(self) -> list[tuple[Buffer, bool]]: ...


@dataclass
class _Unit:
    stream: int
    accesses: list[tuple[Span, bool]]
    commands: list[tuple[int, tuple[int | Slot, ...]]] = field(default_factory=list)
    index: int = 0  # position among its stream's parts


class _Stream:
    def __init__(self, device: Device, queue: str) -> None:
        self.device, self.queue = device, queue
        self.name = f"{device.name}/{queue}"
        self.shared: dict[int, tuple[Buffer, bool]] = {}  # caller-visible memory its runs touch
        self.standing: list[StandingAccess] = []
        # indices into a replay's argument sources, outputs and written arguments: what its
        # prologue copies in (reads), and what its epilogue copies out (writes)
        self.sources: list[int] = []
        self.outputs: list[int] = []
        self.written: list[int] = []
        self.units: list[_Unit] = []
        self.step: Any = None


class NativeStreams:
    """The replay of one captured multi-device step; see the module docstring."""

    @classmethod
    def build(cls, runs: Sequence[StepRun], arguments: Sequence[tuple[int, Buffer]],
              outputs: Sequence[tuple[Buffer, Device]], written: Sequence[tuple[int, Buffer]],
              shared: Sequence[Buffer]) -> NativeStreams | None:
        """None when a part is not host code taking integer arguments, or the machine has no futex
        (such a step replays in runs)."""
        if futex_syscall() is None or any(not d.native_code for d in cls._devices(runs, arguments, outputs)):
            return None
        for run in runs:
            for fn, args in run.commands:
                if native_address(fn) is None or not all(isinstance(a, int) for a in args):
                    return None
        return cls(runs, arguments, outputs, written, shared)

    def __init__(self, runs: Sequence[StepRun], arguments: Sequence[tuple[int, Buffer]],
                 outputs: Sequence[tuple[Buffer, Device]], written: Sequence[tuple[int, Buffer]],
                 shared: Sequence[Buffer]) -> None:
        self.streams: list[_Stream] = []
        index: dict[tuple[Device, str], int] = {}

        def stream(device: Device, queue: str) -> int:
            if (device, queue) not in index:
                index[(device, queue)] = len(self.streams)
                self.streams.append(_Stream(device, queue))
            return index[(device, queue)]
        memmove = native_address(next(iter(self._devices(runs, arguments, outputs))).host_copy())
        assert memmove is not None
        # the row of addresses a replay fills: argument sources, then outputs, then written arguments
        self.arg_positions = [position for position, _ in arguments]
        self.written_positions = [position for position, _ in written]
        self.output_sizes = [(device, buffer.nbytes) for buffer, device in outputs]
        row_words = len(arguments) + len(outputs) + len(written)
        prologues: dict[int, _Unit] = {}
        epilogues: dict[int, _Unit] = {}
        for k, (_, buffer) in enumerate(arguments):
            s = stream(buffer.device, "compute")
            unit = prologues.setdefault(s, _Unit(s, []))
            unit.accesses.append((span(buffer), True))
            unit.commands.append((memmove, (buffer.address, Slot(k), buffer.nbytes)))
            self.streams[s].sources.append(k)
        middle = []
        shared_spans = [span(b) for b in shared]
        calls: dict[int, list[Any]] = {}  # per stream, the kernels its step function calls by address
        for run in runs:
            s = stream(run.device, run.queue)
            unit = _Unit(s, [(span(b), w) for b, w in run.accesses])
            unit.commands = [(native_address(fn) or 0, args) for fn, args in run.commands]
            calls.setdefault(s, []).extend(fn for fn, _ in run.commands)
            middle.append(unit)
            for buffer, write in run.accesses:
                if any(overlap(span(buffer), other) for other in shared_spans):
                    seen = self.streams[s].shared.get(id(buffer))
                    self.streams[s].shared[id(buffer)] = (buffer, write or (seen is not None and seen[1]))
        for i, (buffer, device) in enumerate(outputs):
            s = stream(device, "compute")
            unit = epilogues.setdefault(s, _Unit(s, []))
            unit.accesses.append((span(buffer), False))
            unit.commands.append((memmove, (Slot(len(arguments) + i), buffer.address, buffer.nbytes)))
            self.streams[s].outputs.append(i)
        for k, (_, buffer) in enumerate(written):
            s = stream(buffer.device, "compute")
            unit = epilogues.setdefault(s, _Unit(s, []))
            unit.accesses.append((span(buffer), False))
            unit.commands.append((memmove, (Slot(len(arguments) + len(outputs) + k), buffer.address, buffer.nbytes)))
            self.streams[s].written.append(k)
        # the step's order: every argument copied in, the runs, every output copied out
        units = [*prologues.values(), *middle, *epilogues.values()]
        for unit in units:
            own = self.streams[unit.stream].units
            unit.index = len(own)
            own.append(unit)
        waits = _waits(units)
        self.block = ControlBlock(len(self.streams))
        self.rows = np.zeros((RING, max(row_words, 1)), np.int64)
        self.ready = np.zeros(RING, np.int64)  # word r % RING is r + 1 once replay r may run back to back
        self.timeout = settings.TIMELINE_TIMEOUT
        # the native waits time their deadline on the devices' clock, as their timelines do
        clocks = {id(st.device.clock): st.device.clock for st in self.streams}
        if len(clocks) != 1:
            raise ValueError("a captured step's streams time their waits on one clock, but its devices are on "
                             f"{len(clocks)}: " + ", ".join(f"{st.device.name}: {st.device.clock!r}" for st in self.streams)
                             + "; open them on the same clock")
        now_address = native_now(self.streams[0].device.clock)
        counts = [len(s.units) for s in self.streams]
        # per stream, the progress words of the kernels it runs: a peer waiting on a part that
        # runs one long kernel counts the kernel's progress (tinydist.codegen.progress)
        self.kernel_words = [_word_table(st.units) for st in self.streams]
        for s, st in enumerate(self.streams):
            name = f"jit_stream_{next(_names)}_{id(self):x}_{s}"
            parts = [Part(tuple(waits[id(u)]), tuple(u.commands)) for u in st.units]
            ir_text = step_function_ir(name, self.block, s, parts, counts, self.rows.ctypes.data, RING,
                                       self.rows.shape[1], self.ready.ctypes.data, int(self.timeout * 1e9), CHAIN_NS,
                                       [table.ctypes.data for table in self.kernel_words], now_address)
            # (the kernels it calls stay loaded while it is: their progress words, read by the waits, with them)
            program = st.device.load_program(compile_glue(ir_text), name, [], calls=calls.get(s, ()))
            st.step = _StepCommand(self, s, program.cfunc)
            st.standing = [StandingAccess(buffer, write) for buffer, write in st.shared.values()]
            st.device.failure_listeners.add(self.block)
        self.queues: list[CommandQueue] = [st.device.queues[st.queue] for st in self.streams]
        self.last_submitted = [-1] * len(self.streams)  # each stream's batch of the latest replay
        self.replays = 0
        self.inflight: collections.deque[list[Completion]] = collections.deque()

    @staticmethod
    def _devices(runs: Sequence[StepRun], arguments: Sequence[tuple[int, Buffer]],
                 outputs: Sequence[tuple[Buffer, Device]]) -> set[Device]:
        return {run.device for run in runs} | {b.device for _, b in arguments} | {d for _, d in outputs}

    def replay(self, args: Sequence[Buffer]) -> tuple[list[Buffer], list[Completion]]:
        """Queue one replay of the caller's argument buffers (by argument position); returns its
        fresh output buffers and each stream's completion."""
        block = self.block
        if block.aborted:
            raise DeviceFailed(f"this captured step stopped after a failure ({self._failed_devices() or 'its replay was cut short'}); "
                               "close and reopen its devices, then capture it again")
        if len(self.inflight) == RING:  # the row this replay writes is the one RING replays ago read
            for completion in self.inflight.popleft():
                completion.wait_blocking()
        sources = [args[position] for position in self.arg_positions]
        outputs = [device.allocator.alloc(nbytes) for device, nbytes in self.output_sizes]
        written = [args[position] for position in self.written_positions]
        row = self.rows[self.replays % RING]
        for k, buffer in enumerate([*sources, *outputs, *written]):
            row[k] = buffer.address
        # waits on the capture's own queues are the native code's, unless other work joined them
        native = frozenset(q.timeline for q, last in zip(self.queues, self.last_submitted) if q.last_submitted == last)
        batches = []
        for st in self.streams:
            batch = st.device.batch(st.queue)
            batch.leave_ordering_to(native)
            for standing in st.standing:  # weights: recorded after submit, waited for only when something else touched them
                if not standing.unchanged:
                    batch.order_after(standing.buffer, standing.write)
            for k in st.sources:
                batch.track(sources[k], False)
            for i in st.outputs:
                batch.track(outputs[i], True)
            for k in st.written:
                batch.track(written[k], True)
            batch.command(st.step, ())
            batches.append(batch)
        completions = []
        try:
            for s, batch in enumerate(batches):
                completion = batch.submit()
                completions.append(completion)
                self.last_submitted[s] = completion.value
                for standing in self.streams[s].standing:
                    standing.renew(completion.timeline, completion.value)
        except BaseException:
            block.abort()  # the streams already queued would wait for the ones that never will be
            raise
        # A replay that waits for no other work (and joins queues no other work joined) may run
        # straight on from the one before it, in the same native call.
        if len(native) == len(self.streams) and all(len(batch) == 1 for batch in batches):
            publish(self.ready.ctypes.data + 8 * (self.replays % RING), self.replays + 1)
        self.replays += 1
        self.inflight.append(completions)
        return outputs, completions

    def _failed_devices(self) -> str:
        return "; ".join(f"{st.device.name}: {st.device.failure}" for st in self.streams if st.device.failure is not None)

    def stopped(self, s: int) -> DeviceFailed:
        """The error for stream `s`'s step function having given up a wait (its status words)."""
        block, st = self.block, self.streams[s]
        peer = self.streams[block.word(s, block.PEER)]
        parts = len(peer.units)
        replay, part = divmod(block.word(s, block.TARGET) - 1, parts)  # replays counted from 1, parts from 0
        waited = f"{st.name} (part {block.word(s, block.UNIT)}) waited for {peer.name}'s part {part} of replay {replay + 1}"
        if block.word(s, block.STATUS) == ABORTED:
            why = self._failed_devices() or "another stream of the step gave up first"
            return DeviceFailed(f"{waited} and stopped: {why}")
        hang = DeviceHang(f"{waited}, and {peer.name} made no progress for {self.timeout:g}s, nor did a kernel it runs "
                          f"(its counter stood at {block.word(s, block.SEEN)} parts, all replays counted); "
                          f"{peer.device.name} is marked failed — reopen it (Engine.reopen)")
        first = peer.device.mark_failed(hang)
        if first is hang:
            peer.device.contain(peer.device.queues[peer.queue].timeline)
        return first


class _StepCommand:
    """A stream's batch command: its step function, then a check of why it returned."""

    __slots__ = ("streams", "stream", "cfunc", "__name__")

    def __init__(self, streams: NativeStreams, stream: int, cfunc: Any) -> None:
        self.streams, self.stream, self.cfunc = streams, stream, cfunc
        self.__name__ = getattr(cfunc, "__name__", "jit_stream")

    def __call__(self) -> None:
        self.cfunc()
        if self.streams.block.word(self.stream, ControlBlock.STATUS) != OK:
            raise self.streams.stopped(self.stream)


def _word_table(units: Sequence[_Unit]) -> np.ndarray:
    """int64 [count, address, ...]: the progress words of the kernels `units` call, once each."""
    words = sorted({word for unit in units for address, _ in unit.commands
                    if (word := native_loader.progress_word(address))})
    return np.array([len(words), *words], np.int64)


def _waits(units: Sequence[_Unit]) -> dict[int, list[Wait]]:
    """For each part (by id): what it waits for on other streams — the latest conflicting part that
    comes before it in the step (this replay), else the latest after it (the previous replay) —
    leaving out what an earlier part of its own stream already waited for."""
    def strength(lag: int, index: int) -> tuple[int, int]:
        return -lag, index  # a part of this replay is later than any of the one before
    waited: dict[tuple[int, int], tuple[int, int]] = {}  # (stream, peer) -> strongest wait so far
    result: dict[int, list[Wait]] = {}
    for i, unit in enumerate(units):
        need: dict[int, tuple[int, int]] = {}
        for j, other in enumerate(units):
            if other.stream == unit.stream or not _conflict(unit.accesses, other.accesses):
                continue
            candidate = strength(0 if j < i else 1, other.index)
            if candidate > need.get(other.stream, (-2, -1)):
                need[other.stream] = candidate
        result[id(unit)] = []
        for peer, candidate in sorted(need.items()):
            if candidate > waited.get((unit.stream, peer), (-2, -1)):
                waited[(unit.stream, peer)] = candidate
                result[id(unit)].append(Wait(peer, -candidate[0], candidate[1]))
    return result


def _conflict(a: list[tuple[Span, bool]], b: list[tuple[Span, bool]]) -> bool:
    return any((wa or wb) and overlap(sa, sb) for sa, wa in a for sb, wb in b)
