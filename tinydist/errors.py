"""The exception vocabulary shared by every layer.

    TinydistError
    ├── DeviceError                     something about a device
    │   ├── DeviceNotFound (LookupError)    the name names no device; lists the available ones
    │   ├── DeviceUnavailable               the back end exists but cannot open here; says why
    │   ├── DeviceFailed                    the device was marked failed; every later use raises it
    │   │   └── DeviceHang (TimeoutError)   a timeline stopped moving past its deadline
    │   └── ClosedResourceError             the device / queue was closed
    ├── BufferError_                    misuse of a buffer or view
    │   ├── OutOfBounds (IndexError)        a view or copy outside its base, refused before touching memory
    │   ├── BufferInUse                     freeing a base that still has live views
    │   └── UseAfterFree                    freeing twice, or using a freed buffer
    ├── AllocationError (MemoryError)   an allocation failed; everything it took was given back
    └── CompileError                    LLVM refused a kernel; carries LLVM's message

Messages name the object, show the values and say what to do.
"""

from __future__ import annotations


class TinydistError(Exception):
    """Base of every error tinydist raises on purpose."""


class ClosedResourceError(TinydistError):
    """The resource (a device, a link, a group's shared memory) was closed; open a new one."""


class DeviceError(TinydistError):
    """An error about one device."""


class DeviceNotFound(DeviceError, LookupError):
    """The device name does not name any device."""


class DeviceUnavailable(DeviceError):
    """The back end exists, but the device cannot be opened on this machine."""


class DeviceFailed(DeviceError):
    """The device was marked failed; it refuses all further work until reopened."""


class DeviceHang(DeviceFailed, TimeoutError):
    """A timeline did not move before its deadline; the device is marked failed."""


class DeviceClosed(DeviceError, ClosedResourceError):
    """The device, one of its queues, or the engine holding the devices was closed; open a new one.

    A DeviceError as well, so callers that treat any device error as "this time only, the device
    may be reopened" (engine.lowered) keep doing so."""


class BufferError_(TinydistError):
    """Misuse of a buffer or view (named with a trailing underscore: Python owns BufferError)."""


class OutOfBounds(BufferError_, IndexError):
    """A view or transfer reaches outside its base buffer."""


class BufferInUse(BufferError_):
    """The buffer cannot be freed while live views of it exist."""


class UseAfterFree(BufferError_):
    """The buffer was already freed."""


class AllocationError(TinydistError, MemoryError):
    """An allocation failed; everything it had taken was given back."""


class CompileError(TinydistError):
    """LLVM rejected a kernel."""

