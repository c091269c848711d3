"""etcd as the coordinator's membership store (scheduler.store.EtcdStore), against a real etcd server
(Debian's etcd-server, /usr/bin/etcd) on loopback: the same records as the journal, recovered by
another coordinator; one leader at a time, fenced; and a job whose leader coordinator is SIGKILLed
mid-job, finished correctly with the members and epoch recovered by the standby.

Marked `integration`: `make integration` installs etcd-server first (deploy/ci/apt-packages.txt) and runs
them; in `make test` on a fresh machine etcd is not there yet and they would only skip."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from tests.cluster.helpers import ETCD, Coordinator, Etcd, Output, start_nodes
from tests.cluster.test_journal import _populate, _view
from tests.cluster.workers.job import expected
from tinydist.scheduler.errors import LeadershipLost, MembershipStoreError
from tinydist.scheduler.membership import Membership
from tinydist.scheduler.store import EtcdStore

pytestmark = pytest.mark.integration

@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    if not ETCD.exists():
        pytest.skip(f"{ETCD} absent: install Debian's etcd-server (deploy/ci/apt-packages.txt)")
    server = Etcd(tmp_path_factory.mktemp("etcd"))
    yield server
    server.stop()


def _won(store: EtcdStore, address: str, within: float) -> bool:
    deadline = time.monotonic() + within
    return store.campaign(address, lambda: time.monotonic() > deadline)


def test_membership_written_by_one_coordinator_is_recovered_by_the_next(etcd, request):
    prefix = f"/test/{request.node.name}/"
    now = [0.0]
    first = EtcdStore(etcd.url, "a", prefix=prefix, ttl=2, compact_every=4)   # compacts mid-populate
    assert _won(first, "127.0.0.1:1", 5)
    m = Membership(0.1, 3, clock=lambda: now[0], store=first)
    m.recover()
    _populate(m, now)
    before = _view(m)
    first.close()                                  # revokes the lease: the next wins at once
    second = EtcdStore(etcd.url, "b", prefix=prefix, ttl=2)
    assert _won(second, "127.0.0.1:2", 5)
    assert second.leader() == {"name": "b", "address": "127.0.0.1:2"}
    r = Membership(0.1, 3, clock=lambda: now[0], store=second)
    replayed = r.recover()
    assert _view(r) == before and before[0] == 5 and [x[3] for x in before[2]] == ["alive", "left", "dead"]
    assert 0 < replayed < 7                        # some records replayed after a snapshot, not all of them
    second.close()


def test_one_leader_at_a_time_and_a_deposed_leader_cannot_write(etcd, request):
    prefix = f"/test/{request.node.name}/"
    a = EtcdStore(etcd.url, "a", prefix=prefix, ttl=2)
    b = EtcdStore(etcd.url, "b", prefix=prefix, ttl=2)
    try:
        assert _won(a, "A", 5)
        a.load()
        a.append({"epoch": 1})
        assert not _won(b, "B", 3.0)               # outlives a's TTL: its lease is renewed
        won = threading.Event()
        t = threading.Thread(target=lambda: _won(b, "B", 10) and won.set())
        t.start()
        a.client.revoke(a.lease)                   # what etcd does to the lease of a leader that stalled past TTL
        t.join()
        assert won.is_set() and b.leader() == {"name": "b", "address": "B"}
        with pytest.raises(LeadershipLost, match=r"coordinator 'a' .*(lost the leadership|does not lead)"):
            a.append({"epoch": 2})
        state, records = b.load()
        assert state is None and [(x["seq"], x["epoch"]) for x in records] == [(1, 1)]
    finally:
        a.close()
        b.close()


def test_an_unreachable_etcd_is_a_store_error_naming_it():
    store = EtcdStore("http://127.0.0.1:9", "a", ttl=2)          # discard port: nothing listens
    with pytest.raises(MembershipStoreError, match=r"etcd unreachable for /v3/lease/grant: http://127.0.0.1:9"):
        store.campaign("A")
    with pytest.raises(MembershipStoreError, match="expected http://HOST:PORT"):
        EtcdStore("127.0.0.1:2379", "a")


def test_scheduler_serve_refuses_an_etcd_it_cannot_reach_and_a_second_store(tmp_path):
    import subprocess
    import sys

    from tests.cluster.helpers import ROOT, env
    serve = [sys.executable, "-m", "tinydist.cli", "scheduler", "serve", "--listen", "127.0.0.1:0",
             "--insecure-loopback-only", "--etcd", "http://127.0.0.1:9"]
    run = subprocess.run(serve, capture_output=True, text=True, env=env(), cwd=ROOT, timeout=60)
    assert run.returncode == 1 and "error: etcd unreachable for /v3/kv/range: http://127.0.0.1:9" in run.stderr, run
    run = subprocess.run([*serve, "--state-dir", str(tmp_path)], capture_output=True, text=True, env=env(), cwd=ROOT,
                         timeout=60)
    assert run.returncode == 2 and "give --state-dir" in run.stderr and "not both" in run.stderr, run


def _members(st):
    return [(m.node.node_id, m.node.rank, m.node.pid, m.state) for m in st.members]


def _wait_for_lead(c: Coordinator, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while " leads (etcd " not in c.log.read_text():
        assert time.monotonic() < deadline, c.log.read_text()
        time.sleep(0.05)


def test_leader_coordinator_sigkill_mid_job_the_standby_recovers_members_and_epoch(etcd, tmp_path, request):
    from tinydist.scheduler.node import status
    args = ["--insecure-loopback-only", "--etcd", etcd.url, "--etcd-prefix", f"/test/{request.node.name}/",
            "--leader-ttl", "2"]
    leader = Coordinator(tmp_path, *args, "--name", "first", misses=20)
    _wait_for_lead(leader)
    standby = Coordinator(tmp_path, *args, "--name", "second", misses=20)
    both = f"{standby.address},{leader.address}"   # the standby first: joins must move on to the leader
    out, steps, size = tmp_path / "w.npy", 32, 3001
    outs = [Output(p) for p in start_nodes(both, 2, "--steps", str(steps), "--size", str(size), "--out", str(out),
                                            "--step-sleep", "0.25", "--wait-rejoin", "60",
                                            extra_env={"TINYDIST_SCHEDULER_LOST_AFTER": "60"})]
    try:
        for o in outs:
            o.wait_for("STEP 1 done", 90)
        with pytest.raises(grpc.RpcError) as refused:
            status(standby.address, None)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "standby" in refused.value.details()
        before = status(both, None)
        leader.kill()
        killed = time.monotonic()
        _wait_for_lead(standby)
        took_over = time.monotonic() - killed
        done = [sum(x.startswith("STEP ") for x in list(o.lines)) for o in outs]
        recovered = status(standby.address, None)   # before any node can have finished and left
        log = standby.log.read_text()
        for o in outs:
            assert "REJOINED" in o.wait_for("REJOIN", 90), o.text
        print(f"the standby led {took_over:.2f} s after the leader's SIGKILL (lease TTL 2 s); steps done by then: "
              f"{done} of {steps}")
        for o in outs:
            assert o.finish(90) == 0, o.text
            assert "coordinator_back" in o.text and "ALLREDUCE ok" in o.text, o.text
        after = status(standby.address, None)
    finally:
        for o in outs:
            o.close()
        leader.stop()
        standby.stop()
    np.testing.assert_array_equal(np.load(out), expected(steps, 4, size))
    assert _members(before) == [("node-0", 0, before.members[0].node.pid, "alive"),
                                ("node-1", 1, before.members[1].node.pid, "alive")]
    assert f"leads (etcd {etcd.url}): recovered epoch {before.epoch}, 2 members" in log, log
    assert _members(recovered) == _members(before) and recovered.epoch == before.epoch > 0
    assert {(x.src, x.dst) for x in recovered.links} == {(x.src, x.dst) for x in before.links} != set()
    assert [m.state for m in after.members] == ["left", "left"] and after.epoch == before.epoch + 2


async def _stand_down(url: str, prefix: str, tmp_path) -> tuple[str, str, int, int, list[str], bool]:
    """Coordinator a in this process (so the test can revoke its lease), b a process (one metrics
    registry per process)."""
    import asyncio

    from tinydist.scheduler._generated import cluster_pb2 as pb
    from tinydist.scheduler._generated import cluster_pb2_grpc as pb_grpc
    from tinydist.scheduler.coordinator import Coordinator as InProcess
    a = await InProcess.start("127.0.0.1:0", insecure_loopback_only=True, heartbeat_interval=0.1, miss_limit=50,
                              etcd=url, etcd_prefix=prefix, leader_ttl=2, name="a")
    b = None

    async def call(address: str, method: str, request: object) -> object:
        async with grpc.aio.insecure_channel(address) as channel:
            return await getattr(pb_grpc.ClusterStub(channel), method)(request, timeout=10)

    try:
        await asyncio.wait_for(a.leading.wait(), 20)
        b = Coordinator(tmp_path, "--insecure-loopback-only", "--etcd", url, "--etcd-prefix", prefix,
                        "--leader-ttl", "2", "--name", "b", misses=50)
        joined = await call(a.address, "Join", pb.JoinRequest(node=pb.NodeInfo(node_id="n0", rank=0), world_size=1))
        epoch = (await call(a.address, "Status", pb.StatusRequest())).epoch
        assert a.etcd is not None
        a.etcd.client.revoke(a.etcd.lease)        # a's lease gone, as after a stall past its TTL
        await asyncio.to_thread(_wait_for_lead, b)
        refusal = ""
        for _ in range(200):                       # a notices within TTL/3 and stands down
            try:
                await call(a.address, "Status", pb.StatusRequest())
            except grpc.aio.AioRpcError as exc:
                refusal = f"{exc.code().name}: {exc.details()}"
                break
            await asyncio.sleep(0.05)
        st = await call(b.address, "Status", pb.StatusRequest())
        again = await call(b.address, "Join", pb.JoinRequest(node=pb.NodeInfo(node_id="n0", rank=0), world_size=1,
                                                             incarnation=joined.epoch))
        return (refusal, a.etcd.leader()["name"], epoch, st.epoch, [m.node.node_id for m in st.members],
                again.epoch == joined.epoch)
    finally:
        await a.stop()
        if b is not None:
            b.stop()


def test_a_leader_that_loses_its_lease_stands_down_and_the_standby_serves_its_members(etcd, request, tmp_path):
    import asyncio
    refusal, holder, epoch, recovered_epoch, members, same = asyncio.run(
        _stand_down(etcd.url, f"/test/{request.node.name}/", tmp_path))
    assert refusal.startswith("UNAVAILABLE: standby coordinator"), refusal
    assert holder == "b" and recovered_epoch == epoch == 1 and members == ["n0"]
    assert same                                    # n0 re-registers with b under the incarnation a gave it


async def _etcd_outage(server: Etcd) -> tuple[str, int, int, list[str]]:
    import asyncio

    from tinydist.scheduler._generated import cluster_pb2 as pb
    from tinydist.scheduler._generated import cluster_pb2_grpc as pb_grpc
    from tinydist.scheduler.coordinator import Coordinator as InProcess
    a = await InProcess.start("127.0.0.1:0", insecure_loopback_only=True, heartbeat_interval=0.1, miss_limit=50,
                              etcd=server.url, leader_ttl=2, name="a")

    async def status() -> tuple[str, object]:
        async with grpc.aio.insecure_channel(a.address) as channel:
            try:
                return "OK", await pb_grpc.ClusterStub(channel).Status(pb.StatusRequest(), timeout=10)
            except grpc.aio.AioRpcError as exc:
                return f"{exc.code().name}: {exc.details()}", None

    async def until(ok: bool) -> str:
        for _ in range(600):
            code, _st = await status()
            if (code == "OK") == ok:
                return code
            await asyncio.sleep(0.05)
        raise AssertionError(f"coordinator still answers {code}")

    try:
        await asyncio.wait_for(a.leading.wait(), 20)
        async with grpc.aio.insecure_channel(a.address) as channel:
            await pb_grpc.ClusterStub(channel).Join(pb.JoinRequest(node=pb.NodeInfo(node_id="n0", rank=0)), timeout=10)
        epoch = (await status())[1].epoch                       # type: ignore[union-attr]
        await asyncio.to_thread(server.stop)
        refused = await until(False)                            # its lease cannot be renewed: it stands down
        await asyncio.to_thread(server.start)
        await until(True)                                       # it wins again once its old lease expired
        back = (await status())[1]
        return refused, epoch, back.epoch, [m.node.node_id for m in back.members]  # type: ignore[union-attr]
    finally:
        await a.stop()


def test_the_leader_stands_down_while_etcd_is_away_and_leads_again_with_its_members(tmp_path):
    import asyncio
    if not ETCD.exists():
        pytest.skip(f"{ETCD} absent: install Debian's etcd-server (deploy/ci/apt-packages.txt)")
    server = Etcd(tmp_path)
    try:
        refused, epoch, back, members = asyncio.run(_etcd_outage(server))
    finally:
        server.stop()
    assert refused.startswith("UNAVAILABLE: standby coordinator"), refused
    assert back == epoch == 1 and members == ["n0"]
