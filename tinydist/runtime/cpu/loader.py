"""Links compiled object code into this process (LLVM's MCJIT as an in-memory loader), and
unlinks it once nothing can call it.

Each object file gets an MCJIT engine of its own, owned by a `LoadedCode`; every program loaded
from it holds that owner through its native callable (`cfunc`), so whoever can still call the code
(a program, a cfunc kept alone in a queued command, a capture's linked entry through `calls`)
keeps it mapped. When the last reference goes, the engine is disposed and its code and data
pages are unmapped. One process-wide engine (before) never gave anything back: every new shape
kept ~0.17 MiB of RSS and ~2 memory mappings for the life of the process (`bench/kernel_memory.py`
measures both ways). An engine of its own needs a target machine of its own, and one for the host
CPU with its feature list took 251 us to build, most of an engine's ~430 us (400 loads, load 15).
The engine never generates code (the object is compiled already; it only relocates it), so its
target machine is the generic one for the triple: 24 us. (ORC's LLJIT links an object into a
shared JIT without any, but llvmlite gives each object a JIT library that is never freed: ~9 KiB
of RSS per load that stays, measured over 4,000 loads, against none for an engine disposed.)

Every `TRIM_EVERY` engines disposed, the C heap's free pages go back to the system
(`malloc_trim(0)`, glibc): a process meeting new shapes frees a kernel's engine, its lowering and
schedule, and tensors of sizes no later request matches, and glibc returns free memory only from
the top of the heap, so RSS kept climbing by what was already free. Measured with
`bench/kernel_memory.py` (5,000 shapes, /proc/self/smaps between 2,500 and 4,000 shapes): all of
the ~10-17 KiB/shape still growing was [heap], and one `malloc_trim(0)` at the end took RSS below
its level at 2,500 shapes, i.e. none of it was live. The second half's growth fell from 10.5 to 5.4 KiB/shape
(the allocator's reuse cache given back before each sample in both). A trim cost 0.0-0.9 ms on
that ~225 MiB heap (7 trims over 3,000 shapes: 3 ms of a 73 s loop), once per 256 kernel loads
of several ms each; a process reusing its kernels (training, replays) disposes none and never trims.

Object code is content-addressed: the same bytes load once while loaded and every CPU device
shares the entry point. Distinct live objects must not define the same symbol; that is refused
with a clear error instead of silently running the other definition.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import hashlib
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import llvmlite.binding as llvm

from tinydist.base.errors import CompileError
from tinydist.codegen import progress
from tinydist.runtime.program import ARG_KINDS, Program, check_signature


TRIM_EVERY = 256  # engines disposed between two `malloc_trim(0)` calls; see the module docstring
_malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; other C libraries: none
if _malloc_trim is not None:
    _malloc_trim.argtypes, _malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int


class LoadedCode:
    """The owner of one loaded object file: its engine lives exactly as long as this does.
    `calls`: the code this code calls by address, kept alive with it (a linked entry's kernels)."""

    __slots__ = ("digest", "calls", "__weakref__")

    def __init__(self, digest: str, calls: tuple[Any, ...]) -> None:
        self.digest = digest
        self.calls = calls


@functools.cache
def _host_target() -> llvm.Target:
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    return llvm.Target.from_default_triple()


class NativeLoader:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        # object sha256 -> (a weak reference to its owner, its engine, the symbols looked up from it)
        self._loaded: dict[str, tuple[weakref.ref[LoadedCode], llvm.ExecutionEngine, set[str]]] = {}
        self._symbols: dict[str, str] = {}  # symbol -> the live object's sha256 that defines it
        # Owners die wherever the last reference drops — a garbage collection inside `load` on this
        # very thread included — so a death is queued (a deque append needs no lock) and its
        # engine disposed by whoever holds or next takes the lock.
        self._dead: collections.deque[tuple[str, weakref.ref[LoadedCode]]] = collections.deque()
        # entry address -> (its progress word's address, the object defining it): kernels that publish
        self._progress: dict[int, tuple[int, str]] = {}
        self.disposed = 0   # engines disposed, ever
        self._trimmed = 0   # `disposed` at the last heap trim

    @property
    def loaded(self) -> int:
        """How many object files are loaded (engines not yet disposed)."""
        with self._lock:
            self._dispose_dead()
            return len(self._loaded)

    def load(self, object_code: bytes, entry: str, signature: Sequence[str], calls: Sequence[Any] = ()) -> Program:
        """`entry` of `object_code` as a program. `calls`: programs or cfuncs this code calls by
        address; they stay loaded while it does."""
        signature = check_signature(entry, signature)
        digest = hashlib.sha256(object_code).hexdigest()
        kept = tuple(call.cfunc if isinstance(call, Program) else call for call in calls)
        with self._lock:
            self._dispose_dead()
            found = self._loaded.get(digest)
            owner = found[0]() if found is not None else None
            if found is not None and owner is None:  # died since the disposal above: its callback has queued it
                self._dispose_dead()
            if owner is None or found is None:
                if entry in self._symbols:
                    raise CompileError(f"symbol {entry!r} is already defined by another loaded object; kernel names must be unique")
                owner = LoadedCode(digest, kept)
                engine = self._engine(object_code, entry)
                found = self._loaded[digest] = (weakref.ref(owner, functools.partial(self._died, digest)), engine, set())
            elif self._symbols.get(entry, digest) != digest:
                raise CompileError(f"symbol {entry!r} is already defined by another loaded object; kernel names must be unique")
            elif kept:
                owner.calls += kept
            _, engine, symbols = found
            address = engine.get_function_address(entry)
            if not address:
                raise CompileError(f"object code defines no function {entry!r}")
            progress_word = engine.get_global_value_address(progress.symbol(entry))
            if progress_word:
                self._progress[address] = (progress_word, digest)
            symbols.add(entry)
            self._symbols[entry] = digest
        if self._dead:
            self._try_dispose()
        self._trim_heap()
        prototype = ctypes.CFUNCTYPE(None, *(ARG_KINDS[kind] for kind in signature))
        cfunc = prototype(address)
        cfunc._tinydist_code = owner  # type: ignore[attr-defined]  # the code stays mapped while this callable exists
        return Program(entry, signature, cfunc, address, progress_word)

    def progress_word(self, address: int) -> int:
        """The progress word of the loaded kernel whose entry point is at `address`; 0 if it has none."""
        found = self._progress.get(address)
        return found[0] if found is not None else 0

    @staticmethod
    def _engine(object_code: bytes, entry: str) -> llvm.ExecutionEngine:
        # the engine takes ownership of its target machine (and disposes it): one each, the
        # generic one (no CPU, no features), since relocating compiled code needs only the triple
        machine = _host_target().create_target_machine(reloc="pic")
        empty = llvm.parse_assembly("")
        empty.triple = machine.triple
        engine = llvm.create_mcjit_compiler(empty, machine)
        # with no module left, finalizing generates no code: it only relocates the object (the
        # empty module's codegen pipeline cost 1.5 ms of the 1.8 ms an engine took to finalize)
        engine.remove_module(empty)
        try:
            engine.add_object_file(llvm.ObjectFileRef.from_data(object_code))
            engine.finalize_object()
        except RuntimeError as exc:
            raise CompileError(f"loading object code for {entry!r} failed: {exc}") from exc
        return engine

    def _died(self, digest: str, ref: weakref.ref[LoadedCode]) -> None:
        self._dead.append((digest, ref))
        self._try_dispose()

    def _try_dispose(self) -> None:
        if self._lock.acquire(blocking=False):  # else the holder disposes them
            try:
                self._dispose_dead()
            finally:
                self._lock.release()
            self._trim_heap()

    def _trim_heap(self) -> None:
        """Give the C heap's free pages back once `TRIM_EVERY` engines went since the last time
        (outside the lock: the trim walks the whole heap)."""
        if _malloc_trim is not None and self.disposed - self._trimmed >= TRIM_EVERY:
            self._trimmed = self.disposed
            _malloc_trim(0)

    def _dispose_dead(self) -> None:
        """Forget each dead owner's object and drop its engine (lock held): llvmlite disposes it,
        unmapping its memory."""
        while self._dead:
            digest, ref = self._dead.popleft()
            found = self._loaded.get(digest)
            if found is None or found[0] is not ref:
                continue  # loaded again since: the new owner is alive
            del self._loaded[digest]
            self.disposed += 1
            for symbol in found[2]:
                if self._symbols.get(symbol) == digest:
                    del self._symbols[symbol]
            for address in [a for a, (_, owner) in self._progress.items() if owner == digest]:
                del self._progress[address]


native_loader = NativeLoader()
