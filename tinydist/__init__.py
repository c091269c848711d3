"""tinydist: an asyncio-native distributed tensor runtime with LLVM-generated native kernels."""

from tinydist.errors import (AllocationError, BufferInUse, ClosedResourceError, CompileError, DeviceError, DeviceFailed,
                             DeviceHang, DeviceNotFound, DeviceUnavailable, OutOfBounds, TinydistError, UseAfterFree)
from tinydist.dtypes import DType, bool_, float32, float64, int32, int64
from tinydist.runtime import Buffer, Device, discover, get_engine, open_device
from tinydist.schedule import ScheduleCycleError
from tinydist.tensor import Tensor, cat, manual_seed, stack, synchronize, where
from tinydist.jit import JitError, TinyJit, jit

__version__ = "0.1.0"

__all__ = ["AllocationError", "Buffer", "DType", "JitError", "TinyJit", "jit", "ScheduleCycleError", "Tensor", "bool_", "cat", "float32", "float64",
           "int32", "int64", "manual_seed", "stack", "synchronize", "where", "BufferInUse", "ClosedResourceError", "CompileError", "Device", "DeviceError",
           "DeviceFailed", "DeviceHang", "DeviceNotFound", "DeviceUnavailable", "OutOfBounds", "TinydistError",
           "UseAfterFree", "discover", "get_engine", "open_device"]
