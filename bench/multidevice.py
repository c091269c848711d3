"""In-process allreduce over CPU devices: tinydist vs tinygrad on the same shapes, same run.

Each of N devices holds one row of `size` bytes of float32 (`Tensor(ones(N, n)).shard(devices,
axis=0)`); reducing over the sharded axis is an allreduce that leaves the sum on every device. Timed:
the reduction's realize + synchronize, shards already resident, median of repeats. tinygrad
(`pip install tinygrad`, and a `clang` binary for its CPU back end) runs the same program:
`Tensor.ones(N, n).shard(devices, 0).sum(0).realize()`. Target: tinydist ≥ 5× faster.

    .venv/bin/python bench/multidevice.py [--sizes 1M,16M,64M] [--devices 2,4] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def time_tinydist(ndev: int, elements: int, repeats: int, algorithm: str) -> float:
    import tinydist as td
    devices = [f"CPU:{i}" for i in range(ndev)]
    x = td.Tensor(np.ones((ndev, elements), np.float32)).shard(devices, axis=0).realize()
    td.synchronize()
    out = x.sum(axis=0, algorithm=algorithm)
    np.testing.assert_allclose(out.numpy(), np.full(elements, ndev, np.float32))  # correct, and compiled
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum(axis=0, algorithm=algorithm).realize()
        td.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_tinygrad(ndev: int, elements: int, repeats: int) -> float | str:
    try:
        os.environ.setdefault("DEV", "CPU")
        from tinygrad import Device, Tensor
        devices = tuple(f"CPU:{i}" for i in range(ndev))
        x = Tensor.ones(ndev, elements).contiguous().shard(devices, 0).realize()
        out = x.sum(0).realize()
        np.testing.assert_allclose(out.numpy(), np.full(elements, ndev, np.float32))
    except ImportError:
        return "not installed (pip install tinygrad)"
    except (RuntimeError, OSError) as exc:  # e.g. no clang for its CPU back end
        return f"cannot run here ({type(exc).__name__}: {str(exc).splitlines()[-1][:60]})"
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum(0).realize()
        for d in devices:
            Device[d].synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1M,16M,64M")
    parser.add_argument("--devices", default="2,4")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"in-process allreduce, float32 sum over the sharded axis; median of {args.repeats}; {os.cpu_count()} CPUs")
    for ndev in (int(d) for d in args.devices.split(",")):
        for size in (parse_size(s) for s in args.sizes.split(",")):
            elements = size // 4
            label = f"{ndev} devices {size >> 20} MiB"
            ours = {alg: time_tinydist(ndev, elements, args.repeats, alg) for alg in ("auto", "ring", "naive")}
            best = min(ours, key=ours.get)
            theirs = time_tinygrad(ndev, elements, args.repeats)
            parts = ", ".join(f"{alg} {t * 1e3:.2f} ms" for alg, t in ours.items())
            if isinstance(theirs, str):
                print(f"{label}: tinydist {parts}; tinygrad {theirs}")
            else:
                ratio = theirs / ours["auto"]
                print(f"{label}: tinydist {parts} (best {best}); tinygrad {theirs * 1e3:.2f} ms; "
                      f"tinydist auto {ratio:.2f}x faster target >=5x: {'PASS' if ratio >= 5 else 'MISS'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
