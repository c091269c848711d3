"""Process-group collectives: one process per rank, started by `tinydist launch` (or by hand).

    import tinydist as td
    if td.dist.job_environment() is not None:        # started by tinydist launch, torchrun, srun or Kubernetes
        td.dist.init()                               # TINYDIST_RANK, TINYDIST_WORLD_SIZE, TINYDIST_COORDINATOR
    y = td.dist.all_reduce(td.Tensor(x), op="sum")   # algorithm="auto" | "naive" | "ring" | "all2all"
    td.dist.all_reduce(x, out=x)                     # numpy x overwritten with the result, as in torch
    td.dist.all_gather(t, axis=0); td.dist.reduce_scatter(t, op="sum", axis=0)
    td.dist.broadcast(t, src=0); td.dist.barrier(); td.dist.destroy()

Inputs are td.Tensors or numpy arrays; results are td.Tensors (all_reduce with out=: that numpy
array). The functions are a blocking facade over `ProcessGroup` (numpy in and out), whose links run
on the process's one background event loop (the engine's, `tinydist.runtime.engine`); ranks on one
host run the collective itself on the calling thread, over shared memory. Async code can use `ProcessGroup.open(...)` directly. See docs/collectives.md.
"""

from __future__ import annotations

import atexit
import socket
import sys
import threading
import time
from typing import Any

import numpy as np

from tinydist.dist import lazy
from tinydist.dist.environment import JobEnvironment, detect, launch
from tinydist.dist.errors import CollectiveError, CollectiveMismatch, CollectiveTimeout, RankFailed
from tinydist.dist.group import EXITED, EXITED_ON_ERROR, ProcessGroup
from tinydist.dist.parallel import DistributedDataParallel
from tinydist.dist.rendezvous import parse_coordinator
from tinydist.observability import metrics
from tinydist.runtime.engine import get_engine

__all__ = ["CollectiveError", "CollectiveMismatch", "CollectiveTimeout", "DistributedDataParallel", "ProcessGroup", "RankFailed", "all_gather",
           "all_reduce", "barrier", "broadcast", "destroy", "fail", "get_group", "get_rank", "get_world_size", "init",
           "is_initialized", "job_environment", "rank", "reduce_scatter", "run_on_loop", "world_size"]

_lock = threading.Lock()
_state: dict[str, Any] = {}


def job_environment() -> JobEnvironment | None:
    """Am I part of a job? What the launcher that started this process says about it (rank, world
    size, rendezvous, and which launcher: tinydist launch, torchrun, an srun step, a Kubernetes
    Indexed Job or StatefulSet), or None when none did. The one reader of every launcher's
    variables (`tinydist.dist.environment.detect`), so a script that asks this before td.dist.init()
    runs unchanged under each; it reads the environment only and joins nothing."""
    return detect()


def init(rank: int | None = None, world_size: int | None = None, coordinator: str | None = None,
         timeout: float | None = None, coordinator_sock: socket.socket | None = None) -> None:
    """Join the process group (blocks until every rank has joined or the timeout passes).

    What is not passed comes from the launch variables (`tinydist.dist.environment.launch`).
    `coordinator_sock`: rank 0's rendezvous on a socket already bound and listening (the caller
    bound the port before the other ranks learnt it, so no other process can take it); the group
    owns it from here."""
    with _lock:
        if _state:
            raise RuntimeError("td.dist.init() was already called; call td.dist.destroy() first")
        job = launch(rank, world_size, coordinator, coordinator_sock)
        address = parse_coordinator(job.coordinator)
        engine = get_engine()        # before the atexit below: the group leaves before the loop stops
        group_cm = engine.portal.wrap_async_context_manager(
            ProcessGroup.open(job.rank, job.world_size, address, job.coordinator_sock, timeout))
        try:
            group = group_cm.__enter__()
        except BaseException as exc:
            raise _sole_cause(exc) from None
        _state.update(run=engine.run, group_cm=group_cm, group=group)
        atexit.register(_leave_at_exit)


def _sole_cause(exc: BaseException) -> BaseException:
    """The one error inside (nested) task-group wrappers, so init failures read as themselves."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def destroy() -> None:
    """Leave the group: say BYE to every peer (bounded wait), release links and shared memory. Idempotent."""
    with _lock:
        if not _state:
            return
        state = dict(_state)
        _state.clear()
    state["group_cm"].__exit__(None, None, None)


def _leave_at_exit() -> None:
    """The exit hook: leave the group, the BYE saying the script ended (on an uncaught exception when
    the interpreter recorded one, sys.last_value), so the peers can tell that from td.dist.destroy."""
    with _lock:
        group = _state.get("group")
    if group is not None:
        group.leaving = EXITED_ON_ERROR if getattr(sys, "last_value", None) is not None else EXITED
    destroy()


def fail(rank: int, reason: str) -> None:
    """Mark `rank` failed from another thread (e.g. the cluster scheduler declared its node dead):
    the collective in flight and every later one raise RankFailed. No-op when not initialized."""
    with _lock:
        state = dict(_state)
    if state:
        async def fail_on_loop() -> None:        # where the links' own failures are handled
            state["group"].fail(rank, reason)
        state["run"](fail_on_loop)


def is_initialized() -> bool:
    return bool(_state)


def get_group() -> ProcessGroup:
    if not _state:
        raise RuntimeError("td.dist.init() has not been called")
    return _state["group"]


def rank() -> int:
    return get_group().rank


def world_size() -> int:
    return get_group().world


# torch.distributed's names, for code written against it
get_rank = rank
get_world_size = world_size


def _array(t: Any) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t
    from tinydist.frontend.tensor import Tensor
    if isinstance(t, Tensor):
        return t.numpy()
    return np.asarray(t)


def run_on_loop(fn: Any, *args: Any) -> Any:
    """Run the coroutine function `fn(*args)` on the group's event loop (where the links are served) and
    return its result; for code that uses the links directly, such as scheduler.probe's ping-pong."""
    get_group()
    return _state["run"](fn, *args)


def _call(collective: str, *args: Any, algorithm: str = "") -> Any:
    group = get_group()
    lazy.settle()  # after the graph nodes' collectives already submitted: every rank numbers its calls alike
    # the latency histogram / error counter, without `metrics.time_collective`'s context manager
    # (~1 us of a ~3-5 us small allreduce on one host)
    start = time.perf_counter()
    try:
        result = group.blocking(collective, *args, run_async=_state["run"])
    except BaseException as exc:
        metrics.collective_failed(collective, exc)
        raise
    metrics.COLLECTIVE_SECONDS.observe(collective, algorithm, time.perf_counter() - start)
    return result


def _tensor(arr: np.ndarray) -> Any:
    from tinydist.frontend.tensor import Tensor
    return Tensor(arr)


def _node_tensor(node: Any) -> Any:
    get_group()  # refused now, not when the step's realize runs the node
    from tinydist.frontend.tensor import Tensor
    return Tensor(node)


def all_reduce(t: Any, op: str = "sum", algorithm: str = "auto", out: np.ndarray | None = None) -> Any:
    """Reduce `t` over all ranks (op: sum, mean, prod, max, min); every rank gets the result, a new
    td.Tensor, or with `out=` (a writeable C-contiguous numpy array of the result's shape and dtype)
    written into `out`, which is returned. `all_reduce(x, out=x)` overwrites the numpy array `x`, as
    torch.distributed.all_reduce does, and saves allocating (and first touching) a result. A call whose
    `out` does not qualify raises CollectiveMismatch on every rank and modifies nothing.

    An unrealized td.Tensor (without `out=`) gives a graph node: the collective runs when the result
    is realized, on the device's queue, and inside a td.jit capture (`tinydist.dist.lazy`)."""
    node = lazy.graph_node(t) if out is None else None
    if node is not None:
        return _node_tensor(lazy.all_reduce(node, op, algorithm))
    if out is None:
        return _tensor(_call("all_reduce", _array(t), op, algorithm, algorithm=algorithm))
    return _call("all_reduce", _array(t), op, algorithm, out, algorithm=algorithm)


def all_gather(t: Any, axis: int = 0, lengths: list[int] | None = None) -> Any:
    """Concatenate every rank's `t` along `axis` in rank order; pieces may differ in length along `axis`.
    An unrealized td.Tensor gives a graph node (see all_reduce), whose shape needs every rank's
    length along `axis`: `lengths`, or this rank's for every rank when not given; a tensor of no
    elements without `lengths` is gathered now (its peers' pieces may well have some)."""
    node = lazy.graph_node(t)
    if node is not None and (lengths is not None or node.numel):
        return _node_tensor(lazy.all_gather(node, axis, world_size(), lengths))
    return _tensor(_call("all_gather", _array(t), axis))


def reduce_scatter(t: Any, op: str = "sum", axis: int = 0, algorithm: str = "auto") -> Any:
    """Reduce `t` over all ranks and keep this rank's piece along `axis` (np.array_split's pieces).
    An unrealized td.Tensor gives a graph node (see all_reduce)."""
    node = lazy.graph_node(t)
    if node is not None:
        return _node_tensor(lazy.reduce_scatter(node, op, axis, algorithm, world_size(), rank()))
    return _tensor(_call("reduce_scatter", _array(t), op, axis, algorithm, algorithm=algorithm))


def broadcast(t: Any, src: int = 0) -> Any:
    """Every rank gets rank `src`'s tensor; other ranks may pass None (or a tensor of the same shape/dtype).
    An unrealized td.Tensor gives a graph node (see all_reduce); every rank then passes one."""
    node = lazy.graph_node(t)
    if node is not None:
        return _node_tensor(lazy.broadcast(node, src))
    return _tensor(_call("broadcast", None if t is None else _array(t), src))


def barrier() -> None:
    """Return once every rank has called barrier()."""
    _call("barrier")
