"""Discovery messages, CUresult → named errors, and the device plumbing over a fake libcuda.

The fake driver is a Python object with the driver's function names; it stands in for what
`ctypes.CDLL("libcuda.so")` would return. It keeps "device memory" in host memory so copies can be
checked, and it reports every call, so the order of driver calls a batch makes is visible. It does
NOT prove anything about a real GPU: see docs/cuda.md.
"""

from __future__ import annotations

import ctypes

import anyio
import numpy as np
import pytest

import tinydist as td
from tinydist.base.errors import CompileError, DeviceUnavailable
from tinydist.graph import dtypes
from tinydist.runtime import registry
from tinydist.runtime.cuda import driver as cu

pytestmark = pytest.mark.timeout(30)


class FakeDriver:
    """A tiny libcuda: `init` / `count` / `fail` choose what it reports."""

    def __init__(self, init: int = 0, count: int = 1, module_error: int = 0) -> None:
        self.init, self.count, self.module_error = init, count, module_error
        self.calls: list[str] = []
        self.memory: dict[int, ctypes.Array] = {}
        self._handles = 0x1000

    def __getattr__(self, name: str):
        if not name.startswith("cu"):
            raise AttributeError(name)
        impl = getattr(type(self), "_" + name, None)

        def call(*args):
            self.calls.append(name)
            return impl(self, *args) if impl else 0
        return call

    @staticmethod
    def _set(ref, value) -> None:
        ref._obj.value = value

    def _handle(self) -> int:
        self._handles += 0x10
        return self._handles

    def _cuInit(self, flags):
        return self.init

    def _cuGetErrorName(self, code, out):
        name = cu.ERROR_NAMES.get(code)
        if name is None:
            return 1
        self._keep = ctypes.c_char_p(name.encode())
        out._obj.value = self._keep.value
        return 0

    def _cuDeviceGetCount(self, out):
        self._set(out, self.count)
        return 0

    def _cuDeviceGet(self, out, index):
        self._set(out, index)
        return 0

    def _cuDeviceGetName(self, buffer, size, device):
        ctypes.memmove(buffer, b"Fake H200\0", 10)
        return 0

    def _cuDeviceGetAttribute(self, out, attribute, device):
        values = {cu.ATTR_COMPUTE_CAPABILITY_MAJOR: 9, cu.ATTR_COMPUTE_CAPABILITY_MINOR: 0, cu.ATTR_MULTIPROCESSOR_COUNT: 132}
        self._set(out, values.get(attribute, 0))
        return 0

    def _cuDeviceTotalMem_v2(self, out, device):
        self._set(out, 1 << 30)
        return 0

    def _cuCtxCreate_v2(self, out, flags, device):
        self._set(out, self._handle())
        return 0

    def _cuStreamCreate(self, out, flags):
        self._set(out, self._handle())
        return 0

    def _cuMemAlloc_v2(self, out, nbytes):
        block = (ctypes.c_uint8 * nbytes)()
        self.memory[ctypes.addressof(block)] = block
        self._set(out, ctypes.addressof(block))
        return 0

    def _cuMemFree_v2(self, address):
        return 0 if self.memory.pop(address, None) is not None else 1

    def _copy(self, dst, src, nbytes, stream=None):
        ctypes.memmove(dst, src, nbytes)
        return 0

    _cuMemcpyHtoDAsync_v2 = _cuMemcpyDtoHAsync_v2 = _cuMemcpyDtoDAsync_v2 = _copy
    _cuMemcpyHtoD_v2 = _cuMemcpyDtoH_v2 = _cuMemcpyDtoD_v2 = _cuMemcpyAsync = _copy

    def _cuModuleLoadDataEx(self, out, image, n, options, values):
        if self.module_error:
            log = b"ptxas fatal   : Unresolved extern function 'fmodf'"
            ctypes.memmove(values[2], log + b"\0", len(log) + 1)
            return self.module_error
        self._set(out, self._handle())
        return 0

    def _cuModuleGetFunction(self, out, module, name):
        self._set(out, self._handle())
        return 0


@pytest.fixture
def fake(monkeypatch):
    def install(**kwargs) -> FakeDriver:
        lib = FakeDriver(**kwargs)
        monkeypatch.setattr(cu, "_library_path", lambda: "/fake/libcuda.so.1")
        monkeypatch.setattr(cu, "_open_library", lambda path: lib)
        cu.reset()
        return lib
    yield install
    cu.reset()


def cuda_infos():
    return [info for info in registry.discover() if info.name.startswith("CUDA")]


def test_no_driver_library_is_the_reason(monkeypatch):
    monkeypatch.setattr(cu, "_library_path", lambda: None)
    cu.reset()
    assert [(i.name, i.usable, i.detail) for i in cuda_infos()] == [
        ("CUDA", False, "no CUDA driver library (libcuda.so) on this machine")]
    with pytest.raises(DeviceUnavailable, match="no CUDA driver library"):
        td.open_device("CUDA:0")


def test_unloadable_library_is_the_reason(monkeypatch):
    monkeypatch.setattr(cu, "_library_path", lambda: "/fake/libcuda.so.1")

    def refuse(path):
        raise OSError("cannot open shared object file")
    monkeypatch.setattr(cu, "_open_library", refuse)
    cu.reset()
    (info,) = cuda_infos()
    assert not info.usable and "cannot be loaded" in info.detail and "/fake/libcuda.so.1" in info.detail
    cu.reset()


def test_cuinit_failure_names_the_error(fake):
    fake(init=100)
    (info,) = cuda_infos()
    assert info.detail == "cuInit failed with CUDA_ERROR_NO_DEVICE (100) using /fake/libcuda.so.1"
    with pytest.raises(DeviceUnavailable, match="CUDA_ERROR_NO_DEVICE"):
        td.open_device("CUDA:0")


def test_cuinit_failure_with_insufficient_driver(fake):
    fake(init=35)
    (info,) = cuda_infos()
    assert "CUDA_ERROR_INSUFFICIENT_DRIVER (35)" in info.detail


def test_zero_devices(fake):
    fake(count=0)
    (info,) = cuda_infos()
    assert (info.name, info.usable) == ("CUDA", False)
    assert "zero devices" in info.detail
    with pytest.raises(DeviceUnavailable, match="zero devices"):
        td.open_device("CUDA:0")


def test_devices_listed_with_name_and_capability(fake):
    fake(count=2)
    infos = cuda_infos()
    assert [i.name for i in infos] == ["CUDA:0", "CUDA:1"]
    assert all(i.usable and "Fake H200, compute capability 9.0" in i.detail for i in infos)
    with pytest.raises(td.DeviceNotFound):
        td.open_device("CUDA:5")


def test_error_mapping_uses_the_driver_name_or_the_table(fake):
    drv = cu.Driver(fake())
    err = drv.error("cuMemAlloc_v2", 2)
    assert isinstance(err, td.DeviceError)
    assert (err.call, err.code, err.name) == ("cuMemAlloc_v2", 2, "CUDA_ERROR_OUT_OF_MEMORY")
    assert str(err).startswith("cuMemAlloc_v2 failed with CUDA_ERROR_OUT_OF_MEMORY (2)")
    assert drv.error("cuLaunchKernel", 700).sticky and not err.sticky
    assert drv.error_name(12345) == "CUresult 12345"  # unknown to the driver and to the table
    assert cu.error_name(218) == "CUDA_ERROR_INVALID_PTX"
    missing = cu.Driver(object())
    with pytest.raises(cu.CUDAError, match="SYMBOL_NOT_FOUND"):
        missing.call("cuInit", 0)


@pytest.mark.parametrize("code,name", [(1, "CUDA_ERROR_INVALID_VALUE"), (201, "CUDA_ERROR_INVALID_CONTEXT"),
                                       (222, "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"), (719, "CUDA_ERROR_LAUNCH_FAILED")])
def test_every_failed_call_raises_its_named_error(fake, code, name):
    lib = fake()
    lib._cuStreamSynchronize = lambda self, stream: code
    FakeDriver._cuStreamSynchronize = lambda self, stream: code
    try:
        with pytest.raises(cu.CUDAError, match=name):
            cu.load().call("cuStreamSynchronize", 0)
    finally:
        del FakeDriver._cuStreamSynchronize


def test_device_plumbing_over_the_fake_driver(fake):
    """Open, allocate, copy in/out, launch, close — the driver calls a batch makes, in order."""
    lib = fake()

    async def main():
        async with td.open_device("CUDA:0") as dev:
            assert dev.arch == "sm_90" and dev.sm_count == 132
            buf = dev.allocator.alloc(16)
            await dev.copyin(buf, np.arange(4, dtype=np.float32)).wait(5)
            lib.calls.clear()
            out = (await dev.copyout(buf)).view(np.float32)
            assert out.tolist() == [0.0, 1.0, 2.0, 3.0]
            assert lib.calls == ["cuCtxSetCurrent", "cuMemcpyDtoHAsync_v2", "cuStreamSynchronize"]
            program = dev.compiler.matmul(dtypes.float32)
            lib.calls.clear()
            with dev.batch() as batch:
                batch.launch(program, buf, buf, buf, buf, 1, 2, 2, 2, 0, 0, 0)
            await batch.completion.wait(5)
            assert lib.calls == ["cuCtxSetCurrent", "cuLaunchKernel", "cuStreamSynchronize"]
            buf.free()
        assert "cuCtxDestroy_v2" in lib.calls and not lib.memory
    anyio.run(main)


def test_jit_log_is_surfaced_verbatim(fake):
    fake(module_error=218)

    async def main():
        async with td.open_device("CUDA:0") as dev:
            with pytest.raises(CompileError) as info:
                dev.compiler.matmul(dtypes.float64)
            assert "CUDA_ERROR_INVALID_PTX (218)" in str(info.value)
            assert "ptxas fatal   : Unresolved extern function 'fmodf'" in str(info.value)
    anyio.run(main)


def test_cpu_copies_are_unchanged():
    """The generic copy hook: a CPU device still copies with memmove in every direction."""
    dev = td.get_engine().device("CPU:0")
    assert dev.copy_command("h2d") is dev.host_copy()
    assert dev.copy_command("d2h") is dev.host_copy()
    assert dev.copy_command("d2d", td.get_engine().device("CPU:1")) is dev.host_copy()
