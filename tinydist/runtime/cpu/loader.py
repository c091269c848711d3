"""Links compiled object code into this process (LLVM's MCJIT as an in-memory loader), and
unlinks it once nothing can call it.

Objects are linked into shared MCJIT engines, up to `OBJECTS_PER_ENGINE` each, and each object
is owned by a `LoadedCode`; every program loaded from it holds that owner through its native
callable (`cfunc`), so whoever can still call the code (a program, a cfunc kept alone in a queued
command, a capture's linked entry through `calls`) keeps it mapped. An engine is disposed, its
code and data pages unmapped, once every object linked into it has lost its last reference and no
new object can join it. One process-wide engine (before 156e4d4) never gave anything back: every
new shape kept ~0.17 MiB of RSS and ~2 memory mappings for the life of the process
(`bench/kernel_memory.py` measures both ways). An engine of its own per object gave everything
back but doubled a cache hit's link (`compile/cache-hit`, idle: 0.47 -> 0.93 ms read+link): an
engine and its target machine cost 124-236 us to build (200 builds), against 56-85 us to link an
object into one that exists; shared by 16 objects, a load cost 63 us, and a live object keeps at
most 15 dead ones' pages mapped. The engine never generates code (the object is compiled
already; it only relocates it), so its target machine is the generic one for the triple. (ORC's
LLJIT links an object into a shared JIT without any, but llvmlite gives each object a JIT library
that is never freed: ~9 KiB of RSS per load that stays, measured over 4,000 loads.)

An engine resolves a symbol to the first object in it that defines one, dead ones' included (their
pages stay until the engine goes), so an object joins an engine only if none of the global
symbols it defines (read from its ELF symbol table) was ever defined there; else a new engine is
started. Otherwise a weak helper that two objects define runs the first one's copy for the
second object too, dead or alive (tests/runtime/test_cpu.py shows it).

Every `TRIM_EVERY` objects unloaded, the C heap's free pages go back to the system
(`malloc_trim(0)`, glibc): a process meeting new shapes frees a kernel's engine, its lowering and
schedule, and tensors of sizes no later request matches, and glibc returns free memory only from
the top of the heap, so RSS kept climbing by what was already free. Measured with
`bench/kernel_memory.py` (5,000 shapes, /proc/self/smaps between 2,500 and 4,000 shapes): all of
the ~10-17 KiB/shape still growing was [heap], and one `malloc_trim(0)` at the end took RSS below
its level at 2,500 shapes, i.e. none of it was live. The second half's growth fell from 10.5 to 5.4 KiB/shape
(the allocator's reuse cache given back before each sample in both). A trim cost 0.0-0.9 ms on
that ~225 MiB heap (7 trims over 3,000 shapes: 3 ms of a 73 s loop), once per 256 kernel loads
of several ms each; a process reusing its kernels (training, replays) unloads none and never trims.

Object code is content-addressed: the same bytes load once while loaded and every CPU device
shares the entry point. Distinct live objects must not define the same symbol; that is refused
with a clear error instead of silently running the other definition.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import hashlib
import struct
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import llvmlite.binding as llvm

from tinydist.base.errors import CompileError
from tinydist.codegen import progress
from tinydist.runtime.program import ARG_KINDS, Program, check_signature


TRIM_EVERY = 256  # objects unloaded between two `malloc_trim(0)` calls; see the module docstring
OBJECTS_PER_ENGINE = 16  # objects linked into one MCJIT engine; see the module docstring
_malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; other C libraries: none
if _malloc_trim is not None:
    _malloc_trim.argtypes, _malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int


class LoadedCode:
    """The owner of one loaded object file: its code stays mapped at least as long as this lives.
    `calls`: the code this code calls by address, kept alive with it (a linked entry's kernels)."""

    __slots__ = ("digest", "calls", "__weakref__")

    def __init__(self, digest: str, calls: tuple[Any, ...]) -> None:
        self.digest = digest
        self.calls = calls


class _Engine:
    """One MCJIT engine and what was ever linked into it. It is disposed (llvmlite does it when the
    last reference goes) once the loader stops adding to it and its last live object died."""

    __slots__ = ("engine", "symbols", "linked", "closed")

    def __init__(self) -> None:
        # the engine takes ownership of its target machine (and disposes it): one each, the
        # generic one (no CPU, no features), since relocating compiled code needs only the triple
        machine = _host_target().create_target_machine(reloc="pic")
        empty = llvm.parse_assembly("")
        empty.triple = machine.triple
        self.engine = llvm.create_mcjit_compiler(empty, machine)
        # with no module left, finalizing generates no code: it only relocates the objects (the
        # empty module's codegen pipeline cost 1.5 ms of the 1.8 ms an engine took to finalize)
        self.engine.remove_module(empty)
        self.symbols: set[str] = set()  # every global symbol an object linked here defined
        self.linked = 0                 # objects linked, ever
        self.closed = False             # takes no more objects

    def accepts(self, symbols: frozenset[str] | None) -> bool:
        return (not self.closed and symbols is not None and self.linked < OBJECTS_PER_ENGINE
                and self.symbols.isdisjoint(symbols))

    def link(self, object_code: bytes, symbols: frozenset[str] | None, entry: str) -> None:
        try:
            self.engine.add_object_file(llvm.ObjectFileRef.from_data(object_code))
            self.engine.finalize_object()
        except RuntimeError as exc:
            self.closed = True  # a failed link may leave part of the object behind
            raise CompileError(f"loading object code for {entry!r} failed: {exc}") from exc
        self.linked += 1
        if symbols is None:
            self.closed = True  # what it defines is unknown: nothing else may share its engine
        else:
            self.symbols |= symbols


_ELF64_LSB = b"\x7fELF\x02\x01"
_SECTION_TABLE = struct.Struct("<Q10xHH")      # e_shoff, then e_shentsize, e_shnum (from offset 0x28)
_SYMTAB = struct.Struct("<I16xQQII")           # Elf64_Shdr from +4: sh_type, sh_offset, sh_size, sh_link, sh_info
_SYMBOL = struct.Struct("<I2xH")               # Elf64_Sym: st_name, st_shndx
_SECTION_SIZE, _SYMBOL_SIZE, _SHT_SYMTAB = 64, 24, 2


def defined_symbols(object_code: bytes) -> frozenset[str] | None:
    """The global and weak symbols an ELF64 little-endian object defines (its symbol table's
    non-local entries with a section); None for any other format. A few us, but on the path of
    every cache hit, right after other work has evicted it from the CPU's caches: 28 us there
    in its first form."""
    if not object_code.startswith(_ELF64_LSB):
        return None
    table, entry_size, count = _SECTION_TABLE.unpack_from(object_code, 0x28)
    if entry_size != _SECTION_SIZE:
        return None
    for at in range(table + 4, table + count * _SECTION_SIZE, _SECTION_SIZE):
        kind, start, size, link, first_global = _SYMTAB.unpack_from(object_code, at)
        if kind == _SHT_SYMTAB:
            strings = _SYMTAB.unpack_from(object_code, table + link * _SECTION_SIZE + 4)[1]
            names = []
            for symbol in range(start + first_global * _SYMBOL_SIZE, start + size, _SYMBOL_SIZE):
                name, section = _SYMBOL.unpack_from(object_code, symbol)
                if section:  # else SHN_UNDEF: defined elsewhere
                    name += strings
                    names.append(object_code[name:object_code.index(0, name)].decode())
            return frozenset(names)
    return frozenset()


@functools.cache
def _host_target() -> llvm.Target:
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    return llvm.Target.from_default_triple()


class NativeLoader:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        # object sha256 -> (a weak reference to its owner, its engine, the symbols it defines (None:
        # unknown, its engine is its own), the symbols looked up from it)
        self._loaded: dict[str, tuple[weakref.ref[LoadedCode], _Engine, frozenset[str] | None, set[str]]] = {}
        self._symbols: dict[str, str] = {}  # symbol -> the live object's sha256 that defines it
        self._filling: _Engine | None = None  # the engine new objects join while it accepts them
        # Owners die wherever the last reference drops — a garbage collection inside `load` on this
        # very thread included — so a death is queued (a deque append needs no lock) and its
        # object forgotten by whoever holds or next takes the lock.
        self._dead: collections.deque[tuple[str, weakref.ref[LoadedCode]]] = collections.deque()
        # entry address -> (its progress word's address, the object defining it): kernels that publish
        self._progress: dict[int, tuple[int, str]] = {}
        self.unloaded = 0   # objects unloaded, ever
        self._trimmed = 0   # `unloaded` at the last heap trim

    @property
    def loaded(self) -> int:
        """How many object files are loaded (owners alive)."""
        with self._lock:
            self._dispose_dead()
            return len(self._loaded)

    @property
    def engines(self) -> int:
        """How many MCJIT engines hold loaded objects."""
        with self._lock:
            self._dispose_dead()
            return len({id(found[1]) for found in self._loaded.values()})

    def load(self, object_code: bytes, entry: str, signature: Sequence[str], calls: Sequence[Any] = ()) -> Program:
        """`entry` of `object_code` as a program. `calls`: programs or cfuncs this code calls by
        address; they stay loaded while it does."""
        signature = check_signature(entry, signature)
        digest = hashlib.sha256(object_code).hexdigest()
        kept = tuple(call.cfunc if isinstance(call, Program) else call for call in calls)
        with self._lock:
            if self._dead:
                self._dispose_dead()
            found = self._loaded.get(digest)
            owner = found[0]() if found is not None else None
            if found is not None and owner is None:  # died since the disposal above: its callback has queued it
                self._dispose_dead()
            if owner is None or found is None:
                if entry in self._symbols:
                    raise CompileError(f"symbol {entry!r} is already defined by another loaded object; kernel names must be unique")
                symbols = defined_symbols(object_code)
                engine = self._engine_for(symbols)
                engine.link(object_code, symbols, entry)
                owner = LoadedCode(digest, kept)
                found = self._loaded[digest] = (weakref.ref(owner, functools.partial(self._died, digest)), engine,
                                                symbols, set())
            elif self._symbols.get(entry, digest) != digest:
                raise CompileError(f"symbol {entry!r} is already defined by another loaded object; kernel names must be unique")
            elif kept:
                owner.calls += kept
            _, engine, defined, symbols_used = found
            # in a shared engine a name another object defines must not be taken for this one's
            address = engine.engine.get_function_address(entry) if defined is None or entry in defined else 0
            if not address:
                raise CompileError(f"object code defines no function {entry!r}")
            progress_symbol = progress.symbol(entry)
            progress_word = (engine.engine.get_global_value_address(progress_symbol)
                             if defined is None or progress_symbol in defined else 0)
            if progress_word:
                self._progress[address] = (progress_word, digest)
            symbols_used.add(entry)
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

    def _engine_for(self, symbols: frozenset[str] | None) -> _Engine:
        """The engine an object defining `symbols` joins (lock held): the filling one if it accepts
        them, else a new one, which fills from then on; the old one goes with its last object."""
        if self._filling is None or not self._filling.accepts(symbols):
            self._filling = _Engine()
        return self._filling

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
        """Give the C heap's free pages back once `TRIM_EVERY` objects went since the last time
        (outside the lock: the trim walks the whole heap)."""
        if _malloc_trim is not None and self.unloaded - self._trimmed >= TRIM_EVERY:
            self._trimmed = self.unloaded
            _malloc_trim(0)

    def _dispose_dead(self) -> None:
        """Forget each dead owner's object (lock held); its engine goes with the last reference to
        it, and llvmlite disposes it then, unmapping its memory."""
        while self._dead:
            digest, ref = self._dead.popleft()
            found = self._loaded.get(digest)
            if found is None or found[0] is not ref:
                continue  # loaded again since: the new owner is alive
            del self._loaded[digest]
            self.unloaded += 1
            for symbol in found[3]:
                if self._symbols.get(symbol) == digest:
                    del self._symbols[symbol]
            for address in [a for a, (_, owner) in self._progress.items() if owner == digest]:
                del self._progress[address]


native_loader = NativeLoader()
