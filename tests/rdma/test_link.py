"""The RDMA link as a tinydist transport: conformance, fallback, failures, and a two-process allreduce."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import anyio
import numpy as np
import pytest

from tests.rdma.helpers import FAST, run
from tinydist.base.config import settings
from tinydist.transports.base import PeerFailed, check_link_pair, check_peer_death, serving
from tinydist.transports.rdma_bnxt.softbnxt import FaultPlan
from tinydist.transports.rdma_bnxt.transport import RdmaLink, RdmaNic, open_link
from tinydist.transports.tcp import TcpLink, connected_pair

ROOT = Path(__file__).resolve().parents[2]


async def _pair(na, nb):
    s1, s2 = await connected_pair()
    res = {}

    async def mk(key, s, r, p, n):
        res[key] = await open_link(s, r, p, nic=n, timeout=10)
    async with anyio.create_task_group() as tg:
        tg.start_soon(mk, "a", s1, 0, 1, na)
        tg.start_soon(mk, "b", s2, 1, 0, nb)
    return res["a"], res["b"]


def _clean(nic: RdmaNic) -> None:
    assert nic.soft.live_objects() == {} and nic.soft.mem.live_pages == 0 and nic.dev.ledger.live() == {}
    assert nic.soft.faults == []


def test_conformance_over_rdma() -> None:
    async def body():
        na, nb = await RdmaNic.open_soft("a"), await RdmaNic.open_soft("b")
        base = (na.dev.ledger.live(), na.soft.live_objects())
        a, b = await _pair(na, nb)
        assert isinstance(a, RdmaLink) and isinstance(b, RdmaLink)
        async with serving(a, b):
            await check_link_pair(a, b)
        assert a.rdma_error is None and b.rdma_error is None
        assert (na.dev.ledger.live(), na.soft.live_objects()) == base      # the link gave back its QP, CQs, MRs
        for n in (na, nb):
            await n.close()
            _clean(n)
    run(body(), 60)


def test_conformance_over_lossy_wire() -> None:
    plan = FaultPlan(seed=5).wire(drop=0.02, dup=0.02, reorder=0.02)

    async def body():
        na, nb = await RdmaNic.open_soft("a", plan=plan), await RdmaNic.open_soft("b", plan=plan)
        a, b = await _pair(na, nb)
        async with serving(a, b):
            await check_link_pair(a, b, large=1 << 20)
        assert plan.fired["wire:drop"] and plan.fired["wire:dup"] and plan.fired["wire:reorder"]
        for n in (na, nb):
            await n.close()
            _clean(n)
    run(body(), 90)


def test_link_failure_is_classified_and_bounded() -> None:
    """The wire dies under a link: the sender's completion reports RetryExceeded/LinkDown; the link fails with it."""
    async def body():
        na, nb = await RdmaNic.open_soft("a", cfg=FAST), await RdmaNic.open_soft("b", cfg=FAST)
        try:
            a, b = await _pair(na, nb)
            failures = []
            a.on_failure = lambda peer, reason, blamed: failures.append(reason)
            async with serving(a, b):
                na.soft.link(False)
                with anyio.fail_after(5):
                    with pytest.raises(PeerFailed) as info:
                        for _ in range(100):
                            await a.send(np.zeros(1 << 20, np.uint8))
                            await anyio.sleep(0.01)
                assert "LinkDown" in info.value.reason and "hint" in info.value.reason
                assert type(a.rdma_error).__name__ == "LinkDown" and failures
                na.soft.link(True)
        finally:
            for n in (na, nb):
                await n.close()
        for n in (na, nb):
            _clean(n)
    run(body(), 30)


def test_peer_death_is_noticed() -> None:
    async def body():
        na, nb = await RdmaNic.open_soft("a"), await RdmaNic.open_soft("b")
        a, b = await _pair(na, nb)
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.serve)
            tg.start_soon(b.serve)
            exc = await check_peer_death(a, lambda: b.sock.close())
            assert isinstance(exc, PeerFailed)
            tg.cancel_scope.cancel()
        await a.close()
        await b.close()
        for n in (na, nb):
            await n.close()
            _clean(n)
    run(body(), 30)


def test_fallback_to_tcp_with_reason() -> None:
    async def body():
        na = await RdmaNic.open_soft("a")
        s1, s2 = await connected_pair()
        res = {}

        async def mk(key, s, r, p, n):
            res[key] = await open_link(s, r, p, nic=n, timeout=10)
        with settings.override(RDMA_NIC="off"):
            async with anyio.create_task_group() as tg:
                tg.start_soon(mk, "a", s1, 0, 1, na)
                tg.start_soon(mk, "b", s2, 1, 0, None)
        a, b = res["a"], res["b"]
        assert isinstance(a, TcpLink) and isinstance(b, TcpLink)
        assert "TINYDIST_RDMA_NIC=off" in a.fallback_reason and "rank 1" in a.fallback_reason
        async with serving(a, b):
            await check_link_pair(a, b, large=1 << 16)
        await na.close()
        _clean(na)
    run(body(), 30)


def test_auto_without_hardware_falls_back() -> None:
    async def body():
        s1, s2 = await connected_pair()
        res = {}

        async def mk(key, s, r, p):
            res[key] = await open_link(s, r, p, timeout=10)
        with settings.override(RDMA_NIC="auto"):
            async with anyio.create_task_group() as tg:
                tg.start_soon(mk, "a", s1, 0, 1)
                tg.start_soon(mk, "b", s2, 1, 0)
        assert isinstance(res["a"], TcpLink) and "14e4:1760" in res["a"].fallback_reason
        for link in res.values():
            link.sock.close()
    run(body(), 30)


def spawn_pair(mode: str, tmp: Path, extra_env: dict[str, str] | None = None, args: tuple = ()) -> list[Path]:
    """Run tests/rdma/_worker.py as two processes (rank 0 accepts on a listener we pass it)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    env = {**os.environ, "TINYDIST_RDMA_NIC": "soft", "PYTHONPATH": str(ROOT), **(extra_env or {})}
    outs = [tmp / f"rank{r}.npz" for r in (0, 1)]
    procs = []
    try:
        for rank in (0, 1):
            fd = str(listener.fileno()) if rank == 0 else "-"
            procs.append(subprocess.Popen([sys.executable, *args, str(ROOT / "tests/rdma/_worker.py"), mode, str(rank), str(port), fd,
                                           str(outs[rank])], env=env, pass_fds=(listener.fileno(),) if rank == 0 else (),
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        for p in procs:
            out, _ = p.communicate(timeout=90)
            assert p.returncode == 0, out.decode()[-3000:]
    finally:
        listener.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def test_two_process_allreduce_over_modelled_rdma(tmp_path: Path) -> None:
    outs = spawn_pair("allreduce", tmp_path)
    x0 = np.random.default_rng(0).standard_normal(1_000_003).astype(np.float32)
    x1 = np.random.default_rng(1).standard_normal(1_000_003).astype(np.float32)
    i0, i1 = np.arange(300_001, dtype=np.int64), np.arange(300_001, dtype=np.int64) * 2
    for path in outs:
        r = np.load(path)
        assert str(r["kind"]) == "rdma_bnxt"
        for algorithm in ("naive", "ring"):
            np.testing.assert_array_equal(r[f"f32_{algorithm}"], x0 + x1)
            np.testing.assert_array_equal(r[f"i64_{algorithm}"], i0 + i1)
        np.testing.assert_array_equal(r["gather"], np.array([0] * 5 + [1] * 6, np.int32))
