"""The benchmarks still run against today's API, and the before/after tool reads their figures.

bench/ is not imported by the suite, so an API change can break a benchmark unnoticed (it did:
bench/onnx_infer.py called a private method whose signature changed). The cheap ones run here
with the fewest frames; the slow ones are covered by their own tests where they have one."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):  # noqa: ANN202 - a module object
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_onnx_infer_runs_and_checks_every_runner() -> None:
    pytest.importorskip("onnxruntime")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "onnx_infer.py"), "--frames", "2", "--warmup", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split()[0] + " " + line.split()[1] for line in proc.stdout.splitlines() if "ratio vs onnxruntime" in line]
    assert rows == ["mlp tinydist", "mlp tinydist", "cnn tinydist", "cnn tinydist"], proc.stdout


def test_compare_revisions_reads_report_json_and_printed_tables(tmp_path: Path) -> None:
    compare = _load("compare_revisions")
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "report.py").write_text(
        "import json, sys\n"
        "path = sys.argv[sys.argv.index('--json') + 1]\n"
        "json.dump([{'name': 'launch/direct', 'value': 0.5, 'unit': 'us per call', 'ratio': 2.0}], open(path, 'w'))\n"
        "# Report.from_argv\n")
    (tmp_path / "bench" / "table.py").write_text(
        "print('model runtime p50 p90')\n"
        "print('mlp   tinydist model(feed) (jit replay)   8.0   9.5   p50 ratio vs onnxruntime 1.09x')\n"
        "print('sum 16M f32: tinydist 3.3 ms (numpy 3.0 ms; ratio 0.92x) target >=2x: MISS')\n"
        "print('2 devices 1 MiB: tinydist auto 0.53 ms, ring 5.31 ms, naive 0.43 ms')\n")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    assert compare.run_once(tmp_path, "bench/report.py", [], scratch) == {"launch/direct": (0.5, "us per call", 2.0)}
    assert compare.run_once(tmp_path, "bench/table.py", [], scratch) == {
        "mlp tinydist model(feed) (jit replay)": (8.0, "", 1.09), "sum 16M f32": (3.3, "ms", 0.92),
        "2 devices 1 MiB": (0.53, "ms", None)}
    assert compare.verdict(1.0, 1.2, "us per call") == "SLOWER"
    assert compare.verdict(1.0, 1.2, "GFLOP/s") == "faster"
    assert compare.verdict(1.0, 1.05, "ms") == "same"


@pytest.mark.integration
def test_cluster_bench_predicts_and_measures_every_plan_on_two_namespace_hosts() -> None:
    """bench/cluster.py at its smallest: two network-namespace hosts (root), the probe's links printed,
    every plan's predicted and measured time (results checked against the exact sum inside)."""
    from tests.cluster import netns
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(f"bench/cluster.py needs two network-namespace hosts: {reason}")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    bench = subprocess.Popen([sys.executable, str(ROOT / "bench" / "cluster.py"), "--sizes", "0.0625", "--repeats", "1",
                              "--no-sim"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = bench.communicate(timeout=300)
    finally:
        bench.kill()
    assert bench.returncode == 0, out + err
    assert "  node-0 - node-1: tcp up to 1 MiB α=" in out and "  node-0 - node-0: mem up to 1 MiB α=" in out, out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| 0.0625 MiB | hierarchical/")]
    assert sorted(row[1].rsplit("+", 1)[1] for row in rows) == ["all2all", "naive", "ring"], out
    assert [row[2] for row in rows].count("yes") == 1, out                  # the planner's own choice, marked
    assert len([line for line in out.splitlines() if line.startswith("2x2 hierarchical 0.0625 MiB, chosen plan ")]) == 1, out
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    assert f"{netns.PREFIX}{bench.pid}-" not in listed, listed              # its two hosts removed


def test_architectures_table_runs_tiny() -> None:
    """bench/architectures.py at its smallest: one coverage-set model, both thread counts, the
    summary lines and a first call (cold and warm cache)."""
    pytest.importorskip("onnxruntime")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "architectures.py"), "--frames", "2", "--warmup", "1",
                           "--models", "squeezenet", "--batches", "1", "--threads", "1,2", "--first-call", "squeezenet",
                           "--first-call-threads", "default"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split()[:3] for line in proc.stdout.splitlines() if re.match(r"squeezenet +\d+ +\d+ ", line)]
    assert rows == [["squeezenet", "1", "1"], ["squeezenet", "1", "2"]], proc.stdout
    assert "batch 1 threads 2: median ratio" in proc.stdout, proc.stdout
    assert "squeezenet first call (load + capture + compile, batch 1, threads default): cold cache" in proc.stdout, proc.stdout
