"""Bounded run-ahead of eager realizes (`tinydist.engine.realize`, TINYDIST_REALIZE_RUN_AHEAD):
with the device's queue held by a gate, a loop of realizes stops at the limit until the device
catches up, and every result is still right (against numpy); on a thread running an event loop
nothing waits."""

from __future__ import annotations

import asyncio
import threading

import numpy as np

import tinydist as td
from tinydist.config import settings
from tests.engine.test_lowered import Gates

LIMIT = 3
STEPS = 8


def _loop(a: td.Tensor, done: list[td.Tensor]) -> None:
    x = a
    for _ in range(STEPS):
        x = (x * 0.5 + a).exp().log()  # 4096 elements: not small enough to run on the caller
        x.realize()
        done.append(x)


def test_a_gated_queue_stops_the_loop_at_the_limit() -> None:
    values = np.random.default_rng(0).random((64, 64)).astype(np.float32)
    a = td.Tensor(values).realize()
    td.synchronize()
    done: list[td.Tensor] = []
    with settings.override(REALIZE_RUN_AHEAD=LIMIT):
        gates = Gates(["CPU:0"])
        worker = threading.Thread(target=_loop, args=(a, done))
        worker.start()
        try:
            worker.join(1.0)  # the loop gets no further while the gate holds the queue, however long
            assert worker.is_alive()
            assert len(done) == LIMIT
        finally:
            gates.open()
            worker.join(60)
    assert not worker.is_alive() and len(done) == STEPS
    expected = values.astype(np.float64)
    for got in done:
        expected = np.log(np.exp(expected * 0.5 + values))
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_no_wait_on_a_thread_running_an_event_loop() -> None:
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
            assert len(done) == STEPS
        finally:
            gates.open()
    expected = values.astype(np.float64)
    for _ in range(STEPS):
        expected = np.log(np.exp(expected * 0.5 + values))
    np.testing.assert_allclose(done[-1].numpy(), expected, rtol=1e-5, atol=1e-6)
