"""The main job on the embedded default: local CPU devices, nothing external.

1. a fused tensor graph (matmul, softmax, reductions) checked against numpy;
2. a small MLP captured with td.jit and replayed per frame, numpy in → numpy out;
3. a tensor sharded over several CPU devices, reduced over the sharded axis (an allreduce), with
   the devices' kernels running at the same time on their own worker threads.
"""

from __future__ import annotations

import os
import time

import numpy as np

import tinydist as td


def _fused_graph(rng: np.random.Generator) -> float:
    x = rng.standard_normal((256, 128)).astype(np.float32)
    w = rng.standard_normal((128, 64)).astype(np.float32)
    got = (td.Tensor(x) @ td.Tensor(w)).relu().softmax(axis=1).sum(axis=0).numpy()
    h = np.maximum(x @ w, 0)
    e = np.exp(h - h.max(1, keepdims=True))
    expected = (e / e.sum(1, keepdims=True)).sum(0)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    return float(np.abs(got - expected).max())


def _jit_frames(rng: np.random.Generator, frames: int = 500) -> tuple[float, float]:
    w1 = td.Tensor(rng.standard_normal((64, 64)).astype(np.float32) / 8)
    w2 = td.Tensor(rng.standard_normal((64, 10)).astype(np.float32) / 8)

    @td.jit
    def mlp(x: td.Tensor) -> td.Tensor:
        return (x @ w1).relu().matmul(w2).softmax()

    frame = rng.standard_normal((1, 64)).astype(np.float32)
    for _ in range(3):  # run, capture, first replay
        mlp.call_numpy(frame)
    latencies = []
    for _ in range(frames):
        start = time.perf_counter()
        out = mlp.call_numpy(frame)
        latencies.append(time.perf_counter() - start)
    h = np.maximum(frame @ w1.numpy(), 0) @ w2.numpy()
    e = np.exp(h - h.max(-1, keepdims=True))
    np.testing.assert_allclose(out, e / e.sum(-1, keepdims=True), rtol=1e-4, atol=1e-6)
    p50, p99 = np.percentile(latencies, [50, 99]) * 1e6
    return float(p50), float(p99)


def _sharded(rng: np.random.Generator, devices: list[str]) -> tuple[float, float]:
    """Steady-state milliseconds for exp(x).sum(0) sharded over `devices` and on one device."""
    x = rng.standard_normal((len(devices) * 512, 8192)).astype(np.float32)
    sharded = td.Tensor(x).shard(devices, axis=0).realize()
    whole = td.Tensor(x)
    timings = {}
    for label, tensor in (("sharded", sharded), ("one", whole)):
        best = float("inf")
        for _ in range(3):  # the first run compiles; keep the best of the rest
            start = time.perf_counter()
            total = (tensor.exp() * 0.5).sum(axis=0)
            result = total.numpy()
            best = min(best, time.perf_counter() - start)
        np.testing.assert_allclose(result, (np.exp(x) * 0.5).sum(0), rtol=1e-4)
        timings[label] = best * 1e3
    return timings["sharded"], timings["one"]


def main() -> None:
    rng = np.random.default_rng(0)
    usable = [info.name for info in td.discover() if info.usable]
    print(f"tinydist demo on {', '.join(usable)}")
    error = _fused_graph(rng)
    print(f"  fused graph  softmax(relu(x @ w)).sum(0) equals numpy (max abs error {error:.2e})")
    p50, p99 = _jit_frames(rng)
    print(f"  td.jit MLP   64->64->10 per frame, numpy in -> numpy out: p50 {p50:.1f} us, p99 {p99:.1f} us")
    # one device per core (at least two): more would only take turns on the same cores
    devices = [name for name in usable if name.startswith("CPU:")][:max(2, min(4, os.cpu_count() or 2))]
    sharded_ms, one_ms = _sharded(rng, devices)
    print(f"  sharded      exp(x).sum(0) of {len(devices) * 512}x8192 over {len(devices)} devices (allreduce) equals numpy: "
          f"{sharded_ms:.1f} ms vs {one_ms:.1f} ms on one device ({one_ms / sharded_ms:.2f}x on this machine's cores)")
