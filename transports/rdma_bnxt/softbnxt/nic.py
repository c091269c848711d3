"""softbnxt: a software BNXT NIC behind BAR reads/writes, doorbells and DMA into registered host memory.

Firmware (HWRM mailbox and RCFW command queue) and data path (SQ/RQ/CQ rings, RC transport) use the
real formats (transports.rdma_bnxt.hsi). Work is done asynchronously on the event loop (MMIO writes
schedule it), like a device: the driver must poll or wait for the interrupt to see results.

Fidelity: HWRM request/response layout, seq/valid protocol and init ordering; CMDQ/CREQ rings with
phase bits, cookies and NQ_ARM consumer; backing-store, ring, stat, vnic, filter, GID, CQ, QP, MR
objects and their teardown; QP state machine with required modify masks; requester/responder RC
semantics (PSN with go-back-N, duplicate re-ACK, NAK-SEQ once, RNR, retry and ACK timers,
REMOTE_WRITE/rkey/lkey/bounds checks, LOC_LEN), CQ overflow (no CQE written, CREQ 0xc1, QPs to
ERR), flush CQEs in ERR, DMA to unmapped pages as IOMMU faults. Not modelled: RoCEv2 framing, UD,
SRQ, atomics, READ, congestion control, real MSI-X (one interrupt wakes every waiter).

The NIC is built in layers (state.py -> roce.py -> firmware.py -> this module); see state.py.
"""

from __future__ import annotations

import asyncio

from tinydist.transports.rdma_bnxt import hsi
from tinydist.transports.rdma_bnxt.softbnxt.firmware import Firmware


class SoftNic(Firmware):
    """One modelled NIC: a PCI function with BAR0 (HWRM/RCFW), BAR2 (doorbells) and one Ethernet port."""

    # ---- PCI side -----------------------------------------------------------------------------

    def pci_reset(self) -> None:
        self.counters["pci_reset"] += sum(self.live_objects().values())
        self._reset_objects()
        self.fw_state = "HWRM_READY"

    def bar0_write(self, off: int, data: bytes) -> None:
        if off < 0 or off + len(data) > len(self.bar0):
            self.counters["bar0_bad_write"] += 1
            return
        self.bar0[off:off + len(data)] = data
        loop = asyncio.get_running_loop()
        if off == hsi.HWRM_TRIGGER_OFF and data[:1] == b"\x01":
            req = bytes(self.bar0[:hsi.HWRM_MAX_REQ_LEN])
            loop.call_soon(self._hwrm, req)
        elif off == hsi.RCFW_TRIGGER_OFF:
            loop.call_soon(self._rcfw)

    def doorbell(self, off: int, value: int) -> None:
        if off != self.db_size_kb * 1024:
            self.counters["db_bad_offset"] += 1
            return
        xid, typ, index, epoch, valid, path = hsi.db_decode(value)
        if not valid or path != 0:
            self.counters["db_invalid"] += 1
            return
        if typ == hsi.DB_NQ_ARM:
            ring = self.rings.get(xid)
            if ring is not None and self.cmdq is not None and xid == self.cmdq["creq_id"]:
                self.creq_cons = _unwrap(self.creq_prod, index, epoch, hsi.CREQ_ENTRIES)
                self._flush_creq_backlog()
            return
        if typ in (hsi.DB_CQ, hsi.DB_CQ_ARMALL, hsi.DB_CQ_ARMSE):
            cq = self.cqs.get(xid)
            if cq is None:
                self.counters["db_unknown_cq"] += 1
                return
            cq.cons = _unwrap(cq.prod, index, epoch, cq.size)
            return
        qp = self.qps.get(xid)
        if qp is None:
            self.counters["db_unknown_qp"] += 1
            return
        if typ == hsi.DB_SQ:
            new = _unwrap_ahead(qp.sq_prod, index, epoch, qp.sq_size)
            if new - qp.sq_done > qp.sq_size:
                self._qp_fatal(qp, req_reason=0x10)        # ring overrun
                return
            qp.sq_prod = new
            self._schedule_sq(qp)
        elif typ == hsi.DB_RQ:
            new = _unwrap_ahead(qp.rq_prod, index, epoch, qp.rq_size)
            if new - qp.rq_cons > qp.rq_size:
                self._qp_fatal(qp, res_reason=0x10)
                return
            qp.rq_prod = new
            if qp.state == hsi.QPS_ERR:
                self._flush_rq(qp)
        else:
            self.counters["db_bad_type"] += 1

    def link(self, up: bool) -> None:
        """Bring the port up or down (a pulled cable / switch failure)."""
        self.port_up = up
        self.counters["link_up" if up else "link_down"] += 1


    # ---- lifetime -----------------------------------------------------------------------------

    async def start(self) -> tuple[str, int]:
        """Open the port (a loopback listener); returns its address for peers to dial."""
        return await self.wire.start()

    async def stop(self) -> None:
        for qp in self.qps.values():
            if qp.timer is not None:
                qp.timer.cancel()
        await self.wire.close()
        self._irq()



def _unwrap(prod: int, index: int, epoch: int, n: int) -> int:
    """The full consumer count (<= prod) whose low bits are `index` (mod n) and epoch bit `epoch`."""
    period = 2 * n
    cand = prod - (prod % period) + epoch * n + index % n
    while cand > prod:
        cand -= period
    return max(cand, 0)


def _unwrap_ahead(old: int, index: int, epoch: int, n: int) -> int:
    """The full producer count (>= old, < old + 2n) matching `index`/`epoch`."""
    period = 2 * n
    cand = old - (old % period) + epoch * n + index % n
    while cand < old:
        cand += period
    return cand

