"""RCFW channel: CMDQ (16-byte slots, producer at BAR0+0x60c, trigger at +0x700) and CREQ (16-byte entries).

- Each command gets a 15-bit cookie (never 0); its CREQ answer is matched by cookie, so async
  events (QP_ERROR_NOTIFICATION 0xc0, CQ_ERROR_NOTIFICATION 0xc1) that arrive first are dispatched,
  not mistaken for the answer. An unknown cookie or entry type is counted as a protocol violation
  and logged; it is never raised into an unrelated caller.
- CMDQ space is accounted (slots of commands in flight); bit 31 goes on the first producer write only.
- The CREQ is drained by whoever waits (a command, or a CQ waiter), so errors surface without a
  background task; after consuming entries the driver rings NQ_ARM with its consumer index.
- A timeout marks the channel stalled: later commands fail fast and close() takes the reset path.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from tinydist.transports.rdma_bnxt import hsi
from tinydist.transports.rdma_bnxt.errors import FirmwareError, Timeout
from tinydist.transports.rdma_bnxt.wait import poll


class Rcfw:
    def __init__(self, dev: Any, creq_id: int) -> None:
        self.dev = dev
        self.creq_id = creq_id
        self.cmdq, self.cmdq_pa = dev.alloc_pages(hsi.PAGE, "cmdq")
        self.creq, self.creq_pa = dev.creq_page
        self.write_idx = 0
        self.read_idx = 0
        self.first = True
        self.in_flight: dict[int, tuple[asyncio.Future, int, str]] = {}   # cookie -> (future, slots, name)
        self.slots_used = 0
        self.cookies = itertools.cycle(range(1, 0x8000))
        self.stalled = False
        self.violations = 0
        self.events = 0

    def init_cmdq(self) -> None:
        self.dev.bar0.write(hsi.CMDQ_INIT_OFF, hsi.CMDQ_INIT.pack(self.cmdq_pa, hsi.CMDQ_ENTRIES << 2 | 0, self.creq_id, 0))

    async def command(self, name: str, wait_s: float | None = None, **fields: Any) -> tuple[int, tuple]:
        """Send one command; returns (xid, raw CREQ entry). FirmwareError on status != 0; Timeout when unanswered."""
        budget = wait_s if wait_s is not None else self.dev.cfg.rcfw_timeout
        if self.stalled:
            raise Timeout("RCFW", name, 0.0, fast_fail=True, note="firmware stalled on an earlier command")
        opcode, layout = hsi.RCFW[name]
        cmd = layout.pack(**fields)
        nslots = len(cmd) // 16
        if not await poll(self.dev.pci, lambda: self.slots_used + nslots <= hsi.CMDQ_ENTRIES, budget):
            raise Timeout("RCFW", name, budget, note="no CMDQ space")
        cookie = next(self.cookies)
        hsi.CMDQ_BASE.pack_into(cmd, 0, opcode, nslots, 0, cookie, 0, 0)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self.in_flight[cookie] = (fut, nslots, name)
        self.slots_used += nslots
        for i in range(nslots):
            slot = (self.write_idx + i) % hsi.CMDQ_ENTRIES
            self.cmdq[slot * 16:slot * 16 + 16] = memoryview(cmd)[i * 16:i * 16 + 16]
        self.write_idx += nslots
        prod = (self.write_idx & 0xffff) | (hsi.FIRMWARE_FIRST_FLAG if self.first else 0)
        self.first = False
        self.dev.bar0.write(hsi.CMDQ_PROD_OFF, prod.to_bytes(4, "little"))
        self.dev.bar0.write(hsi.RCFW_TRIGGER_OFF, (1).to_bytes(4, "little"))

        def answered() -> bool:
            self.drain()
            return fut.done()

        if not await poll(self.dev.pci, answered, budget):
            self.in_flight.pop(cookie, None)
            self.stalled = True
            raise Timeout("RCFW", name, budget)
        entry = fut.result()
        status, xid = entry[1], entry[3]
        if status != 0:
            raise FirmwareError("RCFW", name, status, xid=xid)
        return xid, entry

    def drain(self) -> int:
        """Consume every ready CREQ entry (bounded by the ring size); returns how many."""
        n = hsi.CREQ_ENTRIES
        consumed = 0
        for _ in range(n):
            off = (self.read_idx % n) * 16
            entry = hsi.CREQ.unpack_from(self.creq, off)
            if (entry[4] & 1) == ((self.read_idx // n) & 1):
                break
            self.read_idx += 1
            consumed += 1
            self._dispatch(entry)
        if consumed:
            self.dev.ring_db(self.creq_id, hsi.DB_NQ_ARM, self.read_idx % n, (self.read_idx // n) & 1)
        return consumed

    def _dispatch(self, entry: tuple) -> None:
        typ, status, cookie, xid, _v, event, req_err, res_err, sq_cons, rq_cons = entry
        typ &= 0x3f
        if typ == hsi.CREQ_QP_EVENT and event == hsi.EV_QP_ERROR:
            self.events += 1
            self.dev.on_qp_error(xid, req_err, res_err)
        elif typ == hsi.CREQ_QP_EVENT and event == hsi.EV_CQ_ERROR:
            self.events += 1
            self.dev.on_cq_error(xid)
        elif typ == hsi.CREQ_QP_EVENT:
            pending = self.in_flight.pop(cookie, None)
            if pending is None or hsi.RCFW[pending[2]][0] != event:
                self.violations += 1
                self.dev.log.warning("rdma.rcfw.unmatched", cookie=cookie, creq_event=event, status=status)
                if pending is not None:
                    self.in_flight[cookie] = pending
                return
            fut, nslots, _name = pending
            self.slots_used -= nslots
            if not fut.done():
                fut.set_result(entry)
        elif typ == hsi.CREQ_FUNC_EVENT:
            self.events += 1
            self.dev.log.info("rdma.rcfw.func_event", creq_event=event, status=status)
        else:
            self.violations += 1
            self.dev.log.warning("rdma.rcfw.unknown_entry", creq_type=typ, creq_event=event)
