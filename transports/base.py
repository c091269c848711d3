"""The point-to-point link interface every transport implements, and its conformance suite.

A `Link` joins this process to one peer. It carries whole messages, in order, in both directions:

    await link.send(buffer)                 # returns once `buffer` may be reused
    async with link.recv() as view:         # the next message, a read-only memoryview
        consume(view)                       # valid only inside the block (it may point into shared memory)

A link owns one background reader (`serve`), run by the owner's task group; it notices the peer
leaving: a clean `close` on the other side sends BYE first, anything else (EOF, a reset, an ABORT
frame) marks the link failed, wakes every waiter with `PeerFailed`, and tells the owner through
`on_failure(peer, reason, blamed)`. Every wait is bounded: receivers and senders wait only inside
the owner's deadline (a cancel scope), and `close` waits for the peer's BYE at most `linger` seconds.

`check_link_pair(a, b)` is the conformance suite: tests run it against every transport.
"""

from __future__ import annotations

import abc
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import numpy as np

from tinydist.base.errors import ClosedResourceError, TinydistError
from tinydist.observability import tracing


class TransportError(TinydistError):
    """A link broke its protocol or could not be set up."""


class LinkClosed(TransportError, ClosedResourceError):
    """This side already closed the link (or the group's shared memory); open a new group."""


class PeerFailed(TransportError):
    """The peer went away without closing (EOF, reset, or it reported another rank's failure)."""

    def __init__(self, peer: int, reason: str, blamed: int | None = None, code: int = 0) -> None:
        self.peer = peer
        self.blamed = peer if blamed is None else blamed   # the rank that really failed
        self.reason = reason
        self.code = code        # what the reporting rank said happened (its owner's code; 0: nothing said)
        super().__init__(f"rank {self.blamed} failed ({reason})")


FailureCallback = Callable[[int, str, int], None]   # (peer, reason, blamed rank)


class Link(abc.ABC):
    """One peer, ordered messages both ways. Subclasses: `tinydist.transports.tcp.TcpLink`, `tinydist.transports.shm.ShmLink`."""

    kind: str = "?"
    # the trace process this link's send/recv spans go to (`ProcessGroup` sets `rank{N}`)
    trace_process: str = "transport"

    def __init__(self, peer: int, on_failure: FailureCallback | None = None) -> None:
        self.peer = peer
        self.on_failure = on_failure
        self.failure: PeerFailed | None = None
        self.closing = False       # our BYE went out
        self.peer_closed = False   # the peer's BYE came in
        self.peer_bye = 0          # the code its BYE carried (the owner's: tinydist.dist says why a rank left)

    # ---- the interface ----------------------------------------------------------------------

    @abc.abstractmethod
    async def send(self, data: Any) -> None:
        """Send one message (any C-contiguous buffer, possibly empty); returns when it may be reused."""

    @abc.abstractmethod
    def recv(self) -> contextlib.AbstractAsyncContextManager[memoryview]:
        """`async with link.recv() as view`: the next message, valid inside the block."""

    def traced(self, direction: str, started: int, nbytes: int) -> None:
        """A `send` or `recv` span from `started` until now on lane `send to P` / `recv from P`."""
        tracing.record(direction, started, process=self.trace_process,
                       lane=f"send to {self.peer}" if direction == "send" else f"recv from {self.peer}",
                       cat="transport", bytes=nbytes, peer=self.peer, transport=self.kind)

    @abc.abstractmethod
    async def serve(self) -> None:
        """The background reader; run it in the owner's task group. Returns after BYE/EOF or failure."""

    @abc.abstractmethod
    async def close(self, linger: float = 2.0, abort_blame: int | None = None, bye: int = 0) -> None:
        """Say BYE carrying the code `bye` (or ABORT naming `abort_blame`: a rank, with a code from bit
        16 up as `SocketLink.abort` sends it), wait at most `linger` s for the peer's BYE, release everything."""

    # ---- shared helpers ---------------------------------------------------------------------

    def _fail(self, reason: str, blamed: int | None = None, code: int = 0) -> None:
        if self.failure is not None or (self.peer_closed and blamed is None):
            return
        self.failure = PeerFailed(self.peer, reason, blamed, code)
        self._wake_all()
        if self.on_failure is not None and not self.closing:
            self.on_failure(self.peer, reason, self.failure.blamed)

    @abc.abstractmethod
    def _wake_all(self) -> None:
        """Wake every task waiting on this link (it will see `self.failure` or the close)."""

    def _check(self) -> None:
        if self.failure is not None:
            raise self.failure
        if self.closing:
            raise LinkClosed(f"link to rank {self.peer} is closed")


def as_bytes(data: Any) -> memoryview:
    """A flat byte view of any C-contiguous buffer (numpy arrays included), without copying."""
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            raise TransportError("send needs a C-contiguous buffer")
        return data.reshape(-1).view(np.uint8).data
    view = memoryview(data)
    if not view.c_contiguous:
        raise TransportError("send needs a C-contiguous buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


# ---- conformance suite --------------------------------------------------------------------------

async def check_link_pair(a: Link, b: Link, large: int = 3 * (1 << 20) + 17) -> None:
    """Run the conformance suite on two connected links (a.peer is b's side and vice versa).

    Both links' `serve` must already run. Checks: ordering, message sizes from 0 to `large` (around
    transport boundaries too), send-buffer reuse right after `send` returns, both directions at once,
    many messages in flight, and that a view is valid inside its block. Leaves both links open.
    """
    rng = np.random.default_rng(1234)
    sizes = [0, 1, 7, 4095, 4096, 4097, 65535, 65536, 65537, (1 << 18) - 1, 1 << 18, (1 << 18) + 1,
             (1 << 19) + 3, large]

    async def expect(link: Link, payload: bytes) -> None:
        async with link.recv() as view:
            if len(view) != len(payload):
                raise AssertionError(f"{link.kind}: message of {len(view)} bytes, expected {len(payload)}")
            if bytes(view) != payload:
                raise AssertionError(f"{link.kind}: message of {len(payload)} bytes arrived corrupted")

    with anyio.fail_after(60):
        # 1. every size, in order, one direction then the other; the sender scribbles over its buffer
        #    as soon as send returns, which must not change what arrives.
        for src, dst in ((a, b), (b, a)):
            payloads = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]

            async def sender(src: Link = src, payloads: list[bytes] = payloads) -> None:
                for p in payloads:
                    buf = np.frombuffer(p, np.uint8).copy()
                    await src.send(buf)
                    buf[:] = 0xAB

            async with anyio.create_task_group() as tg:
                tg.start_soon(sender)
                for p in payloads:
                    await expect(dst, p)

        # 2. both directions at once, many messages in flight (more than any window of slots).
        count, size = 64, 100_003
        ab = [os.urandom(size) for _ in range(count)]
        ba = [os.urandom(size // 2) for _ in range(count)]

        async def pump(link: Link, msgs: list[bytes]) -> None:
            for m in msgs:
                await link.send(m)

        async def drain(link: Link, msgs: list[bytes]) -> None:
            for m in msgs:
                await expect(link, m)

        async with anyio.create_task_group() as tg:
            tg.start_soon(pump, a, ab)
            tg.start_soon(pump, b, ba)
            tg.start_soon(drain, b, ab)
            tg.start_soon(drain, a, ba)

        # 3. numpy arrays of other dtypes go as their bytes.
        arr = np.arange(1000, dtype=np.float64)
        await a.send(arr)
        async with b.recv() as view:
            if not np.array_equal(np.frombuffer(view, np.float64), arr):
                raise AssertionError(f"{b.kind}: float64 array arrived corrupted")


async def check_peer_death(survivor: Link, kill: Callable[[], Any], timeout: float = 10.0) -> PeerFailed:
    """After `kill()` removes the peer without a BYE, a pending recv on `survivor` raises PeerFailed quickly."""
    with anyio.fail_after(timeout):
        await anyio.sleep(0)
        kill()
        try:
            async with survivor.recv():
                pass
        except PeerFailed as exc:
            return exc
    raise AssertionError(f"{survivor.kind}: recv after the peer died returned a message")


@contextlib.asynccontextmanager
async def serving(*links: Link) -> AsyncIterator[None]:
    """Run each link's reader in a task group for the block; close all links at the end."""
    async with anyio.create_task_group() as tg:
        for link in links:
            tg.start_soon(link.serve)
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                async with anyio.create_task_group() as closers:
                    for link in links:
                        closers.start_soon(link.close)
