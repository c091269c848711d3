"""Each user's example in examples/ runs, at small sizes, as its docstring says to run it; each checks
its own result against a reference nobody here wrote (onnxruntime, numpy) and exits 1 otherwise.
examples/cluster.py runs in tests/cluster/test_cluster_doc.py (it needs the cluster helpers)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

# each example is a fresh interpreter that imports tinydist and compiles its kernels: 5-25 s each here
pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for name in ("TINYDIST_RANK", "TINYDIST_WORLD_SIZE", "TINYDIST_COORDINATOR", "TINYDIST_CERT", "TINYDIST_KEY",
                 "TINYDIST_CA", "TINYDIST_TRACE"):
        env.pop(name, None)
    return env


def _run(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=_env(), timeout=timeout)


def test_every_example_is_run_by_a_test() -> None:
    tested = Path(__file__).read_text() + (ROOT / "tests" / "cluster" / "test_cluster_doc.py").read_text()
    for example in sorted(EXAMPLES.glob("*.py")):
        assert f'"{example.name}"' in tested, f"examples/{example.name} is run by no test"


def test_inference_example_matches_onnxruntime(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    model = tmp_path / "model.onnx"
    result = _run(str(EXAMPLES / "infer_onnx.py"), "--model", str(model), "--runs", "3", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "input  x: tensor(float) ['batch', 16]" in result.stdout
    assert re.search(r"probs: shape \(8, 4\), max \|tinydist - onnxruntime\| = \S+ ok", result.stdout), result.stdout
    # the shell line of its docstring, on the model it wrote
    frame = tmp_path / "frame.npy"
    np.save(frame, np.random.default_rng(2).standard_normal((3, 16)).astype(np.float32))
    cli = _run("-m", "tinydist.cli", "infer", str(model), "--input", f"x={frame}", "--output", str(tmp_path / "out.npz"),
               "--bench", "5", cwd=tmp_path)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    import onnxruntime
    expected = onnxruntime.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": np.load(frame)})
    np.testing.assert_allclose(np.load(tmp_path / "out.npz")["probs"], expected[0], rtol=1e-4, atol=1e-6)


def test_ddp_training_example_under_launch(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    result = _run("-m", "tinydist.cli", "launch", "--nproc-per-node", "2", str(EXAMPLES / "train_digits.py"),
                  "--epochs", "3", "--target", "0.8", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 processes" in result.stdout
    accuracy = re.search(r"final test accuracy ([0-9.]+)%", result.stdout)
    assert accuracy and float(accuracy[1]) >= 80, result.stdout


def test_remote_rig_example_matches_numpy(tmp_path: Path) -> None:
    """The rig set up as the docstring says: certificates, the policy line, a real node process."""
    tinydist = [sys.executable, "-m", "tinydist.cli"]
    for args in (["certs", "init", "lab"], ["certs", "issue", "lab", "--name", "alice"]):
        done = subprocess.run([*tinydist, *args], capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=60)
        assert done.returncode == 0, done.stderr
    policy = tmp_path / "lab" / "policy.toml"
    policy.write_text(policy.read_text().replace("[identities]\n",
                                                 '[identities]\n"spiffe://tinydist.lab/user/alice" = "operator"\n', 1))
    node = subprocess.Popen([*tinydist, "node", "serve", "--listen", "127.0.0.1:0", "--pki", "lab", "--devices", "CPU:0",
                             "--audit", str(tmp_path / "audit.log")], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, cwd=tmp_path, env=_env())
    try:
        assert node.stdout is not None
        deadline = time.monotonic() + 60
        line = ""
        while "serving" not in line and time.monotonic() < deadline and node.poll() is None:
            line = node.stdout.readline()
        served = re.search(r"serving (\S+)", line)
        assert served, f"node did not start: {line!r}"
        result = _run(str(EXAMPLES / "remote_rig.py"), "--node", served[1], "--pki", "lab", "--name", "alice",
                      cwd=tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"on remote://{served[1]}/CPU:0: loss" in result.stdout
        assert result.stdout.count(" ok") == 3, result.stdout
    finally:
        node.terminate()
        node.wait(30)
        if node.stdout is not None:
            node.stdout.close()
