"""`Allocator.recycled`: a frame loop's uploads and replay outputs reuse the buffers the caller
dropped, never one somebody still holds, and an idle one counts as cached, not live."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import tinydist as td
from tinydist.runtime.allocator import RECYCLE_MAX_BYTES, RECYCLED_PER_SIZE
from tinydist.runtime.engine import get_engine

DEVICE = "CPU:3"  # a device of its own: other tests' buffers do not share its pools


def _allocator():
    return get_engine().device(DEVICE).allocator


def test_a_dropped_upload_is_the_next_uploads_buffer() -> None:
    frame = np.arange(64, dtype=np.float32)
    first = td.Tensor(frame, DEVICE)
    buffer = id(first.node.buffer)  # (by id: a reference held here would keep it from being reused)
    del first
    second = td.Tensor(frame * 2, DEVICE)
    assert id(second.node.buffer) == buffer  # the same object, as it was: no allocation, no new Buffer
    np.testing.assert_array_equal(second.numpy(), frame * 2)


def test_a_held_buffer_is_never_handed_out_again() -> None:
    rng = np.random.default_rng(0)
    frames = [rng.standard_normal((4, 16)).astype(np.float32) for _ in range(3 * RECYCLED_PER_SIZE)]
    held = [td.Tensor(f, DEVICE) for f in frames]  # more than a pool keeps: all live at once
    views = [t.reshape(64)[3:9] for t in held]  # a view keeps its source's buffer held too
    del held
    fresh = [td.Tensor(f + 100, DEVICE) for f in frames]
    for frame, view, new in zip(frames, views, fresh):
        np.testing.assert_array_equal(view.numpy(), frame.reshape(64)[3:9])
        np.testing.assert_array_equal(new.numpy(), frame + 100)
    assert len({id(t.node.buffer) for t in fresh}) == len(fresh)


def test_idle_recycled_buffers_count_as_cached_not_live() -> None:
    allocator = _allocator()
    before = allocator.statistics()
    outstanding = allocator.outstanding()
    tensors = [td.Tensor(np.full(32, i, np.float32), DEVICE) for i in range(RECYCLED_PER_SIZE)]
    during = allocator.statistics()
    assert during.live_buffers == before.live_buffers + len(tensors)
    del tensors
    after = allocator.statistics()
    assert (after.live_buffers, after.live_bytes, after.reserved_bytes) == (
        before.live_buffers, before.live_bytes, before.reserved_bytes)
    assert after.cached_bytes >= 32 * 4
    assert allocator.outstanding() == outstanding
    allocator.trim()  # trim gives the idle recycled buffers back with the cached blocks
    assert allocator.statistics().cached_bytes == 0


def test_large_buffers_are_not_kept() -> None:
    allocator = _allocator()
    big = td.Tensor(np.zeros(RECYCLE_MAX_BYTES // 4 + 1, np.float32), DEVICE)
    del big
    assert RECYCLE_MAX_BYTES + 4 not in allocator._recycled  # beyond the bound: made and given back as before
    again = td.Tensor(np.ones(RECYCLE_MAX_BYTES // 4 + 1, np.float32), DEVICE)
    assert float(again.numpy().sum()) == RECYCLE_MAX_BYTES // 4 + 1


def test_threads_uploading_at_once_never_share_a_buffer() -> None:
    errors: list[str] = []

    def loop(worker: int) -> None:
        for i in range(300):
            value = worker * 1000 + i
            t = td.Tensor(np.full(16, value, np.float32), DEVICE)
            u = td.Tensor(np.full(16, -value, np.float32), DEVICE)
            if t.numpy()[0] != value or u.numpy()[0] != -value:
                errors.append(f"worker {worker} frame {i}: {t.numpy()[0]}, {u.numpy()[0]}")

    threads = [threading.Thread(target=loop, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


@pytest.mark.parametrize("keep", [0, 1, 5])
def test_a_frame_loop_equals_numpy_while_results_are_kept(keep: int) -> None:
    """Outputs and inputs recycled frame after frame; the ones the caller keeps stay as they were."""
    rng = np.random.default_rng(keep)
    w_h = rng.standard_normal((16, 8)).astype(np.float32)
    w = td.Tensor(w_h, DEVICE)

    @td.jit
    def step(x: td.Tensor) -> td.Tensor:
        return (x @ w).relu()

    kept: list[tuple[td.Tensor, np.ndarray, td.Tensor, np.ndarray]] = []
    for i in range(40):
        frame = rng.standard_normal((2, 16)).astype(np.float32)
        x = td.Tensor(frame, DEVICE)
        y = step(x)
        expected = np.maximum(frame.astype(np.float64) @ w_h, 0)
        np.testing.assert_allclose(y.numpy(), expected, rtol=1e-5, atol=1e-5)
        if keep and i % keep == 0:
            kept.append((x, frame, y, expected))
    for x, frame, y, expected in kept:
        np.testing.assert_array_equal(x.numpy(), frame)
        np.testing.assert_allclose(y.numpy(), expected, rtol=1e-5, atol=1e-5)
