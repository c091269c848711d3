"""CUDA benchmarks: matmul 4096² float32 TFLOP/s next to cuBLAS (through torch, if present) and
elementwise GB/s next to the device's memory bandwidth (bus width × memory clock × 2, DDR).

    .venv/bin/python bench/cuda.py [--device CUDA:0] [--repeats 10]

Times are medians of `--repeats` runs, measured from the host around one synchronised batch.
On a machine without a usable CUDA device it prints that it was skipped and why, and exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import anyio
import numpy as np


def _skip_reason(name: str) -> str | None:
    from tinydist.runtime.registry import discover
    infos = [info for info in discover() if info.name.startswith("CUDA")]
    if any(info.name == name and info.usable for info in infos):
        return None
    return "; ".join(f"{info.name}: {info.detail}" for info in infos) or "no CUDA back end"


def _median_seconds(run, repeats: int) -> float:
    run()  # warm-up: module load, JIT, allocations
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _torch_cublas(n: int, repeats: int) -> float | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    a = torch.randn(n, n, device="cuda", dtype=torch.float32)
    b = torch.randn(n, n, device="cuda", dtype=torch.float32)
    torch.backends.cuda.matmul.allow_tf32 = False  # compare like with like: plain FP32 FMA

    def run() -> None:
        torch.matmul(a, b)
        torch.cuda.synchronize()
    return _median_seconds(run, repeats)


async def _bench(name: str, repeats: int) -> None:
    from tinydist.codegen.kernel import KernelAST, KNode, load
    from tinydist.graph import dtypes
    from tinydist.runtime.registry import open_device
    from tinydist.graph.shape import ShapeTracker, View

    async with open_device(name) as dev:
        drv = dev.driver
        from tinydist.runtime.cuda import driver as cu
        bus_bits = drv.attribute(cu.ATTR_GLOBAL_MEMORY_BUS_WIDTH, dev.handle)
        clock_khz = drv.attribute(cu.ATTR_MEMORY_CLOCK_RATE, dev.handle)
        peak_gbs = bus_bits / 8 * clock_khz * 1e3 * 2 / 1e9
        print(f"{name}: {drv.device_name(dev.handle)}, {dev.arch}, {dev.sm_count} SMs, "
              f"memory bandwidth (bus × clock × 2) {peak_gbs:.0f} GB/s")

        # matmul 4096² float32
        n = 4096
        a, b, c = (dev.allocator.alloc(n * n * 4) for _ in range(3))
        rng = np.random.default_rng(0)
        host_a = rng.standard_normal((n, n), np.float32)
        host_b = rng.standard_normal((n, n), np.float32)
        await dev.copyin(a, host_a).wait(60)
        await dev.copyin(b, host_b).wait(60)
        matmul = dev.compiler.matmul(dtypes.float32)

        def run_matmul() -> None:
            with dev.batch() as batch:
                batch.launch(matmul, c, a, b, c, 1, n, n, n, 0, 0, 0)
            batch.completion.wait_blocking(120)
        seconds = _median_seconds(run_matmul, repeats)
        ours = 2 * n**3 / seconds / 1e12
        got = (await dev.copyout(c)).view(np.float32).reshape(n, n)
        error = float(np.max(np.abs(got[:64, :64] - host_a[:64] @ host_b[:, :64])))
        cublas = _torch_cublas(n, repeats)
        line = f"matmul {n}x{n}x{n} float32: {ours:.2f} TFLOP/s (max abs error vs numpy on a 64x64 corner {error:.2e})"
        if cublas is not None:
            theirs = 2 * n**3 / cublas / 1e12
            line += f"; cuBLAS (torch, TF32 off) {theirs:.2f} TFLOP/s; ratio {ours / theirs:.2f}"
        else:
            line += "; cuBLAS: skipped (torch with CUDA not installed)"
        print(line)

        # elementwise: out = x * y + x over 64M float32 (3 × 256 MiB of traffic)
        count = 64 << 20
        x, y, out = (dev.allocator.alloc(count * 4) for _ in range(3))
        await dev.copyin(x, np.ones(count, np.float32)).wait(60)
        await dev.copyin(y, np.ones(count, np.float32)).wait(60)
        tracker = ShapeTracker((View.create((count,)),))
        lx, ly = load(0, tracker, dtypes.float32), load(1, tracker, dtypes.float32)
        mul = KNode("mul", (lx, ly), None, dtypes.float32)
        root = KNode("add", (mul, lx), None, dtypes.float32)
        ast = KernelAST((count,), (), root, (dtypes.float32, dtypes.float32), dtypes.float32)
        kernel = dev.compiler.kernel(ast)

        def run_elementwise() -> None:
            with dev.batch() as batch:
                batch.launch(kernel, out, x, y)
            batch.completion.wait_blocking(60)
        seconds = _median_seconds(run_elementwise, repeats)
        gbs = 3 * count * 4 / seconds / 1e9
        print(f"elementwise x*y+x, {count} float32: {gbs:.0f} GB/s = {gbs / peak_gbs:.2f} of the memory bandwidth "
              "(host-timed, includes launch and synchronize)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="CUDA:0")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    reason = _skip_reason(args.device)
    if reason is not None:
        print(f"bench/cuda.py: skipped, {args.device} is not usable here ({reason})")
        return 0
    anyio.run(_bench, args.device, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
