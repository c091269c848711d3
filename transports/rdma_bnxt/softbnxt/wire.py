"""The wire between NIC models: our own frame format over loopback TCP (not RoCE framing).

A frame is `u32 length | header | payload`. The header is little-endian:

    magic 'SB' | ver u8 | opcode u8 (IB RC: SEND_F/M/L/ONLY 0/1/2/4, WRITE_F/M/L/ONLY 6/7/8/0xa, ACK 0x11)
    | dst_qpn u32 | psn u32 | npkts u16 | flags u16 (ACK_REQ) | dgid[16] | RETH va u64, rkey u32, dma_len u32
    | AETH syndrome<<24|msn u32 | payload length u32 | header crc32 u32

One frame carries `npkts` consecutive MTU packets of one message (PSNs psn..psn+npkts-1), so the
model does not pay Python costs per 4 KiB; PSN accounting, go-back-N and duplicate detection still
count packets. Each NIC listens on 127.0.0.1 (an ephemeral port), and on demand on the address a
link's control socket uses (`listen`: a peer in another network namespace cannot reach our
loopback), and dials each peer once: it transmits on the connection it dialed and receives on the
ones it accepted.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import zlib
from collections.abc import Callable

HDR = struct.Struct("<2sBBIIHH16sQIIII")
CRC = struct.Struct("<I")
HEADER_BYTES = HDR.size + CRC.size
LEN = struct.Struct("<I")
MAGIC, VERSION = b"SB", 1
MAX_FRAME = 64 << 20
OP_SEND_FIRST, OP_SEND_MIDDLE, OP_SEND_LAST, OP_SEND_ONLY = 0, 1, 2, 4
OP_WRITE_FIRST, OP_WRITE_MIDDLE, OP_WRITE_LAST, OP_WRITE_ONLY = 6, 7, 8, 0xa
OP_ACK = 0x11
F_ACK_REQ = 1
SYN_ACK, SYN_RNR, SYN_NAK_SEQ, SYN_NAK_INV, SYN_NAK_ACC, SYN_NAK_OP = 0x00, 0x20, 0x60, 0x61, 0x62, 0x63


def pack(opcode: int, dst_qpn: int, psn: int, npkts: int, flags: int, dgid: bytes, va: int = 0, rkey: int = 0,
         dma_len: int = 0, aeth: int = 0, paylen: int = 0) -> bytes:
    head = HDR.pack(MAGIC, VERSION, opcode, dst_qpn, psn & 0xffffff, npkts, flags, dgid, va, rkey, dma_len, aeth, paylen)
    return LEN.pack(HEADER_BYTES + paylen) + head + CRC.pack(zlib.crc32(head))


def unpack(frame: memoryview) -> tuple | None:
    """Header fields, or None for a frame the receiver must drop silently (bad magic, version, crc, length)."""
    if len(frame) < HEADER_BYTES:
        return None
    head = frame[:HDR.size]
    if CRC.unpack_from(frame, HDR.size)[0] != zlib.crc32(head):
        return None
    fields = HDR.unpack(head)
    if fields[0] != MAGIC or fields[1] != VERSION or fields[12] != len(frame) - HEADER_BYTES:
        return None
    return fields


def unpack_header(head: memoryview, paylen: int | None) -> tuple | None:
    """Header fields of a frame whose payload is elsewhere; `paylen` (if given) must match the header."""
    if len(head) < HEADER_BYTES:
        return None
    h = head[:HDR.size]
    if CRC.unpack_from(head, HDR.size)[0] != zlib.crc32(h):
        return None
    fields = HDR.unpack(h)
    if fields[0] != MAGIC or fields[1] != VERSION or (paylen is not None and fields[12] != paylen):
        return None
    return fields


class _FrameProtocol(asyncio.BufferedProtocol):
    """Inbound frames of one connection, parsed in the loop's read callback (no task hop per frame).

    Bytes are received into a ring buffer; a large WRITE frame whose destination the NIC resolves from
    its header (`place`) is received straight into host memory ("DMA"); a frame larger than the
    buffer gets its own buffer.
    """

    def __init__(self, wire: TcpWire) -> None:
        self.wire = wire
        self.buf = bytearray(wire.BUF)
        self.view = memoryview(self.buf)
        self.start = self.end = 0
        self.target: memoryview | None = None     # where the current large payload goes
        self.have = 0
        self.head: bytes | None = None            # header of a placed frame (None: target is a whole frame)
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.wire.inbound.add(transport)
        sock = transport.get_extra_info("socket")
        with contextlib.suppress(OSError, AttributeError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)

    def connection_lost(self, exc: Exception | None) -> None:
        self.wire.inbound.discard(self.transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.target is not None:
            return self.target[self.have:]
        if self.end == len(self.buf):
            self._compact()
        return self.view[self.end:]

    def _compact(self) -> None:
        n = self.end - self.start
        if self.start:
            self.buf[:n] = self.buf[self.start:self.end]
        self.start, self.end = 0, n

    def buffer_updated(self, nbytes: int) -> None:
        if self.target is not None:
            self.have += nbytes
            if self.have < len(self.target):
                return
            target, head, self.target, self.head = self.target, self.head, None, None
            if head is not None:
                self.wire.on_frame(memoryview(head), placed=True)
            else:
                self.wire.on_frame(target)
            return
        self.end += nbytes
        self._parse()

    def _parse(self) -> None:
        wire, view = self.wire, self.view
        while self.end - self.start >= LEN.size:
            (n,) = LEN.unpack_from(self.buf, self.start)
            if n > MAX_FRAME:
                if self.transport is not None:
                    self.transport.close()
                return
            total = LEN.size + n
            avail = self.end - self.start
            if avail >= total:
                wire.on_frame(view[self.start + LEN.size:self.start + total])
                self.start += total
                continue
            body = self.start + LEN.size
            if wire.place is not None and n >= wire.DIRECT and avail >= LEN.size + HEADER_BYTES:
                head = bytes(view[body:body + HEADER_BYTES])
                dest = wire.place(memoryview(head), n - HEADER_BYTES)
                if dest is not None:
                    self.target = memoryview(dest).cast("B")
                    self.have = avail - LEN.size - HEADER_BYTES
                    self.target[:self.have] = view[body + HEADER_BYTES:self.end]
                    self.head = head
                    self.start = self.end = 0
                    return
            if total > len(self.buf):
                big = bytearray(n)
                self.have = avail - LEN.size
                big[:self.have] = view[body:self.end]
                self.target, self.head = memoryview(big), None
                self.start = self.end = 0
                return
            if self.start + total > len(self.buf):
                self._compact()
            return
        if self.start == self.end:
            self.start = self.end = 0


class TcpWire:
    """One NIC's port: listeners for inbound frames (loopback, plus one per interface asked for) and
    one dialed connection per peer GID."""

    BUF = 4 << 20
    DIRECT = 64 * 1024             # frames with payloads at least this big may be received straight into host memory

    def __init__(self, on_frame: Callable[..., None], place: Callable | None = None) -> None:
        self.on_frame = on_frame
        self.place = place         # place(header, paylen) -> writable view for the payload, or None (then on_frame copies)
        self.servers: dict[str, asyncio.base_events.Server] = {}       # by the host they listen on
        self.peers: dict[bytes, asyncio.StreamWriter] = {}
        self.inbound: set = set()
        self.address: tuple[str, int] | None = None

    async def start(self) -> tuple[str, int]:
        self.address = await self.listen("127.0.0.1")
        return self.address

    async def listen(self, host: str) -> tuple[str, int]:
        """The (host, port) this port receives on at `host` (an interface address), listening there first
        if it does not yet. The caller passes an address its peer already reached it on (the link's
        control socket), so nothing is exposed that the job had not already exposed."""
        server = self.servers.get(host)
        if server is None:
            loop = asyncio.get_running_loop()
            server = self.servers[host] = await loop.create_server(lambda: _FrameProtocol(self), host, 0)
        return server.sockets[0].getsockname()[:2]

    async def dial(self, gid: bytes, address: tuple[str, int], timeout: float = 10.0) -> None:
        if gid in self.peers:
            return
        _, writer = await asyncio.wait_for(asyncio.open_connection(address[0], address[1]), timeout)
        sock = writer.get_extra_info("socket")
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        self.peers[gid] = writer

    def forget(self, gid: bytes) -> None:
        writer = self.peers.pop(gid, None)
        if writer is not None:
            writer.close()

    def send(self, gid: bytes, parts: list) -> bool:
        """Queue one frame to the peer owning `gid`; False when there is no connection (the frame is lost)."""
        writer = self.peers.get(gid)
        if writer is None or writer.is_closing():
            return False
        for part in parts:              # write() sends at once when it can; no join copy of the payload
            writer.write(part)
        return True

    async def close(self) -> None:
        writers = list(self.peers.values())
        for w in writers:
            w.close()
        self.peers.clear()
        for t in list(self.inbound):
            t.close()
        servers, self.servers = list(self.servers.values()), {}
        for server in servers:
            server.close()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(server.wait_closed(), 2)
        for w in writers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(w.wait_closed(), 1)
