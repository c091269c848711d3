"""One script under tinydist launch, torchrun, Slurm and Kubernetes: the same TINYDIST_* variables.

(tests/cluster/test_slurm.py runs the recipe under a real Slurm; the torchrun test below runs a real
torchrun where torch is installed, the `bench` extra.)"""

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
           "SLURM_NODELIST": "gpu[01-04]", "SLURM_STEP_NODELIST": "gpu[02-04]", "SLURM_STEP_ID": "0"}
    found = apply(env)
    assert found.source == "slurm" and found.node_id == "gpu02-1" and found.scheduler == "gpu02:29500"
    assert env["TINYDIST_RANK"] == "3" and env["TINYDIST_WORLD_SIZE"] == "8" and env["TINYDIST_LOCAL_RANK"] == "1"
    assert env["TINYDIST_COORDINATOR"] == "gpu02:29400"          # first node of the step


def test_the_slurm_batch_script_itself_is_not_a_rank():
    """What Slurm 22.05 sets in the batch script of `sbatch --ntasks=2` (outside any srun step): a
    script run there is one process, not rank 0 of 2 waiting for a rank 1 that never starts."""
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "vm", "SLURM_JOB_NODELIST": "vm",
             "SLURM_JOB_ID": "7", "SLURMD_NODENAME": "vm"}
    assert detect(batch) is None
    assert detect({**batch, "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "vm"}).world_size == 2


def test_torchrun_variables_map_next_to_its_store():
    # torchrun's agent listens on MASTER_PORT itself (its TCPStore), so rank 0's rendezvous takes the next port
    env = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "node7", "MASTER_PORT": "29500",
           "TORCHELASTIC_USE_AGENT_STORE": "True", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0",
           "SLURM_STEP_NODELIST": "n1"}
    found = apply(env)
    assert found is not None and found.source == "torchrun"      # torchrun inside srun: the inner launcher's ranks
    assert (env["TINYDIST_RANK"], env["TINYDIST_WORLD_SIZE"], env["TINYDIST_LOCAL_RANK"]) == ("1", "4", "1")
    assert env["TINYDIST_COORDINATOR"] == "node7:29501"
    moved = {k: v for k, v in env.items() if not k.startswith("TINYDIST_")}
    assert detect({**moved, "TINYDIST_PORT": "31000"}).coordinator == "node7:31000"


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
                                                 SLURM_STEP_ID="0", SLURM_STEP_NODELIST="127.0.0.1",
                                                 TINYDIST_PORT=str(port)))
             for r in range(2)]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    for r, out in enumerate(outs):
        assert f"RESULT {r} [1.0, 3.0, 5.0, 7.0]" in out, out


def test_one_script_under_a_real_torchrun():
    """`torchrun --standalone --nproc-per-node 2` (torch's own launcher, not ours) runs a script that
    asks td.dist.job_environment() and joins: one 2-rank group, the allreduce equal to numpy's."""
    pytest.importorskip("torch")
    import subprocess
    import sys

    import numpy as np

    from tests.cluster.helpers import ROOT, env
    script = ("import numpy as np, tinydist as td\n"
              "job = td.dist.job_environment()\n"
              "td.dist.init()\n"
              "x = np.arange(5.0) * (td.dist.rank() + 1)\n"
              "print('RESULT', job.source, td.dist.rank(), td.dist.world_size(), td.dist.all_reduce(x).numpy().tolist())\n"
              "td.dist.destroy()\n")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--no-python", sys.executable, "-c", script],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    want = (np.arange(5.0) * 1 + np.arange(5.0) * 2).tolist()
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    assert lines == [f"RESULT torchrun {r} 2 {want}" for r in range(2)], proc.stdout + proc.stderr
