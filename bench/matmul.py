"""Single-thread float32 matmul throughput: the tinydist LLVM kernel vs numpy on one OpenBLAS thread.

Each side runs in its own subprocess pinned to the same core, times C = A @ B into a preallocated
C (after one warm-up call) and reports the median of the repeats. The numpy baseline's environment
drops OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE (this machine forces a core type that halves
OpenBLAS's speed) and sets OPENBLAS_NUM_THREADS=1.

    .venv/bin/python bench/matmul.py [--sizes 512 1024 2048] [--repeats 7] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent


def _median_seconds(call: Callable[[], None], repeats: int) -> float:
    call()  # warm-up: page faults, caches, lazy BLAS initialisation
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _operands(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    return a, b, np.empty((n, n), np.float32)


def _numpy_worker(sizes: list[int], repeats: int) -> dict[int, float]:
    results = {}
    for n in sizes:
        a, b, c = _operands(n)
        results[n] = _median_seconds(lambda: np.matmul(a, b, out=c), repeats)
    return results


def _tinydist_worker(sizes: list[int], repeats: int) -> dict[int, float]:
    sys.path.insert(0, str(REPO))
    from tinydist.codegen.compiler import HostCompiler
    from tinydist.codegen.matmul import SIGNATURE, matmul_ir
    from tinydist.codegen.matmul_tiling import workspace_bytes
    from tinydist.runtime.cpu.loader import native_loader

    name = "bench_matmul_f32"
    kernel = native_loader.load(HostCompiler().compile(matmul_ir(name, "float32")), name, SIGNATURE).cfunc
    results = {}
    for n in sizes:
        a, b, c = _operands(n)
        raw = np.empty(workspace_bytes(n, n, n, "float32") + 64, np.uint8)
        workspace = -raw.ctypes.data % 64 + raw.ctypes.data
        args = (c.ctypes.data, a.ctypes.data, b.ctypes.data, workspace, 1, n, n, n, 0, 0, 0)
        results[n] = _median_seconds(lambda: kernel(*args), repeats)
        if not np.allclose(c, a @ b, rtol=1e-3, atol=1e-3):
            raise AssertionError(f"tinydist matmul {n}^3 disagrees with numpy")
    return results


def _run_side(side: str, sizes: list[int], repeats: int, cpu: int) -> dict[int, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    env["OPENBLAS_NUM_THREADS"] = "1"
    command = [sys.executable, __file__, "--worker", side, "--cpu", str(cpu), "--repeats", str(repeats),
               "--sizes", *map(str, sizes)]
    output = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return {int(n): seconds for n, seconds in json.loads(output).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--cpu", type=int, default=min(os.sched_getaffinity(0)), help="core both sides are pinned to")
    parser.add_argument("--worker", choices=("numpy", "tinydist"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        os.sched_setaffinity(0, {args.cpu})
        worker = _numpy_worker if args.worker == "numpy" else _tinydist_worker
        print(json.dumps(worker(args.sizes, args.repeats)))
        return

    ours = _run_side("tinydist", args.sizes, args.repeats, args.cpu)
    baseline = _run_side("numpy", args.sizes, args.repeats, args.cpu)
    records = []
    for n in args.sizes:
        flops = 2.0 * n ** 3
        record = {"size": n, "dtype": "float32", "repeats": args.repeats,
                  "tinydist_gflops": flops / ours[n] / 1e9, "numpy_gflops": flops / baseline[n] / 1e9}
        record["ratio"] = record["tinydist_gflops"] / record["numpy_gflops"]
        records.append(record)
        print(f"matmul {n}^3 float32: tinydist {record['tinydist_gflops']:.1f} GFLOP/s, "
              f"numpy(OpenBLAS 1 thread) {record['numpy_gflops']:.1f} GFLOP/s, "
              f"ratio {record['ratio']:.2f}x (median of {args.repeats})", flush=True)
    if args.json:
        args.json.write_text(json.dumps(records, indent=2) + "\n")


if __name__ == "__main__":
    main()
