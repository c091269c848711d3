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
"""

from __future__ import annotations

import asyncio
import collections
import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tinydist.transports.rdma_bnxt import hsi
from tinydist.transports.rdma_bnxt.softbnxt import wire
from tinydist.transports.rdma_bnxt.softbnxt.faults import FaultPlan
from tinydist.transports.rdma_bnxt.softbnxt.physmem import PAGE, DmaFault, PhysMem

PSN_MASK = 0xffffff
BURST = 256                      # MTU packets per wire frame (1 MiB)


def psn_diff(a: int, b: int) -> int:
    """a - b in 24-bit sequence space, signed within a 2^23 half window (rxe psn_compare)."""
    d = (a - b) & PSN_MASK
    return d - (1 << 24) if d >= 1 << 23 else d


@dataclass
class Cq:
    id: int
    handle: int
    size: int
    pages: list[int]
    prod: int = 0
    cons: int = 0
    error: bool = False
    qps: set[int] = field(default_factory=set)


@dataclass
class Mr:
    key: int
    va: int
    size: int
    access: int
    pages: np.ndarray            # paddr per page
    shift: int
    run_end: np.ndarray | None = None   # for page i: one past the last page physically contiguous with it


@dataclass
class Wqe:
    index: int
    first_psn: int
    npkts: int
    frames: list                 # (header-parts list) ready to resend
    signaled: bool


@dataclass
class Qp:
    id: int
    handle: int
    scq: Cq
    rcq: Cq
    sq_pages: list[int]
    rq_pages: list[int]
    sq_size: int
    rq_size: int
    access: int = 0
    state: int = hsi.QPS_RESET
    sq_prod: int = 0             # doorbell producer (full 32-bit count)
    sq_next: int = 0             # next WQE the requester reads
    sq_done: int = 0             # WQEs completed
    rq_prod: int = 0
    rq_cons: int = 0
    sq_psn: int = 0
    epsn: int = 0
    dest_qpn: int = 0
    dgid: bytes = b"\0" * 16
    dest_mac: bytes = b"\0" * 6
    timeout: int = 14
    retry_cnt: int = 7
    rnr_retry: int = 7
    min_rnr_timer: int = 1
    retries_left: int = 7
    rnr_left: int = 7
    outstanding: collections.deque = field(default_factory=collections.deque)
    timer: Any = None
    nak_sent: bool = False
    resp_ctx: Any = None         # (kind, mr|rq_slot, va/offset, remaining)
    scheduled: bool = False
    stats: collections.Counter = field(default_factory=collections.Counter)


class SoftNic:
    """One modelled NIC: a PCI function with BAR0 (HWRM/RCFW), BAR2 (doorbells) and one Ethernet port."""

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

    # ---- PCI side -----------------------------------------------------------------------------

    def pci_reset(self) -> None:
        self.counters["pci_reset"] += sum(self.live_objects().values())
        self._reset_objects()
        self.fw_state = "HWRM_READY"

    def bar0_read32(self, off: int) -> int:
        return int.from_bytes(self.bar0[off:off + 4], "little")

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

    def link(self, up: bool) -> None:
        """Bring the port up or down (a pulled cable / switch failure)."""
        self.port_up = up
        self.counters["link_up" if up else "link_down"] += 1

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

    # ---- HWRM ---------------------------------------------------------------------------------

    def _hwrm(self, req: bytes) -> None:
        req_type, _cmpl, seq, _target, resp_addr = hsi.REQ_HDR.unpack_from(req)
        name = hsi.HWRM_BY_TYPE.get(req_type)
        fault = self.plan.match("hwrm", name or f"0x{req_type:x}")
        if fault.get("never"):
            return
        if fault.get("delay"):
            asyncio.get_running_loop().call_later(fault["delay"], self._hwrm_answer, req, name, fault)
            return
        self._hwrm_answer(req, name, fault)

    def _hwrm_answer(self, req: bytes, name: str | None, fault: dict) -> None:
        req_type, _cmpl, seq, _target, resp_addr = hsi.REQ_HDR.unpack_from(req)
        code, body = 0xffff, {}
        out_layout = hsi.Layout("unknown_out", 16, {})
        if name is not None:
            in_layout, out_layout = hsi.HWRM[name][1], hsi.HWRM[name][2]
            args = in_layout.unpack(req)
            if "error" in fault:
                pass                      # an injected error code: the firmware refused, nothing was done
            elif self.fw_state == "FATAL" and name not in ("ver_get", "func_reset"):
                code = 0xf
            elif self.fw_state == "POWER_ON":
                code = 0xf
            else:
                try:
                    code, body = getattr(self, "_hw_" + name)(args)
                except DmaFault as exc:
                    self._fatal(f"IOMMU fault in {name}: {exc}")
                    code = 0xf
        if "error" in fault:
            code, body = fault["error"], {}
        size = out_layout.size
        resp = out_layout.pack(**body)
        resp_len = fault.get("resp_len", size)
        hsi.RESP_HDR.pack_into(resp, 0, code, fault.get("req_type", req_type), (seq + fault.get("seq_delta", 0)) & 0xffff, 0)
        resp[size - 1] = 0
        try:
            # body (valid=0) -> header with resp_len -> valid byte, as the device does
            self._dma_write(resp_addr + 8, bytes(resp[8:size]))
            hsi.RESP_HDR.pack_into(resp, 0, code, fault.get("req_type", req_type), (seq + fault.get("seq_delta", 0)) & 0xffff,
                                   resp_len & 0xffff)
            self._dma_write(resp_addr, bytes(resp[:8]))
            valid_at = (resp_len & 0xffff) - 1
            if 8 <= valid_at < PAGE:
                self._dma_write(resp_addr + valid_at, bytes([fault.get("valid", hsi.HWRM_RESP_VALID_KEY)]))
        except DmaFault as exc:
            self._fatal(f"IOMMU fault writing the HWRM response: {exc}")
        self._irq()

    def _need(self, *states: str) -> int:
        return 0 if self.fw_state in states else 0xf

    def _hw_ver_get(self, a):
        return 0, dict(fw_maj=230, fw_min=1, max_req_win_len=hsi.HWRM_MAX_REQ_LEN, max_resp_len=self.max_resp_len,
                       def_req_timeout=self.def_req_timeout_ms, max_req_timeout=self.max_req_timeout_ms)

    def _hw_func_reset(self, a):
        self.counters["freed_by_reset"] += sum(v for k, v in self.live_objects().items() if k not in ("registered", "backing_store"))
        registered = self.registered
        self._reset_objects()
        self.registered = registered
        self.fw_state = "REGISTERED" if registered else "RESET"
        return 0, {}

    def _hw_func_qcaps(self, a):
        return (2, {}) if a["fid"] != 0xffff else (0, dict(fid=0xffff, port_id=0, mac_address=self.mac))

    def _hw_func_qcfg(self, a):
        return (2, {}) if a["fid"] != 0xffff else (0, dict(fid=0xffff, port_id=0, legacy_l2_db_size_kb=self.db_size_kb))

    def _hw_func_drv_rgtr(self, a):
        if self.fw_state not in ("RESET", "HWRM_READY", "UNREGISTERED"):
            return 0x11, {}
        self.registered, self.fw_state = True, "REGISTERED"
        return 0, {}

    def _hw_func_drv_unrgtr(self, a):
        if not self.registered:
            return 2, {}
        self.counters["leaked_at_unrgtr"] += sum(v for k, v in self.live_objects().items() if k not in ("registered", "backing_store"))
        self.bs_cfg.clear()
        self.registered, self.fw_state = False, "UNREGISTERED"
        return 0, {}

    def _hw_port_phy_qcfg(self, a):
        return 0, dict(link=2 if self.port_up else 0, link_speed=4000 if self.port_up else 0)

    def _hw_func_backing_store_qcaps_v2(self, a):
        t = a["type"]
        if t not in dict(hsi.BS_TYPES):
            return 2, {}
        return 0, dict(type=t, entry_size=64, instance_bit_map=0, ctx_init_value=0xff if t == 0 else 0, ctx_init_offset=0,
                       min_num_entries=16, max_num_entries=1 << 16, split_entry_0=8)

    def _hw_func_backing_store_cfg_v2(self, a):
        if not self.registered:
            return 0xf, {}
        if a["num_entries"] < 16 or a["type"] not in dict(hsi.BS_TYPES):
            return 2, {}
        npages = -(-a["num_entries"] * a["entry_size"] // PAGE)
        self._walk_pbl(a["page_size_pbl_level"] & 3, a["page_dir"], npages, queue=False)
        self.bs_cfg.add((a["type"], a["instance"]))
        if a["flags"] & hsi.BS_ALL_DONE:
            self.bs_done = True
            self.fw_state = "CTX_READY"
        return 0, {}

    def _hw_ring_alloc(self, a):
        if not self.registered:
            return 0xf, {}
        if a["length"] == 0 or a["length"] & (a["length"] - 1):
            return 2, {}
        pages = self._walk_pbl(a["page_tbl_depth"], a["page_tbl_addr"], 1, queue=True)
        rid = self._new_id() & 0xffff
        self.rings[rid] = dict(type=a["ring_type"], length=a["length"], pages=pages, logical_id=a["logical_id"])
        return 0, dict(ring_id=rid, logical_ring_id=a["logical_id"])

    def _hw_ring_free(self, a):
        ring = self.rings.get(a["ring_id"])
        if ring is None or ring["type"] != a["ring_type"]:
            return 2, {}
        del self.rings[a["ring_id"]]
        if self.cmdq is not None and a["ring_id"] == self.cmdq["creq_id"]:
            self.cmdq = None
        return 0, {}

    def _hw_stat_ctx_alloc(self, a):
        if not self.registered:
            return 0xf, {}
        sid = self._new_id()
        self.stat_ctxs[sid] = a["stats_dma_addr"]
        return 0, dict(stat_ctx_id=sid)

    def _hw_stat_ctx_free(self, a):
        return (0, {}) if self.stat_ctxs.pop(a["stat_ctx_id"], None) is not None else (2, {})

    def _hw_vnic_alloc(self, a):
        if not self.registered:
            return 0xf, {}
        vid = self._new_id() & 0xffff
        self.vnics.add(vid)
        return 0, dict(vnic_id=vid)

    def _hw_vnic_free(self, a):
        if a["vnic_id"] not in self.vnics:
            return 2, {}
        self.vnics.discard(a["vnic_id"])
        return 0, {}

    def _hw_vnic_cfg(self, a):
        return (0, {}) if a["vnic_id"] in self.vnics and a["dflt_rx_ring_id"] in self.rings else (2, {})

    def _hw_cfa_l2_filter_alloc(self, a):
        if a["dst_id"] not in self.vnics or a["l2_addr"] != self.mac:
            return 2, {}
        fid = self._new_id()
        self.filters.add(fid)
        return 0, dict(l2_filter_id=fid)

    def _hw_cfa_l2_filter_free(self, a):
        if a["l2_filter_id"] not in self.filters:
            return 2, {}
        self.filters.discard(a["l2_filter_id"])
        return 0, {}

    # ---- RCFW ---------------------------------------------------------------------------------

    def _rcfw(self) -> None:
        init = self.bar0[hsi.CMDQ_INIT_OFF:hsi.CMDQ_INIT_OFF + hsi.CMDQ_INIT.size]
        pbl, size_lvl, creq_id, _ = hsi.CMDQ_INIT.unpack(init)
        if self.cmdq is None or self.cmdq["pbl"] != pbl:
            if creq_id not in self.rings or size_lvl >> 2 != hsi.CMDQ_ENTRIES:
                self.counters["rcfw_bad_init"] += 1
                return
            self.cmdq = dict(pbl=pbl, pages=self._walk_pbl(size_lvl & 3, pbl, 1, queue=True), creq_id=creq_id)
            self.cmdq_cons, self.cmdq_first_seen = 0, False
        pages = self.cmdq["pages"]
        prod_raw = self.bar0_read32(hsi.CMDQ_PROD_OFF)
        if not self.cmdq_first_seen:
            if not prod_raw & hsi.FIRMWARE_FIRST_FLAG:
                self.counters["rcfw_missing_first_flag"] += 1
                return
            self.cmdq_first_seen = True
        prod = prod_raw & 0xffff
        n = hsi.CMDQ_ENTRIES
        for _ in range(n):                                   # bounded: at most one ring of slots per trigger
            if (self.cmdq_cons & 0xffff) == prod:
                break
            head = self._cmdq_read(pages, self.cmdq_cons, 1)
            opcode, cmd_size, _flags, cookie, _rs, _ra = hsi.CMDQ_BASE.unpack(head)
            avail = (prod - self.cmdq_cons) & 0xffff
            if not 1 <= cmd_size <= avail:
                self.counters["rcfw_bad_cmd_size"] += 1
                self.cmdq_cons = prod
                break
            cmd = self._cmdq_read(pages, self.cmdq_cons, cmd_size)
            self.cmdq_cons += cmd_size
            self._rcfw_exec(opcode, cookie, cmd)

    def _cmdq_read(self, pages: list[int], start: int, slots: int) -> bytes:
        out = b""
        for i in range(slots):
            off = ((start + i) % hsi.CMDQ_ENTRIES) * 16
            out += bytes(self.mem.read(self._queue_addr(pages, off), 16))
        return out

    def _rcfw_exec(self, opcode: int, cookie: int, cmd: bytes) -> None:
        name = hsi.RCFW_BY_OPCODE.get(opcode)
        fault = self.plan.match("rcfw", name or f"0x{opcode:x}")
        status, xid = 0xff, 0
        if name is not None and self.fw_state != "FATAL" and "status" not in fault:
            layout = hsi.RCFW[name][1]
            args = layout.unpack(cmd)
            if args["_short"]:
                status = 2
            else:
                try:
                    status, xid = getattr(self, "_rc_" + name)(args)
                except DmaFault as exc:
                    self._fatal(f"IOMMU fault in {name}: {exc}")
                    status = 0xff
        if fault.get("never"):
            return
        if "status" in fault:
            status = fault["status"]
        self._post_creq(hsi.CREQ_QP_EVENT, status, fault.get("cookie", cookie), xid, opcode)

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

    def _rc_initialize_fw(self, a):
        if not self.bs_done or a["stat_ctx_id"] not in self.stat_ctxs or self.rcfw_init:
            return 1, 0
        self.rcfw_init = True
        self.fw_state = "ROCE_READY"
        return 0, 0

    def _rc_deinitialize_fw(self, a):
        if not self.rcfw_init or self.qps or self.cqs or self.mrs:
            return 1, 0
        self.rcfw_init = False
        self.fw_state = "CTX_READY"
        return 0, 0

    def _rc_query_version(self, a):
        return 0, 0

    def _rc_add_gid(self, a):
        if not self.rcfw_init:
            return 1, 0
        idx = min(set(range(len(self.gids) + 1)) - set(self.gids))
        # stored in kernel byte order (reversed big-endian dwords); the wire uses the raw GID
        self.gids[idx] = _gid_from_kernel(a["gid"])
        return 0, idx

    def _rc_delete_gid(self, a):
        return (0, 0) if self.gids.pop(a["gid_index"], None) is not None else (1, 0)

    def _rc_create_cq(self, a):
        if not self.rcfw_init:
            return 1, 0
        size = a["cq_size"]
        if size == 0 or size > 65536:
            return 2, 0
        npages = -(-size * hsi.CQE_STRIDE // PAGE)
        pages = self._walk_pbl(a["pg_size_lvl"] & 3, a["pbl"], npages, queue=True)
        cid = self._new_id()
        self.cqs[cid] = Cq(cid, a["cq_handle"], size, pages)
        return 0, cid

    def _rc_destroy_cq(self, a):
        cq = self.cqs.get(a["cq_cid"])
        if cq is None or cq.qps:
            return 1, 0
        del self.cqs[a["cq_cid"]]
        return 0, 0

    def _rc_create_qp(self, a):
        scq, rcq = self.cqs.get(a["scq_cid"]), self.cqs.get(a["rcq_cid"])
        if not self.rcfw_init or scq is None or rcq is None or a["type"] != 2:
            return 1, 0
        sq, rq = a["sq_size"], a["rq_size"]
        if not (0 < sq <= 65536 and 0 < rq <= 65536):
            return 2, 0
        sq_pages = self._walk_pbl(a["sq_pg_size_lvl"] & 3, a["sq_pbl"], -(-(sq * (hsi.WQE_STRIDE + hsi.MSN_STRIDE)) // PAGE), True)
        rq_pages = self._walk_pbl(a["rq_pg_size_lvl"] & 3, a["rq_pbl"], -(-(rq * hsi.WQE_STRIDE) // PAGE), True)
        qpn = self._new_id()
        qp = Qp(qpn, a["qp_handle"], scq, rcq, sq_pages, rq_pages, sq, rq, access=a["access"])
        self.qps[qpn] = qp
        scq.qps.add(qpn)
        rcq.qps.add(qpn)
        return 0, qpn

    def _rc_destroy_qp(self, a):
        qp = self.qps.pop(a["qp_cid"], None)
        if qp is None:
            return 1, 0
        if qp.timer is not None:
            qp.timer.cancel()
        qp.scq.qps.discard(qp.id)
        qp.rcq.qps.discard(qp.id)
        qp.outstanding.clear()
        return 0, 0

    def _rc_modify_qp(self, a):
        qp = self.qps.get(a["qp_cid"])
        if qp is None:
            return 1, 0
        mask, new = a["modify_mask"], a["state"] & 0xf
        if not mask & hsi.M_STATE:
            return 2, 0
        legal = {hsi.QPS_RESET: {hsi.QPS_INIT, hsi.QPS_RESET}, hsi.QPS_INIT: {hsi.QPS_INIT, hsi.QPS_RTR},
                 hsi.QPS_RTR: {hsi.QPS_RTS}, hsi.QPS_RTS: {hsi.QPS_RTS}, hsi.QPS_ERR: {hsi.QPS_RESET}}
        if new != hsi.QPS_ERR and new not in legal.get(qp.state, set()):
            return 3, 0
        need = hsi.REQUIRED.get(new, hsi.M_STATE)
        if qp.state == hsi.QPS_RTS and new == hsi.QPS_RTS:
            need = hsi.M_STATE
        if mask & need != need:
            return 2, 0
        if mask & hsi.M_ACCESS:
            qp.access = a["access"]
        if new == hsi.QPS_RTR:
            qp.dgid, qp.dest_mac, qp.dest_qpn, qp.epsn = a["dgid"], a["dest_mac"], a["dest_qp_id"], a["rq_psn"] & PSN_MASK
            qp.min_rnr_timer = a["min_rnr_timer"]
            if a["path_mtu"] != hsi.PATH_MTU_4096:
                return 2, 0
        if new == hsi.QPS_RTS and qp.state == hsi.QPS_RTR:
            qp.sq_psn = a["sq_psn"] & PSN_MASK
            qp.timeout, qp.retry_cnt, qp.rnr_retry = a["timeout"], a["retry_cnt"] & 7, a["rnr_retry"] & 7
            qp.retries_left, qp.rnr_left = qp.retry_cnt, qp.rnr_retry
        if new == hsi.QPS_ERR:
            self._qp_error(qp, notify=False)
        else:
            qp.state = new
        if new == hsi.QPS_RESET:
            qp.sq_prod = qp.sq_next = qp.sq_done = qp.rq_prod = qp.rq_cons = 0
        return 0, 0

    def _rc_register_mr(self, a):
        if not self.rcfw_init:
            return 1, 0
        shift = a["log2_pg_size_lvl"] >> 2
        if not 12 <= shift <= 30 or a["mr_size"] == 0 or a["va"] % (1 << shift):
            return 2, 0
        npages = -(-a["mr_size"] // (1 << shift))
        pages = self._walk_pbl(a["log2_pg_size_lvl"] & 3, a["pbl"], npages, queue=False) if npages > 1 else \
            self._walk_pbl(a["log2_pg_size_lvl"] & 3, a["pbl"], 1, queue=False)
        if shift != 12:
            return 2, 0                      # the model registers 4 KiB pages only
        for pa in pages:                     # the pages must be mapped now
            self.mem.read(pa, 1)
        self.mr_tag = (self.mr_tag + 1) & 0xff
        key = (self._new_id() << 8 | self.mr_tag) & 0xffffffff
        self.mrs[key] = Mr(key, a["va"], a["mr_size"], a["access"], np.array(pages, np.int64), shift)
        return 0, key

    def _rc_deregister_mr(self, a):
        return (0, 0) if self.mrs.pop(a["lkey"], None) is not None else (1, 0)

    # ---- memory regions -----------------------------------------------------------------------

    def _mr_check(self, key: int, va: int, n: int, access: int) -> Mr | None:
        mr = self.mrs.get(key)
        if mr is None or (access and mr.access & access != access):
            return None
        if va < mr.va or va + n > mr.va + mr.size:
            return None
        return mr

    def _mr_runs(self, mr: Mr, va: int, n: int):
        """(paddr, length) runs for [va, va+n) of `mr`, merged where the pages are physically consecutive."""
        off = va - mr.va
        if mr.run_end is None:
            brk = np.nonzero(np.diff(mr.pages) != PAGE)[0] + 1
            ends = np.append(brk, len(mr.pages))
            mr.run_end = np.repeat(ends, np.diff(np.concatenate(([0], ends))))
        while n > 0:
            i, o = divmod(off, PAGE)
            take = min(n, int(mr.run_end[i] - i) * PAGE - o)
            yield int(mr.pages[i]) + o, take
            off += take
            n -= take

    def _mr_read(self, mr: Mr, va: int, n: int) -> list[np.ndarray]:
        """The source bytes of a send: views of host memory where contiguous (a requester must not touch a
        buffer until its WQE completes, so retransmissions may read it again), copies otherwise."""
        out: list[np.ndarray] = []
        for pa, k in self._mr_runs(mr, va, n):
            v = self.mem.view(pa, k)
            out.append(v if v is not None else self.mem.read(pa, k))
        return out

    def _mr_write(self, mr: Mr, va: int, data: memoryview) -> None:
        pos = 0
        for pa, k in self._mr_runs(mr, va, len(data)):
            self.mem.write(pa, data[pos:pos + k])
            pos += k

    # ---- completions and errors ---------------------------------------------------------------

    def _post_cqe(self, cq: Cq, cqe: bytearray) -> bool:
        if cq.error:
            return False
        if self.plan.cq_is_full() or cq.prod - cq.cons >= cq.size:
            cq.error = True
            self.counters["cq_overflow"] += 1
            self._post_creq(hsi.CREQ_QP_EVENT, 0, 0, cq.id, hsi.EV_CQ_ERROR)
            for qpn in list(cq.qps):
                if (qp := self.qps.get(qpn)) is not None:
                    self._qp_error(qp, notify=True, req_reason=0x11)
            return False
        toggle = ((cq.prod // cq.size) & 1) ^ 1
        cqe[24] = (cqe[24] & ~1) | toggle
        self._dma_write(self._queue_addr(cq.pages, (cq.prod % cq.size) * hsi.CQE_STRIDE), bytes(cqe))
        cq.prod += 1
        self._irq()
        return True

    def _req_cqe(self, qp: Qp, index: int, status: int) -> None:
        cqe = bytearray(32)
        hsi.CQE_REQ.pack_into(cqe, 0, qp.handle, index % qp.sq_size)
        cqe[24], cqe[25] = hsi.CQE_TYPE_REQ << 1, status
        self._post_cqe(qp.scq, cqe)

    def _res_cqe(self, qp: Qp, length: int, status: int) -> None:
        cqe = bytearray(32)
        hsi.CQE_RES.pack_into(cqe, 0, length, 0, qp.handle, 0)
        cqe[24], cqe[25] = hsi.CQE_TYPE_RES_RC << 1, status
        self._post_cqe(qp.rcq, cqe)

    def _qp_fatal(self, qp: Qp, req_reason: int = 0, res_reason: int = 0) -> None:
        self._qp_error(qp, notify=True, req_reason=req_reason, res_reason=res_reason)

    def _qp_error(self, qp: Qp, notify: bool, req_reason: int = 0, res_reason: int = 0) -> None:
        if qp.state == hsi.QPS_ERR:
            return
        qp.state = hsi.QPS_ERR
        if qp.timer is not None:
            qp.timer.cancel()
            qp.timer = None
        if notify:
            self._post_creq(hsi.CREQ_QP_EVENT, 0, 0, qp.id, hsi.EV_QP_ERROR, req_reason, res_reason,
                            qp.sq_done % qp.sq_size, qp.rq_cons % qp.rq_size)
        self._flush_sq(qp)
        self._flush_rq(qp)

    def _flush_sq(self, qp: Qp) -> None:
        while qp.outstanding:
            w = qp.outstanding.popleft()
            if self.flush_mode == "hw_cqe":
                self._req_cqe(qp, w.index, 0xb)
            qp.sq_done += 1
        while qp.sq_next < qp.sq_prod:
            if self.flush_mode == "hw_cqe":
                self._req_cqe(qp, qp.sq_next, 0xb)
            qp.sq_next += 1
            qp.sq_done += 1

    def _flush_rq(self, qp: Qp) -> None:
        while qp.rq_cons < qp.rq_prod:
            if self.flush_mode == "hw_cqe":
                self._res_cqe(qp, 0, 8)
            qp.rq_cons += 1

    def _fatal(self, why: str) -> None:
        self.faults.append(why)
        self.fw_state = "FATAL"
        for qp in list(self.qps.values()):
            self._qp_error(qp, notify=True, req_reason=0xff)

    # ---- requester ----------------------------------------------------------------------------

    def _schedule_sq(self, qp: Qp) -> None:
        if not qp.scheduled:
            qp.scheduled = True
            asyncio.get_running_loop().call_soon(self._process_sq, qp)

    def _process_sq(self, qp: Qp) -> None:
        qp.scheduled = False
        if self.qps.get(qp.id) is not qp:
            return
        if qp.state == hsi.QPS_ERR:
            self._flush_sq(qp)
            return
        if qp.state != hsi.QPS_RTS:
            self.counters["db_before_rts"] += 1
            return
        try:
            while qp.sq_next < qp.sq_prod and qp.state == hsi.QPS_RTS:
                self._start_wqe(qp)
        except DmaFault as exc:
            self._fatal(f"IOMMU fault on QP {qp.id} SQ: {exc}")

    def _start_wqe(self, qp: Qp) -> None:
        i = qp.sq_next
        slot = i % qp.sq_size
        raw = self.mem.read(self._queue_addr(qp.sq_pages, slot * hsi.WQE_STRIDE), hsi.SQ_WQE.size)
        typ, flags, wqe_size, _imm, length, rva, rkey, sva, lkey, ssize = hsi.SQ_WQE.unpack(raw.tobytes())
        msn = self.mem.read_u64(self._queue_addr(qp.sq_pages, qp.sq_size * hsi.WQE_STRIDE + slot * hsi.MSN_STRIDE))
        qp.sq_next += 1
        npk = hsi.packets(length)
        bad = None
        if typ not in (hsi.WQE_SEND, hsi.WQE_WRITE) or wqe_size < 3:
            bad = 3
        elif length != ssize:
            bad = 2
        elif length and self._mr_check(lkey, sva, length, 0) is None:
            bad = 4
        elif msn != hsi.msn_entry(slot, qp.sq_psn, (qp.sq_psn + npk) & PSN_MASK):
            bad = 3                                                          # model policy: MSN mismatch
        if bad is not None:
            self._req_cqe(qp, i, bad)
            qp.sq_done += 1
            self._qp_error(qp, notify=True, req_reason=bad)
            return
        payload = self._mr_read(self.mrs[lkey], sva, length) if length else []
        first_psn = qp.sq_psn
        qp.sq_psn = (qp.sq_psn + npk) & PSN_MASK
        is_write = typ == hsi.WQE_WRITE
        frames = []
        flat = payload[0] if len(payload) == 1 else (np.concatenate(payload) if payload else np.empty(0, np.uint8))
        for k in range(0, npk, BURST):
            n = min(BURST, npk - k)
            first, last = k == 0, k + n == npk
            if is_write:
                op = wire.OP_WRITE_ONLY if first and last else wire.OP_WRITE_FIRST if first else \
                    wire.OP_WRITE_LAST if last else wire.OP_WRITE_MIDDLE
            else:
                op = wire.OP_SEND_ONLY if first and last else wire.OP_SEND_FIRST if first else \
                    wire.OP_SEND_LAST if last else wire.OP_SEND_MIDDLE
            chunk = flat[k * hsi.MTU:(k + n) * hsi.MTU]
            head = wire.pack(op, qp.dest_qpn, first_psn + k, n, wire.F_ACK_REQ if last else 0, qp.dgid,
                             rva if first and is_write else 0, rkey if first and is_write else 0,
                             length if first and is_write else 0, 0, len(chunk))
            frames.append([head, chunk.data] if len(chunk) else [head])
        w = Wqe(i, first_psn, npk, frames, bool(flags & hsi.WQE_SIGNAL))
        qp.outstanding.append(w)
        for f in frames:
            self._tx(qp.dgid, f)
        self._arm_timer(qp)

    def _tx(self, dgid: bytes, parts: list) -> None:
        if not self.port_up:
            self.counters["tx_link_down"] += 1
            return
        plan = self.plan
        if plan.drop and plan.roll("drop"):
            return
        if plan.reorder and self.reorder_hold is None and plan.roll("reorder"):
            self.reorder_hold = [dgid, parts]
            return
        self.wire.send(dgid, parts)
        self.counters["tx_frames"] += 1
        if plan.dup and plan.roll("dup"):
            self.wire.send(dgid, parts)
        if self.reorder_hold is not None:
            held, self.reorder_hold = self.reorder_hold, None
            self.wire.send(held[0], held[1])

    def _ack_timeout_s(self, qp: Qp) -> float:
        return 4.096e-6 * (1 << min(qp.timeout, 31))

    def _arm_timer(self, qp: Qp, restart: bool = False) -> None:
        if restart and qp.timer is not None:
            qp.timer.cancel()
            qp.timer = None
        if qp.timer is None and qp.outstanding:
            qp.timer = asyncio.get_running_loop().call_later(self._ack_timeout_s(qp), self._on_ack_timeout, qp)

    def _on_ack_timeout(self, qp: Qp) -> None:
        qp.timer = None
        if self.qps.get(qp.id) is not qp or qp.state != hsi.QPS_RTS or not qp.outstanding:
            return
        qp.stats["ack_timeouts"] += 1
        self._retry(qp, qp.outstanding[0].first_psn)

    def _retry(self, qp: Qp, from_psn: int, rnr: bool = False) -> None:
        if rnr:
            if qp.rnr_retry != 7:
                qp.rnr_left -= 1
        elif not (qp.retry_cnt == 7 and self.retry7_infinite):
            qp.retries_left -= 1
        if qp.rnr_left < 0 or qp.retries_left < 0:
            w = qp.outstanding.popleft()
            self._req_cqe(qp, w.index, 9 if rnr else 0xa)
            qp.sq_done += 1
            self._qp_error(qp, notify=True, req_reason=9 if rnr else 0xa)
            return
        qp.stats["retransmits"] += 1
        for w in qp.outstanding:                                   # go back N from from_psn
            for k, f in enumerate(w.frames):
                frame_last = w.first_psn + min((k + 1) * BURST, w.npkts) - 1
                if psn_diff(frame_last, from_psn) >= 0:
                    self._tx(qp.dgid, f)
        self._arm_timer(qp, restart=True)

    def _on_ack(self, qp: Qp, psn: int, syndrome: int) -> None:
        if qp.state != hsi.QPS_RTS:
            return
        kind = syndrome & 0xe0
        acked = psn if kind == 0 else (psn - 1) & PSN_MASK     # a NAK implicitly ACKs what precedes it
        progressed = False
        while qp.outstanding and psn_diff(qp.outstanding[0].first_psn + qp.outstanding[0].npkts - 1, acked) <= 0:
            w = qp.outstanding.popleft()
            status = self.plan.req_cqe_status()
            if w.signaled or status:
                self._req_cqe(qp, w.index, status or 0)
            qp.sq_done += 1
            progressed = True
            if status:
                self._qp_error(qp, notify=True, req_reason=status)
                return
        if progressed:
            qp.retries_left, qp.rnr_left = qp.retry_cnt, qp.rnr_retry
        if kind == 0:
            self._arm_timer(qp, restart=True)
        elif syndrome == wire.SYN_NAK_SEQ:
            qp.stats["nak_seq"] += 1
            if qp.outstanding:
                self._retry(qp, psn)
        elif kind == wire.SYN_RNR:
            qp.stats["rnr"] += 1
            if qp.outstanding:
                if qp.timer is not None:
                    qp.timer.cancel()
                qp.timer = asyncio.get_running_loop().call_later(_rnr_delay(syndrome & 0x1f), self._rnr_fire, qp, psn)
        elif qp.outstanding:
            status = {wire.SYN_NAK_INV: 6, wire.SYN_NAK_ACC: 7}.get(syndrome, 8)
            w = qp.outstanding.popleft()
            self._req_cqe(qp, w.index, status)
            qp.sq_done += 1
            self._qp_error(qp, notify=True, req_reason=status)

    def _rnr_fire(self, qp: Qp, psn: int) -> None:
        qp.timer = None
        if self.qps.get(qp.id) is qp and qp.state == hsi.QPS_RTS and qp.outstanding:
            self._retry(qp, psn, rnr=True)

    # ---- responder ----------------------------------------------------------------------------

    def _send_ack(self, qp: Qp, psn: int, syndrome: int) -> None:
        self._tx(qp.dgid, [wire.pack(wire.OP_ACK, qp.dest_qpn, psn, 0, 0, qp.dgid, aeth=syndrome << 24)])

    def _place(self, head: memoryview, paylen: int) -> np.ndarray | None:
        """Where a WRITE frame's payload goes, if every responder check would pass now; None otherwise."""
        f = wire.unpack_header(head, paylen)
        if f is None or not self.port_up:
            return None
        _m, _v, op, dst_qpn, psn, npkts, _flags, dgid, va, rkey, dma_len, _aeth, _paylen = f
        qp = self.qps.get(dst_qpn)
        if qp is None or qp.state not in (hsi.QPS_RTR, hsi.QPS_RTS) or psn != qp.epsn or dgid not in self.gids.values():
            return None
        if op in (wire.OP_WRITE_FIRST, wire.OP_WRITE_ONLY):
            if not qp.access & hsi.ACCESS_REMOTE_WRITE or not dma_len or paylen > dma_len:
                return None
            mr = self._mr_check(rkey, va, dma_len, hsi.ACCESS_REMOTE_WRITE)
            start = va
        elif op in (wire.OP_WRITE_MIDDLE, wire.OP_WRITE_LAST) and qp.resp_ctx is not None and qp.resp_ctx[0] == "write":
            mr, start = qp.resp_ctx[1], qp.resp_ctx[2]
            if paylen > qp.resp_ctx[3]:
                return None
        else:
            return None
        if mr is None:
            return None
        runs = list(self._mr_runs(mr, start, paylen))
        return self.mem.view(runs[0][0], paylen) if len(runs) == 1 else None

    def _on_frame(self, frame: memoryview, placed: bool = False) -> None:
        if not self.port_up:
            self.counters["rx_link_down"] += 1
            return
        f = wire.unpack(frame) if not placed else wire.unpack_header(frame, None)
        if f is None:
            self.counters["rx_bad_frame"] += 1
            return
        _m, _v, op, dst_qpn, psn, npkts, flags, dgid, va, rkey, dma_len, aeth, paylen = f
        qp = self.qps.get(dst_qpn)
        if qp is None or dgid not in self.gids.values():
            self.counters["rx_unknown_dst"] += 1
            return
        try:
            if op == wire.OP_ACK:
                self._on_ack(qp, psn, aeth >> 24)
            else:
                payload = frame[wire.HEADER_BYTES:] if not placed else _Placed(paylen)
                self._respond(qp, op, psn, npkts, flags, va, rkey, dma_len, payload)
        except DmaFault as exc:
            self._fatal(f"IOMMU fault on QP {qp.id} receive: {exc}")

    def _respond(self, qp: Qp, op: int, psn: int, npkts: int, flags: int, va: int, rkey: int, dma_len: int,
                 payload: memoryview | _Placed) -> None:
        if qp.state not in (hsi.QPS_RTR, hsi.QPS_RTS):
            self.counters["rx_bad_state"] += 1
            return
        d = psn_diff(psn, qp.epsn)
        if d > 0:
            if not qp.nak_sent:
                qp.nak_sent = True
                self._send_ack(qp, qp.epsn, wire.SYN_NAK_SEQ)
            qp.stats["rx_out_of_order"] += 1
            return
        if d < 0:
            qp.stats["rx_duplicate"] += 1
            self._send_ack(qp, (qp.epsn - 1) & PSN_MASK, wire.SYN_ACK)
            return
        n = len(payload)
        first = op in (wire.OP_WRITE_FIRST, wire.OP_WRITE_ONLY, wire.OP_SEND_FIRST, wire.OP_SEND_ONLY)
        last = op in (wire.OP_WRITE_LAST, wire.OP_WRITE_ONLY, wire.OP_SEND_LAST, wire.OP_SEND_ONLY)
        if npkts == 0 or n > npkts * hsi.MTU or (not last and n != npkts * hsi.MTU) or (n and n <= (npkts - 1) * hsi.MTU):
            return self._nak(qp, psn, wire.SYN_NAK_INV, res_reason=2)
        if op in (wire.OP_WRITE_FIRST, wire.OP_WRITE_MIDDLE, wire.OP_WRITE_LAST, wire.OP_WRITE_ONLY):
            if first:
                if not qp.access & hsi.ACCESS_REMOTE_WRITE:
                    return self._nak(qp, psn, wire.SYN_NAK_INV, res_reason=6)
                mr = None
                if dma_len:
                    mr = self._mr_check(rkey, va, dma_len, hsi.ACCESS_REMOTE_WRITE)
                    if mr is None:
                        return self._nak(qp, psn, wire.SYN_NAK_ACC, res_reason=7)
                qp.resp_ctx = ["write", mr, va, dma_len]
            ctx = qp.resp_ctx
            if ctx is None or ctx[0] != "write" or n > ctx[3] or (last and n != ctx[3]):
                return self._nak(qp, psn, wire.SYN_NAK_INV, res_reason=2)
            if n and not isinstance(payload, _Placed):
                self._mr_write(ctx[1], ctx[2], payload)
            ctx[2] += n
            ctx[3] -= n
            if last:
                qp.resp_ctx = None
        elif op in (wire.OP_SEND_FIRST, wire.OP_SEND_MIDDLE, wire.OP_SEND_LAST, wire.OP_SEND_ONLY):
            if first:
                if qp.rq_cons >= qp.rq_prod:
                    qp.stats["rnr_nak"] += 1
                    return self._send_ack(qp, psn, wire.SYN_RNR | (qp.min_rnr_timer & 0x1f))
                slot = qp.rq_cons % qp.rq_size
                raw = self.mem.read(self._queue_addr(qp.rq_pages, slot * hsi.WQE_STRIDE), hsi.RQ_WQE.size).tobytes()
                typ, _fl, _ws, sva, lkey, ssize = hsi.RQ_WQE.unpack(raw)
                mr = self._mr_check(lkey, sva, ssize, hsi.ACCESS_LOCAL_WRITE) if ssize else None
                if typ != hsi.WQE_RECV or (ssize and mr is None):
                    self._res_cqe(qp, 0, 3)
                    qp.rq_cons += 1
                    return self._nak(qp, psn, wire.SYN_NAK_OP, res_reason=3)
                qp.resp_ctx = ["send", mr, sva, ssize, 0]
            ctx = qp.resp_ctx
            if ctx is None or ctx[0] != "send":
                return self._nak(qp, psn, wire.SYN_NAK_INV, res_reason=2)
            if n > ctx[3]:
                self._res_cqe(qp, ctx[4] + n, 2)
                qp.rq_cons += 1
                qp.resp_ctx = None
                return self._nak(qp, psn, wire.SYN_NAK_INV, res_reason=2)
            if n and not isinstance(payload, _Placed):  # never placed: _place takes WRITEs only
                self._mr_write(ctx[1], ctx[2], payload)
            ctx[2] += n
            ctx[3] -= n
            ctx[4] += n
            if last:
                qp.rq_cons += 1
                qp.resp_ctx = None
                self._res_cqe(qp, ctx[4], 0)
        else:
            return self._nak(qp, psn, wire.SYN_NAK_INV, res_reason=4)
        qp.epsn = (qp.epsn + npkts) & PSN_MASK
        qp.nak_sent = False
        if flags & wire.F_ACK_REQ:
            self._send_ack(qp, (qp.epsn - 1) & PSN_MASK, wire.SYN_ACK)

    def _nak(self, qp: Qp, psn: int, syndrome: int, res_reason: int) -> None:
        self._send_ack(qp, psn, syndrome)
        self._qp_error(qp, notify=True, res_reason=res_reason)

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


class _Placed:
    """A payload the wire already received into host memory (see SoftNic._place)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


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


def _rnr_delay(code: int) -> float:
    """IB min_rnr_timer encoding (0 = 655.36 ms, 1 = 0.01 ms, ... 31 = 491.52 ms), a short subset."""
    table = {0: 655.36, 1: 0.01, 2: 0.02, 3: 0.03, 4: 0.04, 5: 0.06, 6: 0.08, 7: 0.12, 8: 0.16, 9: 0.24, 10: 0.32,
             11: 0.48, 12: 0.64, 13: 0.96, 14: 1.28, 15: 1.92, 16: 2.56, 17: 3.84, 18: 5.12, 19: 7.68, 20: 10.24}
    return table.get(code, 15.36) / 1000


def _gid_from_kernel(raw: bytes) -> bytes:
    """Kernel order (byte-reversed big-endian dwords) back to the raw 16-byte GID."""
    return b"".join(raw[i:i + 4][::-1] for i in range(12, -1, -4))
