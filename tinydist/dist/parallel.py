"""`DistributedDataParallel`: one model replica per rank, gradients bucketed and all-reduced.

    ddp = td.parallel.DistributedDataParallel(model, devices=["CPU:0", "CPU:1"])  # ranks = devices here
    ddp = td.dist.DistributedDataParallel(model)   # under `tinydist launch`: ranks = processes
    opt = td.optim.Adam(ddp.parameters(), lr=1e-3)
    loss = td.nn.functional.cross_entropy(ddp(x), y)
    opt.zero_grad(); loss.backward(); opt.step()

The training loop is the same either way:

* **devices of one process** (`devices=[...]` or an int): `module` is rank 0's replica and a copy
  lives on every other device. `ddp(x)` splits the batch along axis 0 over the devices and returns
  a `MultiTensor` of the per-device outputs; the losses in `td.nn.functional` turn it into the loss
  of the whole batch, so `backward()` gives each replica its part of the gradient. Gradients are
  then **summed** across replicas (`tinydist.multi.allreduce`). `ddp.parameters()` holds every
  replica's parameters; the optimizer updates each on its own device with identical gradients, so
  the replicas stay equal.
* **processes** (`td.dist.init()` done, e.g. by `tinydist launch`): `ddp(x)` is `module(x)` on this
  rank's part of the batch; gradients are **averaged** across ranks with `tinydist.dist.all_reduce`.
  Parameters are broadcast from rank 0 at construction.

Both give the gradient of the mean loss over the global batch (for the process case when ranks
hold equal shares). Bucketing: parameters are grouped, last layer first, into buckets of about
`bucket_cap_mb`; a grad hook fires as each parameter's gradient becomes final during backward,
and as soon as a bucket is complete its all-reduce is started — while backward goes on producing
later buckets. In-process, the all-reduce is graph (copies on each device's copy queue, a fused
add on its compute queue) that the optimizer step realizes together with everything else, so the
runtime overlaps one bucket's copies with the next bucket's kernels. Across processes, on a
device that runs host code of this process (the CPU), the all-reduce is a graph node too
(`tinydist.dist.lazy`): the optimizer step's realize runs each bucket's collective on the device's
copy queue as soon as its gradients are made, while the compute queue goes on with the rest of
backward, and a td.jit capture of the step replays them so with no Python per bucket. Elsewhere the bucket is realized (submitted) at once and a background thread reads it back
and all-reduces it while the main thread builds and submits the next buckets; backward() waits for
them at its end (such a step cannot be captured).

Call `zero_grad()` every step (accumulated gradients would be reduced again).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from tinydist.dist import lazy
from tinydist.engine.realize import realize
from tinydist.frontend import autograd
from tinydist.frontend.autograd import no_grad, queue_callback, register_grad_hook
from tinydist.frontend.movement import cat
from tinydist.frontend.tensor import Tensor
from tinydist.graph.collectives import shard_sizes
from tinydist.multi.allreduce import allreduce
from tinydist.multi.sharded import MultiTensor
from tinydist.runtime.registry import canonical_name
from tinydist.train.nn.module import Module, replicate

__all__ = ["DistributedDataParallel"]


class _ProcessGroup(Protocol):
    """What DDP uses of tinydist.dist, imported when first needed (it is this module's package)."""

    def rank(self) -> int: ...
    def world_size(self) -> int: ...
    def all_reduce(self, t: Any, op: str = "sum", algorithm: str = "auto") -> Any: ...
    def broadcast(self, t: Any, src: int = 0) -> Any: ...


def _dist() -> _ProcessGroup | None:
    import tinydist.dist as dist  # this module's package: loaded first, named here to keep its import acyclic
    return dist if dist.is_initialized() else None


class DistributedDataParallel(Module):
    def __init__(self, module: Module, devices: Sequence[str] | int | None = None, bucket_cap_mb: float = 1.0,
                 algorithm: str = "auto") -> None:
        self.module = module
        self.algorithm = algorithm
        self.bucket_cap_bytes = int(bucket_cap_mb * (1 << 20))
        params = module.parameters()
        if isinstance(devices, int):
            devices = [f"CPU:{i}" for i in range(devices)]
        self._dist: _ProcessGroup | None = None
        if devices is not None and len(devices) > 0:
            self.devices = [canonical_name(d) for d in devices]
            if len(set(self.devices)) != len(self.devices):
                raise ValueError(f"DistributedDataParallel: devices must be distinct, got {self.devices}")
            where = {p.device for p in params}
            if where and where != {self.devices[0]}:
                raise ValueError(f"the module's parameters are on {sorted(where)}; build it on {self.devices[0]} "
                                 "(the first device) — the other replicas are copied from it")
            self.replicas = [module] + [replicate(module, d) for d in self.devices[1:]]
            self.mode = "devices" if len(self.devices) > 1 else "single"
        else:
            self._dist = _dist()
            self.devices = [params[0].device] if params else ["CPU:0"]
            self.replicas = [module]
            self.mode = "processes" if self._dist is not None and self._dist.world_size() > 1 else "single"
            if self.mode == "processes":
                self._broadcast_parameters()
        self.world = len(self.replicas) if self.mode == "devices" else (self._group().world_size() if self.mode == "processes" else 1)
        self._params = [r.parameters() for r in self.replicas]
        self.buckets = self._make_buckets(self._params[0])
        self._bucket_of = {j: b for b, bucket in enumerate(self.buckets) for j in bucket}
        self._pending: dict[int, set[tuple[int, int]]] = {}
        self._active = False
        self._futures: list[tuple[list[int], concurrent.futures.Future[Any]]] = []
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        if self.mode != "single":
            for r, params_r in enumerate(self._params):
                for j, p in enumerate(params_r):
                    register_grad_hook(p, self._hook_for(r, j))

    # ---- Module interface ---------------------------------------------------------------------

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        if self.mode != "devices":
            return self.module(x, *args, **kwargs)
        if not isinstance(x, Tensor):
            x = Tensor(np.asarray(x), device=self.devices[0])
        sizes = shard_sizes(x.shape[0], len(self.devices))
        outputs, start = [], 0
        for replica, device, size in zip(self.replicas, self.devices, sizes):
            outputs.append(replica(x[start:start + size].to(device), *args, **kwargs))
            start += size
        return MultiTensor(outputs, 0)

    def parameters(self) -> list[Tensor]:
        """Every replica's parameters (replica 0 first); give these to the optimizer."""
        return [p for params in self._params for p in params]

    def named_parameters(self, prefix: str = "") -> Any:
        return self.module.named_parameters(prefix)

    def state_dict(self) -> Any:
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        for replica in self.replicas:
            replica.load_state_dict(state, strict)

    def train(self, mode: bool = True) -> Module:
        for replica in self.replicas:
            replica.train(mode)
        self.training = mode
        return self

    # ---- gradient reduction -------------------------------------------------------------------

    def _make_buckets(self, params: list[Tensor]) -> list[list[int]]:
        """Parameter indices, last first (the order backward finishes them), grouped by size."""
        buckets: list[list[int]] = []
        size = self.bucket_cap_bytes
        for j in reversed(range(len(params))):
            nbytes = params[j].numel() * params[j].dtype.itemsize
            if not buckets or size + nbytes > self.bucket_cap_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(j)
            size += nbytes
        return buckets

    def _group(self) -> _ProcessGroup:
        assert self._dist is not None, "only the processes mode reaches here, and it has a group"
        return self._dist

    def _hook_for(self, r: int, j: int) -> Callable[[Tensor], None]:
        return lambda _p: self._grad_ready(r, j)

    def _grad_ready(self, r: int, j: int) -> None:
        if not self._active:
            self._active = True
            self._pending = {b: {(rr, jj) for rr in range(len(self.replicas)) for jj in bucket}
                             for b, bucket in enumerate(self.buckets)}
            self._saved_realized = False
            queue_callback(self._finish)
        b = self._bucket_of[j]
        waiting = self._pending.get(b)
        if waiting is None:
            return
        waiting.discard((r, j))
        if not waiting:
            del self._pending[b]
            self._reduce(self.buckets[b])

    def _flat(self, r: int, bucket: list[int]) -> Tensor:
        parts = []
        for j in bucket:
            p = self._params[r][j]
            g = p.grad if p.grad is not None else Tensor.full(p.shape, 0, p.dtype, p.device)
            parts.append(g.reshape(-1))
        return cat(parts) if len(parts) > 1 else parts[0]

    def _scatter(self, r: int, bucket: list[int], flat: Tensor) -> None:
        offset = 0
        for j in bucket:
            p = self._params[r][j]
            n = p.numel()
            p.grad = flat[offset:offset + n].reshape(p.shape)
            offset += n

    def _reduce(self, bucket: list[int]) -> None:
        with no_grad():
            if self.mode == "devices":
                flats = [self._flat(r, bucket) for r in range(len(self.replicas))]
                for r, reduced in enumerate(allreduce(flats, "sum", self.algorithm)):
                    self._scatter(r, bucket, reduced)
                return
            flat = self._flat(0, bucket)
            node = lazy.graph_node(flat)
            if node is not None:  # a graph node: the step's realize (or a td.jit replay) runs the all-reduce
                self._scatter(0, bucket, Tensor(lazy.all_reduce(node, "mean", self.algorithm)))
                return
            from tinydist.frontend.tensor import _assign_observers
            if _assign_observers:
                raise RuntimeError("process-level DistributedDataParallel cannot run inside a td.jit capture "
                                   "(the all-reduce goes through the host)")
            if not self._saved_realized:  # the forward once, shared by every bucket's gradients
                realize(autograd.saved_nodes())
                self._saved_realized = True
            flat.realize()  # submitted; the worker thread waits for it and all-reduces it
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ddp-allreduce")
            dist = self._group()
            self._futures.append((bucket, self._executor.submit(lambda: dist.all_reduce(flat, op="mean", algorithm=self.algorithm))))

    def _finish(self) -> None:
        for b in sorted(self._pending):  # parameters that got no gradient this time: zeros
            self._reduce(self.buckets[b])
        self._pending = {}
        for bucket, future in self._futures:
            reduced = future.result()
            self._scatter(0, bucket, reduced.to(self.devices[0]) if reduced.device != self.devices[0] else reduced)
        self._futures = []
        self._active = False

    def _broadcast_parameters(self) -> None:
        dist = self._group()
        state = self.module.state_dict()
        with no_grad():
            for t in state.values():
                value = dist.broadcast(t if dist.rank() == 0 else t, src=0)
                t.assign(value.to(t.device))
        realize([t.node for t in state.values()])
