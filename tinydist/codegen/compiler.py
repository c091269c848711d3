"""LLVM IR text → optimised native object code for the host CPU.

The target machine is built from the host's CPU name and feature string, and the O3 pipeline runs
*with* that target machine: without it LLVM's cost model knows no vector width and nothing is
vectorised.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import threading
from dataclasses import dataclass
from typing import Any

import llvmlite
import llvmlite.binding as llvm
from llvmlite.binding import ffi

from tinydist.base.config import settings
from tinydist.base.errors import CompileError
from tinydist.codegen.compile_worker import CompileWorker

_init_lock = threading.Lock()
_initialised = False


def _initialise_llvm() -> None:
    global _initialised
    with _init_lock:
        if not _initialised:
            llvm.initialize_native_target()
            llvm.initialize_native_asmprinter()
            _initialised = True


@dataclass(frozen=True)
class HostTarget:
    """What the compiled code depends on; every field is part of the compile-cache key."""

    triple: str
    cpu: str
    features: str
    llvm_version: str
    llvmlite_version: str

    def cache_key_parts(self) -> tuple[str, ...]:
        return (self.triple, self.cpu, self.features, self.llvm_version, self.llvmlite_version, RELOCATION, CODE_MODEL)


@functools.cache
def host_target() -> HostTarget:
    _initialise_llvm()
    return HostTarget(
        triple=llvm.get_process_triple(),
        cpu=llvm.get_host_cpu_name(),
        features=llvm.get_host_cpu_features().flatten(),
        llvm_version=".".join(map(str, llvm.llvm_version_info)),
        llvmlite_version=llvmlite.__version__,
    )


# Object code is loaded into this process at whatever address the loader's memory lands, which
# may be more than 2 GiB from the C library: a call LLVM leaves to a libm function (a float `%`
# becomes fmodf) must then not be a 32-bit PC-relative reference (`call fmodf@PLT`), or
# relocating it overflows and the loader aborts the process — seen once torch's libraries were
# mapped into the same process. The JIT code model takes every symbol's 64-bit address.
RELOCATION, CODE_MODEL = "static", "jitdefault"


def _unlocked(name: str) -> Any:
    """llvmlite's C function `name` without llvmlite's lock. llvmlite serialises every call into
    LLVM on one process-wide lock, so "one compile thread per CPU" ran one pipeline at a time: two
    resnet18 matmul modules (~0.5 s of LLVM each) took as long on two threads as on one. LLVM itself
    runs concurrently on separate contexts (its documented threading model); the two calls taken out
    of the lock — the module pipeline and the object emission, the whole of a compile's time — only
    touch the calling thread's module, context, pass builder and target machine (`HostCompiler._machine`)."""
    return getattr(ffi.lib, name)._cfn


class HostCompiler:
    """Compiles LLVM IR for this machine's CPU. Thread-safe, and compiles on several threads at
    once: each thread parses into an LLVM context and emits with a target machine of its own
    (LLVM's contexts are not thread-safe; llvmlite releases the GIL inside LLVM)."""

    def __init__(self, opt_level: int = 3) -> None:
        if opt_level not in (0, 1, 2, 3):
            raise ValueError(f"opt_level must be 0..3, got {opt_level}")
        _initialise_llvm()
        self.opt_level = opt_level
        self.target = host_target()
        self._local = threading.local()

    @property
    def _machine(self) -> llvm.TargetMachine:
        machine = getattr(self._local, "machine", None)
        if machine is None:
            machine = self._local.machine = llvm.Target.from_triple(self.target.triple).create_target_machine(
                cpu=self.target.cpu, features=self.target.features, opt=self.opt_level, reloc=RELOCATION,
                codemodel=CODE_MODEL)
            self._local.context = llvm.create_context()
        return machine

    def optimise(self, ir_text: str) -> llvm.ModuleRef:
        """Parse, verify and run the O<n> pipeline with the host target machine."""
        machine = self._machine
        try:
            module = llvm.parse_assembly(ir_text, self._local.context)
            module.verify()
        except RuntimeError as exc:
            raise CompileError(f"LLVM rejected the kernel IR: {exc}") from exc
        module.triple = machine.triple
        module.data_layout = str(machine.target_data)
        if self.opt_level:
            tuning = llvm.PipelineTuningOptions(speed_level=self.opt_level)
            tuning.loop_vectorization = True
            tuning.slp_vectorization = True
            builder = llvm.create_pass_builder(machine, tuning)
            _unlocked("LLVMPY_RunNewModulePassManager")(builder.getModulePassManager(), module, builder)
        return module

    def _emit_object(self, module: llvm.ModuleRef) -> bytes:
        """`TargetMachine.emit_object`, outside llvmlite's lock (`_unlocked`)."""
        with ffi.OutputString() as error:
            buffer = _unlocked("LLVMPY_TargetMachineEmitToMemory")(self._machine, module, 1, error)
            if not buffer:
                raise CompileError(f"LLVM could not emit object code for the kernel: {error}")
        try:
            return ctypes.string_at(ffi.lib.LLVMPY_GetBufferStart(buffer), ffi.lib.LLVMPY_GetBufferSize(buffer))
        finally:
            ffi.lib.LLVMPY_DisposeMemoryBuffer(buffer)

    def compile(self, ir_text: str) -> bytes:
        """IR text → relocatable object code (ELF on Linux); in the compile worker once this process
        has optimised TINYDIST_COMPILE_WORKER_AFTER modules itself (`tinydist.codegen.compile_worker`:
        LLVM never frees what its pipeline keeps of each)."""
        worker = _worker(self.opt_level)
        if worker is not None:
            return worker.compile(ir_text, self.opt_level)
        return self._emit_object(self.optimise(ir_text))

    def assembly(self, ir_text: str) -> str:
        """The optimised machine code as text, for inspection (e.g. checking vector registers)."""
        return self._machine.emit_assembly(self.optimise(ir_text))


_in_process = 0           # modules this process has optimised itself
_worker_lock = threading.Lock()
_the_worker: CompileWorker | None = None


def _worker(opt_level: int) -> CompileWorker | None:
    """The process's compile worker once it has optimised COMPILE_WORKER_AFTER modules (an O0
    compile keeps nothing, and never counts); None: compile here."""
    global _in_process, _the_worker
    after = settings.COMPILE_WORKER_AFTER
    if not opt_level or not after:
        return None
    with _worker_lock:
        if _in_process < after:
            _in_process += 1
            return None
        if _the_worker is None:
            _the_worker = CompileWorker()
            # ended with the process, its pipes closed: else the child outlives it until it reads EOF and
            # Python warns of a Popen still running and two unclosed pipes at exit
            atexit.register(_the_worker.close)
        return _the_worker
