"""The project's Slurm recipe under a real Slurm: `sbatch deploy/slurm/train.sbatch
examples/train_digits.py` on a one-host Slurm (tests/cluster/slurm.py: munged, slurmctld and slurmd
from the Debian packages, configured here for this machine's CPUs) with the one change one host
forces (`--nodes=1 --ntasks=2 --ntasks-per-node=2`, against the recipe's one task per node), set up
as docs/cluster.md's "Multi-host Slurm" says: the scheduler's certificate from `tinydist certs init
--this-host` (the tasks dial it at the first node's name), one `tinydist certs issue` per task, and
no TINYDIST_PORT / TINYDIST_SCHEDULER_PORT: the ports are the job's own (environment.job_ports).
Each task (tests/cluster/workers/slurm_task.py) first runs `tinydist cluster status` against
TINYDIST_SCHEDULER, then the example.

What it shows, from the job's own output (srun's --label, SLURM_LABELIO=1, prefixes each task's lines with its task id):
both tasks reached the scheduler at the first node's name and the job's scheduler port; both say
they are rank r of 2 in one group, launched by Slurm, at one rendezvous (the first node's name and
the job's rendezvous port); exactly one
header, from task 0, says "2 processes" (each task training alone would print two headers saying
"1 device(s) in one process", which is how the recipe looked distributed when it was not). And the
weights it saves equal, bit for bit, those of a local 2-process `tinydist launch` run of the same
script with the same arguments: the same algorithm over the same shared-memory transport, so any
difference (a rank training on the wrong shard, a lost gradient average) shows.

Marked `integration`: `make integration` runs it (as root; elsewhere it skips with the reason).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.cluster import slurm
from tests.cluster.helpers import ROOT, env
from tinydist.dist import environment

RECIPE = ROOT / "deploy" / "slurm" / "train.sbatch"
EXAMPLE = ROOT / "examples" / "train_digits.py"
TASK = ROOT / "tests" / "cluster" / "workers" / "slurm_task.py"     # asks the scheduler, then runs EXAMPLE
# a short run: the equality with the local run is the point, not the accuracy
TRAIN_ARGS = ["--epochs", "2", "--target", "0"]


def certs(argv: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "tinydist.cli", "certs", *argv], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env())
    assert done.returncode == 0, done.stdout + done.stderr


def _weights(path: Path) -> dict[str, np.ndarray]:
    import tinydist as td
    state = td.load(path)["model"]
    return {name: np.asarray(value.numpy() if hasattr(value, "numpy") else value) for name, value in state.items()}


@pytest.mark.integration
@pytest.mark.timeout(900)       # ~100 s here (Slurm up ~10 s, two short trainings); pyproject's 120 s is per unit test
def test_sbatch_recipe_trains_as_one_two_rank_group_with_the_local_result(tmp_path):
    pytest.importorskip("sklearn")                # the example's data set (the `examples` extra)
    reason = slurm.unavailable()
    if reason is not None:
        pytest.skip(f"a one-host Slurm needs: {reason}")
    lab = tmp_path / "lab"
    # docs/cluster.md's recipe: the scheduler's certificate names this host (it is dialled by the first
    # node's name), one client certificate per task; the ports are the job's own (environment.job_ports)
    certs(["init", str(lab), "--this-host"])
    job_env = env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
                  TINYDIST_PKI=str(lab), SLURM_LABELIO="1")  # srun --label: each task's lines start "<task id>: "
    for explicit in ("TINYDIST_PORT", "TINYDIST_SCHEDULER_PORT"):
        job_env.pop(explicit, None)
    slurm_ckpt, local_ckpt = tmp_path / "slurm.ckpt", tmp_path / "local.ckpt"
    with slurm.OneHostSlurm() as cluster:
        for task in range(2):                     # the recipe's per-task certificates: <node>-<localid>
            certs(["issue", str(lab), "--name", f"{cluster.node_name}-{task}"])
        done = cluster.sbatch(["--nodes=1", "--ntasks=2", "--ntasks-per-node=2", str(RECIPE), str(TASK), str(EXAMPLE),
                               *TRAIN_ARGS, "--checkpoint", str(slurm_ckpt)], timeout=300, cwd=ROOT, env=job_env)
    print(done.output)
    assert done.returncode == 0, done.output
    joined = sorted(re.findall(r"^(\d+): rank (\d+) of (\d+) in one group \(launched by (\w+), rendezvous (\S+)\)$",
                               done.output, re.M))
    assert [j[:4] for j in joined] == [("0", "0", "2", "slurm"), ("1", "1", "2", "slurm")], done.output
    rendezvous_port, scheduler_port = environment.job_ports({"SLURM_JOB_ID": str(done.job_id)})
    # one rendezvous (one group), at the first node's name and the job's port
    assert joined[0][4] == joined[1][4] == f"{cluster.node_name}:{rendezvous_port}", joined
    # each task reached the scheduler by the first node's name over its certificate
    reached = sorted(re.findall(r"^(\d+): scheduler (\S+): cluster status exit (\d+)", done.output, re.M))
    assert reached == [(t, f"{cluster.node_name}:{scheduler_port}", "0") for t in ("0", "1")], done.output
    headers = re.findall(r"^(\d+): digits: .*", done.output, re.M)
    assert len(headers) == 1 and headers[0] == "0" and "2 processes" in done.output, done.output

    local = subprocess.run([sys.executable, "-m", "tinydist.cli", "launch", "--nproc", "2", str(EXAMPLE), *TRAIN_ARGS,
                            "--checkpoint", str(local_ckpt)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env=env())
    assert local.returncode == 0, local.stdout + local.stderr
    assert "launched by tinydist" in local.stdout, local.stdout
    got, want = _weights(slurm_ckpt), _weights(local_ckpt)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_not_root_is_a_skip_reason_not_a_failure(monkeypatch):
    """In `make test` (no marker): where the integration run is not root it must skip saying so."""
    monkeypatch.setattr(slurm.os, "geteuid", lambda: 1000)
    assert slurm.unavailable() == "not root (euid 1000): slurmd and munged must run as root to start jobs"
    with pytest.raises(RuntimeError, match="not root"):
        slurm.OneHostSlurm()
