"""Links compiled object code into this process (LLVM's MCJIT as an in-memory loader).

Object code is content-addressed: the same bytes load once per process and every CPU device
shares the resulting entry point. Distinct objects must not define the same symbol; that is
refused with a clear error instead of silently resolving to the first definition.
"""

from __future__ import annotations

import ctypes
import hashlib
import threading
from collections.abc import Sequence

import llvmlite.binding as llvm

from tinydist.base.errors import CompileError
from tinydist.codegen import progress
from tinydist.runtime.program import ARG_KINDS, Program, check_signature


class NativeLoader:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engine: llvm.ExecutionEngine | None = None
        self._loaded: dict[str, set[str]] = {}   # object sha256 -> symbols looked up from it
        self._symbols: dict[str, str] = {}       # symbol -> object sha256 that defines it
        self._progress: dict[int, int] = {}      # entry address -> its progress word's (kernels that publish)

    def _execution_engine(self) -> llvm.ExecutionEngine:
        if self._engine is None:
            llvm.initialize_native_target()
            llvm.initialize_native_asmprinter()
            machine = llvm.Target.from_default_triple().create_target_machine(
                cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), reloc="pic")
            empty = llvm.parse_assembly("")
            empty.triple = machine.triple
            self._engine = llvm.create_mcjit_compiler(empty, machine)
        return self._engine

    def load(self, object_code: bytes, entry: str, signature: Sequence[str]) -> Program:
        signature = check_signature(entry, signature)
        digest = hashlib.sha256(object_code).hexdigest()
        with self._lock:
            engine = self._execution_engine()
            if digest not in self._loaded:
                owner = self._symbols.get(entry)
                if owner is not None:
                    raise CompileError(f"symbol {entry!r} is already defined by another loaded object; kernel names must be unique")
                try:
                    engine.add_object_file(llvm.ObjectFileRef.from_data(object_code))
                    engine.finalize_object()
                except RuntimeError as exc:
                    raise CompileError(f"loading object code for {entry!r} failed: {exc}") from exc
                self._loaded[digest] = set()
            elif self._symbols.get(entry, digest) != digest:
                raise CompileError(f"symbol {entry!r} is already defined by another loaded object; kernel names must be unique")
            address = engine.get_function_address(entry)
            if not address:
                raise CompileError(f"object code defines no function {entry!r}")
            progress_word = engine.get_global_value_address(progress.symbol(entry))
            if progress_word:
                self._progress[address] = progress_word
            self._loaded[digest].add(entry)
            self._symbols[entry] = digest
        prototype = ctypes.CFUNCTYPE(None, *(ARG_KINDS[kind] for kind in signature))
        return Program(entry, signature, prototype(address), address, progress_word)

    def progress_word(self, address: int) -> int:
        """The progress word of the loaded kernel whose entry point is at `address`; 0 if it has none."""
        return self._progress.get(address, 0)


native_loader = NativeLoader()
