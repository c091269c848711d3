"""`tinydist infer MODEL.onnx --input NAME=FILE.npy [--device DEV] [--output FILE.npz] [--save-outputs DIR]
[--bench N]`: run an ONNX model once (and time it).

Registered in `tinydist.cli.build_parser` by `add_commands(commands)`. Needs the optional
`onnx` extra (pip install 'tinydist[onnx]')."""

from __future__ import annotations

import argparse
import re
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from tinydist.base.arguments import integer
from tinydist.base.progress import progress


def _parse_input(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--input takes NAME=FILE.npy, got {text!r}")
    return name, path


def _parse_device(text: str) -> str:
    from tinydist.runtime.registry import canonical_name
    try:
        return canonical_name(text)
    except ValueError as e:  # malformed: a usage error, not a traceback
        raise argparse.ArgumentTypeError(str(e)) from None


def _output_file(directory: Path, name: str) -> Path:
    """DIR/NAME.npy, with the characters exporters put in names ('/', ':') that a path cannot hold replaced."""
    return directory / (re.sub(r"[^\w.-]", "_", name) + ".npy")


def _read_model(args: argparse.Namespace) -> Any:
    """The ModelProto in args.model, or a usage error naming the file and what is wrong with it."""
    import onnx  # a missing extra surfaces here, named by the CLI's boundary
    from google.protobuf.message import DecodeError

    path = Path(args.model)
    try:
        data = path.read_bytes()
    except OSError as e:
        args.parser.error(f"{path}: {e.strerror}")
    if not data:
        args.parser.error(f"{path} is empty, not an ONNX model")
    try:
        proto = onnx.load_from_string(data)
    except DecodeError as e:
        args.parser.error(f"{path} is not an ONNX model (its protobuf does not decode: {e})")
    if not proto.opset_import and not proto.graph.node:
        args.parser.error(f"{path} is not an ONNX model (no graph and no opset)")
    return proto


def _read_feed(args: argparse.Namespace, model: Any) -> dict[str, np.ndarray]:
    """Each --input NAME=FILE.npy checked against the model's inputs: usage errors name the input,
    the file, and what was expected against what it holds."""
    expected = ", ".join(f"{n}={d.name}{list('?' if s is None else s for s in shape)}" for n, shape, d in model.inputs)
    declared = {name: (shape, dtype) for name, shape, dtype in model.inputs}
    feed: dict[str, np.ndarray] = {}
    for name, path in args.input or []:
        if name not in declared:
            args.parser.error(f"--input {name}: the model has no input {name!r}; it expects {expected}")
        try:
            array = np.load(path, allow_pickle=False)
        except OSError as e:
            args.parser.error(f"--input {name}={path}: {e.strerror}")
        except ValueError as e:     # not a .npy, or an object array
            args.parser.error(f"--input {name}={path}: not a .npy array file ({e})")
        if not isinstance(array, np.ndarray):
            args.parser.error(f"--input {name}={path}: holds {type(array).__name__}, not one array (.npy, not .npz)")
        shape, dtype = declared[name]
        if array.dtype != dtype:
            args.parser.error(f"--input {name}={path}: expected dtype {dtype}, got {array.dtype}")
        if len(array.shape) != len(shape) or any(d is not None and d != g for d, g in zip(shape, array.shape)):
            want = "(" + ", ".join("?" if d is None else str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"
            args.parser.error(f"--input {name}={path}: expected shape {want}, got {array.shape}")
        feed[name] = array
    missing = [n for n in model.input_names if n not in feed]
    if missing:
        args.parser.error(f"missing --input for {missing}; the model expects {expected}")
    return feed


def _infer(args: argparse.Namespace) -> int:
    from tinydist.base.errors import DeviceNotFound, DeviceUnavailable
    from tinydist.onnx import UnsupportedModelError, load

    proto = _read_model(args)
    try:
        model = load(proto, device=args.device, threads=args.threads)
    except (DeviceNotFound, DeviceUnavailable) as e:  # the message lists the devices that do open
        args.parser.error(f"--device {args.device}: {e}")
    except UnsupportedModelError as e:
        args.parser.error(f"{args.model}: {e}")
    feed = _read_feed(args, model)
    if args.output is not None and not args.output.parent.is_dir():
        args.parser.error(f"--output {args.output}: the folder {args.output.parent} does not exist")
    outputs = model(feed)
    if args.output is not None:  # every output in one .npz, keyed by its name, as np.load reads it back
        # (written member by member: np.savez would take an output named "allow_pickle" as its flag)
        with zipfile.ZipFile(args.output, "w") as archive:
            for name, value in outputs.items():
                with archive.open(f"{name}.npy", "w") as member:
                    np.lib.format.write_array(member, value, allow_pickle=False)
    if args.save_outputs is not None:
        files = {name: _output_file(args.save_outputs, name) for name in outputs}
        if len(set(files.values())) < len(files):
            args.parser.error(f"--save-outputs: output names {list(files)} collide as file names")
        args.save_outputs.mkdir(parents=True, exist_ok=True)
        for name, value in outputs.items():
            np.save(files[name], value, allow_pickle=False)
    for name, value in outputs.items():
        print(f"{name}  shape {value.shape}  {value.dtype}")
    if args.bench:
        for _ in range(args.warmup):
            model(feed)
        times = np.empty(args.bench)
        done = 0
        try:
            for i in progress(range(args.bench), desc="bench", file=sys.stderr, unit="frame"):
                start = time.perf_counter()
                model(feed)
                times[i] = time.perf_counter() - start
                done = i + 1
        except KeyboardInterrupt:   # Ctrl-C: the frames timed so far still count (then exit 130)
            if done:
                _print_latency(times[:done], f"{done} of {args.bench} frames, interrupted", args.warmup)
            raise
        _print_latency(times, f"{args.bench} frames", args.warmup)
    return 0


def _print_latency(times: np.ndarray, frames: str, warmup: int) -> None:
    p50, p90, p99 = np.percentile(times, [50, 90, 99]) * 1e3
    print(f"latency over {frames} (numpy in -> numpy out, after {warmup} warm-up): "
          f"p50 {p50:.3f} ms  p90 {p90:.3f} ms  p99 {p99:.3f} ms", flush=True)


def add_commands(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("infer", help="run an ONNX model on .npy inputs (needs the onnx extra)")
    parser.add_argument("model", help="path of the .onnx file")
    parser.add_argument("--input", action="append", type=_parse_input, metavar="NAME=FILE.npy",
                        help="a graph input from a .npy file (repeat for each input)")
    parser.add_argument("--bench", type=integer(0), default=0, metavar="N", help="also time N frames: p50/p90/p99 latency")
    parser.add_argument("--warmup", type=integer(0), default=10, metavar="N", help="untimed frames before --bench (default 10)")
    parser.add_argument("--device", default="CPU", type=_parse_device, help="device to run on, e.g. CPU:1 (default CPU)")
    parser.add_argument("--threads", type=integer(1), default=None, metavar="N",
                        help="threads each frame's big kernels are split across (default: this machine's CPUs; 1: one thread)")
    parser.add_argument("--output", type=Path, metavar="FILE.npz",
                        help="write the outputs of the first frame to one .npz, keyed by output name")
    parser.add_argument("--save-outputs", type=Path, metavar="DIR",
                        help="write each output of the first frame to DIR/NAME.npy")
    parser.set_defaults(run=_infer)
    return parser
