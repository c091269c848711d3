"""Process collectives as graph nodes: `td.dist.all_reduce(t)` on an unrealized td.Tensor.

    g = td.dist.all_reduce(grad, op="mean")   # a COLLECTIVE node: nothing runs yet
    opt.step()                                # the realize runs it on the device's queue

The node's schedule item (`CollectiveCall`) runs a program of two pointers (out, in) on the
device's copy queue, in the schedule's order: a realize submits it as soon as the kernels making
its input are submitted, and while it runs (waiting for the peers, reducing) the compute queue goes
on with the kernels that do not read its result — a data-parallel step's later buckets of backward
overlap the earlier buckets' all-reduces. (Where no kernel could run beside it, it runs on the
compute queue, and a capture links it with the kernels.) A `td.jit` capture runs it by address, so a
replayed data-parallel step runs every bucket's all-reduce with no Python of its own (the
collective itself is `ProcessGroup.blocking`, the eager calls' path: on one host over the group
segment on the queue's thread). The result lands in the node's own buffer (all_reduce in place
into it, `out=`); no `.numpy()` of the input, no upload of the result.

Every rank must build the same collectives in the same order, as eager calls must. A call the
ranks disagree on (shape, dtype, op, order) is refused by the header check on every rank, as
eagerly; here the refusal fails the device that ran it (host code inside a queue's run cannot
raise through native code), so the realize or replay that needed it raises `DeviceFailed` whose
`__cause__` is the `CollectiveMismatch`, on every rank.

The result's shape must be known when the node is built: all_gather's is every rank's length
along `axis`, taken as this rank's unless `lengths=` gives them; a rank whose pieces do not add
up to its node's shape raises the same way (only that rank can tell).
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from tinydist.base.errors import DeviceFailed
from tinydist.dist.errors import CollectiveMismatch
from tinydist.graph import dtypes
from tinydist.graph.collectives import shard_sizes
from tinydist.graph.lazy import LazyNode, Op
from tinydist.graph.reduce_ops import MEAN
from tinydist.runtime.engine import get_engine
from tinydist.runtime.program import Program
from tinydist.schedule.items import CollectiveCall

# the program's C signature: (out, in), both pointers; no return (an error fails the device)
_ROUTINE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)


@dataclass(frozen=True)
class Collective:
    """One process collective as a graph node's arg: what it is, over which shapes and dtypes.
    Hashable and compared by value (the schedule cache keys on it)."""

    name: str                       # all_reduce | all_gather | reduce_scatter | broadcast
    params: tuple[Any, ...]         # the eager call's arguments after the tensor
    in_shape: tuple[int, ...]
    in_dtype: str                   # numpy dtype strings
    out_shape: tuple[int, ...]
    out_dtype: str
    device: str

    def describe(self) -> str:
        return f"{self.name}{list(self.params)} {self.in_dtype}{list(self.in_shape)} -> {list(self.out_shape)} on {self.device}"

    def program(self) -> Program:
        return _program(self)

    def run(self, out_address: int | None, in_address: int | None) -> None:
        """The collective from the input's memory into the output's (the program's body), on the
        queue's thread. Any error fails the device, the one way out of a run of native code."""
        device = get_engine().device(self.device)
        _running.inside = True  # on whichever thread runs the queue's batch (its worker, or inline the caller)
        try:
            with device.waiting_elsewhere():  # the group's own deadline bounds the wait for the peers
                self._run(_view(in_address, self.in_shape, self.in_dtype), _view(out_address, self.out_shape, self.out_dtype))
        except BaseException as exc:  # noqa: BLE001 - native code called us: the device's failure carries it
            failure = DeviceFailed(f"{self.device}: process collective {self.describe()} failed: {type(exc).__name__}: {exc}")
            failure.__cause__ = exc
            device.mark_failed(failure)
        finally:
            _running.inside = False

    def _run(self, x: np.ndarray, out: np.ndarray) -> None:
        import tinydist.dist as dist  # the facade: this module's package, named here to keep the import acyclic
        if self.name == "all_reduce":
            if out.dtype == x.dtype:  # in place in the node's buffer: the one-host fast path takes only that
                np.copyto(out, x)
                x = out
            dist._call("all_reduce", x, *self.params, out, algorithm=self.params[1])
            return
        result = dist._call(self.name, x, *self.params)
        if result.shape != out.shape:
            raise CollectiveMismatch(f"{self.name}: the result is {list(result.shape)}, the graph node is {list(out.shape)}; "
                                     f"pass lengths= (every rank's length along the axis) when the pieces differ")
        np.copyto(out, result)


def _view(address: int | None, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """A numpy array over `address` (host memory of the schedule's buffer); no bytes, no memory."""
    dt = np.dtype(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    if nbytes == 0:
        return np.empty(shape, dt)
    memory = (ctypes.c_ubyte * nbytes).from_address(address or 0)
    return np.frombuffer(memory, np.uint8).view(dt).reshape(shape)  # type: ignore[call-overload]


# the queues a node's collective runs on (CollectiveCall's; the compute queue where nothing could
# run beside it, `tinydist.schedule.linear`), and the devices whose queues have run (or may be
# running) one
QUEUES = (CollectiveCall.queue, "compute")
_DEVICES: set[str] = set()
# whether this thread is running a node's collective (a queue's worker, or a caller running a batch inline)
_running = threading.local()


def settle() -> None:
    """Wait until the process collectives submitted to the devices' queues have run, so that a
    collective this thread runs now comes after them on this rank, as on every other (the ranks
    number their calls alike). Not from a node's own collective: its batch is the one running."""
    if not _DEVICES or getattr(_running, "inside", False):
        return
    engine = get_engine()
    for name in list(_DEVICES):
        for kind in QUEUES:
            queue = engine.device(name).queues[kind]
            queue.timeline.wait_blocking(queue.last_submitted)


@functools.cache
def _program(collective: Collective) -> Program:
    """`collective`'s program: a ctypes callback (it takes the GIL when native code calls it), kept
    alive by this cache as long as any schedule may call its address."""
    _DEVICES.add(collective.device)
    routine = _ROUTINE(collective.run)
    address = ctypes.cast(routine, ctypes.c_void_p).value
    assert address is not None, "a ctypes callback has an address"
    # a side of no bytes has no buffer to bind: an integer argument, 0 (commands.lower_call)
    out_kind = "w" if math.prod(collective.out_shape) else "i64"
    in_kind = "r" if math.prod(collective.in_shape) else "i64"
    return Program(f"td_dist_{collective.name}", (out_kind, in_kind), routine, address)


def graph_node(t: Any) -> LazyNode | None:
    """`t`'s node when a collective of it becomes a graph node: `t` an unrealized td.Tensor on a
    device whose memory is the host's and that runs host code of this process (the node's program
    is called from the device's queue); else None, and the collective runs now."""
    from tinydist.frontend.tensor import Tensor  # the frontend sits above the graph this module builds
    if not isinstance(t, Tensor) or t.node.realized:
        return None
    device = get_engine().device(t.device)
    return t.node if device.host_visible and device.native_code else None


def node(name: str, x: LazyNode, params: tuple[Any, ...], out_shape: tuple[int, ...], out_dtype: dtypes.DType) -> LazyNode:
    spec = Collective(name, params, x.shape, x.dtype.np.str, out_shape, out_dtype.np.str, x.device)
    return LazyNode(Op.COLLECTIVE, (x,), spec, out_dtype, out_shape, x.device)


def all_reduce(x: LazyNode, op: str, algorithm: str) -> LazyNode:
    out = dtypes.float64 if op == MEAN and not x.dtype.is_float else x.dtype
    return node("all_reduce", x, (op, algorithm), x.shape, out)


def all_gather(x: LazyNode, axis: int, world: int, lengths: list[int] | None) -> LazyNode:
    if not x.shape or not -len(x.shape) <= axis < len(x.shape):
        raise ValueError(f"all_gather of a {list(x.shape)} tensor along axis {axis}: it needs that axis")
    ax = axis % len(x.shape)
    if lengths is not None and (len(lengths) != world or lengths[_rank()] != x.shape[ax]):
        raise ValueError(f"all_gather lengths={lengths}: give one length per rank ({world}), this rank's "
                         f"({_rank()}) being its tensor's {x.shape[ax]} along axis {ax}")
    total = sum(lengths) if lengths is not None else x.shape[ax] * world
    return node("all_gather", x, (axis,), (*x.shape[:ax], total, *x.shape[ax + 1:]), x.dtype)


def reduce_scatter(x: LazyNode, op: str, axis: int, algorithm: str, world: int, rank: int) -> LazyNode:
    if not x.shape or not -len(x.shape) <= axis < len(x.shape):
        raise ValueError(f"reduce_scatter of a {list(x.shape)} tensor along axis {axis}: it needs that axis")
    ax = axis % len(x.shape)
    piece = shard_sizes(x.shape[ax], world)[rank]
    out = dtypes.float64 if op == MEAN and not x.dtype.is_float else x.dtype
    return node("reduce_scatter", x, (op, axis, algorithm), (*x.shape[:ax], piece, *x.shape[ax + 1:]), out)


def broadcast(x: LazyNode, src: int) -> LazyNode:
    return node("broadcast", x, (src,), x.shape, x.dtype)


def _rank() -> int:
    import tinydist.dist as dist
    return dist.rank()
