"""Allocators take memory in undoable steps; any failure half way gives back everything taken."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from tinydist.base.config import settings
from tinydist.base.errors import AllocationError
from tinydist.runtime.device import Device
from tinydist.runtime.faults import InjectedFault, faults
from tinydist.runtime.registry import open_device

from .helpers import HostMemory

pytestmark = pytest.mark.anyio


def _assert_nothing_held(device: Device) -> None:
    stats = device.allocator.statistics()
    assert (stats.live_buffers, stats.live_bytes, stats.reserved_bytes) == (0, 0, 0)
    assert device.allocator.outstanding() == {}


@pytest.fixture
async def device_and_memory(monkeypatch):
    """An open CPU:1 whose host memory traffic is recorded; closed by the test or at teardown."""
    dev = open_device("CPU:1")
    await dev.open()
    try:
        yield dev, HostMemory(dev.allocator, monkeypatch)
    finally:
        await dev.aclose()


@pytest.mark.parametrize(("point", "maps"), [
    ("alloc.reserve", 0),
    ("alloc.map", 0),
    ("cpu.posix_memalign", 0),
    ("alloc.register", 1),
])
async def test_each_step_rolls_back(device_and_memory, point: str, maps: int) -> None:
    dev, memory = device_and_memory
    size = 12345
    with faults.inject(point):
        with pytest.raises(AllocationError) as info:
            dev.allocator.alloc(size)
        assert faults.hits[point] == 1
    error = info.value
    assert isinstance(error, MemoryError)
    assert isinstance(error.__cause__, InjectedFault)
    assert "CPU:1" in str(error) and str(size) in str(error) and point in str(error)
    assert "nothing was kept" in str(error)
    _assert_nothing_held(dev)
    assert len(memory.mapped) == maps
    assert memory.all_returned()    # a block mapped before the failing step went straight back
    # the allocator works normally afterwards
    buf = dev.allocator.alloc(size)
    assert dev.allocator.statistics().live_bytes == size
    buf.free()
    _assert_nothing_held(dev)
    await dev.aclose()
    assert memory.all_returned()


@pytest.mark.parametrize("point", ["alloc.reserve", "alloc.map", "cpu.posix_memalign", "alloc.register"])
async def test_alloc_many_is_all_or_nothing(device_and_memory, point: str) -> None:
    dev, memory = device_and_memory
    with faults.inject(point, after=2):   # the third buffer fails
        with pytest.raises(AllocationError) as info:
            dev.allocator.alloc_many([100, 200, 300, 400])
        assert faults.hits[point] == 3
    assert "300 bytes" in str(info.value)
    _assert_nothing_held(dev)
    assert sorted(n for _, n in memory.mapped) == ([100, 200, 300] if point == "alloc.register" else [100, 200])
    assert len(dev.allocator.alloc_many([1, 2, 3])) == 3
    await dev.aclose()
    _assert_nothing_held(dev)
    assert memory.all_returned()    # every block taken on the way went back to the host


async def test_alloc_many_success(cpu: Device) -> None:
    bufs = cpu.allocator.alloc_many([64, 128, 256])
    assert [b.nbytes for b in bufs] == [64, 128, 256]
    assert len({b.address for b in bufs}) == 3
    assert all(b.address % 64 == 0 for b in bufs)   # cache-line / AVX-512 aligned
    stats = cpu.allocator.statistics()
    assert (stats.live_buffers, stats.live_bytes, stats.reserved_bytes) == (3, 448, 448)
    assert sorted(cpu.allocator.outstanding().values()) == [64, 128, 256]


async def test_memory_limit() -> None:
    with settings.override(CPU_MEMORY_LIMIT=4096):
        dev = open_device("CPU:1")
        await dev.open()
    try:
        alloc = dev.allocator
        assert alloc.statistics().limit_bytes == 4096
        first = alloc.alloc(3000)
        with pytest.raises(AllocationError, match=r"out of memory allocating 2000 bytes: 3000 of 4096") as info:
            alloc.alloc(2000)
        assert "CPU:1" in str(info.value) and "TINYDIST_CPU_MEMORY_LIMIT" in str(info.value)
        stats = alloc.statistics()
        assert (stats.live_buffers, stats.live_bytes, stats.reserved_bytes) == (1, 3000, 3000)
        with pytest.raises(AllocationError, match="out of memory"):
            alloc.alloc_many([1000, 96, 1])   # fits until the last one: all or nothing
        assert alloc.statistics().reserved_bytes == 3000 and len(alloc.outstanding()) == 1
        rest = alloc.alloc(1096)              # exactly up to the limit is fine
        assert alloc.statistics().peak_bytes == 4096
        first.free()
        rest.free()
        again = alloc.alloc(4096)
        assert alloc.statistics().reserved_bytes == 4096
        again.free()
        _assert_nothing_held(dev)
    finally:
        with anyio.fail_after(20):
            await dev.aclose()


@pytest.mark.parametrize(("size", "error"), [(0, ValueError), (-8, ValueError), (1.5, TypeError),
                                              ("64", TypeError), (True, TypeError), (None, TypeError)])
async def test_invalid_sizes(cpu: Device, size: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="CPU:0: allocation size"):
        cpu.allocator.alloc(size)  # type: ignore[arg-type]
    _assert_nothing_held(cpu)


async def test_fault_points_disarm_after_scope(cpu: Device) -> None:
    with faults.inject("alloc.map", after=1):
        ok = cpu.allocator.alloc(8)
        with pytest.raises(AllocationError):
            cpu.allocator.alloc(8)
        with pytest.raises(AllocationError):   # and every pass after that
            cpu.allocator.alloc(8)
        with pytest.raises(ValueError, match="already armed"):
            with faults.inject("alloc.map"):
                pass
    more = cpu.allocator.alloc(8)
    with anyio.fail_after(20):
        await cpu.copyin(more, np.ones(8, np.uint8)).wait(20)
    assert cpu.allocator.statistics().live_buffers == 2
    ok.free()
    more.free()


def test_size_classes_round_up_by_at_most_a_quarter() -> None:
    from tinydist.runtime.allocator import SIZE_CLASS_FROM, size_class

    assert size_class(3000) == 3000 and size_class(SIZE_CLASS_FROM - 1) == SIZE_CLASS_FROM - 1
    rng = np.random.default_rng(1)
    for n in [SIZE_CLASS_FROM, SIZE_CLASS_FROM + 1, 1 << 20, (1 << 20) + 1, *rng.integers(SIZE_CLASS_FROM, 1 << 34, 500).tolist()]:
        block = size_class(n)
        assert n <= block <= n * 1.25 and size_class(block) == block, n
    assert {size_class(n) for n in range((1 << 20) + 1, (1 << 21) + 1, 997)} == {5 << 18, 6 << 18, 7 << 18, 8 << 18}


async def test_random_sizes_reuse_blocks_and_the_cache_stays_bounded(cpu) -> None:
    # before: exact-size reuse and a cache that refused blocks once full — random sizes filled it
    # with blocks nothing matched, and every further block was a fresh mapping
    from pathlib import Path

    def mappings() -> int:
        return len(Path("/proc/self/maps").read_text().splitlines())

    alloc = cpu.allocator
    alloc.cache_limit, alloc.cache_blocks = 1 << 30, 32
    rng = np.random.default_rng(0)
    sizes = rng.integers(256 << 10, 8 << 20, 2000).tolist()
    before = mappings()
    for i, n in enumerate(sizes):
        buffers = [alloc.alloc(int(n)), alloc.alloc(int(sizes[i - 1]))]
        for buffer in buffers:
            buffer.free()
        assert alloc.statistics().cached_bytes <= alloc.cache_limit and len(alloc._cache_order) <= alloc.cache_blocks
    # exact sizes kept ~250 never-matched blocks here (the cache's 1 GiB), each its own mapping
    assert mappings() - before < 64
    first = alloc.alloc(300_000)
    address = first.address
    first.free()
    again = alloc.alloc(310_000)  # another size of the same class: the freed block again
    assert again.address == address
    again.free()
    _assert_nothing_held(cpu)


async def test_distinct_sizes_freed_keep_no_index_entry_past_the_cache(cpu) -> None:
    # a process meeting ever-new tensor sizes (every new shape) evicts each size's last block;
    # before, its size stayed a key of the cache's index with an empty list, one per size ever freed
    alloc = cpu.allocator
    alloc.cache_limit, alloc.cache_blocks = 1 << 30, 16
    for n in range(1000, 1000 + 8 * 500, 8):  # 500 sizes below SIZE_CLASS_FROM: exact, never reused
        alloc.alloc(n).free()
    assert len(alloc._cache_order) == 16
    assert len(alloc._cache) == 16 and all(alloc._cache.values())
    assert set(alloc._cache) == {1000 + 8 * i for i in range(484, 500)}  # the 16 freed last
    reused = alloc.alloc(1000 + 8 * 499)  # a size still cached is handed out again
    assert alloc.statistics().cached_bytes == sum(range(1000 + 8 * 484, 1000 + 8 * 499, 8))
    reused.free()
    alloc.trim()
    assert alloc._cache == {} and alloc._cache_order == {}
    _assert_nothing_held(cpu)
