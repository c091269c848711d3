"""Host memory for CPU devices: 64-byte aligned (a cache line, and a whole AVX-512 vector).

Blocks of 2 MiB and more are aligned to 2 MiB and advised as transparent huge pages, so touching
them the first time costs one fault per 2 MiB instead of one per 4 KiB.
"""

from __future__ import annotations

import ctypes
import ctypes.util

from tinydist.runtime.allocator import Allocator
from tinydist.runtime.faults import faults

ALIGNMENT = 64
HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
_libc.posix_memalign.restype = ctypes.c_int
_libc.free.argtypes = [ctypes.c_void_p]
_libc.free.restype = None
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


class CPUAllocator(Allocator):
    def _map(self, nbytes: int) -> int:
        faults.check("cpu.posix_memalign")
        pointer = ctypes.c_void_p()
        huge = nbytes >= HUGE_PAGE
        status = _libc.posix_memalign(ctypes.byref(pointer), HUGE_PAGE if huge else ALIGNMENT, nbytes)
        if status != 0 or not pointer.value:
            raise MemoryError(f"posix_memalign({nbytes}) failed with errno {status}")
        if huge:
            _libc.madvise(pointer.value, nbytes // HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE)  # advice only: failure is harmless
        return pointer.value

    def _unmap(self, address: int, nbytes: int) -> None:
        _libc.free(address)
