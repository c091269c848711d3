"""The collectives as calls: each of `ProcessGroup`'s collectives prepared as a `Call` — the header
every rank publishes (so all reach the same verdict before any data moves), its body over links and,
on one host, its whole run on the group segment.

A preparer runs no communication: it checks its arguments (an error goes in the header, so every
rank refuses the call alike and no rank's `out` is touched), asks the group's `dispatch` for the
algorithm, and closes over what the bodies need. `ProcessGroup` runs the call (`tinydist.dist.group`).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tinydist.dist import algorithms as algo
from tinydist.dist import shm_algorithms as shm
from tinydist.graph.collectives import Algorithm, Medium, check, choose_partitioned, resolve_partitioned, shard_bounds
from tinydist.graph.reduce_ops import MEAN, ReduceOp, collective_op

if TYPE_CHECKING:
    from tinydist.dist.group import ProcessGroup


@dataclass
class Call:
    """One collective as prepared on this rank: its header and how to run it once headers agree."""

    header: dict[str, Any]
    links: Callable[[dict[int, dict[str, Any]]], Awaitable[Any]]   # the body over links, given every header
    segment: Callable[[shm.Session], Any] | None = None              # the whole collective on the group segment
    nbytes: int = 0                                                  # this rank's input, for the trace
    # over links: data every peer gets right behind the header (`ProcessGroup._exchange`), so the call
    # takes one message round, not the header's then the data's; the header says `eager` so that, on a
    # mismatch, each rank knows which peers' data to drain
    eager: np.ndarray | None = None
    # over TCP links: the body on the calling thread, the links' readers paused (`ProcessGroup._direct`)
    direct: Callable[[dict[int, dict[str, Any]]], Any] | None = None
    # with `eager`, on this thread: the messages a peer's data comes in, expected right behind its header
    # when that header agrees with ours
    early: Callable[[int], list[Any]] | None = None
    sent: list[int] | None = None      # counts the header exchange's sent messages for `early`'s reduce


def all_reduce(group: ProcessGroup, x: np.ndarray, op: str, algorithm: str, out: np.ndarray | None = None) -> Call:
    x = np.asarray(x, order="C")
    try:
        rop, error = collective_op(op), None
    except ValueError as exc:
        rop, error = ReduceOp.SUM, str(exc)      # never runs: the error goes in the header
    error = error or check_out(out, x, np.dtype(np.float64) if op == MEAN and x.dtype.kind not in "fc" else x.dtype)
    chosen, name, reason, link = Algorithm.NAIVE, algorithm, "", ""
    if not error:
        try:
            chosen, name, reason, link = group.dispatch.allreduce(algorithm, x.nbytes)
        except ValueError as exc:
            error = str(exc)
    # naive in one chunk over links: every peer gets our whole input as one message, which can go with the
    # header (every rank that agrees with this header decides alike: same algorithm, dtype and shape).
    # Not an empty input: naive sends no message for it
    eager = (group.shm is None and group.world > 1 and not error and chosen is Algorithm.NAIVE
             and 0 < x.size <= algo.chunk_elements(x.itemsize))
    header = {"coll": "all_reduce", "op": op, "dtype": x.dtype.str, "shape": list(x.shape), "algorithm": name,
              "error": error, "eager": eager}
    on_segment = group.shm is not None and not error and chosen is not Algorithm.RING
    single_copy = on_segment and link == "single copy"
    if not error:
        group.dispatch.log("all_reduce", name, reason, nbytes=x.nbytes, link=link)
    # `out` passed `check_out`: C-contiguous, so its flat view shares its memory
    flat_out = None if out is None else out.reshape(-1)

    def ring_buffer(flat: np.ndarray) -> np.ndarray:
        """Where ring reduces: it works in place, so straight in `out` when it has the input's dtype (the
        input itself when out=x): no copy of the input in and of the result out (two passes over the
        data, a sixth of a 2-rank 64 MiB ring over TCP)."""
        if flat_out is not None and flat_out.dtype == x.dtype:
            if flat_out.ctypes.data != flat.ctypes.data:
                np.copyto(flat_out, flat)
            return flat_out
        return flat.copy()

    async def body(_: dict[int, dict[str, Any]]) -> np.ndarray:
        flat = x.reshape(-1)
        ufunc = rop.ufunc
        own = flat_out is not None and flat_out.ctypes.data == flat.ctypes.data   # out=x (check_out: else apart)
        if group.world == 1:
            acc = flat.copy()
        elif chosen == "naive":
            # naive sends its input while it reduces, so only an `out` apart from the input takes the result
            into = flat_out if flat_out is not None and flat_out.dtype == x.dtype and not own else None
            acc = await algo.naive(group.links, group.rank, group.world, flat, ufunc, into, sent=eager)
        elif chosen == "ring":
            acc = ring_buffer(flat)
            await algo.ring(group.links, group.rank, group.world, acc, shard_bounds(flat.size, group.world),
                            group.rank, group.world - 1, group.world - 1, ufunc)
        else:
            acc = np.empty_like(flat)
            await algo.all2all(group.links, group.rank, group.world, flat, acc, shard_bounds(flat.size, group.world), ufunc)
        return _result(_finish(acc, op, group.world, flat_out), x.shape, out)

    def segment(session: shm.Session) -> np.ndarray:
        run = shm.allreduce_single_copy if single_copy else shm.allreduce_naive if chosen == "naive" else shm.allreduce_all2all
        # reduce straight into `out` when it has the input's dtype (integer mean's float64 `out` does not)
        acc = flat_out if flat_out is not None and flat_out.dtype == x.dtype else np.empty(x.size, x.dtype)
        run(session, x.reshape(-1), acc, rop)
        return _result(_finish(acc, op, group.world, flat_out), x.shape, out)

    plan: list[algo.NaiveDirect] = []
    gone = [-1]     # with `eager`: the messages of the header exchange sent (the header, then the data)

    def naive_plan() -> algo.NaiveDirect:
        """The naive call on this thread, made once (the header exchange may ask first, for `early`)."""
        if not plan:
            flat = x.reshape(-1)
            own = flat_out is not None and flat_out.ctypes.data == flat.ctypes.data
            # naive sends its input while it reduces: into `out` only when apart from the input, or in
            # place with one peer and sum or prod; else a buffer the group keeps (out=x) or a new one
            if flat_out is not None and flat_out.dtype == x.dtype and not own:
                into = flat_out
            elif own and group.world == 2 and rop in (ReduceOp.SUM, ReduceOp.PROD):
                into = flat                 # x op theirs in place, as theirs op x on the peer
            elif flat_out is not None:
                into = group.scratch("naive-out", flat.size, x.dtype)
            else:
                into = np.empty_like(flat)
            plan.append(algo.NaiveDirect(group.move, group.scratch, list(group.links), group.rank, group.world, flat,
                                         rop.ufunc, into, sent=eager, gone=gone if eager else None))
        return plan[0]

    def direct(_: dict[int, dict[str, Any]]) -> np.ndarray:
        flat = x.reshape(-1)
        if chosen is Algorithm.NAIVE:
            acc = naive_plan().run()
        else:
            acc = ring_buffer(flat)
            algo.ring_direct(group.move, group.scratch, group.rank, group.world, acc, shard_bounds(flat.size, group.world),
                             group.rank, group.world - 1, group.world - 1, rop.ufunc)
        return _result(_finish(acc, op, group.world, flat_out), x.shape, out)

    direct_ok = group.shm is None and group.world > 1 and not error and chosen in (Algorithm.NAIVE, Algorithm.RING)
    return Call(header, body, segment if on_segment else None, x.nbytes, x.reshape(-1) if eager else None,
                direct if direct_ok else None, (lambda peer: naive_plan().expects(peer)) if direct_ok and eager else None,
                gone if direct_ok and eager else None)


def all_gather(group: ProcessGroup, x: np.ndarray, axis: int) -> Call:
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
        lengths = [headers[r]["length"] for r in range(group.world)]
        rows, row = moved()
        out = np.empty((sum(lengths), *rows.shape[1:]), x.dtype)
        flat = out.reshape(-1)
        starts = np.cumsum([0, *lengths])
        bounds = [(int(starts[i]) * row, int(starts[i + 1]) * row) for i in range(group.world)]
        a, b = bounds[group.rank]
        flat[a:b] = rows.reshape(-1)
        if group.world > 1:
            chosen, reason = choose_partitioned("all_gather", group.medium, group.world)
            group.dispatch.log("all_gather", chosen.value, reason)
            if chosen is Algorithm.RING:
                await algo.ring(group.links, group.rank, group.world, flat, bounds, group.rank, 0, group.world - 1, None)
            else:
                await algo.direct_gather(group.links, group.rank, flat, bounds)
        return np.moveaxis(out, 0, ax)

    def segment(session: shm.Session) -> np.ndarray:
        group.dispatch.log("all_gather", "direct", "shared memory: every rank copies each piece from its owner's region")
        rows, row = moved()
        flat, headers = shm.all_gather(session, rows.reshape(-1), lambda hs: [hs[r]["length"] * row for r in range(group.world)])
        return np.moveaxis(flat.reshape((sum(headers[r]["length"] for r in range(group.world)), *rows.shape[1:])), 0, ax)

    return Call(header, body, segment if group.shm is not None and not error else None, x.nbytes)


def reduce_scatter(group: ProcessGroup, x: np.ndarray, op: str, axis: int, algorithm: str) -> Call:
    x = np.asarray(x, order="C")
    error = _check_op(op) or _check_algorithm(algorithm, group.medium)
    if x.ndim == 0:
        error = error or "reduce_scatter needs at least one dimension"
    elif not -x.ndim <= axis < x.ndim:
        error = error or f"axis {axis} is out of range for {x.ndim} dimensions"
    ax = axis % x.ndim if x.ndim else 0
    chosen, reason = "all2all", ""
    if not error:
        algorithm_, reason = resolve_partitioned(algorithm, "reduce_scatter", group.medium, group.world)
        chosen = algorithm_.value
    header = {"coll": "reduce_scatter", "op": op, "dtype": x.dtype.str, "shape": list(x.shape), "axis": ax,
              "algorithm": chosen, "error": error}

    def layout() -> tuple[np.ndarray, list[tuple[int, int]], list[tuple[int, int]]]:
        rows = np.asarray(np.moveaxis(x, ax, 0), order="C")
        row = math.prod(rows.shape[1:])
        parts = shard_bounds(rows.shape[0], group.world)
        return rows, parts, [(a * row, b * row) for a, b in parts]

    def finish(rows: np.ndarray, parts: list[tuple[int, int]], piece: np.ndarray) -> np.ndarray:
        shape = (parts[group.rank][1] - parts[group.rank][0], *rows.shape[1:])
        return np.moveaxis(_finish(piece, op, group.world, None).reshape(shape), 0, ax)

    async def body(_: dict[int, dict[str, Any]]) -> np.ndarray:
        rows, parts, bounds = layout()
        flat = rows.reshape(-1)
        ufunc = collective_op(op).ufunc
        a, b = bounds[group.rank]
        if group.world > 1:
            group.dispatch.log("reduce_scatter", chosen, reason)
        if group.world == 1:
            piece = flat.copy()
        elif chosen == "ring":
            out = flat.copy()
            await algo.ring(group.links, group.rank, group.world, out, bounds, group.rank - 1, group.world - 1, 0, ufunc)
            piece = out[a:b]
        else:
            out = np.empty_like(flat)
            await algo.all2all(group.links, group.rank, group.world, flat, out, bounds, ufunc, gather=False)
            piece = out[a:b]
        return finish(rows, parts, piece)

    def segment(session: shm.Session) -> np.ndarray:
        rows, parts, bounds = layout()
        return finish(rows, parts, shm.reduce_scatter(session, rows.reshape(-1), bounds, collective_op(op)))

    return Call(header, body, segment if group.shm is not None and not error and chosen != "ring" else None, x.nbytes)


def broadcast(group: ProcessGroup, x: np.ndarray | None, src: int) -> Call:
    error = None if 0 <= src < group.world else f"src {src} is outside 0..{group.world - 1}"
    if x is None and group.rank == src:
        error = error or "the source rank must pass a tensor"
    arr = None if x is None else np.asarray(x, order="C")
    header = {"coll": "broadcast", "src": src, "error": error,
              "dtype": None if arr is None else arr.dtype.str, "shape": None if arr is None else list(arr.shape)}

    def root(headers: dict[int, dict[str, Any]]) -> tuple[tuple[int, ...], np.dtype]:
        return tuple(headers[src]["shape"]), np.dtype(headers[src]["dtype"])

    async def body(headers: dict[int, dict[str, Any]]) -> np.ndarray:
        out = arr.copy() if group.rank == src and arr is not None else np.empty(*root(headers))  # src has one: see error
        if group.world > 1:
            await algo.broadcast(group.links, group.rank, src, out.reshape(-1))
        return out

    def segment(session: shm.Session) -> np.ndarray:
        return shm.broadcast(session, src, arr if group.rank == src else None, root)

    return Call(header, body, segment if group.shm is not None and not error else None,
                 0 if arr is None else arr.nbytes)


def barrier(group: ProcessGroup) -> Call:
    async def body(_: dict[int, dict[str, Any]]) -> None:
        return None
    def direct(_: dict[int, dict[str, Any]]) -> None:
        return None
    return Call({"coll": "barrier"}, body, shm.barrier if group.shm is not None else None, direct=direct)


# what `ProcessGroup.blocking(name, ...)` prepares
PREPARE: dict[str, Callable[..., Call]] = {"all_reduce": all_reduce, "all_gather": all_gather, "reduce_scatter": reduce_scatter,
                                           "broadcast": broadcast, "barrier": barrier}


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


def check_out(out: Any, x: np.ndarray, dtype: np.dtype) -> str | None:
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
