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
import os
import select
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
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
        # a calling thread's direct use of the socket (`pump`): held by that thread for its whole call and by
        # the loop around each frame it sends; the reader is paused (parked at a frame boundary) meanwhile
        self.direct_lock = threading.Lock()
        self.paused = False
        self._parked: anyio.Event | None = None
        self._resume: anyio.Event | None = None
        self._idle_scope: anyio.CancelScope | None = None

    # ---- sending ----------------------------------------------------------------------------

    async def _send_frame(self, kind: int, aux: int = 0, payload: memoryview | None = None) -> None:
        loop = asyncio.get_running_loop()
        n = 0 if payload is None else len(payload)
        head = HEADER.pack(kind, aux, n)
        async with self.send_lock, self._frame_owner():
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

    @contextlib.asynccontextmanager
    async def _frame_owner(self) -> AsyncIterator[None]:
        """Hold `direct_lock` around one frame the loop sends, so it never interleaves with a thread's."""
        if not self.direct_lock.acquire(blocking=False):
            await anyio.to_thread.run_sync(self.direct_lock.acquire)
        try:
            yield
        finally:
            self.direct_lock.release()

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
        if self.paused:
            await self.resume_reader()
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
                if self.paused:
                    await self._park()
                    continue
                got = await self._next_header(memoryview(head))
                if got is None:
                    continue             # paused while waiting for the next frame
                if not got:
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
            if self._parked is not None:
                self._parked.set()

    async def _next_header(self, view: memoryview) -> bool | None:
        """Read a frame header into `view`: True; False on EOF before its first byte; None when the reader
        was paused while waiting for it (no byte of it read: the wait, not a read, is what gets cancelled)."""
        while True:
            try:
                got = self.sock.recv_into(view)
                break
            except (BlockingIOError, InterruptedError):
                pass
            with anyio.CancelScope() as self._idle_scope:
                await anyio.wait_readable(self.sock)
            self._idle_scope = None
            if self.paused:
                return None
        if got == 0:
            return False
        if got < len(view) and not await recv_exactly(self.sock, view[got:]):
            raise ConnectionResetError(f"connection closed after {got} of {len(view)} bytes")
        return True

    async def _park(self) -> None:
        self._resume = anyio.Event()
        if self._parked is not None:
            self._parked.set()
        await self._resume.wait()

    # ---- a calling thread's direct use (tinydist.dist's TCP path) ------------------------------

    async def pause_reader(self) -> None:
        """Stop the reader at its next frame boundary (on the loop), so a thread holding `direct_lock`
        may read and write the socket itself (`pump`); frames read before stay in the inbox."""
        if self.paused:
            return
        self.paused = True
        self._parked = anyio.Event()
        if self._idle_scope is not None:
            self._idle_scope.cancel()
        if not self.done.is_set():
            await self._parked.wait()

    async def resume_reader(self) -> None:
        """Give the socket back to the reader (on the loop), once no thread is inside a direct call."""
        if not self.paused:
            return
        if not self.direct_lock.acquire(blocking=False):
            await anyio.to_thread.run_sync(self.direct_lock.acquire)
        try:
            self.paused = False
            if self._resume is not None:
                self._resume.set()
        finally:
            self.direct_lock.release()

    # ---- closing ----------------------------------------------------------------------------

    async def close(self, linger: float = 2.0, abort_blame: int | None = None, bye: int = 0) -> None:
        if self.sock.fileno() < 0:     # closed under us (tests simulate a dead process this way)
            self.closing = True
            if self._serve_scope is not None:
                self._serve_scope.cancel()
            self._release()
            return
        with anyio.move_on_after(linger):
            await self.resume_reader()
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


# ---- direct use: a calling thread moves a collective's frames itself ------------------------------

class Stalled(TransportError):
    """`pump` reached its deadline still waiting for frames from (or room towards) `peers`."""

    def __init__(self, peers: list[int]) -> None:
        self.peers = peers
        super().__init__(f"no progress from ranks {peers} before the deadline")


class Expect:
    """One message `pump` is to receive: into `into` (exactly its size) or a new buffer, then `done(view)`,
    which may return further messages to expect from the same link next (data a header announces)."""

    __slots__ = ("into", "done")

    def __init__(self, into: memoryview | None, done: Callable[[memoryview], Any] | None = None) -> None:
        self.into, self.done = into, done


class _Wire:
    """`pump`'s state for one link: frames to send (and how many received messages each waits for), the
    frame being read."""

    __slots__ = ("link", "out", "iov", "ends", "expect", "head", "got", "body", "target", "kind")

    def __init__(self, link: SocketLink) -> None:
        self.link = link
        self.out: collections.deque[tuple[int, bytes, memoryview | None]] = collections.deque()
        self.iov: list[memoryview] = []        # what is left of frames already started
        self.ends: collections.deque[int] = collections.deque()   # iov entries up to each started frame's end
        self.expect: collections.deque[Expect] = collections.deque()
        self.head = memoryview(bytearray(HEADER.size))
        self.got = 0                           # bytes of the current header, then of its payload
        self.body: memoryview | None = None    # the payload being read (None: reading a header)
        self.target: Any = None                # the Expect it fills, or the inbox buffer
        self.kind = 0


def pump(links: dict[int, SocketLink], sends: dict[int, Sequence[tuple[memoryview, int]]],
         expects: dict[int, Sequence[Expect]], deadline: float, wake_fd: int = -1,
         interrupted: Callable[[], None] | None = None, sent: list[int] | None = None) -> None:
    """On the calling thread, which holds every link's `direct_lock` with its reader paused: send each
    `sends[peer]` message (a payload and the count of received messages it waits for, over all links)
    as a DATA frame, and receive the `expects[peer]` messages, in order, calling each one's `done` when
    it is in (a reduce). Non-blocking sockets and poll, so sending, receiving and the kernel's copies
    overlap and no rank waits on its own send. Frames from any link that nothing here expects (a peer
    ahead of us) go to its inbox, as the reader would put them; messages already in an inbox are taken
    first. A BYE, ABORT or EOF raises PeerFailed (recorded on the link, as the reader would); the
    deadline raises Stalled; a byte on `wake_fd` calls `interrupted` (which raises to stop). `sent[0]`
    counts the messages wholly handed to the kernel (their buffers may change from then on)."""
    wires = {peer: _Wire(link) for peer, link in links.items()}
    received = 0
    for peer, msgs in sends.items():
        wires[peer].out.extend((need, HEADER.pack(DATA, 0, len(view)), view) for view, need in msgs)
    for peer, exp in expects.items():
        wire = wires[peer]
        wire.expect.extend(exp)
        inbox = wire.link.inbox.items
        while inbox and wire.expect:
            _fill(wire, wire.expect.popleft(), inbox.popleft())
            received += 1
    poller: Any = None
    woke: set[int] = set()        # sockets poll said are readable
    while True:
        busy = False
        for wire in wires.values():
            link = wire.link
            if wire.expect and link.failure is not None:
                raise link.failure
            # send what is ready, several frames in one sendmsg
            if wire.iov or (wire.out and wire.out[0][0] <= received):
                while wire.out and wire.out[0][0] <= received and len(wire.iov) < 16:
                    _, head, view = wire.out.popleft()
                    wire.iov.append(memoryview(head))
                    wire.ends.append(len(wire.iov))
                    if view is not None and len(view):
                        wire.iov.append(view)
                        wire.ends[-1] += 1
                try:
                    n = link.sock.sendmsg(wire.iov)
                except (BlockingIOError, InterruptedError):
                    n = 0
                except OSError as exc:
                    # a peer that gave up and left may have said why first (an ABORT, a BYE): that story wins
                    raise _last_word(wire) or _broken(link, f"send failed: {exc.__class__.__name__}: {exc}") from None
                if n:
                    busy = True
                    link.bytes_sent += n
                    done = 0
                    while n and wire.iov:
                        first = wire.iov[0]
                        if n >= len(first):
                            n -= len(first)
                            wire.iov.pop(0)
                            done += 1
                        else:
                            wire.iov[0] = first[n:]
                            n = 0
                    # `ends`: the iov entries, counted from the front, up to each started frame's end
                    ends = wire.ends
                    while ends and ends[0] <= done:
                        ends.popleft()
                        if sent is not None:
                            sent[0] += 1
                    if done and ends:
                        wire.ends = collections.deque(e - done for e in ends)
            # read whatever has come, from links something is owed by (or poll woke)
            if not link.peer_closed and (wire.expect or wire.got or wire.body is not None or link.sock.fileno() in woke):
                got = _read(wire)
                while got:
                    received += got
                    busy = True
                    got = _read(wire)
            if wire.expect and link.peer_closed and not wire.got and wire.body is None:
                raise _broken(link, "the peer closed the link", bye=True)
        woke.clear()
        # done when nothing is owed either way and no frame is half read (the reader goes on at a boundary)
        if not any(w.expect or w.iov or w.out or w.got or w.body is not None for w in wires.values()):
            return
        if busy:
            continue
        if poller is None:
            poller = select.poll()
            if wake_fd >= 0:
                poller.register(wake_fd, select.POLLIN)
        for wire in wires.values():
            mask = 0 if wire.link.peer_closed else select.POLLIN
            if wire.iov or (wire.out and wire.out[0][0] <= received):
                mask |= select.POLLOUT
            if mask:
                poller.register(wire.link.sock.fileno(), mask)
            else:
                with contextlib.suppress(KeyError):
                    poller.unregister(wire.link.sock.fileno())
        left = deadline - time.monotonic()
        if left <= 0:
            raise Stalled(sorted(p for p, w in wires.items() if w.expect or w.iov or w.out or w.got or w.body is not None))
        for fd, events in poller.poll(min(left, 3600.0) * 1000):
            if fd == wake_fd:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_fd, 8)
                if interrupted is not None:
                    interrupted()
            elif events & (select.POLLIN | select.POLLHUP | select.POLLERR):
                woke.add(fd)


def _broken(link: SocketLink, reason: str, bye: bool = False, blamed: int | None = None, code: int = 0) -> PeerFailed:
    """Record on `link` what the reader would have (without calling its owner back: the caller raises it)."""
    if link.failure is None and not bye:
        link.failure = PeerFailed(link.peer, reason, blamed, code)
    return link.failure or PeerFailed(link.peer, reason)


def catch_up(links: dict[int, SocketLink], deadline: float) -> None:
    """Read, on the calling thread, what came on the paused links while no call was running, as the
    reader would have at once: DATA to the inbox, a BYE noted, an ABORT or EOF raised as PeerFailed
    (so a call after its peers gave up on it refuses, as it does on the loop)."""
    for link in links.values():
        wire = _Wire(link)
        while not link.peer_closed and link.failure is None:
            if not wire.got and wire.body is None:
                try:
                    if link.sock.recv(1, socket.MSG_PEEK) == b"" and link.peer_closed:
                        break
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:
                    raise _broken(link, f"{exc.__class__.__name__}: {exc}") from None
            _read(wire)
            if (wire.got or wire.body is not None) and not select.select([link.sock], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise Stalled([link.peer])


def _last_word(wire: _Wire) -> PeerFailed | None:
    """What the frames still to be read from a link we can no longer send to say about its peer."""
    try:
        for _ in range(64):
            _read(wire)
            if wire.link.peer_closed:
                return _broken(wire.link, "the peer closed the link", bye=True)
    except PeerFailed as exc:
        return exc
    except TransportError:
        pass
    return None


def _fill(wire: _Wire, exp: Expect, buf: Any) -> None:
    """Deliver `buf`, a whole message, to `exp`."""
    view = memoryview(buf).cast("B")
    if exp.into is not None:
        if len(exp.into) != len(view):
            raise TransportError(f"received {len(view)} bytes from rank {wire.link.peer} where {len(exp.into)} "
                                 f"were expected (ranks out of step)")
        exp.into[:] = view
        view = exp.into
    if exp.done is not None and (more := exp.done(view.toreadonly())):
        wire.expect.extendleft(reversed(more))


def _read(wire: _Wire) -> int:
    """Read from `wire`'s socket without blocking: 1 when a message for an Expect completed, else 0
    (nothing to read, or a frame not finished yet, or one that went to the inbox)."""
    link, sock = wire.link, wire.link.sock
    try:
        if wire.body is None:
            n = sock.recv_into(wire.head[wire.got:])
            if n == 0:
                if wire.got == 0 and link.peer_closed:
                    return 0
                raise _broken(link, "connection closed without BYE (process died?)" if wire.got == 0 else
                              "connection closed inside a frame header")
            wire.got += n
            if wire.got < HEADER.size:
                return 0
            kind, aux, nbytes = HEADER.unpack(wire.head)
            wire.got = 0
            if kind == BYE:
                link.peer_closed, link.peer_bye = True, aux
                return 0
            if kind == ABORT:
                raise _broken(link, f"rank {link.peer} reported rank {aux & 0xFFFF} failed", blamed=aux & 0xFFFF,
                              code=aux >> 16)
            if kind != DATA or nbytes > MAX_MESSAGE:
                raise _broken(link, f"frame kind {kind} of {nbytes} bytes from rank {link.peer} on a direct call")
            if wire.expect and not link.inbox.items:
                exp = wire.expect[0]
                if exp.into is not None and len(exp.into) != nbytes:
                    raise TransportError(f"received {nbytes} bytes from rank {link.peer} where {len(exp.into)} "
                                         f"were expected (ranks out of step)")
                wire.target = exp          # taken off `expect` once it is in
                wire.body = exp.into if exp.into is not None else memoryview(bytearray(nbytes))
            else:
                wire.target = link._buffer(nbytes) if nbytes >= SPARE_MIN else np.empty(nbytes, np.uint8)
                wire.body = wire.target.data
            if nbytes:
                return 0
        else:
            n = sock.recv_into(wire.body[wire.got:])
            if n == 0:
                raise _broken(link, "connection closed inside a message")
            wire.got += n
            if wire.got < len(wire.body):
                return 0
    except (BlockingIOError, InterruptedError):
        return 0
    except OSError as exc:
        raise _broken(link, f"{exc.__class__.__name__}: {exc}") from None
    body, target = wire.body, wire.target
    wire.body, wire.target, wire.got = None, None, 0
    if isinstance(target, Expect):
        wire.expect.popleft()
        if target.done is not None and (more := target.done(body.toreadonly())):
            wire.expect.extendleft(reversed(more))
        return 1
    link.inbox.items.append(target)
    return 0


def send_now(link: SocketLink, kind: int, aux: int, deadline: float) -> None:
    """One payload-less frame (an ABORT) from a thread holding `direct_lock`, best effort until `deadline`."""
    data = memoryview(HEADER.pack(kind, aux, 0))
    with contextlib.suppress(OSError):
        while data:
            try:
                data = data[link.sock.send(data):]
            except (BlockingIOError, InterruptedError):
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([], [link.sock], [], left)[1]:
                    return
