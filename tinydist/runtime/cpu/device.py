"""CPU devices: host memory, native kernels from LLVM, one worker thread per queue.

`CPU:0`, `CPU:1`, … are virtual devices over the same host memory. Each has its own compute and
copy workers; ctypes releases the GIL while a kernel runs, so devices really run in parallel.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence
from typing import Any

from tinydist.base.config import settings
from tinydist.runtime.cpu import containment
from tinydist.runtime.cpu.allocator import CPUAllocator
from tinydist.runtime.cpu.loader import native_loader
from tinydist.runtime.device import Device
from tinydist.runtime.program import Program
from tinydist.runtime.timeline import Timeline

# ctypes.memmove is itself a foreign function: the GIL is released while it copies.
_memmove = ctypes.memmove


class CPUDevice(Device):
    native_code = True

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._allocator: CPUAllocator | None = None
        # the progress word of every program this device loaded, by address (see kernel_progress)
        self._progress_words: dict[int, tuple[ctypes.c_int64, weakref.ref[Any]]] = {}  # word address -> (the word, its code)

    @property
    def allocator(self) -> CPUAllocator:
        if self._allocator is None:
            self.check_usable()
        assert self._allocator is not None
        return self._allocator

    def _open_backend(self) -> None:
        self._allocator = CPUAllocator(self, settings.CPU_MEMORY_LIMIT, settings.ALLOCATOR_CACHE, settings.ALLOCATOR_CACHE_BLOCKS)

    def _close_backend(self) -> None:
        if self._allocator is not None:
            self._allocator.release_all()

    def load_program(self, object_code: bytes, entry: str, signature: Sequence[str], calls: Sequence[Any] = ()) -> Program:
        self.check_usable()
        program = native_loader.load(object_code, entry, signature, calls)
        if program.progress:
            held = self._progress_words.get(program.progress)
            if held is None or held[1]() is None:  # new, or a freed object's word at the same address
                self._progress_words[program.progress] = (ctypes.c_int64.from_address(program.progress),
                                                          weakref.ref(program.cfunc._tinydist_code))
        return program

    def kernel_progress(self) -> int:
        """The sum of this device's programs' progress words: one read each, when a hang
        deadline passes (a process with 1,000 kernels reads them in well under a millisecond).
        A word is read only while its code is held here for the read: code the kernel LRU freed
        is forgotten, never read after it was unmapped."""
        total = 0
        for address, (word, code) in list(self._progress_words.items()):
            alive = code()
            if alive is None:
                self._progress_words.pop(address, None)
                continue
            total += word.value
            del alive
        return total

    def contain(self, hung: Timeline) -> None:
        for queue in self.queues.values():
            worker = queue.worker
            if queue.timeline is hung and worker is not None and containment.park_if_running(worker):
                self.log.error("parked the stuck worker thread: it stays asleep until exit", queue=queue.kind,
                               thread=worker.name)

    @property
    def host_visible(self) -> bool:
        return True

    def host_copy(self) -> object:
        return _memmove
