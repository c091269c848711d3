"""A traced model run, drawn: the Gantt chart in docs/observability.md.

    .venv/bin/python bench/trace_model.py [--model resnet] [--batch 8] [--runs 3] [-o docs/images/trace_resnet.png]

Loads an ONNX model of tests/onnx/architectures/models in a fresh process and traces its first
`--runs` calls: the first runs eagerly (graph building, scheduling, compiling every kernel: the
`compile` and `host` lanes), the second is captured by td.jit, the rest replay the capture (the
`jit` lane). The chart's lower panel zooms on the last replay's batch, where each kernel carries
its name (ops, shape, dtype). Prints the summary table; `--json PATH` also keeps the trace.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import tinydist as td
from tinydist.observability.report import format_summary, last_batch_window, plot_gantt
from tinydist.onnx import load

MODELS = Path(__file__).resolve().parent.parent / "tests" / "onnx" / "architectures" / "models"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet", help="a model of tests/onnx/architectures/models (default resnet)")
    parser.add_argument("--batch", type=int, default=8, help="batch size (default 8)")
    parser.add_argument("--runs", type=int, default=3, help="calls traced (default 3)")
    parser.add_argument("-o", "--output", default="docs/images/trace_resnet.png", help="the PNG (default %(default)s)")
    parser.add_argument("--json", default=None, help="write the trace (Trace Event Format) here too")
    args = parser.parse_args()
    model = load(str(MODELS / f"{args.model}_default.onnx"))
    (name, shape, _), = [(n, s, d) for n, s, d in model.inputs]
    dims = [args.batch if not isinstance(d, int) else d for d in shape]
    x = np.random.default_rng(0).uniform(-1, 1, dims).astype(np.float32)
    out = Path(args.output)
    with td.trace(args.json) as tracer:
        for _ in range(args.runs):
            model({name: x})
    data = tracer.chrome()
    print(format_summary(data, top=12))
    plot_gantt(data, out, title=f"{args.model} (ONNX), batch {args.batch}: {args.runs} calls from a fresh process",
               zoom=last_batch_window(data))
    print(f"wrote {out}" + (f" and {args.json}" if args.json else ""))


if __name__ == "__main__":
    main()
