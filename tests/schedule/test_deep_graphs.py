"""Deep graphs at the interpreter's default recursion limit: every walk over the lazy graph and the
kernel IR keeps its own stack (tinydist.base.walk), so depth is bounded by memory, never by Python's
stack. Each case here used to raise RecursionError (a chain of about 500 ops was enough). They
also pass through the limits depth reveals past recursion: the longest kernel fusion makes, how
far a view is pushed (both `lazy.MAX_FUSED_OPS`), and the memory planner's clash search."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np

import tinydist as td
from tinydist.base.walk import Step, drive, postorder
from tinydist.engine.realize import realize
from tinydist.graph.lazy import ELEMENTWISE, MAX_FUSED_OPS
from tinydist.schedule import create_schedule
from tinydist.schedule.items import KernelCall

rng = np.random.default_rng(11)
ELEMENTWISE_NAMES = frozenset(op.value for op in ELEMENTWISE)


def test_postorder_is_the_order_of_the_recursive_walk_it_replaces() -> None:
    """Kernel numbering, input order and emitted code depend on visit order: it must not change."""
    for trial in range(200):
        size = int(rng.integers(1, 40))
        srcs = [[int(j) for j in rng.integers(0, i, int(rng.integers(0, 4)))] if i else [] for i in range(size)]
        roots = [int(r) for r in rng.integers(0, size, int(rng.integers(1, 4)))]
        expected: list[int] = []

        def visit(i: int) -> None:
            if i not in expected:
                for j in srcs[i]:
                    visit(j)
                expected.append(i)
        for root in roots:
            visit(root)
        nodes = [object() for _ in range(size)]
        index = {id(node): i for i, node in enumerate(nodes)}
        got = postorder([nodes[r] for r in roots], lambda node: [nodes[j] for j in srcs[index[id(node)]]])
        assert [index[id(node)] for node in got] == expected, trial


def test_drive_runs_steps_in_call_order_and_raises_into_the_caller() -> None:
    log: list[str] = []

    def count(n: int) -> Step[int]:
        log.append(f"enter {n}")
        if n == 3:
            raise KeyError(n)
        total = n
        if n < 10_000:
            try:
                total += yield count(n + 1)
            except KeyError:
                log.append(f"caught at {n}")
                total = -1
        return total

    assert drive(count(4)) == sum(range(4, 10_001))   # 10,000 steps deep, on the default stack
    assert log[:2] == ["enter 4", "enter 5"] and len(log) == 9_997
    log.clear()
    assert drive(count(2)) == -1 and log == ["enter 2", "enter 3", "caught at 2"]


def _contraction() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x, a, b of x ← x·a + b with 0 < a < 1: rounding errors die out instead of adding up."""
    return rng.uniform(-1, 1, 8), rng.uniform(0.99, 0.999, 8), rng.uniform(-0.01, 0.01, 8)


def _chain_reference(x: np.ndarray, a: np.ndarray, b: np.ndarray, steps: int) -> np.ndarray:
    for _ in range(steps):
        x = x * a + b
    return x


def test_a_100000_op_chain_is_cut_into_alike_kernels_and_matches_numpy() -> None:
    x0, a0, b0 = _contraction()
    x, a, b = (td.Tensor(v.astype(np.float32)) for v in (x0, a0, b0))
    for _ in range(50_000):
        x = x * a + b                                   # 100,000 elementwise nodes, one chain
    schedule, _ = create_schedule([x.node])
    kernels = [call for call in schedule.linear if isinstance(call, KernelCall)]
    assert len(kernels) == len(schedule.linear) == -(-100_000 // MAX_FUSED_OPS)
    for call in kernels:
        assert sum(node.op in ELEMENTWISE_NAMES for node in call.ast.root.walk()) <= MAX_FUSED_OPS
    assert len({call.ast for call in kernels}) <= 2     # every full piece is the same kernel: compiled once
    np.testing.assert_allclose(x.numpy(), _chain_reference(x0, a0, b0, 50_000), rtol=1e-4, atol=1e-5)


def _residual_weights(layers: int) -> tuple[np.ndarray, list[np.ndarray]]:
    return rng.standard_normal((4, 8)), [rng.standard_normal((8, 8)) * 0.3 for _ in range(layers)]


def _residual_forward(x: np.ndarray, ws: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    inputs = []
    for w in ws:
        inputs.append(x)
        x = x + np.maximum(x @ w, 0) * 0.01
    return x, inputs


def test_a_2000_layer_residual_mlp_forward_matches_numpy() -> None:
    x0, ws = _residual_weights(2000)
    x = td.Tensor(x0.astype(np.float32))
    for w in ws:
        x = x + (x @ td.Tensor(w.astype(np.float32))).relu() * 0.01
    expected, _ = _residual_forward(x0, ws)
    np.testing.assert_allclose(x.numpy(), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_the_backward_of_a_4000_op_chain_matches_numpy() -> None:
    """A gradient graph as deep as its forward: one parameter per step of x ← x·a_i + b."""
    x0, _, b0 = _contraction()
    scales = rng.uniform(0.99, 0.999, (2000, 8))
    params = [td.Tensor(a.astype(np.float32), requires_grad=True) for a in scales]
    x, b = td.Tensor(x0.astype(np.float32)), td.Tensor(b0.astype(np.float32))
    for a in params:
        x = x * a + b
    x.sum().backward()
    grads = [p.grad for p in params]
    realize([grad.node for grad in grads if grad is not None])  # one schedule for all of them
    xs = [x0]
    for a in scales:
        xs.append(xs[-1] * a + b0)
    g = np.ones(8)
    for i in reversed(range(len(scales))):
        grad = grads[i]
        assert grad is not None
        np.testing.assert_allclose(grad.numpy(), g * xs[i], rtol=1e-4, atol=1e-6, err_msg=f"step {i}")
        g = g * scales[i]


def test_a_500_op_chain_under_jit_replays_equal_to_eager() -> None:
    _, a0, b0 = _contraction()
    a, b = td.Tensor(a0.astype(np.float32)), td.Tensor(b0.astype(np.float32))

    def chain(x: td.Tensor) -> td.Tensor:
        for _ in range(250):
            x = x * a + b
        return x

    jitted = td.jit(chain)
    for _ in range(4):
        x0 = rng.uniform(-1, 1, 8).astype(np.float32)
        np.testing.assert_allclose(jitted(td.Tensor(x0)).numpy(), chain(td.Tensor(x0)).numpy(), rtol=1e-6, atol=1e-7)
    assert jitted.captured is not None


def test_a_100_layer_mlp_training_step_matches_numpy() -> None:
    layers, width, lr = 100, 8, 0.1
    td.manual_seed(5)
    model = td.nn.Sequential(*[module for _ in range(layers) for module in (td.nn.Linear(width, width), td.nn.Tanh())])
    linears = [m for m in model.modules() if isinstance(m, td.nn.Linear)]
    params = [(m.weight, m.bias) for m in linears]
    start = [(w.numpy().astype(np.float64), b.numpy().astype(np.float64)) for w, b in params if b is not None]
    x0, target = rng.standard_normal((4, width)), rng.standard_normal((4, width))
    opt = td.optim.SGD(model.parameters(), lr=lr)
    loss = ((model(td.Tensor(x0.astype(np.float32))) - td.Tensor(target.astype(np.float32))) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()

    acts = [x0]
    for w, b in start:
        acts.append(np.tanh(acts[-1] @ w.T + b))
    np.testing.assert_allclose(loss.numpy(), ((acts[-1] - target) ** 2).mean(), rtol=1e-5)
    g = 2 * (acts[-1] - target) / target.size
    for i in reversed(range(layers)):  # the gradients shrink layer by layer: each is checked at its own scale
        gz = g * (1 - acts[i + 1] ** 2)
        expected = {"weight": (start[i][0], gz.T @ acts[i]), "bias": (start[i][1], gz.sum(axis=0))}
        g = gz @ start[i][0]
        for name, (before, grad) in expected.items():
            param = getattr(linears[i], name)
            assert param.grad is not None, f"layer {i} {name} has no gradient"
            np.testing.assert_allclose(param.grad.numpy(), grad, rtol=1e-3, atol=1e-4 * np.abs(grad).max(), err_msg=f"layer {i} {name}")
            np.testing.assert_allclose(param.numpy(), before - lr * param.grad.numpy(), rtol=1e-6, atol=1e-7)


def test_depth_needs_no_bigger_stack_or_recursion_limit() -> None:
    """The fix is iterative walks, not a raised limit: in a fresh interpreter whose recursion limit
    is lowered far below the graph's depth, a deep graph still schedules and runs, and neither
    the limit nor the threads' stack size is touched."""
    script = textwrap.dedent("""
        import sys, threading
        sys.setrecursionlimit(250)
        before = (sys.getrecursionlimit(), threading.stack_size())
        import numpy as np
        import tinydist as td
        x = td.Tensor(np.ones(8, np.float32))
        for _ in range(1000):
            x = x * 0.5 + 0.25
        assert np.allclose(x.reshape(2, 4).numpy(), 0.5)
        assert (sys.getrecursionlimit(), threading.stack_size()) == before, before
        print("ok")
    """)
    root = Path(__file__).resolve().parents[2]  # this checkout's tinydist, whatever the caller's directory
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=root)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
    assert threading.stack_size() == 0 and sys.getrecursionlimit() == 1000  # this process's defaults
