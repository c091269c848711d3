"""softbnxt's state and what every part of the NIC uses: object tables, the interrupt, DMA, the CREQ.

The NIC is built in layers, each class adding one part and calling only those below it:
`NicState` (here) -> `RcDataPath` (roce.py: the RC requester and responder) -> `Firmware`
(firmware.py: the HWRM and RCFW commands) -> `SoftNic` (nic.py: the PCI face, BARs and doorbells).
"""

from __future__ import annotations

import asyncio
import collections
import secrets
from collections.abc import Callable
from typing import Any

import numpy as np

from tinydist.transports.rdma_bnxt import hsi
from tinydist.transports.rdma_bnxt.softbnxt import wire
from tinydist.transports.rdma_bnxt.softbnxt.faults import FaultPlan
from tinydist.transports.rdma_bnxt.softbnxt.objects import Cq, Mr, Qp
from tinydist.transports.rdma_bnxt.softbnxt.physmem import PAGE, DmaFault, PhysMem


class NicState:
    """The NIC's registers, object tables and counters, with the interrupt, DMA and CREQ helpers."""

    # the RC data path's receive side (roce.RcDataPath), where the wire delivers and places frames
    _on_frame: Callable[[memoryview, bool], None]
    _place: Callable[[memoryview, int], np.ndarray | None]

    def __init__(self, name: str = "softbnxt0", *, plan: FaultPlan | None = None, mem: PhysMem | None = None,
                 mac: bytes | None = None, max_resp_len: int = PAGE, def_req_timeout_ms: int = 10_000,
                 max_req_timeout_ms: int = 40_000, flush_mode: str = "hw_cqe", retry7_infinite: bool = False,
                 db_size_kb: int = 64) -> None:
        self.name = name
        self.plan = plan or FaultPlan()
        self.mem = mem or PhysMem()
        self.mac = mac or bytes([0x02, 0x00]) + secrets.token_bytes(4)
        self.max_resp_len, self.def_req_timeout_ms, self.max_req_timeout_ms = max_resp_len, def_req_timeout_ms, max_req_timeout_ms
        self.flush_mode, self.retry7_infinite, self.db_size_kb = flush_mode, retry7_infinite, db_size_kb
        self.bar0 = bytearray(0x1000)
        self.fw_state = "POWER_ON"
        self.port_up = True
        self.waiters: list[asyncio.Future] = []
        self.irq_handlers: list = []
        self.irq_pending = False
        self.wire = wire.TcpWire(self._on_frame, self._place)
        self.faults: list[str] = []                 # IOMMU faults and other fatal events
        self.counters: collections.Counter[str] = collections.Counter()
        self.reorder_hold: list | None = None
        self._reset_objects()

    # ---- object tables ------------------------------------------------------------------------

    def _reset_objects(self) -> None:
        self.rings: dict[int, dict] = {}
        self.stat_ctxs: dict[int, int] = {}
        self.vnics: set[int] = set()
        self.filters: set[int] = set()
        self.bs_cfg: set[tuple[int, int]] = set()
        self.bs_done = False
        self.registered = False
        self.rcfw_init = False
        self.gids: dict[int, bytes] = {}
        self.cqs: dict[int, Cq] = {}
        self.qps: dict[int, Qp] = {}
        self.mrs: dict[int, Mr] = {}
        self.cmdq: dict[str, Any] | None = None
        self.creq_prod = 0
        self.creq_cons = 0
        self.creq_backlog: collections.deque = collections.deque()
        self.cmdq_cons = 0
        self.cmdq_first_seen = False
        self.next_id = 1
        self.mr_tag = 0

    def live_objects(self) -> dict[str, int]:
        """Firmware objects that exist now (what a driver must have freed after close)."""
        counts = {"rings": len(self.rings), "stat_ctxs": len(self.stat_ctxs), "vnics": len(self.vnics),
                  "l2_filters": len(self.filters), "backing_store": len(self.bs_cfg), "registered": int(self.registered),
                  "rcfw_init": int(self.rcfw_init), "gids": len(self.gids), "cqs": len(self.cqs), "qps": len(self.qps),
                  "mrs": len(self.mrs)}
        return {k: v for k, v in counts.items() if v}

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def bar0_read32(self, off: int) -> int:
        return int.from_bytes(self.bar0[off:off + 4], "little")

    # ---- interrupt ----------------------------------------------------------------------------

    def _irq(self) -> None:
        waiters, self.waiters = self.waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(True)
        if self.irq_handlers and not self.irq_pending:
            self.irq_pending = True           # interrupts coalesce until the handlers ran (like MSI-X moderation)
            asyncio.get_running_loop().call_soon(self._run_irq_handlers)

    def _run_irq_handlers(self) -> None:
        self.irq_pending = False
        for fn in list(self.irq_handlers):
            fn()

    async def wait_irq(self, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.waiters.append(fut)
        def expire() -> None:
            if not fut.done():
                fut.set_result(False)
        handle = loop.call_later(max(timeout, 0), expire)
        try:
            return await fut
        finally:
            handle.cancel()

    # ---- DMA helpers --------------------------------------------------------------------------

    def _dma_write(self, pa: int, data: bytes) -> None:
        self.mem.write(pa, data)

    def _queue_addr(self, pages: list[int], offset: int) -> int:
        return pages[offset // PAGE] + offset % PAGE

    def _walk_pbl(self, level: int, base: int, npages: int, queue: bool) -> list[int]:
        """Page addresses from a PBL (level 0: base is the page; 1: table of PTEs; 2: table of tables)."""
        if level == 0:
            return [base]
        if npages > 512 * 512 or npages <= 0:
            raise DmaFault(f"PBL with {npages} pages")
        def ptes(addr: int, n: int) -> list[int]:
            raw = self.mem.read(addr, n * 8).view("<u8")
            if not np.all(raw & 1):
                raise DmaFault("PBL entry without VALID")
            return [int(x) & ~0xfff for x in raw]
        if level == 1:
            out = ptes(base, npages)
            if queue and npages > 1:
                raw = self.mem.read(base, npages * 8).view("<u8")
                if not raw[-1] & 2 or (npages > 1 and not raw[-2] & 4):
                    raise DmaFault("queue PBL without LAST/NEXT_TO_LAST")
            return out
        tables = ptes(base, -(-npages // 512))
        out = []
        for t in tables:
            out += ptes(t, min(512, npages - len(out)))
        return out

    # ---- CREQ ---------------------------------------------------------------------------------

    def _post_creq(self, typ: int, status: int, cookie: int, xid: int, event: int, req_err: int = 0, res_err: int = 0,
                   sq_cons: int = 0, rq_cons: int = 0) -> None:
        self.creq_backlog.append((typ, status, cookie, xid, event, req_err, res_err, sq_cons, rq_cons))
        self._flush_creq_backlog()

    def _flush_creq_backlog(self) -> None:
        if self.cmdq is None:
            return
        ring = self.rings.get(self.cmdq["creq_id"])
        if ring is None:
            return
        n = hsi.CREQ_ENTRIES
        while self.creq_backlog and self.creq_prod - self.creq_cons < n:   # a full CREQ stalls the firmware
            typ, status, cookie, xid, event, req_err, res_err, sq_cons, rq_cons = self.creq_backlog.popleft()
            v = ((self.creq_prod // n) & 1) ^ 1
            entry = hsi.CREQ.pack(typ, status, cookie, xid, v, event, req_err, res_err, sq_cons, rq_cons)
            self._dma_write(self._queue_addr(ring["pages"], (self.creq_prod % n) * 16), entry)
            self.creq_prod += 1
        self._irq()
