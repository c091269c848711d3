"""Process-group collectives in real processes, against numpy: every op, algorithm, dtype; both transports."""

from __future__ import annotations

import functools
import platform
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tinydist.transports import cma
from tinydist.transports.base import TransportError

from .helpers import finish, launch, spawn_ranks


@functools.cache
def _single_copy_permitted() -> bool:
    """Whether sibling processes may read each other's memory here (process_vm_readv): Linux x86-64
    without Yama's ptrace restriction (scope 1+ allows only ancestors), and a read of a child's
    memory works (a seccomp profile or missing rights would refuse it)."""
    if sys.platform != "linux" or platform.machine() != "x86_64" or not cma.available():
        return False
    scope = Path("/proc/sys/kernel/yama/ptrace_scope")
    if scope.exists() and scope.read_text().strip() != "0":
        return False
    child = subprocess.Popen([sys.executable, "-c", "import sys, numpy as np; a = np.full(1, 7.0); "
                              "print(a.ctypes.data, flush=True); sys.stdin.readline()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        seen = np.zeros(1)
        cma.read(child.pid, int(child.stdout.readline()), seen)
        return seen[0] == 7.0
    except TransportError:
        return False
    finally:
        child.kill()
        child.communicate()


@pytest.mark.parametrize("nproc,transport,slot,single_copy", [
    (2, "shm", None, "on"), (2, "tcp", None, "auto"), (3, "tcp", None, "auto"), (4, "shm", None, "on"), (4, "tcp", None, "auto"),
    (3, "shm", "4096", "auto"), (4, "shm", None, "off")])
def test_collectives_match_numpy(nproc, transport, slot, single_copy, no_shm_leak):
    """slot: a small TINYDIST_SHM_SLOT_BYTES makes most calls on the group segment take many rounds.
    single_copy: on, all2all allreduce copies straight between the ranks' memory (process_vm_readv/writev)
    at every size; auto, only from 8 MiB on, so these sizes go through the slots; off, never."""
    env = {"TINYDIST_TRANSPORT": transport, "TINYDIST_SHM_SINGLE_COPY": single_copy,
           **({"TINYDIST_SHM_SLOT_BYTES": slot} if slot else {})}
    result = launch(nproc, "collectives.py", env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    done = re.findall(r"\[rank (\d)\] OK (\d+) checks on rank \d of \d; single copy: (\w+)", result.stdout)
    assert sorted(int(r) for r, _, _ in done) == list(range(nproc)), result.stdout[-3000:]
    assert all(int(n) > 300 for _, n, _ in done)
    expected = transport == "shm" and single_copy != "off" and _single_copy_permitted()
    assert {used for _, _, used in done} == {str(expected)}, result.stdout[-3000:]


@pytest.mark.parametrize("transport", ["auto", "tcp"])   # headers on the group segment / over links
def test_mismatches_raise_on_every_rank_and_group_survives(transport, no_shm_leak):
    result = launch(3, "mismatch.py", env={"TINYDIST_COLLECTIVE_TIMEOUT": "5", "TINYDIST_TRANSPORT": transport,
                                           "TINYDIST_SHM_SLOT_BYTES": "4096"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "NO ERROR" not in out
    for rank in range(3):
        lines = [line for line in out.splitlines() if line.startswith(f"[rank {rank}] MISMATCH")]
        assert len(lines) == 12, out
        assert f"[rank {rank}] OUT ARRAYS untouched" in out
        assert f"[rank {rank}] AFTER [6.0, 6.0, 6.0]" in out
    assert "ranks disagree on shape: rank 0 (4,), rank 1 (5,), rank 2 (5,)" in out
    assert "ranks disagree on dtype: rank 0 float32, rank 1 int64" in out
    assert "ranks disagree on op: rank 0 'sum', rank 1 'max'" in out
    assert "rank 0 'all_reduce', rank 1 'broadcast'" in out
    assert "invalid arguments on rank 1: unknown op 'avg'" in out
    assert "ranks disagree on shape_except_axis: rank 0 (3,), rank 1 (4,)" in out
    assert "ranks disagree on shape: rank 0 (4,), rank 1 (50000,), rank 2 (50000,)" in out
    assert "invalid arguments on rank 1: out= (a float64 array of shape (40000,)) is read-only" in out
    assert "invalid arguments on rank 0: out= (a float64 array of shape (40000,)) is not C-contiguous" in out
    assert ("invalid arguments on rank 2: out= (a int64 array of shape (40000,)) does not fit the result, "
            "a float64 array of shape (40000,)") in out
    assert "invalid arguments on rank 0: out= must be a numpy array, not Tensor" in out


def test_auto_rule_is_deterministic_and_sees_size_world_and_link():
    from tinydist.graph.collectives import Medium, Topology, choose

    def pick(world: int, nbytes: int, same_host: bool, cpus: int | None = None) -> str:
        return choose(Medium.SHM if same_host else Medium.NETWORK, world, nbytes, Topology(cpus=cpus))[0]
    assert pick(4, 1024, True) == "naive"
    assert pick(4, 512 << 10, True, cpus=2) == "naive"     # ranks outnumber CPUs: one step is dear
    assert pick(4, 512 << 10, True, cpus=8) == "all2all"
    assert pick(4, 1 << 20, True, cpus=2) == "all2all"     # until naive's fourfold reading costs more
    assert pick(4, 1 << 20, True, cpus=8) == "all2all"
    assert pick(2, 256 << 10, True, cpus=2) == "all2all"
    assert pick(2, 128 << 10, True, cpus=2) == "naive"
    assert pick(4, 1 << 20, False) == "ring"
    assert pick(2, 64 << 20, True) == "all2all"
    assert pick(2, 64 << 20, False) == "ring"
    assert pick(4, 64 << 20, True) == "all2all"
    assert pick(4, 64 << 20, False) == "ring"
    assert all(choose(m, n, b)[1] for n in (2, 3, 8) for b in (1, 1 << 30) for m in (Medium.SHM, Medium.NETWORK))


def test_choice_is_logged_and_env_override_applies(no_shm_leak):
    result = launch(2, "collectives.py", env={"TINYDIST_LOG_LEVEL": "info", "TINYDIST_ALLREDUCE": "all2all",
                                              "TINYDIST_LOG_FORMAT": "json"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert '"algorithm": "all2all"' in result.stderr and '"reason": "TINYDIST_ALLREDUCE"' in result.stderr


def test_async_api_on_the_group_segment(no_shm_leak):
    """`ProcessGroup.open` from async code: segment collectives run in a worker thread, ring over the links."""
    results = finish(spawn_ranks(3, "async_api.py"), timeout=60)
    for rank, (rc, out) in enumerate(results):
        assert rc == 0, out
        assert f"OK async rank {rank}" in out, out


@pytest.mark.parametrize("nproc", [2, 3])
def test_tcp_collectives_run_on_the_calling_thread(nproc):
    """Over TCP an allreduce (naive, ring) or barrier moves its frames from the caller's thread, not
    through the event loop: they complete, equal to numpy, while a task holds the loop's thread."""
    result = launch(nproc, "loop_held.py", env={"TINYDIST_TRANSPORT": "tcp", "TINYDIST_COLLECTIVE_TIMEOUT": "20"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("HELD True EQUAL True") == nproc, result.stdout[-3000:]
