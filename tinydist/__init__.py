"""tinydist: an asyncio-native distributed tensor runtime with LLVM-generated native kernels."""

from tinydist.errors import (AllocationError, BufferInUse, ClosedResourceError, CompileError, DeviceError, DeviceFailed,
                             DeviceHang, DeviceNotFound, DeviceUnavailable, OutOfBounds, TinydistError, UseAfterFree)
from tinydist.runtime import Buffer, Device, discover, get_engine, open_device

__version__ = "0.1.0"

__all__ = ["AllocationError", "Buffer", "BufferInUse", "ClosedResourceError", "CompileError", "Device", "DeviceError",
           "DeviceFailed", "DeviceHang", "DeviceNotFound", "DeviceUnavailable", "OutOfBounds", "TinydistError",
           "UseAfterFree", "discover", "get_engine", "open_device"]
