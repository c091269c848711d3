"""Ordering across queues and devices from each base buffer's access log, keyed by byte range."""

from __future__ import annotations

from types import SimpleNamespace

import anyio
import numpy as np
import pytest

from tinydist.runtime.dependencies import AccessLog, StandingAccess
from tinydist.runtime.device import Batch, Device
from tinydist.runtime.timeline import Timeline

from .helpers import Gate, Kernels

# ---- the access log on its own -----------------------------------------------------------------


@pytest.fixture
def queues() -> tuple[Timeline, Timeline]:
    return Timeline("A"), Timeline("B")


def test_disjoint_ranges_do_not_wait(queues) -> None:
    a, b = queues
    log = AccessLog()
    log.record(0, 4, True, a, 1)          # A writes bytes [0, 4)
    assert log.waits_for(8, 12, False, b) == {}   # reading [8, 12) is unrelated
    assert log.waits_for(4, 8, True, b) == {}     # [4, 8) only touches the end: half-open ranges
    assert log.waits_for(2, 6, False, b) == {a: 1}  # reading [2, 6) overlaps: RAW


def test_write_after_read_waits(queues) -> None:
    a, b = queues
    log = AccessLog()
    log.record(0, 16, False, a, 3)        # A reads
    assert log.waits_for(8, 24, True, b) == {a: 3}   # WAR
    assert log.waits_for(0, 16, False, b) == {}      # RAR: never waits


def test_write_after_write_waits(queues) -> None:
    a, b = queues
    log = AccessLog()
    log.record(0, 16, True, a, 2)
    assert log.waits_for(15, 16, True, b) == {a: 2}


def test_same_queue_never_waits(queues) -> None:
    a, _ = queues
    log = AccessLog()
    log.record(0, 16, True, a, 1)
    log.record(0, 16, False, a, 2)
    assert log.waits_for(0, 16, True, a) == {}
    assert log.waits_for(0, 16, False, a) == {}


def test_waits_for_the_latest_conflicting_value_per_timeline(queues) -> None:
    a, b = queues
    c = Timeline("C")
    log = AccessLog()
    log.record(0, 8, True, a, 1)
    log.record(8, 16, True, a, 2)
    log.record(0, 16, True, c, 5)
    assert log.waits_for(0, 16, False, b) == {a: 2, c: 5}
    assert log.pending() == {a: 2, c: 5}


def test_completed_accesses_are_pruned(queues) -> None:
    a, b = queues
    log = AccessLog()
    log.record(0, 8, True, a, 1)
    log.record(8, 16, True, a, 2)
    assert len(log) == 2
    a.signal(1)
    assert log.waits_for(0, 16, False, b) == {a: 2}
    assert len(log) == 1  # the finished write to [0, 8) is gone
    a.signal(2)
    assert log.waits_for(0, 16, True, b) == {}
    assert len(log) == 0
    assert log.pending() == {}


def test_superseding_keeps_the_list_short(queues) -> None:
    a, _ = queues
    log = AccessLog()
    for value in range(1, 101):
        log.record(0, 64, True, a, value)       # a hot buffer written over and over
        log.record(0, 64, False, a, value)      # ... and read
    assert len(log) <= 2
    for value in range(101, 201):
        log.record(16, 32, True, a, value)      # a smaller write does not cover [0, 64)
    assert len(log) <= 3


def test_a_read_does_not_supersede_a_write(queues) -> None:
    """Dropping the write would let another queue read before it lands."""
    a, b = queues
    log = AccessLog()
    log.record(0, 8, True, a, 1)
    log.record(0, 8, False, a, 2)
    a.signal(1)
    assert log.waits_for(0, 8, False, b) == {}    # the write finished: reads need not wait on A
    log.record(0, 8, True, a, 3)
    log.record(0, 8, False, a, 4)
    assert log.waits_for(0, 8, False, b) == {a: 3}
    assert log.waits_for(0, 8, True, b) == {a: 4}


def test_other_timelines_are_not_superseded(queues) -> None:
    a, b = queues
    log = AccessLog()
    log.record(0, 8, True, a, 1)
    log.record(0, 8, True, b, 1)
    assert log.waits_for(0, 8, False, Timeline("C")) == {a: 1, b: 1}


def test_a_standing_access_moves_its_one_record_forward_while_nothing_else_touches_the_range(queues) -> None:
    a, b = queues
    log = AccessLog()
    buffer = SimpleNamespace(accesses=log, offset=8, nbytes=8)
    standing = StandingAccess(buffer, write=True)
    assert not standing.unchanged  # never recorded: the first replay scans for what to wait for
    standing.renew(a, 1)
    assert standing.unchanged and len(log) == 1 and log.waits_for(0, 64, False, b) == {a: 1}
    for value in range(2, 6):
        standing.renew(a, value)  # in place: no new record, nothing new to wait for
    assert standing.unchanged and len(log) == 1 and log.waits_for(0, 64, False, b) == {a: 5}
    log.record(0, 16, False, b, 1)  # other work reads the range
    assert not standing.unchanged
    standing.renew(a, 6)
    assert standing.unchanged and len(log) == 2


def test_a_standing_access_whose_record_was_pruned_records_again(queues) -> None:
    a, b = queues
    log = AccessLog()
    standing = StandingAccess(SimpleNamespace(accesses=log, offset=0, nbytes=4), write=False)
    standing.renew(a, 1)
    a.signal(1)
    assert log.waits_for(0, 4, True, b) == {} and len(log) == 0  # finished: pruned
    standing.renew(a, 2)
    assert len(log) == 1 and log.waits_for(0, 4, True, b) == {a: 2}


def test_a_hold_keeps_the_memory_until_reached_and_orders_nothing(queues) -> None:
    """One queue's own work on memory (intermediates in its FIFO order) holds it without ranges:
    nothing waits for it, but the memory is given back only once that work is done."""
    a, b = queues
    log = AccessLog()
    log.hold(a, 3)
    assert log.waits_for(0, 1 << 20, True, b) == {} and not log.conflicts(0, 1 << 20, True)
    assert log.pending() == {a: 3}
    log.record(0, 8, True, b, 1)
    assert log.pending() == {a: 3, b: 1}
    a.signal(3)
    assert log.pending() == {b: 1}


# ---- end to end through Batch ------------------------------------------------------------------

def _waits(batch: Batch) -> list[tuple[str, int]]:
    """The cross-queue waits a batch inserted, as (timeline name, value)."""
    out = []
    for fn, args in batch._commands:
        owner = getattr(fn, "__self__", None)
        if isinstance(owner, Timeline) and fn.__func__ is Timeline.wait_blocking:
            out.append((owner.name, args[0]))
    return out


def _stall(dev: Device, queue: str, gate: Gate) -> None:
    dev.queues[queue].submit([gate.command])


@pytest.mark.anyio
async def test_copy_then_compute_waits_only_on_overlap(cpu: Device, kernels: Kernels, gate) -> None:
    scale = cpu.load_program(kernels.scale, "rt_scale_f32", ["w", "r", "f32", "i64"])
    src = cpu.allocator.alloc(64)
    dst = cpu.allocator.alloc(64)
    stall = gate()
    _stall(cpu, "copy", stall)   # the copy below cannot finish until the gate opens
    data = np.arange(16, dtype=np.float32) + 1
    cpu.copyin(src.view(0, 16), data[:4])          # copy queue writes bytes [0, 16) of src

    with cpu.batch() as disjoint:                  # reads bytes [32, 48): unrelated
        disjoint.launch(scale, dst.view(32, 16), src.view(32, 16), 1.0, 4)
    assert len(disjoint) == 1 and _waits(disjoint) == []

    with cpu.batch() as overlapping:               # reads bytes [8, 24): overlaps the copy
        overlapping.launch(scale, dst.view(0, 16), src.view(8, 16), 2.0, 4)
    assert len(overlapping) == 2
    assert _waits(overlapping) == [("CPU:0/copy", 2)]
    assert overlapping._commands[-1][0] is scale.cfunc

    with cpu.batch() as same_queue:                # reads what the compute queue wrote: FIFO
        same_queue.launch(scale, dst.view(48, 16), dst.view(0, 16), 1.0, 4)
    assert len(same_queue) == 1

    stall.open()
    with anyio.fail_after(20):
        out = (await cpu.copyout(dst.view(0, 16), timeout=20)).view(np.float32)
    # bytes [8, 16) of src were written by the copy: data[2:4]; [16, 24) were never written
    np.testing.assert_array_equal(out[:2], 2.0 * data[2:4])


@pytest.mark.anyio
async def test_write_after_read_across_queues_is_ordered(cpu: Device, kernels: Kernels, gate) -> None:
    scale = cpu.load_program(kernels.scale, "rt_scale_f32", ["w", "r", "f32", "i64"])
    n = 256
    x, y = cpu.allocator.alloc(4 * n), cpu.allocator.alloc(4 * n)
    old = np.arange(n, dtype=np.float32)
    new = -np.ones(n, dtype=np.float32)
    with anyio.fail_after(20):
        await cpu.copyin(x, old).wait(20)
    stall = gate()
    _stall(cpu, "compute", stall)
    with cpu.batch() as read:                       # compute reads x (held up by the gate)
        read.launch(scale, y, x, 3.0, n)
    with cpu.batch("copy") as overwrite:            # the copy queue then overwrites x
        overwrite.write_from_host(x, new)
    assert _waits(overwrite) == [("CPU:0/compute", read.completion.value)]
    assert len(overwrite) == 2
    stall.open()
    with anyio.fail_after(20):
        await overwrite.completion.wait(20)
        got_y = (await cpu.copyout(y, timeout=20)).view(np.float32)
        got_x = (await cpu.copyout(x, timeout=20)).view(np.float32)
    np.testing.assert_array_equal(got_y, 3.0 * old)   # the kernel saw the old data
    np.testing.assert_array_equal(got_x, new)


@pytest.mark.anyio
async def test_peer_read_is_ordered_after_the_owners_write_and_before_its_next(
        cpu: Device, cpu1: Device, kernels: Kernels, gate) -> None:
    """A kernel on CPU:0 reads CPU:1's buffer in place (one host memory): it waits for CPU:1's
    pending write (RAW), and CPU:1's next write waits for that read (WAR)."""
    scale0 = cpu.load_program(kernels.scale, "rt_scale_f32", ["w", "r", "f32", "i64"])
    scale1 = cpu1.load_program(kernels.scale, "rt_scale_f32", ["w", "r", "f32", "i64"])
    n = 256
    source, theirs, mine = cpu1.allocator.alloc(4 * n), cpu1.allocator.alloc(4 * n), cpu.allocator.alloc(4 * n)
    data = np.arange(n, dtype=np.float32)
    with anyio.fail_after(20):
        await cpu1.copyin(source, data).wait(20)
    stall1, stall0 = gate(), gate()
    _stall(cpu1, "compute", stall1)
    with cpu1.batch() as produce:                   # CPU:1 writes theirs = 2 * data (held up)
        produce.launch(scale1, theirs, source, 2.0, n)
    _stall(cpu, "compute", stall0)
    with cpu.batch() as peer_read:                  # CPU:0 reads CPU:1's buffer directly
        peer_read.launch(scale0, mine, theirs, 3.0, n)
    assert _waits(peer_read) == [("CPU:1/compute", produce.completion.value)]
    stall1.open()
    with cpu1.batch() as overwrite:                 # CPU:1 overwrites theirs while CPU:0 still has to read it
        overwrite.launch(scale1, theirs, source, -1.0, n)
    assert _waits(overwrite) == [("CPU:0/compute", peer_read.completion.value)]
    stall0.open()
    with anyio.fail_after(20):
        await overwrite.completion.wait(20)
        got = (await cpu.copyout(mine, timeout=20)).view(np.float32)
    np.testing.assert_array_equal(got, 6.0 * data)  # the produced value, not the later overwrite


@pytest.mark.anyio
async def test_read_after_read_across_queues_never_waits(cpu: Device, kernels: Kernels, gate) -> None:
    scale = cpu.load_program(kernels.scale, "rt_scale_f32", ["w", "r", "f32", "i64"])
    x, y = cpu.allocator.alloc(64), cpu.allocator.alloc(64)
    stall = gate()
    _stall(cpu, "compute", stall)
    with cpu.batch() as read:
        read.launch(scale, y, x, 1.0, 16)
    with cpu.batch("copy") as read_too:
        read_too.read_to_host(np.empty(64, np.uint8), x)
    assert len(read_too) == 1 and _waits(read_too) == []
    stall.open()


@pytest.mark.anyio
async def test_order_after_waits_for_other_work_without_recording_and_ordering_can_be_left_to_the_caller(
        cpu: Device, kernels: Kernels, gate) -> None:
    x = cpu.allocator.alloc(64)
    stall = gate()
    _stall(cpu, "copy", stall)
    cpu.copyin(x, np.ones(16, np.float32))  # a write queued on the copy queue
    with cpu.batch() as ordered:
        ordered.order_after(x, False)
    assert _waits(ordered) == [(f"{cpu.name}/copy", 2)]
    assert x.accesses.pending() == {cpu.queues["copy"].timeline: 2}, "order_after records nothing"
    with cpu.batch() as left:
        left.leave_ordering_to(frozenset({cpu.queues["copy"].timeline}))
        left.track(x, False)
    assert _waits(left) == []
    assert x.accesses.pending() == {cpu.queues["copy"].timeline: 2, cpu.queues["compute"].timeline: 2}
    stall.open()


@pytest.mark.anyio
async def test_track_range_orders_and_records_bytes_of_a_buffer_as_a_view_of_them_would(cpu: Device, gate) -> None:
    x = cpu.allocator.alloc(64)
    stall = gate()
    _stall(cpu, "copy", stall)
    cpu.copyin(x.view(0, 16), np.ones(4, np.float32))  # the copy queue writes bytes [0, 16)
    with cpu.batch() as disjoint:
        disjoint.track_range(x, 16, 16, False)
    assert _waits(disjoint) == []
    with cpu.batch() as overlapping:
        overlapping.track_range(x, 8, 16, True)
        overlapping.track_range(x, 8, 16, False)     # the same range again: ordered once
    assert _waits(overlapping) == [(f"{cpu.name}/copy", 2)]
    assert x.accesses.waits_for(20, 24, False, cpu.queues["copy"].timeline) == {cpu.queues["compute"].timeline: 2}
    stall.open()


@pytest.mark.anyio
async def test_a_batch_waits_once_per_timeline(cpu: Device, kernels: Kernels, gate) -> None:
    scale = cpu.load_program(kernels.scale, "rt_scale_f32", ["w", "r", "f32", "i64"])
    x, y = cpu.allocator.alloc(64), cpu.allocator.alloc(64)
    stall = gate()
    _stall(cpu, "copy", stall)
    cpu.copyin(x, np.ones(16, np.float32))
    with cpu.batch() as batch:
        for _ in range(5):
            batch.launch(scale, y, x, 2.0, 16)
    assert len(batch) == 6 and len(_waits(batch)) == 1
    stall.open()
    with anyio.fail_after(20):
        out = (await cpu.copyout(y, timeout=20)).view(np.float32)
    np.testing.assert_array_equal(out, np.full(16, 2.0, np.float32))


@pytest.mark.anyio
async def test_copyin_kernel_copyout_chain_across_two_devices(cpu: Device, cpu1: Device, kernels: Kernels, gate) -> None:
    """CPU:0's copy queue fills a buffer; CPU:1's copy queue copies it over; CPU:1 computes on it."""
    n = 1024
    scale = cpu1.load_program(kernels.scale, "rt_scale_f32", ["w", "r", "f32", "i64"])
    rng = np.random.default_rng(7)
    data = rng.standard_normal(n).astype(np.float32)
    src0 = cpu.allocator.alloc(4 * n)
    dst1, out1 = cpu1.allocator.alloc(4 * n), cpu1.allocator.alloc(4 * n)
    stall = gate()
    _stall(cpu, "copy", stall)                 # hold CPU:0's copy so every wait below is needed
    cpu.copyin(src0, data)
    with cpu1.batch("copy") as transfer:
        transfer.copy(dst1, src0)
    assert _waits(transfer) == [("CPU:0/copy", 2)]
    with cpu1.batch() as compute:
        compute.launch(scale, out1, dst1, -2.0, n)
    assert _waits(compute) == [("CPU:1/copy", transfer.completion.value)]
    assert not transfer.completion.done()
    stall.open()
    with anyio.fail_after(20):
        got = (await cpu1.copyout(out1, timeout=20)).view(np.float32)
        moved = (await cpu1.copyout(dst1, timeout=20)).view(np.float32)
    np.testing.assert_array_equal(moved, data)
    np.testing.assert_array_equal(got, np.float32(-2.0) * data)


@pytest.mark.anyio
async def test_copyin_kernel_copyout_across_queues(cpu: Device, kernels: Kernels) -> None:
    n = 4096
    scale = cpu.load_program(kernels.scale, "rt_scale_f32", ["w", "r", "f32", "i64"])
    x, y = cpu.allocator.alloc(4 * n), cpu.allocator.alloc(4 * n)
    data = np.linspace(-3, 3, n, dtype=np.float32)
    cpu.copyin(x, data)
    with cpu.batch() as batch:
        batch.launch(scale, y, x, 0.5, n)
    with anyio.fail_after(20):
        out = (await cpu.copyout(y, timeout=20)).view(np.float32)
    np.testing.assert_array_equal(out, np.float32(0.5) * data)
