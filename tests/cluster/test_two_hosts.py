"""Two hosts on one machine (tests/cluster/netns.py): ranks in two network namespaces joined by a veth
pair, each namespace with its own host name, so every byte between the hosts crosses the veth and
tinydist must tell the hosts apart as it does two machines.

- td.dist allreduce / all_gather / broadcast across the hosts equal to numpy float64: 2 ranks over
  TCP; 4 ranks (2 per host: shared memory inside a host, TCP between); 4 ranks with the modelled RDMA
  NIC (TINYDIST_RDMA_NIC=soft) between the hosts. Every socket is bound to its host's veth address.
- the cluster scheduler: 4 nodes (2 per host, 2 devices each) under an mTLS coordinator served on
  host a's veth address; the plan sees 2 host groups by host key, puts its across-groups stage on
  the link measured between the hosts (TCP, or the modelled RDMA NIC), and the hierarchical
  allreduce equals numpy.
- the veth taken down mid-job (TCP and modelled RDMA): every rank raises a classified
  CollectiveError naming its peer within TINYDIST_COLLECTIVE_TIMEOUT (the documented bound for a
  peer that goes silent, docs/collectives.md) plus slack; none hangs.

Marked `integration` (all but the last, the skip reason's own test): `make test` deselects them (pyproject's addopts), `make integration` runs them
(.ci/run calls it after `make test`). They skip, with the reason, where namespaces cannot be made
(not root, no `ip`, `ip netns` not permitted).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.cluster import netns
from tests.cluster.helpers import ROOT, JOB, Output, env
from tests.cluster.workers.collectives import data, piece
from tests.cluster.workers.job import expected

WORKER = Path(__file__).parent / "workers" / "collectives.py"


@pytest.fixture
def hosts() -> Iterator[netns.TwoHosts]:
    reason = netns.unavailable()       # probed here, not at import: `make test` collects this module too
    if reason is not None:
        pytest.skip(f"two hosts need network namespaces: {reason}")
    two = netns.TwoHosts()
    try:
        yield two
    finally:
        two.close()
    assert netns.leftovers() == [], "network namespaces left behind"


def _host_of(hosts: netns.TwoHosts, rank: int) -> netns.Host:
    # interleaved, so ring neighbours sit on different hosts and every step of a ring crosses the veth
    return hosts.hosts[rank % 2]


def _start_ranks(hosts: netns.TwoHosts, world: int, extra: dict[str, str], *args: str) -> list[Output]:
    # the default port: nothing else listens in a namespace made for this test
    coordinator = f"{hosts.a.ip}:29400"
    outs = []
    for rank in range(world):
        proc = _host_of(hosts, rank).popen(
            [sys.executable, str(WORKER), "--rank", str(rank), "--world", str(world), "--coordinator", coordinator, *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
            env=env(TINYDIST_COORDINATOR_ALLOW_REMOTE="1", **extra))
        outs.append(Output(proc))
    return outs


def _links(out: Output) -> dict[int, list[str]]:
    line = out.wait_for("LINKS ", 90)
    return {int(peer): value for peer, value in json.loads(line.split(" ", 1)[1]).items()}


CASES = {
    "2-ranks-tcp": (2, {"TINYDIST_TRANSPORT": "tcp"}, "tcp"),
    "4-ranks-shm-and-tcp": (4, {"TINYDIST_TRANSPORT": "auto", "TINYDIST_RDMA_NIC": "off"}, "tcp"),
    "4-ranks-shm-and-modelled-rdma": (4, {"TINYDIST_TRANSPORT": "auto", "TINYDIST_RDMA_NIC": "soft"}, "rdma_bnxt"),
}


@pytest.mark.integration
@pytest.mark.parametrize("case", list(CASES))
def test_collectives_across_two_hosts_equal_numpy(hosts, tmp_path, case):
    world, extra, between = CASES[case]
    out = tmp_path / "result"
    outs = _start_ranks(hosts, world, extra, "--out", str(out), "--size", "100003")
    try:
        for rank, o in enumerate(outs):
            mine = _host_of(hosts, rank)
            for peer, (kind, local_ip) in _links(o).items():
                same = _host_of(hosts, peer) is mine
                assert kind == ("shm" if same else between), f"rank {rank} -> {peer}: {kind}\n{o.text}"
                assert local_ip == mine.ip, f"rank {rank}'s link to {peer} is bound to {local_ip}, not {mine.ip}"
        for o in outs:
            assert o.finish(90) == 0, o.text
    finally:
        for o in outs:
            o.close()
    inputs = np.stack([data(r, 100003) for r in range(world)])
    want = {
        "all_reduce": inputs.sum(axis=0),
        "all_reduce_ring": inputs.sum(axis=0),
        "all_reduce_max": inputs.max(axis=0),
        "all_gather": np.concatenate([piece(r) for r in range(world)], axis=0),
        "broadcast": inputs[world - 1],
    }
    for rank in range(world):
        got = np.load(f"{out}.rank{rank}.npz")
        for name, value in want.items():
            # sums in another order than numpy's: float64 rounding only; the rest moves bytes, exactly
            if name.startswith("all_reduce") and name != "all_reduce_max":
                np.testing.assert_allclose(got[name], value, rtol=1e-12, atol=1e-12, err_msg=f"{name} on rank {rank}")
            else:
                np.testing.assert_array_equal(got[name], value, err_msg=f"{name} on rank {rank}")


@pytest.mark.integration
@pytest.mark.parametrize("between", ["tcp", "rdma_bnxt"])
def test_scheduler_sees_two_hosts_and_hierarchical_allreduce_equals_numpy(hosts, tmp_path, between):
    from tinydist.security import pki
    lab = tmp_path / "lab"
    pki.init(lab, server_ips=("127.0.0.1", hosts.a.ip))     # the coordinator is served on host a's veth
    world, steps, size = 4, 3, 5003
    for rank in range(world):
        pki.issue(lab, f"node-{rank}")
    port_file = tmp_path / "coordinator.addr"
    log = (tmp_path / "coordinator.log").open("w")
    hosts.a.popen([sys.executable, "-m", "tinydist.cli", "scheduler", "serve", "--listen", f"{hosts.a.ip}:0",
                   "--heartbeat-interval", "0.1", "--miss-limit", "20", "--port-file", str(port_file), "--pki", str(lab)],
                  stdout=log, stderr=subprocess.STDOUT, env=env(), cwd=ROOT)
    deadline = time.monotonic() + 60
    while not port_file.exists() or not port_file.read_text():
        assert time.monotonic() < deadline, (tmp_path / "coordinator.log").read_text()
        time.sleep(0.05)
    address = port_file.read_text()
    assert address.startswith(hosts.a.ip), address
    out = tmp_path / "w.npy"
    outs = []
    for rank in range(world):
        host = _host_of(hosts, rank)
        outs.append(Output(host.popen(
            [sys.executable, str(JOB), "--coordinator", address, "--node-id", f"node-{rank}", "--rank", str(rank),
             "--world", str(world), "--steps", str(steps), "--size", str(size), "--out", str(out), "--status",
             "--pki", str(lab), "--address", host.ip],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
            env=env(TINYDIST_COORDINATOR_ALLOW_REMOTE="1", TINYDIST_TRANSPORT="auto",
                    TINYDIST_RDMA_NIC="soft" if between == "rdma_bnxt" else "off"))))
    try:
        for o in outs:
            assert o.finish(120) == 0, o.text
            assert "ALLREDUCE ok" in o.text, o.text
        plan = outs[0].text
        # one peer group per host, found by host key (the namespace's host name), two nodes in each
        for host, nodes in ((hosts.a, "node-0, node-2"), (hosts.b, "node-1, node-3")):
            assert any(f"(host, host {host.name}/" in line and nodes in line for line in plan.splitlines()), plan
        header = next(line for line in plan.splitlines() if "over 8 devices in 2 peer groups" in line)
        assert "): hierarchical, modelled" in header, plan       # reduce in each host, allreduce between them
        # the stage between the hosts runs over the link the probe measured between them
        across = next(line for line in plan.splitlines() if "allreduce-across-groups" in line)
        assert f" over {between} " in across, plan
    finally:
        for o in outs:
            o.close()
        log.close()
    np.testing.assert_array_equal(np.load(out), expected(steps, world * 2, size))


# what each rank raises when the cable is pulled: over TCP nothing fails at the socket (the kernel
# retransmits for minutes), so the collective's deadline classifies the silent peer (CollectiveTimeout).
# The RDMA model's queue pair gives up on an unacknowledged send after its retry budget (DriverConfig:
# (retry_cnt 7 + 1) x ACK timeout 67 ms, about 0.54 s) with a classified RetryExceeded, and that rank
# fails the peer at once (RankFailed); its ABORT cannot cross the dead link, so a rank that was only
# waiting to receive (nothing of its own in flight) still raises at the deadline. At least one rank
# has a send in flight when the link dies, so at least one sees the RDMA error.
LINK_DOWN = {
    "tcp": ({"TINYDIST_TRANSPORT": "tcp"}, "CollectiveTimeout", "timed out"),
    "modelled-rdma": ({"TINYDIST_TRANSPORT": "rdma", "TINYDIST_RDMA_NIC": "soft"}, "RankFailed", "RDMA RetryExceeded"),
}


@pytest.mark.integration
@pytest.mark.parametrize("link", list(LINK_DOWN))
def test_link_down_mid_job_every_rank_raises_within_the_bound(hosts, link):
    bound = 3.0
    extra, error, detail = LINK_DOWN[link]
    outs = _start_ranks(hosts, 2, {**extra, "TINYDIST_COLLECTIVE_TIMEOUT": str(bound)},
                        "--until-failure", "--size", "262144")
    try:
        for o in outs:
            o.wait_for("LOOPING", 90)
        t0 = time.monotonic()
        hosts.link_down()
        lines = [o.wait_for("FAILED", bound + 10) for o in outs]
        elapsed = time.monotonic() - t0              # until the last rank raised
        print(f"{link}: every rank raised {elapsed:.2f} s after the link went down", *lines, sep="\n")
        for o in outs:
            assert o.finish(10) == 3, o.text
        for rank, line in enumerate(lines):
            timed_out = line.startswith("FAILED CollectiveTimeout ") and "timed out" in line
            assert timed_out or (line.startswith(f"FAILED {error} ") and detail in line), line
            assert f"rank {1 - rank}" in line or f"[{1 - rank}]" in line, line      # naming the peer
        assert any(line.startswith(f"FAILED {error} ") and detail in line for line in lines), lines
        # the failing collective began before the link went down, so its deadline is at most `bound` away
        assert elapsed < bound + 2, f"ranks raised {elapsed:.2f} s after the link went down (bound {bound} s + 2 s slack)"
    finally:
        for o in outs:
            o.close()


def test_not_root_is_a_skip_reason_not_a_failure(monkeypatch):
    """In `make test` (no marker): where the integration run is not root it must skip saying so."""
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert netns.unavailable() == ("not root (euid 1000): network namespaces and veth pairs need "
                                   "CAP_SYS_ADMIN/CAP_NET_ADMIN")
    with pytest.raises(RuntimeError, match="not root"):
        netns.TwoHosts()
