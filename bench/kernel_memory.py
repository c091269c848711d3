"""Memory of compiled code: RSS and memory mappings while one process meets new shapes.

    .venv/bin/python bench/kernel_memory.py [--shapes 5000] [--json PATH]

Each shape is an eager `(x * 2 + n).exp()` over a fresh length n: one new kernel, compiled (into a
temporary compile cache) and loaded. RSS and the number of lines of /proc/self/maps are printed
every tenth of the run; the growth per shape over the second half is the figure that must be ~0.
Before kernels were freed (one process-wide LLVM engine) every shape kept ~2 mappings and
~0.17 MiB for the life of the process; now the devices' kernel LRU (`TINYDIST_LOADED_KERNELS`,
1,024) and the schedule cache bound what stays loaded, and mappings stop growing once the LRU is
full. RSS grew a further ~130 KiB per shape (133.0 KiB measured): LLVM's O3 pipeline (llvmlite
0.50) keeps ~74 KiB of every module it optimises for the life of the process, and no glibc remedy
touches it (malloc_trim, M_ARENA_MAX, fresh contexts or pass builders: the figures are in
`tinydist.codegen.compile_worker`). Past TINYDIST_COMPILE_WORKER_AFTER modules that pipeline runs
in a child process replaced every 256, and this process keeps none of it. With that: mappings
+0 (PASS), RSS 16.8 KiB/shape (MISS against < 16, load 5-8). Of those 16.8 (traced 2,500 -> 5,000
shapes, 2-vCPU VM, load 2-7):
- Python objects: ~1.2 KiB/shape (tracemalloc, snapshots after the schedule cache and the kernel
  LRU had turned over once; the 7-8 KiB/shape reported before counted those bounded caches'
  fresh entries as growth), nearly all graph/lazy.py's and graph/shape.py's lru_caches filling
  (4,096-8,192 entries, full by ~4,000 shapes); one unbounded: the allocator's index kept an
  empty list per size ever freed (~0.2 KiB/shape; now removed with the size's last block).
- The allocator's reuse cache (TINYDIST_ALLOCATOR_CACHE_BLOCKS, 2,048 blocks): bounded, but its
  bytes grow with this loop's ever-longer tensors (8.1 KiB/shape of blocks held, 36.0 MiB at
  5,000 shapes: the sample prints them; ~6 KiB/shape of RSS: 5.4 with it given back before each sample against 11.6 without).
- The rest was free memory glibc kept: /proc/self/smaps put all of the growth in [heap], and one
  malloc_trim(0) took RSS below its level at 2,500 shapes. The loader now trims the heap every
  256 engines it disposes (`tinydist.runtime.cpu.loader`); with the index fix, 16.8 -> 11.6
  KiB/shape (10.5 -> 5.4 with the reuse cache given back before each sample).
Measured after (5,000 shapes, load 2.4-3.3, two runs): mappings +0 (0.000/shape, PASS), RSS
+28.3 and +28.0 MiB over the second half, 11.6 and 11.5 KiB/shape (PASS against < 16). Engines: disposing and reloading
6,000 objects costs 0.003 KiB per load (0.019 with 1,024 kept live): not a holder.
Not a timing benchmark: figures are counts.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Report  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=int, default=5000)
    args, rest = parser.parse_known_args()
    sys.argv[1:] = rest
    report = Report.from_argv("kernel_memory")
    with tempfile.TemporaryDirectory(prefix="tinydist-kernel-memory-") as cache:
        os.environ["TINYDIST_CACHE_DIR"] = cache
        import numpy as np

        import tinydist as td
        from tinydist.runtime.engine import get_engine
        from tinydist.testing import process_resources  # (after TINYDIST_CACHE_DIR is set)

        samples: list[tuple[int, int, float]] = []
        step = max(args.shapes // 10, 1)
        for n in range(1, args.shapes + 1):
            x = np.linspace(-1, 1, n, dtype=np.float32)
            (td.Tensor(x) * 2.0 + float(n)).exp().numpy()
            if n % step == 0:
                gc.collect()
                # the allocator's reuse cache is a bound of its own (TINYDIST_ALLOCATOR_CACHE_BLOCKS),
                # counted in RSS: its bytes grow with this loop's ever-longer tensors, not with kernels
                cached = sum(device.allocator.statistics().cached_bytes for device in get_engine().open_devices()) / 2**20
                resources = process_resources()
                samples.append((n, int(resources["mappings"]), resources["rss_mib"]))
                print(f"shapes {n:6d}   mappings {samples[-1][1]:6d}   RSS {samples[-1][2]:8.1f} MiB   "
                      f"(of it the allocator's reuse cache: {cached:.1f} MiB)", flush=True)
    (n0, maps0, rss0), (n1, maps1, rss1) = samples[len(samples) // 2 - 1], samples[-1]
    per_map, per_rss = (maps1 - maps0) / (n1 - n0), (rss1 - rss0) / (n1 - n0) * 1024
    print(f"second half ({n0} -> {n1} shapes): {maps1 - maps0:+d} mappings ({per_map:.3f}/shape), "
          f"{rss1 - rss0:+.1f} MiB RSS ({per_rss:.1f} KiB/shape)")
    detail = f"{n0} -> {n1} shapes"
    report.add("kernel_memory/mappings_per_shape", per_map, "mappings", detail=detail, target="<0.05", passed=per_map < 0.05)
    report.add("kernel_memory/rss_per_shape", per_rss, "KiB", detail=detail, target="<16", passed=per_rss < 16)
    report.finish()


if __name__ == "__main__":
    main()
