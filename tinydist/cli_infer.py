"""`tinydist infer MODEL.onnx --input NAME=FILE.npy [--bench N]`: run an ONNX model once (and time it).

Registered in `tinydist.cli.build_parser` by `add_commands(commands)`. Needs the optional
`onnx` extra (pip install 'tinydist[onnx]')."""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np


def _parse_input(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--input takes NAME=FILE.npy, got {text!r}")
    return name, path


def _infer(args: argparse.Namespace) -> int:
    from tinydist.onnx import load

    model = load(args.model, device=args.device)
    feed: dict[str, Any] = {}
    for name, path in args.input or []:
        feed[name] = np.load(path, allow_pickle=False)
    missing = [n for n in model.input_names if n not in feed]
    if missing:
        expected = ", ".join(f"{n}={d.name}{list('?' if s is None else s for s in shape)}" for n, shape, d in model.inputs)
        args.parser.error(f"missing --input for {missing}; the model expects {expected}")
    outputs = model(feed)
    for name, value in outputs.items():
        print(f"{name}  shape {value.shape}  {value.dtype}")
    if args.bench:
        for _ in range(args.warmup):
            model(feed)
        times = np.empty(args.bench)
        for i in range(args.bench):
            start = time.perf_counter()
            model(feed)
            times[i] = time.perf_counter() - start
        p50, p90, p99 = np.percentile(times, [50, 90, 99]) * 1e3
        print(f"latency over {args.bench} frames (numpy in -> numpy out, after {args.warmup} warm-up): "
              f"p50 {p50:.3f} ms  p90 {p90:.3f} ms  p99 {p99:.3f} ms")
    return 0


def add_commands(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("infer", help="run an ONNX model on .npy inputs (needs the onnx extra)")
    parser.add_argument("model", help="path of the .onnx file")
    parser.add_argument("--input", action="append", type=_parse_input, metavar="NAME=FILE.npy",
                        help="a graph input from a .npy file (repeat for each input)")
    parser.add_argument("--bench", type=int, default=0, metavar="N", help="also time N frames: p50/p90/p99 latency")
    parser.add_argument("--warmup", type=int, default=10, metavar="N", help="untimed frames before --bench (default 10)")
    parser.add_argument("--device", default="CPU", help="device to run on (default CPU)")
    parser.set_defaults(run=_infer, parser=parser)
    return parser
