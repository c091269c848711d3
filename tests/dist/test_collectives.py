"""Process-group collectives in real processes, against numpy: every op, algorithm, dtype; both transports."""

from __future__ import annotations

import re

import pytest

from .helpers import launch


@pytest.mark.parametrize("nproc,transport", [(2, "shm"), (3, "tcp"), (4, "shm"), (4, "tcp")])
def test_collectives_match_numpy(nproc, transport, no_shm_leak):
    result = launch(nproc, "collectives.py", env={"TINYDIST_TRANSPORT": transport})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    done = re.findall(r"\[rank (\d)\] OK (\d+) checks", result.stdout)
    assert sorted(int(r) for r, _ in done) == list(range(nproc)), result.stdout[-3000:]
    assert all(int(n) > 300 for _, n in done)


def test_mismatches_raise_on_every_rank_and_group_survives(no_shm_leak):
    result = launch(3, "mismatch.py", env={"TINYDIST_COLLECTIVE_TIMEOUT": "5"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "NO ERROR" not in out
    for rank in range(3):
        lines = [line for line in out.splitlines() if line.startswith(f"[rank {rank}] MISMATCH")]
        assert len(lines) == 7, out
        assert f"[rank {rank}] AFTER [6.0, 6.0, 6.0]" in out
    assert "ranks disagree on shape: rank 0 (4,), rank 1 (5,), rank 2 (5,)" in out
    assert "ranks disagree on dtype: rank 0 float32, rank 1 int64" in out
    assert "ranks disagree on op: rank 0 'sum', rank 1 'max'" in out
    assert "rank 0 'all_reduce', rank 1 'broadcast'" in out
    assert "invalid arguments on rank 1: unknown op 'avg'" in out
    assert "ranks disagree on shape_except_axis: rank 0 (3,), rank 1 (4,)" in out


def test_auto_rule_is_deterministic_and_sees_size_world_and_link():
    from tinydist.dist import choose_allreduce
    assert choose_allreduce(4, 1024, True)[0] == "naive"
    assert choose_allreduce(2, 64 << 20, True)[0] == "ring"
    assert choose_allreduce(4, 64 << 20, True)[0] == "all2all"
    assert choose_allreduce(4, 64 << 20, False)[0] == "ring"
    assert all(reason for _, reason in (choose_allreduce(n, b, s) for n in (2, 3, 8) for b in (1, 1 << 30) for s in (True, False)))


def test_choice_is_logged_and_env_override_applies(no_shm_leak):
    result = launch(2, "collectives.py", env={"TINYDIST_LOG_LEVEL": "info", "TINYDIST_ALLREDUCE": "all2all",
                                              "TINYDIST_LOG_FORMAT": "json"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert '"algorithm": "all2all"' in result.stderr and '"reason": "TINYDIST_ALLREDUCE"' in result.stderr
