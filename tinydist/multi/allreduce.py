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

The floor is 2·N·S (read every input once, write every output once). `tinydist.graph.collectives.choose`
picks one (medium `devices`; the rule in its docstring); the choice is logged and can be forced per
call, or with TINYDIST_ALLREDUCE (naive, ring or all2all: the setting is shared with tinydist.dist,
which has no `direct`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from tinydist.base.logs import get_logger
from tinydist.frontend.movement import cat
from tinydist.frontend.tensor import Tensor
from tinydist.graph.collectives import LEGAL, Algorithm, Medium, Topology, resolve, shard_bounds
from tinydist.graph.lazy import LazyNode, Op
from tinydist.graph.reduce_ops import reduce_op
from tinydist.runtime.registry import peer_group

log = get_logger(layer="multi")

ALGORITHMS: tuple[str, ...] = tuple(a.value for a in LEGAL[Medium.DEVICES])


def allreduce(inputs: Sequence[Tensor], op: str = "sum", algorithm: str = "auto") -> list[Tensor]:
    """One result per input, on the input's device, each the `op`-reduction of all inputs."""
    reduce = reduce_op(op)
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
    chosen, reason = resolve(algorithm, Medium.DEVICES, n, elements * inputs[0].dtype.itemsize, Topology(peers=direct))
    log.info("allreduce", algorithm=str(chosen), reason=reason, devices=[t.device for t in inputs], elements=elements, op=op)
    if chosen is Algorithm.DIRECT:
        srcs = tuple(t.node for t in inputs)
        return [Tensor(LazyNode(Op.ALLREDUCE, srcs, (op, i), t.dtype, t.shape, t.device)) for i, t in enumerate(inputs)]

    def combine(a: Tensor, b: Tensor) -> Tensor:
        return a._binary(b, Op(reduce.binary))

    if chosen is Algorithm.NAIVE or elements < n:
        return [_reduce_all([t.to(inputs[i].device) for t in inputs], combine) for i in range(n)]
    flat = [t.reshape(-1) for t in inputs]
    bounds = shard_bounds(elements, n)
    if chosen is Algorithm.RING:
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
