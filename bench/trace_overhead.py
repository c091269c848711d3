"""Tracing overhead: per-kernel cost with tracing off (against a build without the hook) and on.

    .venv/bin/python bench/trace_overhead.py [--json PATH]

A batch of 100 small kernels (saxpy over 64 floats, ~0.4 µs each) is run on the calling thread
(`submit(inline=True)` on an idle queue, so no thread hand-off adds noise) in three builds of the
queue's batch loop, interleaved round by round and compared pairwise within each round:

- unhooked: `CommandQueue._execute` as it was before tracing existed (monkeypatched in);
- off:      the shipped `_execute`, TRACER is None (one global read per batch);
- on:       tracing on: every command timed and recorded.

Lines: per-kernel cost off vs unhooked (target ≤ 1 % more), the hook's cost per batch (batches of
one kernel), per-event cost with tracing on (target ≤ 1 µs), export cost per event, and the cost
of `span()` when tracing is off.
"""

from __future__ import annotations

import dis
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Report, median  # noqa: E402

from tinydist.base.errors import DeviceFailed  # noqa: E402
from tinydist.codegen.compile_cache import CompileCache  # noqa: E402
from tinydist.codegen.compiler import HostCompiler  # noqa: E402
from tinydist.observability import span, tracing  # noqa: E402
from tinydist.runtime import command_queue  # noqa: E402
from tinydist.runtime.command_queue import BatchTiming, CommandQueue  # noqa: E402
from tinydist.runtime.engine import get_engine  # noqa: E402
from tinydist.testing import SAXPY_SIGNATURE, saxpy_ir  # noqa: E402

KERNELS = 100
BATCHES = 200      # per measurement
ROUNDS = 31


def _execute_unhooked(self: CommandQueue, commands, value: int) -> None:
    """CommandQueue._execute exactly as it was before the tracing hook (the reference build)."""
    timeline = self.timeline
    if timeline.failure is not None:
        timeline.retire(value)
        return
    start = time.perf_counter_ns()
    try:
        for fn, args in commands:
            if timeline.failure is not None:
                break
            fn(*args)
    except DeviceFailed as exc:
        self.log.error("batch depended on failed work", value=value, error=str(exc))
        self.device.mark_failed(DeviceFailed(f"{self.name}: batch {value} depended on failed work: {exc}"))
    except BaseException as exc:  # noqa: BLE001
        self.log.error("batch failed", value=value, error=f"{type(exc).__name__}: {exc}")
        self.device.mark_failed(DeviceFailed(f"{self.name}: batch {value} failed: {type(exc).__name__}: {exc}"))
    if timeline.failure is not None:
        timeline.retire(value)
        return
    self.timings.append(BatchTiming(value, len(commands), start, time.perf_counter_ns()))
    timeline.signal(value)


HOOKED = CommandQueue._execute


def _bytecode_difference() -> tuple[int, bool]:
    """(extra instructions in the hooked _execute, whether its untraced loop body is identical)."""
    def ops(fn):
        return [i.opname for i in dis.get_instructions(fn)]

    def loop(fn):
        names = ops(fn)
        start = names.index("FOR_ITER")
        return names[start:names.index("JUMP_BACKWARD", start) + 1]

    return len(ops(HOOKED)) - len(ops(_execute_unhooked)), loop(HOOKED) == loop(_execute_unhooked)


def _run(queue: CommandQueue, commands, batches: int) -> float:
    """Seconds for `batches` inline submissions of `commands`."""
    submit = queue.submit
    start = time.perf_counter()
    for _ in range(batches):
        submit(commands, True)
    return time.perf_counter() - start


def _run_worker(queue: CommandQueue, commands, batches: int) -> float:
    """Seconds for `batches` submissions handed to the worker thread, each waited for."""
    submit, wait = queue.submit, queue.timeline.wait_blocking
    start = time.perf_counter()
    for _ in range(batches):
        wait(submit(commands), 10.0)
    return time.perf_counter() - start


def _measure(queue: CommandQueue, commands, mode: str, batches: int, run=_run) -> float:
    if mode == "unhooked":
        CommandQueue._execute = _execute_unhooked
        try:
            return run(queue, commands, batches)
        finally:
            CommandQueue._execute = HOOKED
    if mode == "on":
        tracer = tracing.start(tracing.Tracer(max_events=1 << 30))
        try:
            return run(queue, commands, batches)
        finally:
            tracing.stop(tracer, wait=False)
    return run(queue, commands, batches)


def main() -> None:
    report = Report.from_argv("trace_overhead", description=__doc__)
    assert command_queue.TRACER is None, "unset TINYDIST_TRACE to measure"
    dev = get_engine().device("CPU:0")
    program = dev.load_program(CompileCache(HostCompiler()).compile(saxpy_ir("bench_trace_saxpy")), "bench_trace_saxpy", SAXPY_SIGNATURE)
    x, y = dev.allocator.alloc(4 * 64), dev.allocator.alloc(4 * 64)
    command = (program.cfunc, (y.address, x.address, 1.0, 64))
    queue = dev.queues["compute"]
    report.note(f"tracing overhead: batches of {KERNELS} kernels (saxpy, 64 floats) run inline; "
                f"{ROUNDS} interleaved rounds x {BATCHES} batches; medians of per-round figures")

    # direct ctypes calls: the floor
    fn, args = command
    direct = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(BATCHES * KERNELS // 10):
            fn(*args)
        direct.append((time.perf_counter() - start) / (BATCHES * KERNELS // 10) * 1e6)

    batch = [command] * KERNELS
    for mode in ("unhooked", "off", "on"):
        _measure(queue, batch, mode, 20)  # warm up
    per_kernel = {"unhooked": [], "off": [], "on": []}
    ratios_off, deltas_on = [], []
    for r in range(ROUNDS):
        order = ("unhooked", "off", "on") if r % 2 == 0 else ("on", "off", "unhooked")
        got = {mode: _measure(queue, batch, mode, BATCHES) / (BATCHES * KERNELS) * 1e6 for mode in order}
        for mode, v in got.items():
            per_kernel[mode].append(v)
        ratios_off.append(got["off"] / got["unhooked"])
        deltas_on.append(got["on"] - got["off"])
    unhooked, off, on = (median(per_kernel[m]) for m in ("unhooked", "off", "on"))
    overhead = (median(ratios_off) - 1) * 100
    spread = statistics.quantiles([(q - 1) * 100 for q in ratios_off], n=4)
    report.add("kernel/direct", median(direct), "us per call", detail="ctypes call on this thread, no runtime",
               repeats=ROUNDS)
    report.add("trace/off-vs-unhooked", overhead, "% per kernel", value_label="off",
               baseline=unhooked, baseline_label="unhooked build", baseline_unit="us/kernel",
               detail=f"off {off:.4f} us/kernel; paired ratios' quartiles {spread[0]:+.2f} %, {spread[2]:+.2f} %",
               target="<=1 %", passed=overhead <= 1.0, repeats=ROUNDS)

    # the same through the worker thread (hand-off and wake-up included), off vs unhooked
    worker = {"unhooked": [], "off": []}
    worker_ratios = []
    for r in range(ROUNDS):
        order = ("unhooked", "off") if r % 2 == 0 else ("off", "unhooked")
        got = {mode: _measure(queue, batch, mode, BATCHES // 4, _run_worker) / (BATCHES // 4 * KERNELS) * 1e6 for mode in order}
        for mode, v in got.items():
            worker[mode].append(v)
        worker_ratios.append(got["off"] / got["unhooked"])
    w_overhead = (median(worker_ratios) - 1) * 100
    w_spread = statistics.quantiles([(q - 1) * 100 for q in worker_ratios], n=4)
    report.add("trace/off-vs-unhooked-worker", w_overhead, "% per kernel", value_label="off",
               baseline=median(worker["unhooked"]), baseline_label="unhooked build", baseline_unit="us/kernel",
               detail=f"off {median(worker['off']):.4f} us/kernel, submit->completion through the worker thread "
                      f"(thread scheduling noise: paired ratios' quartiles {w_spread[0]:+.2f} %, {w_spread[2]:+.2f} %)",
               repeats=ROUNDS)
    extra, same_loop = _bytecode_difference()
    report.add("trace/off-bytecode", extra, "extra bytecode instructions in _execute (static count; once per batch)", value_label="off",
               detail=f"untraced per-command loop identical to the unhooked build: {same_loop} (0 per command)",
               target="0 per command", passed=same_loop)

    # the hook per batch: batches of one kernel, off vs unhooked
    one = [command]
    per_batch_delta = []
    for _ in range(ROUNDS):
        a = _measure(queue, one, "unhooked", BATCHES * 5)
        b = _measure(queue, one, "off", BATCHES * 5)
        per_batch_delta.append((b - a) / (BATCHES * 5) * 1e9)
    report.add("trace/hook-per-batch", median(per_batch_delta), "ns per batch (off minus unhooked, batches of 1 kernel)",
               detail="one global read per batch; noise is of the same order", repeats=ROUNDS)

    per_event = median(deltas_on)  # one event per command (+1 per batch, amortised over 100)
    report.add("trace/on-per-event", per_event * 1000, "ns per event", value_label="on",
               baseline=off, baseline_label="off", baseline_unit="us/kernel",
               detail=f"on {on:.4f} us/kernel", target="<=1000 ns", passed=per_event <= 1.0, repeats=ROUNDS)

    # export cost (not on the hot path: at the end of a trace)
    tracer = tracing.start(tracing.Tracer(max_events=1 << 30))
    _run(queue, batch, BATCHES)
    tracing.stop(tracer, wait=False)
    start = time.perf_counter()
    data = tracer.chrome()
    export = (time.perf_counter() - start) / max(tracer.events, 1) * 1e9
    report.add("trace/export", export, "ns per event", detail=f"{tracer.events} events -> {len(data['traceEvents'])} JSON events, at the end")

    # span() when tracing is off
    n = 200_000
    start = time.perf_counter()
    for _ in range(n):
        with span("x", process="rank0", lane="collective"):
            pass
    report.add("trace/span-off", (time.perf_counter() - start) / n * 1e9, "ns per `with span(...)`",
               detail="tracing off: shared no-op context manager")
    x.free()
    y.free()
    report.finish()


if __name__ == "__main__":
    main()
