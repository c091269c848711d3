"""Shared-memory links between processes on one host: payloads through mapped memory, doorbells on a socket.

Each direction of a link has its own segment, created by the sender: `SLOTS` slots of `SLOT_BYTES`.
Sending a message copies it into free slots and rings the peer with a 16-byte frame naming the slot
(`SLOT`); the peer's consumer reads the slot in place (`async with link.recv() as view` is a view of
the mapping: a reduction reads the peer's bytes directly) and gives it back with a `CREDIT` frame.
A message larger than one slot goes as `BEGIN` (its total size) and consecutive slots, which the
peer's reader copies into a fresh buffer and credits at once. Messages up to `INLINE` bytes ride in
the doorbell itself.

Nothing spins: every wait is an event set by the socket reader, so a waiting rank sleeps in the
event loop, and every wait is bounded by the owner's deadline. The socket also carries BYE/ABORT and
notices a dead peer (EOF), exactly as `tinydist.transports.tcp` does.

Segments never outlive the set-up: both sides unlink the name as soon as the peer has mapped it, so
nothing stays in /dev/shm after close, a crash, or a SIGKILL (only a process killed inside the few
milliseconds of the handshake could leave one; `tinydist launch` sweeps `/dev/shm/tinydist-<job>-*`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import mmap
import os
import secrets
import socket
import struct
from collections.abc import AsyncIterator
from typing import Any

import _posixshmem
import anyio
import numpy as np

from tinydist.observability import tracing
from tinydist.transports.base import FailureCallback, LinkClosed, TransportError, as_bytes
from tinydist.transports.tcp import DATA, HEADER, SocketLink, recv_exactly

SLOT, CREDIT, BEGIN = 10, 11, 12
SLOT_BYTES = 512 * 1024
SLOTS = 8
INLINE = 4096
PREFIX = "tinydist-"


def segment_name(job: str, src: int, dst: int) -> str:
    return f"/{PREFIX}{job}-{src}to{dst}-{secrets.token_hex(4)}"


def _unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        _posixshmem.shm_unlink(name)


def _create(name: str, size: int, reserve: bool = False) -> mmap.mmap:
    """Create and map `name`. With `reserve`, allocate every page now: a /dev/shm too small for it is
    an OSError here (ENOSPC) instead of a SIGBUS at the first touch of a page past its limit."""
    fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        if reserve:
            os.posix_fallocate(fd, 0, size)
        else:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    except BaseException:
        _unlink(name)
        raise
    finally:
        os.close(fd)


def _attach(name: str, size: int) -> mmap.mmap:
    fd = _posixshmem.shm_open(name, os.O_RDWR, 0o600)
    try:
        if os.fstat(fd).st_size != size:
            raise TransportError(f"shared memory {name} has {os.fstat(fd).st_size} bytes, expected {size}")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


async def _send_blob(sock: socket.socket, blob: bytes) -> None:
    await asyncio.get_running_loop().sock_sendall(sock, struct.pack("<I", len(blob)) + blob)


async def _recv_blob(sock: socket.socket) -> bytes:
    head = bytearray(4)
    if not await recv_exactly(sock, memoryview(head)):
        raise TransportError("peer closed during the shared-memory handshake")
    (n,) = struct.unpack("<I", head)
    if n > 4096:
        raise TransportError(f"handshake blob of {n} bytes")
    body = bytearray(n)
    if n and not await recv_exactly(sock, memoryview(body)):
        raise TransportError("peer closed during the shared-memory handshake")
    return bytes(body)


class ShmLink(SocketLink):
    """Payloads through a shared-memory slot ring per direction; the socket carries only doorbells."""

    kind = "shm"

    def __init__(self, sock: socket.socket, peer: int, out_map: mmap.mmap, in_map: mmap.mmap,
                 slots: int = SLOTS, slot_bytes: int = SLOT_BYTES, on_failure: FailureCallback | None = None) -> None:
        super().__init__(sock, peer, on_failure)
        self.slots, self.slot_bytes = slots, slot_bytes
        self.out_map, self.in_map = out_map, in_map
        self.out_arr: np.ndarray | None = np.frombuffer(out_map, np.uint8)
        self.in_arr: np.ndarray | None = np.frombuffer(in_map, np.uint8)
        self.free: collections.deque[int] = collections.deque(range(slots))
        self.freed = anyio.Event()
        self.message_lock = anyio.Lock()          # one message's frames stay together on the stream
        self.assembling: tuple[np.ndarray, int] | None = None

    @classmethod
    async def handshake(cls, sock: socket.socket, rank: int, peer: int, job: str, slots: int = SLOTS,
                        slot_bytes: int = SLOT_BYTES, on_failure: FailureCallback | None = None,
                        timeout: float = 30.0) -> ShmLink:
        """Create our outbound segment, map the peer's, unlink both names; both sides call this."""
        sock.setblocking(False)
        size = slots * slot_bytes
        name = segment_name(job, rank, peer)
        out_map = in_map = None
        try:
            out_map = _create(name, size)
            with anyio.fail_after(timeout):
                await _send_blob(sock, name.encode())
                peer_name = (await _recv_blob(sock)).decode()
                if not peer_name.startswith("/" + PREFIX):
                    raise TransportError(f"unexpected segment name {peer_name!r} from rank {peer}")
                in_map = _attach(peer_name, size)
                _unlink(peer_name)
                await _send_blob(sock, b"mapped")
                if await _recv_blob(sock) != b"mapped":
                    raise TransportError(f"rank {peer} did not map our segment")
        except BaseException:
            for m in (out_map, in_map):
                if m is not None:
                    m.close()
            raise
        finally:
            _unlink(name)
        return cls(sock, peer, out_map, in_map, slots, slot_bytes, on_failure)

    # ---- sending ----------------------------------------------------------------------------

    async def _take_slot(self) -> int:
        while not self.free:
            self._check()
            await self.freed.wait()
            self.freed = anyio.Event()
        return self.free.popleft()

    async def send(self, data: Any) -> None:
        if tracing.active_tracer() is None:
            return await self._send(data)
        started = tracing.clock()
        await self._send(data)
        self.traced("send", started, len(as_bytes(data)))

    async def _send(self, data: Any) -> None:
        self._check()
        view = as_bytes(data)
        n = len(view)
        if n <= INLINE:
            async with self.message_lock:
                await self._send_frame(DATA, 0, view)
            return
        src = np.frombuffer(view, np.uint8)
        async with self.message_lock:
            if n > self.slot_bytes:
                await self._send_frame(BEGIN, 0, None, n)
            for off in range(0, n, self.slot_bytes):
                piece = src[off:off + self.slot_bytes]
                slot = await self._take_slot()
                self._check()
                base = slot * self.slot_bytes
                self._mapped(self.out_arr)[base:base + len(piece)] = piece
                await self._send_frame(SLOT, slot, None, len(piece))

    def _mapped(self, segment: np.ndarray | None) -> np.ndarray:
        """The mapped segment; after close() it is gone, and using the link is an error, not a crash."""
        if segment is None:
            raise LinkClosed(f"shared-memory link to rank {self.peer} is closed")
        return segment

    async def _send_frame(self, kind: int, aux: int = 0, payload: memoryview | None = None, nbytes: int | None = None) -> None:
        if nbytes is None:
            return await super()._send_frame(kind, aux, payload)
        loop = asyncio.get_running_loop()
        async with self.send_lock:
            try:
                await loop.sock_sendall(self.sock, HEADER.pack(kind, aux, nbytes))
            except OSError as exc:
                self._fail(f"send failed: {exc.__class__.__name__}: {exc}")
                self._check()
                raise
        if kind == SLOT:
            self.bytes_sent += nbytes

    # ---- receiving --------------------------------------------------------------------------

    async def _on_frame(self, kind: int, aux: int, nbytes: int) -> None:
        if kind == CREDIT:
            if aux >= self.slots:
                raise TransportError(f"credit for slot {aux} of {self.slots}")
            self.free.append(aux)
            self.freed.set()
        elif kind == BEGIN:
            if self.assembling is not None:
                raise TransportError("BEGIN inside a message")
            self.assembling = (np.empty(nbytes, np.uint8), 0)
        elif kind == SLOT:
            if aux >= self.slots or nbytes > self.slot_bytes:
                raise TransportError(f"slot {aux} with {nbytes} bytes (have {self.slots} of {self.slot_bytes})")
            if self.assembling is None:
                self.inbox.put((aux, nbytes))
                return
            buf, got = self.assembling
            if got + nbytes > len(buf):
                raise TransportError(f"message overflows its announced {len(buf)} bytes")
            base = aux * self.slot_bytes
            buf[got:got + nbytes] = self._mapped(self.in_arr)[base:base + nbytes]
            await self._send_frame(CREDIT, aux, None, 0)
            got += nbytes
            self.assembling = None if got == len(buf) else (buf, got)
            if got == len(buf):
                self.inbox.put(buf)
        else:
            raise TransportError(f"unknown frame kind {kind} from rank {self.peer}")

    @contextlib.asynccontextmanager
    async def _deliver(self, item: Any) -> AsyncIterator[memoryview]:
        if not isinstance(item, tuple):
            yield memoryview(item).toreadonly()
            return
        slot, nbytes = item
        base = slot * self.slot_bytes
        view = self._mapped(self.in_arr)[base:base + nbytes].data.toreadonly()
        try:
            yield view
        finally:
            view.release()
            if self.failure is None and not self.closing:
                with contextlib.suppress(OSError):
                    await self._send_frame(CREDIT, slot, None, 0)

    def _wake_all(self) -> None:
        super()._wake_all()
        self.freed.set()

    def _release(self) -> None:
        self.out_arr = self.in_arr = None
        for m in (self.out_map, self.in_map):
            with contextlib.suppress(BufferError):   # a view still held elsewhere: the GC unmaps it later
                m.close()
