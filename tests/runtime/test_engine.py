"""The sync facade: one background event loop that scripts drive without `async`."""

from __future__ import annotations


import numpy as np
import pytest

from tinydist.base.errors import ClosedResourceError
from tinydist.runtime.device import DeviceState
from tinydist.runtime.engine import Engine


@pytest.fixture
def engine():
    eng = Engine()
    try:
        yield eng
    finally:
        eng.close()


def test_device_opened_once_and_runs_async_functions(engine: Engine) -> None:
    dev = engine.device("CPU:2")
    assert dev.state is DeviceState.OPEN
    assert engine.device("CPU:2") is dev
    assert engine.device("cpu:2") is dev     # same device under any spelling of its name
    assert engine.open_devices() == [dev]
    buf = dev.allocator.alloc(256)
    data = np.arange(64, dtype=np.float32) * 1.5
    dev.copyin(buf, data)
    out = engine.run(dev.copyout, buf)
    np.testing.assert_array_equal(out.view(np.float32), data)


def test_reopen_closes_a_failed_device_and_opens_a_fresh_one_in_its_place(engine: Engine) -> None:
    from tinydist.base.errors import DeviceFailed

    failed = engine.device("CPU:2")
    failed.allocator.alloc(64)
    failed.mark_failed(DeviceFailed("test: broken"))
    with pytest.raises(DeviceFailed, match="test: broken"):
        failed.batch()
    fresh = engine.reopen("cpu:2")
    assert fresh is not failed and fresh.state is DeviceState.OPEN and failed.state is DeviceState.CLOSED
    assert engine.device("CPU:2") is fresh and engine.open_devices() == [fresh]
    buf = fresh.allocator.alloc(16)
    fresh.copyin(buf, np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(engine.run(fresh.copyout, buf).view(np.float32), np.arange(4, dtype=np.float32))
    assert engine.reopen("CPU:3").state is DeviceState.OPEN  # one never opened is simply opened


def test_close_closes_devices_and_is_idempotent() -> None:
    engine = Engine()
    dev = engine.device("CPU:2")
    other = engine.device("CPU:3")
    buf = dev.allocator.alloc(64)
    engine.close()
    assert dev.state is DeviceState.CLOSED and other.state is DeviceState.CLOSED
    assert buf.freed and dev.allocator.statistics().live_buffers == 0
    assert not [q.worker for d in (dev, other) for q in d.queues.values() if q.worker.is_alive()]
    engine.close()
    with pytest.raises(ClosedResourceError, match="engine is closed"):
        engine.run(dev.copyout, buf)
    with pytest.raises(ClosedResourceError):
        engine.device("CPU:1")
    assert engine.open_devices() == []


def test_engine_surfaces_errors_from_the_loop(engine: Engine) -> None:
    with pytest.raises(ValueError, match="malformed device name"):
        engine.device("CPU:")
    dev = engine.device("CPU:2")
    buf = dev.allocator.alloc(8)
    with pytest.raises(ValueError, match="C-contiguous"):
        engine.run(dev.copyout, buf, np.zeros(16, np.uint8)[::2])
