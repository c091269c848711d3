"""softbnxt's firmware: the HWRM mailbox commands and the RCFW command queue (CMDQ in, CREQ out).

Request/response layouts, the seq/valid protocol and init ordering are the real ones (hsi.py); each
command is a `_hw_<name>` or `_rc_<name>` handler returning (status, body).
"""

from __future__ import annotations

import asyncio

import numpy as np

from tinydist.transports.rdma_bnxt import hsi
from tinydist.transports.rdma_bnxt.softbnxt.objects import PSN_MASK, Cq, Mr, Qp
from tinydist.transports.rdma_bnxt.softbnxt.physmem import PAGE, DmaFault
from tinydist.transports.rdma_bnxt.softbnxt.roce import RcDataPath


class Firmware(RcDataPath):
    """The HWRM and RCFW handlers: rings, contexts, VNICs and filters; GIDs, CQs, QPs and MRs."""

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


def _gid_from_kernel(raw: bytes) -> bytes:
    """Kernel order (byte-reversed big-endian dwords) back to the raw 16-byte GID."""
    return b"".join(raw[i:i + 4][::-1] for i in range(12, -1, -4))
