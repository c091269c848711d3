"""One script under tinydist launch, Slurm and Kubernetes: the same TINYDIST_* variables."""

from __future__ import annotations

import pytest

from tinydist.dist.environment import apply, detect, expand_nodelist


def test_expand_slurm_nodelist():
    assert expand_nodelist("node[01-03,07],gpu5") == ["node01", "node02", "node03", "node07", "gpu5"]
    assert expand_nodelist("a[1-2]-b[1-2]") == ["a1-b1", "a1-b2", "a2-b1", "a2-b2"]
    assert expand_nodelist("single") == ["single"]
    with pytest.raises(ValueError):
        expand_nodelist("n[a-b]")


def test_slurm_maps_to_tinydist_variables():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURMD_NODENAME": "gpu02",
           "SLURM_NODELIST": "gpu[01-04]", "SLURM_STEP_NODELIST": "gpu[02-04]"}
    found = apply(env)
    assert found.source == "slurm" and found.node_id == "gpu02-1" and found.scheduler == "gpu02:29500"
    assert env["TINYDIST_RANK"] == "3" and env["TINYDIST_WORLD_SIZE"] == "8" and env["TINYDIST_LOCAL_RANK"] == "1"
    assert env["TINYDIST_COORDINATOR"] == "gpu02:29400"          # first node of the step


def test_kubernetes_indexed_job_and_statefulset():
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "2", "HOSTNAME": "train-2",
           "TINYDIST_WORLD_SIZE": "4", "TINYDIST_K8S_SERVICE": "train"}
    apply(env)
    assert env["TINYDIST_RANK"] == "2" and env["TINYDIST_COORDINATOR"] == "train-0.train:29400"
    sts = detect({"KUBERNETES_SERVICE_HOST": "x", "HOSTNAME": "td-5", "TINYDIST_WORLD_SIZE": "8",
                  "TINYDIST_COORDINATOR": "td-0.td.ns.svc:29400"})
    assert (sts.rank, sts.world_size, sts.coordinator) == (5, 8, "td-0.td.ns.svc:29400")
    with pytest.raises(ValueError, match="TINYDIST_WORLD_SIZE"):
        detect({"KUBERNETES_SERVICE_HOST": "x", "JOB_COMPLETION_INDEX": "0"})
    with pytest.raises(ValueError, match="outside"):
        apply({"KUBERNETES_SERVICE_HOST": "x", "JOB_COMPLETION_INDEX": "9", "HOSTNAME": "t-9", "TINYDIST_WORLD_SIZE": "4",
               "TINYDIST_K8S_SERVICE": "t"})


def test_explicit_variables_win_and_nothing_outside_a_launcher():
    env = {"TINYDIST_RANK": "1", "TINYDIST_WORLD_SIZE": "2", "SLURM_PROCID": "5", "SLURM_NTASKS": "9"}
    assert detect(env).source == "tinydist"
    assert detect({}) is None and apply({}) is None


def test_dist_init_under_slurm_variables(tmp_path):
    """td.dist.init() with only Slurm variables set: a real 2-process job, unchanged script."""
    import socket
    import subprocess
    import sys

    from tests.cluster.helpers import ROOT, env
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = ("import numpy as np, tinydist as td\n"
              "from tinydist import dist\n"
              "dist.init()\n"
              "print('RESULT', dist.rank(), dist.all_reduce(np.arange(4.0) + dist.rank()).numpy().tolist())\n"
              "dist.destroy()\n")
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=env(SLURM_PROCID=str(r), SLURM_NTASKS="2", SLURM_LOCALID=str(r),
                                                 SLURM_STEP_NODELIST="127.0.0.1", TINYDIST_PORT=str(port)))
             for r in range(2)]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    for r, out in enumerate(outs):
        assert f"RESULT {r} [1.0, 3.0, 5.0, 7.0]" in out, out
