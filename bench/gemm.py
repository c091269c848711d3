"""The GEMM table: float32 GFLOP/s at model shapes, tinydist's kernel next to numpy/OpenBLAS on one
thread and the core's measured FMA peak, all in one run.

Shapes: M ∈ {1, 8, 64, 512} × K = N ∈ {384, 768, 1536, 4096} (an activation times a weight), and
the batched 12×64×32×64 product (12 attention heads: scores = Q[64×32] @ Kᵀ[32×64]). The tinydist
side calls the generated kernel straight (no engine), twice: once packing B in the call (an
activation operand) and once with B packed beforehand (a weight: `pack_b` at load/capture).

The FMA peak is a tiny LLVM kernel of independent vector FMA chains (enough to cover the FMA
latency), timed in the same process as the table, so a loaded machine lowers both alike.

Everything runs in one worker subprocess pinned to one core, with OPENBLAS_NUM_THREADS=1 and
OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE dropped from its environment (this machine forces a core type
that halves OpenBLAS's speed; tinydist's kernel does not read them). Each sample times enough
back-to-back calls for ~`--sample-ms` ms; samples alternate tinydist / numpy / peak so load
changes hit every side; the median of `--repeats` samples is reported. `--clock cpu` times the
samples by the worker thread's CPU time instead of the wall clock: on this shared machine the
time other processes hold the core then falls on no side (what the core shares with its sibling
still does). `pp/peak` is the
prepacked median over the peak's median in the same shape's samples; `best pp/peak` the fastest
prepacked sample over the fastest peak sample (the least disturbed of each, on a shared machine).

    .venv/bin/python bench/gemm.py [--repeats 7] [--sample-ms 20] [--clock wall|cpu] [--json PATH]
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

MS = (1, 8, 64, 512)
KNS = (384, 768, 1536, 4096)
BATCHED = (12, 64, 32, 64)   # batch, M, K, N

_PEAK_CHAINS = 16            # independent accumulators: > FMA latency × issue width on znver4/AVX-512
_PEAK_STEPS = 1 << 16        # FMA steps per chain per call: ~0.15 ms, so the ~1 us ctypes call is < 1 %


def _peak_ir(name: str) -> str:
    """void @name(ptr out, i64 steps): `_PEAK_CHAINS` chains of <16 x float> FMAs, summed into out."""
    chains = "\n".join(f"  %a{i} = phi <16 x float> [ zeroinitializer, %entry ], [ %n{i}, %loop ]"
                       for i in range(_PEAK_CHAINS))
    steps = "\n".join(f"  %n{i} = call <16 x float> @llvm.fma.v16f32(<16 x float> %x, <16 x float> %y, <16 x float> %a{i})"
                      for i in range(_PEAK_CHAINS))
    sums = "\n".join(f"  %s{i} = fadd <16 x float> {'%n0' if i == 1 else f'%s{i - 1}'}, %n{i}"
                      for i in range(1, _PEAK_CHAINS))
    return f"""
declare <16 x float> @llvm.fma.v16f32(<16 x float>, <16 x float>, <16 x float>)
define void @{name}(ptr noalias %out, i64 %steps) nounwind {{
entry:
  %x = load <16 x float>, ptr %out, align 4
  %yp = getelementptr inbounds float, ptr %out, i64 16
  %y = load <16 x float>, ptr %yp, align 4
  br label %loop
loop:
  %k = phi i64 [ 0, %entry ], [ %k.next, %loop ]
{chains}
{steps}
  %k.next = add i64 %k, 1
  %more = icmp slt i64 %k.next, %steps
  br i1 %more, label %loop, label %done
done:
{sums}
  store <16 x float> %s{_PEAK_CHAINS - 1}, ptr %out, align 4
  ret void
}}
"""


_CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}
_clock = time.perf_counter


def _timed(call: Callable[[], None], calls: int) -> float:
    start = _clock()
    for _ in range(calls):
        call()
    return (_clock() - start) / calls


def _calls_for(call: Callable[[], None], sample_s: float) -> int:
    call()  # warm-up: page faults, caches, lazy BLAS initialisation
    once = _timed(call, 1)
    return max(1, int(sample_s / max(once, 1e-7)))


def _worker(repeats: int, sample_ms: float, clock: str) -> dict:
    global _clock
    _clock = _CLOCKS[clock]
    sys.path.insert(0, str(REPO))
    from tinydist.codegen.compiler import HostCompiler
    from tinydist.codegen.matmul import SIGNATURE, matmul_ir
    from tinydist.codegen.matmul_packing import PACK_B_SIGNATURE, pack_b_ir
    from tinydist.codegen.matmul_tiling import packed_b_elements, workspace_bytes
    from tinydist.runtime.cpu.loader import native_loader

    compiler = HostCompiler()
    kernel = native_loader.load(compiler.compile(matmul_ir("bench_gemm", "float32")), "bench_gemm", SIGNATURE).cfunc
    prepacked = native_loader.load(compiler.compile(matmul_ir("bench_gemm_packed", "float32", prepacked="b")),
                                   "bench_gemm_packed", SIGNATURE).cfunc
    packer = native_loader.load(compiler.compile(pack_b_ir("bench_gemm_pack", "float32")),
                                "bench_gemm_pack", PACK_B_SIGNATURE).cfunc
    peak_kernel = native_loader.load(compiler.compile(_peak_ir("bench_peak")), "bench_peak", ("w", "i64")).cfunc
    peak_buffer = np.full(32, 1e-3, np.float32)
    peak_flops = 2.0 * 16 * _PEAK_CHAINS * _PEAK_STEPS

    def peak() -> None:
        peak_kernel(peak_buffer.ctypes.data, _PEAK_STEPS)

    shapes = [(1, m, kn, kn) for m in MS for kn in KNS] + [BATCHED]
    rng = np.random.default_rng(0)
    sample_s = sample_ms / 1e3
    rows = []
    peaks: list[float] = []
    for batch, m, k, n in shapes:
        a = rng.standard_normal((batch, m, k), dtype=np.float32)
        b = rng.standard_normal((batch, k, n), dtype=np.float32)
        c_ours, c_packed, c_numpy = (np.empty((batch, m, n), np.float32) for _ in range(3))
        raw = np.empty(workspace_bytes(m, n, k, "float32") + 64, np.uint8)
        workspace = -raw.ctypes.data % 64 + raw.ctypes.data
        packed_raw = np.empty(batch * packed_b_elements(k, n, "float32") * 4 + 64, np.uint8)
        packed = -packed_raw.ctypes.data % 64 + packed_raw.ctypes.data
        packed_stride = packed_b_elements(k, n, "float32")
        for item in range(batch):
            packer(packed + item * packed_stride * 4, b[item].ctypes.data, k, n)
        args = (c_ours.ctypes.data, a.ctypes.data, b.ctypes.data, workspace, batch, m, n, k, m * k, k * n, m * n)
        packed_args = (c_packed.ctypes.data, a.ctypes.data, packed, workspace, batch, m, n, k, m * k, packed_stride, m * n)

        sides: dict[str, Callable[[], None]] = {
            "tinydist": lambda: kernel(*args),
            "tinydist_prepacked": lambda: prepacked(*packed_args),
            "numpy": lambda: np.matmul(a, b, out=c_numpy),
            "peak": peak,
        }
        calls = {side: _calls_for(call, sample_s) for side, call in sides.items()}
        samples: dict[str, list[float]] = {side: [] for side in sides}
        for _ in range(repeats):
            for side, call in sides.items():
                samples[side].append(_timed(call, calls[side]))
        for name, c in (("tinydist", c_ours), ("tinydist_prepacked", c_packed)):
            if not np.allclose(c, c_numpy, rtol=1e-3, atol=1e-3 * np.sqrt(k)):
                raise AssertionError(f"{name} matmul {batch}x{m}x{k}x{n} disagrees with numpy")
        flops = 2.0 * batch * m * k * n
        row = {"batch": batch, "m": m, "k": k, "n": n}
        for side in ("tinydist", "tinydist_prepacked", "numpy"):
            row[f"{side}_gflops"] = flops / float(np.median(samples[side])) / 1e9
            row[f"{side}_best_gflops"] = flops / min(samples[side]) / 1e9
        row["peak_gflops"] = peak_flops / float(np.median(samples["peak"])) / 1e9
        row["peak_best_gflops"] = peak_flops / min(samples["peak"]) / 1e9
        peaks.append(row["peak_gflops"])
        rows.append(row)
    return {"rows": rows, "peak_gflops": float(np.median(peaks))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--sample-ms", type=float, default=20.0, help="length of one timed sample")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--clock", choices=sorted(_CLOCKS), default="wall",
                        help="what a sample is timed by: wall (perf_counter) or cpu (the worker thread's CPU time: "
                             "not the time other processes held the core)")
    parser.add_argument("--cpu", type=int, default=min(os.sched_getaffinity(0)), help="core the worker is pinned to")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        os.sched_setaffinity(0, {args.cpu})
        print(json.dumps(_worker(args.repeats, args.sample_ms, args.clock)))
        return

    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    env["OPENBLAS_NUM_THREADS"] = "1"
    command = [sys.executable, __file__, "--worker", "--cpu", str(args.cpu), "--repeats", str(args.repeats),
               "--sample-ms", str(args.sample_ms), "--clock", args.clock]
    load = os.getloadavg()
    result = json.loads(subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout)
    peak = result["peak_gflops"]
    print(f"GEMM float32, one core (cpu {args.cpu}); median of {args.repeats} alternating samples of ~{args.sample_ms:g} ms "
          f"({args.clock} clock); "
          f"load average before {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, after "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    print(f"FMA peak of the core (16 chains of <16 x float> fma, same run): {peak:.1f} GFLOP/s")
    print(f"{'shape (batch x M x K x N)':>27} {'tinydist':>9} {'prepacked':>9} {'numpy':>8} "
          f"{'ours/np':>7} {'pp/np':>6} {'pp/peak':>7} {'best pp/peak':>12}")
    for row in result["rows"]:
        shape = f"{row['batch']}x{row['m']}x{row['k']}x{row['n']}"
        ours, packed, base = row["tinydist_gflops"], row["tinydist_prepacked_gflops"], row["numpy_gflops"]
        print(f"{shape:>27} {ours:9.1f} {packed:9.1f} {base:8.1f} {ours / base:6.2f}x {packed / base:5.2f}x "
              f"{packed / row['peak_gflops']:6.0%} {row['tinydist_prepacked_best_gflops'] / row['peak_best_gflops']:11.0%}",
              flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
