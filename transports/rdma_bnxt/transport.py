"""RDMA links: the tinydist `Link` interface over a BNXT queue pair (real NIC or the softbnxt model).

    link = await open_link(sock, rank, peer, on_failure=...)   # RDMA if both sides have a NIC, else TcpLink
    await link.send(buf); async with link.recv() as view: ...; await link.close()

Data path (per direction, NCCL-like): the receiver exposes a registered byte ring of `RING_BYTES`
that the sender RDMA-WRITEs into. A message of up to `INLINE` bytes rides inside one SEND. A larger
one that fits the ring is one WRITE (copied first into the sender's registered staging ring at the
same offset; a piece never wraps, the tail is skipped) followed by a small notice SEND (offset,
bytes, skip); RC ordering makes the notice arrive after the data. The receiver delivers it as a view
of its ring (zero copy) and returns a cumulative credit (a SEND) when the block ends, releases may
come in any order. A message larger than the ring goes in `CHUNK_BYTES` pieces, copied out and
credited at once. Every completion's status is checked (an interrupt handler polls the QP; a watchdog
task classifies errors); any error fails the link with the classified RDMA error in the reason.

The TCP socket the rendezvous made stays as the control channel: the QP handshake, BYE/ABORT, and
peer-death detection (EOF), exactly as `tinydist.transports.tcp.SocketLink` does.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import socket
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import numpy as np

from tinydist.base.config import settings
from tinydist.base.logs import get_logger
from tinydist.transports.base import FailureCallback, Link, TransportError, as_bytes
from tinydist.transports.rdma_bnxt.device import BnxtDevice, DriverConfig, Mr, Qp
from tinydist.transports.rdma_bnxt.errors import NicUnavailable, RdmaError
from tinydist.transports.rdma_bnxt.pci import SoftPciDevice, find_pci_nic
from tinydist.transports.rdma_bnxt.softbnxt import FaultPlan, PhysMem, SoftNic
from tinydist.transports.rdma_bnxt.wait import poll
from tinydist.transports.tcp import SocketLink, TcpLink, recv_exactly

RING_BYTES = 8 << 20                      # the receive ring each side exposes to its peer's RDMA WRITEs
CHUNK_BYTES = 2 << 20                     # pieces of a message larger than the ring
CTRL_BYTES = 4096
NOTICE = struct.Struct("<BBHIIIQ")        # kind, flags, pad, skip, offset, nbytes, total (credit: cumulative bytes)
INLINE = CTRL_BYTES - NOTICE.size
RQ_DEPTH = 128
SQ_DEPTH = 512
K_INLINE, K_DATA, K_CREDIT = 1, 2, 3
F_FIRST = 1


class RdmaNic:
    """One NIC as the transport uses it: the device (driver) plus, for the model, its SoftNic and wire port."""

    def __init__(self, dev: BnxtDevice, soft: SoftNic | None, address: tuple[str, int] | None) -> None:
        self.dev, self.soft, self.address = dev, soft, address
        self.kind = "soft" if soft is not None else "hw"

    @classmethod
    async def open_soft(cls, name: str = "softbnxt0", plan: FaultPlan | None = None, cfg: DriverConfig | None = None,
                        mem: PhysMem | None = None) -> RdmaNic:
        nic = SoftNic(name, plan=plan, mem=mem)
        address = await nic.start()
        try:
            dev = await BnxtDevice.create(SoftPciDevice(nic), cfg)
        except BaseException:
            await nic.stop()
            raise
        return cls(dev, nic, address)

    async def wire_address(self, local_ip: str) -> tuple[str, int] | None:
        """Where a peer dials the model's wire: on the interface our control socket to it uses (`local_ip`),
        so a peer on another host (network namespace) can reach it; None for a real NIC (no wire)."""
        if self.soft is None:
            return None
        return await self.soft.wire.listen(local_ip)

    async def dial(self, gid: bytes, address: list | tuple | None) -> None:
        if self.soft is not None and address is not None:
            try:
                await self.soft.wire.dial(gid, (address[0], int(address[1])))
            except (OSError, asyncio.TimeoutError) as exc:
                raise TransportError(f"cannot reach the peer's RDMA wire (softbnxt model) at {address[0]}:{address[1]}: "
                                     f"{exc!r}; is the peer on a network this host reaches?") from exc

    async def close(self) -> None:
        try:
            await self.dev.close()
        finally:
            if self.soft is not None:
                await self.soft.stop()


_process_nic: RdmaNic | None = None
_process_lock: asyncio.Lock | None = None


async def process_nic() -> RdmaNic:
    """This process's NIC per TINYDIST_RDMA_NIC, opened once; NicUnavailable says why there is none."""
    global _process_nic, _process_lock
    mode = settings.RDMA_NIC
    if mode == "off":
        raise NicUnavailable("TINYDIST_RDMA_NIC=off")
    if _process_lock is None:
        _process_lock = asyncio.Lock()
    async with _process_lock:
        if _process_nic is None:
            if mode in ("auto", "hw"):
                find_pci_nic()                     # raises NicUnavailable naming why (no VFIO back end here)
            _process_nic = await RdmaNic.open_soft()
        return _process_nic


def nic_available() -> tuple[bool, str]:
    """Whether this process can have an RDMA NIC (without opening it), and why not; for transport lists
    such as the scheduler's `transports=("mem", "shm", "tcp", "rdma_bnxt")`."""
    mode = settings.RDMA_NIC
    if mode == "off":
        return False, "TINYDIST_RDMA_NIC=off"
    if mode == "soft":
        return True, "software NIC model (TINYDIST_RDMA_NIC=soft)"
    try:
        find_pci_nic()
    except NicUnavailable as exc:
        return False, str(exc)
    return True, "BNXT NIC"  # pragma: no cover - needs hardware


async def close_process_nic() -> None:
    global _process_nic
    nic, _process_nic = _process_nic, None
    if nic is not None:
        await nic.close()


async def _send_json(sock: socket.socket, obj: dict[str, Any]) -> None:
    blob = json.dumps(obj).encode()
    await asyncio.get_running_loop().sock_sendall(sock, struct.pack("<I", len(blob)) + blob)


async def _recv_json(sock: socket.socket) -> dict[str, Any]:
    head = bytearray(4)
    if not await recv_exactly(sock, memoryview(head)):
        raise TransportError("peer closed during the RDMA handshake")
    (n,) = struct.unpack("<I", head)
    if n > 65536:
        raise TransportError(f"RDMA handshake blob of {n} bytes")
    body = bytearray(n)
    if n and not await recv_exactly(sock, memoryview(body)):
        raise TransportError("peer closed during the RDMA handshake")
    try:
        return json.loads(body)
    except ValueError as exc:   # not JSON, or not UTF-8: the peer speaks another protocol or version
        raise TransportError(f"RDMA handshake blob of {n} bytes is not JSON ({exc}); is the peer a tinydist rank "
                             "of the same version?") from exc


async def open_link(sock: socket.socket, rank: int, peer: int, job: str = "", on_failure: FailureCallback | None = None,
                    timeout: float = 30.0, nic: RdmaNic | None = None) -> Link:
    """An RDMA link when both sides have a NIC (real or modelled); otherwise a TcpLink, with the reason logged.

    Both sides call this on the connected control socket (rank order does not matter).
    """
    log = get_logger(rank=rank, peer=peer)
    sock.setblocking(False)
    reason = ""
    if nic is None:
        try:
            nic = await process_nic()
        except NicUnavailable as exc:
            reason = str(exc)
    with anyio.fail_after(timeout):
        await _send_json(sock, {"rdma": nic is not None, "reason": reason})
        theirs = await _recv_json(sock)
    if nic is None or not theirs.get("rdma"):
        why = f"rank {rank}: {reason}" if nic is None else f"rank {peer}: {theirs.get('reason') or 'no NIC'}"
        log.info("rdma.fallback", transport="tcp", reason=why)
        link = TcpLink(sock, peer, on_failure)
        link.fallback_reason = why  # type: ignore[attr-defined]
        return link
    return await RdmaLink.handshake(sock, rank, peer, nic, on_failure, timeout)


class RdmaLink(SocketLink):
    kind = "rdma_bnxt"          # the name scheduler.probe / scheduler.topology use

    def __init__(self, sock: socket.socket, peer: int, nic: RdmaNic, on_failure: FailureCallback | None = None) -> None:
        super().__init__(sock, peer, on_failure)
        self.nic = nic
        self.dev = nic.dev
        self.qp: Qp | None = None
        self.mrs: list[Mr] = []
        self.cqs: list = []
        self.tx_head = 0                  # bytes of the peer's ring used (monotonic, skips included)
        self.tx_credit = 0                # bytes of it the peer gave back
        self.rx_head = 0                  # the same counters for our ring
        self.rx_tail = 0
        self.released: dict[int, int] = {}    # start -> end of regions consumed out of order
        self.freed = anyio.Event()
        self.progress = anyio.Event()
        self.message_lock = anyio.Lock()
        self.assembling: tuple[np.ndarray, int] | None = None
        self.rdma_error: RdmaError | None = None
        self.peer_in: tuple[int, int] = (0, 0)
        self.stats: collections.Counter[str] = collections.Counter()

    # ---- set-up -------------------------------------------------------------------------------

    @classmethod
    async def handshake(cls, sock: socket.socket, rank: int, peer: int, nic: RdmaNic, on_failure: FailureCallback | None,
                        timeout: float) -> RdmaLink:
        link = cls(sock, peer, nic, on_failure)
        try:
            with anyio.fail_after(timeout):
                await link._setup()
                qp = link._live_qp()
                dev = nic.dev
                psn = (rank * 0x10001 + peer * 0x101) & 0xffffff
                wire = await nic.wire_address(sock.getsockname()[0])
                await _send_json(sock, {"gid": dev.gid.hex(), "mac": dev.mac.hex(), "qpn": qp.qpn, "psn": psn,
                                        "wire": list(wire) if wire else None,
                                        "in_va": link.data_in.va, "in_rkey": link.data_in.rkey})
                info = await _recv_json(sock)
                gid, mac = bytes.fromhex(info["gid"]), bytes.fromhex(info["mac"])
                await nic.dial(gid, info["wire"])
                link.peer_in = (int(info["in_va"]), int(info["in_rkey"]))
                await qp.connect(int(info["qpn"]), gid, mac, rq_psn=int(info["psn"]), sq_psn=psn)
                await _send_json(sock, {"ready": True})      # both QPs are in RTS before anyone sends
                if not (await _recv_json(sock)).get("ready"):
                    raise TransportError(f"rank {peer} did not finish the RDMA handshake")
        except BaseException:
            with anyio.CancelScope(shield=True):
                await link._teardown()
            raise
        return link

    async def _setup(self) -> None:
        dev = self.dev
        scq, rcq = await dev.create_cq(SQ_DEPTH), await dev.create_cq(RQ_DEPTH)
        self.cqs = [scq, rcq]
        self.qp = await dev.create_qp(scq, rcq, SQ_DEPTH, RQ_DEPTH)
        self.data_out = await self._mr(RING_BYTES)
        self.data_in = await self._mr(RING_BYTES)
        self.ctrl_out = await self._mr(SQ_DEPTH * CTRL_BYTES)
        self.ctrl_in = await self._mr(RQ_DEPTH * CTRL_BYTES)
        for i in range(RQ_DEPTH):
            self.qp.post_recv(self.ctrl_in, i * CTRL_BYTES, CTRL_BYTES)

    def _live_qp(self) -> Qp:
        """The link's queue pair: made by _setup, gone after close."""
        if self.qp is None:
            raise TransportError(f"RDMA link to rank {self.peer} has no queue pair: it is not set up, or closed")
        return self.qp

    async def _mr(self, size: int) -> Mr:
        mr = await self.dev.register_mr(size)
        self.mrs.append(mr)
        return mr

    async def _teardown(self) -> None:
        """Destroy this link's QP, CQs and MRs (the device stays open for other links)."""
        errors = []
        if self.qp is not None:
            with contextlib.suppress(RdmaError):
                await self.dev.destroy_qp(self.qp)
            self.qp = None
        for mr in reversed(self.mrs):
            try:
                await self.dev.deregister_mr(mr)
            except RdmaError as exc:
                errors.append(exc)
        for cq in reversed(self.cqs):
            try:
                await self.dev.destroy_cq(cq)
            except RdmaError as exc:
                errors.append(exc)
        self.mrs, self.cqs = [], []
        if errors:
            get_logger(peer=self.peer).warning("rdma.link_teardown", errors=[str(e) for e in errors])

    # ---- sending ------------------------------------------------------------------------------

    async def _sq_space(self, need: int) -> None:
        qp = self.qp
        while qp is not None and qp.sq_free() < need:
            self._check()
            self._pump()
            if qp.sq_free() >= need or qp.error is not None:
                break
            def pumped() -> bool:  # pump once; then whether the slots are free (or the QP failed)
                self._pump()
                return qp.sq_free() >= need or qp.error is not None
            await poll(self.dev.pci, pumped, 0.05)

    def _post_notice(self, kind: int, flags: int = 0, skip: int = 0, offset: int = 0, nbytes: int = 0, total: int = 0,
                     payload: Any = None) -> None:
        qp = self._live_qp()
        entry = (qp.sq_prod % qp.sq_size) * CTRL_BYTES
        buf = self.ctrl_out.buf
        NOTICE.pack_into(buf.data, entry, kind, flags, 0, skip, offset, nbytes, total)
        n = NOTICE.size
        if payload is not None and len(payload):
            buf[entry + n:entry + n + len(payload)] = np.frombuffer(payload, np.uint8)
            n += len(payload)
        qp.post_send(self.ctrl_out, entry, n)

    async def _ring_space(self, n: int) -> tuple[int, int]:
        """(offset, skip) for n contiguous bytes of the peer's ring, waiting (bounded by the owner) for credits."""
        while True:
            pos = self.tx_head % RING_BYTES
            skip = RING_BYTES - pos if pos + n > RING_BYTES else 0
            if RING_BYTES - (self.tx_head - self.tx_credit) >= skip + n:
                return (pos + skip) % RING_BYTES, skip
            self._check()
            self._pump()
            if RING_BYTES - (self.tx_head - self.tx_credit) >= skip + n:
                continue
            with anyio.move_on_after(0.05):
                await self.freed.wait()
            self.freed = anyio.Event()

    async def send(self, data: Any) -> None:
        self._check()
        view = as_bytes(data)
        n = len(view)
        try:
            async with self.message_lock:
                if n <= INLINE:
                    await self._sq_space(1)
                    self._check()
                    self._post_notice(K_INLINE, nbytes=n, total=n, payload=view)
                    return
                src = np.frombuffer(view, np.uint8)
                peer_va, peer_rkey = self.peer_in
                step = n if n <= RING_BYTES else CHUNK_BYTES
                for off in range(0, n, step):
                    piece = src[off:off + step]
                    k = len(piece)
                    offset, skip = await self._ring_space(k)
                    await self._sq_space(2)
                    self._check()
                    self.data_out.buf[offset:offset + k] = piece
                    self._live_qp().post_write(self.data_out, offset, k, peer_va + offset, peer_rkey)
                    self._post_notice(K_DATA, F_FIRST if off == 0 else 0, skip, offset, k, n)
                    self.tx_head += skip + k
                self.stats["bytes_sent"] += n
        except RdmaError as exc:
            await self._fail_rdma(exc)
            self._check()
            raise

    # ---- receiving ----------------------------------------------------------------------------

    def _pump(self) -> None:
        """Poll the QP (status checked on every CQE) and handle arrived notices; no awaiting."""
        qp = self.qp
        if qp is None:
            return
        qp.poll()
        if qp.error is not None:
            return
        while qp.recvs:
            index, length = qp.recvs.pop(0)
            self._on_notice(index, length)

    def _on_notice(self, index: int, length: int) -> None:
        qp = self._live_qp()
        entry = (index % RQ_DEPTH) * CTRL_BYTES
        buf = self.ctrl_in.buf
        if length < NOTICE.size:
            raise TransportError(f"notice of {length} bytes from rank {self.peer}")
        kind, flags, _pad, skip, offset, nbytes, total = NOTICE.unpack_from(buf.data, entry)
        if kind == K_INLINE:
            if nbytes != length - NOTICE.size:
                raise TransportError(f"inline message of {nbytes} bytes in a {length}-byte notice")
            self.inbox.put(buf[entry + NOTICE.size:entry + NOTICE.size + nbytes].copy())
        elif kind == K_CREDIT:
            if not self.tx_credit <= total <= self.tx_head:
                raise TransportError(f"credit to byte {total} outside [{self.tx_credit}, {self.tx_head}]")
            self.tx_credit = total
            self.freed.set()
        elif kind == K_DATA:
            start = self.rx_head
            if offset + nbytes > RING_BYTES or (start + skip) % RING_BYTES != offset or skip >= RING_BYTES:
                raise TransportError(f"data at [{offset}, {offset + nbytes}) skip {skip} does not follow the ring from rank {self.peer}")
            self.rx_head += skip + nbytes
            region = (start, self.rx_head)
            if flags & F_FIRST and total == nbytes and self.assembling is None:
                self.inbox.put((offset, nbytes, region))
            else:
                if flags & F_FIRST:
                    if self.assembling is not None:
                        raise TransportError("a new message inside a message")
                    self.assembling = (np.empty(total, np.uint8), 0)
                if self.assembling is None:
                    raise TransportError("a chunk without a first chunk")
                out, got = self.assembling
                if got + nbytes > len(out):
                    raise TransportError(f"message overflows its announced {len(out)} bytes")
                out[got:got + nbytes] = self.data_in.buf[offset:offset + nbytes]
                self._give_back(region)
                got += nbytes
                self.assembling = None if got == len(out) else (out, got)
                if got == len(out):
                    self.inbox.put(out)
        else:
            raise TransportError(f"unknown notice kind {kind} from rank {self.peer}")
        qp.post_recv(self.ctrl_in, (index % RQ_DEPTH) * CTRL_BYTES, CTRL_BYTES)

    def _give_back(self, region: tuple[int, int]) -> None:
        """Give a consumed region of our ring back; credits are cumulative, so out-of-order releases wait."""
        start, end = region
        self.released[start] = end
        advanced = False
        while self.rx_tail in self.released:
            self.rx_tail = self.released.pop(self.rx_tail)
            advanced = True
        qp = self.qp
        if advanced and qp is not None and self.failure is None and not self.closing:
            if qp.sq_free() < 1:
                qp.poll()
            self._post_notice(K_CREDIT, total=self.rx_tail)

    def _poll_inbox(self) -> None:
        try:
            self._pump()
        except RdmaError as exc:
            self._rdma_fail(exc)

    @contextlib.asynccontextmanager
    async def _deliver(self, item: Any) -> AsyncIterator[memoryview]:
        if not isinstance(item, tuple):
            yield memoryview(item).toreadonly()
            return
        offset, nbytes, region = item
        view = self.data_in.buf[offset:offset + nbytes].data.toreadonly()
        try:
            yield view
        finally:
            view.release()
            if self.failure is None and not self.closing and self.qp is not None:
                try:
                    await self._sq_space(1)
                    self._give_back(region)
                except RdmaError as exc:
                    self._rdma_fail(exc)

    def _wake_all(self) -> None:
        super()._wake_all()
        self.freed.set()

    async def _fail_rdma(self, exc: RdmaError) -> None:
        """Fail the link with the QP's primary error (a Flushed names its cause), refined (LinkDown)."""
        qp = self.qp
        primary = exc if qp is None or qp.error is None else qp.error
        if qp is not None:
            primary = await qp.refine(primary)
        self._rdma_fail(primary)

    def _rdma_fail(self, exc: RdmaError) -> None:
        if self.rdma_error is None:
            self.rdma_error = exc
            get_logger(peer=self.peer).warning("rdma.link_failed", error=type(exc).__name__, detail=str(exc), hint=exc.hint)
        self._fail(f"RDMA {type(exc).__name__}: {exc} (hint: {exc.hint})")

    def _on_irq(self) -> None:
        """Interrupt handler: poll the QP at once (status checked), hand notices to waiters."""
        qp = self.qp
        if qp is None or self.failure is not None:
            return
        try:
            self._pump()
        except RdmaError as exc:
            self._rdma_fail(exc)
            return
        except TransportError as exc:
            self._fail(f"{type(exc).__name__}: {exc}")
            return
        if self.inbox.items:
            self.inbox.wake()
        self.freed.set()
        if qp.error is not None:
            self.progress.set()

    async def _completions(self) -> None:
        """Watchdog: polls when no interrupt comes (bounded sleeps), classifies and reports the first error."""
        qp = self.qp
        while qp is not None and self.failure is None:
            try:
                self._pump()
                if qp.error is not None:
                    await qp.classify()
                if self.inbox.items:
                    self.inbox.wake()
                self.freed.set()
                with anyio.move_on_after(0.1):
                    await self.progress.wait()
                self.progress = anyio.Event()
            except RdmaError as exc:
                if not self.closing:
                    await self._fail_rdma(exc)
                return
            except TransportError as exc:
                self._fail(f"{type(exc).__name__}: {exc}")
                return

    async def serve(self) -> None:
        add = getattr(self.dev.pci, "add_irq_handler", None)
        if add is not None:
            add(self._on_irq)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._completions)
                try:
                    await super().serve()
                finally:
                    tg.cancel_scope.cancel()
        finally:
            remove = getattr(self.dev.pci, "remove_irq_handler", None)
            if remove is not None:
                remove(self._on_irq)

    # ---- closing ------------------------------------------------------------------------------

    async def close(self, linger: float = 2.0, abort_blame: int | None = None, bye: int = 0) -> None:
        if self.sock.fileno() >= 0 and not self.closing and self.failure is None and self.qp is not None:
            deadline = time.monotonic() + linger           # our last messages are acknowledged before BYE
            with contextlib.suppress(RdmaError):
                while self.qp.sq_cons < self.qp.sq_prod and time.monotonic() < deadline and self.qp.error is None:
                    self._pump()
                    await self.qp.wait(0.05)
        await super().close(linger, abort_blame, bye)
        with anyio.CancelScope(shield=True):
            await self._teardown()
