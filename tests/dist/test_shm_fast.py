"""The native small allreduce on one host (tinydist.dist.shm_fast), in real processes, against numpy."""

from __future__ import annotations

import re

import pytest

from tinydist.transports.shm_group import ShmGroup

from .helpers import finish, launch, spawn_ranks

pytestmark = pytest.mark.skipif(not ShmGroup.supported(), reason="the group segment needs x86-64 Linux")

# 4 dtypes x 4 ops x 8 shapes x (in place, new array); float max / min are not compiled (numpy's
# NaN rules), so those 2 x 2 x 8 x 2 calls take the segment path
CALLS, NATIVE = 256, 256 - 64


@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_native_allreduce_equals_numpy(nproc, no_shm_leak):
    """Bitwise numpy's rank-order reduction, every size from 0 to 1 MiB + 12 B, naive and all2all (which
    splits the data into parts, one per rank), and every compiled call native."""
    result = launch(nproc, "shm_fast.py", "numpy", env={"TINYDIST_TRANSPORT": "shm"}, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for rank in range(nproc):
        assert f"[rank {rank}] FAST True" in result.stdout, result.stdout[-3000:]
        assert f"[rank {rank}] OK {CALLS} checks; native calls {NATIVE}" in result.stdout, result.stdout[-3000:]
        assert f"[rank {rank}] BARRIERS native 3" in result.stdout, result.stdout[-3000:]


def test_off_takes_the_segment_path(no_shm_leak):
    result = launch(2, "shm_fast.py", "numpy", env={"TINYDIST_TRANSPORT": "shm", "TINYDIST_SHM_FAST": "off"}, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("FAST False") == 2 and result.stdout.count(f"OK {CALLS} checks; native calls 1") == 0
    assert result.stdout.count(f"OK {CALLS} checks") == 2, result.stdout[-3000:]
    assert result.stdout.count("BARRIERS native 0") == 2, result.stdout[-3000:]


@pytest.mark.parametrize("nproc", [2, 3])
def test_a_mismatch_on_the_fast_path_raises_on_every_rank(nproc, no_shm_leak):
    """Different shapes, ops, dtypes, algorithms, a fast call against a segment-path one, calls out of
    sequence, and a (native) barrier against an allreduce of nothing: every rank raises the same CollectiveMismatch (the explain step), well inside the collective
    timeout (the test's bound: 20 s), and the group then takes native calls again."""
    result = launch(nproc, "shm_fast.py", "mismatch", env={"TINYDIST_TRANSPORT": "shm", "TINYDIST_COLLECTIVE_TIMEOUT": "20"},
                    timeout=120)
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert "NO ERROR" not in out, out
    for rank in range(nproc):
        said = dict(re.findall(rf"\[rank {rank}\] MISMATCH (\w+): (.*)", out))
        assert sorted(said) == sorted(["shape", "op", "dtype", "algorithm", "path", "sequence", "empty"]), out
        assert "shape: rank 0 (4,), rank 1 (5,)" in said["shape"], said
        assert "op: rank 0 'sum', rank 1 'prod'" in said["op"], said
        assert "dtype: rank 0 float32, rank 1 int32" in said["dtype"], said
        assert "algorithm: rank 0 'naive', rank 1 'all2all'" in said["algorithm"], said
        assert "dtype: rank 0 int64, rank 1 float64" in said["path"], said
        assert f"rank {nproc - 1} 'barrier'" in said["sequence"] or "different collective calls" in said["sequence"], said
        assert "rank 0 'barrier'" in said["empty"] or "different collective calls" in said["empty"], said
        took = [float(t) for t in re.findall(rf"\[rank {rank}\] TOOK \w+ ([\d.]+)", out)]
        assert len(took) == 7 and max(took) < 20, out          # none ran into the collective timeout
        assert f"[rank {rank}] AFTER {[float(sum(range(1, nproc + 1)))] * 3} native 1" in out, out


def test_a_late_peer_hands_the_wait_over_and_still_adds_up(no_shm_leak):
    """Rank 1 arrives 0.3 s late, past the native wait: ShmGroup.wait takes over, then the native reduce
    (all2all: and its second step)."""
    result = launch(2, "shm_fast.py", "late", env={"TINYDIST_TRANSPORT": "shm"}, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("RESULT naive 3.0 3.0") == 6, result.stdout
    assert result.stdout.count("RESULT all2all 3.0 3.0") == 6, result.stdout


def test_a_peer_killed_during_a_fast_call_is_a_rank_failure(no_shm_leak):
    """The survivors' native wait gives way to the group's, which sees rank 1's link close: RankFailed naming it."""
    procs = spawn_ranks(3, "shm_fast.py", "kill", env={"TINYDIST_TRANSPORT": "shm", "TINYDIST_COLLECTIVE_TIMEOUT": "20"})
    results = finish(procs, timeout=90)
    for rank in (0, 2):
        rc, out = results[rank]
        assert rc == 0, out
        assert re.search(r"ERROR RankFailed rank=1 msg=.*rank 1 died", out), out

