"""Run an ONNX model on tinydist with onnxruntime's API, and check it against onnxruntime.

    python examples/infer_onnx.py                          # builds a small MLP, model.onnx
    python examples/infer_onnx.py --model my.onnx          # any model with float inputs
    tinydist infer model.onnx --input x=frame.npy --output out.npz --bench 100   # the same from the shell

Needs the `onnx` extra (pip install 'tinydist[onnx]'). With no model at --model, it writes a
2-layer MLP (batch x 16 -> 32 -> 4, softmax) there first. Each model input is fed seeded random
data of its shape (a symbolic dimension such as the batch is given --batch); the outputs of the
tinydist session and of onnxruntime's are compared, and the script exits 1 if they differ.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

import tinydist.onnx as ort        # onnxruntime's API: InferenceSession, get_inputs, run


def build_mlp(path: Path, features: int = 16, hidden: int = 32, classes: int = 4) -> None:
    """A small MLP as an ONNX file: Gemm, Relu, Gemm, Softmax, with a symbolic batch dimension."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)
    weights = {"w1": rng.standard_normal((features, hidden)).astype(np.float32) / 4,
               "b1": np.zeros(hidden, np.float32),
               "w2": rng.standard_normal((hidden, classes)).astype(np.float32) / 4,
               "b2": np.zeros(classes, np.float32)}
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "w2", "b2"], ["logits"]),
             helper.make_node("Softmax", ["logits"], ["probs"], axis=1)]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", features])],
                              [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", classes])],
                              [numpy_helper.from_array(v, k) for k, v in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, path)


def feed_for(session: object, batch: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    feed = {}
    for arg in session.get_inputs():      # type: ignore[attr-defined]
        shape = [d if isinstance(d, int) else batch for d in arg.shape]
        feed[arg.name] = rng.standard_normal(shape).astype(np.float32)
    return feed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=Path("model.onnx"))
    p.add_argument("--batch", type=int, default=8, help="size of each symbolic input dimension")
    p.add_argument("--device", default="CPU:0", help="the tinydist device (a provider name to onnxruntime's API)")
    p.add_argument("--runs", type=int, default=20, help="timed runs after the first")
    args = p.parse_args()
    if not args.model.exists():
        build_mlp(args.model)
        print(f"wrote {args.model}")

    session = ort.InferenceSession(str(args.model), providers=[args.device])
    for arg in session.get_inputs():
        print(f"input  {arg.name}: {arg.type} {arg.shape}")
    for arg in session.get_outputs():
        print(f"output {arg.name}: {arg.type} {arg.shape}")
    feed = feed_for(session, args.batch)
    outputs = session.run(None, feed)     # every output, in the graph's order
    start = time.perf_counter()
    for _ in range(args.runs):
        session.run(None, feed)
    per_run = (time.perf_counter() - start) / max(args.runs, 1)
    print(f"{args.runs} runs: {per_run * 1e3:.3f} ms per run on {args.device}")

    import onnxruntime
    reference = onnxruntime.InferenceSession(str(args.model), providers=["CPUExecutionProvider"]).run(None, feed)
    ok = True
    for arg, ours, theirs in zip(session.get_outputs(), outputs, reference):
        error = float(np.max(np.abs(ours - theirs))) if ours.size else 0.0
        same = ours.shape == theirs.shape and np.allclose(ours, theirs, rtol=1e-4, atol=1e-5)
        ok &= same
        print(f"{arg.name}: shape {ours.shape}, max |tinydist - onnxruntime| = {error:.2e} {'ok' if same else 'DIFFERS'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
