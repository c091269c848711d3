"""The real-architecture set against onnxruntime: one table, p50 per frame, ratios from the same run.

The models are the ONNX coverage tests' (tests/onnx/architectures/models/, exported by
`python -m tests.onnx.architectures.export` from torchvision, timm and transformers code with random
weights under fixed seeds; the exporter's default opset), and two full-size models built here with
onnx.helper (seeded random weights): `bert6_384`, the issue's BERT-class encoder (6 layers, hidden
384, 12 heads, sequence 64), and `resnet18` at 224x224 — the coverage set is shrunk to ~100k
parameters, so its frames are too small to show what threads do. Per model, batch and thread count, one
process holds tinydist (`td.onnx.load(path, threads=T)`, called as users call it: captured with
td.jit on its second call, then replayed, numpy in -> numpy out) and onnxruntime
(`intra_op_num_threads=T`, `inter_op_num_threads=1`); the frames alternate between them, so a
load spike on this shared machine falls on both sides; at T > 1 in runs of `--block` (4) frames,
each run once the process is idle (`settle`: onnxruntime's workers spin ~25 ms after each call,
which took a core from tinydist's T-thread frames timed right after one). Every output is checked against
onnxruntime first, with the coverage tests' tolerance (max |diff| <= 2e-5 * max |onnxruntime|).

Printed per row: both p50s (µs), their ratio tinydist/onnxruntime, and at T > 1 each side's
speedup over its own 1-thread p50 of this run. Then the 1-thread median and worst ratios against
the issue's targets, and the first call (load + capture + compile, in a fresh process) of the
models `--first-call` names, with a cold and with a warm on-disk compile cache.

    .venv/bin/python bench/architectures.py [--frames 200] [--warmup 20] [--seconds 2] [--batches 1,8] [--block 4] [--no-settle]
                                            [--threads 1,2] [--models resnet,bert,...,bert6_384,resnet18]
                                            [--first-call resnet18,bert6_384,resnet,bert]
                                            [--first-call-threads 1,default]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "tests" / "onnx" / "architectures" / "models"
MANIFEST: dict[str, Any] = json.loads((MODELS / "manifest.json").read_text())
ARCHITECTURES = sorted(entry["model"] for name, entry in MANIFEST.items() if name.endswith("_default.onnx"))
SCALE_TOL = 2e-5  # tests/onnx/test_architectures.py's
N = helper.make_node


# ---- full-size models, built here (the coverage set is shrunk to ~100k parameters: a frame of it
# is 30-600 µs of ~50 calls of a few µs each, too small for threads to pay on either side) ----

class _Graph:
    """An ONNX graph under construction: nodes, seeded random initializers, fresh names."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[Any] = []
        self.inits: list[Any] = []
        self.count = 0

    def name(self, stem: str) -> str:
        self.count += 1
        return f"{stem}{self.count}"

    def weight(self, *shape: int, scale: float | None = None, value: np.ndarray | None = None) -> str:
        name = self.name("w")
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
        data = value if value is not None else \
            (self.rng.standard_normal(shape) * (scale if scale is not None else fan_in ** -0.5)).astype(np.float32)
        self.inits.append(numpy_helper.from_array(data, name))
        return name

    def op(self, op_type: str, inputs: list[str], **attrs: Any) -> str:
        out = self.name(op_type.lower())
        self.nodes.append(N(op_type, inputs, [out], **attrs))
        return out

    def model(self, inputs: list[Any], output: str, output_shape: list[Any], opset: int) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, "bench", inputs,
                                  [helper.make_tensor_value_info(output, TensorProto.FLOAT, output_shape)], self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        model.ir_version = 9
        onnx.checker.check_model(model)
        return model


def bert_encoder(layers: int = 6, hidden: int = 384, heads: int = 12, seq: int = 64, vocab: int = 1000) -> onnx.ModelProto:
    """The issue's BERT-class encoder: token and position embeddings, LayerNorm, then `layers`
    post-norm blocks (QKV projections, 12-head softmax attention, output projection, residual,
    LayerNorm, GELU feed-forward of 4x width, residual, LayerNorm); 1.4 GFLOP per sequence of 64."""
    g = _Graph(21)
    dim = hidden // heads
    ids = "input_ids"
    h = g.op("Gather", [g.weight(vocab, hidden, scale=0.5), ids])
    h = g.op("Add", [h, g.weight(seq, hidden, scale=0.5)])

    def norm(x: str) -> str:
        return g.op("LayerNormalization", [x, g.weight(hidden, value=np.ones(hidden, np.float32)),
                                           g.weight(hidden, scale=0.1)], axis=-1, epsilon=1e-12)

    def linear(x: str, n_in: int, n_out: int) -> str:
        return g.op("Add", [g.op("MatMul", [x, g.weight(n_in, n_out, scale=n_in ** -0.5)]), g.weight(n_out, scale=0.1)])

    split = g.weight(4, value=np.array([0, 0, heads, dim], np.int64))
    merge = g.weight(3, value=np.array([0, 0, hidden], np.int64))
    scale = g.weight(1, value=np.array([dim ** -0.5], np.float32))
    h = norm(h)
    for _ in range(layers):
        q, k, v = (g.op("Reshape", [linear(h, hidden, hidden), split]) for _ in range(3))
        q = g.op("Transpose", [q], perm=[0, 2, 1, 3])
        k = g.op("Transpose", [k], perm=[0, 2, 3, 1])
        v = g.op("Transpose", [v], perm=[0, 2, 1, 3])
        p = g.op("Softmax", [g.op("Mul", [g.op("MatMul", [q, k]), scale])], axis=-1)
        ctx = g.op("Reshape", [g.op("Transpose", [g.op("MatMul", [p, v])], perm=[0, 2, 1, 3]), merge])
        h = norm(g.op("Add", [h, linear(ctx, hidden, hidden)]))
        f = linear(g.op("Gelu", [linear(h, hidden, 4 * hidden)]), 4 * hidden, hidden)
        h = norm(g.op("Add", [h, f]))
    inputs = [helper.make_tensor_value_info(ids, TensorProto.INT64, ["batch", seq])]
    return g.model(inputs, h, ["batch", seq, hidden], opset=20)


def resnet18(image: int = 224, classes: int = 1000) -> onnx.ModelProto:
    """torchvision's resnet18 structure: 7x7/2 stem, max pool, four stages of two basic blocks
    (64-512 channels; a 1x1/2 projection where a stage halves the size), every convolution followed
    by BatchNormalization, global average pool, a 1000-way Gemm; 1.8 GFLOP at 224x224."""
    g = _Graph(18)

    def conv_bn(x: str, c_in: int, c_out: int, k: int, stride: int, relu: bool) -> str:
        y = g.op("Conv", [x, g.weight(c_out, c_in, k, k)], kernel_shape=[k, k], strides=[stride, stride],
                 pads=[k // 2] * 4)
        bn = [g.weight(c_out, value=(1 + 0.1 * g.rng.standard_normal(c_out)).astype(np.float32)),
              g.weight(c_out, scale=0.1), g.weight(c_out, scale=0.1),
              g.weight(c_out, value=(1 + 0.1 * np.abs(g.rng.standard_normal(c_out))).astype(np.float32))]
        y = g.op("BatchNormalization", [y, *bn], epsilon=1e-5)
        return g.op("Relu", [y]) if relu else y

    h = conv_bn("x", 3, 64, 7, 2, True)
    h = g.op("MaxPool", [h], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    c_in = 64
    for stage, c_out in enumerate((64, 128, 256, 512)):
        for block in range(2):
            stride = 2 if stage and not block else 1
            y = conv_bn(conv_bn(h, c_in, c_out, 3, stride, True), c_out, c_out, 3, 1, False)
            shortcut = conv_bn(h, c_in, c_out, 1, stride, False) if stride != 1 or c_in != c_out else h
            h = g.op("Relu", [g.op("Add", [y, shortcut])])
            c_in = c_out
    h = g.op("Flatten", [g.op("GlobalAveragePool", [h])])
    h = g.op("Gemm", [h, g.weight(classes, 512), g.weight(classes, scale=0.1)], transB=1)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, image, image])]
    return g.model(inputs, h, ["batch", classes], opset=17)


# name -> (builder, its manifest-style entry: the inputs feeds() makes)
FULL_SIZE: dict[str, tuple[Callable[[], onnx.ModelProto], dict[str, Any]]] = {
    "bert6_384": (bert_encoder, {"inputs": [{"name": "input_ids", "shape": ["batch", 64], "dtype": "int64",
                                             "low": 0, "high": 1000}]}),
    "resnet18": (resnet18, {"inputs": [{"name": "x", "shape": ["batch", 3, 224, 224], "dtype": "float32",
                                        "low": -1.0, "high": 1.0}]}),
}


def model_file(arch: str, folder: Path) -> tuple[Path, dict[str, Any]]:
    """The .onnx file of `arch` (a coverage-set architecture, or a full-size model written into
    `folder`) and its manifest entry."""
    if arch in FULL_SIZE:
        build, entry = FULL_SIZE[arch]
        path = folder / f"{arch}.onnx"
        if not path.exists():
            onnx.save(build(), path)
        return path, entry
    path = MODELS / f"{arch}_default.onnx"
    if path.name not in MANIFEST:
        raise SystemExit(f"no model {arch!r}: the coverage set has {', '.join(ARCHITECTURES)}; built here: {', '.join(FULL_SIZE)}")
    return path, MANIFEST[path.name]


def feeds(entry: dict[str, Any], batch: int, seed: int) -> dict[str, np.ndarray]:
    """Inputs as the coverage tests make them: token ids over the vocabulary, right-padded masks,
    images and spectrograms uniform in the manifest's range."""
    rng = np.random.default_rng(seed)
    out = {}
    for spec in entry["inputs"]:
        shape = tuple(batch if d == "batch" else d for d in spec["shape"])
        if spec["name"] == "attention_mask":
            lengths = rng.integers(1, shape[1] + 1, shape[0])
            out[spec["name"]] = (np.arange(shape[1])[None, :] < lengths[:, None]).astype(np.int64)
        elif spec["dtype"] == "int64":
            out[spec["name"]] = rng.integers(spec["low"], spec["high"], shape, dtype=np.int64)
        else:
            out[spec["name"]] = rng.uniform(spec["low"], spec["high"], shape).astype(spec["dtype"])
    return out


def session(path: Path, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def settle(limit: float = 0.25) -> None:
    """Idle until this process's threads stop running (at most `limit` s). onnxruntime's intra-op
    workers spin after every call: 24-31 ms of their CPU in the 100 ms after a bert6_384 or
    resnet18 call at 2 threads (measured here), and 12-15 ms of it inside a 2-thread tinydist frame
    timed right after an onnxruntime call. With T threads on T cores, a side timed in the other's
    wake so runs with a core taken; tinydist's workers sleep ~40 µs after a frame, so only
    tinydist's T > 1 rows lost to it."""
    end = time.perf_counter() + limit
    while time.perf_counter() < end:
        cpu = time.process_time()
        time.sleep(0.005)
        if time.process_time() - cpu < 0.0005:
            return


def alternating_p50(ours: Callable[[], Any], theirs: Callable[[], Any], frames: int, warmup: int,
                    block: int, settled: bool = True) -> tuple[float, float]:
    """p50 seconds of `ours()` and of `theirs()`, timed in alternating blocks of `block` calls
    (warm-up calls first), each block after `settle()` unless not `settled`: the other side's
    workers have stopped spinning, and a side's own calls follow each other as in a user's loop."""
    for _ in range(warmup):
        ours()
        theirs()
    a: list[float] = []
    b: list[float] = []
    clock = time.perf_counter
    while len(a) < frames:
        for call, times in ((ours, a), (theirs, b)):
            if settled:
                settle()
            for _ in range(min(block, frames - len(times))):
                start = clock()
                call()
                times.append(clock() - start)
    return float(np.median(a)), float(np.median(b))


def check(model: Any, ort_session: ort.InferenceSession, entry: dict[str, Any], batch: int, where: str) -> None:
    feed = feeds(entry, batch, seed=1)
    for (name, have), want in zip(model(feed).items(), ort_session.run(None, feed)):
        scale = max(float(np.abs(want).max()), 1e-30)
        err = float(np.abs(have.astype(np.float64) - want).max()) if have.size else 0.0
        if have.shape != want.shape or err > SCALE_TOL * scale:
            raise SystemExit(f"{where} output {name!r}: {have.shape} vs onnxruntime {want.shape}, "
                             f"max |diff| {err:.3g} > {SCALE_TOL} * {scale:.3g}")


def first_call_ms(arch: str, folder: Path, cache_dir: Path, batch: int, threads: int | None) -> float:
    """Load + three calls (run, capture, first replay) in a fresh process with the given cache."""
    code = f"""
import sys, time
from pathlib import Path
sys.path.insert(0, {str(ROOT / 'bench')!r})
from architectures import feeds, model_file
import tinydist.onnx as tdo
path, entry = model_file({arch!r}, Path({str(folder)!r}))
feed = feeds(entry, {batch}, seed=0)
start = time.perf_counter()
model = tdo.load(str(path), threads={threads!r})
for _ in range(3):
    model(feed)
print((time.perf_counter() - start) * 1e3)
"""
    env = dict(os.environ, TINYDIST_CACHE_DIR=str(cache_dir), PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=200, help="timed frames per side and row (default 200)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed frames per side first (default 20)")
    parser.add_argument("--batches", default="1,8", help="batch sizes (default 1,8)")
    parser.add_argument("--threads", default="1,2", help="thread counts, both sides (default 1,2)")
    parser.add_argument("--block", type=int, default=4,
                        help="in T > 1 rows, frames per side in a row, each run of them after the process idled "
                             "(settle()); 1-thread rows alternate frame by frame (default 4)")
    parser.add_argument("--no-settle", action="store_true",
                        help="T > 1 rows too alternate frame by frame, without waiting for the other side's workers "
                             "to stop spinning")
    parser.add_argument("--seconds", type=float, default=2.0,
                        help="at most this long per side and row: fewer frames for the full-size models (default 2)")
    parser.add_argument("--models", default=",".join([*ARCHITECTURES, *FULL_SIZE]),
                        help=f"coverage-set architectures and full-size models ({', '.join(FULL_SIZE)}); default all")
    parser.add_argument("--first-call", default="resnet18,bert6_384,resnet,bert",
                        help="models whose first call is timed ('' for none)")
    parser.add_argument("--first-call-threads", default="1,default",
                        help="thread counts of the first calls ('default': load's own, this machine's CPUs)")
    args = parser.parse_args()
    import tinydist.onnx as tdo

    batches = [int(b) for b in args.batches.split(",")]
    thread_counts = [int(t) for t in args.threads.split(",")]
    print(f"# load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs")
    print(f"# p50 per frame (µs), numpy in -> numpy out; up to {args.frames} frames per side (at most {args.seconds:g} s) "
          f"after up to {args.warmup} warm-up, the sides alternating frame by frame"
          f"{'' if args.no_settle else f' (T > 1: every {args.block} frames, each run of them after the process idled)'}"
          "; ratio = tinydist / onnxruntime")
    print(f"{'model':<16} {'batch':>5} {'thr':>3} {'onnxruntime':>12} {'tinydist':>10} {'ratio':>7} {'td xT':>7} {'ort xT':>7}")
    ratios: dict[tuple[int, int], dict[str, float]] = {}
    speedups: dict[int, dict[str, float]] = {}
    folder = Path(tempfile.mkdtemp(prefix="tinydist-bench-"))
    for arch in filter(None, args.models.split(",")):
        path, entry = model_file(arch, folder)
        for batch in batches:
            feed = feeds(entry, batch, seed=0)
            single: tuple[float, float] | None = None
            for threads in thread_counts:
                model, theirs = tdo.load(str(path), threads=threads), session(path, threads)
                check(model, theirs, entry, batch, f"{arch} batch {batch} threads {threads}")
                start = time.perf_counter()
                model(feed)
                theirs.run(None, feed)
                frames = max(5, min(args.frames, int(args.seconds / (time.perf_counter() - start))))
                settled = threads > 1 and not args.no_settle  # only T > 1 sessions have workers that spin
                ours_s, theirs_s = alternating_p50(lambda: model(feed), lambda: theirs.run(None, feed), frames,
                                                   min(args.warmup, frames), args.block if settled else 1, settled)
                ratio = ours_s / theirs_s
                ratios.setdefault((batch, threads), {})[arch] = ratio
                scaled = ""
                if threads == 1:
                    single = (ours_s, theirs_s)
                elif single is not None:
                    speedups.setdefault(threads, {})[f"{arch} b{batch}"] = single[0] / ours_s
                    scaled = f"{single[0] / ours_s:6.2f}x {single[1] / theirs_s:6.2f}x"
                print(f"{arch:<16} {batch:>5} {threads:>3} {theirs_s * 1e6:>12.1f} {ours_s * 1e6:>10.1f} "
                      f"{ratio:>6.2f}x {scaled}", flush=True)
    print("# summary (targets: 1 thread every model <= 1.3x and the median <= 1.0x; "
          "T threads every model <= 1.3x, speedup over 1 thread >= 1.7x on the compute-bound ones)")
    for (batch, threads), by_model in sorted(ratios.items()):
        worst = max(by_model, key=lambda m: by_model[m])
        median = statistics.median(by_model.values())
        verdict = "PASS" if by_model[worst] <= 1.3 and (threads > 1 or median <= 1.0) else "MISS"
        print(f"batch {batch} threads {threads}: median ratio {median:.2f}x, worst {worst} {by_model[worst]:.2f}x, "
              f"{sum(r <= 1.3 for r in by_model.values())}/{len(by_model)} models <= 1.3x: {verdict}")
    for threads, by_row in sorted(speedups.items()):
        best = max(by_row, key=lambda m: by_row[m])
        print(f"tinydist {threads} threads over 1: median {statistics.median(by_row.values()):.2f}x, "
              f"best {best} {by_row[best]:.2f}x, {sum(s >= 1.7 for s in by_row.values())}/{len(by_row)} rows >= 1.7x")
    first_threads = [None if t == "default" else int(t) for t in args.first_call_threads.split(",")]
    for arch in filter(None, args.first_call.split(",")):
        model_file(arch, folder)
        for first in first_threads:
            with tempfile.TemporaryDirectory() as tmp:
                cold = first_call_ms(arch, folder, Path(tmp) / "cache", 1, first)
                warm = first_call_ms(arch, folder, Path(tmp) / "cache", 1, first)
            print(f"{arch} first call (load + capture + compile, batch 1, threads {first or 'default'}): cold cache "
                  f"{cold:.0f} ms, warm cache {warm:.0f} ms (targets <= 1000 / <= 300 ms: "
                  f"{'PASS' if cold <= 1000 and warm <= 300 else 'MISS'})", flush=True)
    print(f"# load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
