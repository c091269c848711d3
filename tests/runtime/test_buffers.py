"""Buffers and views: bounds checked before memory is touched, frees checked, memory given back late."""

from __future__ import annotations

import gc
import weakref

import anyio
import numpy as np
import pytest

from tinydist.base.errors import BufferInUse, BufferError_, OutOfBounds, UseAfterFree
from tinydist.runtime.command_queue import CommandQueue
from tinydist.runtime.device import Device

from tinydist.testing import MockClock

from .helpers import Gate, Kernels, armed

pytestmark = pytest.mark.anyio


async def _complete_after(queue: CommandQueue, value: int, gate: Gate, clock: MockClock) -> None:
    """Open `gate` once a waiter for `value` is registered (its deadline armed on `clock`, the
    device's), and return when the wait finishes."""
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(queue.timeline.wait, value, 20)
            await armed(clock, 1)
            assert queue.timeline.statistics().async_waiters == 1 and not queue.timeline.reached(value)
            gate.open()


# ---- views -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("offset", "nbytes"), [(-1, 4), (0, -1), (0, 65), (60, 8), (65, 0), (64, 1), (2**63, 2**63)])
async def test_view_outside_base_is_refused(cpu: Device, offset: int, nbytes: int) -> None:
    base = cpu.allocator.alloc(64)
    with pytest.raises(OutOfBounds) as info:
        base.view(offset, nbytes)
    assert isinstance(info.value, IndexError) and isinstance(info.value, BufferError_)
    assert f"[{offset}, {offset}+{nbytes})" in str(info.value) and "64" in str(info.value)
    # nothing was made: the base is as usable as before
    assert base.live_views() == []
    view = base.view(8, 16)
    assert view.address == base.address + 8
    with anyio.fail_after(20):
        await cpu.copyin(view, np.arange(16, dtype=np.uint8)).wait(20)
        out = await cpu.copyout(base, timeout=20)
    np.testing.assert_array_equal(out[8:24], np.arange(16, dtype=np.uint8))


async def test_view_edges_are_allowed(cpu: Device) -> None:
    base = cpu.allocator.alloc(64)
    whole = base.view(0, 64)
    empty_end = base.view(64, 0)
    assert (whole.offset, whole.nbytes) == (0, 64)
    assert empty_end.address == base.address + 64 and empty_end.nbytes == 0
    assert whole.is_view and whole.base is base and not base.is_view


async def test_view_of_view_is_bounded_by_its_parent(cpu: Device) -> None:
    base = cpu.allocator.alloc(128)
    parent = base.view(32, 32)
    with pytest.raises(OutOfBounds):
        parent.view(0, 33)          # the base has room, the parent does not
    with pytest.raises(OutOfBounds):
        parent.view(24, 16)
    with pytest.raises(OutOfBounds):
        parent.view(-8, 8)          # cannot reach back before the parent
    child = parent.view(8, 24)
    assert child.base is base       # views always hang off the base
    assert child.offset == 40 and child.nbytes == 24
    assert child.address == base.address + 40
    assert set(base.live_views()) == {parent, child}


async def test_view_arguments_must_be_ints(cpu: Device) -> None:
    base = cpu.allocator.alloc(64)
    with pytest.raises(TypeError):
        base.view(1.0, 4)
    with pytest.raises(TypeError):
        base.view(0, "4")
    assert base.live_views() == []


async def test_transfers_are_bounds_checked_before_anything_is_queued(cpu: Device) -> None:
    a, b = cpu.allocator.alloc(64), cpu.allocator.alloc(32)
    with cpu.batch("copy") as batch:
        with pytest.raises(OutOfBounds, match="size mismatch"):
            batch.copy(a, b)
        with pytest.raises(OutOfBounds, match="copyin size mismatch"):
            batch.write_from_host(b, np.zeros(33, np.uint8))
        with pytest.raises(OutOfBounds, match="copyout size mismatch"):
            batch.read_to_host(np.zeros(31, np.uint8), b)
        assert len(batch) == 0
    assert len(a.accesses) == 0 and len(b.accesses) == 0


# ---- freeing -----------------------------------------------------------------------------------


async def test_free_with_live_views_is_refused(cpu: Device) -> None:
    alloc = cpu.allocator
    base = alloc.alloc(256)
    v1, v2 = base.view(0, 16), base.view(16, 16)
    with pytest.raises(BufferInUse, match=r"2 live view\(s\)"):
        base.free()
    # refused: nothing changed
    assert not base.freed
    assert alloc.statistics().live_buffers == 1 and alloc.statistics().live_bytes == 256
    assert base.address in alloc.outstanding()
    with anyio.fail_after(20):
        await cpu.copyin(v1, np.full(16, 7, np.uint8)).wait(20)
    v1.release()
    v1.release()  # idempotent
    with pytest.raises(BufferInUse, match=r"1 live view\(s\)"):
        base.free()
    v2.release()
    base.free()
    assert base.freed
    with anyio.fail_after(20):
        await cpu.synchronize(20)
    assert alloc.statistics().live_buffers == 0 and alloc.outstanding() == {}


async def test_released_views_are_unusable(cpu: Device) -> None:
    base = cpu.allocator.alloc(64)
    view = base.view(0, 8)
    view.release()
    with pytest.raises(UseAfterFree):
        _ = view.address
    with pytest.raises(UseAfterFree):
        view.view(0, 4)
    with pytest.raises(UseAfterFree):
        cpu.copyin(view, np.zeros(8, np.uint8))
    assert base.address  # the base is unaffected


async def test_free_and_release_are_not_interchangeable(cpu: Device) -> None:
    base = cpu.allocator.alloc(64)
    view = base.view(0, 8)
    with pytest.raises(TypeError, match="release"):
        view.free()
    with pytest.raises(TypeError, match="free"):
        base.release()
    assert not view.freed and not base.freed


async def test_double_free_and_use_after_free(cpu: Device) -> None:
    alloc = cpu.allocator
    base = alloc.alloc(64)
    base.free()
    with pytest.raises(UseAfterFree, match="double free"):
        base.free()
    with pytest.raises(UseAfterFree):
        _ = base.address
    with pytest.raises(UseAfterFree):
        base.view(0, 8)
    with pytest.raises(UseAfterFree):
        cpu.copyin(base, np.zeros(64, np.uint8))
    with pytest.raises(UseAfterFree):
        await cpu.copyout(base)
    assert alloc.statistics().live_buffers == 0
    assert cpu.queues["copy"].last_submitted == 0  # refused requests queued nothing


async def test_free_while_a_kernel_is_in_flight_defers_give_back(cpu: Device, kernels: Kernels, gate, clock: MockClock) -> None:
    alloc = cpu.allocator
    scale = cpu.load_program(kernels.scale, "rt_scale_f32", ["w", "r", "f32", "i64"])
    x, y = alloc.alloc(4096), alloc.alloc(4096)
    y_address = y.address
    stall = gate()
    compute = cpu.queues["compute"]
    compute.submit([stall.command])
    with cpu.batch() as batch:
        batch.launch(scale, y, x, 2.0, 1024)
    y.free()
    assert y.freed
    with pytest.raises(UseAfterFree):
        _ = y.address   # no new use is accepted...
    stats = alloc.statistics()
    assert stats.live_buffers == 2 and stats.live_bytes == 8192 and stats.reserved_bytes == 8192
    assert y_address in alloc.outstanding()  # ...but the memory is still there for the kernel
    await _complete_after(compute, batch.completion.value, stall, clock)
    stats = alloc.statistics()
    assert stats.live_buffers == 1 and stats.live_bytes == 4096 and stats.reserved_bytes == 4096
    assert y_address not in alloc.outstanding()


async def test_garbage_collected_bases_give_memory_back(cpu: Device) -> None:
    alloc = cpu.allocator
    a = alloc.alloc(1000)
    views = [a.view(i, 1) for i in range(3)]
    ref = weakref.ref(a)
    del a, views
    gc.collect()
    assert ref() is None
    assert alloc.statistics().live_buffers == 0 and alloc.statistics().reserved_bytes == 0
    assert alloc.outstanding() == {}


async def test_garbage_collected_base_in_flight_waits_for_the_work(cpu: Device, kernels: Kernels, gate, clock: MockClock) -> None:
    alloc = cpu.allocator
    scale = cpu.load_program(kernels.scale, "rt_scale_f32", ["w", "r", "f32", "i64"])
    x, y = alloc.alloc(4096), alloc.alloc(4096)
    stall = gate()
    compute = cpu.queues["compute"]
    compute.submit([stall.command])
    with cpu.batch() as batch:
        batch.launch(scale, y, x, 2.0, 1024)
    del y
    gc.collect()
    assert alloc.statistics().live_buffers == 2
    await _complete_after(compute, batch.completion.value, stall, clock)
    assert alloc.statistics().live_buffers == 1 and alloc.statistics().live_bytes == 4096


# ---- external memory ---------------------------------------------------------------------------


async def test_from_blob_memory_is_used_in_place_and_never_freed(cpu: Device, kernels: Kernels, monkeypatch) -> None:
    alloc = cpu.allocator
    unmapped: list[int] = []
    real_unmap = alloc._unmap
    monkeypatch.setattr(alloc, "_unmap", lambda address, nbytes: (unmapped.append(address), real_unmap(address, nbytes)))
    scale = cpu.load_program(kernels.scale, "rt_scale_f32", ["w", "r", "f32", "i64"])
    host = np.zeros(64, np.float32)
    blob = alloc.from_blob(host.ctypes.data, host.nbytes, owner=host)
    assert blob.external and blob.address == host.ctypes.data
    assert alloc.outstanding() == {} and alloc.statistics().live_buffers == 0
    x = alloc.alloc(256)
    data = np.arange(64, dtype=np.float32)
    cpu.copyin(x, data)
    with cpu.batch() as batch:
        batch.launch(scale, blob, x, 3.0, 64)
    with anyio.fail_after(20):
        await batch.completion.wait(20)
    np.testing.assert_array_equal(host, 3.0 * data)   # the kernel wrote the caller's memory
    blob.free()
    with anyio.fail_after(20):
        await cpu.synchronize(20)
    assert host.ctypes.data not in unmapped
    host[:] = 5.0   # still the caller's, still valid
    assert alloc.statistics().live_buffers == 1 and list(alloc.outstanding().values()) == [256]


async def test_from_blob_owner_lives_until_free_and_last_use(cpu: Device, kernels: Kernels, gate, clock: MockClock) -> None:
    alloc = cpu.allocator
    scale = cpu.load_program(kernels.scale, "rt_scale_f32", ["w", "r", "f32", "i64"])
    host = np.zeros(256, np.float32)
    owner = weakref.ref(host)
    blob = alloc.from_blob(host.ctypes.data, host.nbytes, owner=host)
    del host
    gc.collect()
    assert owner() is not None   # the buffer keeps it
    x = alloc.alloc(1024)
    stall = gate()
    compute = cpu.queues["compute"]
    compute.submit([stall.command])
    with cpu.batch() as batch:
        batch.launch(scale, blob, x, 1.0, 256)
    blob.free()
    del blob
    gc.collect()
    assert owner() is not None   # a kernel still writes into it
    await _complete_after(compute, batch.completion.value, stall, clock)
    gc.collect()
    assert owner() is None       # freed and no longer used: released
    assert alloc.outstanding().keys() == {x.address}


async def test_from_blob_rejects_bad_arguments(cpu: Device) -> None:
    with pytest.raises(ValueError, match="positive address and size"):
        cpu.allocator.from_blob(0, 64)
    with pytest.raises(ValueError, match="positive address and size"):
        cpu.allocator.from_blob(4096, 0)
