"""tinydist.base.progress: a tqdm bar on a terminal, plain flushed lines anywhere else."""

from __future__ import annotations

import io
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tinydist.base.progress import is_terminal, progress

ROOT = Path(__file__).resolve().parents[1]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def counts(text: str) -> list[str]:
    return re.findall(r"(\d+)/\d+", text)


@pytest.mark.parametrize("total,lines,expected", [(10, 10, [str(i) for i in range(1, 11)]), (100, 4, ["25", "50", "75", "100"]),
                                                  (7, 3, ["3", "6", "7"]), (1, 10, ["1"])])
def test_into_a_pipe_plain_lines_at_fractions_of_the_total(total, lines, expected):
    out = io.StringIO()
    seen = list(progress(range(total), desc="job", file=out, lines=lines))
    assert seen == list(range(total))
    text = out.getvalue()
    assert "\r" not in text and "\x1b" not in text
    assert counts(text) == expected
    assert all(line.startswith("job ") for line in text.splitlines())


def test_without_a_total_a_line_every_n_items_and_the_last_count():
    out = io.StringIO()
    for _ in progress(iter(range(250)), desc="stream", file=out, every=100):
        pass
    assert re.findall(r"stream (\d+) ", out.getvalue()) == ["100", "200", "250"]


def test_postfix_update_and_close_once():
    out = io.StringIO()
    with progress(total=4, desc="steps", file=out, lines=2) as bar:
        for i in range(4):
            bar.set_postfix_str(f"loss {i}")
            bar.update()
        bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].endswith("loss 1") and lines[1].endswith("loss 3")


def test_on_a_terminal_a_tqdm_bar():
    out = Terminal()
    for _ in progress(range(5), desc="draw", file=out):
        pass
    text = out.getvalue()
    assert is_terminal(out) and not is_terminal(io.StringIO())
    assert "\r" in text and "draw: 100%" in text and "5/5" in text


def test_the_example_writes_lines_into_a_pipe():
    """examples/train_digits.py under a pipe: no carriage returns, progress lines then the accuracy per epoch."""
    datasets = pytest.importorskip("sklearn.datasets")
    steps = int(len(datasets.load_digits().data) * 0.8) // 64   # the example's split and batch
    every = -(-steps // 4)                                        # its 4 lines per epoch
    expected = [str(n) for n in range(every, steps, every)] + [str(steps)]
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "train_digits.py"), "--epochs", "2", "--target", "0"],
                            capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stdout
    lines = result.stdout.splitlines()
    for epoch in (1, 2):
        mine = [line for line in lines if line.startswith(f"epoch  {epoch}/2 ")]
        assert re.findall(rf" (\d+)/{steps} ", " ".join(mine)) == expected
        assert "test accuracy" in mine[-1] and "loss" in mine[0]


def _relu_model(folder):
    """relu.onnx (x: float32[2, 3] -> y) and x.npy in `folder`, for `tinydist infer --bench`."""
    onnx = pytest.importorskip("onnx")
    import numpy as np
    from onnx import TensorProto, helper
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), folder / "relu.onnx")
    np.save(folder / "x.npy", np.ones((2, 3), np.float32))


def test_infer_bench_reports_progress_lines_into_a_pipe(tmp_path):
    """`tinydist infer --bench N` into a pipe: the frames' progress as lines on stderr, the latency on stdout."""
    _relu_model(tmp_path)
    result = subprocess.run([sys.executable, "-m", "tinydist.cli", "infer", "relu.onnx", "--input", "x=x.npy",
                             "--bench", "20", "--warmup", "1"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stderr
    progress_lines = [line for line in result.stderr.splitlines() if line.startswith("bench ")]
    assert counts("\n".join(progress_lines)) == [str(n) for n in range(2, 21, 2)]
    assert all("frame/s" in line for line in progress_lines)
    assert "latency over 20 frames" in result.stdout


def _sigint_as_python_sets_it() -> None:
    """In the child before exec: SIGINT at its default, so that Python installs its Ctrl-C handler.
    A job started with `&` by a shell without job control (a CI script run in the background)
    ignores SIGINT, the child inherits that, and the test's Ctrl-C was lost: the bench ran on."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.timeout(240)  # the child's start and first compile, then up to 90 s to exit, 60 s to dump its stacks
def test_infer_bench_interrupted_prints_what_it_timed(tmp_path):
    """Ctrl-C during `tinydist infer --bench`: the latency of the frames timed so far, exit 130, no
    traceback (before: a KeyboardInterrupt traceback and no statistics). Ctrl-C landing inside a
    frame's run must not fail the device either (it exited 1, "a run on the calling thread failed:
    KeyboardInterrupt", about 1 run in 6 at load 4)."""
    _relu_model(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "tinydist.cli", "infer", "relu.onnx", "--input", "x=x.npy",
                             "--bench", "100000000", "--warmup", "1"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_sigint_as_python_sets_it,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1",
                                 "PYTHONFAULTHANDLER": "1"})
    try:
        assert proc.stdout is not None and proc.stderr is not None
        for _ in range(1000):                       # the outputs' line: the timed loop has begun
            line = proc.stdout.readline()
            if not line or line.startswith("y  shape"):
                break
        assert line.startswith("y  shape"), line
        time.sleep(1.0)                             # one warm-up frame, then well inside the timed frames
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:  # a hang: SIGABRT makes faulthandler print where each thread is
            proc.send_signal(signal.SIGABRT)
            out, err = proc.communicate(timeout=60)
            pytest.fail(f"infer --bench did not exit within 90 s of Ctrl-C; its threads:\n{err[-8000:]}")
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    assert re.search(r"latency over \d+ of 100000000 frames, interrupted .* p50 [\d.]+ ms", out), out
