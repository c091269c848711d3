"""An on-disk cache of compiled object code.

Keyed by sha256 of the IR text, CPU name, CPU features, LLVM/llvmlite versions and the opt level,
so a changed host or toolchain never loads stale code. Entries are written atomically (temp file
and rename): two processes compiling the same kernel both succeed, one file wins.
"""

from __future__ import annotations

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
