"""Real node processes on loopback: join, status, hierarchical allreduce equal to numpy, a node
SIGKILLed (or hung) mid-collective → every survivor raises naming it, restart from checkpoint."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.cluster.helpers import ROOT, Coordinator, Output, env, start_nodes
from tests.cluster.workers.job import expected


@pytest.fixture
def coordinator(tmp_path):
    c = Coordinator(tmp_path, "--insecure-loopback-only")
    yield c
    c.stop()


def _kill_all(outs):
    for o in outs:
        o.close()


def test_join_status_and_hierarchical_allreduce_equals_numpy(coordinator, tmp_path):
    out = tmp_path / "w.npy"
    outs = [Output(p) for p in start_nodes(coordinator.address, 2, "--steps", "3", "--size", "5003", "--out", str(out),
                                           "--status", "--hold", "20")]
    try:
        for o in outs:
            o.wait_for("HOLDING", 60)
        status = subprocess.run([sys.executable, "-m", "tinydist.cli", "cluster", "status", "--coordinator",
                                 coordinator.address, "--insecure", "--plan-bytes", "1048576"],
                                capture_output=True, text=True, env=env(), cwd=ROOT, timeout=30)
        assert status.returncode == 0, status.stdout + status.stderr
        text = status.stdout
        assert "2 alive of 2 nodes" in text
        for needle in ("node-0", "node-1", "CPU:0,CPU:1", "g0", "g1", "node-0/CPU:1", "node-1/CPU:0", "latency",
                       "GB/s", "allreduce-across-groups", "hierarchical"):
            assert needle in text, f"{needle!r} missing from status:\n{text}"
        for o in outs:
            assert "ALLREDUCE ok" in o.text, o.text
        assert "reduce-in-group" in outs[0].text and "candidates:" in outs[0].text      # rank 0 printed the plan
    finally:
        _kill_all(outs)
    np.testing.assert_array_equal(np.load(out), expected(3, 4, 5003))


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_node_loss_mid_collective_then_restart_from_checkpoint(coordinator, tmp_path, fault):
    ckpt, out = tmp_path / "ckpt", tmp_path / "w.npy"
    args = ["--steps", "6", "--size", "4001", "--ckpt", str(ckpt), "--out", str(out)]
    # node-2 stalls before step 3's allreduce: the survivors are then inside that collective
    procs = start_nodes(coordinator.address, 3, *args[:-2], per_rank={2: ["--stall-at", "3"]})
    outs = [Output(p) for p in procs[:2]]
    victim = Output(procs[2])
    try:
        victim.wait_for("STALL step 3", 60)
        time.sleep(0.3)                                   # survivors are waiting in step 3's collective
        t0 = time.monotonic()
        os.kill(victim.proc.pid, getattr(signal, fault))
        for o in outs:
            line = o.wait_for("NODEFAILED", 10)
            assert "node=node-2" in line and "'node-2'" in line, line
            assert o.finish(10) == 3
        elapsed = time.monotonic() - t0
        # socket EOF / (misses + 1) heartbeats + slack
        bound = 1.0 if fault == "SIGKILL" else coordinator.interval * (coordinator.misses + 1) + 1.5
        assert elapsed < bound, f"survivors raised after {elapsed:.2f} s (bound {bound} s)"
        if fault == "SIGSTOP":
            # the first survivor to hear from the coordinator fails the group; the other may learn via its ABORT
            assert any("declared dead" in o.text and f"missed {coordinator.misses} heartbeats" in o.text for o in outs), outs[0].text
    finally:
        _kill_all([victim, *outs])
    assert not (ckpt / "step-00000003" / "COMMITTED").exists()
    coordinator.wait_until_not_alive(["node-0", "node-1", "node-2"])   # the crashed job is gone
    # restart: survivors plus a replacement node-2, same world size → resume from step 2
    restarted = [Output(p) for p in start_nodes(coordinator.address, 3, *args)]
    try:
        for o in restarted:
            assert o.finish(60) == 0, o.text
            assert "RESUMED from step 2" in o.text, o.text
    finally:
        _kill_all(restarted)
    np.testing.assert_array_equal(np.load(out), expected(6, 6, 4001))


def test_mtls_membership_and_identity_binding(tmp_path):
    import grpc

    from tinydist.scheduler._generated import cluster_pb2 as pb
    from tinydist.scheduler.errors import MembershipError
    from tinydist.scheduler.node import Credentials, NodeAgent
    from tinydist.security import pki
    lab = tmp_path / "lab"
    pki.init(lab)
    for name in ("node-0", "node-1"):
        pki.issue(lab, name)
    c = Coordinator(tmp_path, "--pki", str(lab))
    try:
        outs = [Output(p) for p in start_nodes(c.address, 2, "--steps", "2", "--pki", str(lab), "--hold", "10")]
        try:
            for o in outs:
                o.wait_for("HOLDING", 60)
                assert "ALLREDUCE ok" in o.text
            creds = Credentials.load(lab / "clients/node-0.pem", lab / "clients/node-0.key", lab / "ca.pem")
            from tinydist.scheduler.node import status
            st = status(c.address, creds)
            assert [m.node.node_id for m in st.members] == ["node-0", "node-1"] and len(st.groups) == 2
            # node-0's certificate may not speak for node-1
            with pytest.raises(MembershipError, match="PERMISSION_DENIED.*may not speak for node 'node-1'"):
                NodeAgent(c.address, "node-1", ["CPU:0"], credentials=creds).join(timeout=5)
            # no client certificate: no insecure channel to a TLS coordinator, and plaintext fails
            with grpc.insecure_channel(c.address) as channel:
                from tinydist.scheduler._generated import cluster_pb2_grpc as pb_grpc
                with pytest.raises(grpc.RpcError):
                    pb_grpc.ClusterStub(channel).Status(pb.StatusRequest(), timeout=3)
        finally:
            _kill_all(outs)
    finally:
        c.stop()


def test_insecure_coordinator_refuses_non_loopback_and_wildcard(tmp_path):
    from tinydist.scheduler.coordinator import Coordinator as CoordinatorServer
    with pytest.raises(ValueError, match="wildcard.*the interface the nodes reach"):
        asyncio.run(CoordinatorServer.start("0.0.0.0:1234", pki=tmp_path))
    with pytest.raises(ValueError, match="loopback"):
        asyncio.run(CoordinatorServer.start("10.1.2.3:1234", insecure_loopback_only=True))
    from tinydist.scheduler.errors import ClusterError
    from tinydist.scheduler.node import open_channel
    with pytest.raises(ClusterError, match="loopback-only"):
        open_channel("10.1.2.3:29500", None)
