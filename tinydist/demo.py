"""The main job on the embedded default: local CPU devices, nothing external.

Compiles two LLVM kernels, runs them on CPU:0 and CPU:1 at the same time through the async
runtime, checks the results against numpy, and prints what ran where and for how long.
"""

from __future__ import annotations

import time

import anyio
import numpy as np

from tinydist.codegen.compile_cache import CompileCache
from tinydist.codegen.compiler import HostCompiler
from tinydist.runtime.registry import open_device

# y[i] = a * x[i] + y[i], float32; vectorised by LLVM's O3 pipeline for the host CPU.
SAXPY_IR = """
define void @demo_saxpy(ptr noalias %y, ptr noalias readonly %x, float %a, i64 %n) {
entry:
  %empty = icmp eq i64 %n, 0
  br i1 %empty, label %exit, label %loop
loop:
  %i = phi i64 [0, %entry], [%next, %loop]
  %px = getelementptr inbounds float, ptr %x, i64 %i
  %py = getelementptr inbounds float, ptr %y, i64 %i
  %vx = load float, ptr %px
  %vy = load float, ptr %py
  %ax = fmul contract float %a, %vx
  %r = fadd contract float %ax, %vy
  store float %r, ptr %py
  %next = add nuw i64 %i, 1
  %done = icmp eq i64 %next, %n
  br i1 %done, label %exit, label %loop
exit:
  ret void
}
"""


async def run_demo(n: int = 1 << 22) -> dict[str, float]:
    cache = CompileCache(HostCompiler())
    started = time.perf_counter()
    object_code = cache.compile(SAXPY_IR)
    compile_ms = (time.perf_counter() - started) * 1e3
    rng = np.random.default_rng(0)
    results: dict[str, float] = {"compile_ms": compile_ms, "cache_hits": cache.statistics.hits}
    async with open_device("CPU:0") as cpu0, open_device("CPU:1") as cpu1:
        inputs, staged, launches = {}, [], []
        for device, a in ((cpu0, 2.0), (cpu1, -0.5)):
            saxpy = device.load_program(object_code, "demo_saxpy", ["rw", "r", "f32", "i64"])
            x, y = rng.standard_normal(n, np.float32), rng.standard_normal(n, np.float32)
            inputs[device.name] = (a, x, y)
            bx, by = device.allocator.alloc(x.nbytes), device.allocator.alloc(y.nbytes)
            device.copyin(bx, x)
            device.copyin(by, y)
            await device.synchronize()
            staged.append((device, saxpy, a, bx, by))
        for device, saxpy, a, bx, by in staged:  # both devices start together and run in parallel
            with device.batch() as batch:
                for _ in range(8):
                    batch.launch(saxpy, by, bx, a, n)
            launches.append((device, by, batch.completion))
        for device, by, completion in launches:
            await completion.wait()
            out = (await device.copyout(by)).view(np.float32)
            a, x, y = inputs[device.name]
            expected = y.copy()
            for _ in range(8):
                expected = (np.float32(a) * x + expected).astype(np.float32)
            np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
            timing = device.queues["compute"].timings[-1]
            results[f"{device.name} ms"] = (timing.end_ns - timing.start_ns) / 1e6
        t0, t1 = (d.queues["compute"].timings[-1] for d in (cpu0, cpu1))
        overlap = max(0, min(t0.end_ns, t1.end_ns) - max(t0.start_ns, t1.start_ns))
        results["overlap_ms"] = overlap / 1e6
    return results


def main() -> None:
    results = anyio.run(run_demo)
    print("tinydist demo: saxpy x8 on CPU:0 and CPU:1 concurrently — results equal numpy")
    for key, value in results.items():
        print(f"  {key:>12}: {value:.3f}" if isinstance(value, float) else f"  {key:>12}: {value}")
