"""The `tinydist` command line: device listing, the demo, and the installed entry point."""

from __future__ import annotations

import ctypes.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import structlog

from tinydist import cli
from tinydist.base import logs
from tinydist.base.config import settings


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


def test_package_runs_as_a_module() -> None:
    """`python -m tinydist` is what a user types first; it is the same command line."""
    result = _run([sys.executable, "-m", "tinydist", "devices"])
    assert result.returncode == 0, result.stderr
    assert _table(result.stdout)["CPU:0"][0] == "ok"


def test_installed_script_in_a_subprocess() -> None:
    script = Path(sys.executable).parent / "tinydist"
    if not script.exists():
        pytest.skip(f"no installed entry point next to {sys.executable}")
    result = _run([str(script), "devices"])
    assert result.returncode == 0, result.stderr
    assert _table(result.stdout)["CPU:1"][0] == "ok"


# ---- user errors: one line naming the problem, a documented exit code, never a traceback ------------------

def _tinydist(*argv: str, env: dict[str, str] | None = None, cwd: Path | None = None,
              stdout: int | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("TINYDIST_")}
    full.update(TINYDIST_CPU_DEVICES="2", **(env or {}))
    return subprocess.run([sys.executable, "-m", "tinydist.cli", *argv], stdout=stdout if stdout is not None else subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=60, env=full, cwd=cwd, check=False)


def _user_error(result: subprocess.CompletedProcess[str], code: int, command: str, *named: str) -> str:
    """The last stderr line is `tinydist COMMAND: error: ...` naming every one of `named`; returns it."""
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == code, (result.returncode, result.stderr)
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"tinydist {command}: error: "), line
    for text in named:
        assert text in line, (text, line)
    return line


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """A Relu model over x: float32[2, 3], good and bad inputs for it, and files that are not what they claim."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper
    import numpy as np
    d = tmp_path_factory.mktemp("cli")
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), d / "relu.onnx")
    np.save(d / "ok.npy", np.ones((2, 3), np.float32))
    np.save(d / "shape.npy", np.ones((4, 4), np.float32))
    np.save(d / "dtype.npy", np.ones((2, 3), np.int64))
    (d / "empty.onnx").write_bytes(b"")
    (d / "corrupt.onnx").write_bytes(b"\xff\xff\xff garbage")
    (d / "notrace.json").write_text('{"a": 1}')
    (d / "text.txt").write_text("not json")
    return d


@pytest.mark.parametrize("argv,code,named", [
    (["missing.onnx"], 2, ["missing.onnx", "No such file"]),
    (["corrupt.onnx"], 2, ["corrupt.onnx", "not an ONNX model"]),
    (["empty.onnx"], 2, ["empty.onnx", "empty"]),
    (["relu.onnx", "--input", "x=shape.npy"], 2, ["x=shape.npy", "expected shape (2, 3)", "got (4, 4)"]),
    (["relu.onnx", "--input", "x=dtype.npy"], 2, ["x=dtype.npy", "expected dtype float32", "got int64"]),
    (["relu.onnx", "--input", "y=ok.npy"], 2, ["no input 'y'", "x=float32[2, 3]"]),
    (["relu.onnx", "--input", "x=nothere.npy"], 2, ["x=nothere.npy", "No such file"]),
    (["relu.onnx", "--input", "x=relu.onnx"], 2, ["x=relu.onnx", "not a .npy"]),
    (["relu.onnx", "--input", "x=ok.npy", "--bench", "-5"], 2, ["--bench", "-5"]),
    (["relu.onnx", "--input", "x=ok.npy", "--threads", "0"], 2, ["--threads", "at least 1", "got 0"]),
    (["relu.onnx", "--input", "x=ok.npy", "--device", "GPU"], 2, ["--device GPU", "available devices: CPU:0"]),
    (["relu.onnx", "--input", "x=ok.npy", "--output", "nodir/out.npz"], 2, ["--output nodir/out.npz", "does not exist"]),
], ids=["missing", "corrupt", "empty", "shape", "dtype", "unknown-input", "missing-npy", "not-npy", "bench", "threads", "device",
        "output-folder"])
def test_infer_user_errors(files, argv, code, named) -> None:
    line = _user_error(_tinydist("infer", *argv, cwd=files), code, "infer", *named)
    assert "opset 0" not in line


@pytest.mark.parametrize("threads", [[], ["--threads", "1"], ["--threads", "2"]], ids=["default", "1", "2"])
def test_infer_still_runs(files, threads) -> None:
    result = _tinydist("infer", "relu.onnx", "--input", "x=ok.npy", *threads, cwd=files)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["y", "shape", "(2,", "3)", "float32"]


def test_missing_extra_names_the_pip_line(files, tmp_path) -> None:
    """With onnx not importable, infer says which extra to install."""
    (tmp_path / "onnx").mkdir()
    (tmp_path / "onnx" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'onnx'\", name='onnx')\n")
    path = os.pathsep.join([str(tmp_path), *[p for p in sys.path if p]])
    result = _tinydist("infer", "relu.onnx", "--input", "x=ok.npy", cwd=files, env={"PYTHONPATH": path})
    _user_error(result, 1, "infer", "pip install 'tinydist[onnx]'")


@pytest.mark.parametrize("argv,code,named", [
    (["nosuch.py"], 2, ["nosuch.py", "no such script"]),
    (["-m", "nosuch_module_xyz"], 2, ["nosuch_module_xyz", "no module"]),
    (["--from", "notrace.json"], 2, ["notrace.json", "not a trace"]),
    (["--from", "text.txt"], 2, ["text.txt", "not a trace", "not JSON"]),
    (["--from", "nothere.json"], 2, ["nothere.json", "No such file"]),
], ids=["script", "module", "not-trace", "not-json", "missing"])
def test_profile_user_errors(files, argv, code, named) -> None:
    _user_error(_tinydist("profile", *argv, cwd=files), code, "profile", *named)


def _held_port() -> tuple[socket.socket, int]:
    held = socket.create_server(("127.0.0.1", 0))
    return held, held.getsockname()[1]


def test_scheduler_serve_on_a_port_in_use() -> None:
    held, port = _held_port()
    with held:
        result = _tinydist("scheduler", "serve", "--insecure-loopback-only", "--listen", f"127.0.0.1:{port}")
    _user_error(result, 1, "scheduler serve", f"127.0.0.1:{port}", "in use")
    assert result.stdout == ""


def test_node_serve_on_a_port_in_use(tmp_path) -> None:
    from tinydist.security import pki
    pki.init(tmp_path / "pki")
    held, port = _held_port()
    with held:
        result = _tinydist("node", "serve", "--pki", str(tmp_path / "pki"), "--listen", f"127.0.0.1:{port}")
    _user_error(result, 1, "node serve", f"127.0.0.1:{port}", "in use")


def test_metrics_address_out_of_range_and_in_use() -> None:
    result = _tinydist("scheduler", "serve", "--insecure-loopback-only", "--metrics", "127.0.0.1:99999")
    _user_error(result, 2, "scheduler serve", "--metrics", "99999", "0-65535")
    held, port = _held_port()
    with held:
        result = _tinydist("scheduler", "serve", "--insecure-loopback-only", "--listen", "127.0.0.1:0",
                           "--metrics", f"127.0.0.1:{port}")
    _user_error(result, 1, "scheduler serve", f"metrics on 127.0.0.1:{port}", "in use")


@pytest.mark.parametrize("argv,named", [
    (["--nproc", "0", "x.py"], ["--nproc", "at least 1, got 0"]),
    (["--nproc-per-node", "two", "x.py"], ["--nproc-per-node", "'two'"]),
    (["--nnodes", "2", "x.py"], ["--nnodes > 1 needs --master-port"]),
    (["--node-rank", "3", "--nnodes", "2", "--master-port", "1", "x.py"], ["--node-rank 3", "0 … 1"]),
    (["--master-port", "99999", "x.py"], ["--master-port", "99999"]),
    (["--rdzv-endpoint", "nohostport", "x.py"], ["--rdzv-endpoint", "HOST:PORT"]),
], ids=["nproc-0", "nproc-word", "nnodes-no-port", "node-rank", "port", "endpoint"])
def test_launch_user_errors(argv, named) -> None:
    _user_error(_tinydist("launch", *argv), 2, "launch", *named)


def test_launch_unknown_flag_is_named_not_a_missing_nproc() -> None:
    result = _tinydist("launch", "--nproc", "2", "--bogus", "x.py")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "unrecognized arguments: --bogus" in result.stderr
    assert "required" not in result.stderr


@pytest.mark.parametrize("name,value", [("LOG_FORMAT", "xml"), ("LOG_LEVEL", "loud")])
def test_bad_log_variable_is_a_usage_error(name, value) -> None:
    result = _tinydist("devices", env={f"TINYDIST_{name}": value})
    _user_error(result, 2, "devices", f"TINYDIST_{name}='{value}'", "expected one of")


def test_closed_stdout_exits_quietly() -> None:
    """`tinydist cluster status --json | head`: the reader leaves, the writer stops without a word (128+SIGPIPE)."""
    with tempfile.TemporaryDirectory() as d:
        port_file = Path(d) / "port"
        server = subprocess.Popen([sys.executable, "-m", "tinydist.cli", "scheduler", "serve", "--insecure-loopback-only",
                                   "--listen", "127.0.0.1:0", "--port-file", str(port_file)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(600):
                if port_file.exists() and port_file.read_text():
                    break
                time.sleep(0.05)
            read, write = os.pipe()
            os.close(read)      # `head` has already gone
            try:
                result = _tinydist("cluster", "status", "--insecure", "--coordinator", port_file.read_text(), "--json",
                                   stdout=write)
            finally:
                os.close(write)
        finally:
            server.terminate()
            server.wait(timeout=30)
    assert result.returncode == 128 + signal.SIGPIPE, result.stderr
    assert result.stderr == ""


def test_a_bug_keeps_its_traceback_and_asks_for_a_report(monkeypatch, capsys) -> None:
    def broken(args):
        raise RuntimeError("an internal invariant broke")
    monkeypatch.setattr(cli, "_devices", broken)
    assert cli.main(["devices"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: an internal invariant broke" in err
    assert err.strip().splitlines()[-1].startswith("tinydist devices: this is a bug in tinydist")


def test_traceback_flag_shows_a_user_errors_traceback(monkeypatch, capsys) -> None:
    from tinydist.base.errors import DeviceFailed

    def failing(args):
        raise DeviceFailed("CPU:0 was marked failed")
    monkeypatch.setattr(cli, "_devices", failing)
    assert cli.main(["devices"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip() == "tinydist devices: error: CPU:0 was marked failed"
    assert cli.main(["--traceback", "devices"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1] == "tinydist devices: error: CPU:0 was marked failed"


def test_interrupt_exits_130(monkeypatch, capsys) -> None:
    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "_devices", interrupted)
    assert cli.main(["devices"]) == 130
    assert capsys.readouterr().err.strip() == "tinydist devices: interrupted"


@pytest.mark.parametrize("argv,named", [
    ([], ["--pki DIR", "--insecure-loopback-only"]),
    (["--pki", "{empty}"], ["lacks ca.pem", "tinydist certs init"]),
    (["--insecure-loopback-only", "--listen", "10.1.2.3:0"], ["loopback", "10.1.2.3"]),
    (["--insecure-loopback-only", "--miss-limit", "0"], ["--miss-limit", "at least 1, got 0"]),
], ids=["no-pki", "empty-pki", "not-loopback", "miss-limit"])
def test_scheduler_serve_usage_errors(tmp_path, argv, named) -> None:
    argv = [a.replace("{empty}", str(tmp_path)) for a in argv]
    _user_error(_tinydist("scheduler", "serve", *argv), 2, "scheduler serve", *named)
