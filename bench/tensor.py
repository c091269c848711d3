"""Lazy-tensor benchmarks on ONE core: fused kernels against numpy measured in the same run.

    .venv/bin/python bench/tensor.py [--repeats 9] [--cpu N] [--only fused sum ...] [--json PATH]

Every figure is a median of repeats (after warm-up calls: the first call compiles), with the
tinydist side in this process and the numpy baseline in a subprocess, both pinned to the same CPU
(os.sched_setaffinity, every thread), their repeats alternating so drifting load hits both alike. The baseline's environment drops OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE
(see bench/_common.py) and sets OPENBLAS_NUM_THREADS=1, one environment for all baselines even
where numpy does not call BLAS. Each tinydist result is checked against numpy (allclose) once,
before timing.

1. fused   `(A*B+C).relu().realize(); td.synchronize()` on 16M float32 against numpy's
           `np.maximum(a*b+c, 0)` (which makes temporaries) — target >= 3x;
2. sum     of 16M float32 — target >= 2x;
3. softmax over the rows of a 4096x4096 float32 matrix against
           `e = np.exp(x - x.max(1, keepdims=True)); e / e.sum(1, keepdims=True)` — target >= 2x;
4. matmul  1024x1024 float32, `(A @ B).realize(); td.synchronize()` against numpy's `a @ b` on one
           OpenBLAS thread, in GFLOP/s — target >= 0.9x;
5. graph   a chain of 100 tiny ops (alternating `t - t.max(1)` and `t - t.mean(0)` on 8x8, which
           schedules to ~100 kernels), rebuilt every iteration (the schedule cache hits):
           (realize + synchronize time) / kernels, next to numpy's time per op for the same 100 ops.

Timed calls for 1-4 include building the lazy graph (the whole user-visible expression); the
previous result is dropped and garbage collected (untimed) before each repeat, on both sides, and
the collector is off while a call is timed. Alongside wall time, the kernel-only time is the sum of
the compute-queue batches' BatchTiming (start_ns..end_ns) that the call submitted: what the worker
thread spent running kernels, so wall - kernel is the runtime's overhead (graph build, schedule,
bind, submit, hand-off, wake-up). Kernels are the schedule's calls; a batch may run a stretch of
them as one command (`tinydist.engine.lowered`), so commands are counted apart.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Report, baseline_env, median  # noqa: E402

N = 1 << 24            # 16M elements
SOFTMAX_SHAPE = (4096, 4096)
MATMUL_N = 1024
GRAPH_SHAPE = (8, 8)
GRAPH_STEPS = 50       # 2 ops per step: 100 numpy ops
GRAPH_ITERS = 20       # realizes per repeat for the tiny graph
WARMUP = 3

TARGETS = {"fused": 3.0, "sum": 2.0, "softmax": 2.0, "matmul": 0.9}
CASES = ("fused", "sum", "softmax", "matmul", "graph")


# ---- inputs and numpy reference expressions (the same in both processes) -------------------------

def inputs(case: str) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    if case == "fused":
        return [rng.standard_normal(N, dtype=np.float32) for _ in range(3)]
    if case == "sum":
        return [rng.random(N, dtype=np.float32)]  # positive: a relative tolerance means something
    if case == "softmax":
        return [rng.standard_normal(SOFTMAX_SHAPE, dtype=np.float32)]
    if case == "matmul":
        return [rng.standard_normal((MATMUL_N, MATMUL_N), dtype=np.float32) for _ in range(2)]
    if case == "graph":
        return [rng.standard_normal(GRAPH_SHAPE, dtype=np.float32)]
    raise ValueError(case)


def graph_chain(t: Any, keepdim: dict[str, bool]) -> Any:
    """The tiny-op chain, written once for both libraries (`keepdim` spells the keyword)."""
    for i in range(GRAPH_STEPS):
        t = t - t.max(1, **keepdim) if i % 2 == 0 else t - t.mean(0, **keepdim)
    return t


def numpy_fn(case: str, arrays: list[np.ndarray]) -> Callable[[], Any]:
    if case == "fused":
        a, b, c = arrays
        return lambda: np.maximum(a * b + c, 0)
    if case == "sum":
        (a,) = arrays
        return lambda: a.sum()
    if case == "softmax":
        (x,) = arrays

        def softmax() -> np.ndarray:
            e = np.exp(x - x.max(1, keepdims=True))
            return e / e.sum(1, keepdims=True)
        return softmax
    if case == "matmul":
        a, b = arrays
        return lambda: a @ b
    if case == "graph":
        (x,) = arrays

        def chain() -> np.ndarray:
            for _ in range(GRAPH_ITERS):
                out = graph_chain(x, {"keepdims": True})
            return out
        return chain
    raise ValueError(case)


class Timer:
    """One call timed at a time: the previous result is dropped and collected (untimed) first, and
    the collector is off while the call runs."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.call = call
        self.result: Any = None

    def warm_up(self, calls: int = WARMUP) -> None:
        for _ in range(calls):
            self.result = None
            self.result = self.call()

    def once(self, before: Callable[[], None] | None = None) -> float:
        self.result = None
        gc.collect()
        if before is not None:
            before()
        gc.disable()
        try:
            start = time.perf_counter()
            self.result = self.call()
            return time.perf_counter() - start
        finally:
            gc.enable()


def numpy_server() -> None:
    """The baseline subprocess: reads `CASE warmup` or `CASE time` lines, answers one JSON line each.
    Both processes are pinned to the same CPU, so this one is idle (blocked on stdin) while the
    tinydist side runs, and the two sides' repeats alternate: drifting load hits both alike."""
    timers: dict[str, Timer] = {}
    print(json.dumps({"numpy": np.__version__, "env": {k: os.environ.get(k) for k in (
        "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}}), flush=True)
    for line in sys.stdin:
        case, what = line.split()
        if case not in timers:
            timers.clear()  # the previous case's arrays go before this one's are made
            gc.collect()
            timers[case] = Timer(numpy_fn(case, inputs(case)))
        if what == "warmup":
            timers[case].warm_up()
            print("null", flush=True)
        else:
            print(json.dumps(timers[case].once()), flush=True)


class NumpyBaseline:
    def __init__(self, cpu: int) -> None:
        command = [sys.executable, __file__, "--worker", "--cpu", str(cpu)]
        env = baseline_env({"OPENBLAS_NUM_THREADS": "1"})
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self._ask(None)

    def _ask(self, request: str | None) -> Any:
        assert self.process.stdin is not None and self.process.stdout is not None
        if request is not None:
            self.process.stdin.write(request + "\n")
            self.process.stdin.flush()
        answer = self.process.stdout.readline()
        if not answer:
            raise RuntimeError(f"the numpy baseline process exited (status {self.process.wait()})")
        return json.loads(answer)

    def warm_up(self, case: str) -> None:
        self._ask(f"{case} warmup")

    def once(self, case: str) -> float:
        return self._ask(f"{case} time")

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait()


# ---- the tinydist side -------------------------------------------------------------------------

class Side:
    """The tinydist engine, and the compute queue's batch timings each call submitted."""

    def __init__(self) -> None:
        import tinydist as td
        self.td = td
        self.queue = td.get_engine().device("CPU:0").queues["compute"]

    def last_value(self) -> int:
        return self.queue.timings[-1].value if self.queue.timings else 0

    def kernel_seconds(self, after: int) -> tuple[float, int, int]:
        """Sum of batch durations, batches and commands for batches with timeline value > after."""
        batches = [t for t in self.queue.timings if t.value > after]
        return sum(t.end_ns - t.start_ns for t in batches) / 1e9, len(batches), sum(t.commands for t in batches)

    def once(self, timer: Timer) -> tuple[float, float, int, int]:
        """Wall seconds of one timed call (which must realize and synchronize), kernel-only seconds,
        batches and kernels it submitted."""
        mark: list[int] = []
        wall = timer.once(lambda: (self.td.synchronize(), mark.append(self.last_value())))
        return (wall, *self.kernel_seconds(mark[0]))


def check(name: str, ours: np.ndarray, reference: Any, **tolerance: float) -> None:
    if not np.allclose(ours, reference, **tolerance):
        error = np.max(np.abs(np.asarray(ours, np.float64) - np.asarray(reference, np.float64)))
        raise AssertionError(f"{name}: tinydist disagrees with numpy (max abs error {error:g}, {tolerance})")


def bench_big(report: Report, side: Side, baseline: NumpyBaseline, case: str, repeats: int, cpu: int) -> None:
    td = side.td
    arrays = inputs(case)
    tensors = [td.Tensor(a) for a in arrays]
    td.synchronize()
    if case == "fused":
        A, B, C = tensors
        build = lambda: (A * B + C).relu()  # noqa: E731
        name, tol = "fused max(a*b+c,0) 16M f32", {"rtol": 1e-5, "atol": 1e-6}
    elif case == "sum":
        (A,) = tensors
        build = lambda: A.sum()  # noqa: E731
        name, tol = "sum 16M f32", {"rtol": 1e-4, "atol": 0.0}
    elif case == "softmax":
        (X,) = tensors
        build = lambda: X.softmax(1)  # noqa: E731
        name, tol = "softmax rows 4096x4096 f32", {"rtol": 1e-4, "atol": 1e-8}
    else:
        A, B = tensors
        build = lambda: A @ B  # noqa: E731
        name, tol = "matmul 1024^3 f32", {"rtol": 1e-3, "atol": 1e-3}

    from tinydist.schedule import create_schedule
    schedule_calls = [type(c).__name__ for c in create_schedule([build().node])[0].linear]
    check(name, build().numpy(), numpy_fn(case, arrays)(), **tol)

    def call() -> Any:
        out = build().realize()
        td.synchronize()
        return out

    timer = Timer(call)
    timer.warm_up()
    baseline.warm_up(case)
    walls, kernels, base_times = [], [], []
    batches = commands = 0
    for _ in range(repeats):  # alternate the sides, one repeat each
        wall, seconds, batches, commands = side.once(timer)
        walls.append(wall)
        kernels.append(seconds)
        base_times.append(baseline.once(case))
    timer.result = None
    wall, kernel, base = median(walls), median(kernels), median(base_times)
    target = TARGETS[case]
    extra = {"tinydist_ms_all": [w * 1e3 for w in walls], "kernel_ms_all": [k * 1e3 for k in kernels],
             "numpy_ms_all": [t * 1e3 for t in base_times], "kernel_ms": kernel * 1e3,
             "overhead_ms": (wall - kernel) * 1e3, "batches": batches, "commands": commands,
             "schedule": schedule_calls, "numpy_env": baseline.info["env"], "numpy_version": baseline.info["numpy"],
             "cpu": cpu}
    if case == "matmul":
        flops = 2.0 * MATMUL_N ** 3
        ours, theirs, kernel_rate = flops / wall / 1e9, flops / base / 1e9, flops / kernel / 1e9
        ratio = ours / theirs
        extra.update(tinydist_ms=wall * 1e3, numpy_ms=base * 1e3, kernel_gflops=kernel_rate)
        report.add(name, ours, "GFLOP/s", value_label="tinydist", baseline=theirs, baseline_unit="GFLOP/s",
                   baseline_label="numpy(OpenBLAS 1 thread)", ratio=ratio, ratio_label="ratio",
                   detail=(f"wall {wall * 1e3:.2f} ms, kernel-only {kernel * 1e3:.2f} ms = {kernel_rate:.1f} GFLOP/s "
                           f"({kernel / wall:.0%} of wall), ratio on kernel-only {kernel_rate / theirs:.2f}x; "
                           f"{len(schedule_calls)} kernels in {batches} batch(es), {commands} command(s)"),
                   target=f">={target:g}x", passed=ratio >= target, repeats=repeats, extra=extra)
        return
    ratio = base / wall
    report.add(name, wall * 1e3, "ms", value_label="tinydist", baseline=base * 1e3, baseline_label="numpy",
               ratio=ratio, ratio_label="ratio",
               detail=(f"kernel-only {kernel * 1e3:.2f} ms = {kernel / wall:.0%} of wall, runtime overhead "
                       f"{(wall - kernel) * 1e3:.2f} ms, ratio on kernel-only {base / kernel:.2f}x; "
                       f"{len(schedule_calls)} kernel(s) in {batches} batch(es), {commands} command(s)"),
               target=f">={target:g}x", passed=ratio >= target, repeats=repeats, extra=extra)


def bench_graph(report: Report, side: Side, baseline: NumpyBaseline, repeats: int, cpu: int) -> None:
    td = side.td
    from tinydist.schedule import create_schedule
    (x,) = inputs("graph")
    X = td.Tensor(x)
    td.synchronize()
    build = lambda: graph_chain(X, {"keepdim": True})  # noqa: E731
    n_kernels = len(create_schedule([build().node])[0].linear)
    check("graph", build().numpy(), graph_chain(x, {"keepdims": True}), rtol=1e-5, atol=1e-5)
    n_ops = 2 * GRAPH_STEPS

    build_s: list[float] = []
    realize_s: list[float] = []

    def iterations() -> Any:
        """GRAPH_ITERS realize+synchronize calls, each on a freshly built graph (untimed build)."""
        total = built = 0.0
        for _ in range(GRAPH_ITERS):
            start = time.perf_counter()
            t = build()
            middle = time.perf_counter()
            t.realize()
            td.synchronize()
            total += time.perf_counter() - middle
            built += middle - start
        build_s.append(built / GRAPH_ITERS)
        realize_s.append(total / GRAPH_ITERS)
        return t

    timer = Timer(iterations)
    timer.warm_up()
    baseline.warm_up("graph")
    build_s.clear()
    realize_s.clear()
    kernel_s, base_times = [], []
    for _ in range(repeats):  # alternate the sides, one repeat each
        kernel_s.append(side.once(timer)[1] / GRAPH_ITERS)
        base_times.append(baseline.once("graph"))
    timer.result = None
    per_realize, kernel = median(realize_s), median(kernel_s)
    per_kernel_us = per_realize / n_kernels * 1e6
    numpy_chain = median(base_times) / GRAPH_ITERS
    numpy_per_op_us = numpy_chain / n_ops * 1e6
    report.add(f"graph {n_ops} tiny ops 8x8 f32", per_kernel_us, "us/kernel", value_label="tinydist",
               baseline=numpy_per_op_us, baseline_label="numpy per op", baseline_unit="us",
               ratio=per_kernel_us / numpy_per_op_us, ratio_label="tinydist per kernel / numpy per op",
               detail=(f"{n_kernels} kernels, realize+synchronize {per_realize * 1e3:.2f} ms, graph build "
                       f"{median(build_s) * 1e3:.2f} ms (untimed), kernel-only {kernel * 1e6:.0f} us "
                       f"= {kernel / n_kernels * 1e6:.2f} us/kernel; numpy {n_ops} ops {numpy_chain * 1e6:.0f} us"),
               repeats=repeats,
               extra={"kernels": n_kernels, "numpy_ops": n_ops, "realize_ms": per_realize * 1e3,
                      "build_ms": median(build_s) * 1e3, "kernel_us": kernel * 1e6,
                      "realize_ms_all": [t * 1e3 for t in realize_s], "iterations_per_repeat": GRAPH_ITERS,
                      "numpy_us_per_chain": numpy_chain * 1e6, "cpu": cpu})


def pin_process(cpu: int) -> None:
    """Pin every thread this process has (numpy's import may have started OpenBLAS threads) to `cpu`;
    threads started later inherit the affinity of the thread that starts them."""
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), {cpu})
        except (ProcessLookupError, ValueError):
            pass


def threads_pinned(cpu: int) -> bool:
    for status in Path("/proc/self/task").glob("*/status"):
        try:
            line = next(s for s in status.read_text().splitlines() if s.startswith("Cpus_allowed_list"))
        except (OSError, StopIteration):
            continue
        if line.split()[-1] != str(cpu):
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--cpu", type=int, default=min(os.sched_getaffinity(0)), help="the core both sides run on")
    parser.add_argument("--only", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results as a JSON list to PATH")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats < 7:
        parser.error("--repeats must be at least 7")
    # Pin before tinydist starts any thread: threads inherit the creating thread's affinity.
    pin_process(args.cpu)
    if args.worker:
        numpy_server()
        return

    report = Report("tensor", args.json)
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    report.note(f"# tensor benchmarks on CPU {args.cpu} only; load average {load}; {os.cpu_count()} CPUs")
    side = Side()
    baseline = NumpyBaseline(args.cpu)
    try:
        for case in args.only:
            if case == "graph":
                bench_graph(report, side, baseline, args.repeats, args.cpu)
            else:
                bench_big(report, side, baseline, case, args.repeats, args.cpu)
    finally:
        baseline.close()
    if not threads_pinned(args.cpu):
        report.note(f"# WARNING: some threads of this process are not pinned to CPU {args.cpu}")
    report.finish()


if __name__ == "__main__":
    main()
