"""Helpers for tests/dist: start real rank processes, with or without `tinydist launch`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKERS = Path(__file__).parent / "workers"


def shm_entries() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("tinydist-*")} if shm.is_dir() else set()


@pytest.fixture
def no_shm_leak():
    before = shm_entries()
    yield
    leaked = shm_entries() - before
    assert not leaked, f"shared-memory segments left in /dev/shm: {sorted(leaked)}"


def launch(nproc: int, worker: str, *args: str, env: dict[str, str] | None = None, timeout: float = 90) -> subprocess.CompletedProcess:
    """`tinydist launch --nproc N tests/dist/workers/<worker> args`, output captured."""
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "tinydist.cli", "launch", "--nproc", str(nproc), str(WORKERS / worker), *args],
                          env=full_env, capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(nproc: int, worker: str, *args: str, env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """Start the ranks by hand (no launcher): rank 0 hosts the coordinator on a free port."""
    port = free_port()
    procs = []
    for rank in range(nproc):
        full_env = dict(os.environ, TINYDIST_RANK=str(rank), TINYDIST_WORLD_SIZE=str(nproc),
                        TINYDIST_COORDINATOR=f"127.0.0.1:{port}", **(env or {}))
        full_env.pop("TINYDIST_COORDINATOR_FD", None)
        procs.append(subprocess.Popen([sys.executable, str(WORKERS / worker), *args], env=full_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def finish(procs: list[subprocess.Popen], timeout: float = 60) -> list[tuple[int, str]]:
    out = []
    try:
        for p in procs:
            stdout, _ = p.communicate(timeout=timeout)
            out.append((p.returncode, stdout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out
