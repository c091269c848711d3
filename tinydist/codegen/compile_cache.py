"""An on-disk cache of compiled object code.

Keyed by sha256 of the IR text, CPU name, CPU features, LLVM/llvmlite versions and the opt level,
so a changed host or toolchain never loads stale code. Entries are written atomically (temp file
and rename): two processes compiling the same kernel both succeed, one file wins.
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tinydist.codegen.compiler import HostCompiler
from tinydist.config import settings


@dataclass
class CacheStatistics:
    hits: int = 0
    misses: int = 0


class CompileCache:
    def __init__(self, compiler: HostCompiler, directory: Path | None = None, enabled: bool | None = None) -> None:
        self.compiler = compiler
        self.directory = Path(directory if directory is not None else settings.CACHE_DIR) / "kernels"
        self.enabled = settings.COMPILE_CACHE == "1" if enabled is None else enabled
        self.statistics = CacheStatistics()

    def key(self, ir_text: str) -> str:
        digest = hashlib.sha256()
        for part in (ir_text, *self.compiler.target.cache_key_parts(), f"O{self.compiler.opt_level}"):
            digest.update(part.encode())
            digest.update(b"\0")
        return digest.hexdigest()

    def path(self, ir_text: str) -> Path:
        key = self.key(ir_text)
        return self.directory / key[:2] / f"{key}.o"

    def compile(self, ir_text: str) -> bytes:
        """Object code for `ir_text`: from disk when cached, else compiled and stored."""
        if not self.enabled:
            self.statistics.misses += 1
            return self.compiler.compile(ir_text)
        path = self.path(ir_text)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            data = b""
        if data:
            self.statistics.hits += 1
            return data
        self.statistics.misses += 1
        data = self.compiler.compile(ir_text)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        return data


@functools.cache
def _kernel_cache() -> CompileCache:
    return CompileCache(HostCompiler())


@functools.cache
def _glue_compiler() -> HostCompiler:
    return HostCompiler(opt_level=1)


def compile_kernel(ir_text: str) -> bytes:
    """Object code for a kernel: the O3 pipeline, through the on-disk cache. The one host
    compiler every kernel of this process goes through."""
    return _kernel_cache().compile(ir_text)


def compile_glue(ir_text: str) -> bytes:
    """Object code for glue that calls kernels with addresses baked in (a capture's entry point,
    a stream's step function): O1 — it is calls and branches, nothing to vectorise — and never
    cached on disk, since its addresses are this process's."""
    return _glue_compiler().compile(ir_text)
