"""Cross-memory attach: copy straight between this process's memory and a peer process's.

Linux's process_vm_readv(2) / process_vm_writev(2) move bytes between two address spaces in one copy,
done by the kernel; MPI libraries use them for large messages on one host ("single copy"). They need
the right to ptrace the peer (same user, and Yama's ptrace_scope or a seccomp profile may forbid it),
so a group probes them once (`ShmGroup.negotiate_single_copy`) and uses them only where every rank can.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from collections.abc import Callable

import numpy as np

from tinydist.transports.base import TransportError


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
_READ: Callable[..., int] | None  # process_vm_readv / _writev, where the C library has them
_WRITE: Callable[..., int] | None
if _libc is not None and hasattr(_libc, "process_vm_readv"):
    for _fn in (_libc.process_vm_readv, _libc.process_vm_writev):
        _fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                        ctypes.c_ulong]
        _fn.restype = ctypes.c_ssize_t
    _READ, _WRITE = _libc.process_vm_readv, _libc.process_vm_writev
else:
    _READ = _WRITE = None


class PeerGone(TransportError):
    """The peer process no longer exists (ESRCH): it died while its memory was being read or written."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        super().__init__(f"process {pid} is gone")


def available() -> bool:
    return _READ is not None


def read(pid: int, address: int, into: np.ndarray) -> None:
    """Copy `into.nbytes` bytes at `address` in process `pid` into the contiguous array `into`."""
    _transfer(_READ, pid, address, into, "read")


def write(pid: int, address: int, data: np.ndarray) -> None:
    """Copy the contiguous array `data` to `address` in process `pid`."""
    _transfer(_WRITE, pid, address, data, "write")


def _transfer(call: Callable[..., int] | None, pid: int, address: int, local: np.ndarray, verb: str) -> None:
    if call is None:
        raise TransportError("process_vm_readv/writev are not available on this platform")
    done, total, base = 0, local.nbytes, local.ctypes.data
    while done < total:          # a transfer stops short only at an unmapped page: then the next call fails
        mine, theirs = _IoVec(base + done, total - done), _IoVec(address + done, total - done)
        moved = call(pid, ctypes.byref(mine), 1, ctypes.byref(theirs), 1, 0)
        if moved <= 0:
            err = ctypes.get_errno() if moved < 0 else errno.EFAULT
            if err == errno.ESRCH:
                raise PeerGone(pid)
            raise TransportError(f"cannot {verb} {total - done} bytes at {address + done:#x} in process {pid}: "
                                 f"{os.strerror(err)}")
        done += moved
