"""Allocators: symmetric ownership of device memory.

`alloc` takes resources in steps — reserve the bytes against the device's limit, map memory,
record it in the ledger — and keeps the undo of each step; if any step fails, the
stack unwinds and everything taken so far is given back before the error propagates. `free` runs
the same undos. `alloc_many` is all-or-nothing over several buffers.

Freed memory is kept in a size-keyed cache (bounded by TINYDIST_ALLOCATOR_CACHE bytes) and handed
out again for the next allocation of the same size: repeated realizes of one graph then never pay
for mapping and first-touch page faults again. The cache is the allocator's own: `trim()` and
closing the device give it back. The ledger and statistics count live buffers only.

Back ends implement `_map` / `_unmap` (and may add steps); the ledger lets tests and `close()`
prove that nothing is left behind.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import sys
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tinydist.base.errors import AllocationError
from tinydist.runtime.buffer import Buffer
from tinydist.runtime.faults import faults

if TYPE_CHECKING:
    from tinydist.runtime.device import Device


# `recycled`'s bounds: buffers kept per size, sizes kept, the largest size kept (beyond it the
# copy into a frame's buffer costs more than making the buffer)
RECYCLED_PER_SIZE = 4
RECYCLED_SIZES = 64
RECYCLE_MAX_BYTES = 1 << 20


@dataclass(frozen=True)
class AllocatorStatistics:
    live_buffers: int
    live_bytes: int
    reserved_bytes: int
    peak_bytes: int
    limit_bytes: int
    cached_bytes: int = 0


class Allocator(ABC):
    def __init__(self, device: Device, limit_bytes: int, cache_bytes: int = 0) -> None:
        self.device = device
        self.limit_bytes = limit_bytes
        self.cache_limit = cache_bytes
        self._lock = threading.Lock()
        # Frees arrive from finalizers, which the garbage collector may run on a thread that is
        # already inside this allocator holding the lock: they are queued (deque appends need no
        # lock) and applied by whoever holds or next takes the lock — never waited for.
        self._released: collections.deque[tuple[int, int]] = collections.deque()
        self._reserved = 0
        self._peak = 0
        self._ledger: dict[int, int] = {}  # address -> bytes mapped
        self._cache: dict[int, list[int]] = {}  # nbytes -> addresses of freed blocks of that size
        self._cached_bytes = 0
        # address -> its live base buffer, weakly (a dict entry and a plain weak reference: a WeakSet's
        # callback per buffer costs more than the rest of an allocation); dropped when it is given back
        self._bases: dict[int, weakref.ref[Buffer]] = {}
        self._recycled: dict[int, list[Buffer]] = {}  # nbytes -> buffers `recycled` handed out, oldest size first

    # ---- back-end hooks ----------------------------------------------------------------------

    @abstractmethod
    def _map(self, nbytes: int) -> int:
        """Take `nbytes` of device memory; return its address."""

    @abstractmethod
    def _unmap(self, address: int, nbytes: int) -> None:
        """Give back exactly what `_map` returned."""

    # ---- public ------------------------------------------------------------------------------

    def alloc(self, nbytes: int) -> Buffer:
        if type(nbytes) is not int:
            raise TypeError(f"{self.device.name}: allocation size must be an int, got {type(nbytes).__name__}")
        if nbytes <= 0:
            raise ValueError(f"{self.device.name}: allocation size must be positive, got {nbytes}")
        self.device.check_usable()
        if not faults.armed:  # a cached block, no fault injected: one lock section (every frame's upload)
            with self._lock:
                blocks = self._cache.get(nbytes)
                if blocks and self._reserved + nbytes <= self.limit_bytes:
                    address = blocks.pop()
                    self._cached_bytes -= nbytes
                    self._reserved += nbytes
                    if self._reserved > self._peak:
                        self._peak = self._reserved
                    self._ledger[address] = nbytes
                else:
                    address = 0
            if self._released:  # frees queued while the lock was held are applied by its holder
                self._apply_releases()
            if address:
                try:
                    return self._wrap(address, nbytes)
                except BaseException:
                    self._free(address, nbytes)
                    raise
        # Each step taken is undone in reverse on failure. Written out rather than as a list of
        # undo closures: this is on every realize's and every replay's path.
        reserved = mapped = registered = False
        cached = 0
        try:
            faults.check("alloc.reserve")
            faults.check("alloc.map")
            with self._lock:
                if self._reserved + nbytes > self.limit_bytes:
                    raise AllocationError(
                        f"{self.device.name}: out of memory allocating {nbytes} bytes: "
                        f"{self._reserved} of {self.limit_bytes} bytes in use; free buffers or raise TINYDIST_CPU_MEMORY_LIMIT")
                self._reserved += nbytes
                reserved = True
                if self._reserved > self._peak:
                    self._peak = self._reserved
                blocks = self._cache.get(nbytes)
                if blocks:
                    cached = blocks.pop()
                    self._cached_bytes -= nbytes
            address = cached or self._map(nbytes)
            mapped = not cached
            faults.check("alloc.register")
            with self._lock:
                self._ledger[address] = nbytes
                registered = True
            buffer = self._wrap(address, nbytes)
        except Exception as exc:
            if registered:
                self._unregister(address)
            if cached:
                self._put_cached(cached, nbytes)
            elif mapped:
                self._unmap(address, nbytes)
            if reserved:
                self._unreserve(nbytes)
            if isinstance(exc, AllocationError):
                raise
            raise AllocationError(
                f"{self.device.name}: allocating {nbytes} bytes failed ({exc}); "
                f"in use: {self._reserved} of {self.limit_bytes} bytes; nothing was kept") from exc
        finally:
            if self._released:
                self._apply_releases()
        return buffer

    def recycled(self, nbytes: int) -> Buffer:
        """A base buffer of `nbytes` that nothing references any more, one of the few handed out
        here before, as it is — its memory, its access log and its host view — else a new one,
        kept for the next ask. For buffers made and dropped every frame (an uploaded frame, a
        replay's outputs): making a Buffer and giving it back costs ~3 us, finding an idle one
        ~0.3 us. An idle one counts as cached, not live (`statistics`, `outstanding`); whoever
        writes it orders that against work still reading it, as for any buffer (its access log)."""
        with self._lock:
            pool = self._recycled.get(nbytes)
            if pool is not None:
                for buffer in pool:
                    if sys.getrefcount(buffer) <= 3 and not buffer._freed:  # the pool's, the loop's, the call's
                        return buffer
        buffer = self.alloc(nbytes)
        if nbytes <= RECYCLE_MAX_BYTES:
            with self._lock:
                pool = self._recycled.get(nbytes)
                if pool is None:
                    if len(self._recycled) >= RECYCLED_SIZES:  # the oldest size goes: its buffers die when dropped
                        del self._recycled[next(iter(self._recycled))]
                    pool = self._recycled[nbytes] = []
                pool[:] = [b for b in pool if not b._freed]
                if len(pool) < RECYCLED_PER_SIZE:
                    pool.append(buffer)
        return buffer

    def _idle_recycled(self) -> dict[int, int]:
        """address -> bytes of the recycled buffers nothing references (lock held)."""
        return {b._address: b.nbytes for pool in self._recycled.values() for b in pool
                if sys.getrefcount(b) <= 3 and not b._freed}  # the pool's, the loop's, the call's

    def _wrap(self, address: int, nbytes: int) -> Buffer:
        """The base buffer over a registered block, known to `release_all` by its weak reference."""
        buffer = Buffer(self.device, nbytes, address, functools.partial(self._free, address, nbytes))
        self._bases[address] = buffer.release_ref  # the buffer's own weak reference: no second one made
        return buffer

    def alloc_many(self, sizes: Sequence[int]) -> list[Buffer]:
        """Allocate every size or none: a failure frees the ones already made."""
        made: list[Buffer] = []
        try:
            for size in sizes:
                made.append(self.alloc(size))
        except BaseException:
            for buffer in reversed(made):
                buffer.free()
            raise
        return made

    def from_blob(self, address: int, nbytes: int, owner: Any = None) -> Buffer:
        """Wrap external memory; it is never freed by tinydist, and `owner` is kept alive until its
        last device use completes after `free()`."""
        if nbytes <= 0 or address <= 0:
            raise ValueError(f"{self.device.name}: from_blob needs a positive address and size, got address={address:#x}, nbytes={nbytes}")
        self.device.check_usable()
        return Buffer(self.device, nbytes, address, lambda: None, external=True, owner=owner)

    def release_all(self) -> int:
        """Free every buffer still allocated and empty the cache (the device is closing); returns
        how many buffers were still live."""
        with self._lock:
            idle = self._idle_recycled()
        live = [b for b in (ref() for ref in list(self._bases.values())) if b is not None and not b.freed]
        for buffer in live:
            for view in buffer.live_views():
                view.release()
            buffer.free()
        self.cache_limit = 0
        self.trim()
        return sum(1 for buffer in live if buffer._address not in idle)

    def trim(self) -> int:
        """Give every cached block back, the idle recycled buffers too; returns the bytes released."""
        with self._lock:
            recycled, self._recycled = self._recycled, {}
        del recycled  # the idle ones die here: their blocks join the cache
        with self._locked():
            blocks = [(address, nbytes) for nbytes, addresses in self._cache.items() for address in addresses]
            self._cache.clear()
            self._cached_bytes = 0
        for address, nbytes in blocks:
            self._unmap(address, nbytes)
        return sum(nbytes for _, nbytes in blocks)

    def statistics(self) -> AllocatorStatistics:
        with self._locked():
            idle = sum(self._idle_recycled().values())
            live = len(self._ledger) - len(self._idle_recycled())
            return AllocatorStatistics(live, sum(self._ledger.values()) - idle, self._reserved - idle, self._peak,
                                       self.limit_bytes, self._cached_bytes + idle)

    def outstanding(self) -> dict[int, int]:
        """address -> bytes of every live buffer (mapped, not given back, not idle in the cache)."""
        with self._locked():
            idle = self._idle_recycled()
            return {address: nbytes for address, nbytes in self._ledger.items() if address not in idle}

    # ---- steps and their undos ---------------------------------------------------------------

    def _unreserve(self, nbytes: int) -> None:
        with self._locked():
            self._reserved -= nbytes

    def _unregister(self, address: int) -> None:
        with self._locked():
            del self._ledger[address]

    def _cache_block(self, address: int, nbytes: int) -> bool:
        """Keep a freed block for reuse if the cache has room (lock held); False: unmap it."""
        if self._cached_bytes + nbytes > self.cache_limit:
            return False
        self._cache.setdefault(nbytes, []).append(address)
        self._cached_bytes += nbytes
        return True

    def _put_cached(self, address: int, nbytes: int) -> None:
        with self._locked():
            kept = self._cache_block(address, nbytes)
        if not kept:
            self._unmap(address, nbytes)

    def _free(self, address: int, nbytes: int) -> None:
        self._released.append((address, nbytes))
        self._apply_releases()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            yield
        self._apply_releases()

    def _apply_releases(self) -> None:
        while self._released:
            if not self._lock.acquire(blocking=False):
                return  # the holder applies them when it lets go (it checks after releasing)
            unmap = []
            try:
                while self._released:
                    address, nbytes = self._released.popleft()
                    del self._ledger[address]
                    self._bases.pop(address, None)
                    self._reserved -= nbytes
                    if not self._cache_block(address, nbytes):
                        unmap.append((address, nbytes))
            finally:
                self._lock.release()
            for address, nbytes in unmap:
                self._unmap(address, nbytes)
