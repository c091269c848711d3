"""The driver's checks are exceptions, not asserts: the whole RDMA suite passes under `python -O` too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_python_O_runs_the_rdma_suite() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-O", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-W", "ignore::pytest.PytestConfigWarning", str(ROOT / "tests/rdma"),
                           "-k", "not python_O and not fuzz"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


def test_no_assert_statements_in_the_driver() -> None:
    """`python -O` strips asserts; the package must not rely on any for runtime checks."""
    import ast
    pkg = ROOT / "transports/rdma_bnxt"
    found = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in pkg.rglob("*.py")
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Assert)]
    assert found == []
