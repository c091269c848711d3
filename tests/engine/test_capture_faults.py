"""A failure half way through a capture gives back everything the capture took.

Capture binds argument copies, one arena per device and lane, and target buffers, then builds
its replay (compiling and linking). A fault at any of those steps, on either device, must leave
both devices' allocators exactly as they were before the capture began, and the next capture of
the same function must work and match numpy.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

import tinydist as td
from tinydist.base.errors import AllocationError, DeviceError
from tinydist.runtime.compiler import DeviceCompiler
from tinydist.runtime.engine import get_engine
from tinydist.runtime.faults import InjectedFault, faults

DEVICES = ("CPU:0", "CPU:1")


def _live() -> dict[str, tuple[int, int]]:
    gc.collect()
    td.synchronize(10)
    stats = {name: get_engine().device(name).allocator.statistics() for name in DEVICES}
    return {name: (s.live_buffers, s.live_bytes) for name, s in stats.items()}


def _two_device_step(replay: str) -> td.TinyJit:
    w = td.Tensor(np.linspace(-1, 1, 48, dtype=np.float32).reshape(8, 6), device="CPU:1")

    @td.jit(replay=replay)
    def step(x: td.Tensor, y: td.Tensor) -> tuple[td.Tensor, td.Tensor]:
        hidden = (x.to("CPU:1") @ w).relu()          # an arena on CPU:1, a copy in
        return (hidden.to("CPU:0") * y).sum(axis=1), hidden.exp()
    return step


def _expected(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    w = np.linspace(-1, 1, 48).reshape(8, 6)
    hidden = np.maximum(x.astype(np.float64) @ w, 0)
    return (hidden * y).sum(axis=1), np.exp(hidden)


POINTS = [("engine.bind.argument", 0), ("engine.bind.argument", 1), ("engine.bind.arena", 0),
          ("engine.bind.arena", 1), ("engine.bind.target", 0), ("engine.bind.target", 1), ("alloc.map", 3)]


@pytest.mark.parametrize("replay", ["runs", "streams"])
@pytest.mark.parametrize(("point", "after"), POINTS)
def test_a_fault_while_binding_a_capture_leaves_nothing_allocated(replay: str, point: str, after: int) -> None:
    step = _two_device_step(replay)
    g = np.random.default_rng(5)
    x, y = g.standard_normal((4, 8)).astype(np.float32), g.standard_normal((4, 6)).astype(np.float32)
    xt, yt = td.Tensor(x), td.Tensor(y)
    step(xt, yt)[0].numpy()  # call 1 runs as written: what is left allocated now is the caller's
    before = _live()
    with faults.inject(point, after=after), pytest.raises((InjectedFault, AllocationError)):
        step(xt, yt)
    assert step.captured is None
    assert faults.hits.get(point, 0) >= after + 1
    assert _live() == before
    for _ in range(3):  # the next call captures for real, and replays
        x, y = g.standard_normal((4, 8)).astype(np.float32), g.standard_normal((4, 6)).astype(np.float32)
        reduced, hidden = step(td.Tensor(x), td.Tensor(y))
        want_reduced, want_hidden = _expected(x, y)
        np.testing.assert_allclose(reduced.numpy(), want_reduced, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(hidden.numpy(), want_hidden, rtol=1e-5, atol=1e-5)
    assert step.captured is not None and step.captured.strategy.name == replay


def test_a_failure_linking_the_entry_point_leaves_nothing_allocated(monkeypatch: pytest.MonkeyPatch) -> None:
    w = td.Tensor(np.eye(6, dtype=np.float32))

    @td.jit
    def step(x: td.Tensor) -> td.Tensor:
        return (x @ w).relu() + 1

    x = td.Tensor(np.ones((2, 6), np.float32))
    step(x).numpy()
    before = _live()

    def refuse(self: DeviceCompiler, launches: object) -> None:
        raise DeviceError("link refused by the test")
    monkeypatch.setattr(DeviceCompiler, "link", refuse)
    with pytest.raises(DeviceError, match="link refused"):
        step(x)
    assert step.captured is None and _live() == before
    monkeypatch.undo()
    np.testing.assert_array_equal(step(x).numpy(), np.full((2, 6), 2, np.float32))
