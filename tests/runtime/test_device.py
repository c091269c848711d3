"""Device names, discovery, and the lifecycle state machine (open, failed, closed)."""

from __future__ import annotations

import ctypes.util

import anyio
import numpy as np
import pytest

from tinydist.base.config import settings
from tinydist.base.errors import ClosedResourceError, DeviceError, DeviceNotFound, DeviceUnavailable
from tinydist.runtime.device import DeviceState
from tinydist.runtime.registry import canonical_name, discover, open_device

from .helpers import HostMemory

pytestmark = pytest.mark.anyio


def _worker_threads(device: object) -> list[str]:
    """Names of the device's own worker threads that are still running."""
    return sorted(q.worker.name for q in device.queues.values() if q.worker is not None and q.worker.is_alive())


def test_unknown_kind_lists_available_devices() -> None:
    with pytest.raises(DeviceNotFound) as info:
        open_device("NOPE:0")
    assert isinstance(info.value, LookupError)
    assert "'NOPE'" in str(info.value) and "available devices:" in str(info.value)
    assert "CPU:0" in str(info.value)


def test_cpu_index_beyond_configured_count() -> None:
    with settings.override(CPU_DEVICES=2):
        with pytest.raises(DeviceNotFound, match=r"no device CPU:2; available devices: CPU:0, CPU:1$"):
            open_device("CPU:2")
        assert open_device("CPU:1").state is DeviceState.UNOPENED


def test_cuda_is_unavailable_and_says_why() -> None:
    with pytest.raises(DeviceUnavailable) as info:
        open_device("CUDA:0")
    message = str(info.value)
    assert "CUDA:0 cannot open here" in message and "CPU:0" in message
    if ctypes.util.find_library("cuda") is None:
        assert "no CUDA driver library" in message
    else:
        assert "not built yet" in message


def test_discover_reports_usable_and_unusable() -> None:
    with settings.override(CPU_DEVICES=3):
        infos = {info.name: info for info in discover()}
    assert [n for n in infos if n.startswith("CPU")] == ["CPU:0", "CPU:1", "CPU:2"]
    assert all(infos[f"CPU:{i}"].usable for i in range(3))
    assert not infos["CUDA"].usable and infos["CUDA"].detail


@pytest.mark.parametrize("name", ["", "CPU:", ":0", "CPU:-1", "CPU:0:1", "1CPU", "CPU 0", "CPU:x"])
def test_malformed_names(name: str) -> None:
    with pytest.raises(ValueError, match="malformed device name"):
        open_device(name)


def test_names_are_canonical() -> None:
    assert canonical_name("cpu") == "CPU:0"
    assert canonical_name(" CPU:01 ") == "CPU:1"
    with pytest.raises(TypeError):
        canonical_name(0)  # type: ignore[arg-type]


async def test_open_and_close_are_idempotent() -> None:
    dev = open_device("cpu:3")
    assert dev.name == "CPU:3" and dev.state is DeviceState.UNOPENED
    with pytest.raises(DeviceError, match="not open"):
        dev.batch()
    assert await dev.open() is dev
    queues = dict(dev.queues)
    assert await dev.open() is dev
    assert dev.queues == queues        # the second open made nothing new
    assert dev.state is DeviceState.OPEN
    assert sorted(_worker_threads(dev)) == ["tinydist:CPU:3/compute", "tinydist:CPU:3/copy"]
    await dev.aclose()
    await dev.aclose()
    assert dev.state is DeviceState.CLOSED
    assert _worker_threads(dev) == []
    with pytest.raises(ClosedResourceError, match="open a new one"):
        await dev.open()


async def test_closing_an_unopened_device() -> None:
    dev = open_device("CPU:3")
    await dev.aclose()
    assert dev.state is DeviceState.CLOSED
    with pytest.raises(ClosedResourceError):
        await dev.open()


async def test_use_after_close(kernels) -> None:
    async with open_device("CPU:3") as dev:
        buf = dev.allocator.alloc(64)
        alloc = dev.allocator
    attempts = {
        "batch": lambda: dev.batch(),
        "copy batch": lambda: dev.batch("copy"),
        "alloc": lambda: alloc.alloc(8),
        "from_blob": lambda: alloc.from_blob(4096, 8),
        "copyin": lambda: dev.copyin(alloc.alloc(64), np.zeros(64, np.uint8)),
        "load_program": lambda: dev.load_program(kernels.scale, "rt_scale_f32", ["w", "r", "f32", "i64"]),
        "submit": lambda: dev.queues["compute"].submit([]),
    }
    for label, attempt in attempts.items():
        with pytest.raises(ClosedResourceError):
            attempt()
            pytest.fail(label)
    with pytest.raises(ClosedResourceError):
        await dev.copyout(buf)
    with pytest.raises(ClosedResourceError):
        async with dev:
            pass
    assert dev.queues["copy"].last_submitted == 0


async def test_closing_frees_every_buffer_and_stops_workers(kernels, monkeypatch) -> None:
    dev = open_device("CPU:3")
    await dev.open()
    alloc = dev.allocator
    memory = HostMemory(alloc, monkeypatch)
    freed_early = alloc.alloc(512)
    freed_early.free()
    scale = dev.load_program(kernels.scale, "rt_scale_f32", ["w", "r", "f32", "i64"])
    x, y = alloc.alloc(4096), alloc.alloc(4096)
    view = y.view(0, 1024)
    extra = alloc.alloc_many([100, 200])
    dev.copyin(x, np.ones(1024, np.float32))
    with dev.batch() as batch:
        batch.launch(scale, view, x.view(0, 1024), 2.0, 256)
    assert alloc.statistics().live_buffers == 4
    with anyio.fail_after(20):
        await dev.aclose()
    assert batch.completion.done()          # submitted work finished before the memory went
    stats = alloc.statistics()
    assert (stats.live_buffers, stats.live_bytes, stats.reserved_bytes) == (0, 0, 0)
    assert alloc.outstanding() == {}
    assert all(b.freed for b in (x, y, view, *extra))
    assert len(memory.mapped) >= 4 and memory.all_returned()   # host memory went back, cached or not
    assert _worker_threads(dev) == []
    with pytest.raises(ClosedResourceError):
        alloc.alloc(8)


async def test_unknown_queue_is_a_value_error(cpu) -> None:
    with pytest.raises(ValueError, match="no queue 'dma'; queues: compute, copy"):
        cpu.batch("dma")


async def test_kernel_cannot_use_a_buffer_outside_its_peer_group(cpu, cpu1, kernels, monkeypatch) -> None:
    scale = cpu.load_program(kernels.scale, "rt_scale_f32", ["w", "r", "f32", "i64"])
    mine, theirs = cpu.allocator.alloc(64), cpu1.allocator.alloc(64)
    assert cpu.reads_directly(cpu1) and cpu1.reads_directly(cpu)  # CPU devices of one process: one memory
    monkeypatch.setattr(cpu1, "peer_group", None)  # as if CPU:1's memory were not the host's
    assert not cpu.reads_directly(cpu1)
    batch = cpu.batch()
    with pytest.raises(DeviceError, match="copy it to CPU:0 first"):
        batch.launch(scale, mine, theirs, 1.0, 16)
    with pytest.raises(TypeError, match="takes 4 arguments"):
        batch.launch(scale, mine, mine, 1.0)
    with pytest.raises(TypeError, match="argument 1 must be a Buffer"):
        batch.launch(scale, mine, np.zeros(16, np.float32), 1.0, 16)
    assert len(batch) == 0 and len(theirs.accesses) == 0


async def test_a_batch_submits_once(cpu) -> None:
    buf = cpu.allocator.alloc(16)
    with cpu.batch("copy") as batch:
        batch.write_from_host(buf, np.arange(16, dtype=np.uint8))
    with pytest.raises(RuntimeError, match="already submitted"):
        batch.submit()
    assert cpu.queues["copy"].last_submitted == 1


async def test_a_batch_that_raises_is_not_submitted(cpu) -> None:
    buf = cpu.allocator.alloc(16)
    with pytest.raises(KeyError):
        with cpu.batch("copy") as batch:
            batch.write_from_host(buf, np.arange(16, dtype=np.uint8))
            raise KeyError("user code failed")
    assert batch.completion is None and cpu.queues["copy"].last_submitted == 0
