"""softbnxt's RC data path: memory-region checks, CQEs, the requester (SQ, retry and ACK timers) and the responder.

Go-back-N on PSNs, duplicate re-ACK, NAK-SEQ once, RNR with the IB timer table, REMOTE_WRITE / rkey /
lkey / bounds checks, LOC_LEN, CQ overflow (no CQE, QPs to ERR) and flush CQEs in ERR (see nic.py).
"""

from __future__ import annotations

import asyncio

import numpy as np

from tinydist.transports.rdma_bnxt import hsi
from tinydist.transports.rdma_bnxt.softbnxt import wire
from tinydist.transports.rdma_bnxt.softbnxt.objects import BURST, PSN_MASK, Cq, Mr, Qp, Wqe, psn_diff
from tinydist.transports.rdma_bnxt.softbnxt.physmem import PAGE, DmaFault
from tinydist.transports.rdma_bnxt.softbnxt.state import NicState


class RcDataPath(NicState):
    """The RC transport's requester and responder over the wire, on the QPs the firmware made."""

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


class _Placed:
    """A payload the wire already received into host memory (see RcDataPath._place)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n



def _rnr_delay(code: int) -> float:
    """IB min_rnr_timer encoding (0 = 655.36 ms, 1 = 0.01 ms, ... 31 = 491.52 ms), a short subset."""
    table = {0: 655.36, 1: 0.01, 2: 0.02, 3: 0.03, 4: 0.04, 5: 0.06, 6: 0.08, 7: 0.12, 8: 0.16, 9: 0.24, 10: 0.32,
             11: 0.48, 12: 0.64, 13: 0.96, 14: 1.28, 15: 1.92, 16: 2.56, 17: 3.84, 18: 5.12, 19: 7.68, 20: 10.24}
    return table.get(code, 15.36) / 1000

