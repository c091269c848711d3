"""Per-frame ONNX inference latency: tinydist.onnx vs onnxruntime (one thread), same run, same models.

Each frame is numpy in → numpy out. Models (built here with onnx.helper, seeded weights):
  mlp: Gemm 64→64, Relu, Gemm 64→10, batch 1
  cnn: Conv(3→8, 3x3) BN Relu MaxPool Conv(8→16, 3x3, s2) Relu GlobalAveragePool Gemm(16→10) Softmax, 1x3x32x32

Prints p50/p90/p99 over --frames frames (after --warmup) for both, and the p50 ratio tinydist/onnxruntime.
tinydist runs twice: `model(feed)` as users call it (captured with td.jit on its second call, then
replayed: numpy in, one native entry point, numpy out), and the eager path that builds, schedules
and realizes the lazy graph every frame (what every call would cost without the JIT).

    .venv/bin/python bench/onnx_infer.py [--frames 300] [--warmup 20]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import tinydist as td
import tinydist.onnx as tdo

N = helper.make_node


def _model(nodes, x_shape, out, inits):
    graph = helper.make_graph(nodes, "bench", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, [1, 10])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def mlp(rng):
    w = lambda *s: (rng.standard_normal(s) * 0.2).astype(np.float32)  # noqa: E731
    nodes = [N("Gemm", ["x", "w1", "b1"], ["h"], transB=1), N("Relu", ["h"], ["a"]), N("Gemm", ["a", "w2", "b2"], ["y"], transB=1)]
    return _model(nodes, (1, 64), "y", {"w1": w(64, 64), "b1": w(64), "w2": w(10, 64), "b2": w(10)}), (1, 64)


def cnn(rng):
    w = lambda *s: (rng.standard_normal(s) * 0.2).astype(np.float32)  # noqa: E731
    nodes = [N("Conv", ["x", "c1w", "c1b"], ["c1"], pads=[1, 1, 1, 1]),
             N("BatchNormalization", ["c1", "s", "b", "m", "v"], ["bn"]), N("Relu", ["bn"], ["r1"]),
             N("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
             N("Conv", ["p1", "c2w"], ["c2"], strides=[2, 2], pads=[1, 1, 1, 1]), N("Relu", ["c2"], ["r2"]),
             N("GlobalAveragePool", ["r2"], ["g"]), N("Flatten", ["g"], ["f"]),
             N("Gemm", ["f", "fw", "fb"], ["l"], transB=1), N("Softmax", ["l"], ["y"])]
    inits = {"c1w": w(8, 3, 3, 3), "c1b": w(8), "s": 1 + w(8), "b": w(8), "m": w(8), "v": 1 + np.abs(w(8)),
             "c2w": w(16, 8, 3, 3), "fw": w(10, 16), "fb": w(10)}
    return _model(nodes, (1, 3, 32, 32), "y", inits), (1, 3, 32, 32)


def percentiles(fn, frames, warmup):
    for _ in range(warmup):
        fn()
    times = np.empty(frames)
    for i in range(frames):
        start = time.perf_counter()
        fn()
        times[i] = time.perf_counter() - start
    return np.percentile(times, [50, 90, 99]) * 1e6


def tinydist_runners(model, x):
    """(label, frame function) pairs: model(feed) (JIT replay), and the eager graph path."""
    loaded = tdo.load(model)
    eager = tdo.load(model)
    return [("tinydist model(feed) (jit replay)", lambda: loaded({"x": x})["y"]),
            ("tinydist eager (graph per frame)", lambda: eager.run_tensors({"x": td.Tensor(x)})[0].numpy())]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=300, help="timed frames per runtime (default 300)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed frames first (default 20)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"frames {args.frames} after {args.warmup} warm-up; latency per frame in µs (numpy in -> numpy out)")
    print(f"{'model':<5} {'runtime':<36} {'p50':>9} {'p90':>9} {'p99':>9}")
    for name, build in (("mlp", mlp), ("cnn", cnn)):
        model, shape = build(rng)
        x = rng.standard_normal(shape).astype(np.float32)
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        expected = session.run(None, {"x": x})[0]
        theirs = percentiles(lambda: session.run(None, {"x": x}), args.frames, args.warmup)
        print(f"{name:<5} {'onnxruntime (1 thread)':<36} {theirs[0]:>9.1f} {theirs[1]:>9.1f} {theirs[2]:>9.1f}")
        for label, run in tinydist_runners(model, x):
            np.testing.assert_allclose(run(), expected, rtol=1e-4, atol=1e-5)
            ours = percentiles(run, args.frames, args.warmup)
            print(f"{name:<5} {label:<36} {ours[0]:>9.1f} {ours[1]:>9.1f} {ours[2]:>9.1f}"
                  f"   p50 ratio vs onnxruntime {ours[0] / theirs[0]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
