"""`ProcessGroup`: the core of tinydist.dist. One per process; collectives run one at a time.

Every collective starts with a header exchange: each rank publishes a small JSON header (sequence
number, collective, op, dtype, shape, axis, root, resolved algorithm, local argument errors) and
reads everyone's. All ranks therefore see the same headers and reach the same verdict: if they
disagree, every rank raises the same `CollectiveMismatch` before any result is computed (and the
group stays usable). The exchange doubles as the barrier, and tells allgather each rank's piece length.

Two ways to run a collective:
- ranks on one host (shared-memory links, x86-64 Linux) also map one group segment
  (`tinydist.transports.shm_group`): the header sits in shared memory next to the data, and the collective
  runs on the caller's thread (`blocking`), reading peers' regions directly
  (`tinydist.dist.shm_algorithms`). An explicit `ring` still moves its data over the links.
- otherwise headers and data go as link messages, on the event loop (`_collective`).

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
import math
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import numpy as np

from tinydist.base.config import settings
from tinydist.base.logs import get_logger
from tinydist.dist import algorithms as algo
from tinydist.dist import shm_algorithms as shm
from tinydist.dist.errors import CollectiveError, CollectiveMismatch, CollectiveTimeout, RankFailed
from tinydist.dist.shm_fast import FastAllreduce
from tinydist.dist.rendezvous import connect_mesh, coordinator_listener, register, serve_coordinator
from tinydist.graph.collectives import AUTO, Algorithm, Medium, check, choose_partitioned, resolve, resolve_partitioned, shard_bounds
from tinydist.graph.reduce_ops import MEAN, ReduceOp, collective_op
from tinydist.observability import tracing
from tinydist.transports.base import Link, PeerFailed, TransportError
from tinydist.transports.shm_group import TIMED_OUT, Abandoned, ShmGroup, WaitTimeout, open_group

T = TypeVar("T")
_CHOICES = 256   # allreduce choices a group memoises (`ProcessGroup._allreduce_choice`)
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


@dataclass
class _Call:
    """One collective as prepared on this rank: its header and how to run it once headers agree."""

    header: dict[str, Any]
    links: Callable[[dict[int, dict[str, Any]]], Awaitable[Any]]   # the body over links, given every header
    segment: Callable[[shm.Session], Any] | None = None              # the whole collective on the group segment
    nbytes: int = 0                                                  # this rank's input, for the trace


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
        self._last_choice: dict[str, str] = {}
        self._choices: dict[tuple[str, int, str, bool], tuple[Algorithm, str, str, str]] = {}   # `_allreduce_choice`

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

    def _begin(self, call: _Call) -> tuple[dict[str, Any], str]:
        """Refuse after a failure; number the call. Every rank numbers its calls alike."""
        if self._failure is not None:
            raise self._failure
        self._seq += 1
        return {"seq": self._seq, **call.header}, f"{call.header['coll']} (call #{self._seq})"

    async def _run(self, call: _Call) -> Any:
        if self.shm is None:
            return await self._collective(call)
        return await anyio.to_thread.run_sync(self._on_segment, call, anyio.from_thread.run)

    def blocking(self, collective: str, *args: Any, run_async: Callable[..., Any]) -> Any:
        """Run `collective` (all_reduce, all_gather, reduce_scatter, broadcast, barrier) from a thread
        that is not the group's event loop; `run_async(fn, *args)` runs a coroutine function there
        (a blocking portal's `call`). On the group segment the collective runs on this thread."""
        if self.fast is not None:
            if collective == "all_reduce":
                done = self.fast.all_reduce(*args)
                if done is not None:
                    return done
            elif collective == "barrier" and self.fast.barrier():
                return None
        call = getattr(self, f"_{collective}")(*args)
        if self.shm is None:
            return run_async(self._collective, call)
        return self._on_segment(call, run_async)

    def _traced(self, header: dict[str, Any], call: _Call, where: str) -> contextlib.AbstractContextManager[Any]:
        """The collective's span on this rank's `collective` lane: name, algorithm, bytes, world,
        rank, call number and where its data went (`segment` or `links`); a no-op when not tracing."""
        if tracing.active_tracer() is None:
            return contextlib.nullcontext()
        coll = header["coll"]
        return tracing.span(coll, process=f"rank{self.rank}", lane="collective", cat="collective", collective=coll,
                            algorithm=header.get("algorithm") or _ALGORITHM.get(coll, coll), bytes=call.nbytes,
                            world=self.world, rank=self.rank, seq=header["seq"], dtype=header.get("dtype", ""),
                            data=where)

    def _on_segment(self, call: _Call, run_async: Callable[..., Any]) -> Any:
        with self._thread_lock:
            header, name = self._begin(call)
            # tracing asked once a call; untraced, no span to build and no context manager to enter
            # (a nullcontext and a second active_tracer(): 5 Python calls, ~42 bytecodes of ~1,600)
            if tracing.active_tracer() is None:
                return self._on_segment_traced(call, run_async, header, name, None)
            with self._traced(header, call, "segment" if call.segment is not None else "links"):
                return self._on_segment_traced(call, run_async, header, name, f"rank{self.rank}")

    def _on_segment_traced(self, call: _Call, run_async: Callable[..., Any], header: dict[str, Any], name: str,
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
            if self._failure is None:
                self._failure = CollectiveError(f"{name} broke off on rank {self.rank} ({type(exc).__name__}: {exc}); "
                                                f"the ranks are out of step, so the group takes no more collectives")
                with contextlib.suppress(TransportError):
                    self.shm.give_up([self.rank], self.shm.step + 1, BROKE_OFF, self.rank)
            raise
        return run_async(self._guarded, name, lambda: call.links(headers), list, deadline - time.monotonic())

    def _agree(self, name: str, header: dict[str, Any], blob: bytes, blobs: dict[int, bytes]) -> dict[int, dict[str, Any]]:
        """Every rank's header from the segment, checked by `_verdict` (identical blobs need no parsing)."""
        if header.get("error") is None and all(b == blob for b in blobs.values()):
            return dict.fromkeys(blobs, header)
        headers = {r: json.loads(b) for r, b in blobs.items()}
        _verdict(name, headers)
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

    async def _collective(self, call: _Call) -> Any:
        async with self._lock:
            header, name = self._begin(call)
            with self._traced(header, call, "links"):
                return await self._collective_traced(call, header, name)

    async def _collective_traced(self, call: _Call, header: dict[str, Any], name: str) -> Any:
        if self.world == 1:
            _verdict(name, {0: header})
            return await call.links({0: header})
        headers: dict[int, dict[str, Any]] = {self.rank: header}

        async def run() -> Any:
            await self._exchange(header, headers)
            _verdict(name, headers)
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

    async def _exchange(self, header: dict[str, Any], into: dict[int, dict[str, Any]]) -> None:
        blob = json.dumps(header).encode()

        async def get(peer: int) -> None:
            async with self.links[peer].recv() as view:
                into[peer] = json.loads(bytes(view))

        async with anyio.create_task_group() as tg:
            for peer, link in self.links.items():
                tg.start_soon(link.send, blob)
                tg.start_soon(get, peer)

    def _log_choice(self, coll: str, algorithm: str, reason: str, **fields: Any) -> None:
        key = f"{algorithm}:{reason}"
        if self._last_choice.get(coll) != key:
            self._last_choice[coll] = key
            self.log.info("dist.algorithm", collective=coll, algorithm=algorithm, reason=reason, **fields)
        else:
            self.log.debug("dist.algorithm", collective=coll, algorithm=algorithm, reason=reason, **fields)

    # ---- collectives (numpy in, numpy out) --------------------------------------------------
    # Each `_name` prepares a `_Call`; `name` runs it from async code, `blocking("name", ...)` from a thread.

    async def all_reduce(self, x: np.ndarray, op: str = "sum", algorithm: str = "auto",
                         out: np.ndarray | None = None) -> np.ndarray:
        """The reduction of every rank's `x`; written into `out` (and `out` returned) when given: `out=x`
        overwrites the input, as torch.distributed.all_reduce does (see `_check_out` for what `out` must be)."""
        return await self._run(self._all_reduce(x, op, algorithm, out))

    async def all_gather(self, x: np.ndarray, axis: int = 0) -> np.ndarray:
        return await self._run(self._all_gather(x, axis))

    async def reduce_scatter(self, x: np.ndarray, op: str = "sum", axis: int = 0, algorithm: str = "auto") -> np.ndarray:
        return await self._run(self._reduce_scatter(x, op, axis, algorithm))

    async def broadcast(self, x: np.ndarray | None, src: int = 0) -> np.ndarray:
        return await self._run(self._broadcast(x, src))

    async def barrier(self) -> None:
        await self._run(self._barrier())

    def _all_reduce(self, x: np.ndarray, op: str, algorithm: str, out: np.ndarray | None = None) -> _Call:
        x = np.asarray(x, order="C")
        try:
            rop, error = collective_op(op), None
        except ValueError as exc:
            rop, error = ReduceOp.SUM, str(exc)      # never runs: the error goes in the header
        error = error or _check_out(out, x, np.dtype(np.float64) if op == MEAN and x.dtype.kind not in "fc" else x.dtype)
        chosen, name, reason, link = Algorithm.NAIVE, algorithm, "", ""
        if not error:
            try:
                chosen, name, reason, link = self._allreduce_choice(algorithm, x.nbytes)
            except ValueError as exc:
                error = str(exc)
        header = {"coll": "all_reduce", "op": op, "dtype": x.dtype.str, "shape": list(x.shape), "algorithm": name,
                  "error": error}
        on_segment = self.shm is not None and not error and chosen is not Algorithm.RING
        single_copy = on_segment and link == "single copy"
        if not error:
            self._log_choice("all_reduce", name, reason, nbytes=x.nbytes, link=link)
        # `out` passed `_check_out`: C-contiguous, so its flat view shares its memory
        flat_out = None if out is None else out.reshape(-1)

        async def body(_: dict[int, dict[str, Any]]) -> np.ndarray:
            flat = x.reshape(-1)
            ufunc = rop.ufunc
            if self.world == 1:
                acc = flat.copy()
            elif chosen == "naive":
                acc = await algo.naive(self.links, self.rank, self.world, flat, ufunc)
            elif chosen == "ring":
                acc = flat.copy()
                await algo.ring(self.links, self.rank, self.world, acc, shard_bounds(flat.size, self.world),
                                self.rank, self.world - 1, self.world - 1, ufunc)
            else:
                acc = np.empty_like(flat)
                await algo.all2all(self.links, self.rank, self.world, flat, acc, shard_bounds(flat.size, self.world), ufunc)
            return _result(_finish(acc, op, self.world, flat_out), x.shape, out)

        def segment(session: shm.Session) -> np.ndarray:
            run = shm.allreduce_single_copy if single_copy else shm.allreduce_naive if chosen == "naive" else shm.allreduce_all2all
            # reduce straight into `out` when it has the input's dtype (integer mean's float64 `out` does not)
            acc = flat_out if flat_out is not None and flat_out.dtype == x.dtype else np.empty(x.size, x.dtype)
            run(session, x.reshape(-1), acc, rop)
            return _result(_finish(acc, op, self.world, flat_out), x.shape, out)

        return _Call(header, body, segment if on_segment else None, x.nbytes)

    def _allreduce_choice(self, algorithm: str, nbytes: int) -> tuple[Algorithm, str, str, str]:
        """`resolve(algorithm, ...)` for an allreduce of `nbytes` here: the algorithm, its name (the
        header's), why, and the path its data takes (for the log). Memoised per (algorithm, bytes,
        TINYDIST_ALLREDUCE for auto, medium): the inputs decide it, and a repeated call (a training
        loop's) then spends one dict lookup, not resolve's, check's and the enum's Python (counted
        with the op parsed once: 8-9 of a 4 KiB two-process allreduce's ~70 Python calls, 90-128 of
        its ~1,700 bytecodes). An illegal
        `algorithm` raises ValueError every time, uncached. The memo is dropped when it holds
        `_CHOICES` keys (a loop over ever new sizes)."""
        key = (algorithm, nbytes, settings.ALLREDUCE if algorithm == AUTO else "", self.same_host)
        choice = self._choices.get(key)
        if choice is None:
            chosen, reason = resolve(algorithm, self.medium, self.world, nbytes)
            on_segment = self.shm is not None and chosen is not Algorithm.RING
            threshold = None if self.shm is None else self.shm.single_copy_bytes
            single_copy = on_segment and chosen is Algorithm.ALL2ALL and threshold is not None and nbytes >= threshold
            link = "single copy" if single_copy else "shm segment" if on_segment else "shm" if self.same_host else "tcp"
            if len(self._choices) >= _CHOICES:
                self._choices.clear()
            choice = self._choices[key] = (chosen, chosen.value, reason, link)
        return choice

    def _all_gather(self, x: np.ndarray, axis: int) -> _Call:
        x = np.asarray(x, order="C")
        error = None
        if x.ndim == 0:
            error = "all_gather needs at least one dimension"
        elif not -x.ndim <= axis < x.ndim:
            error = f"axis {axis} is out of range for {x.ndim} dimensions"
        ax = axis % x.ndim if x.ndim else 0
        other = [d for i, d in enumerate(x.shape) if i != ax]
        header = {"coll": "all_gather", "dtype": x.dtype.str, "axis": ax, "ndim": x.ndim, "shape_except_axis": other,
                  "length": x.shape[ax] if x.ndim else 0, "error": error}

        def moved() -> tuple[np.ndarray, int]:
            rows = np.asarray(np.moveaxis(x, ax, 0), order="C")
            return rows, math.prod(rows.shape[1:])

        async def body(headers: dict[int, dict[str, Any]]) -> np.ndarray:
            lengths = [headers[r]["length"] for r in range(self.world)]
            rows, row = moved()
            out = np.empty((sum(lengths), *rows.shape[1:]), x.dtype)
            flat = out.reshape(-1)
            starts = np.cumsum([0, *lengths])
            bounds = [(int(starts[i]) * row, int(starts[i + 1]) * row) for i in range(self.world)]
            a, b = bounds[self.rank]
            flat[a:b] = rows.reshape(-1)
            if self.world > 1:
                chosen, reason = choose_partitioned("all_gather", self.medium, self.world)
                self._log_choice("all_gather", chosen.value, reason)
                if chosen is Algorithm.RING:
                    await algo.ring(self.links, self.rank, self.world, flat, bounds, self.rank, 0, self.world - 1, None)
                else:
                    await algo.direct_gather(self.links, self.rank, flat, bounds)
            return np.moveaxis(out, 0, ax)

        def segment(session: shm.Session) -> np.ndarray:
            self._log_choice("all_gather", "direct", "shared memory: every rank copies each piece from its owner's region")
            rows, row = moved()
            flat, headers = shm.all_gather(session, rows.reshape(-1), lambda hs: [hs[r]["length"] * row for r in range(self.world)])
            return np.moveaxis(flat.reshape((sum(headers[r]["length"] for r in range(self.world)), *rows.shape[1:])), 0, ax)

        return _Call(header, body, segment if self.shm is not None and not error else None, x.nbytes)

    def _reduce_scatter(self, x: np.ndarray, op: str, axis: int, algorithm: str) -> _Call:
        x = np.asarray(x, order="C")
        error = _check_op(op) or _check_algorithm(algorithm, self.medium)
        if x.ndim == 0:
            error = error or "reduce_scatter needs at least one dimension"
        elif not -x.ndim <= axis < x.ndim:
            error = error or f"axis {axis} is out of range for {x.ndim} dimensions"
        ax = axis % x.ndim if x.ndim else 0
        chosen, reason = "all2all", ""
        if not error:
            algorithm_, reason = resolve_partitioned(algorithm, "reduce_scatter", self.medium, self.world)
            chosen = algorithm_.value
        header = {"coll": "reduce_scatter", "op": op, "dtype": x.dtype.str, "shape": list(x.shape), "axis": ax,
                  "algorithm": chosen, "error": error}

        def layout() -> tuple[np.ndarray, list[tuple[int, int]], list[tuple[int, int]]]:
            rows = np.asarray(np.moveaxis(x, ax, 0), order="C")
            row = math.prod(rows.shape[1:])
            parts = shard_bounds(rows.shape[0], self.world)
            return rows, parts, [(a * row, b * row) for a, b in parts]

        def finish(rows: np.ndarray, parts: list[tuple[int, int]], piece: np.ndarray) -> np.ndarray:
            shape = (parts[self.rank][1] - parts[self.rank][0], *rows.shape[1:])
            return np.moveaxis(_finish(piece, op, self.world, None).reshape(shape), 0, ax)

        async def body(_: dict[int, dict[str, Any]]) -> np.ndarray:
            rows, parts, bounds = layout()
            flat = rows.reshape(-1)
            ufunc = collective_op(op).ufunc
            a, b = bounds[self.rank]
            if self.world > 1:
                self._log_choice("reduce_scatter", chosen, reason)
            if self.world == 1:
                piece = flat.copy()
            elif chosen == "ring":
                out = flat.copy()
                await algo.ring(self.links, self.rank, self.world, out, bounds, self.rank - 1, self.world - 1, 0, ufunc)
                piece = out[a:b]
            else:
                out = np.empty_like(flat)
                await algo.all2all(self.links, self.rank, self.world, flat, out, bounds, ufunc, gather=False)
                piece = out[a:b]
            return finish(rows, parts, piece)

        def segment(session: shm.Session) -> np.ndarray:
            rows, parts, bounds = layout()
            return finish(rows, parts, shm.reduce_scatter(session, rows.reshape(-1), bounds, collective_op(op)))

        return _Call(header, body, segment if self.shm is not None and not error and chosen != "ring" else None, x.nbytes)

    def _broadcast(self, x: np.ndarray | None, src: int) -> _Call:
        error = None if 0 <= src < self.world else f"src {src} is outside 0..{self.world - 1}"
        if x is None and self.rank == src:
            error = error or "the source rank must pass a tensor"
        arr = None if x is None else np.asarray(x, order="C")
        header = {"coll": "broadcast", "src": src, "error": error,
                  "dtype": None if arr is None else arr.dtype.str, "shape": None if arr is None else list(arr.shape)}

        def root(headers: dict[int, dict[str, Any]]) -> tuple[tuple[int, ...], np.dtype]:
            return tuple(headers[src]["shape"]), np.dtype(headers[src]["dtype"])

        async def body(headers: dict[int, dict[str, Any]]) -> np.ndarray:
            out = arr.copy() if self.rank == src and arr is not None else np.empty(*root(headers))  # src has one: see error
            if self.world > 1:
                await algo.broadcast(self.links, self.rank, src, out.reshape(-1))
            return out

        def segment(session: shm.Session) -> np.ndarray:
            return shm.broadcast(session, src, arr if self.rank == src else None, root)

        return _Call(header, body, segment if self.shm is not None and not error else None,
                     0 if arr is None else arr.nbytes)

    def _barrier(self) -> _Call:
        async def body(_: dict[int, dict[str, Any]]) -> None:
            return None
        return _Call({"coll": "barrier"}, body, shm.barrier if self.shm is not None else None)


# ---- helpers ----------------------------------------------------------------------------------

def _check_op(op: str) -> str | None:
    try:
        collective_op(op)
    except ValueError as exc:
        return str(exc)
    return None


def _check_algorithm(algorithm: str, medium: Medium) -> str | None:
    try:
        check(algorithm, medium)
    except ValueError as exc:
        return str(exc)
    return None


def _check_out(out: Any, x: np.ndarray, dtype: np.dtype) -> str | None:
    """Why `out` cannot take a result shaped like `x` of `dtype` (None if it can, or if there is no `out`).
    Checked before the collective and sent in the header, so every rank refuses the call and no rank's
    `out` is touched."""
    if out is None:
        return None
    if not isinstance(out, np.ndarray):
        return (f"out= must be a numpy array, not {type(out).__name__}; for a td.Tensor t, drop out= "
                f"and t.assign() the result")
    what = f"out= (a {out.dtype} array of shape {out.shape})"
    if not out.flags.writeable:
        return f"{what} is read-only; pass a writeable array (np.array(out) copies it) or drop out= for a new result"
    if not out.flags.c_contiguous:
        return (f"{what} is not C-contiguous, so the result cannot be written in place; pass a contiguous "
                f"array (np.ascontiguousarray) or drop out= for a new result")
    if out.shape != x.shape or out.dtype != dtype:
        return f"{what} does not fit the result, a {dtype} array of shape {x.shape}"
    if np.may_share_memory(out, x) and out.ctypes.data != x.ctypes.data:
        return f"{what} overlaps the input without being it; pass the input itself (in place) or a separate array"
    return None


def _finish(acc: np.ndarray, op: str, world: int, out: np.ndarray | None) -> np.ndarray:
    """The collective's flat result from the flat reduction `acc`: divided by `world` for mean (integer
    mean is float64, as numpy's), and in `out` when given (copied there unless `acc` is `out`)."""
    if op == MEAN:
        if acc.dtype.kind in "fc":
            acc /= world
        else:
            acc = np.divide(acc, world, out=out)
    if out is not None and acc is not out:
        np.copyto(out, acc)
        return out
    return acc


def _result(flat: np.ndarray, shape: tuple[int, ...], out: np.ndarray | None) -> np.ndarray:
    """`out` itself when the caller gave one (numpy's `out=` convention), else `flat` in `shape`."""
    return flat.reshape(shape) if out is None else out


_FIELDS = ("coll", "op", "dtype", "shape", "axis", "ndim", "shape_except_axis", "src", "algorithm")


def _verdict(name: str, headers: dict[int, dict[str, Any]]) -> None:
    """Raise the same CollectiveMismatch on every rank when the headers disagree."""
    ranks = sorted(headers)
    bad = [f"rank {r}: {headers[r]['error']}" for r in ranks if headers[r].get("error")]
    if bad:
        raise CollectiveMismatch(f"{name}: invalid arguments on {'; '.join(bad)}")
    seqs = {headers[r].get("seq") for r in ranks}
    if len(seqs) > 1:
        raise CollectiveMismatch(f"{name}: ranks are at different collective calls: "
                                 + ", ".join(f"rank {r} #{headers[r].get('seq')}" for r in ranks))
    problems = []
    broadcast = headers[ranks[0]].get("coll") == "broadcast"
    for field in _FIELDS:
        values = {r: headers[r].get(field) for r in ranks}
        if broadcast and field in ("shape", "dtype"):   # non-root ranks may pass no tensor
            values = {r: v for r, v in values.items() if v is not None}
        if len({json.dumps(v) for v in values.values()}) > 1:
            problems.append(f"{field}: " + ", ".join(f"rank {r} {_show(field, v)}" for r, v in values.items()))
            if field == "coll":
                break
    if problems:
        raise CollectiveMismatch(f"{name}: ranks disagree on " + "; ".join(problems))


def _show(field: str, value: Any) -> str:
    if field == "dtype" and value is not None:
        return str(np.dtype(value))
    if field in ("shape", "shape_except_axis") and value is not None:
        return str(tuple(value))
    return repr(value)


def _peer_failure(exc: BaseException) -> PeerFailed | None:
    if isinstance(exc, PeerFailed):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _peer_failure(inner)
            if found is not None:
                return found
    return None
