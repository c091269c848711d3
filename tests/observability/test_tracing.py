"""Tracing: a traced two-device program gives valid Trace Event Format with lanes per queue and
flows between real events; tracing off records nothing and does no per-command work; per-rank
files and their merge; the profile command; the Gantt chart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

import tinydist as td
from tinydist import cli
from tinydist.base.errors import DeviceFailed
from tinydist.codegen.compile_cache import CompileCache
from tinydist.codegen.compiler import HostCompiler
from tinydist.observability import chrome, span, tracing
from tinydist.observability.report import format_summary, summarize
from tinydist.runtime import command_queue
from tinydist.runtime.engine import get_engine
from tinydist.runtime.registry import open_device
from tinydist.testing import scale_ir

# out[i] = a * in[i]  (float32)
SCALE_IR = scale_ir("obs_scale_f32")
N = 1024


@pytest.fixture(scope="module")
def scale_code() -> bytes:
    return CompileCache(HostCompiler()).compile(SCALE_IR)


@pytest.fixture(autouse=True)
def no_tracer_left():
    assert command_queue.TRACER is None, "a tracer was left installed"
    yield
    assert command_queue.TRACER is None, "a tracer was left installed"


def _two_device_program(scale_code: bytes) -> np.ndarray:
    """CPU:0: copy in, scale ×2; copy to CPU:1; CPU:1: scale ×3, ×0.5; copy out."""
    engine = get_engine()
    d0, d1 = engine.device("CPU:0"), engine.device("CPU:1")
    k0 = d0.load_program(scale_code, "obs_scale_f32", ["w", "r", "f32", "i64"])
    k1 = d1.load_program(scale_code, "obs_scale_f32", ["w", "r", "f32", "i64"])
    a0, b0 = d0.allocator.alloc(4 * N), d0.allocator.alloc(4 * N)
    a1, b1 = d1.allocator.alloc(4 * N), d1.allocator.alloc(4 * N)
    try:
        d0.copyin(a0, np.arange(N, dtype=np.float32))
        with d0.batch() as batch:
            batch.launch(k0, b0, a0, 2.0, N)
        with d1.batch("copy") as batch:
            batch.copy(a1, b0)                      # waits on CPU:0 compute: a flow
        with d1.batch() as batch:
            batch.launch(k1, b1, a1, 3.0, N)        # waits on CPU:1 copy: a flow
            batch.launch(k1, a1, b1, 0.5, N)
        return engine.run(d1.copyout, a1).view(np.float32)  # a host sync
    finally:
        for buf in (a0, b0, a1, b1):
            buf.free()


def _lanes(trace: dict) -> tuple[dict[int, str], dict[tuple[int, int], str]]:
    processes, threads = {}, {}
    for e in trace["traceEvents"]:
        if e["ph"] == "M" and e["name"] == "process_name":
            processes[e["pid"]] = e["args"]["name"]
        if e["ph"] == "M" and e["name"] == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    return processes, threads


def _enclosing(xs: list[dict], pid: int, tid: int, ts: float, cat: set[str]) -> dict | None:
    found = [e for e in xs if e["pid"] == pid and e["tid"] == tid and e["cat"] in cat
             and e["ts"] - 1e-3 <= ts <= e["ts"] + e["dur"] + 1e-3]
    return found[0] if found else None


def test_traced_two_device_program_is_valid_trace_event_format(scale_code: bytes, tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    with td.trace(path) as tracer:
        result = _two_device_program(scale_code)
    np.testing.assert_allclose(result, np.arange(N, dtype=np.float32) * 3.0)
    trace = json.loads(path.read_text())

    assert chrome.validate(trace) == []
    events = trace["traceEvents"]
    assert {e["ph"] for e in events} <= {"X", "M", "s", "f", "C"}  # complete events only: no B/E to balance
    processes, threads = _lanes(trace)
    pid = {name: p for p, name in processes.items()}
    assert {"CPU:0", "CPU:1"} <= set(pid)
    for device in ("CPU:0", "CPU:1"):
        lanes = {name for (p, _), name in threads.items() if p == pid[device]}
        assert {"compute", "copy"} <= lanes                     # one lane per queue
    xs = [e for e in events if e["ph"] == "X"]
    for e in xs:
        assert processes[e["pid"]] in ("CPU:0", "CPU:1") and (e["pid"], e["tid"]) in threads
        assert isinstance(e["ts"], float | int) and e["dur"] >= 0

    # commands nest inside their batch, on their queue's lane, and carry device/queue/value
    batches = [e for e in xs if e["cat"] == "batch"]
    commands = [e for e in xs if e["cat"] in ("kernel", "copy", "wait")]
    for c in commands:
        parent = _enclosing(batches, c["pid"], c["tid"], c["ts"], {"batch"})
        assert parent is not None and c["ts"] + c["dur"] <= parent["ts"] + parent["dur"] + 1e-3
        assert (c["args"]["device"], c["args"]["queue"], c["args"]["value"]) == \
               (parent["args"]["device"], parent["args"]["queue"], parent["args"]["value"])
        assert threads[(c["pid"], c["tid"])] == c["args"]["queue"]
    kernels = [e for e in commands if e["cat"] == "kernel"]
    assert [(processes[k["pid"]], k["name"]) for k in sorted(kernels, key=lambda k: k["ts"])] == \
           [("CPU:0", "obs_scale_f32"), ("CPU:1", "obs_scale_f32"), ("CPU:1", "obs_scale_f32")]
    assert all(threads[(k["pid"], k["tid"])] == "compute" for k in kernels)
    copies = [e for e in commands if e["cat"] == "copy"]
    assert len(copies) == 3 and all(c["args"]["bytes"] == 4 * N for c in copies)
    assert sorted(processes[c["pid"]] for c in copies) == ["CPU:0", "CPU:1", "CPU:1"]

    # flows connect the batch that signalled a value to the wait it released
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    finishes = {e["id"]: e for e in events if e["ph"] == "f"}
    assert set(starts) == set(finishes) and len(starts) >= 3
    for fid, s in starts.items():
        f = finishes[fid]
        source = _enclosing(batches, s["pid"], s["tid"], s["ts"], {"batch"})
        waiter = _enclosing(xs, f["pid"], f["tid"], f["ts"], {"wait", "host sync"})
        assert source is not None and waiter is not None, (s, f)
        assert (source["args"]["timeline"], source["args"]["value"]) == (waiter["args"]["timeline"], waiter["args"]["target"])
        assert f["ts"] >= s["ts"] and f["bp"] == "e"
    cross = [fid for fid, s in starts.items() if s["pid"] != finishes[fid]["pid"]]
    assert cross, "the CPU:0 → CPU:1 copy's wait should have a cross-device flow"
    assert any(e["cat"] == "host sync" for e in xs)             # copyout waited on the host

    # bytes in flight counters go up by the copy size and back to zero
    counters = defaultdict(list)
    for e in events:
        if e["ph"] == "C":
            counters[e["pid"]].append(e["args"]["bytes"])
    assert set(counters) == {pid["CPU:0"], pid["CPU:1"]}
    assert all(max(v) == 4 * N and v[-1] == 0 for v in counters.values())
    assert trace["otherData"]["tinydist"]["origin_monotonic_ns"] == tracer.origin_ns


def test_summary_counts_kernels_and_queue_busy(scale_code: bytes) -> None:
    with td.trace() as tracer:
        _two_device_program(scale_code)
    data = tracer.chrome()
    s = summarize(data)
    kernel = next(r for r in s["names"] if r["name"] == "obs_scale_f32")
    assert kernel["count"] == 3 and kernel["total_us"] > 0 and 0 < kernel["share"] <= 1
    lanes = {(r["process"], r["lane"]): r for r in s["lanes"]}
    assert {("CPU:0", "compute"), ("CPU:1", "compute"), ("CPU:1", "copy")} <= set(lanes)
    assert all(0 < r["busy"] <= 1 for r in lanes.values())
    text = format_summary(data)
    assert "obs_scale_f32" in text and "busy %" in text


def _kernel_commands(scale_code: bytes, count: int):
    dev = get_engine().device("CPU:2")
    k = dev.load_program(scale_code, "obs_scale_f32", ["w", "r", "f32", "i64"])
    a, b = dev.allocator.alloc(4 * 64), dev.allocator.alloc(4 * 64)
    args = (b.address, a.address, 2.0, 64)
    return dev, [(k.cfunc, args)] * count, (a, b)


class _CountingTime:
    """Stands in for the `time` module in command_queue: counts perf_counter_ns calls."""

    def __init__(self) -> None:
        import time
        self.calls = 0
        self._real = time.perf_counter_ns

    def perf_counter_ns(self) -> int:
        self.calls += 1
        return self._real()


def test_tracing_off_records_nothing_and_does_no_per_command_work(scale_code: bytes, monkeypatch) -> None:
    dev, commands, bufs = _kernel_commands(scale_code, 500)
    queue = dev.queues["compute"]
    idle = tracing.Tracer()  # made but never started: must receive nothing

    def must_not_run(*args, **kwargs):
        raise AssertionError("the tracer ran while tracing was off")

    monkeypatch.setattr(tracing.Tracer, "run_batch", must_not_run)
    counting = _CountingTime()
    monkeypatch.setattr(command_queue, "time", counting)
    calls = []
    for batch in (commands[:1], commands):  # 1 command, then 500
        counting.calls = 0
        queue.submit(batch, inline=True)
        queue.timeline.wait_blocking(queue.last_submitted, 10)
        calls.append(counting.calls)
    assert calls == [2, 2]  # the batch's start and end: nothing per command
    assert idle.batches == [] and idle.events == 0

    # allocation: none retained per command (a BatchTiming per batch is all that stays)
    queue.submit(commands, inline=True)  # warm up
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(4):
            queue.submit(commands, inline=True)  # the queue is idle: runs on this thread
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    cq_file = command_queue.__file__
    grown = sum(d.size_diff for d in after.compare_to(before, "filename") if d.traceback[0].filename == cq_file)
    assert grown < 2000, f"{grown} bytes retained by command_queue for 2000 untraced commands"
    for buf in bufs:
        buf.free()


def test_tracing_on_times_every_command(scale_code: bytes, monkeypatch) -> None:
    dev, commands, bufs = _kernel_commands(scale_code, 200)
    queue = dev.queues["compute"]
    counting = _CountingTime()
    monkeypatch.setattr(tracing, "clock", counting.perf_counter_ns)
    with td.trace() as tracer:
        queue.submit(commands, inline=True)
        queue.timeline.wait_blocking(queue.last_submitted, 10)
    assert counting.calls >= 2 * 200 + 2
    [(info, value, start, end, failed, timed)] = [b for b in tracer.batches if b[0].device == "CPU:2"]
    assert len(timed) == 200 and not failed and value == queue.last_submitted
    assert all(start <= t0 <= t1 <= end for t0, t1, _, _ in timed)
    names = {e["name"] for e in tracer.chrome()["traceEvents"] if e.get("cat") == "kernel"}
    assert names == {"obs_scale_f32"}
    for buf in bufs:
        buf.free()


async def _fail_in_batch() -> None:
    def boom() -> None:
        raise RuntimeError("injected")

    async with open_device("CPU:3") as dev:
        with dev.batch() as batch:
            batch.command(boom, ())
        with pytest.raises(DeviceFailed):
            await batch.completion.wait(timeout=5)


def test_a_failing_command_is_recorded_and_fails_the_device_as_untraced() -> None:
    import anyio
    with td.trace() as tracer:
        anyio.run(_fail_in_batch)
    [(info, value, start, end, failed, timed)] = [b for b in tracer.batches if b[0].device == "CPU:3"]
    assert failed and len(timed) == 1 and timed[0][2].__name__ == "boom"
    assert chrome.validate(tracer.chrome()) == []


def test_span_is_a_shared_no_op_when_off_and_an_event_when_on() -> None:
    assert span("x") is span("y", process="rank0", lane="collective", nbytes=4)
    with span("nothing"):
        pass
    with td.trace() as tracer:
        with span("allreduce", process="rank0", lane="collective", cat="collective", bytes=64):
            with span("step 1", process="rank0", lane="collective", cat="collective"):
                pass
        with span("rpc Launch", process="node", lane="rpc", cat="rpc", status="OK"):
            pass
    data = tracer.chrome()
    assert chrome.validate(data) == []
    names = {e["name"]: e for e in data["traceEvents"] if e["ph"] == "X"}
    assert names["allreduce"]["args"] == {"bytes": 64} and names["rpc Launch"]["cat"] == "rpc"
    processes, threads = _lanes(data)
    assert {"rank0", "node"} <= set(processes.values()) and {"collective", "rpc"} <= set(threads.values())


def _cli(argv: list[str]) -> int:
    """Run `tinydist ARGV` in this process without `cli.main`'s logging reconfiguration (which
    would bind loggers made meanwhile to pytest's per-test capture stream)."""
    args = cli.build_parser().parse_args(argv)
    return args.run(args)


def test_rank_files_and_merge_on_one_clock(scale_code: bytes, tmp_path: Path, monkeypatch) -> None:
    paths = []
    for rank in (0, 1):
        monkeypatch.setenv("TINYDIST_RANK", str(rank))
        with td.trace(tmp_path / "job.json"):
            _two_device_program(scale_code)
        paths.append(tmp_path / f"job.rank{rank}.json")
    monkeypatch.delenv("TINYDIST_RANK")
    assert all(p.exists() for p in paths) and not (tmp_path / "job.json").exists()
    r0, r1 = (json.loads(p.read_text()) for p in paths)
    assert r1["otherData"]["tinydist"]["rank"] == 1

    out = tmp_path / "merged.json"
    assert _cli(["profile", "--no-summary", "--merge", str(out), *map(str, paths)]) == 0
    merged = json.loads(out.read_text())
    assert chrome.validate(merged) == []
    processes, _ = _lanes(merged)
    assert sorted(processes.values()) == ["rank0 CPU:0", "rank0 CPU:1", "rank1 CPU:0", "rank1 CPU:1"]
    n_x = lambda t: sum(e["ph"] == "X" for e in t["traceEvents"])  # noqa: E731
    assert n_x(merged) == n_x(r0) + n_x(r1)
    # one clock: rank 1 started later, so its events move right by the origins' difference
    shift = (r1["otherData"]["tinydist"]["origin_monotonic_ns"] - r0["otherData"]["tinydist"]["origin_monotonic_ns"]) / 1000
    assert shift > 0
    first = lambda t, pids: min(e["ts"] for e in t["traceEvents"] if e["ph"] == "X" and e["pid"] in pids)  # noqa: E731
    rank1_pids = {p for p, name in processes.items() if name.startswith("rank1")}
    assert first(merged, rank1_pids) == pytest.approx(first(r1, {1, 2}) + shift, abs=1e-2)
    flow_ids = [e["id"] for e in merged["traceEvents"] if e["ph"] == "s"]
    assert len(flow_ids) == len(set(flow_ids)) > 0


def test_gantt_png_is_written(scale_code: bytes, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from tinydist.observability.report import plot_gantt
    with td.trace() as tracer:
        _two_device_program(scale_code)
    png = plot_gantt(tracer.chrome(), tmp_path / "gantt.png", title="test")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_gantt_zoom_on_the_last_batch_and_names_that_fit(scale_code: bytes, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from tinydist.observability.report import _fit, last_batch_window
    with td.trace() as tracer:
        _two_device_program(scale_code)
    data = tracer.chrome()
    xs = [e for e in data["traceEvents"] if e["ph"] == "X"]
    last = max((e for e in xs if e["cat"] == "batch"), key=lambda e: e["ts"])
    lo, hi = last_batch_window(data)
    t0 = min(e["ts"] for e in xs)
    assert lo <= last["ts"] - t0 and last["ts"] - t0 + last["dur"] <= hi
    saved = tracer.write(tmp_path / "t.json")
    png = tmp_path / "zoom.png"
    assert _cli(["profile", "--from", str(saved), "--png", str(png), "--zoom", "last", "--no-summary"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit) as bad:
        _cli(["profile", "--from", str(saved), "--png", str(png), "--zoom", "2:1"])
    assert bad.value.code == 2
    # a kernel's name broken at spaces into the lines a bar holds, a cut word marked
    assert _fit("add+max 8x16x4x4 f32", 40, 3) == "add+max 8x16x4x4 f32"
    assert _fit("add+max 8x16x4x4 f32", 9, 3) == "add+max\n8x16x4x4\nf32"
    assert _fit("matmul 8x147x2048 f32 strided", 8, 2) == "matmul\n8x147x2…"
    assert _fit("add+max 8x16x4x4 f32", 3, 3) == ""


def test_profile_command_runs_a_script_and_prints_a_summary(tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    script = tmp_path / "job.py"
    script.write_text("import sys, numpy as np, tinydist as td\n"
                      "m = td.Tensor(np.ones((8, 4), np.float32)).shard(['CPU:0', 'CPU:1'], axis=0).sum(axis=0)\n"
                      "print('job', sys.argv[1:], m.shards[1].numpy().tolist())\n")
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    assert _cli(["profile", "-o", str(out), "--png", str(png), str(script), "--flag", "x"]) == 0
    printed = capsys.readouterr().out
    assert "job ['--flag', 'x'] [8.0, 8.0, 8.0, 8.0]" in printed
    assert "kernel" in printed and "busy %" in printed
    assert chrome.validate(json.loads(out.read_text())) == [] and png.stat().st_size > 5000


def test_environment_variable_traces_a_whole_program(tmp_path: Path) -> None:
    out = tmp_path / "env.json"
    code = ("import numpy as np, tinydist as td\n"
            "t = td.Tensor(np.ones(16, np.float32), device='CPU:1') * 2\n"
            "print(t.numpy().sum())\n")
    env = dict(os.environ, TINYDIST_TRACE=str(out))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "32.0" in run.stdout and "trace written" in run.stderr
    trace = json.loads(out.read_text())
    assert chrome.validate(trace) == []
    assert any(e["ph"] == "X" and e["cat"] == "kernel" for e in trace["traceEvents"])
