"""Bounded run-ahead of eager realizes (`tinydist.engine.realize`, TINYDIST_REALIZE_RUN_AHEAD):
with the device's queue held by a gate, a loop of realizes waits at the limit until the device
catches up, and every result is still right (against numpy); a queue that finishes nothing is
left behind after a while; on a thread running an event loop nothing waits."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import tinydist as td
import tinydist.engine.realize as realize_module
from tests.engine.test_lowered import Gates
from tinydist.base.config import settings
from tinydist.runtime.device import Completion

LIMIT = 3
STEPS = 8


def _loop(a: td.Tensor, done: list[td.Tensor]) -> None:
    x = a
    for _ in range(STEPS):
        x = (x * 0.5 + a).exp().log()  # 4096 elements: not small enough to run on the caller
        x.realize()
        done.append(x)


def test_a_gated_queue_stops_the_loop_at_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop waits first when LIMIT realizes are queued behind the gate; opened then, the
    wait ends with the oldest realize done, and every later one waits its turn the same way."""
    values = np.random.default_rng(0).random((64, 64)).astype(np.float32)
    a = td.Tensor(values).realize()
    td.synchronize()
    done: list[td.Tensor] = []
    waits: list[int] = []
    original = realize_module._await

    def awaiting(completion: Completion) -> bool:
        waits.append(len(done))
        gates.open()  # the device catches up from here on
        reached = original(completion)
        assert reached, "an open queue finishes the realize waited for"
        return reached

    monkeypatch.setattr(realize_module, "_await", awaiting)
    with settings.override(REALIZE_RUN_AHEAD=LIMIT):
        gates = Gates(["CPU:0"])
        try:
            _loop(a, done)
        finally:
            gates.open()
    assert waits and waits[0] == LIMIT, waits
    assert len(done) == STEPS
    expected = values.astype(np.float64)
    for got in done:
        expected = np.log(np.exp(expected * 0.5 + values))
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_a_queue_that_finishes_nothing_is_left_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """A queue held by something this thread releases later does not deadlock the loop: after
    HELD_S without progress the realize goes on (here the hold is the test's gate)."""
    monkeypatch.setattr(realize_module, "HELD_S", 0.05)
    values = np.random.default_rng(2).random((64, 64)).astype(np.float32)
    a = td.Tensor(values).realize()
    td.synchronize()
    done: list[td.Tensor] = []
    with settings.override(REALIZE_RUN_AHEAD=1):
        gates = Gates(["CPU:0"])
        try:
            _loop(a, done)
            assert len(done) == STEPS
        finally:
            gates.open()
    expected = values.astype(np.float64)
    for _ in range(STEPS):
        expected = np.log(np.exp(expected * 0.5 + values))
    np.testing.assert_allclose(done[-1].numpy(), expected, rtol=1e-5, atol=1e-6)


def test_no_wait_on_a_thread_running_an_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    waited: list[Completion] = []
    monkeypatch.setattr(realize_module, "_await", lambda completion: waited.append(completion) or True)
    values = np.random.default_rng(1).random((64, 64)).astype(np.float32)
    a = td.Tensor(values).realize()
    td.synchronize()
    done: list[td.Tensor] = []

    async def main() -> None:
        _loop(a, done)  # all STEPS realizes queue behind the gate: blocking here would hang the loop

    with settings.override(REALIZE_RUN_AHEAD=1):
        gates = Gates(["CPU:0"])
        try:
            asyncio.run(main())
            assert len(done) == STEPS and not waited
        finally:
            gates.open()
    expected = values.astype(np.float64)
    for _ in range(STEPS):
        expected = np.log(np.exp(expected * 0.5 + values))
    np.testing.assert_allclose(done[-1].numpy(), expected, rtol=1e-5, atol=1e-6)
