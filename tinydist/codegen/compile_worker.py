"""LLVM's optimisation pipeline in a child process, replaced every `RECYCLE` compiles.

Why: llvmlite 0.50's new-pass-manager pipeline keeps memory for every module it optimises, for
the life of the process. Measured by compiling distinct one-loop kernels through `HostCompiler`
(2,000 of them, the growth over the second half, 2-vCPU VM under load): O3 keeps 73.9 KiB a
module, O1 55.4, O0 0.0; `emit_object` alone 0.5. None of glibc's remedies touch it:
`malloc_trim(0)` after every 16 compiles 73.3 KiB, `mallopt(M_ARENA_MAX, 1)` 73.9, a fresh LLVM
context per module 70.9 (70.2 trimmed), a fresh pass builder and tuning options, each disposed,
73.9, one pass builder reused 72.5 (a reused module pass manager aborts inside LLVM). It is not
fragmentation but memory LLVM never frees, so the only bound is a process that ends.

So a process that has compiled `TINYDIST_COMPILE_WORKER_AFTER` modules itself (64 by default:
~5 MiB kept; short programs and tests never start a worker) sends the rest to one child,
`tinydist.codegen.compile_worker.main` in a fresh interpreter, over pipes: a request is the optimisation level and
the IR, the answer the object code or the compile error. The child is replaced after `RECYCLE`
modules (~18 MiB kept there at most) and costs one interpreter start-up (~0.5 s of CPU) per
`RECYCLE` compiles of several ms each. A child that dies (an LLVM abort on bad IR) is a
CompileError in the caller, not the caller's death; the next compile starts a fresh child.
"""

from __future__ import annotations

import contextlib
import os
import struct
import subprocess
import sys
import threading
from typing import IO

from tinydist.base.errors import CompileError

RECYCLE = 256
_REQUEST = struct.Struct("<BI")    # optimisation level, IR bytes
_ANSWER = struct.Struct("<BI")     # 0 object code / 1 compile error, payload bytes


class CompileWorker:
    """The child process, started on first use and replaced every `RECYCLE` compiles. Thread-safe."""

    def __init__(self, recycle: int = RECYCLE) -> None:
        self.recycle = recycle
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._served = 0
        self.started = 0     # children started, for tests and the bench

    def compile(self, ir_text: str, opt_level: int) -> bytes:
        """Object code for `ir_text` at `opt_level`, compiled in the child."""
        ir = ir_text.encode()
        with self._lock:
            proc = self._child()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(_REQUEST.pack(opt_level, len(ir)) + ir)
                proc.stdin.flush()
                status, size = _ANSWER.unpack(_read(proc.stdout, _ANSWER.size))
                payload = _read(proc.stdout, size)
            except (OSError, EOFError) as exc:
                self._stop()
                raise CompileError(f"the compile worker (pid {proc.pid}) died compiling a {len(ir)}-byte module "
                                   f"({exc}); LLVM likely aborted on it: its message is on stderr above") from exc
            self._served += 1
            if self._served >= self.recycle:
                self._stop()
        if status:
            raise CompileError(payload.decode(errors="replace"))
        return payload

    def _child(self) -> subprocess.Popen[bytes]:
        if self._proc is None:
            env = dict(os.environ, TINYDIST_COMPILE_WORKER_AFTER="0")   # the child compiles in-process
            try:
                self._proc = subprocess.Popen([sys.executable, "-c", "from tinydist.codegen.compile_worker import main; main()"],
                                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
            except OSError as exc:
                raise CompileError(f"cannot start the compile worker ({sys.executable}: {exc}); set "
                                   f"TINYDIST_COMPILE_WORKER_AFTER=0 to compile in this process") from exc
            self._served = 0
            self.started += 1
        return self._proc

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            assert proc.stdin is not None and proc.stdout is not None
            for stream in (proc.stdin, proc.stdout):   # the child's loop sees EOF and returns
                with contextlib.suppress(OSError):      # a dead child's pipe: nothing left to flush to
                    stream.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def close(self) -> None:
        with self._lock:
            self._stop()


def _read(stream: IO[bytes], n: int) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise EOFError(f"the pipe closed after {len(data)} of {n} bytes")
    return data


def main() -> None:
    """The child's loop: one HostCompiler per optimisation level, requests until stdin closes."""
    from tinydist.codegen.compiler import HostCompiler

    compilers: dict[int, HostCompiler] = {}
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        head = stdin.read(_REQUEST.size)
        if len(head) < _REQUEST.size:
            return
        level, size = _REQUEST.unpack(head)
        ir_text = _read(stdin, size).decode()
        try:
            if level not in compilers:
                compilers[level] = HostCompiler(opt_level=level)
            status, payload = 0, compilers[level].compile(ir_text)
        except CompileError as exc:
            status, payload = 1, str(exc).encode()
        stdout.write(_ANSWER.pack(status, len(payload)) + payload)
        stdout.flush()
