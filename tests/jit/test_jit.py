"""td.jit: capture once, replay with signature checks, equal results to the un-jitted function."""

from __future__ import annotations

import numpy as np
import pytest

import tinydist as td

rng = np.random.default_rng(7)


def _weights() -> tuple[td.Tensor, td.Tensor, td.Tensor, np.ndarray, np.ndarray]:
    w1 = rng.standard_normal((64, 64)).astype(np.float32)
    w2 = rng.standard_normal((64, 10)).astype(np.float32)
    return td.Tensor(w1), td.Tensor(np.zeros(64, np.float32)), td.Tensor(w2), w1, w2


def _reference_mlp(x: np.ndarray, w1: np.ndarray, w2: np.ndarray) -> np.ndarray:
    h = np.maximum(x @ w1, 0) @ w2
    e = np.exp(h - h.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_mlp_replays_equal_numpy_and_link_one_entry_point() -> None:
    w1, b1, w2, n1, n2 = _weights()

    @td.jit
    def mlp(x: td.Tensor) -> td.Tensor:
        return ((x @ w1 + b1).relu() @ w2).softmax()

    for _ in range(6):
        x = rng.standard_normal((1, 64)).astype(np.float32)
        np.testing.assert_allclose(mlp(td.Tensor(x)).numpy(), _reference_mlp(x, n1, n2), rtol=1e-4, atol=1e-6)
    assert mlp.captured is not None
    assert mlp.captured.strategy.name == "entry" and mlp.captured.strategy.entry.signature == ()  # one native entry point, addresses bound inside


def test_outputs_are_fresh_and_feeding_an_output_back_is_safe() -> None:
    @td.jit
    def step(x: td.Tensor) -> td.Tensor:
        return x * 2 + 1

    x = td.Tensor(np.ones(8, np.float32))
    results = []
    for _ in range(5):
        x = step(x)
        results.append(x)
    expected = np.ones(8, np.float32)
    for result in results:  # every returned tensor keeps its own value
        expected = expected * 2 + 1
        np.testing.assert_array_equal(result.numpy(), expected)


def test_weights_changed_in_place_are_seen_by_replays() -> None:
    w = td.Tensor(np.ones(4, np.float32))

    @td.jit
    def scale(x: td.Tensor) -> td.Tensor:
        return x * w

    x = td.Tensor(np.full(4, 3, np.float32))
    for _ in range(3):
        scale(x)
    w.assign(w * 5).realize()
    np.testing.assert_array_equal(scale(x).numpy(), np.full(4, 15, np.float32))


def test_assigns_inside_the_function_run_on_every_replay() -> None:
    counter = td.Tensor(np.zeros(3, np.float32))

    @td.jit
    def tick(x: td.Tensor) -> td.Tensor:
        counter.assign(counter + x)
        return x * 1

    x = td.Tensor(np.ones(3, np.float32))
    for _ in range(5):
        tick(x)
    np.testing.assert_array_equal(counter.numpy(), np.full(3, 5, np.float32))


def test_signature_mismatches_name_the_argument_and_the_difference() -> None:
    @td.jit
    def f(x: td.Tensor, scale: float) -> td.Tensor:
        return x * scale

    x = td.Tensor(np.ones((2, 3), np.float32))
    for _ in range(3):
        f(x, 2.0)
    with pytest.raises(td.JitError, match=r"argument 'x': captured as Tensor float32\[2, 3\].*got Tensor float32\[3, 3\]"):
        f(td.Tensor(np.ones((3, 3), np.float32)), 2.0)
    with pytest.raises(td.JitError, match=r"argument 'x'.*got Tensor float64"):
        f(td.Tensor(np.ones((2, 3), np.float64)), 2.0)
    with pytest.raises(td.JitError, match=r"argument 'x'.*on CPU:1"):
        f(td.Tensor(np.ones((2, 3), np.float32), device="CPU:1"), 2.0)
    with pytest.raises(td.JitError, match=r"argument 'scale' was float 2.0 at capture and is float 3.0 now"):
        f(x, 3.0)
    with pytest.raises(td.JitError, match="missing a required argument: 'scale'"):
        f(x)
    np.testing.assert_array_equal(f(x, 2.0).numpy(), np.full((2, 3), 2, np.float32))  # still usable


def test_keyword_arguments_and_tuple_outputs() -> None:
    @td.jit
    def f(a: td.Tensor, b: td.Tensor) -> tuple[td.Tensor, td.Tensor]:
        return a + b, (a * b).sum()

    a, b = np.arange(4, dtype=np.float32), np.ones(4, np.float32)
    for _ in range(4):
        s, p = f(b=td.Tensor(b), a=td.Tensor(a))
        np.testing.assert_array_equal(s.numpy(), a + b)
        assert p.item() == pytest.approx(float((a * b).sum()))


def test_async_callers_await_a_replay() -> None:
    import anyio

    @td.jit
    def f(x: td.Tensor) -> td.Tensor:
        return x.exp()

    x = np.linspace(-1, 1, 16).astype(np.float32)

    async def main() -> list[np.ndarray]:
        return [(await f.acall(td.Tensor(x))).numpy() for _ in range(4)]

    for out in anyio.run(main):
        np.testing.assert_allclose(out, np.exp(x), rtol=1e-6)


def test_returning_an_input_unchanged_is_refused() -> None:
    @td.jit
    def identity(x: td.Tensor) -> td.Tensor:
        return x

    x = td.Tensor(np.ones(2, np.float32))
    identity(x)
    with pytest.raises(td.JitError, match="nothing to capture"):
        identity(x)


def test_call_numpy_is_numpy_in_numpy_out_and_checks_the_signature() -> None:
    w1, b1, w2, n1, n2 = _weights()

    @td.jit
    def mlp(x: td.Tensor) -> td.Tensor:
        return ((x @ w1 + b1).relu() @ w2).softmax()

    for _ in range(5):  # the first calls capture through the normal path, later ones replay
        x = rng.standard_normal((1, 64)).astype(np.float32)
        out = mlp.call_numpy(x)
        assert isinstance(out, np.ndarray) and out.dtype == np.float32
        np.testing.assert_allclose(out, _reference_mlp(x, n1, n2), rtol=1e-4, atol=1e-6)
    strided = np.asfortranarray(rng.standard_normal((1, 64)).astype(np.float32))
    np.testing.assert_allclose(mlp.call_numpy(strided), _reference_mlp(strided, n1, n2), rtol=1e-4, atol=1e-6)
    with pytest.raises(td.JitError, match=r"argument 'x': captured as Tensor float32\[1, 64\].*got ndarray float64\[1, 64\]"):
        mlp.call_numpy(np.zeros((1, 64)))
    with pytest.raises(td.JitError, match=r"got ndarray float32\[2, 64\]"):
        mlp.call_numpy(np.zeros((2, 64), np.float32))
    with pytest.raises(td.JitError, match="takes numpy arrays"):
        mlp.call_numpy([0.0] * 64)


@pytest.fixture(params=["on", "off"])
def native_streams(request: pytest.FixtureRequest):
    """Both ways a multi-device capture replays: one native call per queue, or a batch per run."""
    from tinydist.base.config import settings

    with settings.override(JIT_NATIVE_STREAMS=request.param):
        yield request.param


def test_graphs_over_several_devices_replay_per_queue_or_in_runs(native_streams: str) -> None:
    import anyio

    w = rng.standard_normal((6, 4)).astype(np.float32)
    weight = td.Tensor(w, device="CPU:1")

    @td.jit
    def sharded(x: td.Tensor) -> td.Tensor:
        halves = x.shard(["CPU:0", "CPU:1"], axis=0)                 # copies onto CPU:1
        total = (halves.exp() * 0.5).sum(axis=0)                      # allreduce across the devices
        return (total.to("CPU:1").reshape(1, 6) @ weight).to("CPU:0")  # and a matmul on CPU:1

    def reference(x: np.ndarray) -> np.ndarray:
        return ((np.exp(x) * 0.5).sum(0).reshape(1, 6) @ w)

    for _ in range(5):
        x = rng.standard_normal((9, 6)).astype(np.float32)
        out = sharded(td.Tensor(x))
        assert out.device == "CPU:0"
        np.testing.assert_allclose(out.numpy(), reference(x), rtol=1e-4, atol=1e-5)
    captured = sharded.captured
    assert captured is not None and captured.strategy.name != "entry"
    if native_streams == "on":
        assert captured.strategy.name == "streams"
        assert {"CPU:0/compute", "CPU:1/compute"} <= {st.name for st in captured.strategy.streams.streams}
    else:
        assert captured.strategy.name == "runs" and len(captured.strategy.runs) > 2
    x = rng.standard_normal((9, 6)).astype(np.float32)
    np.testing.assert_allclose(sharded.call_numpy(x), reference(x), rtol=1e-4, atol=1e-5)

    async def main() -> np.ndarray:
        return (await sharded.acall(td.Tensor(x))).numpy()

    np.testing.assert_allclose(anyio.run(main), reference(x), rtol=1e-4, atol=1e-5)


def test_a_caller_that_never_waits_is_held_to_the_run_ahead_bound(native_streams: str) -> None:
    from tinydist.base.config import settings
    from tinydist.runtime.engine import get_engine

    @td.jit
    def sharded(x: td.Tensor) -> td.Tensor:
        return (x.shard(["CPU:0", "CPU:1"], axis=0).exp() * 0.5).sum(axis=0).to("CPU:0")

    xs = [rng.standard_normal((8, 5)).astype(np.float32) for _ in range(9)]
    queues = [q for name in ("CPU:0", "CPU:1") for q in get_engine().device(name).queues.values()]
    outputs, caught_up = [], 0
    with settings.override(JIT_RUN_AHEAD=3):
        for x in xs:
            outputs.append(sharded(td.Tensor(x)))
            if sharded.queued == 0:  # this call reached the bound: it waited until the devices caught up
                caught_up += 1
                assert [q.statistics().in_flight for q in queues] == [0] * len(queues)
    assert caught_up == 3 and sharded.captured is not None and sharded.captured.strategy.name != "entry"
    for x, out in zip(xs, outputs):
        np.testing.assert_allclose(out.numpy(), (np.exp(x) * 0.5).sum(0), rtol=1e-5, atol=1e-6)


def test_arguments_copied_in_and_outputs_copied_out_inside_runs_keep_their_order(native_streams: str) -> None:
    # b, read only on CPU:1, is copied in at the start of the first run there; a gets a batch of
    # its own, since a run on CPU:1 reads it (the end of a run on CPU:0 would come too late for
    # that reader); both outputs are copied out at the end of the runs that make them. Replays
    # back to back, read afterwards: each saw its own arguments.
    @td.jit
    def mixed(a: td.Tensor, b: td.Tensor) -> tuple[td.Tensor, td.Tensor]:
        return (a.to("CPU:1") * b).sum(axis=0), (b.sum(axis=0).to("CPU:0") + a).exp() * 2

    g = np.random.default_rng(3)
    pairs = [(g.standard_normal((5, 3)).astype(np.float32), g.standard_normal((5, 3)).astype(np.float32)) for _ in range(6)]
    results = [mixed(td.Tensor(a), td.Tensor(b, device="CPU:1")) for a, b in pairs]
    for (a, b), (s, u) in zip(pairs, results):
        assert (s.device, u.device) == ("CPU:1", "CPU:0")
        np.testing.assert_allclose(s.numpy(), (a * b).sum(0), rtol=1e-5)
        np.testing.assert_allclose(u.numpy(), np.exp(a + b.sum(0)) * 2, rtol=1e-5)
    captured = mixed.captured
    assert captured is not None
    if native_streams == "off":
        assert captured.strategy.args_into[None] == [(0, 0)] and None not in captured.strategy.outputs_from
        assert sorted(n for k, slots in captured.strategy.args_into.items() if k is not None for _, n in slots) == [1]


def test_captured_data_parallel_step_replayed_back_to_back_matches_one_device(native_streams: str) -> None:
    # two devices exchanging gradients through copies between their queues, replayed without
    # waiting in between (replays queue up behind each other): the same weights as one device
    g = np.random.default_rng(7)
    data = [(g.random((8, 1, 6, 6), dtype=np.float32), g.integers(0, 3, 8)) for _ in range(6)]

    def train(devices: int, captured: bool) -> list[np.ndarray]:
        td.manual_seed(0)
        net = td.nn.Sequential(td.nn.Conv2d(1, 4, 3, padding=1), td.nn.ReLU(), td.nn.MaxPool2d(2),
                               td.nn.Flatten(), td.nn.Linear(4 * 3 * 3, 3))
        model = td.parallel.DistributedDataParallel(net, devices=devices) if devices > 1 else net
        opt = td.optim.SGD(model.parameters(), lr=0.5)

        def step(x: td.Tensor, y: td.Tensor) -> td.Tensor:
            loss = td.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss
        run = td.jit(step) if captured else step
        for x, y in data:
            run(td.Tensor(x), td.Tensor(y))
        return [p.numpy() for p in net.parameters()]

    for got, want in zip(train(2, captured=True), train(1, captured=False)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_a_step_over_several_devices_queues_one_batch_per_queue_per_replay() -> None:
    from tinydist.runtime.engine import get_engine

    @td.jit
    def step(x: td.Tensor) -> td.Tensor:
        halves = x.shard(["CPU:0", "CPU:1"], axis=0)
        return (halves.exp() * 0.5).sum(axis=0).to("CPU:0") + 1

    xs = [rng.standard_normal((8, 5)).astype(np.float32) for _ in range(6)]
    step(td.Tensor(xs[0]))
    step(td.Tensor(xs[0]))  # captured
    td.synchronize()
    queues = [get_engine().device(name).queues["compute"] for name in ("CPU:0", "CPU:1")]
    before = [q.last_submitted for q in queues]
    outputs = [step(td.Tensor(x)) for x in xs]
    assert [q.last_submitted - b for q, b in zip(queues, before)] == [len(xs), len(xs)]
    for x, out in zip(xs, outputs):
        np.testing.assert_allclose(out.numpy(), (np.exp(x) * 0.5).sum(0) + 1, rtol=1e-5, atol=1e-6)


def test_a_caller_far_ahead_of_the_devices_reuses_argument_rows_only_after_their_replay() -> None:
    from tinydist.base.config import settings
    from tinydist.engine.streams import RING

    @td.jit
    def step(x: td.Tensor) -> td.Tensor:
        return (x.to("CPU:1") * 2).to("CPU:0") + x

    xs = [np.full(3, i, np.float32) for i in range(2 * RING + 5)]
    with settings.override(JIT_RUN_AHEAD=10 * RING):  # never held back by the run-ahead bound
        outputs = [step(td.Tensor(x)) for x in xs]
    assert step.captured is not None and step.captured.strategy.name == "streams"
    for x, out in zip(xs, outputs):
        np.testing.assert_array_equal(out.numpy(), 3 * x)


def test_weights_changed_between_replays_on_a_queue_of_the_step_are_seen() -> None:
    # work queued on one of the step's queues between replays is ordered by the access logs, not
    # left to the step's native waits
    w = td.Tensor(np.ones(4, np.float32), device="CPU:1")

    @td.jit
    def scale(x: td.Tensor) -> td.Tensor:
        return (x.to("CPU:1") * w).to("CPU:0")

    x = td.Tensor(np.full(4, 3, np.float32))
    for _ in range(3):
        scale(x)
    w.assign(w * 5)
    w.realize()
    first = scale(x)
    w.assign(w + 1)
    w.realize()
    np.testing.assert_array_equal(first.numpy(), np.full(4, 15, np.float32))
    np.testing.assert_array_equal(scale(x).numpy(), np.full(4, 18, np.float32))


def _captured_over(devices: tuple[str, str]) -> tuple[td.jit, td.Tensor]:
    """A step whose part on the first device reads what the second computed."""
    first, second = devices

    @td.jit
    def step(x: td.Tensor) -> td.Tensor:
        return (x.to(second).exp() + 1).to(first) * 2

    x = td.Tensor(np.zeros(4, np.float32), device=first)
    np.testing.assert_allclose(step(x).numpy(), np.full(4, 4, np.float32))
    np.testing.assert_allclose(step(x).numpy(), np.full(4, 4, np.float32))
    assert step.captured is not None and step.captured.strategy.name == "streams"
    return step, x


def test_a_device_failing_mid_step_stops_the_other_devices_part_with_its_error() -> None:
    import threading

    from tinydist.base.errors import DeviceFailed
    from tinydist.runtime.engine import get_engine

    engine = get_engine()
    step, x = _captured_over(("CPU:2", "CPU:3"))
    gate = threading.Event()
    try:
        engine.device("CPU:3").queues["compute"].submit([(gate.wait, (60,))])  # CPU:3's part queues behind it
        out = step(x)  # CPU:2's part waits in native code for CPU:3's
        engine.device("CPU:3").mark_failed(DeviceFailed("test: CPU:3 broke"))
        gate.set()
        with pytest.raises(DeviceFailed, match=r"CPU:2/compute \(part \d\) waited for CPU:3/compute's part 0 of replay 2 "
                                               r"and stopped: CPU:3: test: CPU:3 broke"):
            out.numpy()
        assert engine.device("CPU:2").failure is not None
        with pytest.raises(DeviceFailed, match="this captured step stopped after a failure"):
            step(x)
    finally:
        gate.set()
        for name in ("CPU:2", "CPU:3"):
            engine.reopen(name)


def test_a_device_that_stands_still_mid_step_is_declared_hung_by_the_waiting_part() -> None:
    """The step's native wait times its deadline on the devices' clock, a MockClock here: CPU:2's
    part waits on through exactly the timeout with CPU:3 standing still, and gives up just past it."""
    import threading

    from tinydist.base.config import settings
    from tinydist.base.errors import DeviceFailed, DeviceHang
    from tinydist.runtime.engine import get_engine
    from tinydist.testing import MockClock

    engine = get_engine()
    clock = MockClock()
    gate = threading.Event()
    try:
        second, third = engine.reopen("CPU:2", clock=clock), engine.reopen("CPU:3", clock=clock)
        with settings.override(TIMELINE_TIMEOUT=60):  # baked into the step's native waits at capture
            step, x = _captured_over(("CPU:2", "CPU:3"))
        third.queues["compute"].submit([(gate.wait, (60,))])
        readings = clock.native_readings
        out = step(x)
        # CPU:2's step function started its chain, then its wait on CPU:3 (started and checked once)
        clock.wait_for_native_readings(readings + 3)
        assert clock.waiters == 0, "only the native wait times anything: moving the clock wakes no timeline"
        clock.advance(60)
        clock.wait_for_native_readings(clock.native_readings + 3)  # it checked the time now and waited on
        assert third.failure is None and second.failure is None
        clock.advance(1e-3)
        with pytest.raises(DeviceFailed, match=r"waited for CPU:3/compute's part 0 of replay 2, and CPU:3/compute "
                                               r"made no progress for 60s"):
            out.numpy()
        assert isinstance(third.failure, DeviceHang)
    finally:
        gate.set()
        for name in ("CPU:2", "CPU:3"):
            engine.reopen(name)


@pytest.mark.parametrize("other", ["CPU:0", "CPU:1"])
def test_an_argument_the_step_assigns_to_gets_its_new_value_and_keeps_its_own_memory(native_streams: str, other: str) -> None:
    # from the capture call on, each call reads the argument's value before the call and writes
    # the new one back into the caller's tensor — which stays the caller's, whatever later calls do
    @td.jit
    def step(state: td.Tensor, x: td.Tensor) -> td.Tensor:
        out = (state.to(other) * x.to(other)).to("CPU:0")
        state.assign(state + 1)
        return out

    states, outputs = [], []
    for i in range(6):
        state = td.Tensor(np.full(3, 10 * i + 7, np.float32))
        outputs.append(step(state, td.Tensor(np.full(3, 2, np.float32))))
        states.append(state)
    for i, (state, out) in enumerate(zip(states, outputs)):
        np.testing.assert_array_equal(out.numpy(), np.full(3, 2 * (10 * i + 7), np.float32))
        np.testing.assert_array_equal(state.numpy(), np.full(3, 10 * i + 8, np.float32))
    same = td.Tensor(np.zeros(3, np.float32))  # one tensor passed again and again counts up
    for _ in range(4):
        step(same, td.Tensor(np.ones(3, np.float32)))
    np.testing.assert_array_equal(same.numpy(), np.full(3, 4, np.float32))


def test_a_step_assigning_a_tensor_twice_replays_both_assigns_like_eager() -> None:
    # AdamW decays a weight and then updates it: two assigns to one tensor in one step. The
    # second used to realize the first at capture, so every replay skipped the decay.
    def train(jitted: bool) -> np.ndarray:
        td.manual_seed(0)
        model = td.nn.Linear(4, 3)
        opt = td.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
        x = td.Tensor(np.random.default_rng(1).standard_normal((8, 4)).astype(np.float32))

        def step(x: td.Tensor) -> td.Tensor:
            loss = (model(x) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss
        run = td.jit(step) if jitted else step
        for _ in range(5):
            run(x).numpy()
        return model.weight.numpy()
    np.testing.assert_allclose(train(jitted=True), train(jitted=False), rtol=1e-6, atol=1e-7)

    state = td.Tensor(np.zeros(3, np.float32))
    state.assign(state + 100)  # pending before any capture: runs once, never part of a replay

    @td.jit
    def twice(x: td.Tensor) -> td.Tensor:
        state.assign(state * 2)
        state.assign(state + x)
        return x * 1

    for _ in range(4):
        twice(td.Tensor(np.ones(3, np.float32)))
    expected = 100.0
    for _ in range(4):
        expected = expected * 2 + 1
    np.testing.assert_array_equal(state.numpy(), np.full(3, expected, np.float32))
