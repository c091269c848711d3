"""ctypes bindings to the CUDA driver API (libcuda), every CUresult checked.

Only the driver is used (no runtime library, no libdevice, no nvrtc): PTX comes from
`tinydist.codegen.ptx` and is JIT-compiled by the driver (`cuModuleLoadDataEx`). Symbols are the
versioned ones the `cuda.h` macros resolve to (`cuMemAlloc` → `cuMemAlloc_v2`, …), choosing the
forms every driver since CUDA 4 exports (`cuCtxCreate_v2`, not CUDA 13's `_v4`; the legacy-stream
`cuMemcpyHtoDAsync_v2`, not the per-thread `_ptsz` variants: tinydist always passes its own stream).

A failed call raises `CUDAError` naming the call and the error (`cuGetErrorName`, or this module's
table when the driver cannot say). Errors after which the context is unusable ("sticky": an
illegal address, a launch failure …) are flagged, and the device layer marks the device failed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from ctypes import POINTER, c_char_p, c_float, c_int, c_size_t, c_uint, c_uint64, c_void_p
from typing import Any

from tinydist.base.errors import DeviceError, TinydistError

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704

# CUresult names for the codes tinydist can meet, from cuda.h; used when cuGetErrorName is not
# available (no driver loaded) or does not know the code.
ERROR_NAMES: dict[int, str] = {
    0: "CUDA_SUCCESS", 1: "CUDA_ERROR_INVALID_VALUE", 2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED", 4: "CUDA_ERROR_DEINITIALIZED", 34: "CUDA_ERROR_STUB_LIBRARY",
    35: "CUDA_ERROR_INSUFFICIENT_DRIVER", 46: "CUDA_ERROR_DEVICE_UNAVAILABLE", 100: "CUDA_ERROR_NO_DEVICE",
    101: "CUDA_ERROR_INVALID_DEVICE", 200: "CUDA_ERROR_INVALID_IMAGE", 201: "CUDA_ERROR_INVALID_CONTEXT",
    209: "CUDA_ERROR_NO_BINARY_FOR_GPU", 217: "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED", 218: "CUDA_ERROR_INVALID_PTX",
    221: "CUDA_ERROR_JIT_COMPILER_NOT_FOUND", 222: "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
    400: "CUDA_ERROR_INVALID_HANDLE", 500: "CUDA_ERROR_NOT_FOUND", 600: "CUDA_ERROR_NOT_READY",
    700: "CUDA_ERROR_ILLEGAL_ADDRESS", 701: "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", 702: "CUDA_ERROR_LAUNCH_TIMEOUT",
    704: "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED", 705: "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED",
    714: "CUDA_ERROR_HARDWARE_STACK_ERROR", 715: "CUDA_ERROR_ILLEGAL_INSTRUCTION", 716: "CUDA_ERROR_MISALIGNED_ADDRESS",
    717: "CUDA_ERROR_INVALID_ADDRESS_SPACE", 718: "CUDA_ERROR_INVALID_PC", 719: "CUDA_ERROR_LAUNCH_FAILED",
    802: "CUDA_ERROR_SYSTEM_NOT_READY", 803: "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
    804: "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE", 999: "CUDA_ERROR_UNKNOWN",
}
# Errors that leave the context unusable: every later call fails too.
STICKY = frozenset({700, 714, 715, 716, 717, 718, 719})

# CUdevice_attribute / CUjit_option / flags (cuda.h)
ATTR_MULTIPROCESSOR_COUNT = 16
ATTR_MEMORY_CLOCK_RATE = 36          # kHz
ATTR_GLOBAL_MEMORY_BUS_WIDTH = 37    # bits
ATTR_UNIFIED_ADDRESSING = 41
ATTR_COMPUTE_CAPABILITY_MAJOR = 75
ATTR_COMPUTE_CAPABILITY_MINOR = 76
JIT_INFO_LOG_BUFFER = 3
JIT_INFO_LOG_BUFFER_SIZE_BYTES = 4
JIT_ERROR_LOG_BUFFER = 5
JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 6
JIT_LOG_VERBOSE = 12
STREAM_NON_BLOCKING = 0x1
EVENT_BLOCKING_SYNC = 0x1
EVENT_DISABLE_TIMING = 0x2

_P = POINTER
# name -> argtypes; CUdevice is int, CUdeviceptr unsigned long long, handles void*
SIGNATURES: dict[str, list[Any]] = {
    "cuInit": [c_uint],
    "cuDriverGetVersion": [_P(c_int)],
    "cuGetErrorName": [c_int, _P(c_char_p)],
    "cuGetErrorString": [c_int, _P(c_char_p)],
    "cuDeviceGetCount": [_P(c_int)],
    "cuDeviceGet": [_P(c_int), c_int],
    "cuDeviceGetName": [c_char_p, c_int, c_int],
    "cuDeviceGetAttribute": [_P(c_int), c_int, c_int],
    "cuDeviceTotalMem_v2": [_P(c_size_t), c_int],
    "cuDeviceCanAccessPeer": [_P(c_int), c_int, c_int],
    "cuCtxCreate_v2": [_P(c_void_p), c_uint, c_int],
    "cuCtxDestroy_v2": [c_void_p],
    "cuCtxSetCurrent": [c_void_p],
    "cuCtxEnablePeerAccess": [c_void_p, c_uint],
    "cuMemAlloc_v2": [_P(c_uint64), c_size_t],
    "cuMemFree_v2": [c_uint64],
    "cuMemcpyHtoD_v2": [c_uint64, c_void_p, c_size_t],
    "cuMemcpyDtoH_v2": [c_void_p, c_uint64, c_size_t],
    "cuMemcpyDtoD_v2": [c_uint64, c_uint64, c_size_t],
    "cuMemcpyHtoDAsync_v2": [c_uint64, c_void_p, c_size_t, c_void_p],
    "cuMemcpyDtoHAsync_v2": [c_void_p, c_uint64, c_size_t, c_void_p],
    "cuMemcpyDtoDAsync_v2": [c_uint64, c_uint64, c_size_t, c_void_p],
    "cuMemcpyAsync": [c_uint64, c_uint64, c_size_t, c_void_p],
    "cuMemcpyPeerAsync": [c_uint64, c_void_p, c_uint64, c_void_p, c_size_t, c_void_p],
    "cuStreamCreate": [_P(c_void_p), c_uint],
    "cuStreamDestroy_v2": [c_void_p],
    "cuStreamSynchronize": [c_void_p],
    "cuEventCreate": [_P(c_void_p), c_uint],
    "cuEventDestroy_v2": [c_void_p],
    "cuEventRecord": [c_void_p, c_void_p],
    "cuEventSynchronize": [c_void_p],
    "cuEventQuery": [c_void_p],
    "cuEventElapsedTime": [_P(c_float), c_void_p, c_void_p],
    "cuModuleLoadDataEx": [_P(c_void_p), c_char_p, c_uint, _P(c_int), _P(c_void_p)],
    "cuModuleUnload": [c_void_p],
    "cuModuleGetFunction": [_P(c_void_p), c_void_p, c_char_p],
    "cuLaunchKernel": [c_void_p, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_void_p,
                       _P(c_void_p), _P(c_void_p)],
}


class CUDAError(DeviceError):
    """A CUDA driver call failed: `code` (CUresult), `name` ("CUDA_ERROR_…"), `call`."""

    def __init__(self, call: str, code: int, name: str, description: str = "") -> None:
        self.call, self.code, self.name = call, code, name
        self.sticky = code in STICKY
        detail = f": {description}" if description and description != name else ""
        super().__init__(f"{call} failed with {name} ({code}){detail}")


def _library_path() -> str | None:
    return ctypes.util.find_library("cuda")


def _open_library(path: str) -> Any:
    """dlopen libcuda (a seam: tests replace it with a fake driver)."""
    return ctypes.CDLL(path)


class Driver:
    """The loaded driver library with argument types set; `call(name, *args)` checks the result."""

    def __init__(self, lib: Any, path: str = "libcuda") -> None:
        self.lib, self.path = lib, path
        self._fns: dict[str, Any] = {}
        for name, argtypes in SIGNATURES.items():
            try:
                fn = getattr(lib, name)
            except AttributeError:
                continue  # checked when called: an old driver lacks a symbol
            try:
                fn.argtypes, fn.restype = argtypes, c_int
            except (AttributeError, TypeError):
                pass  # a Python stand-in
            self._fns[name] = fn

    def raw(self, name: str, *args: Any) -> int:
        fn = self._fns.get(name)
        if fn is None:
            raise CUDAError(name, -1, "SYMBOL_NOT_FOUND", f"the driver library {self.path} has no {name}")
        return int(fn(*args))

    def call(self, name: str, *args: Any) -> None:
        code = self.raw(name, *args)
        if code != CUDA_SUCCESS:
            raise self.error(name, code)

    def error(self, call: str, code: int) -> CUDAError:
        return CUDAError(call, code, self.error_name(code), self._error_string(code))

    def error_name(self, code: int) -> str:
        return self._query("cuGetErrorName", code) or ERROR_NAMES.get(code, f"CUresult {code}")

    def _error_string(self, code: int) -> str:
        return self._query("cuGetErrorString", code) or ""

    def _query(self, name: str, code: int) -> str | None:
        fn = self._fns.get(name)
        if fn is None:
            return None
        text = c_char_p()
        try:
            if fn(code, ctypes.byref(text)) != CUDA_SUCCESS or not text.value:
                return None
        except Exception:  # noqa: BLE001 - naming an error must never raise another
            return None
        return text.value.decode(errors="replace")

    # ---- small typed helpers ---------------------------------------------------------------

    def out_int(self, name: str, *args: Any) -> int:
        value = c_int()
        self.call(name, ctypes.byref(value), *args)
        return value.value

    def out_pointer(self, name: str, *args: Any) -> int:
        value = c_void_p()
        self.call(name, ctypes.byref(value), *args)
        return value.value or 0

    def device_name(self, device: int) -> str:
        buffer = ctypes.create_string_buffer(256)
        self.call("cuDeviceGetName", buffer, 256, device)
        return buffer.value.decode(errors="replace")

    def attribute(self, attribute: int, device: int) -> int:
        return self.out_int("cuDeviceGetAttribute", attribute, device)


def error_name(code: int) -> str:
    """The CUresult's name from the table (no driver needed)."""
    return ERROR_NAMES.get(code, f"CUresult {code}")


_driver: Driver | None = None
_driver_lock = threading.Lock()


class DriverUnavailable(TinydistError):
    """Why there is no usable driver here (the message is shown by `tinydist devices`)."""


def load() -> Driver:
    """The initialised driver (cuInit done), or DriverUnavailable saying why not."""
    global _driver
    with _driver_lock:
        if _driver is not None:
            return _driver
        path = _library_path()
        if path is None:
            raise DriverUnavailable("no CUDA driver library (libcuda.so) on this machine")
        try:
            lib = _open_library(path)
        except OSError as exc:
            raise DriverUnavailable(f"the CUDA driver library {path} cannot be loaded: {exc}") from exc
        driver = Driver(lib, path)
        try:
            driver.call("cuInit", 0)
        except CUDAError as exc:
            raise DriverUnavailable(f"cuInit failed with {exc.name} ({exc.code}) using {path}") from exc
        _driver = driver
        return driver


def reset() -> None:
    """Forget the loaded driver (tests that swap the loader)."""
    global _driver
    with _driver_lock:
        _driver = None
