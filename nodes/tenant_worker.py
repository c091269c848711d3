"""The process one tenant's kernels run in (`python -m tinydist.nodes.tenant_worker CTL FDS AS_BYTES CPU_S`).

Started by `tinydist.nodes.tenants.TenantWorker`, one per identity. Its address space holds the Python
interpreter, LLVM's loader, that tenant's loaded kernels and that tenant's buffers — shared-memory
segments (memfd) the node created and passed over `FDS` (SCM_RIGHTS), mapped here and in the node
at once, so copies stay zero-copy. Nothing of the node (keys, other tenants' memory, the policy) is
in it: it is a fresh interpreter (exec, not fork), and the node's memory is another process.

Before it reads its first request it confines itself, for good (nothing can lift these):

- resource limits: RLIMIT_AS (the tenant's byte quota + heap), RLIMIT_CPU (a backstop for a busy
  worker: SIGXCPU ends it, the next call starts a fresh one), RLIMIT_CORE 0, RLIMIT_NOFILE 16;
- PR_SET_PDEATHSIG(SIGKILL): it dies with the node;
- PR_SET_NO_NEW_PRIVS and a seccomp-BPF allow-list (`SYSCALLS`): memory management, reading and
  writing its two sockets, futex, signals, exit. No open/openat (no files, no /proc), no socket or
  connect, no fork/clone/execve, no kill, no ptrace or process_vm_readv (no reading the node).
  Anything else fails EPERM; a foreign syscall ABI (x32, i386) kills the process.

A kernel that walks out of its buffers therefore finds this tenant's own memory or an unmapped page
(SIGSEGV: the worker dies, the node fails that tenant's pending calls and starts a fresh worker on
its next call); even a kernel that takes over the worker can only use the syscalls above on its own
sockets. Requests (node → worker) are length-prefixed pickles: the node is trusted here. Replies
(worker → node) are fixed structs the node parses strictly (`REPLY`): this side is not trusted.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import platform
import resource
import signal
import socket
import struct
import sys
import time
from typing import Any

REPLY = struct.Struct("<QBdH")  # seq, ok (1) / failed (0), seconds, length of the message that follows
FRAME = struct.Struct("<I")
MAX_REPLY_MESSAGE = 512

# x86_64 numbers: read write close fstat lseek mmap mprotect munmap brk rt_sigaction rt_sigprocmask
# rt_sigreturn pread64 sched_yield mremap madvise getpid sendto recvfrom recvmsg (descriptors in)
# exit gettimeofday sigaltstack futex clock_gettime clock_nanosleep exit_group newfstatat getrandom
# membarrier rseq. No sendmsg: the worker never passes a descriptor on.
SYSCALLS = (0, 1, 3, 5, 8, 9, 10, 11, 12, 13, 14, 15, 17, 24, 25, 28, 39, 44, 45, 47, 60, 96, 131, 202,
            228, 230, 231, 262, 318, 324, 334)
_AUDIT_ARCH_X86_64 = 0xC000003E
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 1, 38, 22, 2
_RET_KILL_PROCESS, _RET_ERRNO, _RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_EPERM = 1


class _Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Filter))]


def seccomp_filter(allowed: tuple[int, ...]) -> list[tuple[int, int, int, int]]:
    """The BPF program: x86_64 ABI only, `allowed` syscalls pass, anything else EPERM."""
    ld_abs, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    n = len(allowed)
    prog = [(ld_abs, 0, 0, 4),                       # seccomp_data.arch
            (jeq, 1, 0, _AUDIT_ARCH_X86_64),
            (ret, 0, 0, _RET_KILL_PROCESS),
            (ld_abs, 0, 0, 0),                       # seccomp_data.nr
            (jge, n + 2, 0, 0x40000000)]             # the x32 ABI: past the list, EPERM and ALLOW to the kill
    for i, nr in enumerate(allowed):
        prog.append((jeq, n - i, 0, nr))             # a jump lands at its index + 1 + jt: ALLOW
    prog += [(ret, 0, 0, _RET_ERRNO | _EPERM), (ret, 0, 0, _RET_ALLOW), (ret, 0, 0, _RET_KILL_PROCESS)]
    return prog


def confine(address_space: int, cpu_seconds: int) -> bool:
    """Apply the limits and the filter; returns whether seccomp is on (x86_64 Linux only)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # the node died before the line above took effect
        os._exit(1)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (16, 16))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
    resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
    if platform.machine() != "x86_64":
        return False
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS failed")
    rules = seccomp_filter(SYSCALLS)
    filters = (_Filter * len(rules))(*(_Filter(*r) for r in rules))
    prog = _Program(len(rules), filters)
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "seccomp filter refused")
    return True


class Worker:
    def __init__(self, ctl: socket.socket, fds: socket.socket) -> None:
        self.ctl, self.fds = ctl, fds
        libc = ctypes.CDLL(None, use_errno=True)
        self._mmap = libc.mmap
        self._mmap.restype = ctypes.c_void_p
        self._mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        self._munmap = libc.munmap
        self._munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.segments: dict[int, tuple[int, int]] = {}  # segment id -> (address here, size)
        self.programs: dict[Any, Any] = {}

    def _recv_exact(self, n: int) -> bytes:
        chunks, got = [], 0
        while got < n:
            chunk = self.ctl.recv(min(n - got, 1 << 20))
            if not chunk:
                raise EOFError
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def reply(self, seq: int, ok: bool, seconds: float = 0.0, message: str = "") -> None:
        data = message.encode()[:MAX_REPLY_MESSAGE]
        self.ctl.sendall(REPLY.pack(seq, 1 if ok else 0, seconds, len(data)) + data)

    def serve(self) -> None:
        while True:
            try:
                (length,) = FRAME.unpack(self._recv_exact(FRAME.size))
                request = pickle.loads(self._recv_exact(length))
            except EOFError:
                return
            seq, op, args = request
            try:
                seconds = getattr(self, f"op_{op}")(*args)
            except Exception as exc:  # reported to the node, which maps it for the caller
                self.reply(seq, False, 0.0, f"{type(exc).__name__}: {exc}")
            else:
                self.reply(seq, True, seconds or 0.0)

    def op_map(self, segment: int, size: int) -> None:
        _, fds, _, _ = socket.recv_fds(self.fds, 1, 1)
        if len(fds) != 1:
            raise OSError("no segment descriptor arrived")
        address = self._mmap(None, size, 3, 1, fds[0], 0)  # PROT_READ|PROT_WRITE, MAP_SHARED
        os.close(fds[0])
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mapping a {size}-byte segment failed")
        self.segments[segment] = (address, size)

    def op_unmap(self, segment: int) -> None:
        found = self.segments.pop(segment, None)
        if found is not None:
            self._munmap(found[0], found[1])

    def op_load(self, key: Any, code: bytes, symbol: str, signature: tuple[str, ...]) -> None:
        from tinydist.runtime.cpu.loader import native_loader
        self.programs[key] = native_loader.load(code, symbol, signature)

    def op_unload(self, key: Any) -> None:
        self.programs.pop(key, None)

    def op_launch(self, key: Any, args: list[tuple[str, Any, Any]]) -> float:
        program = self.programs[key]
        values: list[Any] = []
        for kind, a, b in args:
            if kind == "b":
                address, size = self.segments[a]
                if not 0 <= b < size:
                    raise IndexError(f"offset {b} outside segment of {size} bytes")
                values.append(address + b)
            else:
                values.append(a)
        start = time.perf_counter()
        program.cfunc(*values)
        return time.perf_counter() - start


def main(argv: list[str]) -> None:
    ctl_fd, fds_fd, address_space, cpu_seconds = (int(a) for a in argv)
    ctl = socket.socket(fileno=ctl_fd)
    fds = socket.socket(fileno=fds_fd)
    # everything that reads files or /proc happens before the filter: the loader and LLVM's
    # native target
    from tinydist.runtime.cpu import loader
    loader._host_target()
    worker = Worker(ctl, fds)
    sandboxed = confine(address_space, cpu_seconds)
    worker.reply(0, True, 0.0, "seccomp" if sandboxed else "rlimits")
    worker.serve()


if __name__ == "__main__":
    main(sys.argv[1:])
