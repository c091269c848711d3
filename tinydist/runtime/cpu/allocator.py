"""Host memory for CPU devices: 64-byte aligned (a cache line, and a whole AVX-512 vector)."""

from __future__ import annotations

import ctypes
import ctypes.util

from tinydist.runtime.allocator import Allocator
from tinydist.runtime.faults import faults

ALIGNMENT = 64

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
_libc.posix_memalign.restype = ctypes.c_int
_libc.free.argtypes = [ctypes.c_void_p]
_libc.free.restype = None


class CPUAllocator(Allocator):
    def _map(self, nbytes: int) -> int:
        faults.check("cpu.posix_memalign")
        pointer = ctypes.c_void_p()
        status = _libc.posix_memalign(ctypes.byref(pointer), ALIGNMENT, nbytes)
        if status != 0 or not pointer.value:
            raise MemoryError(f"posix_memalign({nbytes}) failed with errno {status}")
        return pointer.value

    def _unmap(self, address: int, nbytes: int) -> None:
        _libc.free(address)
