"""TINYDIST_TRANSPORT=rdma makes td.dist use BNXT RDMA links (here the softbnxt model) unchanged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("_launch_worker.py")


def test_the_transport_setting_selects_rdma_links_for_td_dist() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TINYDIST_")}
    env.update(TINYDIST_TRANSPORT="rdma", TINYDIST_RDMA_NIC="soft", TINYDIST_COLLECTIVE_TIMEOUT="20")
    run = subprocess.run([sys.executable, "-m", "tinydist.cli", "launch", "--nproc", "2", str(WORKER)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    for rank in (0, 1):
        assert f"rank {rank} links ['rdma_bnxt'] ok True" in run.stdout, run.stdout + run.stderr
