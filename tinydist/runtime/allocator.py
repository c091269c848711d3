"""Allocators: symmetric ownership of device memory.

`alloc` takes resources in steps — reserve the bytes against the device's limit, map memory,
record it in the ledger — and keeps the undo of each step; if any step fails, the
stack unwinds and everything taken so far is given back before the error propagates. `free` runs
the same undos. `alloc_many` is all-or-nothing over several buffers.

Freed memory is kept in a size-keyed cache (bounded by TINYDIST_ALLOCATOR_CACHE bytes and
TINYDIST_ALLOCATOR_CACHE_BLOCKS blocks) and handed out again for the next allocation of the same
size class: repeated realizes of one graph then never pay for mapping and first-touch page faults
again. Blocks of 64 KiB and more are mapped in size classes, four per power of two (at most 25 %
over the request), so tensors of ever-different sizes reuse blocks too; when a freed block does
not fit, the blocks freed longest ago make room. Before, exact sizes and a cache that refused new
blocks once full: 10k random-size tensors realized and dropped filled it with blocks no later size
matched, and mappings grew from 1.5k to 10.5k. The cache is the allocator's own: `trim()` and
closing the device give it back. The ledger and statistics count live buffers only, in the bytes
asked for.

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

from tinydist.base.errors import AllocationError, DeviceClosed, DeviceFailed
from tinydist.runtime.buffer import Buffer
from tinydist.runtime.faults import faults

if TYPE_CHECKING:
    from tinydist.runtime.device import Device


# `recycled`'s bounds: buffers kept per size, sizes kept, the largest size kept (beyond it the
# copy into a frame's buffer costs more than making the buffer)
RECYCLED_PER_SIZE = 4
RECYCLED_SIZES = 64
RECYCLE_MAX_BYTES = 1 << 20

SIZE_CLASS_FROM = 64 << 10  # below this, blocks come from the C heap without a mapping of their own


def size_class(nbytes: int) -> int:
    """The bytes mapped for an allocation of `nbytes` where freed blocks are reused: itself when
    small, else rounded up to a multiple of a quarter of its power of two (2**k <= nbytes)."""
    if nbytes < SIZE_CLASS_FROM:
        return nbytes
    step = 1 << (nbytes.bit_length() - 3)
    return -(-nbytes // step) * step


@dataclass(frozen=True)
class AllocatorStatistics:
    live_buffers: int
    live_bytes: int
    reserved_bytes: int
    peak_bytes: int
    limit_bytes: int
    cached_bytes: int = 0


class Allocator(ABC):
    def __init__(self, device: Device, limit_bytes: int, cache_bytes: int = 0, cache_blocks: int = 2048) -> None:
        self.device = device
        self.limit_bytes = limit_bytes
        self.cache_limit = cache_bytes
        self.cache_blocks = cache_blocks
        self._lock = threading.Lock()
        # Frees arrive from finalizers, which the garbage collector may run on a thread that is
        # already inside this allocator holding the lock: they are queued (deque appends need no
        # lock) and applied by whoever holds or next takes the lock — never waited for.
        self._released: collections.deque[tuple[int, int, int]] = collections.deque()  # (address, nbytes, block)
        self._reserved = 0
        self._peak = 0
        self._ledger: dict[int, int] = {}  # address -> bytes mapped
        self._cache: dict[int, list[int]] = {}  # size class -> addresses of freed blocks of that class
        self._cache_order: collections.OrderedDict[int, int] = collections.OrderedDict()  # address -> class, oldest first
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
            block = size_class(nbytes) if self.cache_limit else nbytes
            with self._lock:
                blocks = self._cache.get(block)
                if blocks and self._reserved + nbytes <= self.limit_bytes:
                    address = blocks.pop()
                    del self._cache_order[address]
                    self._cached_bytes -= block
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
                    return self._wrap(address, nbytes, block)
                except BaseException:
                    self._free(address, nbytes, block)
                    raise
        # Each step taken is undone in reverse on failure. Written out rather than as a list of
        # undo closures: this is on every realize's and every replay's path.
        reserved = mapped = registered = False
        cached = 0
        block = size_class(nbytes) if self.cache_limit else nbytes  # with no reuse, rounding would only waste
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
                blocks = self._cache.get(block)
                if blocks:
                    cached = blocks.pop()
                    del self._cache_order[cached]
                    self._cached_bytes -= block
            address = cached or self._map(block)
            mapped = not cached
            faults.check("alloc.register")
            with self._lock:
                self._ledger[address] = nbytes
                registered = True
            buffer = self._wrap(address, nbytes, block)
        except Exception as exc:
            if registered:
                self._unregister(address)
            if cached:
                self._put_cached(cached, block)
            elif mapped:
                self._unmap(address, block)
            if reserved:
                self._unreserve(nbytes)
            # a failed or closed device, or a refusal (a remote node's AccessDenied), is not an allocation failure
            if isinstance(exc, (AllocationError, DeviceFailed, DeviceClosed, PermissionError)):
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

    def _wrap(self, address: int, nbytes: int, block: int) -> Buffer:
        """The base buffer over a registered block (`block` bytes mapped for its `nbytes`), known to
        `release_all` by its weak reference."""
        buffer = Buffer(self.device, nbytes, address, functools.partial(self._free, address, nbytes, block))
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
            blocks = list(self._cache_order.items())
            self._cache.clear()
            self._cache_order.clear()
            self._cached_bytes = 0
        for address, nbytes in blocks:
            self._unmap(address, nbytes)
        return sum(nbytes for _, nbytes in blocks)

    def statistics(self) -> AllocatorStatistics:
        with self._locked():
            idle = self._idle_recycled()  # (one scan: it reads every pooled buffer's reference count)
            idle_bytes = sum(idle.values())
            return AllocatorStatistics(len(self._ledger) - len(idle), sum(self._ledger.values()) - idle_bytes,
                                       self._reserved - idle_bytes, self._peak, self.limit_bytes,
                                       self._cached_bytes + idle_bytes)

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

    def _cache_block(self, address: int, block: int, unmap: list[tuple[int, int]]) -> None:
        """Keep a freed block for reuse (lock held), the blocks freed longest ago making room; what
        is not kept goes on `unmap`, to be unmapped once the lock is let go."""
        if block > self.cache_limit or self.cache_blocks < 1:
            unmap.append((address, block))
            return
        while self._cache_order and (self._cached_bytes + block > self.cache_limit
                                     or len(self._cache_order) >= self.cache_blocks):
            oldest, size = self._cache_order.popitem(last=False)
            blocks = self._cache[size]
            blocks.remove(oldest)
            if not blocks:  # else every size ever freed keeps a key: one per new shape, without bound
                del self._cache[size]
            self._cached_bytes -= size
            unmap.append((oldest, size))
        self._cache.setdefault(block, []).append(address)
        self._cache_order[address] = block
        self._cached_bytes += block

    def _put_cached(self, address: int, block: int) -> None:
        unmap: list[tuple[int, int]] = []
        with self._locked():
            self._cache_block(address, block, unmap)
        for old, size in unmap:
            self._unmap(old, size)

    def _free(self, address: int, nbytes: int, block: int) -> None:
        self._released.append((address, nbytes, block))
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
            unmap: list[tuple[int, int]] = []
            try:
                while self._released:
                    address, nbytes, block = self._released.popleft()
                    del self._ledger[address]
                    self._bases.pop(address, None)
                    self._reserved -= nbytes
                    self._cache_block(address, block, unmap)
            finally:
                self._lock.release()
            for address, nbytes in unmap:
                self._unmap(address, nbytes)
