"""What a captured replay costs per frame, and what each microsecond of it is spent on.

The 64-64-10 MLP `((x @ w1 + b1).relu() @ w2)` on one frame (batch 1, float32), captured with
td.jit and replayed through each entry a user reaches for:

    tensor   `step(x).numpy()`                 x an existing td.Tensor          target <= 10 us
    fresh    `step(td.Tensor(frame)).numpy()`  a new Tensor from the frame      target <= 15 us
    numpy    `step.call_numpy(frame)`          numpy in, numpy out              target <= 6 us

next to the same forward pass in numpy and in PyTorch (one thread, no_grad, from_numpy in and
numpy out), measured in the same run: medians of repeats, the sides alternating repeat by
repeat. Each line gives the thread's CPU time too: on a machine other work keeps busy the wall
clock counts the waits for a core, the CPU time mostly not (the frame loop runs on the calling
thread). Then the breakdown — the parts timed on their own, the same way:

    native        the linked entry point alone (the three kernels, addresses baked in)
    frame         the native frame function over buffers (copies in, the entry, copies out):
                  what a Tensor replay runs
    inline run    the entry run through `CommandQueue.run_if_idle` (the idle check and the
                  submit lock held around it), less the entry: what every replay pays to run
                  on the caller's thread in the queue's order
    submission    one no-op command through the compute queue, inline: what a replay paid
                  before, and still pays when the queue has unfinished work
    host frame    `HostFrame.run`: call_numpy's work below the frontend (access checks, the
                  inline run, numpy's copies into and out of views of the capture's buffers)
    wrap          making the output Tensor around a computed buffer
    Tensor(frame) making a Tensor from a frame and dropping it (allocation, upload, release)
    .numpy()      reading a computed Tensor back

The rest of each entry's time is Python bookkeeping of the call: checking the arguments,
choosing output buffers from the pool, the access checks, rebuilding the result.

    .venv/bin/python bench/replay.py [--json PATH]
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
from tinydist.graph.lazy import buffer_node  # noqa: E402
from tinydist.runtime.engine import get_engine  # noqa: E402

TARGETS = {"tensor": 10.0, "fresh": 15.0, "numpy": 6.0}


def per_call_us(fn: Callable[[], Any], calls: int) -> tuple[float, float]:
    """Microseconds per call, on the wall clock and in this thread's CPU time."""
    start, start_cpu = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6, (time.thread_time() - start_cpu) / calls * 1e6


def alternate(sides: dict[str, Callable[[], Any]], repeats: int, calls: int,
              cpu: dict[str, float] | None = None) -> dict[str, float]:
    """Median wall-clock microseconds per call of each side, the sides taking turns repeat by
    repeat; the medians of this thread's CPU time go into `cpu`, when given."""
    for fn in sides.values():
        per_call_us(fn, max(calls // 10, 50))
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            times[name].append(per_call_us(fn, calls))
    if cpu is not None:
        cpu.update({name: median([c for _, c in values]) for name, values in times.items()})
    return {name: median([w for w, _ in values]) for name, values in times.items()}


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
    assert step.captured is not None and step.captured.strategy.name == "entry" and step.captured.capture.frame is not None

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
    cpu: dict[str, float] = {}
    result = alternate(sides, repeats, calls, cpu)

    entry = step.captured.strategy
    host = step.captured.capture.frame
    device = get_engine().device(x.device)
    queue = device.queues["compute"]
    noop = (device.host_copy(), (entry.output_copies[0][0], entry.output_copies[0][0], 0))
    computed = step(x)
    addresses = (x.node.buffer.address, computed.node.buffer.address)
    spec = step.captured.capture.output_specs[0]
    parts = alternate({
        "native": entry.entry.cfunc,
        "frame": lambda: host.frame(*addresses),
        "inline run": lambda: queue.run_if_idle(entry.entry.cfunc, ()),
        "submission": lambda: queue.submit([noop], inline=True),
        "host frame": lambda: host.run((frame,)),
        "wrap": lambda: td.Tensor(buffer_node(computed.node.buffer, spec[1], spec[0], spec[2])),
        "Tensor(frame)": lambda: td.Tensor(frame),
        ".numpy()": computed.numpy,
    }, repeats, calls)

    baseline = result["numpy-baseline"]
    for name, label in (("tensor", "step(x).numpy()"), ("fresh", "step(td.Tensor(frame)).numpy()"),
                        ("numpy", "step.call_numpy(frame)")):
        value = result[name]
        detail = f"thread CPU time {cpu[name]:.2f} us, numpy's {cpu['numpy-baseline']:.2f} us"
        if "torch" in result:
            detail += f"; torch {result['torch']:.2f} us, torch/ours {result['torch'] / value:.2f}x"
        report.add(f"replay/{name}", value, "us per frame", value_label=label, baseline=baseline,
                   baseline_label="numpy forward", ratio=baseline / value, ratio_label="numpy/ours", detail=detail,
                   target=f"<={TARGETS[name]:g} us", passed=value <= TARGETS[name], repeats=repeats)
    run_cost = parts["inline run"] - parts["native"]
    tensor_parts = parts["frame"] + run_cost + parts["wrap"] + parts[".numpy()"]
    report.add("replay/breakdown", result["tensor"], "us", value_label="step(x).numpy()",
               detail=(f"native entry {parts['native']:.2f}, frame copies {parts['frame'] - parts['native']:.2f}, "
                       f"inline run on the idle queue {run_cost:.2f} (a submission would be {parts['submission']:.2f}), "
                       f"output Tensor {parts['wrap']:.2f}, .numpy() {parts['.numpy()']:.2f}, Python bookkeeping of the "
                       f"call {result['tensor'] - tensor_parts:.2f}"), repeats=repeats)
    report.add("replay/breakdown", result["fresh"], "us", value_label="step(td.Tensor(frame)).numpy()",
               detail=(f"Tensor(frame) made and dropped {parts['Tensor(frame)']:.2f}, step(x).numpy() {result['tensor']:.2f}, "
                       f"the rest {result['fresh'] - result['tensor'] - parts['Tensor(frame)']:.2f}"), repeats=repeats)
    report.add("replay/breakdown", result["numpy"], "us", value_label="step.call_numpy(frame)",
               detail=(f"host frame {parts['host frame']:.2f} (native entry {parts['native']:.2f}, inline run {run_cost:.2f}, "
                       f"numpy copies and access checks {parts['host frame'] - parts['inline run']:.2f}), "
                       f"frontend bookkeeping {result['numpy'] - parts['host frame']:.2f}"), repeats=repeats)
    report.finish()


if __name__ == "__main__":
    main()
