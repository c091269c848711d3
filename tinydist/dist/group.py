"""`ProcessGroup`: the async core of tinydist.dist. One per process; collectives run one at a time.

Every collective starts with a header exchange: each rank sends every peer a small JSON header
(sequence number, collective, op, dtype, shape, axis, root, resolved algorithm, local argument
errors) and reads theirs. All ranks therefore see the same headers and reach the same verdict: if
they disagree, every rank raises the same `CollectiveMismatch` before any data moves (and the group
stays usable). The exchange doubles as the barrier, and tells allgather each rank's piece length.

Failures: a link that sees EOF/reset without a BYE (or an ABORT naming a rank) calls back here; the
group records `RankFailed(rank)`, cancels the collective in flight, and tells the other peers with
ABORT frames. A collective that outlives TINYDIST_COLLECTIVE_TIMEOUT raises `CollectiveTimeout`
naming the ranks it still waited for. After either, the group refuses further collectives.
"""

from __future__ import annotations

import contextlib
import json
import math
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
import numpy as np

from tinydist.config import settings
from tinydist.dist import algorithms as algo
from tinydist.dist.errors import CollectiveError, CollectiveMismatch, CollectiveTimeout, RankFailed
from tinydist.dist.rendezvous import connect_mesh, register, serve_coordinator
from tinydist.logs import get_logger
from transports.base import Link, PeerFailed

T = TypeVar("T")

OPS: dict[str, Callable[..., np.ndarray]] = {
    "sum": np.add, "mean": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}
ALGORITHMS = ("naive", "ring", "all2all")

# auto-selection thresholds (bytes of the whole tensor); bench/allreduce.py measured them.
SMALL_BYTES = 64 * 1024


def choose_allreduce(world: int, nbytes: int, same_host: bool) -> tuple[str, str]:
    """The algorithm `auto` picks, and why. Deterministic in its inputs, so every rank agrees.

    Measured (bench/allreduce.py, docs/collectives.md): naive wins only for small messages (one
    step instead of 2(N-1)); past that it moves (N-1)x the bytes and loses up to 3x.
    """
    if world <= 1:
        return "naive", "one rank"
    if nbytes <= SMALL_BYTES:
        return "naive", f"{nbytes} B <= {SMALL_BYTES} B: one step of small messages beats 2(N-1) steps"
    if world == 2:
        return "ring", "2 ranks: ring halves what each rank moves and reduces, pipelined"
    if same_host:
        return "all2all", "shared memory: 2(N-1)/N of the bytes in two steps, each chunk reduced once"
    return "ring", "network: bandwidth-optimal 2(N-1)/N of the bytes, one neighbour per step"


class ProcessGroup:
    """All ranks of one job, connected pairwise. Use `ProcessGroup.open(...)` (an async context manager)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.links: dict[int, Link] = {}
        self.same_host = True
        self.log = get_logger(rank=rank, world=world)
        self._lock = anyio.Lock()
        self._seq = 0
        self._failure: CollectiveError | None = None
        self._scope: anyio.CancelScope | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._last_choice: dict[str, str] = {}

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
                        coordinator_sock = socket.create_server(coordinator, reuse_port=False)
                    tg.start_soon(serve_coordinator, coordinator_sock, world, timeout)
                table, listener = await register(coordinator, rank, world, timeout)
                group.links = await connect_mesh(rank, world, table, listener, transport, group._on_link_failure, timeout)
                hosts = {info["host"] for info in table["peers"].values()}
                group.same_host = len(hosts) == 1 and transport != "tcp"
                for link in group.links.values():
                    tg.start_soon(link.serve)
            group.log.debug("dist.init", links={p: link.kind for p, link in group.links.items()})
            try:
                yield group
            finally:
                with anyio.CancelScope(shield=True):
                    await group._close()

    async def _close(self) -> None:
        blamed = self._failure.rank if isinstance(self._failure, RankFailed) else None
        async with anyio.create_task_group() as tg:
            for link in self.links.values():
                tg.start_soon(lambda link=link: link.close(linger=2.0, abort_blame=blamed))

    def fail(self, rank: int, reason: str) -> None:
        """Declare `rank` failed from outside (the cluster scheduler saw its node die): same path as a
        link that saw EOF, so the collective in flight and every later one raise RankFailed(rank)."""
        self._on_link_failure(rank, reason, rank)

    def _on_link_failure(self, peer: int, reason: str, blamed: int) -> None:
        if self._failure is not None:
            return
        self._failure = RankFailed(blamed, f"rank {blamed} failed: {reason}")
        self.log.warning("dist.rank_failed", failed_rank=blamed, noticed_via=peer, reason=reason)
        if self._scope is not None:
            self._scope.cancel()
        if self._tg is not None:
            for p, link in self.links.items():
                if p not in (peer, blamed):
                    self._tg.start_soon(link.abort, blamed)   # type: ignore[attr-defined]

    # ---- the collective driver --------------------------------------------------------------

    async def _collective(self, header: dict[str, Any], body: Callable[[dict[int, dict[str, Any]]], Awaitable[T]]) -> T:
        async with self._lock:
            if self._failure is not None:
                raise self._failure
            self._seq += 1
            header = {"seq": self._seq, **header}
            name = f"{header['coll']} (call #{self._seq})"
            if self.world == 1:
                _verdict(name, {0: header})
                return await body({0: header})
            timeout = settings.COLLECTIVE_TIMEOUT
            headers: dict[int, dict[str, Any]] = {self.rank: header}
            result: Any = None
            try:
                with anyio.CancelScope() as scope:
                    self._scope = scope
                    with anyio.move_on_after(timeout) as deadline:
                        try:
                            await self._exchange(header, headers)
                            _verdict(name, headers)
                            result = await body(headers)
                            return result
                        except (PeerFailed, ExceptionGroup) as exc:
                            peer = _peer_failure(exc)
                            if peer is None:
                                raise
                            if self._failure is None:
                                self._failure = RankFailed(peer.blamed, f"rank {peer.blamed} failed: {peer.reason}")
            finally:
                self._scope = None
            if self._failure is not None:
                raise RankFailed(self._failure.rank if isinstance(self._failure, RankFailed) else -1,
                                 f"{name}: {self._failure}") from None
            if deadline.cancelled_caught:
                missing = sorted(set(range(self.world)) - set(headers))
                waiting = missing or sorted(self.links)
                what = f"no call from ranks {missing}" if missing else f"data from ranks {waiting} did not arrive"
                self._failure = CollectiveTimeout(waiting, f"{name} timed out after {timeout:g} s on rank {self.rank}: "
                                                           f"{what} (TINYDIST_COLLECTIVE_TIMEOUT)")
                raise self._failure
            raise CollectiveError(f"{name} was cancelled")  # pragma: no cover

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

    async def all_reduce(self, x: np.ndarray, op: str = "sum", algorithm: str = "auto") -> np.ndarray:
        x = np.asarray(x, order="C")
        error = _check_op(op) or _check_algorithm(algorithm)
        chosen, reason = algorithm, "requested"
        if not error and algorithm == "auto":
            if settings.ALLREDUCE != "auto":
                chosen, reason = settings.ALLREDUCE, "TINYDIST_ALLREDUCE"
            else:
                chosen, reason = choose_allreduce(self.world, x.nbytes, self.same_host)
        header = {"coll": "all_reduce", "op": op, "dtype": x.dtype.str, "shape": list(x.shape), "algorithm": chosen, "error": error}
        if not error:
            self._log_choice("all_reduce", chosen, reason, nbytes=x.nbytes, link="shm" if self.same_host else "tcp")

        async def body(_: dict[int, dict[str, Any]]) -> np.ndarray:
            flat = x.reshape(-1)
            ufunc = OPS[op]
            if self.world == 1:
                out = flat.copy()
            elif chosen == "naive":
                out = await algo.naive(self.links, self.rank, self.world, flat, ufunc)
            elif chosen == "ring":
                out = flat.copy()
                await algo.ring(self.links, self.rank, self.world, out, algo.split_bounds(flat.size, self.world),
                                self.rank, self.world - 1, self.world - 1, ufunc)
            else:
                out = np.empty_like(flat)
                await algo.all2all(self.links, self.rank, self.world, flat, out, algo.split_bounds(flat.size, self.world), ufunc)
            return _finish(out, op, self.world).reshape(x.shape)

        return await self._collective(header, body)

    async def all_gather(self, x: np.ndarray, axis: int = 0) -> np.ndarray:
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

        async def body(headers: dict[int, dict[str, Any]]) -> np.ndarray:
            lengths = [headers[r]["length"] for r in range(self.world)]
            moved = np.asarray(np.moveaxis(x, ax, 0), order="C")
            row = math.prod(moved.shape[1:])
            out = np.empty((sum(lengths), *moved.shape[1:]), x.dtype)
            flat = out.reshape(-1)
            starts = np.cumsum([0, *lengths])
            bounds = [(int(starts[i]) * row, int(starts[i + 1]) * row) for i in range(self.world)]
            a, b = bounds[self.rank]
            flat[a:b] = moved.reshape(-1)
            if self.world > 1:
                if self.same_host or self.world == 2:
                    self._log_choice("all_gather", "direct", "one step: each piece goes straight to every rank")
                    await algo.direct_gather(self.links, self.rank, flat, bounds)
                else:
                    self._log_choice("all_gather", "ring", "network: one neighbour per step")
                    await algo.ring(self.links, self.rank, self.world, flat, bounds, self.rank, 0, self.world - 1, None)
            return np.moveaxis(out, 0, ax)

        return await self._collective(header, body)

    async def reduce_scatter(self, x: np.ndarray, op: str = "sum", axis: int = 0, algorithm: str = "auto") -> np.ndarray:
        x = np.asarray(x, order="C")
        error = _check_op(op) or _check_algorithm(algorithm)
        if x.ndim == 0:
            error = error or "reduce_scatter needs at least one dimension"
        elif not -x.ndim <= axis < x.ndim:
            error = error or f"axis {axis} is out of range for {x.ndim} dimensions"
        ax = axis % x.ndim if x.ndim else 0
        chosen = algorithm
        if algorithm == "auto":
            chosen = "ring" if not self.same_host and self.world > 2 else "all2all"
        elif algorithm == "naive":
            chosen = "all2all"
        header = {"coll": "reduce_scatter", "op": op, "dtype": x.dtype.str, "shape": list(x.shape), "axis": ax,
                  "algorithm": chosen, "error": error}

        async def body(_: dict[int, dict[str, Any]]) -> np.ndarray:
            moved = np.asarray(np.moveaxis(x, ax, 0), order="C")
            row = math.prod(moved.shape[1:])
            rows = algo.split_bounds(moved.shape[0], self.world)
            bounds = [(a * row, b * row) for a, b in rows]
            flat = moved.reshape(-1)
            ufunc = OPS[op]
            a, b = bounds[self.rank]
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
            shape = (rows[self.rank][1] - rows[self.rank][0], *moved.shape[1:])
            return np.moveaxis(_finish(piece, op, self.world).reshape(shape), 0, ax)

        return await self._collective(header, body)

    async def broadcast(self, x: np.ndarray | None, src: int = 0) -> np.ndarray:
        error = None if 0 <= src < self.world else f"src {src} is outside 0..{self.world - 1}"
        if x is None and self.rank == src:
            error = error or "the source rank must pass a tensor"
        arr = None if x is None else np.asarray(x, order="C")
        header = {"coll": "broadcast", "src": src, "error": error,
                  "dtype": None if arr is None else arr.dtype.str, "shape": None if arr is None else list(arr.shape)}

        async def body(headers: dict[int, dict[str, Any]]) -> np.ndarray:
            root = headers[src]
            out = arr.copy() if self.rank == src else np.empty(root["shape"], np.dtype(root["dtype"]))
            if self.world > 1:
                await algo.broadcast(self.links, self.rank, src, out.reshape(-1))
            return out

        return await self._collective(header, body)

    async def barrier(self) -> None:
        async def body(_: dict[int, dict[str, Any]]) -> None:
            return None
        await self._collective({"coll": "barrier"}, body)


# ---- helpers ----------------------------------------------------------------------------------

def _check_op(op: str) -> str | None:
    return None if op in OPS else f"unknown op {op!r}; expected one of {', '.join(OPS)}"


def _check_algorithm(algorithm: str) -> str | None:
    return None if algorithm in ("auto", *ALGORITHMS) else f"unknown algorithm {algorithm!r}; expected auto, {', '.join(ALGORITHMS)}"


def _finish(out: np.ndarray, op: str, world: int) -> np.ndarray:
    if op != "mean":
        return out
    if out.dtype.kind in "fc":
        out /= world
        return out
    return out / world       # integer mean is float64, as numpy's mean


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
