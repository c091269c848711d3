"""`ProcessGroup`: the core of tinydist.dist. One per process; collectives run one at a time.

This module holds the group's life (rendezvous, links, the segment, close) and failures, and runs
one collective at a time; each collective is prepared as a call in `tinydist.dist.calls`, its
algorithm chosen by `tinydist.dist.dispatch`, and the headers compared by `tinydist.dist.headers`.

Every collective starts with a header exchange: each rank publishes a small JSON header (sequence
number, collective, op, dtype, shape, axis, root, resolved algorithm, local argument errors) and
reads everyone's. All ranks therefore see the same headers and reach the same verdict: if they
disagree, every rank raises the same `CollectiveMismatch` before any result is computed (and the
group stays usable). The exchange doubles as the barrier, and tells allgather each rank's piece length.
Over links a one-chunk naive allreduce sends its data right behind the header (`Call.eager`): one
message round instead of two, and on a mismatch each rank drains the data its peers' headers announced.

Two ways to run a collective:
- ranks on one host (shared-memory links, x86-64 Linux) also map one group segment
  (`tinydist.transports.shm_group`): the header sits in shared memory next to the data, and the collective
  runs on the caller's thread (`blocking`), reading peers' regions directly
  (`tinydist.dist.shm_algorithms`). An explicit `ring` still moves its data over the links.
- otherwise headers and data go as link messages: over TCP links an allreduce (naive, ring) and a
  barrier on the caller's thread, the links' readers paused (`_direct`, `tcp.pump`); the rest on the
  event loop (`_collective`).

Failures: a link that sees EOF/reset without a BYE (or an ABORT naming a rank) calls back here; the
group records `RankFailed(rank)`, cancels the collective in flight, and tells the other peers with
ABORT frames. A collective that outlives TINYDIST_COLLECTIVE_TIMEOUT raises `CollectiveTimeout`
naming the ranks it still waited for. After either, the group refuses further collectives.

A call completes on every rank or fails on every rank. On the group segment that is exact: a rank
gives up on a peer only by poisoning the peer's step word (`ShmGroup.give_up`), so a rank arriving
after its peers' deadline cannot post its step and raises the same `CollectiveTimeout` naming itself,
and ranks waiting on a dead or departed rank all read the same story from the poison. Over links a
rank that times out sends every peer an ABORT saying so (awaited, bounded) before it raises, so a
late rank that calls afterwards raises the same `CollectiveTimeout`; a late rank arriving inside the
moment between its peers' deadline and their ABORT reaching it may still finish a `barrier` (which
moves no data; every other collective waits for data its peers never send).

How a rank stopped is said as it happened (`_STORY`): it died (its connection closed without a BYE:
SIGKILL, os._exit, a crash), it left (td.dist.destroy), it exited (its script ended, normally or on
an uncaught exception, and the exit hook left the group), or it broke off a collective on an error
of its own. A BYE carries the code; an ABORT carries the code with the blamed rank; a poison holds it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Container, Iterable, Sequence
from typing import Any, TypeVar

import anyio
import numpy as np

from tinydist.base.config import settings
from tinydist.base.logs import get_logger
from tinydist.dist import calls
from tinydist.dist import shm_algorithms as shm
from tinydist.dist.calls import PREPARE, Call
from tinydist.dist.dispatch import Dispatch
from tinydist.dist.errors import CollectiveError, CollectiveMismatch, CollectiveTimeout, RankFailed
from tinydist.dist.headers import verdict
from tinydist.dist.shm_fast import FastAllreduce
from tinydist.dist.rendezvous import connect_mesh, coordinator_listener, register, serve_coordinator
from tinydist.graph.collectives import Medium
from tinydist.observability import tracing
from tinydist.transports.base import Link, PeerFailed, TransportError, as_bytes
from tinydist.transports.tcp import ABORT, Expect, Stalled, TcpLink, catch_up, pump, send_now
from tinydist.transports.shm_group import TIMED_OUT, Abandoned, ShmGroup, WaitTimeout, open_group

T = TypeVar("T")
# the algorithm of a collective that has one way to run (the others name theirs in the header)
_ALGORITHM = {"all_gather": "direct", "broadcast": "direct", "barrier": "barrier"}

# How a rank stopped: the codes a BYE, an ABORT and a poisoned step word carry (TIMED_OUT, 1, is the
# segment's own: a deadline passed). 0, a BYE from before the codes, reads as LEFT.
DIED, LEFT, EXITED, EXITED_ON_ERROR, BROKE_OFF, DECLARED = 2, 3, 4, 5, 6, 7
_STORY = {
    DIED: "died (its connection closed without a goodbye: killed, os._exit or a crash)",
    LEFT: "left the group (td.dist.destroy)",
    EXITED: "exited (its script ended without td.dist.destroy; the exit hook said goodbye)",
    EXITED_ON_ERROR: "exited on an uncaught exception (the exit hook said goodbye; see that rank's output)",
    BROKE_OFF: "broke off the collective on an error of its own (see that rank's output)",
    DECLARED: "was declared failed (ProcessGroup.fail: the cluster scheduler saw its node die)",
}


def _abort(links: Iterable[TcpLink], aborts: Sequence[int], skip: Container[int] = ()) -> None:
    """ABORT frames (`aborts`, each a blamed rank and its code) to every peer of `links` but `skip`, from
    the thread holding their `direct_lock`s: best effort, 1 s for them all."""
    until = time.monotonic() + 1.0
    for link in links:
        if link.peer not in skip:
            for aux in aborts:
                send_now(link, ABORT, aux, until)

class ProcessGroup:
    """All ranks of one job, connected pairwise. Use `ProcessGroup.open(...)` (an async context manager)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.links: dict[int, Link] = {}
        self.same_host = True
        self.log = get_logger(rank=rank, world=world)
        self._lock = anyio.Lock()                 # collectives over links, on the event loop
        self._thread_lock = threading.Lock()      # collectives on the segment, on the callers' threads
        self.shm: ShmGroup | None = None
        self.fast: FastAllreduce | None = None      # small allreduces as one native call (`shm_fast`)
        self._seq = 0
        self._failure: CollectiveError | None = None
        self._failure_code = 0                    # the story of `_failure` when a rank failed (`_STORY`)
        self.leaving = LEFT                       # what our BYE will say: td.dist's exit hook sets EXITED*
        self._scope: anyio.CancelScope | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self.dispatch = Dispatch(self)            # which algorithm each collective runs, and the log saying so
        self._direct_ok: bool | None = None       # collectives on the caller's thread over TCP (`_direct`)
        self._wake_fd = -1                        # wakes a direct call's poll when the group fails from outside
        self._deadline = 0.0
        self._scratch: dict[str, np.ndarray] = {}

    @property
    def medium(self) -> Medium:
        """What an allreduce moves through: one host's shared memory, or the network."""
        return Medium.SHM if self.same_host else Medium.NETWORK

    # ---- life cycle -------------------------------------------------------------------------

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, rank: int, world: int, coordinator: tuple[str, int], coordinator_sock: socket.socket | None = None,
                   timeout: float | None = None, transport: str | None = None) -> AsyncIterator[ProcessGroup]:
        """Rendezvous, connect the mesh, serve the links for the block, close deterministically."""
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside 0..{world - 1} (world size {world})")
        timeout = settings.COLLECTIVE_TIMEOUT if timeout is None else timeout
        transport = transport or settings.TRANSPORT
        group = cls(rank, world)
        async with anyio.create_task_group() as tg:
            group._tg = tg
            if world > 1:
                if rank == 0:
                    if coordinator_sock is None:
                        coordinator_sock = coordinator_listener(coordinator)
                    tg.start_soon(serve_coordinator, coordinator_sock, world, timeout)
                try:
                    table, listener = await register(coordinator, rank, world, timeout)
                except TransportError as exc:
                    if rank == 0:
                        raise
                    raise CollectiveTimeout([0], f"rendezvous: rank {rank} reached no coordinator within {timeout:g} s, "
                                                 f"so ranks [0] (which serves it) did not join: {exc}") from exc
                try:
                    group.links = await connect_mesh(rank, world, table, listener, transport, group._on_link_failure, timeout)
                except (PeerFailed, ExceptionGroup) as exc:
                    gone = _peer_failure(exc)
                    if gone is None:
                        raise
                    raise RankFailed(gone.blamed, f"rendezvous: rank {gone.blamed} {_STORY[DIED]} after it registered: "
                                                  f"{gone.reason}") from exc
                hosts = {info["host"] for info in table["peers"].values()}
                group.same_host = len(hosts) == 1 and transport != "tcp"
                for link in group.links.values():
                    link.trace_process = f"rank{rank}"   # where its send/recv spans go in a trace
                    tg.start_soon(link.serve)
            try:
                if world > 1 and group.same_host and transport in ("auto", "shm") and ShmGroup.supported():
                    group.shm = await open_group(rank, world, table["job"], group.links, settings.SHM_SLOT_BYTES, timeout)
                    await group._negotiate_single_copy(timeout)
                    group.fast = FastAllreduce.create(group, group.shm)
                group.log.debug("dist.init", links={p: link.kind for p, link in group.links.items()},
                                segment=group.shm is not None, single_copy_bytes=group.shm and group.shm.single_copy_bytes)
                yield group
            finally:
                with anyio.CancelScope(shield=True):
                    await group._close()

    async def _negotiate_single_copy(self, timeout: float) -> None:
        """Agree with every rank from what size on all2all copies straight between the ranks' memory
        (`ShmGroup.negotiate_single_copy`): TINYDIST_SHM_SINGLE_COPY=off on any rank says never, `on`
        asks for every size, `auto` for `shm.SINGLE_COPY_MIN_BYTES` on."""
        grp = self.shm
        assert grp is not None
        wanted = {"auto": shm.SINGLE_COPY_MIN_BYTES, "on": 0, "off": None}[settings.SHM_SINGLE_COPY]
        deadline = time.monotonic() + timeout
        try:
            await anyio.to_thread.run_sync(grp.negotiate_single_copy, deadline, self._check_waiting, wanted)
        except WaitTimeout as exc:
            raise self._timed_out("the single-copy probe", exc.ranks, False) from None
        except Abandoned as exc:
            raise self._abandoned("the single-copy probe", exc, False) from None
        if grp.single_copy_bytes is None:
            self.log.info("dist.single_copy_off", reason="TINYDIST_SHM_SINGLE_COPY=off or a rank cannot read a peer's "
                                                         "memory (process_vm_readv: ptrace rights); large collectives "
                                                         "go through the segment's slots")

    async def _close(self) -> None:
        failed = self._failure
        blamed = failed.rank | self._failure_code << 16 if isinstance(failed, RankFailed) and failed.rank >= 0 else None
        async with anyio.create_task_group() as tg:
            for link in self.links.values():
                tg.start_soon(functools.partial(link.close, linger=2.0, abort_blame=blamed, bye=self.leaving))
        if self.shm is not None:
            self.shm.close()
        if self._wake_fd >= 0:
            os.close(self._wake_fd)
            self._wake_fd = -1

    def fail(self, rank: int, reason: str) -> None:
        """Declare `rank` failed from outside (the cluster scheduler saw its node die): same path as a
        link that saw EOF, so the collective in flight and every later one raise RankFailed(rank)."""
        self._on_link_failure(rank, reason, rank, DECLARED)

    def _on_link_failure(self, peer: int, reason: str, blamed: int, code: int = 0) -> None:
        if self._failure is not None:
            return
        code = self._record_peer_failure(peer, reason, blamed, code)
        self.log.warning("dist.rank_failed", failed_rank=blamed, noticed_via=peer, reason=reason)
        if self._scope is not None:
            self._scope.cancel()
        if self.shm is not None:
            self.shm.wake_all()          # a caller's thread asleep on a peer's step rechecks now
        if self._wake_fd >= 0:
            os.eventfd_write(self._wake_fd, 1)   # a direct call's poll rechecks now
        if self._tg is not None:
            for p, other in self.links.items():
                if p not in (peer, blamed):
                    self._tg.start_soon(other.abort, blamed, code)   # type: ignore[attr-defined]

    def _record_peer_failure(self, peer: int, reason: str, blamed: int, code: int = 0) -> int:
        """Record what happened to rank `blamed` (`code`, or what the link to `peer` says); return the
        story's code. Its BYE came: it left or exited, as the BYE says. Its ABORT came: what the ABORT
        says (a timeout: the peer gave up waiting for `blamed`, perhaps us). Else the link broke: it died."""
        link = self.links.get(peer)
        if not code and link is not None and link.failure is not None and link.failure.code:
            code = link.failure.code
        elif not code and link is not None and link.peer_closed and link.failure is None:
            code = link.peer_bye or LEFT
        code = code or DIED
        if code == TIMED_OUT:
            self._failure = CollectiveTimeout([blamed], f"rank {peer} timed out waiting for rank {blamed}"
                                                        f"{' (this rank)' if blamed == self.rank else ''} "
                                                        f"(TINYDIST_COLLECTIVE_TIMEOUT) and gave the call up, on every rank")
        else:
            self._failure = RankFailed(blamed, f"rank {blamed} {_STORY.get(code, 'failed')}: {reason}")
        self._failure_code = code
        return code

    # ---- the collective driver --------------------------------------------------------------

    def _begin(self, call: Call) -> tuple[dict[str, Any], str]:
        """Refuse after a failure; number the call. Every rank numbers its calls alike."""
        if self._failure is not None:
            raise self._failure
        self._seq += 1
        return {"seq": self._seq, **call.header}, f"{call.header['coll']} (call #{self._seq})"

    async def _run(self, call: Call) -> Any:
        if self.shm is None:
            return await self._collective(call)
        return await anyio.to_thread.run_sync(self._on_segment, call, anyio.from_thread.run)

    def blocking(self, collective: str, *args: Any, run_async: Callable[..., Any]) -> Any:
        """Run `collective` (all_reduce, all_gather, reduce_scatter, broadcast, barrier) from a thread
        that is not the group's event loop; `run_async(fn, *args)` runs a coroutine function there
        (a blocking portal's `call`). On the group segment the collective runs on this thread, and over
        TCP links an allreduce (naive, ring) or a barrier does too (`_direct`)."""
        if self.fast is not None:
            if collective == "all_reduce":
                done = self.fast.all_reduce(*args)
                if done is not None:
                    return done
            elif collective == "barrier" and self.fast.barrier():
                return None
        call = PREPARE[collective](self, *args)
        if self.shm is None:
            if call.direct is not None and self._direct_links():
                return self._direct(call, run_async)
            return run_async(self._collective, call)
        return self._on_segment(call, run_async)

    # ---- over TCP links, on the calling thread ----------------------------------------------

    def _direct_links(self) -> bool:
        """Whether collectives may run on the caller's thread: every link a plain TCP link."""
        if self._direct_ok is None:
            self._direct_ok = self.world > 1 and all(type(link) is TcpLink for link in self.links.values())
        return self._direct_ok

    def _direct(self, call: Call, run_async: Callable[..., Any]) -> Any:
        """`call` on this thread over the TCP links, header exchange included, without the event loop: the
        links' readers are paused (once; the loop takes a link back when it next reads it) and this thread
        holds each link's `direct_lock` for the call. Same frames and chunk plans as on the loop, same errors."""
        with self._thread_lock:
            if self._failure is not None:
                raise self._failure
            links = self.links
            held: list[TcpLink] = []
            try:
                for link in links.values():
                    assert isinstance(link, TcpLink)
                    link.direct_lock.acquire()
                    held.append(link)
                if not all(link.paused for link in held):
                    run_async(self._pause_links)
                if self._wake_fd < 0:
                    self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
                try:
                    catch_up(self.links, time.monotonic() + settings.COLLECTIVE_TIMEOUT)   # type: ignore[arg-type]
                except PeerFailed as exc:
                    self._peer_failed(exc, held)
                except Stalled:
                    pass      # a frame half sent: the call's own pump reads on (and times out)
                header, name = self._begin(call)
                with self._traced(header, call, "links"):
                    return self._direct_call(call, header, name, held)
            finally:
                for link in held:
                    link.direct_lock.release()

    def _peer_failed(self, exc: PeerFailed, links: list[TcpLink]) -> None:
        """Record what a direct call learnt of a peer (as `_on_link_failure` does on the loop) and tell
        the other peers with ABORTs (bounded: 1 s)."""
        if self._failure is not None:
            return
        code = self._record_peer_failure(exc.peer, exc.reason, exc.blamed)
        self.log.warning("dist.rank_failed", failed_rank=exc.blamed, noticed_via=exc.peer, reason=exc.reason)
        _abort(links, [exc.blamed | code << 16], skip=(exc.peer, exc.blamed))

    async def _pause_links(self) -> None:
        for link in self.links.values():
            await link.pause_reader()   # type: ignore[attr-defined]

    def move(self, sends: dict[int, list[tuple[memoryview, int]]], expects: dict[int, list[Expect]],
             sent: list[int] | None = None) -> None:
        """Send and receive a direct call's messages (`tcp.pump`) within the call's deadline."""
        pump(self.links, sends, expects, self._deadline, self._wake_fd, self._interrupted, sent)   # type: ignore[arg-type]

    def scratch(self, key: str, count: int, dtype: np.dtype) -> np.ndarray:
        """A buffer of `count` elements kept for the next direct call (no page faults on reuse)."""
        nbytes = count * np.dtype(dtype).itemsize
        buf = self._scratch.get(key)
        if buf is None or buf.nbytes < nbytes:
            buf = self._scratch[key] = np.empty(max(nbytes, 64), np.uint8)
        return buf[:nbytes].view(dtype)

    def _interrupted(self) -> None:
        """Raise inside a direct call's pump once the group failed from outside (`fail`: the scheduler
        declared a rank dead). The ABORTs `_on_link_failure` starts on the loop wait for the links this
        thread holds, and the process may exit before they go (the peers then blamed this rank for its
        EOF), so this thread tells the other peers first (bounded: 1 s)."""
        if self._failure is not None:
            blamed = self._failure.rank if isinstance(self._failure, RankFailed) else self.rank
            if blamed != self.rank:
                _abort(self.links.values(), [blamed | self._failure_code << 16], skip=(blamed,))  # type: ignore[arg-type]
            raise PeerFailed(blamed, str(self._failure))

    def _direct_call(self, call: Call, header: dict[str, Any], name: str, links: list[TcpLink]) -> Any:
        assert call.direct is not None
        self._deadline = time.monotonic() + settings.COLLECTIVE_TIMEOUT
        blob = json.dumps(header).encode()
        blobs: dict[int, bytes] = {self.rank: blob}
        stage_headers = True

        def got_header(peer: int, view: memoryview) -> list[Expect] | None:
            # the data behind a header: into the call when the header agrees, else read off the link
            blobs[peer] = theirs = bytes(view)
            if theirs == blob:
                return None if call.early is None else call.early(peer)
            return [Expect(None)] if json.loads(theirs).get("eager") else None

        try:
            first = [(memoryview(blob), 0)] + ([] if call.eager is None else [(as_bytes(call.eager), 0)])
            self.move({p: list(first) for p in self.links},
                      {p: [Expect(None, functools.partial(got_header, p))] for p in self.links}, call.sent)
            headers = self._agree(name, header, blob, blobs)   # data behind a disagreeing header was drained
            stage_headers = False
            return call.direct(headers)
        except Stalled:
            absent = sorted(set(range(self.world)) - set(blobs)) if stage_headers else []
            error = self._timed_out(name, absent or sorted(self.links), bool(absent))
            # tell every peer before raising, so a rank that calls later fails the same way
            _abort(links, [rank | TIMED_OUT << 16 for rank in error.ranks])
            raise error from None
        except PeerFailed as exc:
            self._peer_failed(exc, links)
            self._check_failure(name)
            raise
        except CollectiveError:
            raise
        except BaseException as exc:
            # this rank stopped part way through (a message of the wrong size, an interrupt): the links'
            # streams are out of step, so the group takes no more collectives and the peers are told
            if self._broke_off(name, exc):
                _abort(links, [self.rank | BROKE_OFF << 16])
            raise

    def _broke_off(self, name: str, exc: BaseException) -> bool:
        """Fail the group: this rank stopped `name` part way through, so the ranks are out of step.
        False where the group had failed already (its first failure is the one it keeps)."""
        if self._failure is not None:
            return False
        self._failure = CollectiveError(f"{name} broke off on rank {self.rank} ({type(exc).__name__}: {exc}); "
                                        f"the ranks are out of step, so the group takes no more collectives")
        return True

    def _traced(self, header: dict[str, Any], call: Call, where: str) -> contextlib.AbstractContextManager[Any]:
        """The collective's span on this rank's `collective` lane: name, algorithm, bytes, world,
        rank, call number and where its data went (`segment` or `links`); a no-op when not tracing."""
        if tracing.active_tracer() is None:
            return contextlib.nullcontext()
        coll = header["coll"]
        return tracing.span(coll, process=f"rank{self.rank}", lane="collective", cat="collective", collective=coll,
                            algorithm=header.get("algorithm") or _ALGORITHM.get(coll, coll), bytes=call.nbytes,
                            world=self.world, rank=self.rank, seq=header["seq"], dtype=header.get("dtype", ""),
                            data=where)

    def _on_segment(self, call: Call, run_async: Callable[..., Any]) -> Any:
        with self._thread_lock:
            header, name = self._begin(call)
            # tracing asked once a call; untraced, no span to build and no context manager to enter
            # (a nullcontext and a second active_tracer(): 5 Python calls, ~42 bytecodes of ~1,600)
            if tracing.active_tracer() is None:
                return self._on_segment_traced(call, run_async, header, name, None)
            with self._traced(header, call, "segment" if call.segment is not None else "links"):
                return self._on_segment_traced(call, run_async, header, name, f"rank{self.rank}")

    def _on_segment_traced(self, call: Call, run_async: Callable[..., Any], header: dict[str, Any], name: str,
                           trace: str | None) -> Any:
        """The collective on the segment; `trace`: this rank's trace process (its steps' spans) while tracing."""
        if self.shm is None:
            raise CollectiveError(f"{name}: the group's shared memory is closed (td.dist.destroy() was called)")
        deadline = time.monotonic() + settings.COLLECTIVE_TIMEOUT
        blob = json.dumps(header).encode()
        session = shm.Session(self.shm, blob, functools.partial(self._agree, name, header, blob), deadline,
                              self._check_waiting, trace)
        try:
            if call.segment is not None:
                return call.segment(session)
            session.round()
            headers = session.sync()
        except WaitTimeout as exc:
            raise self._timed_out(name, exc.ranks, session.headers is None) from None
        except Abandoned as exc:
            raise self._abandoned(name, exc, session.headers is None) from None
        except RankFailed as exc:
            if self._failure is None:       # a peer's process vanished under a single copy: as a link's EOF
                self._on_link_failure(exc.rank, str(exc), exc.rank)
            self._check_failure(name)
            raise
        except CollectiveError:
            raise
        except BaseException as exc:
            # this rank stopped part way through its steps: the peers' step counts no longer match ours,
            # so it poisons its own word (the peers waiting for its next step raise at once, told why)
            if self._broke_off(name, exc):
                with contextlib.suppress(TransportError):
                    self.shm.give_up([self.rank], self.shm.step + 1, BROKE_OFF, self.rank)
            raise
        return run_async(self._guarded, name, lambda: call.links(headers), list, deadline - time.monotonic())

    def _agree(self, name: str, header: dict[str, Any], blob: bytes, blobs: dict[int, bytes]) -> dict[int, dict[str, Any]]:
        """Every rank's header from the segment, checked by `_verdict` (identical blobs need no parsing)."""
        if header.get("error") is None and all(b == blob for b in blobs.values()):
            return dict.fromkeys(blobs, header)
        headers = {r: json.loads(b) for r, b in blobs.items()}
        verdict(name, headers)
        return headers

    def _check_failure(self, name: str) -> None:
        failure = self._failure
        if isinstance(failure, CollectiveTimeout):
            raise CollectiveTimeout(failure.ranks, f"{name}: {failure}") from None
        if failure is not None:
            raise RankFailed(failure.rank if isinstance(failure, RankFailed) else -1, f"{name}: {failure}") from None

    def _check_waiting(self, peer: int) -> tuple[int, int] | None:
        """Between sleeps on `peer`'s step, whether to give up on it: (story, blamed rank) when the group
        failed (a rank died: its link saw EOF) or `peer` left (its BYE came) and never will post it."""
        if self._failure is not None:
            return self._failure_code or BROKE_OFF, self._failure.rank if isinstance(self._failure, RankFailed) else self.rank
        link = self.links[peer]
        if link.peer_closed:
            return link.peer_bye or LEFT, peer
        return None

    def _abandoned(self, name: str, exc: Abandoned, no_call: bool) -> CollectiveError:
        """Record and return the error a poisoned step word says: the same on every rank of the call."""
        if exc.reason == TIMED_OUT:
            late = exc.ranks or [self.rank]
            whose = " (this rank, too late)" if self.rank in late else ""
            what = f"no call from ranks {late}{whose}" if no_call else f"data from ranks {late}{whose} did not arrive"
            self._failure = CollectiveTimeout(late, f"{name} timed out after {settings.COLLECTIVE_TIMEOUT:g} s: {what}; "
                                                    f"rank {exc.blamed} gave the call up, on every rank "
                                                    f"(TINYDIST_COLLECTIVE_TIMEOUT)")
        else:
            self._failure = RankFailed(exc.blamed, f"{name}: rank {exc.blamed} {_STORY.get(exc.reason, 'failed')}")
            self._failure_code = exc.reason
        return self._failure

    async def _collective(self, call: Call) -> Any:
        async with self._lock:
            header, name = self._begin(call)
            with self._traced(header, call, "links"):
                return await self._collective_traced(call, header, name)

    async def _collective_traced(self, call: Call, header: dict[str, Any], name: str) -> Any:
        if self.world == 1:
            verdict(name, {0: header})
            return await call.links({0: header})
        headers: dict[int, dict[str, Any]] = {self.rank: header}

        async def run() -> Any:
            await self._exchange(header, headers, call.eager)
            try:
                verdict(name, headers)
            except CollectiveMismatch:
                # the data a peer sent behind its header is not for any later call: read it off the link
                for peer, theirs in headers.items():
                    if peer != self.rank and theirs.get("eager"):
                        async with self.links[peer].recv():
                            pass
                raise
            return await call.links(headers)

        return await self._guarded(name, run, lambda: sorted(set(range(self.world)) - set(headers)),
                                   settings.COLLECTIVE_TIMEOUT)

    async def _guarded(self, name: str, body: Callable[[], Awaitable[T]], missing: Callable[[], list[int]], timeout: float) -> T:
        """Run `body` within `timeout`; a peer's failure or the deadline becomes RankFailed / CollectiveTimeout."""
        result: Any = None
        try:
            with anyio.CancelScope() as scope:
                self._scope = scope
                with anyio.move_on_after(timeout) as deadline:
                    try:
                        result = await body()
                        return result
                    except (PeerFailed, ExceptionGroup) as exc:
                        peer = _peer_failure(exc)
                        if peer is None:
                            raise
                        if self._failure is None:
                            self._record_peer_failure(peer.peer, peer.reason, peer.blamed)
        finally:
            self._scope = None
        self._check_failure(name)
        if deadline.cancelled_caught:
            absent = missing()
            error = self._timed_out(name, absent or sorted(self.links), bool(absent))
            # tell every peer before raising, so a rank that calls later fails the same way (bounded: 1 s a link)
            with anyio.CancelScope(shield=True):
                async with anyio.create_task_group() as tg:
                    for link in self.links.values():
                        for rank in error.ranks:
                            tg.start_soon(link.abort, rank, TIMED_OUT)   # type: ignore[attr-defined]
            raise error
        raise CollectiveError(f"{name} was cancelled")  # pragma: no cover

    def _timed_out(self, name: str, ranks: list[int], no_call: bool) -> CollectiveTimeout:
        """Record (the group is unusable after it) and return the timeout naming the ranks waited for."""
        what = f"no call from ranks {ranks}" if no_call else f"data from ranks {ranks} did not arrive"
        self._failure = CollectiveTimeout(ranks, f"{name} timed out after {settings.COLLECTIVE_TIMEOUT:g} s on rank "
                                                 f"{self.rank}: {what} (TINYDIST_COLLECTIVE_TIMEOUT)")
        return self._failure

    async def _exchange(self, header: dict[str, Any], into: dict[int, dict[str, Any]], eager: np.ndarray | None) -> None:
        """Send our header (and `eager`, the call's data, right behind it) to every peer, then read their
        headers. At most two messages a link, the data one chunk, which every transport takes without its
        receiver (a TCP link's reader drains the socket; a shared-memory link has 8 slots, the previous
        call's consumed; an RDMA link's ring holds many chunks), so no rank waits on another's send, and
        there is no task group for the sends: its tasks were most of a small call's Python over TCP.
        With two or more peers their headers are read concurrently, so that a timeout blames only the
        ranks whose header did not come (read in turn, a late rank 1 hid rank 2's header behind it)."""
        blob = json.dumps(header).encode()
        for link in self.links.values():
            await link.send(blob)
            if eager is not None:
                await link.send(eager)

        async def get(peer: int) -> None:
            async with self.links[peer].recv() as view:
                into[peer] = json.loads(bytes(view))

        if len(self.links) == 1:
            await get(next(iter(self.links)))
            return
        async with anyio.create_task_group() as tg:
            for peer in self.links:
                tg.start_soon(get, peer)

    # ---- collectives (numpy in, numpy out) --------------------------------------------------
    # Each is prepared as a `Call` (`tinydist.dist.calls`); `name` runs it from async code,
    # `blocking("name", ...)` from a thread.

    async def all_reduce(self, x: np.ndarray, op: str = "sum", algorithm: str = "auto",
                         out: np.ndarray | None = None) -> np.ndarray:
        """The reduction of every rank's `x`; written into `out` (and `out` returned) when given: `out=x`
        overwrites the input, as torch.distributed.all_reduce does (see `calls.check_out` for what `out` must be)."""
        return await self._run(calls.all_reduce(self, x, op, algorithm, out))

    async def all_gather(self, x: np.ndarray, axis: int = 0) -> np.ndarray:
        return await self._run(calls.all_gather(self, x, axis))

    async def reduce_scatter(self, x: np.ndarray, op: str = "sum", axis: int = 0, algorithm: str = "auto") -> np.ndarray:
        return await self._run(calls.reduce_scatter(self, x, op, axis, algorithm))

    async def broadcast(self, x: np.ndarray | None, src: int = 0) -> np.ndarray:
        return await self._run(calls.broadcast(self, x, src))

    async def barrier(self) -> None:
        await self._run(calls.barrier(self))


def _peer_failure(exc: BaseException) -> PeerFailed | None:
    if isinstance(exc, PeerFailed):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _peer_failure(inner)
            if found is not None:
                return found
    return None
