"""`tinydist launch` as torchrun users call it: its flags, the variables every rank gets, log
settings reaching the ranks, JSON lines staying JSON, per-rank log files, and one job started by
two launchers on loopback from flags alone. Real processes throughout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .helpers import WORKERS, free_port

WORKER = str(WORKERS / "launch_env.py")


def _tinydist(*argv: str) -> list[str]:
    return [sys.executable, "-m", "tinydist.cli", *argv]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TINYDIST_")} | {"TINYDIST_CPU_DEVICES": "1"}


def _reports(stdout: str) -> dict[int, dict]:
    """rank -> what launch_env.py printed, from `[rank N] ENV {...}` lines."""
    found = {}
    for line in stdout.splitlines():
        prefix, sep, payload = line.partition(" ENV ")
        if sep:
            assert prefix.startswith("[rank "), line
            report = json.loads(payload)
            assert prefix == f"[rank {report['RANK']}]", line
            found[int(report["RANK"])] = report
    return found


def _check(report: dict, rank: int, local_rank: int, world: int, local_world: int, node: int, port: int) -> None:
    assert report["RANK"] == report["TINYDIST_RANK"] == str(rank)
    assert report["LOCAL_RANK"] == report["TINYDIST_LOCAL_RANK"] == str(local_rank)
    assert report["WORLD_SIZE"] == report["TINYDIST_WORLD_SIZE"] == str(world)
    assert report["LOCAL_WORLD_SIZE"] == str(local_world) and report["GROUP_RANK"] == str(node)
    assert report["MASTER_ADDR"] == "127.0.0.1" and report["MASTER_PORT"] == str(port)
    assert report["TINYDIST_COORDINATOR"] == f"127.0.0.1:{port}"
    assert (report["get_rank"], report["get_world_size"]) == (rank, world)
    assert report["total"] == [world * (world + 1) / 2] * 3     # sum of rank + 1 over the job


def test_torchrun_variables_and_json_logs_reach_the_ranks() -> None:
    """Log flags given before `launch` reach the ranks; their JSON log lines come out as JSON with the rank inside."""
    result = subprocess.run(_tinydist("--log-format", "json", "--log-level", "info", "launch", "--nproc-per-node", "2",
                                      WORKER), env=_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = _reports(result.stdout)
    assert sorted(reports) == [0, 1], result.stdout
    port = int(reports[0]["MASTER_PORT"])
    for rank, report in reports.items():
        _check(report, rank, rank, 2, 2, 0, port)
        assert (report["TINYDIST_LOG_FORMAT"], report["TINYDIST_LOG_LEVEL"]) == ("json", "info")
    records = [json.loads(line) for line in result.stderr.splitlines()]     # every stderr line is JSON
    done = {r["rank"]: r for r in records if r.get("event") == "worker.done"}
    assert sorted(done) == [0, 1] and all(r["total"] == 3.0 and r["level"] == "info" for r in done.values())


def test_two_launchers_on_loopback_make_one_job(tmp_path: Path) -> None:
    """--nnodes 2 --node-rank K --rdzv-endpoint HOST:PORT and nothing else: 2 × 2 ranks, ranks 2-3 on node 1."""
    port = free_port()
    common = ["launch", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    nodes = [subprocess.Popen(_tinydist(*common, "--node-rank", str(node), WORKER), env=_env(), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for node in (1, 0)]
    try:
        outputs = [p.communicate(timeout=120) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(nodes, outputs):
        assert p.returncode == 0, err[-3000:]
    node1, node0 = (_reports(out) for out, _ in outputs)
    assert sorted(node0) == [0, 1] and sorted(node1) == [2, 3]
    for rank, report in (node0 | node1).items():
        _check(report, rank, rank % 2, 4, 2, rank // 2, port)


def test_log_dir_keeps_each_ranks_output_and_tee_0_keeps_the_console_quiet(tmp_path: Path) -> None:
    result = subprocess.run(_tinydist("launch", "--nproc", "2", "--log-dir", str(tmp_path), "--tee", "0", WORKER),
                            env=_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ENV" not in result.stdout
    for rank in (0, 1):
        lines = (tmp_path / str(rank) / "stdout.log").read_text().splitlines()
        reports = [json.loads(line.removeprefix("ENV ")) for line in lines if line.startswith("ENV ")]   # unprefixed
        assert [r["RANK"] for r in reports] == [str(rank)]
        assert (tmp_path / str(rank) / "stderr.log").exists()


def test_a_failing_job_under_json_logs_adds_no_plain_launcher_line(tmp_path: Path) -> None:
    """The launcher's own report of a failed rank is a JSON record (with the job's rank, not a local index);
    only the ranks' own plain prints carry `[rank N] `."""
    result = subprocess.run(_tinydist("--log-format", "json", "launch", "--nproc", "2", "--grace", "1",
                                      str(WORKERS / "launcher_fail.py"), str(tmp_path)),
                            env=_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    assert "[rank 1] rank 1 fails" in lines
    records = [json.loads(line) for line in lines if not line.startswith("[rank ")]
    assert [(r["event"], r["rank"], r["returncode"]) for r in records if r.get("component") == "launch"] == \
        [("launch.rank_failed", 1, 3)]
