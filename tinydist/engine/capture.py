"""A captured graph: bound once, compiled once, replayed by the strategy that fits.

Capture binds every buffer of the schedule once (`tinydist.engine.binding`): the arguments the
caller passes get buffers of the capture's own, which each replay copies them into (so feeding
an output back as the next input is safe); weights are bound where they live; intermediates get
one arena. A strategy (`tinydist.engine.replay`) then turns the bound schedule into native code
and replays it. A failure while capturing gives back everything the capture took.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from tinydist.engine.binding import bind
from tinydist.engine.replay import HostFrame, Replay, choose
from tinydist.graph.dtypes import DType
from tinydist.graph.lazy import LazyNode
from tinydist.graph.shape import Shape
from tinydist.runtime.buffer import Buffer
from tinydist.runtime.device import Batch, Completion
from tinydist.runtime.engine import get_engine
from tinydist.schedule import Schedule


class Capture:
    """One captured graph; see the module docstring.

    `arguments` maps input numbers of the schedule to the caller's argument positions; the
    other inputs are weights. `outputs` are the graph's outputs, in the caller's order (the
    schedule's first targets; the rest are side effects, assigns made by the function)."""

    def __init__(self, schedule: Schedule, inputs: Sequence[LazyNode], arguments: Mapping[int, int],
                 outputs: Sequence[LazyNode], replay: str = "auto", threads: int = 1) -> None:
        self.schedule = schedule
        self.threads = threads  # the one-entry-point replay's (tinydist.engine.parallel)
        self.output_specs: list[tuple[Shape, DType, str]] = [(node.shape, node.dtype, node.device) for node in outputs]
        self.output_bytes = [node.nbytes for node in outputs]
        self.devices = {device for _, _, device in self.output_specs} | {call.device for call in schedule.linear}
        self.keep_alive: list[Buffer] = []  # views whose addresses replays use
        self.bound = bind(schedule, inputs, owned=arguments.keys())
        try:
            self.buffers = self.bound.buffers
            self.arg_slots = sorted((position, number) for number, position in arguments.items())
            # the same, with each argument's shape and dtype (a frame loop's views of its buffers)
            self.arg_layouts = [(position, number, (inputs[number].shape, inputs[number].dtype))
                                for position, number in self.arg_slots]
            self.output_numbers = [schedule.aliases.get(n, n) for n in schedule.targets[:len(outputs)]]
            # inputs the function assigned to: their new value is copied back to the caller's buffer
            self.written_args = [(position, number) for position, number in self.arg_slots
                                 if number in schedule.aliases.values()]
            # Buffers the capture owns are touched only by its replays, in FIFO order on one queue:
            # only the weights it shares with the rest of the program need ordering against other work.
            shared: dict[int, tuple[Buffer, bool]] = {}
            for number in range(len(inputs)):
                buffer = self.buffers[number]
                if number not in arguments and buffer is not None:
                    written = number in schedule.aliases.values()
                    shared[id(buffer)] = (buffer, written or shared.get(id(buffer), (buffer, False))[1])
            self.accesses = list(shared.values())
            self.strategy: Replay = choose(self, replay)
            self.frame = HostFrame(self.strategy) if HostFrame.unfit(self) is None else None  # type: ignore[arg-type]
        except BaseException:
            self.bound.release()
            raise

    def buffer(self, number: int) -> Buffer:
        return self.bound.buffer(number)

    def replay(self, args: Sequence[Buffer], inline: bool) -> tuple[list[Buffer], list[Completion]]:
        """Queue one replay of the caller's argument buffers (by argument position)."""
        return self.strategy.replay(args, inline)

    def replay_arrays(self, arrays: Sequence[np.ndarray], devices: Sequence[str]) -> list[np.ndarray]:
        """numpy arrays in (C-contiguous, by argument position, for arguments on `devices`),
        numpy arrays out: the host frame where it applies, else the arrays uploaded straight to
        their devices, one replay, and the outputs read back — on any device, local or remote."""
        if self.frame is not None:
            return self.frame.run(arrays)
        engine = get_engine()
        uploads: dict[str, Batch] = {}
        args: list[Buffer] = []
        for array, name in zip(arrays, devices):
            device = engine.device(name)
            buffer = device.allocator.alloc(array.nbytes)
            if not device.write_now(buffer, array):
                if name not in uploads:
                    uploads[name] = device.batch("copy")
                uploads[name].write_from_host(buffer, array)
            args.append(buffer)
        for batch in uploads.values():
            batch.submit()
        outputs, completions = self.replay(args, inline=True)
        results = [np.empty(shape, dtype.np) for shape, dtype, _ in self.output_specs]
        reads = []
        for completion in completions:
            completion.wait_blocking()
        for result, buffer in zip(results, outputs):
            if not buffer.device.read_now(result, buffer):
                batch = buffer.device.batch("copy")
                batch.read_to_host(result, buffer)
                reads.append(batch.submit())
        for completion in reads:
            completion.wait_blocking()
        return results
