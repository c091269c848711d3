"""TCP links: one stream socket per peer pair, length-prefixed frames, a background reader per link.

Frames are a 16-byte header `<B3xIQ` (kind, aux, nbytes) and, for DATA, `nbytes` of payload. The
sender writes straight from the caller's buffer and the reader reads straight into a buffer
(`loop.sock_recv_into`), so a message is copied only by the kernel. A message's buffer is valid
inside its `recv()` block only, so the link takes it back afterwards for the next message of its
size (`SPARE_BUFFERS`): a fresh buffer per chunk cost a page fault per 4 KiB received (a 2-rank
64 MiB ring: 14,022 minor faults a call) and the kernel's copy then ran at page-fault speed. Senders never wait for the
receiver, so every chunk a collective issues is in flight at once, bounded by the socket buffers.

`SocketLink` holds the framing, BYE/ABORT handling and EOF detection; `tinydist.transports.shm.ShmLink`
reuses it for its doorbells.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import struct
from collections.abc import AsyncIterator
from typing import Any

import anyio
import numpy as np

from tinydist.observability import tracing
from tinydist.transports.base import FailureCallback, Link, PeerFailed, TransportError, as_bytes

HEADER = struct.Struct("<B3xIQ")
DATA, BYE, ABORT = 1, 2, 3
SMALL = 64 * 1024            # payloads up to this size go out in one sendall with their header
MAX_MESSAGE = 1 << 40        # a header announcing more than this is a protocol violation
SOCKET_BUFFER = 4 << 20
SPARE_BUFFERS = 8            # received buffers a link keeps for reuse (a collective's chunks repeat one size)
SPARE_MIN = 64 * 1024        # smaller buffers come from the allocator's free lists without page faults


def tune_socket(sock: socket.socket) -> None:
    """Non-blocking, no Nagle delay, large buffers (the kernel may cap them)."""
    sock.setblocking(False)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)


async def recv_exactly(sock: socket.socket, view: memoryview) -> bool:
    """Fill `view` from `sock`; False on EOF before the first byte, TransportError on EOF midway."""
    loop = asyncio.get_running_loop()
    got, total = 0, len(view)
    while got < total:
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            if got == 0:
                return False
            raise ConnectionResetError(f"connection closed after {got} of {total} bytes")
        got += n
    return True


class Mailbox:
    """Received messages in arrival order, and the one task waiting for the next."""

    def __init__(self) -> None:
        self.items: collections.deque[Any] = collections.deque()
        self.event = anyio.Event()

    def put(self, item: Any) -> None:
        self.items.append(item)
        self.event.set()

    def wake(self) -> None:
        self.event.set()

    async def wait(self) -> None:
        if not self.items:
            await self.event.wait()
        if self.event.is_set():
            self.event = anyio.Event()


class SocketLink(Link):
    """A link framed over one connected stream socket (TCP, or a Unix socket in tests)."""

    kind = "tcp"

    def __init__(self, sock: socket.socket, peer: int, on_failure: FailureCallback | None = None) -> None:
        super().__init__(peer, on_failure)
        tune_socket(sock)
        self.sock = sock
        self.inbox = Mailbox()
        self.send_lock = anyio.Lock()
        self.done = anyio.Event()          # the reader has stopped
        self._serve_scope: anyio.CancelScope | None = None
        self.bytes_sent = 0
        self._spare: list[np.ndarray] = []   # delivered buffers, given out again to messages of their size

    # ---- sending ----------------------------------------------------------------------------

    async def _send_frame(self, kind: int, aux: int = 0, payload: memoryview | None = None) -> None:
        loop = asyncio.get_running_loop()
        n = 0 if payload is None else len(payload)
        head = HEADER.pack(kind, aux, n)
        async with self.send_lock:
            try:
                if payload is None or n == 0:
                    await loop.sock_sendall(self.sock, head)
                elif n <= SMALL:
                    await loop.sock_sendall(self.sock, head + bytes(payload))
                else:
                    await loop.sock_sendall(self.sock, head)
                    await loop.sock_sendall(self.sock, payload)
            except OSError as exc:
                self._fail(f"send failed: {exc.__class__.__name__}: {exc}")
                self._check()
                raise
        self.bytes_sent += n

    async def send(self, data: Any) -> None:
        self._check()
        if tracing.active_tracer() is None:
            return await self._send_frame(DATA, 0, as_bytes(data))
        view, started = as_bytes(data), tracing.clock()
        await self._send_frame(DATA, 0, view)
        self.traced("send", started, len(view))

    # ---- receiving --------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def recv(self) -> AsyncIterator[memoryview]:
        traced = tracing.active_tracer() is not None
        started = tracing.clock() if traced else 0
        while True:
            if not self.inbox.items and self.failure is None:
                self._poll_inbox()
            if self.inbox.items:
                item = self.inbox.items.popleft()
                break
            self._check()
            if self.peer_closed or self.done.is_set():
                raise PeerFailed(self.peer, "the peer closed the link")
            await self.inbox.wait()
        async with self._deliver(item) as view:
            if traced:
                self.traced("recv", started, len(view))   # waiting for the message, until it is in hand
            yield view

    def _poll_inbox(self) -> None:
        """Fill the inbox from a source the reader thread does not watch; a socket link has none."""

    @contextlib.asynccontextmanager
    async def _deliver(self, item: Any) -> AsyncIterator[memoryview]:
        yield memoryview(item).toreadonly()
        # the view is valid inside the block only, so the buffer may hold a later message
        if item.nbytes >= SPARE_MIN:
            if len(self._spare) >= SPARE_BUFFERS:
                self._spare.pop(0)
            self._spare.append(item)

    def _buffer(self, nbytes: int) -> np.ndarray:
        """A buffer for a message of `nbytes`: a spare one of that size, else a new one."""
        spare = self._spare
        for i in range(len(spare) - 1, -1, -1):
            if spare[i].nbytes == nbytes:
                return spare.pop(i)
        return np.empty(nbytes, np.uint8)

    def _wake_all(self) -> None:
        self.inbox.wake()

    async def _on_frame(self, kind: int, aux: int, nbytes: int) -> None:
        """Handle a frame kind this class does not know (subclasses extend this)."""
        raise TransportError(f"unknown frame kind {kind} from rank {self.peer}")

    async def serve(self) -> None:
        with anyio.CancelScope() as self._serve_scope:
            if self.sock.fileno() >= 0:
                await self._serve()
        self.done.set()

    async def _serve(self) -> None:
        head = bytearray(HEADER.size)
        try:
            while True:
                if not await recv_exactly(self.sock, memoryview(head)):
                    if not self.peer_closed:
                        self._fail("connection closed without BYE (process died?)")
                    return
                kind, aux, nbytes = HEADER.unpack(head)
                if nbytes > MAX_MESSAGE:
                    raise TransportError(f"frame of {nbytes} bytes from rank {self.peer} exceeds the limit")
                if kind == DATA:
                    buf = self._buffer(nbytes) if nbytes >= SPARE_MIN else np.empty(nbytes, np.uint8)
                    if nbytes and not await recv_exactly(self.sock, buf.data):
                        raise ConnectionResetError("connection closed inside a message")
                    self.inbox.put(buf)
                elif kind == BYE:
                    self.peer_closed, self.peer_bye = True, aux
                    self.inbox.wake()
                    if self.closing:
                        return
                elif kind == ABORT:
                    # an ABORT's aux: the blamed rank in the low 16 bits, the owner's code for what happened above
                    self._fail(f"rank {self.peer} reported rank {aux & 0xFFFF} failed", blamed=aux & 0xFFFF, code=aux >> 16)
                else:
                    await self._on_frame(kind, aux, nbytes)
        except (OSError, TransportError) as exc:
            if not (self.closing and self.peer_closed):
                self._fail(f"{exc.__class__.__name__}: {exc}")
        finally:
            self.done.set()
            self.inbox.wake()

    # ---- closing ----------------------------------------------------------------------------

    async def close(self, linger: float = 2.0, abort_blame: int | None = None, bye: int = 0) -> None:
        if self.sock.fileno() < 0:     # closed under us (tests simulate a dead process this way)
            self.closing = True
            if self._serve_scope is not None:
                self._serve_scope.cancel()
            self._release()
            return
        already = self.closing
        self.closing = True
        if not already and self.failure is None:
            with anyio.move_on_after(linger), contextlib.suppress(OSError, TransportError):
                await self._send_frame(ABORT if abort_blame is not None else BYE, bye if abort_blame is None else abort_blame)
        with anyio.move_on_after(linger):
            if not self.peer_closed and self.failure is None:
                await self.done.wait()
        self._wake_all()
        if self._serve_scope is not None:
            self._serve_scope.cancel()
            with anyio.move_on_after(linger):
                await self.done.wait()
        self._release()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def _release(self) -> None:
        """Free transport resources beyond the socket (subclasses)."""

    async def abort(self, blamed: int, code: int = 0) -> None:
        """Tell the peer that rank `blamed` failed, `code` saying how (the owner's; best effort, bounded)."""
        if self.failure is None and not self.closing and self.sock.fileno() >= 0:
            with anyio.move_on_after(1.0), contextlib.suppress(OSError, TransportError):
                await self._send_frame(ABORT, blamed | code << 16)


class TcpLink(SocketLink):
    kind = "tcp"


# ---- connection set-up used by tests and tinydist.dist ------------------------------------------

async def connected_pair() -> tuple[socket.socket, socket.socket]:
    """Two connected loopback TCP sockets (a listener on 127.0.0.1, an ephemeral port)."""
    loop = asyncio.get_running_loop()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.setblocking(False)
        client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        client.setblocking(False)
        with anyio.fail_after(10):
            accept = asyncio.ensure_future(loop.sock_accept(listener))
            await loop.sock_connect(client, listener.getsockname())
            server, _ = await accept
    finally:
        listener.close()
    return client, server
