"""Each schedule item lowered to runtime commands, once.

Realize, capture and every replay strategy consume this lowering: a `Launch` (a program and its
arguments in its signature's order) or a `Copy`. A consumer either issues a command into a
batch (`issue`: checked, its accesses ordered by the access logs) or binds it to native form
(`bound`: the callable, integer arguments and the buffers it touches) for replays that
assemble their own commands. Writing this once is the point: the matmul's argument tuple, the
gather's views and the choice of a streaming copy used to be spelled out by every consumer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tinydist.codegen.lowering import STREAMING_STORE_BYTES
from tinydist.runtime.buffer import Buffer
from tinydist.runtime.device import Batch, Device
from tinydist.runtime.program import Program
from tinydist.schedule.items import Call, CollectiveCall, CopyCall, GatherCall, KernelCall, MatmulCall, SliceCall

# (buffer, written?) for every buffer a command touches
Accesses = list[tuple[Buffer, bool]]


@dataclass(frozen=True, slots=True)
class Launch:
    """`program` with `args` in its signature's order: buffers where it takes buffers."""
    program: Program
    args: tuple[Any, ...]

    def accesses(self) -> Accesses:
        return [(self.args[i], write) for i, write in self.program.buffer_args]

    def bound(self, device: Device) -> tuple[Any, tuple[int, ...], Accesses]:
        values = tuple(a.address if isinstance(a, Buffer) else a for a in self.args)
        return self.program.cfunc, values, self.accesses()


@dataclass(frozen=True, slots=True)
class Copy:
    """`src` into `dst` (same size); `streaming` copies with non-temporal stores (see `lower_call`)."""
    dst: Buffer
    src: Buffer
    streaming: bool

    def accesses(self) -> Accesses:
        return [(self.dst, True), (self.src, False)]

    def bound(self, device: Device) -> tuple[Any, tuple[int, ...], Accesses]:
        fn = device.compiler.stream_copy().cfunc if self.streaming else device.copy_command("d2d", self.src.device)
        return fn, (self.dst.address, self.src.address, self.dst.nbytes), self.accesses()


Command = Launch | Copy


def compile_ahead(calls: Sequence[Call], device_of: Callable[[str], Device], also: Sequence[Callable[[], object]] = ()) -> None:
    """Have each device build the kernels and matmuls `calls` will launch, several at once
    (`DeviceCompiler.compile_ahead`, with `also` on the first device's pool), before they are
    lowered one by one."""
    wanted: dict[str, tuple[Device, list[Any], list[Any]]] = {}
    for call in calls:
        if isinstance(call, KernelCall | MatmulCall):
            device = device_of(call.device)
            _, kernels, matmuls = wanted.setdefault(device.name, (device, [], []))
            if isinstance(call, KernelCall):
                kernels.append(call.ast)
            else:
                matmuls.append((call.dtype, call.strided, call.prepacked))
    for device, kernels, matmuls in wanted.values():
        device.compiler.compile_ahead(kernels, matmuls, also)
        also = ()


def lower_call(call: Call, buffers: Sequence[Buffer | None], device: Device, views: list[Buffer]) -> list[Command]:
    """The commands running `call` on `device` with the schedule's buffers bound; the views it
    makes of them (a gather's pieces, a slice kernel's ranges) are appended to `views` for the
    caller to release once the commands hold their addresses."""
    b: Any = buffers
    compiler = device.compiler
    if isinstance(call, KernelCall):
        return [Launch(compiler.kernel(call.ast), (b[call.out], *(b[i] for i in call.inputs)))]
    if isinstance(call, MatmulCall):
        return [Launch(compiler.matmul(call.dtype, call.strided, call.prepacked),
                       (b[call.out], b[call.a], b[call.b], b[call.workspace], call.batch, call.m, call.n, call.k,
                        call.a_batch_stride, call.b_batch_stride, call.m * call.n,
                        *(call.strided.arguments() if call.strided is not None else ())))]
    if isinstance(call, CollectiveCall):
        # a side of no bytes has no buffer: the program takes 0 there (its signature says i64)
        return [Launch(call.routine.program(), tuple(0 if b[n] is None else b[n] for n in (call.out, call.src)))]
    if isinstance(call, CopyCall):
        return [_copy(device, b[call.out], b[call.src], call.nbytes)]
    if isinstance(call, GatherCall):
        commands: list[Command] = []
        for src, offset in zip(call.srcs, call.offsets):
            piece = b[call.out].view(offset, b[src].nbytes)
            views.append(piece)
            commands.append(_copy(device, piece, b[src], call.nbytes))
        return commands
    assert isinstance(call, SliceCall), call
    ranges = [b[n].view(call.start, call.nbytes) for n in (*call.outs, *call.inputs)]
    views.extend(ranges)
    return [Launch(compiler.kernel(call.ast), tuple(ranges))]


def _copy(device: Device, dst: Buffer, src: Buffer, total: int) -> Copy:
    """A copy that is part of a call writing `total` bytes. When that is bigger than the
    last-level cache, a copy in host memory from this device or a peer streams (non-temporal
    stores: no read-for-ownership, no eviction); anything else is the device's own copy."""
    streaming = total >= STREAMING_STORE_BYTES and device.host_visible and device.reads_directly(src.device)
    return Copy(dst, src, streaming)


def issue(batch: Batch, command: Command) -> None:
    """Add `command` to `batch`: its buffers checked and its accesses ordered by the access logs."""
    if isinstance(command, Launch):
        batch.launch(command.program, *command.args)
    elif command.streaming:
        batch.launch(batch.device.compiler.stream_copy(), command.dst, command.src, command.dst.nbytes)
    else:
        batch.copy(command.dst, command.src)
