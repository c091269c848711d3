"""BnxtDevice: the hardened driver. PCI device -> HWRM mailbox -> RCFW -> rings/doorbells -> CQ/QP/MR.

    async with BnxtDevice.open(pci, DriverConfig(...)) as dev:
        scq, rcq = await dev.create_cq(), await dev.create_cq()
        qp = await dev.create_qp(scq, rcq)
        mr = await dev.register_mr(1 << 20)
        ...

Every object created is a ledger entry with its undo. `close()` (and any failure during `open`)
destroys them in reverse order, then resets the function and unregisters, and frees host pages
only after that reset succeeded (else quarantines them). Failures of close are collected into a
TeardownError raised after every step was tried.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import numpy as np

from tinydist.base.logs import get_logger
from tinydist.transports.rdma_bnxt import hsi
from tinydist.transports.rdma_bnxt.errors import (CompletionError, CQOverflow, CqeProtocolViolation, FirmwareError, Flushed, LinkDown,
                                         LocalQpOperation, ProtocolViolation, QpFatal, RdmaError, RetryExceeded, TeardownError,
                                         Timeout, completion_error)
from tinydist.transports.rdma_bnxt.hwrm import Mailbox
from tinydist.transports.rdma_bnxt.ledger import PAGES, Entry, ResourceLedger
from tinydist.transports.rdma_bnxt.rcfw import Rcfw
from tinydist.transports.rdma_bnxt.wait import poll

PTE_VALID, PTE_LAST, PTE_NEXT_TO_LAST = 1, 2, 4
VA_BASE = 0x7f00_0000_0000
_E = TypeVar("_E", bound=RdmaError)


@dataclasses.dataclass
class DriverConfig:
    hwrm_timeout: float | None = None      # default: the firmware's def_req_timeout (capped by max_req_timeout)
    hwrm_reset_timeout: float = 40.0
    hwrm_valid_timeout: float = 0.01
    rcfw_timeout: float = 20.0
    busy_retries: int = 5
    cq_entries: int = 1024
    sq_entries: int = 1024
    rq_entries: int = 1024
    qp_timeout: int = 14                   # ACK timeout 4.096 us * 2^14 = 67 ms
    retry_cnt: int = 7
    rnr_retry: int = 7
    drain_timeout: float = 0.5


class BnxtDevice:
    def __init__(self, pci: Any, cfg: DriverConfig | None = None) -> None:
        self.pci = pci
        self.cfg = cfg or DriverConfig()
        self.log = get_logger(nic=getattr(pci, "name", "bnxt"))
        self.ledger = ResourceLedger()
        self.state = "new"
        self.qps: dict[int, Qp] = {}
        self.cqs: dict[int, Cq] = {}
        self.rcfw: Rcfw | None = None
        self.reset_ok = False
        self._va = itertools.count(VA_BASE, 1 << 32)
        self.steps: list[str] = []
        self._collecting: list[Entry] | None = None

    # ---- life cycle ---------------------------------------------------------------------------

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, pci: Any, cfg: DriverConfig | None = None) -> AsyncIterator[BnxtDevice]:
        dev = await cls.create(pci, cfg)
        try:
            yield dev
        finally:
            await dev.close()

    @classmethod
    async def create(cls, pci: Any, cfg: DriverConfig | None = None) -> BnxtDevice:
        dev = cls(pci, cfg)
        try:
            await dev._init()
        except BaseException as exc:
            try:
                await dev.close()
            except TeardownError as td:
                exc.add_note(f"teardown after the failed open also failed: {td}")
            raise
        return dev

    async def _init(self) -> None:
        self.state = "opening"
        self.steps.append("pci_reset")
        self.pci.reset()
        self.bar0, self.bar2 = self.pci.map_bar(0), self.pci.map_bar(2)
        self.hwrm = Mailbox(self)
        ver = await self._hwrm("ver_get", hwrm_intf_maj=1, hwrm_intf_min=10)
        if ver["max_resp_len"]:
            self.hwrm.max_resp_len = min(hsi.PAGE, ver["max_resp_len"])
        if ver["max_req_timeout"]:
            self.hwrm.max_timeout = ver["max_req_timeout"] / 1000
        if self.cfg.hwrm_timeout is None and ver["def_req_timeout"]:
            self.hwrm.default_timeout = ver["def_req_timeout"] / 1000
        await self._hwrm("func_reset", timeout=self.cfg.hwrm_reset_timeout)
        caps = await self._hwrm("func_qcaps", fid=0xffff)
        self.mac, self.port_id = caps["mac_address"], caps["port_id"]
        await self._hwrm("func_drv_rgtr", os_type=0xffff)
        self.ledger.push("drv_rgtr", None, self._unregister)
        qcfg = await self._hwrm("func_qcfg", fid=0xffff)
        self.db_off = qcfg["legacy_l2_db_size_kb"] * 1024
        await self._backing_store()
        # RCFW channel: CREQ (an NQ ring), CMDQ, stats context, initialize_fw
        self.creq_page = self.alloc_pages(hsi.PAGE, "creq")
        creq_id = await self._ring_alloc(hsi.RING_NQ, self.creq_page[1], hsi.CREQ_ENTRIES, logical_id=0, int_mode=2)
        self.ring_db(creq_id, hsi.DB_NQ_ARM, 0, 0)
        self.rcfw = Rcfw(self, creq_id)
        self.rcfw.init_cmdq()
        _stats, stats_pa = self.alloc_pages(hsi.PAGE, "stats")
        st = await self._hwrm("stat_ctx_alloc", stats_dma_addr=stats_pa, update_period_ms=1000, stats_dma_length=176)
        sid = st["stat_ctx_id"]
        self.ledger.push("stat_ctx", sid, lambda: self._hwrm("stat_ctx_free", stat_ctx_id=sid))
        await self._rcfw("initialize_fw", stat_ctx_id=sid, flags=1)
        self.ledger.push("rcfw_init", None, lambda: self._rcfw("deinitialize_fw"))
        # second NQ ("never armed or serviced, but CQ and L2 ring allocation require one")
        nq_page = self.alloc_pages(hsi.PAGE, "nq")
        self.nq_id = await self._ring_alloc(hsi.RING_NQ, nq_page[1], 16, logical_id=1, int_mode=2)
        # the L2 receive path RoCE ingress needs
        cmpl_id = await self._ring_alloc(hsi.RING_L2_CMPL, self.alloc_pages(hsi.PAGE, "l2_cmpl")[1], 64)
        rx_id = await self._ring_alloc(hsi.RING_RX, self.alloc_pages(hsi.PAGE, "rx")[1], 64, rx_buf_size=640, cmpl_ring_id=cmpl_id)
        vnic = (await self._hwrm("vnic_alloc"))["vnic_id"]
        self.ledger.push("vnic", vnic, lambda: self._hwrm("vnic_free", vnic_id=vnic))
        await self._hwrm("vnic_cfg", vnic_id=vnic, dflt_rx_ring_id=rx_id, dflt_cmpl_ring_id=cmpl_id, mru=9018)
        flt = (await self._hwrm("cfa_l2_filter_alloc", flags=1, l2_addr=self.mac, l2_addr_mask=b"\xff" * 6, dst_id=vnic))["l2_filter_id"]
        self.ledger.push("l2_filter", flt, lambda: self._hwrm("cfa_l2_filter_free", l2_filter_id=flt))
        # GID ::ffff:10.m3.m4.m5, sent in the kernel's byte order (byte-reversed big-endian dwords)
        self.gid = bytes(10) + b"\xff\xff" + bytes([10]) + self.mac[3:6]
        gid_index, _ = await self._rcfw("add_gid", gid=self.gid[::-1], src_mac=self.mac, vlan=0xffff)
        self.ledger.push("gid", gid_index, lambda: self._rcfw("delete_gid", gid_index=gid_index))
        self.state = "open"
        self.log.debug("rdma.open", steps=len(self.steps), gid=self.gid.hex(), mac=self.mac.hex())

    async def _backing_store(self) -> None:
        qp_entries = 0
        last = len(hsi.BS_TYPES) - 1
        for i, (typ, extra) in enumerate(hsi.BS_TYPES):
            caps = await self._hwrm("func_backing_store_qcaps_v2", type=typ)
            entry_size = caps["entry_size"]
            if not 0 < entry_size <= hsi.PAGE:
                raise ProtocolViolation("HWRM", "func_backing_store_qcaps_v2", "entry_size_out_of_bounds", str(entry_size))
            n = max(caps["min_num_entries"], caps["split_entry_0"] + extra)
            if typ == 0xf:
                n = qp_entries
            if typ == 0:
                qp_entries = n
            if not 0 < n <= caps["max_num_entries"] or n * entry_size > 64 << 20:
                raise ProtocolViolation("HWRM", "func_backing_store_qcaps_v2", "num_entries_out_of_bounds", str(n))
            arr, paddrs, _ = self.alloc_paged(n * entry_size, "backing_store")
            if caps["ctx_init_value"]:
                arr.reshape(-1)[:n * entry_size].reshape(n, entry_size)[:, caps["ctx_init_offset"] * 4 % entry_size] = caps["ctx_init_value"]
            level, page_dir = self.build_pbl(paddrs, queue=False)
            await self._hwrm("func_backing_store_cfg_v2", type=typ, instance=0, flags=hsi.BS_ALL_DONE if i == last else 0,
                             page_dir=page_dir, num_entries=n, entry_size=entry_size, page_size_pbl_level=level)

    async def _ring_alloc(self, ring_type: int, page_pa: int, length: int, **kw: Any) -> int:
        out = await self._hwrm("ring_alloc", ring_type=ring_type, page_tbl_addr=page_pa, page_tbl_depth=0, page_size=12,
                               length=length, enables=0, **kw)
        rid = out["ring_id"]
        self.ledger.push("ring", rid, lambda: self._hwrm("ring_free", ring_type=ring_type, ring_id=rid))
        return rid

    async def _hwrm(self, name: str, timeout: float | None = None, **fields: Any) -> dict[str, Any]:
        self.steps.append(name)
        return await self.hwrm.send(name, timeout=timeout, **fields)

    async def _rcfw(self, name: str, **fields: Any) -> tuple[int, tuple]:
        self.steps.append(name)
        if self.rcfw is None:
            raise RdmaError(f"RCFW {name} before the channel exists")
        return await self.rcfw.command(name, **fields)

    async def _unregister(self) -> None:
        """Stop device DMA (func_reset) and unregister; pages are freed only if this succeeded."""
        await self._hwrm("func_reset", timeout=self.cfg.hwrm_reset_timeout)
        await self._hwrm("func_drv_unrgtr", flags=0)
        self.reset_ok = True

    async def close(self) -> None:
        """Tear down everything in reverse order (idempotent); TeardownError lists what failed."""
        if self.state == "closed":
            return
        self.state = "closing"
        errors: list[BaseException] = []
        stalled = self.rcfw is not None and self.rcfw.stalled
        for qp in list(self.qps.values()):
            qp.closed = True
        for entry in self.ledger.firmware_entries():
            if stalled and entry.kind in ("qp", "cq", "mr", "gid", "rcfw_init"):
                self.ledger.forget(entry)          # the firmware is gone; func_reset frees these
                continue
            try:
                await self.ledger.release(entry)
            except RdmaError as exc:
                errors.append(exc)
                self.ledger.forget(entry)
                if isinstance(exc, Timeout) and exc.phase == "RCFW":
                    stalled = True
        if not self.reset_ok and self.ledger.created["drv_rgtr"] == 0 and getattr(self, "hwrm", None) is not None:
            with contextlib.suppress(RdmaError):   # opened far enough to talk to firmware: stop its DMA anyway
                await self._hwrm("func_reset", timeout=self.cfg.hwrm_reset_timeout)
                self.reset_ok = True
            if self.reset_ok:                      # a registration whose answer was lost may still have happened
                with contextlib.suppress(RdmaError):
                    await self._hwrm("func_drv_unrgtr", flags=0)
        if self.reset_ok or not hasattr(self, "hwrm"):
            for entry in self.ledger.page_entries():
                try:
                    await self.ledger.release(entry)
                except Exception as exc:  # noqa: BLE001 - every failure is reported in the TeardownError
                    errors.append(exc)
                    self.ledger.forget(entry)
            quarantined = 0
        else:
            quarantined = self.ledger.quarantine()
            self.log.warning("rdma.quarantine", pages=quarantined, reason="function reset failed; device may still DMA")
        self.qps.clear()
        self.cqs.clear()
        self.state = "closed"
        if errors or quarantined:
            raise TeardownError(errors, quarantined)

    # ---- memory, PBLs, doorbells --------------------------------------------------------------

    def alloc_pages(self, size: int, what: str) -> tuple[np.ndarray, int]:
        """Host pages for the device; returns (view of `size` bytes, paddr of the first page) and records them."""
        arr, paddrs = self.pci.alloc_sysmem(size)
        entry = self.ledger.push(PAGES, paddrs, lambda: self.pci.free_sysmem(paddrs))
        if self._collecting is not None:
            self._collecting.append(entry)
        return arr[:size], paddrs[0]

    def alloc_paged(self, size: int, what: str) -> tuple[np.ndarray, list[int], Entry]:
        arr, paddrs = self.pci.alloc_sysmem(size)
        entry = self.ledger.push(PAGES, paddrs, lambda: self.pci.free_sysmem(paddrs))
        if self._collecting is not None:
            self._collecting.append(entry)
        return arr[:size], paddrs, entry

    @contextlib.contextmanager
    def _pages_of(self) -> Any:
        """Collect the page entries allocated in the block (an object's rings and PBLs), to free with the object."""
        prev, self._collecting = self._collecting, []
        try:
            yield self._collecting
        finally:
            self._collecting = prev

    async def _free_pages(self, entries: list[Entry]) -> None:
        """The firmware object using these pages is destroyed, so the device no longer DMAs into them."""
        for e in reversed(entries):
            await self.ledger.release(e)

    def build_pbl(self, paddrs: list[int], queue: bool) -> tuple[int, int]:
        """(level, base): level 0 for one page, 1 up to 512 pages, 2 beyond. PBL pages go to the ledger."""
        if len(paddrs) == 1:
            return 0, paddrs[0]
        def table(addrs: list[int], mark: bool) -> int:
            arr, pa = self.alloc_pages(hsi.PAGE, "pbl")
            ptes = np.array(addrs, np.uint64) | np.uint64(PTE_VALID)
            if mark:
                ptes[-1] |= np.uint64(PTE_LAST)
                if len(ptes) > 1:
                    ptes[-2] |= np.uint64(PTE_NEXT_TO_LAST)
            arr[:len(ptes) * 8] = ptes.view(np.uint8)
            return pa
        if len(paddrs) <= 512:
            return 1, table(paddrs, queue)
        if len(paddrs) > 512 * 512:
            raise ValueError(f"{len(paddrs)} pages exceed a level-2 PBL")
        return 2, table([table(paddrs[i:i + 512], False) for i in range(0, len(paddrs), 512)], False)

    def ring_db(self, xid: int, db_type: int, index: int, epoch: int) -> None:
        self.bar2.write64(self.db_off, hsi.db_value(xid, db_type, index, epoch))

    def service(self) -> None:
        """Drain the CREQ (async events); every waiter calls this."""
        if self.rcfw is not None:
            self.rcfw.drain()

    def on_qp_error(self, qpn: int, req_err: int, res_err: int) -> None:
        qp = self.qps.get(qpn)
        if qp is not None:
            qp.set_error(QpFatal(qpn, req_reason=req_err, res_reason=res_err))

    def on_cq_error(self, cq_id: int) -> None:
        cq = self.cqs.get(cq_id)
        if cq is None:
            return
        cq.overflowed = True
        for qp in self.qps.values():
            if qp.scq is cq or qp.rcq is cq:
                qp.set_error(CQOverflow(qp.qpn, cq=cq_id), strong=True)

    async def port_up(self) -> bool:
        return (await self._hwrm("port_phy_qcfg", port_id=self.port_id))["link"] != 0

    # ---- CQ / QP / MR -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.state != "open":
            raise RdmaError(f"device is {self.state}")

    async def create_cq(self, entries: int | None = None) -> Cq:
        self._check_open()
        n = entries or self.cfg.cq_entries
        with self._pages_of() as pages:
            arr, paddrs, _ = self.alloc_paged(n * hsi.CQE_STRIDE, "cq")
            level, pbl = self.build_pbl(paddrs, queue=True)
        handle = next(self._va)
        cid, _ = await self._rcfw("create_cq", cq_handle=handle, cq_size=n, cq_fco_cnq_id=self.nq_id, pg_size_lvl=level, pbl=pbl)
        cq = Cq(self, cid, n, arr)
        cq.pages = pages
        cq.entry = self.ledger.push("cq", cid, lambda: self._destroy_cq(cq))
        self.cqs[cid] = cq
        return cq

    async def _destroy_cq(self, cq: Cq) -> None:
        self.cqs.pop(cq.id, None)
        await self._rcfw("destroy_cq", cq_cid=cq.id)
        await self._free_pages(cq.pages)

    async def create_qp(self, scq: Cq, rcq: Cq, sq_entries: int | None = None, rq_entries: int | None = None,
                        access: int = hsi.ACCESS_LOCAL_WRITE | hsi.ACCESS_REMOTE_WRITE) -> Qp:
        self._check_open()
        sqn, rqn = sq_entries or self.cfg.sq_entries, rq_entries or self.cfg.rq_entries
        with self._pages_of() as pages:
            sq, sq_paddrs, _ = self.alloc_paged(sqn * (hsi.WQE_STRIDE + hsi.MSN_STRIDE), "sq")
            rq, rq_paddrs, _ = self.alloc_paged(rqn * hsi.WQE_STRIDE, "rq")
            sq_lvl, sq_pbl = self.build_pbl(sq_paddrs, queue=True)
            rq_lvl, rq_pbl = self.build_pbl(rq_paddrs, queue=True)
        handle = next(self._va)
        qpn, _ = await self._rcfw("create_qp", qp_handle=handle, type=2, access=access, sq_size=sqn, rq_size=rqn,
                                  sq_fwo_sq_sge=6, rq_fwo_rq_sge=6, scq_cid=scq.id, rcq_cid=rcq.id, sq_pbl=sq_pbl,
                                  rq_pbl=rq_pbl, sq_pg_size_lvl=sq_lvl, rq_pg_size_lvl=rq_lvl)
        qp = Qp(self, qpn, handle, scq, rcq, sq, sqn, rq, rqn, access)
        qp.pages = pages
        qp.entry = self.ledger.push("qp", qpn, lambda: self._destroy_qp(qp))
        self.qps[qpn] = qp
        await qp.modify(hsi.QPS_INIT, hsi.MASK_INIT, access=access, pkey=0xffff)
        return qp

    async def _destroy_qp(self, qp: Qp) -> None:
        qp.closed = True
        if qp.state not in (hsi.QPS_ERR, hsi.QPS_RESET):
            with contextlib.suppress(CompletionError, FirmwareError):
                await qp.modify(hsi.QPS_ERR, hsi.M_STATE)
            await poll(self.pci, lambda: qp.drained(), self.cfg.drain_timeout)
        self.qps.pop(qp.qpn, None)
        await self._rcfw("destroy_qp", qp_cid=qp.qpn)
        await self._free_pages(qp.pages)

    async def destroy_qp(self, qp: Qp) -> None:
        await self.ledger.release(qp.entry)

    async def destroy_cq(self, cq: Cq) -> None:
        await self.ledger.release(cq.entry)

    async def register_mr(self, size: int, access: int = hsi.ACCESS_LOCAL_WRITE | hsi.ACCESS_REMOTE_WRITE) -> Mr:
        self._check_open()
        with self._pages_of() as pages:
            arr, paddrs, _ = self.alloc_paged(size, "mr")
            level, pbl = self.build_pbl(paddrs, queue=False)
        va = next(self._va)
        key, _ = await self._rcfw("register_mr", log2_pg_size_lvl=12 << 2 | level, access=access, pbl=pbl, va=va, mr_size=size)
        mr = Mr(va, size, key, arr)
        mr.pages = pages

        async def undo() -> None:
            await self._rcfw("deregister_mr", lkey=key)
            await self._free_pages(pages)
        mr.entry = self.ledger.push("mr", key, undo)
        return mr

    async def deregister_mr(self, mr: Mr) -> None:
        await self.ledger.release(mr.entry)


@dataclasses.dataclass(eq=False)
class Mr:
    va: int
    size: int
    key: int
    buf: np.ndarray
    entry: Any = None
    pages: Any = None

    @property
    def lkey(self) -> int:
        return self.key

    @property
    def rkey(self) -> int:
        return self.key


class Cq:
    def __init__(self, dev: BnxtDevice, cid: int, size: int, buf: np.ndarray) -> None:
        self.dev, self.id, self.size, self.buf = dev, cid, size, buf
        self.cons = 0
        self.overflowed = False
        self.entry: Any = None
        self.pages: list[Entry] = []

    def drain(self, limit: int | None = None) -> list[tuple[int, int, bytes]]:
        """Ready CQEs as (type, status, raw 32 bytes); acknowledges them with one CQ doorbell."""
        out = []
        n = self.size
        for _ in range(limit or n):
            off = (self.cons % n) * hsi.CQE_STRIDE
            tt = int(self.buf[off + 24])
            if (tt & 1) == ((self.cons // n) & 1):
                break
            out.append(((tt >> 1) & 0xf, int(self.buf[off + 25]), bytes(self.buf[off:off + hsi.CQE_STRIDE])))
            self.cons += 1
        if out:
            self.dev.ring_db(self.id, hsi.DB_CQ, self.cons % n, (self.cons // n) & 1)
        return out


class Qp:
    """Driver-side RC queue pair: post WRITE/SEND/RECV with ring-full checks, poll with status checks."""

    def __init__(self, dev: BnxtDevice, qpn: int, handle: int, scq: Cq, rcq: Cq, sq: np.ndarray, sq_size: int,
                 rq: np.ndarray, rq_size: int, access: int) -> None:
        self.dev, self.qpn, self.handle, self.scq, self.rcq = dev, qpn, handle, scq, rcq
        self.sq, self.sq_size, self.rq, self.rq_size, self.access = sq, sq_size, rq, rq_size, access
        self.msn = sq[sq_size * hsi.WQE_STRIDE:].view("<u8")
        self.state = hsi.QPS_RESET
        self.sq_prod = self.sq_cons = self.rq_prod = self.rq_cons = 0
        self.psn = 0
        self.error: CompletionError | None = None
        self.error_reported = False
        self.closed = False
        self.recvs: list[tuple[int, int]] = []      # (rq index, length) completed, not yet taken
        self.progress = 0                           # bumped whenever poll() consumed something
        self.entry: Any = None
        self.pages: list[Entry] = []
        self.peer: Any = None

    # state machine -----------------------------------------------------------------------------
    async def modify(self, state: int, mask: int, **fields: Any) -> None:
        await self.dev._rcfw("modify_qp", modify_mask=mask, qp_cid=self.qpn, state=state, **fields)
        self.state = state

    async def connect(self, dest_qpn: int, dgid: bytes, dest_mac: bytes, rq_psn: int = 0, sq_psn: int = 0) -> None:
        """INIT -> RTR -> RTS with tinygrad's masks (plus our PSNs)."""
        cfg = self.dev.cfg
        await self.modify(hsi.QPS_RTR | (2 << 6), hsi.MASK_RTR, access=self.access, pkey=0xffff, dgid=dgid, sgid_index=0,
                          hop_limit=64, dest_mac=dest_mac, path_mtu=hsi.PATH_MTU_4096, rq_psn=rq_psn, min_rnr_timer=1,
                          max_dest_rd_atomic=4, dest_qp_id=dest_qpn)
        self.state = hsi.QPS_RTR
        await self.modify(hsi.QPS_RTS, hsi.MASK_RTS, access=self.access, timeout=cfg.qp_timeout, retry_cnt=cfg.retry_cnt,
                          rnr_retry=cfg.rnr_retry, sq_psn=sq_psn, max_rd_atomic=4)
        self.psn = sq_psn

    def set_error(self, err: CompletionError, strong: bool = False) -> None:
        weak = (QpFatal, Flushed)
        if self.error is None or (isinstance(self.error, weak) and not isinstance(err, weak)) or \
                (strong and not isinstance(self.error, CQOverflow)):
            self.error = err
        self.state = hsi.QPS_ERR

    def _raise_error(self) -> None:
        err = self.error
        if err is None:
            return
        if self.error_reported:
            raise Flushed(f"QP is in ERR after {type(err).__name__}; work requests are flushed", qpn=self.qpn,
                          status=0xb, status_name="WR_FLUSH") from err
        self.error_reported = True
        raise err

    # posting -----------------------------------------------------------------------------------
    def sq_free(self) -> int:
        return self.sq_size - (self.sq_prod - self.sq_cons)

    def _post_sq(self, typ: int, mr: Mr, offset: int, length: int, remote_va: int = 0, rkey: int = 0) -> int:
        if self.error is not None:
            self._raise_error()
        if self.state != hsi.QPS_RTS or self.closed:
            raise LocalQpOperation(f"post on a QP in state {self.state} (needs RTS)", qpn=self.qpn, status=3)
        if self.sq_free() <= 0:
            raise LocalQpOperation("send queue full (poll completions first)", qpn=self.qpn, status=3)
        if offset < 0 or length < 0 or offset + length > mr.size:
            raise ValueError(f"[{offset}, {offset + length}) is outside the MR of {mr.size} bytes")
        i = self.sq_prod
        slot = i % self.sq_size
        base = slot * hsi.WQE_STRIDE
        hsi.SQ_WQE.pack_into(self.sq.data, base, typ, hsi.WQE_SIGNAL, 3, 0, length, remote_va, rkey, mr.va + offset, mr.lkey, length)
        npk = hsi.packets(length)
        self.msn[slot] = hsi.msn_entry(slot, self.psn, (self.psn + npk) & 0xffffff)
        self.psn = (self.psn + npk) & 0xffffff
        self.sq_prod += 1
        self.dev.ring_db(self.qpn, hsi.DB_SQ, self.sq_prod % self.sq_size, (self.sq_prod // self.sq_size) & 1)
        return i

    def post_write(self, mr: Mr, offset: int, length: int, remote_va: int, rkey: int) -> int:
        return self._post_sq(hsi.WQE_WRITE, mr, offset, length, remote_va, rkey)

    def post_send(self, mr: Mr, offset: int, length: int) -> int:
        return self._post_sq(hsi.WQE_SEND, mr, offset, length)

    def post_recv(self, mr: Mr, offset: int, length: int) -> int:
        if self.error is not None:
            self._raise_error()
        if self.state not in (hsi.QPS_INIT, hsi.QPS_RTR, hsi.QPS_RTS):
            raise LocalQpOperation(f"post_recv on a QP in state {self.state}", qpn=self.qpn, status=3)
        if self.rq_prod - self.rq_cons >= self.rq_size:
            raise LocalQpOperation("receive queue full", qpn=self.qpn, status=3)
        if offset < 0 or length < 0 or offset + length > mr.size:
            raise ValueError(f"[{offset}, {offset + length}) is outside the MR of {mr.size} bytes")
        i = self.rq_prod
        hsi.RQ_WQE.pack_into(self.rq.data, (i % self.rq_size) * hsi.WQE_STRIDE, hsi.WQE_RECV, 0, 3, mr.va + offset, mr.lkey, length)
        self.rq_prod += 1
        self.dev.ring_db(self.qpn, hsi.DB_RQ, self.rq_prod % self.rq_size, (self.rq_prod // self.rq_size) & 1)
        return i

    # completions -------------------------------------------------------------------------------
    def poll(self) -> bool:
        """Consume this QP's CQEs (status checked on each), then the CREQ. True if anything moved."""
        moved = False
        for typ, status, raw in self.scq.drain():
            moved = True
            qp_handle, cons_idx = hsi.CQE_REQ.unpack_from(raw, 0)
            if typ != hsi.CQE_TYPE_REQ or qp_handle != self.handle:
                self.set_error(CqeProtocolViolation(f"unexpected CQE type {typ} / handle 0x{qp_handle:x} on the send CQ",
                                                   qpn=self.qpn, status=status))
                continue
            if cons_idx != self.sq_cons % self.sq_size:
                self.set_error(CqeProtocolViolation(f"send CQE for slot {cons_idx}, expected {self.sq_cons % self.sq_size}",
                                                   qpn=self.qpn, status=status))
                continue
            if status != 0:
                self.set_error(completion_error("REQ", status, self.qpn, self.sq_cons))
            self.sq_cons += 1
        for typ, status, raw in self.rcq.drain():
            moved = True
            length, _imm, qp_handle, _mr = hsi.CQE_RES.unpack_from(raw, 0)
            if typ != hsi.CQE_TYPE_RES_RC or qp_handle != self.handle:
                self.set_error(CqeProtocolViolation(f"unexpected CQE type {typ} on the receive CQ", qpn=self.qpn, status=status))
                continue
            if status != 0:
                self.set_error(completion_error("RES", status, self.qpn, self.rq_cons))
            else:
                self.recvs.append((self.rq_cons, length))
            self.rq_cons += 1
        before = self.error
        self.dev.service()
        moved = moved or self.error is not before
        if moved:
            self.progress += 1
        return moved

    def drained(self) -> bool:
        self.poll()
        return self.sq_cons >= self.sq_prod and self.rq_cons >= self.rq_prod

    async def wait(self, timeout: float) -> bool:
        """Wait (bounded) until this QP's completions or error state move, whoever consumed them; True if they did."""
        start = self.progress

        def moved() -> bool:
            self.poll()
            return self.progress != start or self.error is not None
        return bool(await poll(self.dev.pci, moved, timeout))

    async def _until(self, what: str, done: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            if done():
                return
            if self.error is not None:
                await self.classify()
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout("CQ_POLL", f"{what} on QP {self.qpn}", timeout, qpn=self.qpn)
            await poll(self.dev.pci, lambda: (self.poll(), done() or self.error is not None)[1], left)

    async def wait_send(self, index: int, timeout: float = 10.0) -> None:
        """Wait for the send WQE `index` to complete; raises its classified error (or the QP's, if it failed first)."""
        def done() -> bool:
            err = self.error
            if err is not None and not (err.side == "REQ" and 0 <= index < err.wqe_index):
                return False
            return self.sq_cons > index
        await self._until(f"send WQE {index}", done, timeout)

    async def wait_recv(self, timeout: float = 10.0) -> tuple[int, int]:
        """The next completed receive (rq index, length); raises the QP's classified error."""
        await self._until("receive", lambda: bool(self.recvs), timeout)
        return self.recvs.pop(0)

    async def refine(self, err: _E) -> _E | LinkDown:
        """The most precise class for a QP error: exhausted retries while the port is down is LinkDown."""
        if isinstance(err, RetryExceeded):
            with contextlib.suppress(RdmaError):
                if not await self.dev.port_up():
                    link = LinkDown("port is down (retries exhausted while the link was lost)", qpn=self.qpn,
                                    status=err.status, status_name=err.status_name, wqe_index=err.wqe_index)
                    link.__cause__ = err
                    if self.error is err:
                        self.error = link
                    return link
        return err

    async def classify(self) -> None:
        """Raise the QP's error (refined, see `refine`), then Flushed for later work."""
        if self.error is not None and not self.error_reported:
            await self.refine(self.error)  # a refined error replaces self.error there
        self._raise_error()
