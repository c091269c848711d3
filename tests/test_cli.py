"""The `tinydist` command line: device listing, the demo, and the installed entry point."""

from __future__ import annotations

import ctypes.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import structlog

from tinydist import cli, logs
from tinydist.config import settings


@pytest.fixture(autouse=True)
def restore_logging():
    """`main` reconfigures logging onto the captured stream; put the old configuration back."""
    saved, configured = structlog.get_config(), logs._configured
    yield
    structlog.configure(**saved)
    logs._configured = configured


def _table(text: str) -> dict[str, tuple[str, str]]:
    rows = {}
    for line in text.splitlines():
        name, status, detail = line.split(maxsplit=2)
        rows[name] = (status, detail)
    return rows


def test_devices_lists_cpu_ok_and_cuda_with_reason(capsys) -> None:
    with settings.override(CPU_DEVICES=3):
        assert cli.main(["devices"]) == 0
    rows = _table(capsys.readouterr().out)
    assert list(rows) == ["CPU:0", "CPU:1", "CPU:2", "CUDA"]
    assert rows["CPU:0"][0] == "ok" and "host memory" in rows["CPU:0"][1]
    status, reason = rows["CUDA"]
    assert status == "n/a"
    assert ("no CUDA driver library" in reason) if ctypes.util.find_library("cuda") is None else ("not built yet" in reason)


def test_demo_with_json_logs(capsys) -> None:
    assert cli.main(["--log-format", "json", "demo"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].startswith("tinydist demo on CPU:0, CPU:1")
    assert "equals numpy" in lines[1] and lines[1].lstrip().startswith("fused graph")
    assert lines[2].lstrip().startswith("td.jit MLP") and "p50" in lines[2] and "p99" in lines[2]
    assert lines[3].lstrip().startswith("sharded") and "equals numpy" in lines[3]
    for line in captured.err.splitlines():   # whatever was logged is JSON
        json.loads(line)


def test_bad_arguments_exit_with_usage(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--log-format", "xml", "devices"])
    assert info.value.code == 2
    assert "invalid choice: 'xml'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main([])


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TINYDIST_")}
    env["TINYDIST_CPU_DEVICES"] = "2"
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, check=False)


def test_module_entry_point_in_a_subprocess() -> None:
    result = _run([sys.executable, "-m", "tinydist.cli", "devices"])
    assert result.returncode == 0, result.stderr
    rows = _table(result.stdout)
    assert list(rows) == ["CPU:0", "CPU:1", "CUDA"]
    assert rows["CPU:0"][0] == "ok" and rows["CUDA"][0] == "n/a"


def test_installed_script_in_a_subprocess() -> None:
    script = Path(sys.executable).parent / "tinydist"
    if not script.exists():
        pytest.skip(f"no installed entry point next to {sys.executable}")
    result = _run([str(script), "devices"])
    assert result.returncode == 0, result.stderr
    assert _table(result.stdout)["CPU:1"][0] == "ok"
