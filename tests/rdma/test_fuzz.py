"""Fuzzing what the firmware and the NIC write: HWRM responses, CREQ entries, CQEs, wire frames.

Whatever the bytes, the driver raises only RdmaError subclasses (never IndexError/struct.error),
never reads past the response page, and never hangs (every wait is bounded).
"""

from __future__ import annotations

import asyncio

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.rdma.helpers import FAST, run
from tinydist.transports.rdma_bnxt import hsi
from tinydist.transports.rdma_bnxt.device import BnxtDevice, Cq, Qp
from tinydist.transports.rdma_bnxt.errors import RdmaError
from tinydist.transports.rdma_bnxt.hwrm import Mailbox
from tinydist.transports.rdma_bnxt.rcfw import Rcfw
from tinydist.transports.rdma_bnxt.softbnxt import wire

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class FakePci:
    """A device whose mailbox answers with the fuzzed bytes (written into the response page on trigger)."""

    name = "fuzz"

    def __init__(self) -> None:
        self.answer = b""
        self.page: np.ndarray | None = None
        self.doorbells: list[int] = []

    def alloc_sysmem(self, size):
        n = -(-size // 4096)
        return np.zeros(n * 4096, np.uint8), [0x1000_0000 + i * 4096 for i in range(n)]

    def free_sysmem(self, paddrs):
        pass

    async def wait_irq(self, timeout):
        await asyncio.sleep(timeout)
        return False


class FakeBar:
    def __init__(self, pci: FakePci) -> None:
        self.pci = pci

    def write(self, off, data):
        if off == hsi.HWRM_TRIGGER_OFF and self.pci.page is not None:
            ans = self.pci.answer[:4096]
            self.pci.page[:len(ans)] = np.frombuffer(ans, np.uint8)

    def write64(self, off, value):
        self.pci.doorbells.append(value)


def _fake_dev():
    pci = FakePci()
    dev = BnxtDevice(pci, FAST)
    dev.cfg.hwrm_valid_timeout = 0.001
    dev.bar0 = dev.bar2 = FakeBar(pci)
    dev.db_off = 0
    return pci, dev


@FUZZ
@given(body=st.binary(min_size=0, max_size=300), resp_len=st.integers(0, 0xffff), seq_ok=st.booleans(),
       name=st.sampled_from(sorted(hsi.HWRM)))
def test_hwrm_response_fuzz(body: bytes, resp_len: int, seq_ok: bool, name: str) -> None:
    async def go():
        pci, dev = _fake_dev()
        mbox = Mailbox(dev)
        mbox.default_timeout = 0.002
        pci.page = mbox.page
        req_type = hsi.HWRM[name][0]
        head = hsi.RESP_HDR.pack(0 if len(body) < 2 else body[0], req_type, 1 if seq_ok else 7, resp_len)
        pci.answer = head + body[8:]
        try:
            out = await mbox.send(name)
        except RdmaError:
            return
        assert 8 <= resp_len <= 4096 and isinstance(out, dict)
    run(go(), 10)


@FUZZ
@given(entries=st.lists(st.binary(min_size=16, max_size=16), min_size=1, max_size=300))
def test_creq_fuzz(entries: list[bytes]) -> None:
    pci, dev = _fake_dev()
    dev.creq_page = pci.alloc_sysmem(4096)[0], 0x1000
    rc = Rcfw(dev, creq_id=1)
    for i, e in enumerate(entries[:256]):
        rc.creq[i * 16:i * 16 + 16] = np.frombuffer(e, np.uint8)
    consumed = rc.drain()                    # unknown cookies/types are counted, async events dispatched
    assert consumed <= 256


@FUZZ
@given(raw=st.binary(min_size=64 * 32, max_size=64 * 32), posted=st.integers(0, 64))
def test_cqe_fuzz(raw: bytes, posted: int) -> None:
    pci, dev = _fake_dev()
    cq_buf = np.frombuffer(bytearray(raw), np.uint8).copy()
    scq, rcq = Cq(dev, 1, 64, cq_buf), Cq(dev, 2, 64, np.zeros(64 * 32, np.uint8))
    sq = np.zeros(64 * (128 + 8), np.uint8)
    qp = Qp(dev, 5, 0x1234, scq, rcq, sq, 64, np.zeros(64 * 128, np.uint8), 64, 3)
    qp.state = hsi.QPS_RTS
    qp.sq_prod = posted
    moved = qp.poll()                         # never raises: bad CQEs become the QP's classified error
    assert isinstance(moved, bool)
    if qp.error is not None:
        assert isinstance(qp.error, RdmaError)
        try:
            run(qp.wait_send(0, 0.01), 5)
        except RdmaError:
            pass


@FUZZ
@given(frame=st.binary(min_size=0, max_size=200))
def test_wire_frame_fuzz(frame: bytes) -> None:
    assert wire.unpack(memoryview(frame)) is None or len(frame) >= wire.HEADER_BYTES
