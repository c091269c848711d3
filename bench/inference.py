"""Per-frame inference latency (numpy in → numpy out, batch 1): tinydist vs onnxruntime vs tinygrad.

Three models built offline with onnx.helper (random weights, fixed seed):
  mlp          784-256-256-10: Gemm, Relu, Gemm, Relu, Gemm, Softmax
  cnn          1x3x64x64: Conv(3→16) Relu MaxPool Conv(16→32) Relu GlobalAveragePool Gemm(32→10)
  transformer  one block, seq 64, width 128: MatMul/Add (QKV, out, FFN), Softmax attention,
               LayerNormalization ×2, residuals

Every runtime's output is checked against onnxruntime first. Printed per model: p50 (and p90)
microseconds per frame for tinydist (`td.onnx.load(model)(feed)`, which captures with td.jit and
replays), onnxruntime with one thread, and tinygrad TinyJit on the same weights (when tinygrad is
installed: `pip install tinygrad`), with ratios against onnxruntime. Also the first-call time
(load, capture, compile) with a cold and with a warm on-disk compile cache.

    .venv/bin/python bench/inference.py [--frames 300] [--warmup 20] [--models mlp,cnn,transformer]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

N = helper.make_node
ROOT = Path(__file__).resolve().parents[1]


def _weights(seed: int = 0):
    rng = np.random.default_rng(seed)
    return lambda *shape, scale=0.1: (rng.standard_normal(shape) * scale).astype(np.float32)


def _model(nodes, x_shape, y_shape, inits, opset=17):
    graph = helper.make_graph(nodes, "bench", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(y_shape))],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def mlp_model():
    w = _weights(1)
    inits = {"w1": w(256, 784), "b1": w(256), "w2": w(256, 256), "b2": w(256), "w3": w(10, 256), "b3": w(10)}
    nodes = [N("Gemm", ["x", "w1", "b1"], ["h1"], transB=1), N("Relu", ["h1"], ["a1"]),
             N("Gemm", ["a1", "w2", "b2"], ["h2"], transB=1), N("Relu", ["h2"], ["a2"]),
             N("Gemm", ["a2", "w3", "b3"], ["l"], transB=1), N("Softmax", ["l"], ["y"], axis=-1)]
    return _model(nodes, (1, 784), (1, 10), inits), inits, (1, 784)


def cnn_model():
    w = _weights(2)
    inits = {"c1w": w(16, 3, 3, 3), "c1b": w(16), "c2w": w(32, 16, 3, 3), "c2b": w(32), "fw": w(10, 32), "fb": w(10)}
    nodes = [N("Conv", ["x", "c1w", "c1b"], ["c1"], pads=[1, 1, 1, 1]), N("Relu", ["c1"], ["r1"]),
             N("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
             N("Conv", ["p1", "c2w", "c2b"], ["c2"], pads=[1, 1, 1, 1]), N("Relu", ["c2"], ["r2"]),
             N("GlobalAveragePool", ["r2"], ["g"]), N("Flatten", ["g"], ["f"]),
             N("Gemm", ["f", "fw", "fb"], ["y"], transB=1)]
    return _model(nodes, (1, 3, 64, 64), (1, 10), inits), inits, (1, 3, 64, 64)


def transformer_model(seq: int = 64, width: int = 128, ffn: int = 512):
    w = _weights(3)
    inits = {"wq": w(width, width), "wk": w(width, width), "wv": w(width, width), "wo": w(width, width),
             "g1": 1 + w(width), "be1": w(width), "w1": w(width, ffn), "bf1": w(ffn), "w2": w(ffn, width),
             "bf2": w(width), "g2": 1 + w(width), "be2": w(width), "scale": np.array(width ** -0.5, np.float32)}
    nodes = [N("MatMul", ["x", "wq"], ["q"]), N("MatMul", ["x", "wk"], ["k"]), N("MatMul", ["x", "wv"], ["v"]),
             N("Transpose", ["k"], ["kt"], perm=[0, 2, 1]), N("MatMul", ["q", "kt"], ["s0"]),
             N("Mul", ["s0", "scale"], ["s"]), N("Softmax", ["s"], ["p"], axis=-1), N("MatMul", ["p", "v"], ["att"]),
             N("MatMul", ["att", "wo"], ["o"]), N("Add", ["x", "o"], ["r1"]),
             N("LayerNormalization", ["r1", "g1", "be1"], ["n1"], axis=-1, epsilon=1e-5),
             N("MatMul", ["n1", "w1"], ["f1"]), N("Add", ["f1", "bf1"], ["f2"]), N("Relu", ["f2"], ["f3"]),
             N("MatMul", ["f3", "w2"], ["f4"]), N("Add", ["f4", "bf2"], ["f5"]), N("Add", ["n1", "f5"], ["r2"]),
             N("LayerNormalization", ["r2", "g2", "be2"], ["y"], axis=-1, epsilon=1e-5)]
    return _model(nodes, (1, seq, width), (1, seq, width), inits), inits, (1, seq, width)


MODELS = {"mlp": mlp_model, "cnn": cnn_model, "transformer": transformer_model}


# ---- tinygrad versions of the same models (same weights) -------------------------------------------

def tinygrad_runner(name: str, inits: dict[str, np.ndarray]):
    os.environ.setdefault("DEV", "CPU")
    from tinygrad import Tensor, TinyJit
    W = {k: Tensor(v).realize() for k, v in inits.items()}

    def mlp(x):
        h = (x @ W["w1"].T + W["b1"]).relu()
        h = (h @ W["w2"].T + W["b2"]).relu()
        return (h @ W["w3"].T + W["b3"]).softmax(-1)

    def cnn(x):
        h = x.conv2d(W["c1w"], W["c1b"], padding=1).relu().max_pool2d(2)
        h = h.conv2d(W["c2w"], W["c2b"], padding=1).relu().mean(axis=(2, 3))
        return h @ W["fw"].T + W["fb"]

    def transformer(x):
        q, k, v = x @ W["wq"], x @ W["wk"], x @ W["wv"]
        att = ((q @ k.transpose(1, 2)) * W["scale"]).softmax(-1) @ v
        n1 = (x + att @ W["wo"]).layernorm(-1, 1e-5) * W["g1"] + W["be1"]
        f = ((n1 @ W["w1"] + W["bf1"]).relu() @ W["w2"]) + W["bf2"]
        return (n1 + f).layernorm(-1, 1e-5) * W["g2"] + W["be2"]

    fn = TinyJit(lambda x: {"mlp": mlp, "cnn": cnn, "transformer": transformer}[name](x).realize())
    return lambda frame: fn(Tensor(frame)).numpy()


# ---- measuring ------------------------------------------------------------------------------------

def percentiles(run, frame, frames: int, warmup: int) -> tuple[float, float]:
    for _ in range(warmup):
        run(frame)
    times = []
    for _ in range(frames):
        start = time.perf_counter()
        run(frame)
        times.append(time.perf_counter() - start)
    p50, p90 = np.percentile(times, [50, 90]) * 1e6
    return float(p50), float(p90)


def first_call_ms(model_path: Path, cache_dir: Path, x_shape: tuple[int, ...]) -> float:
    """Load + three calls (run, capture, first replay) in a fresh process with the given cache."""
    code = f"""
import time, numpy as np, tinydist.onnx as tdo
x = np.zeros({x_shape!r}, np.float32)
start = time.perf_counter()
model = tdo.load({str(model_path)!r})
for _ in range(3):
    model({{"x": x}})
print((time.perf_counter() - start) * 1e3)
"""
    env = dict(os.environ, TINYDIST_CACHE_DIR=str(cache_dir))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--frames", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--models", default="mlp,cnn,transformer")
    args = parser.parse_args()
    import tinydist.onnx as tdo
    try:
        import tinygrad  # noqa: F401
        have_tinygrad = True
    except ImportError:
        have_tinygrad = False
    targets = {"mlp": 1.5, "cnn": 2.0, "transformer": 1.5}
    print(f"p50 / p90 latency per frame in µs, numpy in -> numpy out, batch 1; {args.frames} frames after {args.warmup} warm-up")
    for name in args.models.split(","):
        model, inits, x_shape = MODELS[name]()
        frame = np.random.default_rng(7).standard_normal(x_shape).astype(np.float32)
        options = ort.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        reference = session.run(None, {"x": frame})[0]
        loaded = tdo.load(model)
        np.testing.assert_allclose(loaded({"x": frame})["y"], reference, rtol=1e-4, atol=1e-5)
        ort_p50, ort_p90 = percentiles(lambda f: session.run(None, {"x": f}), frame, args.frames, args.warmup)
        td_p50, td_p90 = percentiles(lambda f: loaded({"x": f})["y"], frame, args.frames, args.warmup)
        verdict = "PASS" if td_p50 <= targets[name] * ort_p50 else "MISS"
        print(f"{name:<12} onnxruntime (1 thread) {ort_p50:9.1f} / {ort_p90:9.1f}")
        print(f"{name:<12} tinydist               {td_p50:9.1f} / {td_p90:9.1f}   {td_p50 / ort_p50:5.2f}x onnxruntime "
              f"(target <= {targets[name]}x: {verdict})")
        tg_reason = "not installed (pip install tinygrad)" if not have_tinygrad else ""
        if have_tinygrad:
            try:
                tg = tinygrad_runner(name, inits)
                np.testing.assert_allclose(tg(frame), reference, rtol=1e-3, atol=1e-4)
            except (RuntimeError, OSError) as exc:  # e.g. its CPU back end needs a clang binary
                tg_reason = f"cannot run here ({type(exc).__name__}: {str(exc).splitlines()[-1][:80]})"
        if tg_reason:
            print(f"{name:<12} tinygrad TinyJit: {tg_reason}, skipped")
        else:
            tg_p50, tg_p90 = percentiles(tg, frame, args.frames, args.warmup)
            print(f"{name:<12} tinygrad TinyJit       {tg_p50:9.1f} / {tg_p90:9.1f}   {tg_p50 / ort_p50:5.2f}x onnxruntime, "
                  f"tinydist {tg_p50 / td_p50:5.1f}x faster")
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"{name}.onnx"
            onnx.save(model, path)
            cold = first_call_ms(path, Path(tmp) / "cache", x_shape)
            warm = first_call_ms(path, Path(tmp) / "cache", x_shape)
        print(f"{name:<12} first call (load + capture + compile): cold cache {cold:.0f} ms, warm cache {warm:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
