"""Regression tests for replays that returned wrong values or refused work, against numpy."""

from __future__ import annotations

import numpy as np
import pytest

import tinydist as td
from tinydist.frontend.jit import REPLAYS, JitError

STRATEGIES = [r for r in REPLAYS if r != "auto"]


@pytest.mark.parametrize("replay", STRATEGIES)
def test_inputs_reached_out_of_declaration_order_are_not_swapped(replay: str) -> None:
    # call_numpy paired its input copies with the arrays by list position: from call 3 on,
    # `b - a` returned `a - b`.
    @td.jit(replay=replay)
    def f(a: td.Tensor, b: td.Tensor, c: td.Tensor) -> td.Tensor:
        return c * 10 + b - a   # reached c, b, a

    g = np.random.default_rng(0)
    for call in range(12):
        a, b, c = (g.standard_normal(5).astype(np.float32) for _ in range(3))
        want = c.astype(np.float64) * 10 + b - a
        np.testing.assert_allclose(f.call_numpy(a, b, c), want, rtol=1e-6, atol=1e-6, err_msg=f"call {call + 1}")
        np.testing.assert_allclose(f(td.Tensor(a), td.Tensor(b), td.Tensor(c)).numpy(), want, rtol=1e-6, atol=1e-6)


def test_the_same_tensor_for_two_parameters_at_capture_is_two_inputs_after() -> None:
    @td.jit
    def f(a: td.Tensor, b: td.Tensor) -> td.Tensor:
        return a * 2 - b

    x = td.Tensor(np.arange(4, dtype=np.float32))
    for _ in range(2):
        np.testing.assert_array_equal(f(x, x).numpy(), np.arange(4))   # call 2 captures with a is b
    y = np.full(4, 7, np.float32)
    np.testing.assert_array_equal(f(x, td.Tensor(y)).numpy(), np.arange(4) * 2 - 7)
    np.testing.assert_array_equal(f.call_numpy(np.ones(4, np.float32), y), np.full(4, -5))


def test_an_output_that_is_an_argument_or_a_weight_is_returned_as_the_function_returns_it() -> None:
    w = td.Tensor(np.full(3, 2, np.float32))

    @td.jit
    def f(x: td.Tensor) -> tuple[td.Tensor, td.Tensor, td.Tensor]:
        return x * w, x, w

    for i in range(4):
        x = td.Tensor(np.full(3, i, np.float32))
        product, same, weight = f(x)
        assert same is x and weight is w
        np.testing.assert_array_equal(product.numpy(), np.full(3, 2 * i))
    product, same, weight = f.call_numpy(np.ones(3, np.float32))
    np.testing.assert_array_equal(product, np.full(3, 2))
    np.testing.assert_array_equal(same, np.ones(3))
    np.testing.assert_array_equal(weight, np.full(3, 2))


def test_a_function_that_computes_nothing_is_refused_with_a_reason() -> None:
    @td.jit
    def f(x: td.Tensor) -> td.Tensor:
        return x

    x = td.Tensor(np.ones(2, np.float32))
    f(x)
    with pytest.raises(JitError, match="nothing to capture"):
        f(x)


def test_call_numpy_runs_on_the_device_it_names_and_refuses_another_after_capture() -> None:
    w_host = np.arange(12, dtype=np.float32).reshape(4, 3)
    w = td.Tensor(w_host, device="CPU:1")

    @td.jit
    def f(x: td.Tensor) -> td.Tensor:
        return x @ w

    for _ in range(4):
        x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
        np.testing.assert_allclose(f.call_numpy(x, device="CPU:1"), x.astype(np.float64) @ w_host, rtol=1e-5, atol=1e-5)
    with pytest.raises(JitError, match="CPU:1"):
        f.call_numpy(x, device="CPU:0")


def test_a_forced_strategy_that_does_not_apply_says_why() -> None:
    @td.jit(replay="entry")
    def f(x: td.Tensor) -> td.Tensor:
        return (x.to("CPU:1") * 2).to("CPU:0")

    x = td.Tensor(np.ones(2, np.float32))
    f(x)
    with pytest.raises(JitError, match="replay='entry' does not apply: it runs on 2 devices"):
        f(x)
    with pytest.raises(ValueError, match="replay must be one of"):
        td.jit(replay="fast")


def test_the_chosen_strategy_and_the_reasons_for_it_are_logged(monkeypatch: pytest.MonkeyPatch) -> None:
    import structlog
    import structlog.testing

    from tinydist.base import logs as td_logs
    from tinydist.engine import replay

    @td.jit
    def f(x: td.Tensor) -> td.Tensor:
        return (x.to("CPU:1") * 2).to("CPU:0") + x

    x = td.Tensor(np.ones(3, np.float32))
    f(x)
    saved, configured = structlog.get_config(), td_logs._configured
    td_logs.configure(level="debug")
    try:
        with structlog.testing.capture_logs() as logs:
            # module loggers take the level in force when they are made: make the engine's anew
            monkeypatch.setattr(replay, "log", td_logs.get_logger(layer="replay"))
            f(x)
    finally:
        structlog.configure(**saved)
        td_logs._configured = configured
    chosen = [entry for entry in logs if entry["event"] == "replay chosen"]
    assert len(chosen) == 1 and chosen[0]["strategy"] == f.captured.strategy.name
    assert chosen[0]["forced"] is False
    assert any(reason.startswith("not entry: it runs on 2 devices") for reason in chosen[0]["reasons"])


@pytest.mark.parametrize("jitted", [False, True])
def test_a_reshape_taken_before_an_assign_keeps_the_old_value(jitted: bool) -> None:
    # A target that was a reshape of realized memory shared that memory, so the assign (or one
    # run later) changed it: eagerly when the assign was read first, in every replay always.
    def f(t: td.Tensor) -> tuple[td.Tensor, td.Tensor]:
        view = t.reshape(3, 1)
        t.assign(t + t)
        return view, t * 1

    run = td.jit(f) if jitted else f
    for i in range(5):
        t = td.Tensor(np.full(3, i + 1, np.float32))
        view, doubled = run(t)
        np.testing.assert_array_equal(doubled.numpy(), np.full(3, 2 * (i + 1)))   # the assign read first
        np.testing.assert_array_equal(view.numpy(), np.full((3, 1), i + 1))
        np.testing.assert_array_equal(t.numpy(), np.full(3, 2 * (i + 1)))


@pytest.mark.parametrize("jitted", [False, True])
def test_an_assign_the_result_reads_runs_once(jitted: bool) -> None:
    # Realizing `t + t` after `t.assign(t + t)` ran the assign in its schedule but left it
    # unrealized, so reading `t` afterwards ran it again (t doubled twice).
    def f(t: td.Tensor) -> td.Tensor:
        t.assign(t + t)
        return t + t

    run = td.jit(f) if jitted else f
    for i in range(5):
        t = td.Tensor(np.full(3, i + 1, np.float32))
        np.testing.assert_array_equal(run(t).numpy(), np.full(3, 4 * (i + 1)))
        np.testing.assert_array_equal(t.numpy(), np.full(3, 2 * (i + 1)))
