"""The engine's own intra-op workers: T - 1 threads that live in native code and run the parts of
parallel entry points (`tinydist.codegen.parallel`) beside the thread that calls them.

Each worker is a Python thread whose whole life is one ctypes call of the pool's loop (which
releases the GIL), so a frame costs no Python on the workers' side: the caller's entry point
posts the frame through the control block and the workers, spinning or asleep on its futex,
start at once. One pool per device and thread count (`DeviceCompiler.link_parallel` asks for
it): a device's entry points run one at a time (its compute queue), so a pool's control block is
never shared by two frames; two devices run their frames at the same time on pools of their own.
Pools stop when the process exits (`close`: the stop word, a post, the threads joined).
"""

from __future__ import annotations

import atexit
import itertools
import threading

import numpy as np

from tinydist.codegen.compile_cache import compile_glue
from tinydist.codegen.parallel import CONTROL_WORDS, STOP, worker_ir
from tinydist.runtime.cpu.loader import native_loader

_ids = itertools.count()
_LINE = 64


class WorkerPool:
    """`threads - 1` native workers and their control block (see the module docstring)."""

    def __init__(self, threads: int) -> None:
        if threads < 2:
            raise ValueError(f"a worker pool serves 2 or more threads, got {threads}")
        self.threads = threads
        raw = np.zeros(CONTROL_WORDS * 8 + _LINE, np.uint8)
        start = -raw.ctypes.data % _LINE
        self._memory = raw  # kept: the workers poll it for the life of the pool
        self.words = raw[start:start + CONTROL_WORDS * 8].view(np.int64)
        self.control = self.words.ctypes.data
        name = f"tinydist_workers_{next(_ids)}"
        code = compile_glue(worker_ir(name, self.control))
        self._loop = native_loader.load(code, name, ["i64"])
        self.post = native_loader.load(code, f"{name}_post", [])
        self._workers = [threading.Thread(target=self._loop.cfunc, args=(slot,), daemon=True,
                                          name=f"tinydist-intra-op-{slot}") for slot in range(1, threads)]
        for worker in self._workers:
            worker.start()
        self.closed = False
        atexit.register(self.close)

    def close(self) -> None:
        """Stop the workers (each finishes the frame it runs) and wait for them."""
        if self.closed:
            return
        self.closed = True
        self.words[STOP] = 1
        self.post.cfunc()
        for worker in self._workers:
            worker.join()
        atexit.unregister(self.close)


_pools: dict[tuple[str, int], WorkerPool] = {}
_lock = threading.Lock()


def pool(device: str, threads: int) -> WorkerPool:
    """The pool of `threads` threads for `device`'s entry points, started on first use."""
    with _lock:
        found = _pools.get((device, threads))
        if found is None or found.closed:
            found = _pools[(device, threads)] = WorkerPool(threads)
        return found
