"""An on-disk cache of compiled object code.

Keyed by sha256 of the IR text, CPU name, CPU features, LLVM/llvmlite versions and the opt level,
so a changed host or toolchain never loads stale code.

An entry is a magic number, the sha256 of the object code, and the code. It is written to a temp
file, fsynced, and renamed into place (the directory fsynced too): two processes compiling the
same kernel both succeed, one file wins, and a crash or power loss leaves the old state or the new,
never half a file. A bad entry (truncated, garbage, flipped bits: each of which made LLVM's loader
segfault or abort before checksums) fails the check, is logged, deleted and compiled again.

The cache holds at most `COMPILE_CACHE_MAX_MB`: past that, the entries used longest ago (a hit
renews an entry's mtime once a minute at most) are deleted until it is back under nine tenths of the cap.

A generated kernel (the matmul, whose IR takes ~0.1 s of Python to build and print) can be looked
up before its IR exists (`compile_generated`): keyed by what the generator was asked for and a
fingerprint of the generator's code (every module of `tinydist.codegen` and of the layers below it), so a hit renders no IR
and a changed generator never loads stale code.
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from tinydist.base.config import settings
from tinydist.codegen.compiler import HostCompiler

log = structlog.get_logger("tinydist.compile_cache")

MAGIC = b"TDKO\x01\x00\x00\x00"
_HEADER = len(MAGIC) + hashlib.sha256().digest_size
_STALE_TEMP_SECONDS = 3600.0  # a temp file this old belongs to a writer that died
# A hit renews an entry's mtime only when it is older than this: the eviction order needs no finer
# grain, and a hit then costs no write (a first call's hits of just-written entries: none).
RENEW_AFTER_SECONDS = 60.0


def _read_all(fd: int, size: int) -> bytes:
    """The file's `size` bytes (fewer if it ends sooner) through a descriptor open on it: one
    read for an entry, since an entry's file never changes once renamed into place."""
    data = os.read(fd, size)
    while len(data) < size:
        more = os.read(fd, size - len(data))
        if not more:
            break
        data += more
    return data


@dataclass
class CacheStatistics:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    evicted: int = 0


def encode_entry(code: bytes) -> bytes:
    return MAGIC + hashlib.sha256(code).digest() + code


def decode_entry(data: bytes) -> tuple[bytes | None, str]:
    """The object code in an entry, or None and what is wrong with it."""
    if len(data) < _HEADER:
        return None, f"{len(data)} bytes, shorter than the {_HEADER}-byte header"
    if not data.startswith(MAGIC):
        return None, "no entry header (not written by this version, or overwritten)"
    code = data[_HEADER:]
    if hashlib.sha256(code).digest() != data[len(MAGIC):_HEADER]:
        return None, f"checksum mismatch over {len(code)} bytes of code (truncated or corrupted)"
    return code, ""


class CompileCache:
    def __init__(self, compiler: HostCompiler, directory: Path | None = None, enabled: bool | None = None) -> None:
        self.compiler = compiler
        # the entry format's version names the directory: older entries are never read as newer ones
        self.directory = Path(directory if directory is not None else settings.CACHE_DIR) / "kernels-v2"
        self.enabled = settings.COMPILE_CACHE == "1" if enabled is None else enabled
        self.statistics = CacheStatistics()
        self._size: int | None = None  # bytes on disk, measured at this cache's first write

    def key(self, ir_text: str) -> str:
        digest = hashlib.sha256()
        for part in (ir_text, *self.compiler.target.cache_key_parts(), f"O{self.compiler.opt_level}"):
            digest.update(part.encode())
            digest.update(b"\0")
        return digest.hexdigest()

    def generated_key(self, source: str) -> str:
        """The key of a generated kernel: the generator's request `source`, the generator's code,
        the host and the opt level (never the IR, which is not rendered on a hit)."""
        digest = hashlib.sha256()
        for part in ("generated", source, generator_fingerprint(), *self.compiler.target.cache_key_parts(),
                     f"O{self.compiler.opt_level}"):
            digest.update(part.encode())
            digest.update(b"\0")
        return digest.hexdigest()

    def path(self, ir_text: str) -> Path:
        return self._path(self.key(ir_text))

    def _path(self, key: str) -> Path:
        return self.directory / key[:2] / f"{key}.o"

    def compile(self, ir_text: str) -> bytes:
        """Object code for `ir_text`: from disk when cached and intact, else compiled and stored."""
        return self._compile(lambda: self.path(ir_text), lambda: ir_text)

    def compile_generated(self, source: str, render: Callable[[], str]) -> bytes:
        """Object code for the IR `render()` returns, looked up by `source` (a deterministic text
        of everything the generator was asked for): `render` runs only on a miss."""
        return self._compile(lambda: self._path(self.generated_key(source)), render)

    def _compile(self, path_of: Callable[[], Path], render: Callable[[], str]) -> bytes:
        if not self.enabled:
            self.statistics.misses += 1
            return self.compiler.compile(render())
        path = path_of()
        code = self._read(path)
        if code is not None:
            self.statistics.hits += 1
            return code
        self.statistics.misses += 1
        code = self.compiler.compile(render())
        self._write(path, encode_entry(code))
        return code

    def _read(self, path: Path) -> bytes | None:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return None
        try:
            status = os.fstat(fd)
            data = _read_all(fd, status.st_size)
            if time.time() - status.st_mtime > RENEW_AFTER_SECONDS:
                os.utime(fd)  # the eviction order: least recently used first
        finally:
            os.close(fd)
        code, problem = decode_entry(data)
        if code is None:
            self.statistics.corrupt += 1
            log.warning("compile cache entry is bad; deleted, compiling again", path=str(path), problem=problem)
            path.unlink(missing_ok=True)
            return None
        return code

    def _write(self, path: Path, entry: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(entry)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        self._account(path, len(entry))

    def _account(self, path: Path, nbytes: int) -> None:
        """Keep the directory under the size cap; the first write of a process measures it."""
        if self._size is None:
            self._size = sum(size for _, size, _ in self._entries())
        else:
            self._size += nbytes
        cap = settings.COMPILE_CACHE_MAX_MB * 1024 * 1024
        if self._size <= cap:
            return
        for _, size, entry in sorted(self._entries()):
            if self._size <= cap * 9 // 10:
                break
            if entry == path:
                continue  # the entry just written is in use
            entry.unlink(missing_ok=True)
            self._size -= size
            self.statistics.evicted += 1
        log.info("compile cache over its cap; evicted the least recently used entries",
                 directory=str(self.directory), cap_mb=settings.COMPILE_CACHE_MAX_MB,
                 evicted=self.statistics.evicted)

    def _entries(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of every entry; temp files of writers that died are removed."""
        found: list[tuple[float, int, Path]] = []
        now = time.time()
        for entry in self.directory.glob("*/*"):
            try:
                stat = entry.stat()
            except FileNotFoundError:
                continue
            if entry.name.startswith(".tmp-"):
                if now - stat.st_mtime > _STALE_TEMP_SECONDS:
                    entry.unlink(missing_ok=True)
                continue
            found.append((stat.st_mtime, stat.st_size, entry))
        return found


# The code a generator's IR can depend on: this package and the layers below it (tests/test_layering.py
# keeps codegen from importing anything above).
_GENERATOR_PACKAGES = ("base", "graph", "security", "codegen")


@functools.cache
def generator_fingerprint() -> str:
    """sha256 of the code generators' source: every module of tinydist.codegen and of the layers it
    may import, by path and bytes (~1 ms, once per process)."""
    digest = hashlib.sha256()
    root = Path(__file__).parent.parent
    for package in _GENERATOR_PACKAGES:
        for module in sorted((root / package).rglob("*.py")):
            digest.update(str(module.relative_to(root)).encode() + b"\0" + module.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.cache
def _kernel_cache() -> CompileCache:
    return CompileCache(HostCompiler())


def compile_kernel(ir_text: str) -> bytes:
    """Object code for a kernel: the O3 pipeline, through the on-disk cache. The one host
    compiler every kernel of this process goes through."""
    return _kernel_cache().compile(ir_text)


def compile_generated_kernel(source: str, render: Callable[[], str]) -> bytes:
    """`compile_kernel(render())`, looked up by the generator's request `source` before any IR is
    rendered (`CompileCache.compile_generated`)."""
    return _kernel_cache().compile_generated(source, render)


@functools.cache
def _glue_compiler(opt_level: int) -> HostCompiler:
    return HostCompiler(opt_level=opt_level)


def compile_glue(ir_text: str, straight_line: bool = False) -> bytes:
    """Object code for glue that calls kernels with addresses baked in (a capture's entry point,
    a stream's step function): O1 — it is calls and branches, nothing to vectorise — and never
    cached on disk, since its addresses are this process's. `straight_line` glue (a list of calls
    and copies, or of pieces of calls with only a claim and a spin-wait loop between them: a capture's
    entry points) at O0: there is nothing for a pass to do, and O0 skips the pipeline and selects
    instructions fast (a resnet18 entry of 116 calls and its frame: 2.5-3.0 ms at O0, 11.7-13.6 ms
    at O1, besides the ~30 ms of setting up the O1 pipeline in a fresh process)."""
    return _glue_compiler(0 if straight_line else 1).compile(ir_text)


@functools.cache
def _glue_cache() -> CompileCache:
    return CompileCache(_glue_compiler(1))


def compile_portable_glue(ir_text: str) -> bytes:
    """`compile_glue` for glue that bakes in no address of this process (the command interpreter
    of `tinydist.engine.lowered`), so its object code is cached on disk like a kernel's: a warm
    process never sets up LLVM's pipeline for it (~50 ms of a warm first call)."""
    return _glue_cache().compile(ir_text)
