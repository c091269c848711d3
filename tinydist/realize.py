"""Running a schedule: bind buffers, compile what is new, submit, hand results to the graph.

Targets get buffers of their own (the user holds them); intermediates are views into one arena
per device and lane, laid out by the memory plan. Consecutive calls on the same device and queue
go into one batch (one worker hand-off); cross-queue and cross-device order comes from the
runtime's access logs, so a batch is submitted before another batch that reads its outputs is
built. The arena is freed right after submission — the runtime gives its memory back only once
the last kernel using it has completed.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence

import numpy as np

from tinydist.codegen.compile_cache import CompileCache
from tinydist.codegen.compiler import HostCompiler
from tinydist.codegen.copy import SIGNATURE as STREAM_COPY_SIGNATURE
from tinydist.codegen.copy import stream_copy_ir
from tinydist.codegen.kernel import KernelAST
from tinydist.codegen.lowering import STREAMING_STORE_BYTES, lower
from tinydist.codegen.matmul import SIGNATURE as MATMUL_SIGNATURE
from tinydist.codegen.matmul import StridedOperand, matmul_ir
from tinydist.codegen.reduce import reduce_ir
from tinydist.codegen.reduce import signature as reduce_signature
from tinydist.dtypes import DType
from tinydist.lazy import LazyNode, Op
from tinydist.logs import get_logger
from tinydist.runtime.buffer import Buffer
from tinydist.runtime.cpu.loader import native_loader
from tinydist.runtime.device import Batch, Completion, Device
from tinydist.runtime.engine import get_engine
from tinydist.runtime.program import Program
from tinydist.schedule import Schedule, create_schedule
from tinydist.schedule.items import CopyCall, GatherCall, KernelCall, MatmulCall, SliceCall

log = get_logger(layer="realize")


class Programs:
    """Compiled kernels: lowered once per kernel AST, compiled through the on-disk cache."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._compiler: HostCompiler | None = None
        self._cache: CompileCache | None = None
        self._programs: dict[tuple[object, str], Program] = {}

    def _compile_cache(self) -> CompileCache:
        if self._cache is None:
            self._compiler = HostCompiler()
            self._cache = CompileCache(self._compiler)
        return self._cache

    def kernel(self, ast: KernelAST, device: Device) -> Program:
        key = (ast, device.name)
        program = self._programs.get(key)
        if program is None:
            with self._lock:
                if hasattr(device, "load_kernel"):  # back ends with their own code generator (CUDA: PTX)
                    program = device.load_kernel(ast)
                    self._programs[key] = program
                    return program
                name, ir_text = lower(ast)
                program = device.load_ir(ir_text, name, ["w"] * ast.outputs + ["r"] * len(ast.slot_dtypes), self._compile_cache().compile)
                self._programs[key] = program
        return program

    def matmul(self, dtype: DType, device: Device, strided: StridedOperand | None = None) -> Program:
        """The matmul kernel; with `strided`, one specialised to read that operand through its view."""
        key = (("matmul", dtype.name, strided), device.name)
        program = self._programs.get(key)
        if program is None:
            with self._lock:
                if hasattr(device, "load_matmul"):  # same arguments as the CPU matmul
                    if strided is not None:
                        raise ValueError(f"{device.name} reads matmul operands contiguous only; the schedule gave a strided one")
                    program = device.load_matmul(dtype.name)
                    self._programs[key] = program
                    return program
                name = f"tinydist_matmul_{dtype.name}"
                if strided is not None:
                    name += "_strided_" + hashlib.sha256(repr(strided).encode()).hexdigest()[:16]
                program = device.load_ir(matmul_ir(name, dtype.name, strided=strided), name, MATMUL_SIGNATURE,
                                         self._compile_cache().compile)
                self._programs[key] = program
        return program

    def stream_copy(self, device: Device) -> Program:
        key = (("stream_copy",), device.name)
        program = self._programs.get(key)
        if program is None:
            with self._lock:
                name = "tinydist_stream_copy"
                program = device.load_ir(stream_copy_ir(name), name, STREAM_COPY_SIGNATURE, self._compile_cache().compile)
                self._programs[key] = program
        return program


    def host_reduce(self, op: str, dtype: np.dtype, sources: int, outputs: int) -> Program:
        """The fused reduction of `tinydist.codegen.reduce` for host memory (the process-group collectives
        call it on their shared segment, outside any device queue)."""
        key = (("reduce", op, dtype.str, sources, outputs), "host")
        program = self._programs.get(key)
        if program is None:
            with self._lock:
                name = f"tinydist_reduce_{op}_{dtype.str[1:]}_{sources}_{outputs}"
                program = native_loader.load(self._compile_cache().compile(reduce_ir(name, op, dtype, sources, outputs)),
                                             name, reduce_signature(sources, outputs))
                self._programs[key] = program
        return program


programs = Programs()


def _copy(batch: Batch, dst: Buffer, src: Buffer, total: int) -> None:
    """`src` into `dst` on the batch's queue, as part of a call writing `total` bytes. When that
    is bigger than the last-level cache, a copy in host memory from this device or a peer streams
    (non-temporal stores: no read-for-ownership, no eviction); anything else is the device's own copy."""
    device = batch.device
    if total >= STREAMING_STORE_BYTES and device.host_visible and device.reads_directly(src.device):
        batch.launch(programs.stream_copy(device), dst, src, dst.nbytes)
    else:
        batch.copy(dst, src)


def _with_readers_of_overwritten(targets: list[LazyNode]) -> list[LazyNode]:
    """Add the live, unrealized readers of every buffer an assign in this graph overwrites, so they
    are computed from the old value in the same schedule (before the overwrite: WAR)."""
    result = list(targets)
    while True:
        in_graph: set[int] = set()
        assigns: list[LazyNode] = []
        stack = list(result)
        while stack:
            node = stack.pop()
            if id(node) in in_graph or node.realized:
                continue
            in_graph.add(id(node))
            if node.op is Op.ASSIGN:
                assigns.append(node)
            stack.extend(node.srcs)
        extra = [reader for a in assigns for reader in a.srcs[0].live_readers()
                 if id(reader) not in in_graph and reader is not a]
        if not extra:
            return result
        result.extend(dict.fromkeys(extra))


def realize(targets: Sequence[LazyNode]) -> list[Completion]:
    """Compute every unrealized target and set its `buffer`; returns the submissions' completions."""
    pending = list(dict.fromkeys(t for t in targets if not t.realized))
    if not pending:
        return []
    pending = _with_readers_of_overwritten(pending)
    schedule, inputs = create_schedule(pending)
    buffers, arenas = _bind(schedule, inputs)
    try:
        completions = _submit(schedule, buffers)
    finally:
        for arena, views in arenas:
            for view in views:
                view.release()
            arena.free()
    for node, number in zip(pending, schedule.targets):
        node.buffer = buffers[schedule.aliases.get(number, number)]
        if not node.requires_grad or node.op in (Op.BUFFER, Op.ASSIGN):  # autograd hook: backward() walks srcs
            node.srcs = ()  # the graph below is no longer needed: let it be collected
    return completions


def _bind(schedule: Schedule, inputs: list[LazyNode]) -> tuple[list[Buffer | None], list[tuple[Buffer, list[Buffer]]]]:
    engine = get_engine()
    buffers: list[Buffer | None] = [None] * len(schedule.specs)
    for number, node in enumerate(inputs):
        buffers[number] = node.buffer
    arenas: list[tuple[Buffer, list[Buffer]]] = []
    for (device_name, lane), size in schedule.plan.arena_bytes.items():
        if size:
            arena = engine.device(device_name).allocator.alloc(size)
            arenas.append((arena, []))
            for number, where in schedule.plan.arena_of.items():
                if where == (device_name, lane):
                    view = arena.view(schedule.plan.offsets[number], schedule.specs[number].nbytes)
                    buffers[number] = view
                    arenas[-1][1].append(view)
    try:
        for number in range(schedule.n_inputs, len(schedule.specs)):
            spec = schedule.specs[number]
            if buffers[number] is None and number not in schedule.aliases and spec.nbytes:
                buffers[number] = engine.device(spec.device).allocator.alloc(spec.nbytes)
    except BaseException:
        for arena, views in arenas:
            for view in views:
                view.release()
            arena.free()
        raise
    for version, memory in schedule.aliases.items():
        buffers[version] = buffers[memory]
    return buffers, arenas


def _submit(schedule: Schedule, buffers: list[Buffer | None]) -> list[Completion]:
    engine = get_engine()
    completions: list[Completion] = []
    batch: Batch | None = None
    for call in schedule.linear:
        device = engine.device(call.device)
        if batch is None or batch.device is not device or batch.queue.kind != call.queue:
            if batch is not None and len(batch):
                completions.append(batch.submit())
            batch = device.batch(call.queue)
        if isinstance(call, KernelCall):
            batch.launch(programs.kernel(call.ast, device), buffers[call.out], *(buffers[i] for i in call.inputs))
        elif isinstance(call, MatmulCall):
            batch.launch(programs.matmul(call.dtype, device, call.strided), buffers[call.out], buffers[call.a], buffers[call.b],
                         buffers[call.workspace], call.batch, call.m, call.n, call.k,
                         call.a_batch_stride, call.b_batch_stride, call.m * call.n)
        elif isinstance(call, CopyCall):
            _copy(batch, buffers[call.out], buffers[call.src], call.nbytes)
        elif isinstance(call, GatherCall):
            out = buffers[call.out]
            for src, offset in zip(call.srcs, call.offsets):
                piece = out.view(offset, buffers[src].nbytes)
                _copy(batch, piece, buffers[src], call.nbytes)
                piece.release()  # the batch keeps the address and the access record, not the view
        elif isinstance(call, SliceCall):
            ranges = [buffers[n].view(call.start, call.nbytes) for n in (*call.outs, *call.inputs)]
            batch.launch(programs.kernel(call.ast, device), *ranges)
            for view in ranges:
                view.release()
    if batch is not None and len(batch):
        completions.append(batch.submit())
    log.debug("realized", calls=len(schedule.linear), batches=len(completions))
    return completions
