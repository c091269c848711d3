"""CUDA devices over the driver API: `CUDA:0`, `CUDA:1`, …

One context per device (`cuCtxCreate`), one non-blocking CUDA stream per queue (compute, copy).
The runtime's queue worker threads stay in charge of ordering: a batch for CUDA is

    [begin: make the context current, select this queue's stream]
    commands: each enqueues async work on that stream (cuLaunchKernel, cuMemcpy*Async) — or is a
              host wait on another queue's timeline (cross-queue / cross-device order)
    [end: cuStreamSynchronize]

and only then does the worker signal the queue's timeline, so a timeline value still proves that
the work *finished*. The synchronize blocks the worker thread, not the event loop (ctypes releases
the GIL). Commands that run outside a CUDA batch (a CPU device's copy queue reading CUDA memory)
make the context current themselves and use the synchronous copies.

Memory is plain `cuMemAlloc` (never managed). Copies: host→device / device→host on the queue's
stream; device→device within a device with cuMemcpyDtoDAsync; between two CUDA devices with
cuMemcpyPeerAsync after cuCtxEnablePeerAccess where cuDeviceCanAccessPeer allows it, otherwise
staged through host memory in chunks.

Kernels: PTX from `tinydist.codegen.ptx`, JIT-compiled by the driver with its error log
surfaced verbatim in `CompileError`. A JIT capture links its launches into one callable run in one
batch — a single submission with one synchronize (not a CUDA graph).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from tinydist.base.config import settings
from tinydist.base.errors import CompileError, DeviceError, DeviceUnavailable
from tinydist.codegen import ptx
from tinydist.codegen.kernel import KernelAST
from tinydist.codegen.matmul_tiling import StridedOperand
from tinydist.graph.dtypes import DType
from tinydist.runtime.allocator import Allocator
from tinydist.runtime.compiler import DeviceCompiler
from tinydist.runtime.cuda import driver as cu
from tinydist.runtime.device import Batch, Device
from tinydist.runtime.program import Program, check_signature

STAGING_CHUNK = 64 << 20  # host staging between devices without peer access
JIT_LOG_BYTES = 64 << 10
_ARG_TYPES: dict[str, type[ctypes._SimpleCData[Any]]] = {"r": ctypes.c_uint64, "w": ctypes.c_uint64, "rw": ctypes.c_uint64,
              "i64": ctypes.c_int64, "f64": ctypes.c_double, "f32": ctypes.c_float}


class CUDAAllocator(Allocator):
    """Device memory from cuMemAlloc (256-byte aligned by the driver); freed with cuMemFree."""

    def _map(self, nbytes: int) -> int:
        device: CUDADevice = self.device  # type: ignore[assignment]
        device.make_current()
        pointer = ctypes.c_uint64()
        device.driver.call("cuMemAlloc_v2", ctypes.byref(pointer), nbytes)
        return pointer.value

    def _unmap(self, address: int, nbytes: int) -> None:
        device: CUDADevice = self.device  # type: ignore[assignment]
        device.make_current()
        device.driver.call("cuMemFree_v2", address)


class _StreamBatch(Batch):
    """A Batch whose commands run between the device's begin (context, stream) and end (sync)."""

    __slots__ = ()

    def submit(self, inline: bool = False) -> Any:
        if self.completion is None and self._commands:
            device: CUDADevice = self.device  # type: ignore[assignment]
            kind = self.queue.kind
            self._commands.insert(0, (device._begin, (kind,)))
            self._commands.append((device._end, (kind,)))
        return super().submit(inline)


class _Launch:
    """A loaded kernel: calling it enqueues one launch on the current batch's stream."""

    def __init__(self, device: CUDADevice, function: int, kernel: ptx.PTXKernel) -> None:
        self.device, self.function, self.kernel = device, function, kernel
        self.kinds = [_ARG_TYPES[k] for k in kernel.signature]

    def prepare(self, args: Sequence[Any]) -> tuple[tuple[int, ...], Any, Any] | None:
        """Launch geometry and the kernelParams array for `args`; None when there is nothing to do."""
        grid, block = self.kernel.launch_dims(tuple(args), self.device.sm_count)
        if 0 in grid:
            return None
        values = [kind(arg) for kind, arg in zip(self.kinds, args)]
        params = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
        return (*grid, *block), params, values  # values keep the argument storage alive

    def launch(self, prepared: tuple[tuple[int, ...], Any, Any] | None) -> None:
        if prepared is None:
            return
        dims, params, _values = prepared
        stream = self.device.current_stream()
        self.device.driver.call("cuLaunchKernel", self.function, *dims, 0, stream or self.device.streams["compute"], params, None)
        if stream is None:  # outside a batch: finish before returning, like every other command
            self.device.driver.call("cuStreamSynchronize", self.device.streams["compute"])

    def __call__(self, *args: Any) -> None:
        self.launch(self.prepare(args))


class _Replay:
    """A JIT capture: prepared launches enqueued back to back (one batch, one synchronize)."""

    def __init__(self, launches: list[tuple[_Launch, Any]]) -> None:
        self.launches = launches

    def __call__(self) -> None:
        for launcher, prepared in self.launches:
            launcher.launch(prepared)


class CUDADevice(Device):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.index = int(name.split(":")[1])
        self.driver: cu.Driver = None  # type: ignore[assignment]
        self.handle = 0          # CUdevice
        self.context = 0         # CUcontext
        self.capability = (0, 0)
        self.arch = ""
        self.sm_count = 1
        self.streams: dict[str, int] = {}
        self._allocator: CUDAAllocator | None = None
        self._modules: list[int] = []
        self._programs: dict[Any, Program] = {}
        self._programs_lock = threading.Lock()
        self._peers: dict[str, bool] = {}  # source device name -> peer access enabled?
        self._tls = threading.local()

    # ---- lifecycle ---------------------------------------------------------------------------

    @property
    def allocator(self) -> CUDAAllocator:
        if self._allocator is None:
            self.check_usable()
        assert self._allocator is not None
        return self._allocator

    def _open_backend(self) -> None:
        try:
            drv = cu.load()
        except cu.DriverUnavailable as exc:
            raise DeviceUnavailable(f"{self.name} cannot open: {exc}") from exc
        undo: list[Callable[[], object]] = []
        try:
            count = drv.out_int("cuDeviceGetCount")
            if self.index >= count:
                raise DeviceUnavailable(f"{self.name} cannot open: the driver reports {count} CUDA device(s)")
            self.driver = drv
            self.handle = drv.out_int("cuDeviceGet", self.index)
            self.capability = (drv.attribute(cu.ATTR_COMPUTE_CAPABILITY_MAJOR, self.handle),
                               drv.attribute(cu.ATTR_COMPUTE_CAPABILITY_MINOR, self.handle))
            self.arch = ptx.arch_for(self.capability)
            self.sm_count = drv.attribute(cu.ATTR_MULTIPROCESSOR_COUNT, self.handle)
            total = ctypes.c_size_t()
            drv.call("cuDeviceTotalMem_v2", ctypes.byref(total), self.handle)
            context = drv.out_pointer("cuCtxCreate_v2", 0, self.handle)
            self.context = context
            undo.append(lambda: drv.call("cuCtxDestroy_v2", context))
            for kind in self.queue_kinds:
                stream = drv.out_pointer("cuStreamCreate", cu.STREAM_NON_BLOCKING)
                self.streams[kind] = stream
                undo.append(partial(drv.call, "cuStreamDestroy_v2", stream))
            self._allocator = CUDAAllocator(self, total.value, settings.ALLOCATOR_CACHE, settings.ALLOCATOR_CACHE_BLOCKS)
        except BaseException:
            for step in reversed(undo):
                try:
                    step()
                except cu.CUDAError as exc:
                    self.log.error("undo after a failed open failed", error=str(exc))
            self.streams, self.context = {}, 0
            raise

    def _close_backend(self) -> None:
        if not self.context:
            return
        errors = []
        try:
            if self._allocator is not None:
                self._allocator.release_all()
        except cu.CUDAError as exc:
            errors.append(exc)
        self.make_current()
        for module in self._modules:
            try:
                self.driver.call("cuModuleUnload", module)
            except cu.CUDAError as exc:
                errors.append(exc)
        for stream in self.streams.values():
            try:
                self.driver.call("cuStreamDestroy_v2", stream)
            except cu.CUDAError as exc:
                errors.append(exc)
        try:
            self.driver.call("cuCtxDestroy_v2", self.context)  # gives back anything still held
        except cu.CUDAError as exc:
            errors.append(exc)
        self._modules, self.streams, self.context = [], {}, 0
        for error in errors:
            self.log.error("CUDA close step failed", error=str(error))

    # ---- context, streams, batches -----------------------------------------------------------

    def make_current(self) -> None:
        if not self.context:
            raise DeviceError(f"{self.name} has no CUDA context (not open)")
        self.driver.call("cuCtxSetCurrent", self.context)

    def current_stream(self) -> int | None:
        """The stream of the CUDA batch running on this thread, or None outside one."""
        return getattr(self._tls, "stream", None)

    def _begin(self, kind: str) -> None:
        self.make_current()
        self._tls.stream = self.streams[kind]

    def _end(self, kind: str) -> None:
        self._tls.stream = None
        self.driver.call("cuStreamSynchronize", self.streams[kind])

    def batch(self, queue: str = "compute") -> Batch:
        self.check_usable()
        try:
            return _StreamBatch(self, self.queues[queue])
        except KeyError:
            raise ValueError(f"{self.name} has no queue {queue!r}; queues: {', '.join(self.queues)}") from None

    # ---- copies ------------------------------------------------------------------------------

    def copy_command(self, direction: str, source: Device | None = None) -> Callable[[int, int, int], None]:
        if direction == "h2d":
            return self._h2d
        if direction == "d2h":
            return self._d2h
        if direction != "d2d":
            raise ValueError(f"copy direction must be 'h2d', 'd2h' or 'd2d', got {direction!r}")
        if source is None or source is self:
            return self._d2d
        if source.host_visible:
            return self._h2d
        if isinstance(source, CUDADevice):
            return self._peer_copy(source)
        raise DeviceError(f"{self.name} cannot copy from {source.name}: neither CUDA nor host memory; stage through a CPU device")

    def host_copy(self) -> Callable[[int, int, int], None]:
        """Copy between any two addresses this process can name (unified addressing tells the
        driver which side each is on): what a JIT replay's copies use."""
        return self._any

    def _run_copy(self, async_name: str, sync_name: str, dst: int, src: int, nbytes: int) -> None:
        stream = self.current_stream()
        if stream is not None:
            self.driver.call(async_name, dst, src, nbytes, stream)
        else:
            self.make_current()
            self.driver.call(sync_name, dst, src, nbytes)

    def _h2d(self, dst: int, src: int, nbytes: int) -> None:
        self._run_copy("cuMemcpyHtoDAsync_v2", "cuMemcpyHtoD_v2", dst, src, nbytes)

    def _d2h(self, dst: int, src: int, nbytes: int) -> None:
        self._run_copy("cuMemcpyDtoHAsync_v2", "cuMemcpyDtoH_v2", dst, src, nbytes)

    def _d2d(self, dst: int, src: int, nbytes: int) -> None:
        self._run_copy("cuMemcpyDtoDAsync_v2", "cuMemcpyDtoD_v2", dst, src, nbytes)

    def _any(self, dst: int, src: int, nbytes: int) -> None:
        stream = self.current_stream()
        if stream is None:
            self.make_current()
            self.driver.call("cuMemcpyAsync", dst, src, nbytes, self.streams["copy"])
            self.driver.call("cuStreamSynchronize", self.streams["copy"])
        else:
            self.driver.call("cuMemcpyAsync", dst, src, nbytes, stream)

    def can_access_peer(self, source: CUDADevice) -> bool:
        allowed = self.driver.out_int("cuDeviceCanAccessPeer", self.handle, source.handle)
        return bool(allowed)

    def _peer_copy(self, source: CUDADevice) -> Callable[[int, int, int], None]:
        enabled = self._peers.get(source.name)
        if enabled is None:
            enabled = self.can_access_peer(source)
            if enabled:  # let this context read the source's memory
                self.make_current()
                code = self.driver.raw("cuCtxEnablePeerAccess", source.context, 0)
                if code not in (cu.CUDA_SUCCESS, cu.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED):
                    raise self.driver.error("cuCtxEnablePeerAccess", code)
            self._peers[source.name] = enabled
            self.log.debug("peer copies", source=source.name, peer_access=enabled)

        if enabled:
            def peer(dst: int, src: int, nbytes: int) -> None:
                stream = self.current_stream()
                if stream is None:
                    self.make_current()
                self.driver.call("cuMemcpyPeerAsync", dst, self.context, src, source.context, nbytes, stream or self.streams["copy"])
                if stream is None:
                    self.driver.call("cuStreamSynchronize", self.streams["copy"])
            return peer

        def staged(dst: int, src: int, nbytes: int) -> None:
            host = np.empty(min(nbytes, STAGING_CHUNK), np.uint8)
            stream = self.current_stream()
            for start in range(0, nbytes, STAGING_CHUNK):
                n = min(STAGING_CHUNK, nbytes - start)
                source.make_current()
                source.driver.call("cuMemcpyDtoH_v2", host.ctypes.data, src + start, n)
                self.make_current()
                self.driver.call("cuMemcpyHtoD_v2", dst + start, host.ctypes.data, n)
            if stream is not None:
                self.make_current()
        return staged

    # ---- programs ----------------------------------------------------------------------------

    def load_program(self, object_code: bytes, entry: str, signature: Sequence[str], calls: Sequence[Any] = ()) -> Program:
        raise DeviceError(f"{self.name} runs PTX kernels with launch geometry: use dev.compiler.kernel(ast) / dev.compiler.matmul(dtype) "
                          "(host object code cannot run on a GPU)")

    def load_ir(self, ir_text: str, entry: str, signature: Sequence[str], compile: Callable[[str], bytes]) -> Program:
        raise DeviceError(f"{self.name} cannot run host LLVM IR ({entry}); kernels reach it as kernel ASTs through dev.compiler.kernel")

    def load_generated(self, source: str, render: Callable[[], str], entry: str, signature: Sequence[str],
                       compile: Callable[[str, Callable[[], str]], bytes]) -> Program:
        raise DeviceError(f"{self.name} cannot run host LLVM IR ({entry}); kernels reach it as kernel ASTs through dev.compiler.kernel")

    def _cached(self, key: Any, make: Callable[[], ptx.PTXKernel]) -> Program:
        program = self._programs.get(key)
        if program is None:
            with self._programs_lock:
                program = self._programs.get(key)
                if program is None:
                    self.check_usable()
                    kernel = make()
                    program = self.load_ptx(ptx.compile_ptx(kernel.ir, self.arch), kernel)
                    self._programs[key] = program
        return program

    def load_ptx(self, ptx_text: str, kernel: ptx.PTXKernel) -> Program:
        """JIT-compile PTX with the driver; its error log comes back verbatim in a CompileError."""
        signature = check_signature(kernel.name, kernel.signature)
        self.make_current()
        info = ctypes.create_string_buffer(JIT_LOG_BYTES)
        error = ctypes.create_string_buffer(JIT_LOG_BYTES)
        options = (ctypes.c_int * 5)(cu.JIT_INFO_LOG_BUFFER, cu.JIT_INFO_LOG_BUFFER_SIZE_BYTES,
                                     cu.JIT_ERROR_LOG_BUFFER, cu.JIT_ERROR_LOG_BUFFER_SIZE_BYTES, cu.JIT_LOG_VERBOSE)
        values = (ctypes.c_void_p * 5)(ctypes.addressof(info), JIT_LOG_BYTES, ctypes.addressof(error), JIT_LOG_BYTES, 1)
        module = ctypes.c_void_p()
        code = self.driver.raw("cuModuleLoadDataEx", ctypes.byref(module), ptx_text.encode(), 5, options, values)
        if code != cu.CUDA_SUCCESS:
            log = error.value.decode(errors="replace")
            raise CompileError(f"{self.name}: the driver could not load {kernel.name} for {self.arch}: "
                               f"cuModuleLoadDataEx failed with {self.driver.error_name(code)} ({code}); JIT error log:\n{log}")
        self._modules.append(module.value or 0)
        function = self.driver.out_pointer("cuModuleGetFunction", module, kernel.name.encode())
        self.log.debug("kernel loaded", kernel=kernel.name, arch=self.arch, jit_log=info.value.decode(errors="replace"))
        return Program(kernel.name, signature, _Launch(self, function, kernel), function)

    def _make_compiler(self) -> DeviceCompiler:
        return CUDACompiler(self)

    def link_launches(self, launches: Sequence[tuple[Program, Sequence[Any]]]) -> Program:
        """JIT capture: (program, arguments as addresses/scalars) in order → one callable that
        enqueues them all (run inside one batch: a single submission and one synchronize)."""
        prepared = []
        for program, args in launches:
            launcher = program.cfunc
            if not isinstance(launcher, _Launch) or launcher.device is not self:
                raise DeviceError(f"{self.name}: {program.name} is not a kernel loaded on this device")
            prepared.append((launcher, launcher.prepare(args)))
        return Program(f"cuda_replay_{len(prepared)}", (), _Replay(prepared), 0)


class CUDACompiler(DeviceCompiler):
    """Kernels lowered to PTX for the device's architecture; linked launches enqueue in order."""

    device: CUDADevice

    @property
    def links(self) -> bool:
        return True

    def kernel(self, ast: KernelAST) -> Program:
        return self.device._cached(ast, lambda: ptx.lower_kernel(ast))

    def matmul(self, dtype: DType, strided: StridedOperand | None = None, prepacked: str | None = None) -> Program:
        """The tiled matmul, same arguments as the CPU one (`codegen.matmul.SIGNATURE`)."""
        if strided is not None:
            raise DeviceError(f"{self.device.name} reads matmul operands contiguous only; the schedule gave a strided one")
        if prepacked:
            raise DeviceError(f"{self.device.name} reads operands as plain matrices; a {prepacked.upper()} packed for the "
                              "CPU kernel (matmul_prepacked) runs on host devices only: multiply by the unpacked weight")
        return self.device._cached(("matmul", dtype.name), lambda: ptx.matmul_kernel(dtype.name))

    def stream_copy(self) -> Program:
        raise DeviceError(f"{self.device.name} copies through its driver; it has no streaming host copy")

    def link(self, launches: Sequence[tuple[Program, Sequence[int]]]) -> Program:
        return self.device.link_launches(launches)


def discover() -> list[tuple[str, bool, str]]:
    """(name, usable, detail) for each CUDA device, or one entry saying why there are none."""
    try:
        drv = cu.load()
    except cu.DriverUnavailable as exc:
        return [("CUDA", False, str(exc))]
    try:
        count = drv.out_int("cuDeviceGetCount")
    except cu.CUDAError as exc:
        return [("CUDA", False, f"cuDeviceGetCount failed with {exc.name} ({exc.code})")]
    if count == 0:
        return [("CUDA", False, f"the CUDA driver ({drv.path}) reports zero devices")]
    infos = []
    for index in range(count):
        try:
            handle = drv.out_int("cuDeviceGet", index)
            name = drv.device_name(handle)
            major = drv.attribute(cu.ATTR_COMPUTE_CAPABILITY_MAJOR, handle)
            minor = drv.attribute(cu.ATTR_COMPUTE_CAPABILITY_MINOR, handle)
            total = ctypes.c_size_t()
            drv.call("cuDeviceTotalMem_v2", ctypes.byref(total), handle)
        except cu.CUDAError as exc:
            infos.append((f"CUDA:{index}", False, f"querying it failed: {exc}"))
            continue
        try:
            arch = ptx.arch_for((major, minor))
        except CompileError as exc:
            infos.append((f"CUDA:{index}", False, f"{name}: {exc}"))
            continue
        infos.append((f"CUDA:{index}", True, f"{name}, compute capability {major}.{minor} (PTX for {arch}), "
                                             f"{total.value / 2**30:.1f} GiB"))
    return infos
