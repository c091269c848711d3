"""Process collectives as graph nodes (tinydist.dist.lazy) in real processes: each against numpy at
2-4 ranks, sizes 0 / 1 / prime / 1 MiB + odd, uneven pieces; a mismatch raises on every rank; a
td.jit-captured DistributedDataParallel step equals the eager one."""

from __future__ import annotations

import re

import pytest

from .helpers import launch


@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_graph_collectives_match_numpy(nproc, no_shm_leak):
    result = launch(nproc, "graph_collectives.py", "values")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    done = re.findall(r"\[rank (\d)\] OK (\d+) graph collectives", result.stdout)
    assert sorted(int(r) for r, _ in done) == list(range(nproc)), result.stdout[-3000:]
    assert {int(count) for _, count in done} == {41}


@pytest.mark.parametrize("nproc", [2, 3])
def test_graph_collective_mismatch_raises_on_every_rank(nproc, no_shm_leak):
    """Rank 0 all-reduces 5 elements, the others 4, after an agreed call that made the one-host fast
    path's entry: every rank's realize raises, the CollectiveMismatch naming both shapes as its cause."""
    result = launch(nproc, "graph_collectives.py", "mismatch")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert len(re.findall(r"FAST PATH on \[(\d\.0, ){3}\d\.0\]", result.stdout)) == nproc, result.stdout[-3000:]
    raised = re.findall(r"\[rank (\d)\] RAISED CollectiveMismatch: all_reduce \(call #2\): ranks disagree on shape: "
                        r"rank 0 \(5,\), rank 1 \(4,\)", result.stdout)
    assert sorted(int(r) for r in raised) == list(range(nproc)), result.stdout[-3000:]


def test_captured_ddp_step_equals_eager(no_shm_leak):
    result = launch(2, "ddp_graph.py")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert len(re.findall(r"\[rank \d\] OK 6 steps, 3 buckets, captured == eager", result.stdout)) == 2, result.stdout[-3000:]


def test_ddp_bucket_all_reduce_overlaps_backward(tmp_path, no_shm_leak):
    """From each rank's trace, an eager and a captured step (two of each): the first bucket's
    collective, on the copy queue, waits only for the compute batches making its input, and the
    compute batch running backward's last weight-gradient matmul does not wait for it; in at least
    one step per rank it started before that matmul ended (on the compute queue it ran after every
    backward kernel, in every step). The steps equal one bucket all-reduced after the whole
    backward, bitwise (the worker checks it)."""
    result = launch(2, "ddp_overlap.py", str(tmp_path / "trace.json"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert len(re.findall(r"\[rank \d\] OK 4 steps, 2 buckets == 1 bucket bitwise, eager and captured", result.stdout)) == 2, \
        result.stdout[-3000:]
    from tinydist.observability.chrome import load
    from tinydist.observability.report import collective_overlap
    for rank in range(2):
        trace = load(tmp_path / f"trace.rank{rank}.json")
        steps = [s for s in collective_overlap(trace) if s["args"]["mode"] != "warm-up"]
        assert [s["args"]["mode"] for s in steps] == ["eager"] * 2 + ["captured"] * 2, steps
        for s in steps:
            assert len(s["collectives"]) == 2, s
            assert s["ahead"], (rank, s)
        assert any(s["collectives"][0][0] < s["matmul_end"] for s in steps), (rank, steps)
