"""Single copy between ranks' memory: `tinydist.transports.cma` against a real child process, and the group's agreement on it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tinydist.transports import cma
from tinydist.transports.base import TransportError
from tinydist.transports.shm import _unlink
from tinydist.transports.shm_group import ShmGroup

from .test_collectives import _single_copy_permitted

needs_cma = pytest.mark.skipif(not (cma.available() and _single_copy_permitted()),
                               reason="process_vm_readv between processes is not permitted here")

# the child holds 8 float64 0..7, prints their address, and after a line on stdin prints them again
CHILD = """
import sys, numpy as np
a = np.arange(8, dtype=np.float64)
print(a.ctypes.data, flush=True)
sys.stdin.readline()
print(" ".join(str(v) for v in a), flush=True)
"""


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield proc, int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.communicate()


@needs_cma
def test_read_and_write_a_peer_process(child):
    proc, address = child
    got = np.empty(8, np.float64)
    cma.read(proc.pid, address, got)
    assert got.tolist() == list(range(8))
    cma.write(proc.pid, address + 16, np.array([-1.0, -2.0]))       # elements 2 and 3
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.stdout.readline().split() == ["0.0", "1.0", "-1.0", "-2.0", "4.0", "5.0", "6.0", "7.0"]


@needs_cma
def test_unmapped_address_names_it_and_changes_nothing(child):
    proc, address = child
    into = np.full(4, 7.0)
    with pytest.raises(TransportError, match=r"cannot read 32 bytes at 0x10 in process \d+: Bad address"):
        cma.read(proc.pid, 0x10, into)
    assert into.tolist() == [7.0] * 4


@needs_cma
def test_a_dead_process_is_peer_gone():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    with pytest.raises(cma.PeerGone, match=f"process {proc.pid} is gone"):
        cma.read(proc.pid, 0x1000, np.empty(1))


def _negotiate(wanted: list[int | None]) -> list[int | None]:
    """Two ranks of one segment in this process (threads), each wanting single copy from a size on (None: not)."""
    first, name = ShmGroup.create("single-copy-test", 0, 2, slot_bytes=4096)
    groups = [first]
    try:
        groups.append(ShmGroup.attach(name, 1, 2, slot_bytes=4096))
    finally:
        _unlink(name)
    agreed: list[int | None] = [-1, -1]

    def run(rank: int) -> None:
        agreed[rank] = groups[rank].negotiate_single_copy(time.monotonic() + 10, lambda peer: None, wanted[rank])

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    for grp in groups:
        assert grp.pids == [grp.pids[0]] * 2        # both ranks are this process
        grp.close()
    return agreed


def test_one_rank_saying_no_turns_single_copy_off_for_all(no_shm_leak):
    assert _negotiate([0, None]) == [None, None]
    assert _negotiate([None, 1 << 20]) == [None, None]


@needs_cma
def test_ranks_that_may_agree_on_single_copy_from_the_largest_size_asked(no_shm_leak):
    assert _negotiate([0, 0]) == [0, 0]
    assert _negotiate([8 << 20, 0]) == [8 << 20, 8 << 20]
