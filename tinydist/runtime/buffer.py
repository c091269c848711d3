"""Buffers and views of device memory.

A base buffer owns a range of memory (or borrows it, for external memory); a view is
`(base, offset, nbytes)` into it. Views are checked against their base before anything touches
memory. A base cannot be freed while live views of it exist, nor twice. Freeing is immediate for
the caller (no new use is accepted) but the memory is given back only after the last device work
that touches it has completed, so an in-flight kernel never sees freed memory — the same rule
keeps external memory referenced until its last use.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tinydist.base.errors import BufferInUse, OutOfBounds, UseAfterFree
from tinydist.runtime.dependencies import AccessLog

if TYPE_CHECKING:
    from tinydist.runtime.device import Device


class Buffer:
    __slots__ = ("device", "nbytes", "offset", "_parent", "accesses", "_address", "_finalizer",
                 "_freed", "_views", "_external", "host_view", "__weakref__")

    def __init__(self, device: Device, nbytes: int, address: int, release: Callable[[], None],
                 *, external: bool = False, owner: Any = None) -> None:
        """A base buffer; made by allocators (`Allocator.alloc`, `Allocator.from_blob`), not by users."""
        self.device = device
        self.nbytes = nbytes
        self.offset = 0
        self._parent: Buffer | None = None  # None for a base: `base` is then self (no reference cycle)
        self.accesses = AccessLog()
        self._address = address
        # The same path gives memory back on free() and when the buffer is garbage collected.
        self._finalizer: _Release | None = _Release(self, self.accesses, release, owner)
        self._external = external
        self._freed = False
        self._views: weakref.WeakSet[Buffer] | None = None  # made with the first view
        # a numpy array over this memory, kept by `Device.host_array` (host-memory devices only)
        self.host_view: Any = None

    @classmethod
    def _view_of(cls, base: Buffer, offset: int, nbytes: int) -> Buffer:
        view = cls.__new__(cls)
        view.device, view.nbytes, view.offset, view._parent = base.device, nbytes, offset, base
        view.accesses = base.accesses
        view._address, view._finalizer, view._external = base._address, None, base._external
        # views of a view are views of the base: only the base's set is ever used, so share it
        # rather than building one per view (an allreduce's launches make dozens of views a call)
        views = base._views
        if views is None:
            views = base._views = weakref.WeakSet()
        view._freed, view._views, view.host_view = False, views, None
        views.add(view)
        return view

    def __repr__(self) -> str:
        kind = "external " if self._external else ""
        if self.is_view:
            return f"Buffer(view of {self.base!r}, offset={self.offset}, nbytes={self.nbytes})"
        state = ", freed" if self._freed else ""
        return f"Buffer({kind}device={self.device.name!r}, nbytes={self.nbytes}{state})"

    @property
    def release_ref(self) -> weakref.ref[Buffer]:
        """The weak reference whose callback gives a base buffer's memory back (it dies with it)."""
        assert self._finalizer is not None and self._finalizer.ref is not None, f"{self!r} is a view or freed"
        return self._finalizer.ref

    @property
    def base(self) -> Buffer:
        return self if self._parent is None else self._parent

    @property
    def is_view(self) -> bool:
        return self._parent is not None

    @property
    def freed(self) -> bool:
        return self._freed or self.base._freed

    @property
    def external(self) -> bool:
        return self._external

    @property
    def address(self) -> int:
        """The memory address of this buffer's first byte (checked: the base must be alive)."""
        if self._freed or (self._parent is not None and self._parent._freed):  # check_alive, inline: a replay asks per buffer
            self.check_alive()
        return self._address + self.offset

    def check_alive(self) -> None:
        # read through _parent, not the `base` property: this runs once per access of every batch
        if self._freed or (self._parent is not None and self._parent._freed):
            raise UseAfterFree(f"{self!r} was freed; allocate a new buffer")

    def view(self, offset: int, nbytes: int) -> Buffer:
        """A view of `nbytes` bytes starting `offset` bytes into this buffer (or view)."""
        self.check_alive()
        if not isinstance(offset, int) or not isinstance(nbytes, int):
            raise TypeError(f"view offset and nbytes must be ints, got {type(offset).__name__} and {type(nbytes).__name__}")
        if offset < 0 or nbytes < 0 or offset > self.nbytes or nbytes > self.nbytes - offset:
            raise OutOfBounds(f"view [{offset}, {offset}+{nbytes}) is outside {self!r} (valid: 0 <= offset <= offset+nbytes <= {self.nbytes})")
        return Buffer._view_of(self.base, self.offset + offset, nbytes)

    def release(self) -> None:
        """Drop this view (views also drop when garbage collected). Idempotent."""
        if not self.is_view:
            raise TypeError(f"release() is for views; free the base {self!r} with free()")
        self._freed = True
        self.base._views.discard(self)  # type: ignore[union-attr]

    def live_views(self) -> list[Buffer]:
        views = self.base._views
        return [] if views is None else [v for v in views if not v._freed]

    def free(self) -> None:
        """Give the base's memory back once all device work on it has completed."""
        if self.is_view:
            raise TypeError(f"free() frees a base buffer; {self!r} is a view: call release() on it")
        if self._freed:
            raise UseAfterFree(f"double free of {self!r}")
        views = self.live_views()
        if views:
            raise BufferInUse(f"cannot free {self!r}: {len(views)} live view(s), e.g. {views[0]!r}; release them first")
        self._freed = True
        assert self._finalizer is not None
        self._finalizer()


# the weak reference of every base buffer whose memory is not given back yet: a reference only
# the buffer held would die with it in a garbage-collected cycle, without calling back
_RELEASES: set[weakref.ref[Buffer]] = set()


class _Release:
    """A base buffer's release, run once: by `free()`, or when the buffer is garbage collected,
    as its weak reference's callback. A slotted object and a weak reference rather than a
    `weakref.finalize` (~1.5 us to make and run, and every frame's `Tensor(array)` makes one);
    like a finalize made with `atexit=False`, it gives nothing back once the interpreter is
    shutting down."""

    __slots__ = ("accesses", "owner", "ref", "release")

    def __init__(self, buffer: Buffer, accesses: AccessLog, release: Callable[[], None], owner: Any) -> None:
        self.ref: weakref.ref[Buffer] | None = weakref.ref(buffer, self)
        self.accesses, self.release, self.owner = accesses, release, owner
        _RELEASES.add(self.ref)

    def __call__(self, _ref: object = None) -> None:
        release = self.release
        if release is None:
            return
        _RELEASES.discard(self.ref)
        self.ref = self.release = None  # type: ignore[assignment]
        owner, self.owner = self.owner, None
        if not sys.is_finalizing():
            _release_when_idle(self.accesses, release, owner)


def _release_when_idle(accesses: AccessLog, release: Callable[[], None], owner: Any) -> None:
    """Call `release` once every device access recorded in `accesses` has completed.

    `owner` (external memory's owner) is referenced here only to keep it alive until then.
    """
    pending = accesses.pending()
    if not pending:
        release()
        return
    countdown = _ReleaseAfterLast(len(pending), release, owner)
    for timeline, value in pending.items():
        timeline.call_when_reached(value, countdown)


class _ReleaseAfterLast:
    """Called once per pending timeline; the last call releases the memory and lets go of its
    owner. One object rather than a closure and its cells: a caller that runs far ahead of the
    devices keeps one of these per freed buffer alive, and the garbage collector walks them all."""

    __slots__ = ("_remaining", "_lock", "_release", "_owner")

    def __init__(self, count: int, release: Callable[[], None], owner: Any) -> None:
        self._remaining = count
        self._lock = threading.Lock()
        self._release: Callable[[], None] | None = release
        self._owner = owner

    def __call__(self) -> None:
        with self._lock:
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            assert self._release is not None
            self._release()
            self._release = self._owner = None
