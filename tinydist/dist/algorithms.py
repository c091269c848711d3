"""Collective algorithms over flat numpy arrays and point-to-point links, chunked and pipelined.

Every algorithm cuts its data into chunks of at most `CHUNK_BYTES` (one shared-memory slot, so a
chunk is reduced straight out of the peer's memory) and runs one sender and one receiver task per
link, so chunk k+1 travels while chunk k is reduced. Both sides derive the same chunk plan from the
same bounds, so no chunk carries a tag: each link is an ordered stream.

- naive:    every rank sends all its data to every peer; each rank reduces in rank order 0..N-1, so
            every rank gets bitwise the same result. (N-1)·n bytes out per rank, one step.
- ring:     reduce-scatter then allgather around the ring, 2(N-1) steps of n/N bytes; the sender of
            step s forwards chunk k as soon as the receiver has reduced chunk k of step s-1.
- all2all:  rank i owns segment i: every rank sends segment j straight to rank j, which reduces
            it, then sends its reduced segment straight to everyone; 2(N-1)·n/N bytes, two steps.
            A reduced chunk goes out as soon as the last peer's contribution to it is in.

While tracing, each algorithm step is a span on the rank's `collective steps` lane, timed by its
receiver (the step ends when its last chunk is in and reduced): ring's `reduce-scatter step s` and
`allgather step s`, all2all's `reduce from j` and `gather from j`, naive's `reduce chunk k`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import anyio
import numpy as np

from tinydist.observability import tracing
from tinydist.transports.base import Link
from tinydist.transports.shm import SLOT_BYTES
from tinydist.transports.tcp import Expect

CHUNK_BYTES = SLOT_BYTES

Ufunc = Callable[..., np.ndarray]
Bounds = list[tuple[int, int]]


def _step(name: str, rank: int, started: int, nbytes: int, **args: int) -> None:
    tracing.record(name, started, process=f"rank{rank}", lane="collective steps", cat="collective", bytes=nbytes, **args)


def chunk_bounds(start: int, stop: int, chunk: int) -> Bounds:
    return [(a, min(a + chunk, stop)) for a in range(start, stop, chunk)]


def _view(view: memoryview, dtype: np.dtype, count: int) -> np.ndarray:
    arr = np.frombuffer(view, dtype)
    if arr.size != count:
        raise RuntimeError(f"received {arr.size} elements where {count} were expected (ranks out of step)")
    return arr


class Progress:
    """A counter one task advances and another awaits, without polling."""

    def __init__(self) -> None:
        self.value = 0
        self._event = anyio.Event()

    def advance(self) -> None:
        self.value += 1
        self._event.set()
        self._event = anyio.Event()

    async def reach(self, target: int) -> None:
        while self.value < target:
            await self._event.wait()


def chunk_elements(itemsize: int) -> int:
    """Elements of `itemsize` bytes in one chunk."""
    return max(1, CHUNK_BYTES // max(1, itemsize))


async def naive(links: dict[int, Link], rank: int, world: int, x: np.ndarray, ufunc: Ufunc,
                out: np.ndarray | None = None, sent: bool = False) -> np.ndarray:
    """The reduction of every rank's `x`, in `out` when given (its memory apart from `x`'s: `x` is sent
    while `out` is written). `sent`: `x` already went to every peer (behind the header, one chunk)."""
    out = np.empty_like(x) if out is None else out
    chunks = chunk_bounds(0, x.size, chunk_elements(x.itemsize))

    async def sender(peer: int) -> None:
        for a, b in chunks:
            await links[peer].send(x[a:b])

    traced = tracing.active_tracer() is not None

    async def reducer() -> None:
        for k, (a, b) in enumerate(chunks):
            started = tracing.clock() if traced else 0
            dst = out[a:b]
            for j in range(world):
                if j == rank:
                    _combine(ufunc, dst, x[a:b], j == 0)
                    continue
                async with links[j].recv() as view:
                    _combine(ufunc, dst, _view(view, x.dtype, b - a), j == 0)
            if traced:
                _step(f"reduce chunk {k}", rank, started, dst.nbytes * world, chunk=k)

    if len(chunks) <= 1:
        # one message a link, which every link takes without its receiver (see ProcessGroup._exchange):
        # send, then reduce, without the task group's tasks (most of a small call's Python over TCP)
        if not sent:
            for peer in links:
                await sender(peer)
        await reducer()
        return out
    async with anyio.create_task_group() as tg:
        for peer in links:
            tg.start_soon(sender, peer)
        tg.start_soon(reducer)
    return out


def _combine(ufunc: Ufunc, dst: np.ndarray, src: np.ndarray, first: bool) -> None:
    if first:
        np.copyto(dst, src)
    else:
        ufunc(dst, src, out=dst)


async def ring(links: dict[int, Link], rank: int, world: int, out: np.ndarray, bounds: Sequence[tuple[int, int]],
               hold: int, reduce_steps: int, gather_steps: int, ufunc: Ufunc | None) -> None:
    """In place on `out`: at step s send segment (hold-s) right, receive segment (hold-s-1) from the left,
    reducing it for the first `reduce_steps` steps and copying it after that."""
    right, left = links[(rank + 1) % world], links[(rank - 1) % world]
    step = chunk_elements(out.itemsize)
    chunks = [chunk_bounds(a, b, step) for a, b in bounds]
    total = reduce_steps + gather_steps
    # start[s] = how many chunks the receiver has finished before step s
    start = [0]
    for s in range(total):
        start.append(start[-1] + len(chunks[(hold - s - 1) % world]))
    progress = Progress()
    traced = tracing.active_tracer() is not None

    async def sender() -> None:
        for s in range(total):
            for k, (a, b) in enumerate(chunks[(hold - s) % world]):
                if s > 0:
                    await progress.reach(start[s - 1] + k + 1)
                await right.send(out[a:b])

    async def receiver() -> None:
        for s in range(total):
            started, moved = tracing.clock() if traced else 0, 0
            for a, b in chunks[(hold - s - 1) % world]:
                moved += (b - a) * out.itemsize
                async with left.recv() as view:
                    src = _view(view, out.dtype, b - a)
                    if s < reduce_steps:
                        assert ufunc is not None
                        ufunc(out[a:b], src, out=out[a:b])
                    else:
                        out[a:b] = src
                progress.advance()
            if traced:
                _step(f"reduce-scatter step {s}" if s < reduce_steps else f"allgather step {s - reduce_steps}", rank,
                      started, moved, step=s)

    async with anyio.create_task_group() as tg:
        tg.start_soon(sender)
        tg.start_soon(receiver)


async def all2all(links: dict[int, Link], rank: int, world: int, x: np.ndarray, out: np.ndarray,
                  bounds: Sequence[tuple[int, int]], ufunc: Ufunc, gather: bool = True) -> None:
    """Reduce segment `rank` of every rank's `x` into `out` (peers send it straight here); with `gather`,
    send the reduced segment straight to every peer and place theirs."""
    step = chunk_elements(x.itemsize)
    chunks = [chunk_bounds(a, b, step) for a, b in bounds]
    mine = chunks[rank]
    a0, b0 = bounds[rank]
    out[a0:b0] = x[a0:b0]
    counts = [0] * len(mine)
    ready = [anyio.Event() for _ in mine]
    if world == 1:
        return
    traced = tracing.active_tracer() is not None

    async def sender(peer: int) -> None:
        link = links[peer]
        for a, b in chunks[peer]:
            await link.send(x[a:b])
        if gather:
            for k, (a, b) in enumerate(mine):
                await ready[k].wait()
                await link.send(out[a:b])

    async def receiver(peer: int) -> None:
        link = links[peer]
        started = tracing.clock() if traced else 0
        for k, (a, b) in enumerate(mine):
            async with link.recv() as view:
                ufunc(out[a:b], _view(view, x.dtype, b - a), out=out[a:b])
            counts[k] += 1
            if counts[k] == world - 1:
                ready[k].set()
        if traced:
            _step(f"reduce from {peer}", rank, started, (b0 - a0) * x.itemsize, peer=peer)
        if gather:
            started = tracing.clock() if traced else 0
            for a, b in chunks[peer]:
                async with link.recv() as view:
                    out[a:b] = _view(view, x.dtype, b - a)
            if traced:
                lo, hi = bounds[peer]
                _step(f"gather from {peer}", rank, started, (hi - lo) * x.itemsize, peer=peer)

    async with anyio.create_task_group() as tg:
        for peer in links:
            tg.start_soon(sender, peer)
            tg.start_soon(receiver, peer)


async def direct_gather(links: dict[int, Link], rank: int, out: np.ndarray, bounds: Sequence[tuple[int, int]]) -> None:
    """Allgather in one step: send my piece (already in `out`) to every peer, place each peer's piece."""
    step = chunk_elements(out.itemsize)
    chunks = [chunk_bounds(a, b, step) for a, b in bounds]

    async def sender(peer: int) -> None:
        for a, b in chunks[rank]:
            await links[peer].send(out[a:b])

    async def receiver(peer: int) -> None:
        for a, b in chunks[peer]:
            async with links[peer].recv() as view:
                out[a:b] = _view(view, out.dtype, b - a)

    async with anyio.create_task_group() as tg:
        for peer in links:
            tg.start_soon(sender, peer)
            tg.start_soon(receiver, peer)


async def broadcast(links: dict[int, Link], rank: int, src: int, out: np.ndarray) -> None:
    """The root sends its data to every peer directly; the others receive into `out`."""
    chunks = chunk_bounds(0, out.size, chunk_elements(out.itemsize))
    if rank == src:
        async def sender(peer: int) -> None:
            for a, b in chunks:
                await links[peer].send(out[a:b])
        async with anyio.create_task_group() as tg:
            for peer in links:
                tg.start_soon(sender, peer)
        return
    for a, b in chunks:
        async with links[src].recv() as view:
            out[a:b] = _view(view, out.dtype, b - a)


# ---- direct: the same algorithms run on the calling thread over paused TCP links ----------------
# (`ProcessGroup._direct`). The same chunk plan and frames as above, so a rank running them meets a
# peer running the async ones; `move(sends, expects)` is `tinydist.transports.tcp.pump` within the
# call's deadline, `scratch(key, count, dtype)` a buffer the group keeps for the next call.

Move = Callable[..., None]   # (sends, expects, sent=None): `ProcessGroup.move`
Scratch = Callable[[str, int, np.dtype], np.ndarray]


def _bytes(arr: np.ndarray) -> memoryview:
    return arr.reshape(-1).view(np.uint8).data


class NaiveDirect:
    """`naive` on this thread: every peer's chunks land in a buffer of its own, and chunk k is reduced in
    rank order (bitwise the same on every rank) once the last peer's chunk k is in; into `out`, whose
    memory is apart from `x`'s, or is `x` itself with one peer and a commutative `ufunc` (x op theirs is
    theirs op x): then chunk k is reduced once it has also left (`move` counts sent messages).
    `expects(peer)`: the messages `peer` sends, for the header exchange to expect right behind an
    agreeing header when the data went with it (`sent`, counted in `gone`); `run()` moves the rest and
    returns `out`."""

    def __init__(self, move: Move, scratch: Scratch, peers: Sequence[int], rank: int, world: int, x: np.ndarray,
                 ufunc: Ufunc, out: np.ndarray, sent: bool = False, gone: list[int] | None = None) -> None:
        self.move, self.peers, self.rank, self.world, self.x, self.ufunc, self.out = move, peers, rank, world, x, ufunc, out
        self.chunks = chunk_bounds(0, x.size, chunk_elements(x.itemsize))
        self.theirs = {p: scratch(f"naive{p}", x.size, x.dtype) for p in peers}
        self.counts = [0] * len(self.chunks)
        self.in_place = out is x
        self.sent = sent
        # our chunks handed to the kernel, in order; `sent`: the header exchange's pump counts them in
        # `gone`, from -1 (the header frame goes first)
        self.gone = gone if gone is not None else [0]
        self.later: list[int] = []
        self.expected: set[int] = set()

    def expects(self, peer: int) -> list[Expect]:
        self.expected.add(peer)
        theirs = self.theirs[peer]
        return [Expect(_bytes(theirs[a:b]), functools.partial(self._arrived, k)) for k, (a, b) in enumerate(self.chunks)]

    def _reduce(self, k: int) -> None:
        a, b = self.chunks[k]
        dst, x, ufunc = self.out[a:b], self.x, self.ufunc
        if self.in_place:
            (p,) = self.peers
            ufunc(dst, self.theirs[p][a:b], out=dst)
            return
        for j in range(self.world):
            _combine(ufunc, dst, x[a:b] if j == self.rank else self.theirs[j][a:b], j == 0)

    def _arrived(self, k: int, _: memoryview) -> None:
        self.counts[k] += 1
        if self.counts[k] == self.world - 1:
            if self.in_place and self.gone[0] <= k:
                self.later.append(k)             # still to be sent: reduced once the move is over
            else:
                self._reduce(k)

    def run(self) -> np.ndarray:
        sends = {} if self.sent else {p: [(_bytes(self.x[a:b]), 0) for a, b in self.chunks] for p in self.peers}
        expects = {p: self.expects(p) for p in self.peers if p not in self.expected}
        if sends or expects:
            self.move(sends, expects, self.gone)
        for k in self.later:
            self._reduce(k)
        return self.out


def ring_direct(move: Move, scratch: Scratch, rank: int, world: int, out: np.ndarray, bounds: Sequence[tuple[int, int]],
                hold: int, reduce_steps: int, gather_steps: int, ufunc: Ufunc | None) -> None:
    """`ring` on this thread: chunk k of step s goes right once chunk k of step s-1 is in (the pump
    counts), chunks being reduced land in a scratch chunk and chunks being gathered straight in `out`."""
    step = chunk_elements(out.itemsize)
    chunks = [chunk_bounds(a, b, step) for a, b in bounds]
    total = reduce_steps + gather_steps
    tmp = scratch("ring", step, out.dtype)

    def reduce_into(a: int, b: int, _: memoryview) -> None:
        assert ufunc is not None
        ufunc(out[a:b], tmp[:b - a], out=out[a:b])

    sends: list[tuple[memoryview, int]] = []
    expects: list[Expect] = []
    before = 0                     # messages received before this step
    for s in range(total):
        mine = chunks[(hold - s) % world]
        sends.extend((_bytes(out[a:b]), before - len(chunks[(hold - s) % world]) + k + 1 if s else 0)
                     for k, (a, b) in enumerate(mine))
        for a, b in chunks[(hold - s - 1) % world]:
            if s < reduce_steps:
                expects.append(Expect(_bytes(tmp[:b - a]), functools.partial(reduce_into, a, b)))
            else:
                expects.append(Expect(_bytes(out[a:b])))
        before += len(chunks[(hold - s - 1) % world])
    move({(rank + 1) % world: sends}, {(rank - 1) % world: expects})
