"""docs/cluster.md's first two code blocks run as written (the scheduler on a free port instead of
29500, `tinydist` as `python -m tinydist.cli`), and examples/cluster.py trains to numpy's weights."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.helpers import ROOT, Coordinator, Output, env

DOC = ROOT / "docs" / "cluster.md"
# certificates, a scheduler, two joins, then four processes started one after another: 35-45 s here
pytestmark = pytest.mark.timeout(300)
TINYDIST = f"{sys.executable} -m tinydist.cli"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", DOC.read_text(), re.S | re.M)


def _commands(block: str) -> list[str]:
    """The block's commands, continuation lines joined, comments dropped."""
    joined = block.replace("\\\n", " ")
    return [re.sub(r"\s+#.*$", "", line).strip() for line in joined.splitlines() if line.strip()]


def _shell(command: str, cwd: Path, timeout: float = 60, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", f'tinydist() {{ {TINYDIST} "$@"; }}; {command}'], capture_output=True,
                          text=True, cwd=cwd, env=env(**extra), timeout=timeout)


def test_the_cluster_doc_runs(tmp_path: Path) -> None:
    commands = _commands(_blocks("sh")[0])
    certs = next(c for c in commands if c.startswith("tinydist certs init"))
    result = _shell(certs, tmp_path)
    assert result.returncode == 0, result.stderr
    lab = tmp_path / "lab"
    coordinator = Coordinator(tmp_path, "--pki", str(lab), interval=0.2, misses=25)
    addr = coordinator.address
    node0 = {"TINYDIST_CERT": str(lab / "clients/node-0.pem"), "TINYDIST_KEY": str(lab / "clients/node-0.key"),
             "TINYDIST_CA": str(lab / "ca.pem")}
    joins: list[Output] = []
    try:
        join = next(c for c in commands if c.startswith("tinydist node join")).replace("127.0.0.1:29500", addr)
        for node in ("node-0", "node-1"):          # "and node-1 likewise"
            line = join.replace("node-0", node).replace("tinydist ", f"{TINYDIST} ", 1)
            joins.append(Output(subprocess.Popen(["bash", "-c", f"exec {line}"], stdout=subprocess.PIPE,
                                                 stderr=subprocess.STDOUT, text=True, cwd=tmp_path, env=env())))
        for out in joins:
            out.wait_for("joined", 90)
        for command in (c for c in commands if c.startswith("tinydist cluster status")):
            result = _shell(command.replace("127.0.0.1:29500", addr), tmp_path, **node0)
            assert result.returncode == 0 and result.stderr == "", command + "\n" + result.stderr
            assert "node-1" in result.stdout, result.stdout
        for out in joins:
            out.proc.send_signal(signal.SIGTERM)
            assert out.finish(30) == 0, out.text
        joins.clear()

        script = tmp_path / "node.py"
        script.write_text(_blocks("python")[0].replace("127.0.0.1:29500", addr))
        procs = []
        for node in ("node-0", "node-1"):
            creds = {k: v.replace("node-0", node) for k, v in node0.items()}
            procs.append(Output(subprocess.Popen([sys.executable, str(script), node], stdout=subprocess.PIPE,
                                                 stderr=subprocess.STDOUT, text=True, cwd=tmp_path, env=env(**creds))))
        for out in procs:
            joins.append(out)
            assert out.finish(120) == 0, out.text
            assert "[6. 6. 6.]" in out.text and "  why: hierarchical/" in out.text, out.text
    finally:
        for out in joins:
            out.close()
        coordinator.stop()


def test_the_cluster_example_matches_numpy(tmp_path: Path) -> None:
    coordinator = Coordinator(tmp_path, "--insecure-loopback-only", interval=0.2, misses=25)
    outs = [Output(subprocess.Popen([sys.executable, str(ROOT / "examples" / "cluster.py"), "--insecure",
                                     "--coordinator", coordinator.address, "--node-id", f"node-{i}", "--steps", "6",
                                     "--samples", "96"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, cwd=ROOT, env=env())) for i in range(2)]
    try:
        for i, out in enumerate(outs):
            assert out.finish(120) == 0, out.text
            assert f"node-{i}: weights " in out.text and "equal numpy's" in out.text, out.text
        assert "step   5  loss" in "".join(o.text for o in outs)
    finally:
        for out in outs:
            out.close()
        coordinator.stop()
