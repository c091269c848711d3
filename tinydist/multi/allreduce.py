"""Allreduce across devices of one process, built as graph.

Each algorithm returns, for every device, a tensor on that device holding the reduction of all
inputs. `direct` is one graph node per output (ALLREDUCE), the others are ordinary graph nodes:
`t.to(device)` then a fused kernel. Between devices of one peer group (CPU devices of one process
share the host's memory) the scheduler turns such a copy into a direct read: the kernel on the
destination loads the source from its device's memory, so no bytes are copied, and the runtime's
access logs order that read after its producer and before later writers on the other device's
queues. Between other devices a copy is a copy, on the
destination's copy queue, overlapping the previous chunk's addition on its compute queue.

With S bytes per device and N devices, memory traffic (reads + writes, all devices) for peers:

  direct   device i reduces range i of every input, reading them in place, and writes the result
           into range i of every output, in one kernel per device (a SliceCall): 2·N·S, the floor.
           Peers only (it reads and writes other devices' memory), and no autograd through it
  naive    every device reduces all N inputs: N·(N+1)·S, in one kernel per device
  ring     reduce-scatter then allgather around a ring, in N chunks: 2·(N-1) steps
  all2all  device i reduces chunk i reading every device (reduce-scatter, (N+1)·S), then each
           device gathers the N reduced chunks (allgather, copies: 2·N·S): (3·N+1)·S

The floor is 2·N·S (read every input once, write every output once). `choose` picks one (rule in
its docstring); the choice is logged and can be forced per call, or with TINYDIST_ALLREDUCE
(naive, ring or all2all: the setting is shared with tinydist.dist, which has no `direct`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from tinydist.config import settings
from tinydist.lazy import LazyNode, Op
from tinydist.logs import get_logger
from tinydist.runtime.registry import peer_group
from tinydist.tensor import Tensor, cat

log = get_logger(layer="multi")

ALGORITHMS = ("direct", "naive", "ring", "all2all")
REDUCE_OPS = ("sum", "max", "min", "prod")
# Below this many elements the extra graph of all2all (N chunks, N gathers: milliseconds of
# Python at 4 devices) costs more than the traffic it saves (bench/multidevice.py).
ALL2ALL_MIN_ELEMENTS = 1 << 21


def _combine(op: str) -> Callable[[Tensor, Tensor], Tensor]:
    return {"sum": lambda a, b: a + b, "prod": lambda a, b: a * b,
            "max": lambda a, b: a.maximum(b), "min": lambda a, b: a.minimum(b)}[op]


def choose(devices: int, elements: int, requested: str = "auto", direct: bool = False) -> str:
    """`requested` if explicit; else TINYDIST_ALLREDUCE if set to an algorithm; else `direct` where
    it can run (`direct`: the inputs are on one peer group and need no gradient) — the least
    traffic and one kernel per device at every size; else naive for two devices (N·(N+1) = 6 <
    3·N+1 = 7 bytes of traffic per input byte) or small inputs (one kernel per device, the fewest
    calls), all2all beyond that (traffic linear in N, not quadratic)."""
    if requested == "auto":
        requested = settings.ALLREDUCE
    if requested != "auto":
        if requested not in ALGORITHMS:
            raise ValueError(f"unknown allreduce algorithm {requested!r}; choose one of {', '.join(ALGORITHMS)} or 'auto'")
        if requested == "direct" and not direct:
            raise ValueError("allreduce 'direct' needs inputs on devices of one peer group, without gradients")
        return requested
    if direct:
        return "direct"
    return "naive" if devices <= 2 or elements < ALL2ALL_MIN_ELEMENTS else "all2all"


def _chunks(n: int, parts: int) -> list[tuple[int, int]]:
    edges = np.linspace(0, n, parts + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


def allreduce(inputs: Sequence[Tensor], op: str = "sum", algorithm: str = "auto") -> list[Tensor]:
    """One result per input, on the input's device, each the `op`-reduction of all inputs."""
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}; choose one of {', '.join(REDUCE_OPS)}")
    shapes = {t.shape for t in inputs}
    if len(shapes) != 1 or len({t.dtype for t in inputs}) != 1:
        raise ValueError(f"allreduce inputs must agree in shape and dtype, got {[(t.shape, t.dtype.name) for t in inputs]}")
    n = len(inputs)
    if n == 1:
        return list(inputs)
    shape = inputs[0].shape
    elements = int(np.prod(shape, dtype=np.int64))
    groups = {peer_group(t.device) for t in inputs}
    direct = None not in groups and len(groups) == 1 and not any(t.requires_grad for t in inputs)
    chosen = choose(n, elements, algorithm, direct=direct)
    log.info("allreduce", algorithm=chosen, devices=[t.device for t in inputs], elements=elements, op=op)
    if chosen == "direct":
        srcs = tuple(t.node for t in inputs)
        return [Tensor(LazyNode(Op.ALLREDUCE, srcs, (op, i), t.dtype, t.shape, t.device)) for i, t in enumerate(inputs)]
    combine = _combine(op)
    if chosen == "naive" or elements < n:
        return [_reduce_all([t.to(inputs[i].device) for t in inputs], combine) for i in range(n)]
    flat = [t.reshape(-1) for t in inputs]
    bounds = _chunks(elements, n)
    if chosen == "ring":
        reduced = _ring_reduce_scatter(flat, bounds, combine)
    else:
        reduced = [_reduce_all([flat[j][lo:hi].to(flat[i].device) for j in range(n)], combine)
                   for i, (lo, hi) in enumerate(bounds)]
    # allgather: every device assembles all reduced chunks (chunk i lives on device i)
    return [cat([reduced[c].to(flat[i].device) for c in range(n)]).reshape(shape) for i in range(n)]


def _reduce_all(parts: list[Tensor], combine: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    result = parts[0]
    for part in parts[1:]:
        result = combine(result, part)
    return result


def _ring_reduce_scatter(flat: list[Tensor], bounds: list[tuple[int, int]],
                         combine: Callable[[Tensor, Tensor], Tensor]) -> list[Tensor]:
    """After n-1 steps device i holds the full reduction of chunk i (returned in chunk order)."""
    n = len(flat)
    # partial[d][c]: device d's running reduction of chunk c
    partial = [[flat[d][lo:hi] for lo, hi in bounds] for d in range(n)]
    for step in range(n - 1):
        for d in range(n):
            chunk = (d - step - 1) % n          # the chunk device d passes on at this step
            nxt = (d + 1) % n
            incoming = partial[d][chunk].to(flat[nxt].device)
            partial[nxt][chunk] = combine(partial[nxt][chunk], incoming)
    return [partial[c][c] for c in range(n)]
