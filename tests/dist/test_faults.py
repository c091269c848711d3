"""Faults: a rank SIGKILLed or hanging mid-collective, and the launcher stopping a job when one rank fails."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .helpers import WORKERS, finish, launch, shm_entries, spawn_ranks


def _survivors_name(results: list[tuple[int, str]], victim: int, within: float, victim_rc: int = -9) -> None:
    """The victim exited with `victim_rc` (-9: SIGKILL); every other rank raised RankFailed naming it
    within `within` s, and again on its next call."""
    assert results[victim][0] == victim_rc, results[victim]
    for rank, (rc, out) in enumerate(results):
        if rank == victim:
            continue
        assert rc == 0, out
        found = re.search(r"RANKFAILED rank=(\d+) after=([\d.]+) msg=(.*)", out)
        assert found, out
        assert int(found.group(1)) == victim, out
        assert float(found.group(2)) < within, out
        assert re.search(rf"rank {victim} (died|left the group)", found.group(3)), out
        assert "AGAIN RankFailed" in out


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_sigkill_mid_collective_survivors_name_the_dead_rank(transport, no_shm_leak):
    procs = spawn_ranks(4, "faults.py", "kill", "2", env={"TINYDIST_COLLECTIVE_TIMEOUT": "3", "TINYDIST_TRANSPORT": transport})
    _survivors_name(finish(procs, timeout=60), victim=2, within=3.0)     # well within the 3 s collective timeout


@pytest.mark.parametrize("single_copy", ["off", "on"])
def test_sigkill_mid_collective_on_the_group_segment(single_copy, no_shm_leak):
    """Small slots make each call many rounds, so the victim dies between two steps of one collective;
    survivors asleep on its step must be woken by the link's EOF, not wait for the timeout. With single
    copy, all2all reads and writes the victim's memory directly and may find its process gone."""
    procs = spawn_ranks(4, "faults.py", "kill", "1", "all2all,naive",
                        env={"TINYDIST_COLLECTIVE_TIMEOUT": "20", "TINYDIST_SHM_SLOT_BYTES": "65536",
                             "TINYDIST_SHM_SINGLE_COPY": single_copy})
    _survivors_name(finish(procs, timeout=60), victim=1, within=5.0)     # far below the 20 s timeout


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_rank_leaving_mid_job_is_a_failure_not_a_timeout(transport, no_shm_leak):
    """A rank that calls destroy() while the others still run collectives said BYE: nobody will post
    its steps, so waiting for it must end in RankFailed at once, not after the 20 s timeout."""
    procs = spawn_ranks(3, "faults.py", "leave", "1", env={"TINYDIST_COLLECTIVE_TIMEOUT": "20", "TINYDIST_TRANSPORT": transport})
    _survivors_name(finish(procs, timeout=60), victim=1, within=5.0, victim_rc=0)


def test_hung_rank_times_out_naming_it(no_shm_leak):
    procs = spawn_ranks(3, "faults.py", "hang", "1", env={"TINYDIST_COLLECTIVE_TIMEOUT": "2"})
    start = time.monotonic()
    try:
        results = [finish([p], timeout=30)[0] for p in procs if p is not procs[1]]
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert time.monotonic() - start < 25
    for rc, out in results:
        assert rc == 0, out
        found = re.search(r"TIMEOUT ranks=\[1\] after=([\d.]+) msg=(.*)", out)
        assert found, out
        assert 1.5 < float(found.group(1)) < 4.0, out
        assert "no call from ranks [1]" in found.group(2)
        assert "AGAIN CollectiveTimeout" in out


def test_launcher_fails_fast_and_kills_the_rest(tmp_path):
    start = time.monotonic()
    result = launch(3, "launcher_fail.py", str(tmp_path), timeout=60)
    elapsed = time.monotonic() - start
    assert result.returncode == 3, result.stdout + result.stderr
    assert elapsed < 20, elapsed                     # not the 60 s the other ranks would sleep
    assert "[rank 0] hello from 0 of 3" in result.stdout
    assert "[rank 2] hello from 2 of 3" in result.stdout
    assert "[rank 1] rank 1 fails" in result.stderr
    assert "rank 1 exited with code 3" in result.stderr
    for rank in range(3):
        pid = int((tmp_path / f"pid{rank}").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_launcher_success_and_no_shm_left():
    before = shm_entries()
    result = launch(2, "mismatch.py")
    assert result.returncode == 0, result.stderr
    assert shm_entries() - before == set()


def test_shared_memory_too_small_is_a_clear_error_on_every_rank(no_shm_leak):
    """A group segment /dev/shm cannot hold fails at init with the reason and the fixes, on every rank
    (rank 0 reserves the pages up front rather than dying of SIGBUS later)."""
    procs = spawn_ranks(2, "init_only.py", env={"TINYDIST_SHM_SLOT_BYTES": str(1 << 44), "TINYDIST_COLLECTIVE_TIMEOUT": "20"})
    for rc, out in finish(procs, timeout=60):
        assert rc == 3, out
        assert "INIT FAILED TransportError" in out, out
        assert "cannot reserve" in out and "TINYDIST_SHM_SLOT_BYTES" in out, out


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for a parent that is gone."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _poll(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_sigkilled_launcher_leaves_no_rank_and_no_shm_behind(tmp_path):
    """Ranks live in sessions of their own, so killing the launcher used to orphan every one of them."""
    before = shm_entries()
    launcher = subprocess.Popen([sys.executable, "-m", "tinydist.cli", "launch", "--nproc", "2", "--grace", "1",
                                 str(WORKERS / "launcher_orphan.py"), str(tmp_path)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert _poll(lambda: all((tmp_path / f"pid{r}").exists() for r in range(2)), 60), "ranks never started"
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
        assert all(_running(pid) for pid in pids)
        assert len(shm_entries() - before) == 2
        launcher.kill()
        launcher.wait(timeout=10)
        assert _poll(lambda: not any(_running(pid) for pid in pids), 30), "ranks outlived their launcher"
        assert _poll(lambda: shm_entries() - before == set(), 10), shm_entries() - before
    finally:
        launcher.kill()
        for r in range(2):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError, ValueError):
                os.kill(int((tmp_path / f"pid{r}").read_text()), signal.SIGKILL)
