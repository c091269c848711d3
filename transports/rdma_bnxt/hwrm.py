"""HWRM mailbox: one request in flight, every firmware-controlled field checked before use.

1. Under the lock: seq += 1, build the request (cmpl_ring 0xffff, target 0xffff, resp_addr = the
   response page), refuse one longer than the firmware's window, zero the page, write the words,
   then the trigger.
2. Poll (wait.poll) until the header shows resp_len != 0. A header whose seq_id is not ours is a
   ProtocolViolation (the page was zeroed, so it cannot be a stale answer); so is a req_type that
   is not the one sent, and a resp_len outside [8, min(page, ver_get.max_resp_len)].
3. Short wait for the valid byte at resp_len-1: 0 -> Timeout(HWRM_VALID), other than 1 -> violation.
4. Copy page[:resp_len] once, parse from the copy (a short response is a violation, except for
   ver_get whose later fields are optional), clear the valid byte.
5. error_code != 0 -> FirmwareError; BUSY/RESOURCE_LOCKED retried at most `busy_retries` times.
After a timeout the page is retired (a late DMA must not land in a page we reuse) and a fresh one used.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tinydist.transports.rdma_bnxt import hsi
from tinydist.transports.rdma_bnxt.errors import FirmwareError, ProtocolViolation, Timeout
from tinydist.transports.rdma_bnxt.wait import poll


class Mailbox:
    def __init__(self, dev: Any) -> None:
        self.dev = dev
        self.lock = asyncio.Lock()
        self.seq = 0
        self.max_resp_len = hsi.PAGE
        self.max_req_len = hsi.HWRM_MAX_REQ_LEN
        self.default_timeout = dev.cfg.hwrm_timeout or 10.0
        self.max_timeout = 40.0
        self.page, self.page_pa = dev.alloc_pages(hsi.PAGE, "hwrm_resp")
        self.stats = {"requests": 0, "short": 0, "busy_retries": 0}

    def budget(self, timeout: float | None) -> float:
        return min(timeout if timeout is not None else self.default_timeout, self.max_timeout)

    async def send(self, name: str, timeout: float | None = None, **fields: Any) -> dict[str, Any]:
        attempt = 0
        while True:
            try:
                return await self._send_once(name, timeout, fields)
            except FirmwareError as exc:
                if exc.code not in (0x10, 0x11) or attempt >= self.dev.cfg.busy_retries:
                    raise
            self.stats["busy_retries"] += 1
            await asyncio.sleep(min(0.001 * 2 ** attempt, 0.05))
            attempt += 1

    async def _send_once(self, name: str, timeout: float | None, fields: dict[str, Any]) -> dict[str, Any]:
        req_type, in_layout, out_layout = hsi.HWRM[name]
        budget = self.budget(timeout)
        async with self.lock:
            self.seq = seq = (self.seq + 1) & 0xffff
            req = in_layout.pack(**fields)
            hsi.REQ_HDR.pack_into(req, 0, req_type, 0xffff, seq, 0xffff, self.page_pa)
            if len(req) > self.max_req_len:
                raise ValueError(f"HWRM {name} request of {len(req)} bytes exceeds the window of {self.max_req_len}")
            page = self.page
            page[:] = 0
            bar0 = self.dev.bar0
            bar0.write(hsi.HWRM_REQ_OFF, bytes(req.ljust(-(-len(req) // 4) * 4, b"\0")))
            bar0.write(hsi.HWRM_TRIGGER_OFF, (1).to_bytes(4, "little"))
            self.stats["requests"] += 1

            def header() -> tuple | None:
                hdr = hsi.RESP_HDR.unpack_from(page, 0)
                return hdr if hdr[3] != 0 else None

            hdr = await poll(self.dev.pci, header, budget)
            if hdr is None:
                self._retire_page()
                raise Timeout("HWRM", name, budget, note=f"response header {hsi.RESP_HDR.unpack_from(page, 0)}")
            code, rtype, rseq, resp_len = hdr
            limit = min(hsi.PAGE, self.max_resp_len)
            if rseq != seq:
                raise ProtocolViolation("HWRM", name, "seq_mismatch", f"sent seq {seq}, response says {rseq}")
            if not 8 <= resp_len <= limit:
                raise ProtocolViolation("HWRM", name, "resp_len_out_of_bounds", f"resp_len {resp_len} not in [8, {limit}]")
            if rtype != req_type:
                raise ProtocolViolation("HWRM", name, "req_type_mismatch", f"sent 0x{req_type:x}, response says 0x{rtype:x}")
            valid = await poll(self.dev.pci, lambda: int(page[resp_len - 1]) or None, self.dev.cfg.hwrm_valid_timeout)
            if valid is None:
                self._retire_page()
                raise Timeout("HWRM_VALID", name, self.dev.cfg.hwrm_valid_timeout, note=f"resp_len {resp_len}")
            if valid != hsi.HWRM_RESP_VALID_KEY:
                raise ProtocolViolation("HWRM", name, "bad_valid_byte", f"valid byte {valid}")
            body = bytes(page[:resp_len])
            page[resp_len - 1] = 0
        if code != 0:
            raise FirmwareError("HWRM", name, code)
        out = out_layout.unpack(body)
        if out["_short"]:
            self.stats["short"] += 1
            if name != "ver_get":
                raise ProtocolViolation("HWRM", name, "resp_len_short", f"resp_len {resp_len} < {out_layout.size}")
        return out

    def _retire_page(self) -> None:
        """A timed-out request may still be answered by DMA: keep that page pinned, use a new one."""
        self.page, self.page_pa = self.dev.alloc_pages(hsi.PAGE, "hwrm_resp")
