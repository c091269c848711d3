"""Runtime benchmarks: launch overhead, parallel speedup over two CPU devices, compile cache.

    .venv/bin/python bench/runtime.py [--json PATH]      (or `make bench`)

Every figure is a median of repeats, printed next to a baseline measured in the same run:

1. launch overhead, submit → completion, against calling the same kernel's ctypes function directly
   on this thread (the pure native call cost): one kernel per batch, a batch of 100 kernels (the
   runtime's overhead per kernel, target ≤ 5 µs), and batch-of-1 against batch-of-100 to show the
   worker hand-off is paid once per batch, not per kernel;
2. parallel speedup of a compute-bound kernel (a chain of dependent FMAs per element over an
   L1-resident array): two launches on CPU:0 alone against one launch each on CPU:0 and CPU:1 at
   the same time (target ≥ 1.7× on this 2-core machine), with the overlap of the two devices'
   batches from their queues' timings;
3. the compile cache: a cold compile (compile, store, link) against a cache hit (read from disk,
   link) of the same kernel in a temporary cache directory (target: a hit costs about 1 ms).
"""

from __future__ import annotations

import asyncio
import gc
import os
import queue
import sys
import tempfile
import threading
from pathlib import Path

import anyio
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Report, atime_repeats, clock, median, time_repeats  # noqa: E402

from tinydist.codegen.compile_cache import CompileCache  # noqa: E402
from tinydist.codegen.compiler import HostCompiler  # noqa: E402
from tinydist.runtime.registry import open_device  # noqa: E402
from tinydist.testing import SAXPY_SIGNATURE, saxpy_ir  # noqa: E402

SMALL_N = 64

# Compute-bound: each element runs `iters` dependent FMAs x = x * (1 - 2^-11) + 2^-11 (fixed point
# 1.0, so values stay finite), held in a register; the array (4 KiB) stays in L1. The chain is
# latency-bound and LLVM neither vectorises nor reassociates it (no fast-math flags).
CHAIN_IR = """
declare float @llvm.fma.f32(float, float, float)

define void @bench_fma_chain(ptr noalias %x, i64 %n, i64 %iters) {
entry:
  %empty = icmp eq i64 %n, 0
  %none = icmp eq i64 %iters, 0
  %skip = or i1 %empty, %none
  br i1 %skip, label %exit, label %outer
outer:
  %i = phi i64 [0, %entry], [%inext, %store]
  %p = getelementptr inbounds float, ptr %x, i64 %i
  %v0 = load float, ptr %p
  br label %inner
inner:
  %k = phi i64 [0, %outer], [%knext, %inner]
  %v = phi float [%v0, %outer], [%v1, %inner]
  %v1 = call float @llvm.fma.f32(float %v, float 0.99951171875, float 0.00048828125)
  %knext = add nuw i64 %k, 1
  %kdone = icmp eq i64 %knext, %iters
  br i1 %kdone, label %store, label %inner
store:
  store float %v1, ptr %p
  %inext = add nuw i64 %i, 1
  %done = icmp eq i64 %inext, %n
  br i1 %done, label %exit, label %outer
exit:
  ret void
}
"""
CHAIN_N = 1024
CHAIN_TARGET_S = 0.15  # seconds per launch

LAUNCH_REPEATS = 7
LAUNCHES_PER_REPEAT = 200
BATCH = 100
BATCHES_PER_REPEAT = 20
PARALLEL_REPEATS = 7
CACHE_REPEATS = 7

LAUNCH_TARGET_US = 5.0
SPEEDUP_TARGET = 1.7
CACHE_HIT_TARGET_MS = 2.0  # "about a millisecond": within a factor of two


def _settle() -> None:
    gc.collect()


async def bare_round_trip_us(trips: int = 1000) -> float:
    """The floor for any hand-off: event loop → plain worker thread → event loop, no tinydist."""
    loop = asyncio.get_running_loop()
    inbox: queue.SimpleQueue[asyncio.Future[None] | None] = queue.SimpleQueue()

    def worker() -> None:
        while (future := inbox.get()) is not None:
            loop.call_soon_threadsafe(future.set_result, None)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()

    async def trips_once() -> None:
        for _ in range(trips):
            future = loop.create_future()
            inbox.put(future)
            await future

    try:
        return median(await atime_repeats(trips_once, LAUNCH_REPEATS)) / trips * 1e6
    finally:
        inbox.put(None)
        thread.join()


async def bench_launch(report: Report, compiler: HostCompiler) -> None:
    cache = CompileCache(compiler, enabled=False)
    async with open_device("CPU:0") as dev:
        kernel = dev.load_program(cache.compile(saxpy_ir("bench_saxpy")), "bench_saxpy", SAXPY_SIGNATURE)
        x, y = dev.allocator.alloc(SMALL_N * 4), dev.allocator.alloc(SMALL_N * 4)
        dev.copyin(x, np.full(SMALL_N, 1e-3, np.float32))
        dev.copyin(y, np.zeros(SMALL_N, np.float32))
        await dev.synchronize()

        # Baseline: the kernel's ctypes function called on this thread (argument conversion + call).
        cfunc, ya, xa = kernel.cfunc, y.address, x.address
        calls = 2000

        def direct() -> None:
            for _ in range(calls):
                cfunc(ya, xa, 2.0, SMALL_N)

        _settle()
        direct_us = median(time_repeats(direct, LAUNCH_REPEATS)) / calls * 1e6

        async def one_per_batch() -> None:
            for _ in range(LAUNCHES_PER_REPEAT):
                with dev.batch() as batch:
                    batch.launch(kernel, y, x, 2.0, SMALL_N)
                await batch.completion.wait()

        build_times: list[float] = []

        async def batches_of_100() -> None:
            for _ in range(BATCHES_PER_REPEAT):
                start = clock()
                with dev.batch() as batch:
                    for _ in range(BATCH):
                        batch.launch(kernel, y, x, 2.0, SMALL_N)
                build_times.append(clock() - start)
                await batch.completion.wait()

        _settle()
        bare_us = await bare_round_trip_us()
        _settle()
        batch1_us = median(await atime_repeats(one_per_batch, LAUNCH_REPEATS)) / LAUNCHES_PER_REPEAT * 1e6
        _settle()
        batch100_us = median(await atime_repeats(batches_of_100, LAUNCH_REPEATS)) / BATCHES_PER_REPEAT * 1e6
        build_us = median(build_times) / BATCH * 1e6

        report.add("launch/direct", direct_us, "us per call", detail="ctypes call of the kernel on the calling thread",
                   repeats=LAUNCH_REPEATS)
        report.add("launch/batch1", batch1_us, "us submit->completion", baseline=direct_us, baseline_label="direct call",
                   ratio=batch1_us / direct_us, ratio_label="runtime/direct",
                   detail=f"bare loop->thread->loop round trip without tinydist {bare_us:.1f} us",
                   repeats=LAUNCH_REPEATS, extra={"bare_round_trip_us": bare_us})
        overhead_us = (batch100_us - BATCH * direct_us) / BATCH
        report.add("launch/batch100", overhead_us, "us/kernel overhead", baseline=direct_us, baseline_label="direct call",
                   detail=f"{batch100_us / BATCH:.2f} us/kernel in all, of which build+submit {build_us:.2f} us on the caller",
                   target=f"<={LAUNCH_TARGET_US:g} us", passed=overhead_us <= LAUNCH_TARGET_US, repeats=LAUNCH_REPEATS,
                   extra={"per_kernel_us": batch100_us / BATCH, "build_submit_us_per_kernel": build_us})
        # batch(n) = fixed + n * marginal: two points give both.
        marginal_us = (batch100_us - batch1_us) / (BATCH - 1)
        fixed_us = batch1_us - marginal_us
        report.add("handoff/per-batch", fixed_us, "us fixed cost per batch",
                   detail=(f"paid once: batch of 1 {batch1_us:.1f} us, batch of {BATCH} {batch100_us:.1f} us "
                           f"= {batch100_us / batch1_us:.1f}x batch1 for {BATCH}x the kernels, "
                           f"marginal {marginal_us:.2f} us/kernel"),
                   repeats=LAUNCH_REPEATS,
                   extra={"batch1_us": batch1_us, "batch100_us": batch100_us, "marginal_us_per_kernel": marginal_us})


async def bench_parallel(report: Report, compiler: HostCompiler) -> None:
    object_code = CompileCache(compiler, enabled=False).compile(CHAIN_IR)
    rng = np.random.default_rng(0)
    async with open_device("CPU:0") as cpu0, open_device("CPU:1") as cpu1:
        chain0 = cpu0.load_program(object_code, "bench_fma_chain", ["rw", "i64", "i64"])
        chain1 = cpu1.load_program(object_code, "bench_fma_chain", ["rw", "i64", "i64"])
        a0, b0 = cpu0.allocator.alloc(CHAIN_N * 4), cpu0.allocator.alloc(CHAIN_N * 4)
        a1 = cpu1.allocator.alloc(CHAIN_N * 4)
        for dev, buf in ((cpu0, a0), (cpu0, b0), (cpu1, a1)):
            dev.copyin(buf, rng.uniform(0.0, 2.0, CHAIN_N).astype(np.float32))
        await cpu0.synchronize()
        await cpu1.synchronize()

        # Calibrate `iters` so one launch takes about CHAIN_TARGET_S (direct call, this thread).
        probe = 20_000
        seconds = min(time_repeats(lambda: chain0.cfunc(a0.address, CHAIN_N, probe), 3))
        iters = max(1, round(probe * CHAIN_TARGET_S / seconds))

        async def one_device() -> None:
            with cpu0.batch() as batch:
                batch.launch(chain0, a0, CHAIN_N, iters)
                batch.launch(chain0, b0, CHAIN_N, iters)
            await batch.completion.wait()

        overlaps: list[float] = []
        launch_ms: list[float] = []

        async def two_devices() -> None:
            with cpu0.batch() as first:
                first.launch(chain0, a0, CHAIN_N, iters)
            with cpu1.batch() as second:
                second.launch(chain1, a1, CHAIN_N, iters)
            await first.completion.wait()
            await second.completion.wait()
            t0, t1 = cpu0.queues["compute"].timings[-1], cpu1.queues["compute"].timings[-1]
            assert (t0.value, t1.value) == (first.completion.value, second.completion.value)
            overlap = max(0, min(t0.end_ns, t1.end_ns) - max(t0.start_ns, t1.start_ns))
            overlaps.append(overlap / max(t0.end_ns - t0.start_ns, t1.end_ns - t1.start_ns))
            launch_ms.extend(((t0.end_ns - t0.start_ns) / 1e6, (t1.end_ns - t1.start_ns) / 1e6))

        # The machine's own ceiling, without tinydist: the same kernel called through ctypes twice on
        # this thread, against once each on two plain threads (ctypes releases the GIL).
        scratch = [np.ones(CHAIN_N, np.float32) for _ in range(2)]

        def plain_sequential() -> None:
            for array in scratch:
                chain0.cfunc(array.ctypes.data, CHAIN_N, iters)

        def plain_threads() -> None:
            threads = [threading.Thread(target=chain0.cfunc, args=(array.ctypes.data, CHAIN_N, iters)) for array in scratch]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()

        # Interleave the four so drifting machine load hits all alike.
        await one_device()
        await two_devices()
        overlaps.clear()
        launch_ms.clear()
        one, two, seq, par = [], [], [], []
        for _ in range(PARALLEL_REPEATS):
            _settle()
            one.extend(await atime_repeats(one_device, 1, warmup=0))
            two.extend(await atime_repeats(two_devices, 1, warmup=0))
            seq.extend(time_repeats(plain_sequential, 1, warmup=0))
            par.extend(time_repeats(plain_threads, 1, warmup=0))
        out = np.concatenate([(await d.copyout(b)).view(np.float32) for d, b in ((cpu0, a0), (cpu0, b0), (cpu1, a1))])
        if not np.allclose(out, 1.0, atol=1e-3):
            raise AssertionError(f"FMA chain kernel gave wrong values (expected 1.0): {out[:4]}")

    t_one, t_two = median(one), median(two)
    speedup = t_one / t_two
    report.add("parallel/speedup", speedup, "x", baseline=t_one * 1e3, baseline_label="CPU:0 alone 2 launches",
               baseline_unit="ms",
               detail=(f"CPU:0+CPU:1 {t_two * 1e3:.0f} ms, best repeat {t_one / min(two):.2f}x; "
                       f"{iters} dependent FMAs x {CHAIN_N} elements per launch"),
               target=f">={SPEEDUP_TARGET:g}x", passed=speedup >= SPEEDUP_TARGET, repeats=PARALLEL_REPEATS,
               extra={"one_device_ms": t_one * 1e3, "two_devices_ms": t_two * 1e3, "iters": iters,
                      "best_speedup": t_one / min(two), "two_devices_ms_all": [t * 1e3 for t in two]})
    ceiling = median(seq) / median(par)
    report.add("parallel/machine-ceiling", ceiling, "x", baseline=median(seq) * 1e3,
               baseline_label="plain ctypes 2 calls on one thread", baseline_unit="ms",
               detail=(f"2 plain threads {median(par) * 1e3:.0f} ms, no tinydist, best repeat {median(seq) / min(par):.2f}x; "
                       f"runtime reaches {speedup / ceiling:.0%} of it"),
               repeats=PARALLEL_REPEATS, extra={"sequential_ms": median(seq) * 1e3, "threads_ms": median(par) * 1e3,
                      "best_ceiling": median(seq) / min(par), "threads_ms_all": [t * 1e3 for t in par]})
    report.add("parallel/overlap", median(overlaps) * 100, "% of the longer batch",
               detail=f"batch intervals from queue timings; one launch {median(launch_ms):.0f} ms",
               repeats=PARALLEL_REPEATS, extra={"launch_ms": median(launch_ms)})


async def bench_compile_cache(report: Report, compiler: HostCompiler) -> None:
    # Each repeat uses fresh symbol names (a process links a symbol once): kernel A goes the cold
    # way (compile, store, link); kernel B, the same code under another name, is stored untimed and
    # then goes the warm way through a new cache object (read from disk, link) as a new process would.
    cold, hit, read = [], [], []
    tag = f"{os.getpid()}"
    async with open_device("CPU:0") as dev:
        with tempfile.TemporaryDirectory(prefix="tinydist-bench-cache-") as tmp:
            for r in range(CACHE_REPEATS + 1):
                name_a, name_b = f"bench_cc_a_{tag}_{r}", f"bench_cc_b_{tag}_{r}"
                ir_a, ir_b = saxpy_ir(name_a), saxpy_ir(name_b)
                cache = CompileCache(compiler, Path(tmp), enabled=True)
                _settle()
                start = clock()
                dev.load_program(cache.compile(ir_a), name_a, SAXPY_SIGNATURE)
                cold_s = clock() - start
                assert cache.statistics.misses == 1
                cache.compile(ir_b)
                warm = CompileCache(compiler, Path(tmp), enabled=True)
                _settle()
                start = clock()
                code = warm.compile(ir_b)
                read_s = clock() - start
                dev.load_program(code, name_b, SAXPY_SIGNATURE)
                hit_s = clock() - start
                assert warm.statistics.hits == 1
                if r:  # the first round warms up the file system and the loader
                    cold.append(cold_s)
                    hit.append(hit_s)
                    read.append(read_s)
    cold_ms, hit_ms, read_ms = median(cold) * 1e3, median(hit) * 1e3, median(read) * 1e3
    report.add("compile/cache-hit", hit_ms, "ms read+link", baseline=cold_ms, baseline_label="cold compile+store+link",
               ratio=cold_ms / hit_ms, ratio_label="cold/hit", detail=f"read from disk {read_ms:.3f} ms",
               target=f"<={CACHE_HIT_TARGET_MS:g} ms", passed=hit_ms <= CACHE_HIT_TARGET_MS, repeats=CACHE_REPEATS,
               extra={"cold_ms": cold_ms, "read_ms": read_ms, "link_ms": hit_ms - read_ms})


async def main(report: Report) -> None:
    compiler = HostCompiler()
    report.note(f"tinydist runtime benchmarks ({os.cpu_count()} CPUs; medians of repeats, baselines from this run)")
    await bench_launch(report, compiler)
    await bench_parallel(report, compiler)
    await bench_compile_cache(report, compiler)


if __name__ == "__main__":
    report = Report.from_argv("runtime", description=__doc__.splitlines()[0])
    anyio.run(main, report)
    report.finish()
