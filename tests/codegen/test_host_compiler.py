"""HostCompiler on several threads: the O3 pipeline and the object emission run outside llvmlite's
process-wide lock (else one compile thread per CPU compiles one module at a time), and what
concurrent threads emit is what one thread emits (tinydist.codegen.compiler)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from llvmlite.binding import ffi

from tinydist.base.config import settings
from tinydist.codegen.compiler import HostCompiler

from tests.codegen.test_compile_worker import kernel_ir

HEAVY = ("LLVMPY_RunNewModulePassManager", "LLVMPY_TargetMachineEmitToMemory")


def test_the_pipeline_and_emission_do_not_hold_llvmlites_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    held: dict[str, list[bool]] = {name: [] for name in HEAVY}
    for name in HEAVY:
        real = getattr(ffi.lib, name)._cfn

        def probe(*args: Any, _real: Any = real, _name: str = name) -> Any:
            held[_name].append(ffi.lib._lock._lock._is_owned())   # this thread holds llvmlite's lock?
            return _real(*args)
        # the function as llvmlite's wrapper calls it: taking the lock, then the C function (here `probe`)
        monkeypatch.setitem(ffi.lib._fntab, name, ffi._lib_fn_wrapper(ffi.lib._lock, probe))
    with settings.override(COMPILE_WORKER_AFTER=0):             # compiled in this process
        obj = HostCompiler(opt_level=3).compile(kernel_ir(1000))
    assert obj[:4] == b"\x7fELF"
    assert held == {name: [False] for name in HEAVY}


def test_threads_emit_what_one_thread_emits() -> None:
    sizes = [5, 17, 100, 1000, 4096, 12345, 3, 777] * 2
    with settings.override(COMPILE_WORKER_AFTER=0):
        alone = [HostCompiler(opt_level=3).compile(kernel_ir(n)) for n in sizes]
        shared = HostCompiler(opt_level=3)          # one compiler, a target machine and context per thread
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(shared.compile, [kernel_ir(n) for n in sizes]))
    assert together == alone
