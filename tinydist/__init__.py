"""tinydist: an asyncio-native distributed tensor runtime with LLVM-generated native kernels.

The engine, in processing order: `Tensor` (lazy graph, autograd) → `schedule` (fusion, order,
memory plan) → `codegen` (LLVM) → `runtime` (devices, queues, timelines). Subsystems that pull in
heavier dependencies are imported on first use: `td.dist` (process collectives, with its
transports), `td.parallel` (data parallel, which lives in the dist layer), `td.onnx`, `td.multi`
(sharded tensors) — so `import tinydist` stays light and never loads gRPC (tests/test_import_light.py).
"""

from importlib import import_module
from typing import Any

from tinydist.base.errors import (AllocationError, BufferInUse, ClosedResourceError, CompileError, DeviceError, DeviceFailed,
                                  DeviceHang, DeviceNotFound, DeviceUnavailable, OutOfBounds, TinydistError, UseAfterFree,
                                  WorkTooLarge)
from tinydist.frontend import autograd
from tinydist.frontend.autograd import enable_grad, no_grad
from tinydist.frontend.factories import (arange, empty, empty_like, eye, full, full_like, ones, ones_like, rand, randn,
                                         zeros, zeros_like)
from tinydist.frontend.jit import JitError, TinyJit, jit
from tinydist.frontend.movement import cat, stack
from tinydist.frontend.tensor import Tensor, manual_seed, synchronize, where
from tinydist.graph import dtypes
from tinydist.graph.dtypes import (
    DType, bool_, float16, float32, float64, int8, int16, int32, int64, uint8, uint16, uint32, uint64)
from tinydist.observability import trace
from tinydist.runtime import Buffer, Device, discover, get_engine, open_device
from tinydist.runtime.registry import register_scheme
from tinydist.schedule import ScheduleCycleError
from tinydist.train import data, nn, optim
from tinydist.train.serialization import load, save

# remote://host:port/KIND:N devices; the module (and gRPC) is imported only when one is opened
register_scheme("remote", "tinydist.runtime.remote.device:RemoteDevice")

__version__ = "0.1.0"

_LAZY = {"dist": "tinydist.dist", "onnx": "tinydist.onnx", "multi": "tinydist.multi",
         "parallel": "tinydist.dist.parallel", "remote": "tinydist.runtime.remote"}


def __getattr__(name: str) -> Any:
    if name == "bfloat16":  # registered on first use: ml_dtypes' import is heavier than numpy's
        return dtypes.bfloat16
    if name in _LAZY:
        module = import_module(_LAZY[name])
        globals()[name] = module
        return module
    raise AttributeError(f"module 'tinydist' has no attribute {name!r}")


__all__ = ["AllocationError", "Buffer", "BufferInUse", "ClosedResourceError", "CompileError", "DType", "Device",
           "DeviceError", "DeviceFailed", "DeviceHang", "WorkTooLarge", "DeviceNotFound", "DeviceUnavailable", "JitError",
           "OutOfBounds", "ScheduleCycleError", "Tensor", "TinyJit", "TinydistError", "UseAfterFree", "arange", "autograd",
           "bool_", "cat", "data", "discover", "dist", "empty", "empty_like", "enable_grad", "eye", "float16", "float32", "float64",
           "full", "full_like", "get_engine", "int8", "int16", "int32", "int64", "jit", "load", "manual_seed", "multi", "nn",
           "no_grad", "ones", "ones_like", "onnx", "open_device", "optim", "parallel", "rand", "randn", "remote", "save", "stack",
           "synchronize", "trace", "uint8", "uint16", "uint32", "uint64", "where", "zeros", "zeros_like"]
