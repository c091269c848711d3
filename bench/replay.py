"""What a captured replay costs per frame, and what each microsecond of it is spent on.

The 64-64-10 MLP `((x @ w1 + b1).relu() @ w2)` on one frame (batch 1, float32), captured with
td.jit and replayed through each entry a user reaches for:

    tensor   `step(x).numpy()`                 x an existing td.Tensor          target <= 10 us
    fresh    `step(td.Tensor(frame)).numpy()`  a new Tensor from the frame      target <= 15 us
    numpy    `step.call_numpy(frame)`          numpy in, numpy out              target <= 6 us

next to the same forward pass in numpy and in PyTorch (one thread, no_grad, from_numpy in and
numpy out), measured in the same run: medians of repeats, the sides alternating repeat by
repeat. Then the breakdown — the parts timed on their own, the same way:

    native        the linked entry point alone (the three kernels, addresses baked in)
    frame         the host-frame function alone (copies in, the entry, copies out)
    submission    one no-op command through the compute queue, inline (the runtime's floor)
    Tensor(frame) making a Tensor from a frame (allocation + upload)
    .numpy()      reading a computed Tensor back

The rest of each entry's time is Python bookkeeping of the call: binding and checking the
arguments, choosing output buffers, building the commands, wrapping the outputs.

    .venv/bin/python bench/replay.py [--repeats 15] [--calls 2000] [--json PATH]
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import OPENBLAS_VARS, Report, baseline_env, median  # noqa: E402

if any(v in os.environ for v in OPENBLAS_VARS):  # numpy's baseline runs as OpenBLAS would choose
    os.execve(sys.executable, [sys.executable, *sys.argv], baseline_env())

import tinydist as td  # noqa: E402
from tinydist.runtime.engine import get_engine  # noqa: E402

TARGETS = {"tensor": 10.0, "fresh": 15.0, "numpy": 6.0}


def per_call_us(fn: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def alternate(sides: dict[str, Callable[[], Any]], repeats: int, calls: int) -> dict[str, float]:
    """Median microseconds per call of each side, the sides taking turns repeat by repeat."""
    for fn in sides.values():
        per_call_us(fn, max(calls // 10, 50))
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            times[name].append(per_call_us(fn, calls))
    return {name: median(values) for name, values in times.items()}


def main() -> None:
    report = Report.from_argv("replay", description=__doc__)
    repeats, calls = 15, 2000
    rng = np.random.default_rng(0)
    w1_h, b1_h, w2_h = (rng.standard_normal(s).astype(np.float32) for s in ((64, 64), (64,), (64, 10)))
    w1, b1, w2 = td.Tensor(w1_h), td.Tensor(b1_h), td.Tensor(w2_h)

    @td.jit
    def step(x: td.Tensor) -> td.Tensor:
        return (x @ w1 + b1).relu() @ w2

    frame = rng.standard_normal((1, 64)).astype(np.float32)
    x = td.Tensor(frame)
    reference = np.maximum(frame.astype(np.float64) @ w1_h + b1_h, 0) @ w2_h
    for _ in range(3):
        np.testing.assert_allclose(step(x).numpy(), reference, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(step.call_numpy(frame), reference, rtol=1e-4, atol=1e-4)
    assert step.captured is not None and step.captured.strategy.name == "entry"

    sides: dict[str, Callable[[], Any]] = {
        "tensor": lambda: step(x).numpy(),
        "fresh": lambda: step(td.Tensor(frame)).numpy(),
        "numpy": lambda: step.call_numpy(frame),
        "numpy-baseline": lambda: np.maximum(frame @ w1_h + b1_h, 0) @ w2_h,
    }
    try:
        import torch
        torch.set_num_threads(1)
        tw1, tb1, tw2 = (torch.from_numpy(a) for a in (w1_h, b1_h, w2_h))

        def torch_forward() -> np.ndarray:
            with torch.no_grad():
                return torch.relu(torch.from_numpy(frame) @ tw1 + tb1).matmul(tw2).numpy()
        np.testing.assert_allclose(torch_forward(), reference, rtol=1e-4, atol=1e-4)
        sides["torch"] = torch_forward
    except ImportError:
        report.note("torch is not installed (pip install 'tinydist[bench]'): no PyTorch baseline")
    result = alternate(sides, repeats, calls)

    entry = step.captured.strategy
    frame_fn = step.captured.capture.frame
    device = get_engine().device(x.device)
    queue = device.queues["compute"]
    noop = (device.host_copy(), (entry.output_copies[0][0], entry.output_copies[0][0], 0))
    addresses = (frame.ctypes.data, np.empty((1, 10), np.float32).ctypes.data)
    computed = step(x)
    parts = alternate({
        "native": entry.entry.cfunc,
        "frame": lambda: frame_fn.frame(*addresses),
        "submission": lambda: queue.submit([noop], inline=True),
        "Tensor(frame)": lambda: td.Tensor(frame),
        ".numpy()": computed.numpy,
    }, repeats, calls)

    baseline = result["numpy-baseline"]
    for name, label in (("tensor", "step(x).numpy()"), ("fresh", "step(td.Tensor(frame)).numpy()"),
                        ("numpy", "step.call_numpy(frame)")):
        value = result[name]
        detail = f"torch {result['torch']:.2f} us, torch/ours {result['torch'] / value:.2f}x" if "torch" in result else None
        report.add(f"replay/{name}", value, "us per frame", value_label=label, baseline=baseline,
                   baseline_label="numpy forward", ratio=baseline / value, ratio_label="numpy/ours", detail=detail,
                   target=f"<={TARGETS[name]:g} us", passed=value <= TARGETS[name], repeats=repeats)
    floor = parts["submission"] + parts["native"]
    report.add("replay/breakdown", result["tensor"], "us", value_label="step(x).numpy()",
               detail=(f"native entry {parts['native']:.2f}, one inline submission {parts['submission']:.2f}, "
                       f".numpy() {parts['.numpy()']:.2f}, Python bookkeeping of the call "
                       f"{result['tensor'] - floor - parts['.numpy()']:.2f}"), repeats=repeats)
    report.add("replay/breakdown", result["fresh"], "us", value_label="step(td.Tensor(frame)).numpy()",
               detail=(f"Tensor(frame) {parts['Tensor(frame)']:.2f} (its buffer freed again when the frame's "
                       f"Tensor goes: the rest of {result['fresh'] - result['tensor']:.2f} over step(x))"), repeats=repeats)
    report.add("replay/breakdown", result["numpy"], "us", value_label="step.call_numpy(frame)",
               detail=(f"frame function {parts['frame']:.2f} (of which the entry {parts['native']:.2f}), one inline "
                       f"submission {parts['submission']:.2f}, Python bookkeeping "
                       f"{result['numpy'] - parts['frame'] - parts['submission']:.2f}"), repeats=repeats)
    report.finish()


if __name__ == "__main__":
    main()
