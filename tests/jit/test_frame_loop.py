"""The frame loop: a host-memory replay runs on the caller's thread while its queue is idle, and
keeps every guarantee of a queued one — outputs that do not alias across calls, inputs the caller
may change afterwards, and the queue's order when it is busy. Checked against numpy float64."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import tinydist as td
from tinydist.base.errors import DeviceFailed
from tinydist.runtime.command_queue import BUSY, CommandQueue

rng = np.random.default_rng(11)


def _mlp() -> tuple[td.TinyJit, np.ndarray, np.ndarray]:
    w1 = rng.standard_normal((16, 16)).astype(np.float32)
    w2 = rng.standard_normal((16, 4)).astype(np.float32)
    tw1, tw2 = td.Tensor(w1), td.Tensor(w2)

    @td.jit
    def step(x: td.Tensor) -> td.Tensor:
        return (x @ tw1).relu() @ tw2

    return step, w1, w2


def _reference(x: np.ndarray, w1: np.ndarray, w2: np.ndarray) -> np.ndarray:
    return np.maximum(x.astype(np.float64) @ w1, 0) @ w2


def _compute_queue() -> CommandQueue:
    return td.get_engine().device("CPU:0").queues["compute"]


def test_an_idle_queue_replays_on_the_callers_thread_and_outputs_do_not_alias() -> None:
    step, w1, w2 = _mlp()
    frames = [rng.standard_normal((2, 16)).astype(np.float32) for _ in range(8)]
    for frame in frames[:2]:
        step(td.Tensor(frame)).numpy()  # run, capture
    td.synchronize()
    queue = _compute_queue()
    before = queue.last_submitted
    outputs = [step(td.Tensor(frame)) for frame in frames]  # all held: none may share memory
    arrays = [step.call_numpy(frame) for frame in frames]
    assert queue.last_submitted == before  # no submission: every replay ran on this thread
    for frame, out, array in zip(frames, outputs, arrays):
        np.testing.assert_allclose(out.numpy(), _reference(frame, w1, w2), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(array, _reference(frame, w1, w2), rtol=1e-5, atol=1e-5)
    assert len({a.ctypes.data for a in arrays}) == len(arrays)


def test_the_caller_may_change_its_inputs_after_the_call_returns() -> None:
    step, w1, w2 = _mlp()
    frame = rng.standard_normal((2, 16)).astype(np.float32)
    x = td.Tensor(frame)
    for _ in range(2):
        step(x)
    expected = _reference(frame, w1, w2)
    array = step.call_numpy(frame)
    out = step(x)
    frame[:] = 0
    x.assign(td.Tensor(frame)).realize()
    np.testing.assert_allclose(array, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(step(x).numpy(), _reference(frame, w1, w2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("entry", ["tensor", "numpy"])
def test_a_busy_queue_gets_the_replay_queued_behind_its_work(entry: str) -> None:
    step, w1, w2 = _mlp()
    frame = rng.standard_normal((2, 16)).astype(np.float32)
    for _ in range(2):
        step(td.Tensor(frame))
    td.synchronize()
    queue = _compute_queue()
    release, ran = threading.Event(), []
    queue.submit([(lambda: (release.wait(30), ran.append("earlier")), ())])
    x = td.Tensor(frame)
    result: list[np.ndarray] = []
    caller = threading.Thread(target=lambda: result.append(step(x).numpy() if entry == "tensor" else step.call_numpy(frame)))
    caller.start()
    caller.join(0.5)
    assert not result  # it waits for the work queued before it
    release.set()
    caller.join(30)
    assert ran == ["earlier"]
    np.testing.assert_allclose(result[0], _reference(frame, w1, w2), rtol=1e-5, atol=1e-5)


def test_run_if_idle_runs_nothing_on_a_busy_queue_and_a_failure_fails_the_device() -> None:
    device = td.get_engine().reopen("CPU:3")
    queue = device.queues["compute"]
    assert queue.run_if_idle(lambda a, b: a + b, (2, 3)) == 5
    release = threading.Event()
    value = queue.submit([(release.wait, (30,))])
    assert queue.run_if_idle(lambda: pytest.fail("ran on a busy queue"), ()) is BUSY
    release.set()
    device.queues["compute"].timeline.wait_blocking(value)

    def broken() -> None:
        raise RuntimeError("native work failed")
    with pytest.raises(DeviceFailed, match="native work failed"):
        queue.run_if_idle(broken, ())
    assert device.failure is not None
    td.get_engine().reopen("CPU:3")


def test_ctrl_c_inside_a_run_on_the_calling_thread_leaves_the_device_usable() -> None:
    """Regression: Ctrl-C landing inside a replay's inline run failed the whole device
    (`tinydist infer --bench` then exited 1 with "a run on the calling thread failed:
    KeyboardInterrupt" instead of printing its latency and exiting 130)."""
    device = td.get_engine().reopen("CPU:3")
    queue = device.queues["compute"]

    def interrupted() -> None:
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        queue.run_if_idle(interrupted, ())
    assert device.failure is None
    assert queue.run_if_idle(lambda a, b: a * b, (2, 3)) == 6
