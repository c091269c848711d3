"""RC semantics through the model and the driver: data, access checks, and faults during transfers.

Each fault ends in its classified error within a bounded time, and afterwards both devices close
with nothing leaked (driver ledger and model agree).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.rdma.helpers import FAST, assert_clean, close_pair, open_pair, run
from tinydist.transports.rdma_bnxt import hsi
from tinydist.transports.rdma_bnxt.errors import (CompletionError, CQOverflow, Flushed, LinkDown, LocalLengthError, LocalProtectionError,
                                         LocalQpOperation, QpFatal, Recovery, RemoteAccessError, RemoteInvalidRequest, RetryExceeded,
                                         RnrRetryExceeded, completion_error)
from tinydist.transports.rdma_bnxt.softbnxt import FaultPlan


def _fill(mr, seed=0):
    mr.buf[:] = np.random.default_rng(seed).integers(0, 256, mr.size, dtype=np.uint8)


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 1 << 20])
def test_write_and_send_sizes(size: int) -> None:
    async def body():
        a, b = await open_pair(mr_bytes=(1 << 20) + 8192)
        _fill(a.mr)
        i = a.qp.post_write(a.mr, 0, size, b.mr.va + 8, b.mr.rkey)
        await a.qp.wait_send(i, 5)
        assert np.array_equal(b.mr.buf[8:8 + size], a.mr.buf[:size])
        b.qp.post_recv(b.mr, 0, size + 10)
        i = a.qp.post_send(a.mr, 3, size)
        await a.qp.wait_send(i, 5)
        index, length = await b.qp.wait_recv(5)
        assert (index, length) == (0, size) and np.array_equal(b.mr.buf[:size], a.mr.buf[3:3 + size])
        await close_pair(a, b)
        assert_clean(a.nic, a.dev)
        assert_clean(b.nic, b.dev)
    run(body())


def test_ring_wrap_and_psn_wrap() -> None:
    """More WQEs than the rings hold (64-entry SQ/CQ), across the 24-bit PSN wrap (start 0xfffff0)."""
    async def body():
        a, b = await open_pair()
        _fill(a.mr, 1)
        for k in range(3 * 64 + 1):
            i = a.qp.post_write(a.mr, k * 64, 5000, b.mr.va + k * 64, b.mr.rkey)
            if k % 16 == 15:
                await a.qp.wait_send(i, 5)
        await a.qp.wait_send(i, 5)
        assert np.array_equal(b.mr.buf[:192 * 64 + 5000], a.mr.buf[:192 * 64 + 5000])
        assert a.qp.psn < 0x1000                      # wrapped
        await close_pair(a, b)
        assert_clean(a.nic, a.dev)
    run(body())


async def _expect(coro, cls, budget: float = 3.0):
    t0 = time.monotonic()
    with pytest.raises(cls) as info:
        await coro
    assert time.monotonic() - t0 < budget
    return info.value


@pytest.mark.parametrize("flush_mode", ["hw_cqe", "silent"])
def test_write_access_errors(flush_mode: str) -> None:
    """Bad rkey: the primary error is reported once, later work is Flushed (with or without hardware flush CQEs)."""
    async def body():
        a, b = await open_pair(flush_mode=flush_mode)
        later = None
        # bad rkey
        i = a.qp.post_write(a.mr, 0, 100, b.mr.va, b.mr.rkey ^ 0x55)
        later = a.qp.post_write(a.mr, 0, 100, b.mr.va, b.mr.rkey)       # queued behind the failing one
        err = await _expect(a.qp.wait_send(i), RemoteAccessError)
        await _expect(a.qp.wait_send(later), Flushed)
        assert err.status == 7 and err.recovery is Recovery.NONE and err.side == "REQ"
        # the QP is in ERR now: a new post reports Flushed, whose cause is the primary error
        with pytest.raises(Flushed) as info:
            a.qp.post_write(a.mr, 0, 1, b.mr.va, b.mr.rkey)
        assert isinstance(info.value.__cause__, RemoteAccessError)
        await close_pair(a, b)
        assert_clean(a.nic, a.dev)
        assert_clean(b.nic, b.dev)
    run(body())


@pytest.mark.parametrize("case", ["past_end", "deregistered", "zero_len_bogus_rkey", "no_remote_write", "bad_lkey"])
def test_write_checks(case: str) -> None:
    async def body():
        access_b = hsi.ACCESS_LOCAL_WRITE if case == "no_remote_write" else None
        a, b = await open_pair(access_b=access_b)
        va, rkey, n, lkey_mr = b.mr.va, b.mr.rkey, 100, a.mr
        if case == "past_end":
            va = b.mr.va + b.mr.size - 99
        if case == "deregistered":
            await b.dev.deregister_mr(b.mr)
        if case == "zero_len_bogus_rkey":
            rkey, n = 0xdead, 0
        if case == "bad_lkey":
            lkey_mr = type(a.mr)(a.mr.va, a.mr.size, a.mr.key ^ 0x100, a.mr.buf)
        i = a.qp.post_write(lkey_mr, 0, n, va, rkey)
        expected = {"past_end": RemoteAccessError, "deregistered": RemoteAccessError, "no_remote_write": RemoteInvalidRequest,
                    "bad_lkey": LocalProtectionError}.get(case)
        if expected is None:
            await a.qp.wait_send(i, 3)
        else:
            await _expect(a.qp.wait_send(i), expected)
        await close_pair(a, b)
        assert_clean(a.nic, a.dev)
    run(body())


def test_recv_shorter_than_send() -> None:
    async def body():
        a, b = await open_pair()
        b.qp.post_recv(b.mr, 0, 100)
        i = a.qp.post_send(a.mr, 0, 101)
        await _expect(a.qp.wait_send(i), RemoteInvalidRequest)
        await _expect(b.qp.wait_recv(2), LocalLengthError)
        await close_pair(a, b)
        assert_clean(a.nic, a.dev)
        assert_clean(b.nic, b.dev)
    run(body())


def test_post_before_rts_is_refused_locally() -> None:
    async def body():
        a, b = await open_pair()
        qp = await a.dev.create_qp(await a.dev.create_cq(), await a.dev.create_cq())
        with pytest.raises(LocalQpOperation):
            qp.post_send(a.mr, 0, 1)
        await close_pair(a, b)
        assert_clean(a.nic, a.dev)
    run(body())


@pytest.mark.parametrize("fault", ["drop", "dup", "reorder", "all"])
def test_lossy_wire_delivers_exact_data(fault: str) -> None:
    plan = FaultPlan(seed=11)
    kw = {"drop": dict(drop=0.1), "dup": dict(dup=0.2), "reorder": dict(reorder=0.2),
          "all": dict(drop=0.05, dup=0.05, reorder=0.05)}[fault]
    plan.wire(**kw)

    async def body():
        a, b = await open_pair(plan_a=plan, plan_b=plan, cfg=FAST)
        _fill(a.mr, 2)
        idx = []
        for k in range(40):
            idx.append(a.qp.post_write(a.mr, k * 20000, 20000 + k, b.mr.va + k * 20000, b.mr.rkey))
        for i in idx:
            await a.qp.wait_send(i, 10)
        b.qp.post_recv(b.mr, 900_000, 9000)
        await a.qp.wait_send(a.qp.post_send(a.mr, 0, 9000), 10)
        assert (await b.qp.wait_recv(5))[1] == 9000
        assert np.array_equal(b.mr.buf[900_000:909_000], a.mr.buf[:9000])
        for k in range(40):
            assert np.array_equal(b.mr.buf[k * 20000:k * 20000 + 20000 + k], a.mr.buf[k * 20000:k * 20000 + 20000 + k])
        assert plan.fired, plan.fired
        stats = a.nic.qps[a.qp.qpn].stats + b.nic.qps[b.qp.qpn].stats
        if fault in ("drop", "all"):
            assert stats["retransmits"] > 0
        if fault == "dup":
            assert stats["rx_duplicate"] > 0
        await close_pair(a, b)
        assert_clean(a.nic, a.dev)
        assert_clean(b.nic, b.dev)
    run(body(), 60)


def test_total_loss_is_retry_exceeded() -> None:
    plan = FaultPlan().wire(drop=1.0)

    async def body():
        a, b = await open_pair(plan_a=plan)
        i = a.qp.post_write(a.mr, 0, 10, b.mr.va, b.mr.rkey)
        err = await _expect(a.qp.wait_send(i), RetryExceeded)
        assert err.recovery is Recovery.RESET_QP and err.status == 0xa
        await close_pair(a, b)
        assert_clean(a.nic, a.dev)
    run(body())


def test_link_down_is_classified() -> None:
    async def body():
        a, b = await open_pair()
        a.nic.link(False)
        i = a.qp.post_write(a.mr, 0, 10, b.mr.va, b.mr.rkey)
        err = await _expect(a.qp.wait_send(i), LinkDown)
        assert err.recovery is Recovery.RESTAGE and isinstance(err.__cause__, RetryExceeded)
        a.nic.link(True)
        await close_pair(a, b)
        assert_clean(a.nic, a.dev)
    run(body())


def test_link_flap_shorter_than_retry_budget_recovers() -> None:
    import asyncio
    import dataclasses
    cfg = dataclasses.replace(FAST, qp_timeout=13, retry_cnt=5)     # 33 ms ACK timer, ~200 ms retry budget

    async def body():
        a, b = await open_pair(cfg=cfg)
        _fill(a.mr, 5)
        a.nic.link(False)
        i = a.qp.post_write(a.mr, 0, 5000, b.mr.va, b.mr.rkey)
        await asyncio.sleep(0.01)
        a.nic.link(True)
        await a.qp.wait_send(i, 3)
        assert np.array_equal(b.mr.buf[:5000], a.mr.buf[:5000])
        assert a.nic.qps[a.qp.qpn].stats["retransmits"] >= 1
        await close_pair(a, b)
        assert_clean(a.nic, a.dev)
    run(body())


def test_rnr_retry_exceeded() -> None:
    async def body():
        a, b = await open_pair()
        i = a.qp.post_send(a.mr, 0, 10)                # no receive posted, rnr_retry 3
        await _expect(a.qp.wait_send(i), RnrRetryExceeded)
        await close_pair(a, b)
        assert_clean(a.nic, a.dev)
    run(body())


def test_late_receive_within_rnr_budget() -> None:
    """rnr_retry 7 (infinite): the SEND is RNR-NAKed until the receive is posted, then completes."""
    import asyncio
    import dataclasses
    cfg = dataclasses.replace(FAST, rnr_retry=7)

    async def body():
        a, b = await open_pair(cfg=cfg)
        i = a.qp.post_send(a.mr, 0, 10)
        qpb = b.nic.qps[b.qp.qpn]
        for _ in range(2000):                                  # bounded: until the first RNR NAK went out
            if qpb.stats["rnr_nak"]:
                break
            await asyncio.sleep(0.001)
        assert qpb.stats["rnr_nak"] >= 1
        b.qp.post_recv(b.mr, 0, 10)
        await a.qp.wait_send(i, 3)
        assert (await b.qp.wait_recv(2))[1] == 10
        await close_pair(a, b)
        assert_clean(a.nic, a.dev)
    run(body())


def test_cq_overflow_natural() -> None:
    """The receive CQ (4 entries) is smaller than the posted receives and nobody polls it: overflow, no CQE lost silently."""
    async def body():
        a, b = await open_pair(rq_b=16, rcq_b=4)
        for k in range(16):
            b.qp.post_recv(b.mr, k * 64, 64)
        for _ in range(8):
            a.qp.post_send(a.mr, 0, 8)
        await _expect(a.qp.wait_send(7), RetryExceeded)     # the responder went to ERR; later SENDs are never ACKed
        for _ in range(4):                                  # the completions before the overflow are delivered ...
            assert (await b.qp.wait_recv(2))[1] == 8
        err = await _expect(b.qp.wait_recv(2), CQOverflow)  # ... then the overflow, not a silent loss
        assert err.recovery is Recovery.RESET_QP
        assert b.nic.counters["cq_overflow"] == 1
        await close_pair(a, b)
        assert_clean(a.nic, a.dev)
        assert_clean(b.nic, b.dev)
    run(body())


def test_cq_overflow_injected_during_transfer() -> None:
    plan = FaultPlan().cq_full(nth=3)

    async def body():
        a, b = await open_pair(plan_a=plan)
        for _ in range(5):
            i = a.qp.post_write(a.mr, 0, 100, b.mr.va, b.mr.rkey)
        await _expect(a.qp.wait_send(i), CQOverflow)
        await close_pair(a, b)
        assert_clean(a.nic, a.dev)
    run(body())


@pytest.mark.parametrize("status", range(1, 0xc))
def test_every_error_cqe_status_is_classified(status: int) -> None:
    plan = FaultPlan().cqe(nth=2, status=status)

    async def body():
        a, b = await open_pair(plan_a=plan)
        await a.qp.wait_send(a.qp.post_write(a.mr, 0, 10, b.mr.va, b.mr.rkey), 3)
        i = a.qp.post_write(a.mr, 0, 10, b.mr.va, b.mr.rkey)
        err = await _expect(a.qp.wait_send(i), CompletionError)
        assert type(err) is type(completion_error("REQ", status, 0)), (status, err)
        assert err.status == status and err.hint
        await close_pair(a, b)
        assert_clean(a.nic, a.dev)
    run(body())


@pytest.mark.parametrize(("step", "fault", "cls"), [("create_qp", "status", "FirmwareError"), ("modify_qp", "status", "FirmwareError"),
                                                     ("register_mr", "status", "FirmwareError"), ("create_cq", "never", "Timeout")])
def test_rcfw_fault_during_setup_of_transfer(step: str, fault: str, cls: str) -> None:
    import tinydist.transports.rdma_bnxt.errors as E
    plan = FaultPlan()
    rule = plan.rcfw(step, nth=2)
    rule.status(2) if fault == "status" else rule.never()

    async def body():
        from tests.rdma.helpers import open_nic
        from tinydist.transports.rdma_bnxt import BnxtDevice
        from tinydist.transports.rdma_bnxt.pci import SoftPciDevice
        nic, _ = await open_nic("n", plan)
        dev = await BnxtDevice.create(SoftPciDevice(nic), FAST)
        t0 = time.monotonic()
        with pytest.raises(getattr(E, cls)):
            for _ in range(3):
                await dev.register_mr(8192)
                await dev.create_qp(await dev.create_cq(), await dev.create_cq())
        assert time.monotonic() - t0 < 2
        await dev.close()
        await nic.stop()
        assert_clean(nic, dev, strict=False)
    run(body())


def test_async_qp_error_wakes_waiter() -> None:
    async def body():
        a, b = await open_pair()
        a.nic._qp_fatal(a.nic.qps[a.qp.qpn], req_reason=0x42)
        err = await _expect(a.qp.wait_send(a.qp.sq_prod, 1), (QpFatal, Flushed))
        assert isinstance(err, (QpFatal, Flushed))
        await close_pair(a, b)
        assert_clean(a.nic, a.dev)
    run(body())


def test_dma_to_freed_page_is_an_iommu_fault() -> None:
    """Negative control: freeing an MR's pages while it is registered makes the model fault, not corrupt memory."""
    async def body():
        a, b = await open_pair()
        b.nic.mem.free(b.nic.mrs[b.mr.key].pages[:1].tolist())
        i = a.qp.post_write(a.mr, 0, 10, b.mr.va, b.mr.rkey)
        with pytest.raises(CompletionError):
            await a.qp.wait_send(i, 2)
        assert b.nic.faults and "IOMMU" in b.nic.faults[0]
        await a.dev.close()
        for s in (a, b):
            await s.nic.stop()
    run(body())
