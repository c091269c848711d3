"""A device's programs: every kernel, matmul and copy it runs, compiled once.

Each device owns one compiler (`Device.compiler`), so the engine never asks what a device can
do: it asks its compiler for a program. The default lowers kernel IR to LLVM IR and hands it to
the device's `load_ir` — a local device compiles it through the on-disk cache and loads the
object code, a remote device ships the IR to its node. A back end with a code generator of its
own (CUDA: PTX) brings a compiler of its own.

`links` is the one capability the engine reads: whether a list of launches can become one
program. On a device that runs host code in this process (`Device.native_code`), that program
is a native function calling each kernel with its addresses baked in (a capture's entry point);
elsewhere (a remote node, which runs no client binaries) there is nothing to link.

The programs are an LRU of `TINYDIST_LOADED_KERNELS` (1,024 by default): a process that keeps
meeting new shapes drops the kernels it used longest ago. Dropping one only lets go of this
cache's reference; its code is unmapped when the last holder lets go too (a cached schedule's
lowering, a captured step, a queued command: see `tinydist.runtime.cpu.loader`), so a dropped
kernel is never called after its code is gone, and one still in use is simply built again when
asked for. A hit costs a move to the LRU's end besides the lookup (~2 OrderedDict calls), once per
kernel per call-by-call realize; cached schedules' lowerings and replays do not ask.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from tinydist.base.config import settings
from tinydist.base.errors import DeviceError
from tinydist.codegen.compile_cache import compile_generated_kernel, compile_glue, compile_kernel
from tinydist.codegen.copy import SIGNATURE as STREAM_COPY_SIGNATURE
from tinydist.codegen.copy import stream_copy_ir
from tinydist.codegen.kernel import KernelAST, short_dtype
from tinydist.codegen.lowering import lower
from tinydist.codegen.matmul import matmul_ir, program_name, strided_form
from tinydist.codegen.matmul import signature as matmul_signature
from tinydist.codegen.matmul_tiling import StridedOperand
from tinydist.codegen.parallel import entry_ir as parallel_entry_ir
from tinydist.codegen.reduce import reduce_ir
from tinydist.codegen.reduce import signature as reduce_signature
from tinydist.graph.dtypes import DType
from tinydist.runtime.cpu.loader import native_loader
from tinydist.runtime.cpu.workers import pool
from tinydist.runtime import command_queue
from tinydist.runtime.program import LABELS, Program

if TYPE_CHECKING:
    from tinydist.runtime.device import Device

# (program, arguments in its signature order: addresses and integer scalars)
Launch = tuple[Program, Sequence[int]]

_entry_ids = itertools.count()
_MEMMOVE = ctypes.cast(ctypes.memmove, ctypes.c_void_p).value


class DeviceCompiler:
    """Programs for one device, each built once; see the module docstring."""

    def __init__(self, device: Device, capacity: int | None = None) -> None:
        self.device = device
        self.capacity = settings.LOADED_KERNELS if capacity is None else capacity
        self._lock = threading.Lock()
        self._programs: OrderedDict[Hashable, Program] = OrderedDict()
        self._building: dict[Hashable, Future[Program]] = {}   # builds under way, so each is built once
        self.evicted = 0  # programs dropped from the LRU

    @property
    def links(self) -> bool:
        """Whether `link` can turn launches into one program on this device. Not while tracing:
        what is lowered or captured then keeps each kernel a command of its own, so the trace
        names and times every kernel (a linked program is one event for all of them). `link`
        itself still works, for a caller that asked before tracing began."""
        return self.device.native_code and command_queue.TRACER is None

    def __len__(self) -> int:
        return len(self._programs)

    def _lookup(self, key: Hashable) -> Program | None:
        # no lock: each OrderedDict call is atomic under the GIL, and an eviction between the two
        # (the only writer that removes) just means the program is not renewed
        program = self._programs.get(key)
        if program is not None:
            try:
                self._programs.move_to_end(key)
            except KeyError:
                pass
        return program

    def _cached(self, key: Hashable, build: Callable[[], Program], label: Callable[[], str] | None = None) -> Program:
        program = self._lookup(key)
        if program is not None:
            return program
        with self._lock:
            program = self._lookup(key)
            if program is not None:
                return program
            pending = self._building.get(key)
            building = pending is None
            if pending is None:
                pending = self._building[key] = Future()
        if not building:
            return pending.result()   # another thread builds it: a kernel is built once
        try:
            program = self._build(build, label)
        except BaseException as exc:
            with self._lock:
                del self._building[key]
            pending.set_exception(exc)
            raise
        with self._lock:
            self._programs[key] = program
            del self._building[key]
            while len(self._programs) > self.capacity:
                _, dropped = self._programs.popitem(last=False)
                LABELS.pop(dropped.name, None)  # bounded with the programs (one still loaded elsewhere traces by symbol)
                self.evicted += 1
        pending.set_result(program)
        return program

    def compile_ahead(self, kernels: Sequence[KernelAST], matmuls: Sequence[tuple[DType, StridedOperand | None, str | None]],
                      also: Sequence[Callable[[], object]] = ()) -> None:
        """Build the programs of `kernels` and of `matmuls` ((dtype, strided, prepacked) as `matmul`
        takes them) not built yet, on up to one thread per CPU at once: LLVM runs without the GIL,
        so one kernel compiles while the next one's IR is rendered and another compiles. A schedule's
        lowering asks for them all first, then takes them one by one. `also`: other (cached) builds
        the caller is about to need, run in the same pool when there is one. The matmuls go first
        (one is ~0.5 s of LLVM, an elementwise kernel ~50 ms: the longest first keeps both threads
        busy to the end). Only a device compiling host code here (`native_code`); a failed build
        raises when its program is asked for again."""
        if not self.device.native_code:
            return
        todo: dict[Hashable, Callable[[], object]] = {}
        for dtype, strided, prepacked in matmuls:
            key = ("matmul", dtype.name, strided_form(dtype.name, strided), prepacked)
            if key not in self._programs:
                todo.setdefault(key, functools.partial(self.matmul, dtype, strided, prepacked))
        for ast in kernels:
            if ast not in self._programs:
                todo.setdefault(ast, functools.partial(self.kernel, ast))
        threads = min(len(todo), _cpus())
        if threads < 2:
            return
        with ThreadPoolExecutor(threads, thread_name_prefix="tinydist-compile") as pool:
            for done in [pool.submit(build) for build in (*todo.values(), *also)]:
                done.exception()   # wait; the error is raised again where the program is asked for

    def _build(self, build: Callable[[], Program], label: Callable[[], str] | None) -> Program:
        """`build()`, filing the program's label (`program.LABELS`); while tracing, also a span on
        the host's `compile` lane (lowering, the object cache or LLVM, loading)."""
        tracer = command_queue.TRACER
        started = time.perf_counter_ns() if tracer is not None else 0
        program = build()
        text = label() if label is not None else program.name
        if label is not None:
            LABELS[program.name] = text
        if tracer is not None:
            tracer.add_span("host", "compile", f"compile {text}", "compile", started, time.perf_counter_ns(),
                            {"program": program.name, "device": self.device.name})
        return program

    def kernel(self, ast: KernelAST) -> Program:
        def build() -> Program:
            signature = ["w"] * ast.outputs + ["r"] * len(ast.slot_dtypes)
            source = ast.source() if self.device.native_code else None
            if source is None:
                name, ir_text = lower(ast, publish_progress=self.device.native_code)
                return self.device.load_ir(ir_text, name, signature, compile_kernel)
            # looked up by the kernel itself (a warm cache lowers nothing); named by it too, as the IR is not at hand
            source = f"lower publish_progress=True\n{source}"
            name = "k_" + hashlib.sha256(source.encode()).hexdigest()[:20]
            return self.device.load_generated(source, lambda: lower(ast, name=name)[1], name, signature,
                                              compile_generated_kernel)
        return self._cached(ast, build, ast.label)

    def matmul(self, dtype: DType, strided: StridedOperand | None = None, prepacked: str | None = None) -> Program:
        """The matmul kernel; with `strided`, the one for that operand's form of view (one for every
        view of that form: the view is its trailing arguments, `StridedOperand.arguments`);
        `prepacked` "b" ("a"), one reading that operand packed at load (`pack_b_array`, `pack_a_array`)."""
        form = strided_form(dtype.name, strided)

        def build() -> Program:
            name = program_name(dtype.name, form, prepacked)
            publish = self.device.native_code
            # the request in full (the generator's code is in the cache key too): a warm cache renders no IR
            source = f"matmul_ir {name} {dtype.name} strided={form!r} publish_progress={publish} prepacked={prepacked}"
            return self.device.load_generated(
                source, lambda: matmul_ir(name, dtype.name, strided=form, publish_progress=publish, prepacked=prepacked),
                name, matmul_signature(form), compile_generated_kernel)
        return self._cached(("matmul", dtype.name, form, prepacked), build,
                            lambda: f"matmul {short_dtype(dtype)}{' strided' if strided is not None else ''}"
                                    f"{f' {prepacked.upper()} prepacked' if prepacked else ''}")

    def stream_copy(self) -> Program:
        """A copy with non-temporal stores, for copies bigger than the last-level cache."""
        def build() -> Program:
            name = "tinydist_stream_copy"
            return self.device.load_ir(stream_copy_ir(name), name, STREAM_COPY_SIGNATURE, compile_kernel)
        return self._cached(("stream_copy",), build, lambda: "stream copy")

    def link(self, launches: Sequence[Launch]) -> Program:
        """One program running `launches` in order, every argument bound."""
        if not self.device.native_code:
            raise DeviceError(f"{self.device.name} cannot link launches into one program (it runs no host code "
                              "of this process); replay its calls one by one")
        lines = [f"  {_call(program, args)}" for program, args in launches]
        name = f"tinydist_entry_{next(_entry_ids)}"
        ir_text = f"define void @{name}() {{\nentry:\n" + "\n".join(lines) + "\n  ret void\n}\n"
        return self._build(lambda: self.device.load_program(compile_glue(ir_text, straight_line=True), name, [],
                                                            calls=[program for program, _ in launches]),
                           lambda: _entry_label(launches))

    def link_parallel(self, threads: int, phases: Sequence[Sequence[Sequence[Launch]]]) -> Program:
        """One program running a frame on `threads` threads: this one and the workers of this
        device's pool of that size (`tinydist.runtime.cpu.workers`). `phases`: each a list of
        pieces, each piece launches one thread runs in order; a phase's pieces go to whichever
        thread takes them, and the next phase starts when they are all done (`tinydist.codegen.parallel`)."""
        if not self.device.native_code or threads < 2:
            raise DeviceError(f"{self.device.name} cannot link a parallel entry point over {threads} thread(s) "
                              "(it needs host code of this process and 2 or more threads); link one entry instead")
        workers = pool(self.device.name, threads)
        name = f"tinydist_entry_{next(_entry_ids)}"
        calls = [[[_call(program, args) for program, args in piece] for piece in phase] for phase in phases]
        ir_text = parallel_entry_ir(name, workers.control, workers.post.address, calls)
        launches = [launch for phase in phases for piece in phase for launch in piece]
        # at O0 too (`compile_glue`): its loops are the claim and the spin-wait, a pause each turn; the bulk is
        # the pieces' calls. bert6_384's entry: O1 988-1019 ms, O0 57-172 ms (load 6); frames at 2 threads,
        # alternating, O0/O1 1.048 (bert6_384) and 1.004 (resnet18) at load 6-8, i.e. within the noise there
        return self._build(lambda: self.device.load_program(compile_glue(ir_text, straight_line=True), name, [],
                                                            calls=[workers.post, *(program for program, _ in launches)]),
                           lambda: f"{threads} threads, " + _entry_label(launches))

    def link_frame(self, entry: Program, copies_in: Sequence[tuple[int, int]], copies_out: Sequence[tuple[int, int]]) -> Program:
        """One program taking a frame's host addresses — a source per `copies_in` (destination
        address, bytes), then a destination per `copies_out` (source address, bytes) — that copies
        them in, calls `entry`, and copies the results out: a numpy frame is one native call."""
        if not self.device.native_code or not self.device.host_visible:
            raise DeviceError(f"{self.device.name} cannot link a host frame (its memory is not the host's, "
                              "or it runs no host code of this process)")
        params = [f"ptr %in{i}" for i in range(len(copies_in))] + [f"ptr %out{i}" for i in range(len(copies_out))]
        # memmove by its address, not the memcpy intrinsic: a copy LLVM does not inline becomes a
        # call to an external symbol, whose 32-bit relocation the in-process loader cannot always
        # reach from JIT memory (it aborts the process); the streams' glue calls libc the same way
        copy = f"call ptr inttoptr (i64 {_MEMMOVE} to ptr)"
        lines = [f"  {copy}(ptr inttoptr (i64 {address} to ptr), ptr %in{i}, i64 {nbytes})"
                 for i, (address, nbytes) in enumerate(copies_in)]
        lines.append(f"  call void inttoptr (i64 {entry.address} to ptr)()")
        lines += [f"  {copy}(ptr %out{i}, ptr inttoptr (i64 {address} to ptr), i64 {nbytes})"
                  for i, (address, nbytes) in enumerate(copies_out)]
        name = f"tinydist_frame_{next(_entry_ids)}"
        ir_text = f"define void @{name}({', '.join(params)}) {{\nentry:\n" + "\n".join(lines) + "\n  ret void\n}\n"
        return self._build(lambda: self.device.load_program(compile_glue(ir_text, straight_line=True), name,
                                                            ["r"] * len(copies_in) + ["w"] * len(copies_out), calls=[entry]),
                           lambda: f"frame: {LABELS.get(entry.name, entry.name)}")


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on every platform
        return os.cpu_count() or 1


def _call(program: Program, args: Sequence[int]) -> str:
    """The IR instruction calling `program` with `args` baked in."""
    operands = [f"ptr inttoptr (i64 {value} to ptr)" if kind in ("r", "w", "rw") else f"i64 {value}"
                for kind, value in zip(program.signature, args, strict=True)]
    return f"call void inttoptr (i64 {program.address} to ptr)({', '.join(operands)})"


def _entry_label(launches: Sequence[Launch]) -> str:
    inner = list(dict.fromkeys(LABELS.get(program.name, program.name) for program, _ in launches))
    return f"{len(launches)} kernels: " + ", ".join(inner[:3]) + (", …" if len(inner) > 3 else "")


@functools.cache
def host_reduce(op: str, dtype: np.dtype, sources: int, outputs: int) -> Program:
    """The fused reduction of `tinydist.codegen.reduce` for host memory: the process-group
    collectives call it on their shared segment, outside any device queue."""
    name = f"tinydist_reduce_{op}_{dtype.str[1:]}_{sources}_{outputs}"
    return native_loader.load(compile_kernel(reduce_ir(name, op, dtype, sources, outputs)), name,
                              reduce_signature(sources, outputs))
