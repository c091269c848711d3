"""Sharded tensors: one logical tensor split along an axis over several devices of one process.

    x = td.Tensor(np_array).shard(["CPU:0", "CPU:1", "CPU:2"], axis=0)   # uneven splits allowed
    (x * 2).sum(axis=0)      # per-shard partial sums, then an allreduce: replicated on every device
    x.to("CPU:0")            # a real gather: each shard copied once, joined on the target

Elementwise ops run per shard (each device on its own worker threads, so shards run in parallel);
an operand that is an ordinary tensor is sliced to each shard's rows (or copied whole when it is
broadcast along the sharded axis). Reducing over the sharded axis reduces each shard, then
allreduces the partial results (`tinydist.multi.allreduce`). Movement ops that keep every shard's
elements on its device work per shard; one that would move elements between shards raises.
A replicated tensor (`axis=None`) holds one full copy per device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from tinydist.base.errors import TinydistError
from tinydist.engine.realize import realize
from tinydist.frontend.arguments import normalize_axes, normalize_axis
from tinydist.frontend.movement import cat
from tinydist.frontend.tensor import Tensor
from tinydist.graph import dtypes
from tinydist.graph.collectives import shard_sizes
from tinydist.graph.dtypes import DType
from tinydist.multi.allreduce import allreduce
from tinydist.runtime.registry import canonical_name


class ShardError(TinydistError, ValueError):
    """The operation would move elements between shards, or mixes incompatible shardings."""


class MultiTensor:
    """A tensor split over `devices` along `axis` (or replicated on each, when axis is None)."""

    def __init__(self, shards: Sequence[Tensor], axis: int | None) -> None:
        self.shards = list(shards)
        self.axis = axis

    # ---- construction -------------------------------------------------------------------------

    @staticmethod
    def shard(tensor: Tensor, devices: Sequence[str], axis: int | None = 0) -> MultiTensor:
        devices = [canonical_name(d) for d in devices]
        if not devices:
            raise ValueError("shard() needs at least one device")
        if len(set(devices)) != len(devices):
            raise ValueError(f"shard() devices must be distinct, got {devices}")
        if axis is None:
            return MultiTensor([tensor.to(d) for d in devices], None)
        axis = normalize_axis(axis, tensor.ndim)
        sizes = shard_sizes(tensor.shape[axis], len(devices))
        shards, start = [], 0
        for device, size in zip(devices, sizes):
            index = tuple(slice(start, start + size) if i == axis else slice(None) for i in range(tensor.ndim))
            shards.append(tensor[index].to(device))
            start += size
        return MultiTensor(shards, axis)

    # ---- properties ---------------------------------------------------------------------------

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(s.device for s in self.shards)

    @property
    def dtype(self) -> DType:
        return self.shards[0].dtype

    @property
    def shape(self) -> tuple[int, ...]:
        first = self.shards[0].shape
        if self.axis is None:
            return first
        return first[:self.axis] + (sum(s.shape[self.axis] for s in self.shards),) + first[self.axis + 1:]

    @property
    def ndim(self) -> int:
        return len(self.shards[0].shape)

    @property
    def bounds(self) -> list[tuple[int, int]]:
        """Each shard's [start, end) along the sharded axis."""
        result, start = [], 0
        for s in self.shards:
            size = s.shape[self.axis] if self.axis is not None else 0
            result.append((start, start + size))
            start += size
        return result

    def __repr__(self) -> str:
        how = f"axis {self.axis}" if self.axis is not None else "replicated"
        return f"<MultiTensor {self.dtype.name}{list(self.shape)} over {list(self.devices)}, {how}>"

    # ---- realizing ----------------------------------------------------------------------------

    def realize(self) -> MultiTensor:
        realize([s.node for s in self.shards])  # one schedule: every device's kernels submitted together
        return self

    def to(self, device: str) -> Tensor:
        """Gather onto one device (each shard copied once); a replicated tensor copies one replica."""
        device = canonical_name(device)
        if self.axis is None:
            local = next((s for s in self.shards if s.device == device), self.shards[0])
            return local.to(device)
        return cat([s.to(device) for s in self.shards], self.axis)

    def numpy(self) -> np.ndarray:
        self.realize()
        if self.axis is None:
            return self.shards[0].numpy()
        return np.concatenate([s.numpy() for s in self.shards], axis=self.axis)

    # ---- elementwise --------------------------------------------------------------------------

    def _local(self, other: Any, i: int, out_ndim: int) -> Any:
        """Shard i's part of an operand of an elementwise op whose result has `out_ndim` axes."""
        if isinstance(other, MultiTensor):
            if other.devices != self.devices or other.axis != self.axis or \
                    (self.axis is not None and other.bounds != self.bounds):
                raise ShardError(f"operands are sharded differently: {self!r} and {other!r}; reshard one with .to() and .shard()")
            return other.shards[i]
        if not isinstance(other, Tensor):
            return other  # a Python scalar or numpy value: the same for every shard
        device = self.shards[i].device
        if self.axis is None:
            return other.to(device)
        axis_in_other = self.axis - (out_ndim - other.ndim)
        if axis_in_other < 0 or other.shape[axis_in_other] == 1:
            return other.to(device)  # broadcast along the sharded axis: every shard needs all of it
        lo, hi = self.bounds[i]
        index = tuple(slice(lo, hi) if k == axis_in_other else slice(None) for k in range(other.ndim))
        return other[index].to(device)

    def _elementwise(self, name: str, *others: Any, **kwargs: Any) -> MultiTensor:
        shapes = [self.shape] + [o.shape for o in others if isinstance(o, (Tensor, MultiTensor))]
        out_ndim = len(np.broadcast_shapes(*shapes))
        if out_ndim != self.ndim:
            raise ShardError(f"{name}: the sharded operand must have the result's rank ({out_ndim}), got shape {self.shape}")
        shards = [getattr(s, name)(*(self._local(o, i, out_ndim) for o in others), **kwargs)
                  for i, s in enumerate(self.shards)]
        return MultiTensor(shards, self.axis)

    def __getattr__(self, name: str) -> Any:
        # Unary elementwise methods (exp, relu, cast, ...) apply per shard.
        if name in _PER_SHARD:
            return lambda *args, **kwargs: self._elementwise(name, *args, **kwargs)
        raise AttributeError(f"MultiTensor has no attribute {name!r}")

    def __add__(self, o: Any) -> MultiTensor: return self._elementwise("__add__", o)
    def __radd__(self, o: Any) -> MultiTensor: return self._elementwise("__radd__", o)
    def __sub__(self, o: Any) -> MultiTensor: return self._elementwise("__sub__", o)
    def __rsub__(self, o: Any) -> MultiTensor: return self._elementwise("__rsub__", o)
    def __mul__(self, o: Any) -> MultiTensor: return self._elementwise("__mul__", o)
    def __rmul__(self, o: Any) -> MultiTensor: return self._elementwise("__rmul__", o)
    def __truediv__(self, o: Any) -> MultiTensor: return self._elementwise("__truediv__", o)
    def __rtruediv__(self, o: Any) -> MultiTensor: return self._elementwise("__rtruediv__", o)
    def __pow__(self, o: Any) -> MultiTensor: return self._elementwise("__pow__", o)
    def __neg__(self) -> MultiTensor: return self._elementwise("__neg__")
    def __lt__(self, o: Any) -> MultiTensor: return self._elementwise("__lt__", o)
    def __gt__(self, o: Any) -> MultiTensor: return self._elementwise("__gt__", o)
    def __le__(self, o: Any) -> MultiTensor: return self._elementwise("__le__", o)
    def __ge__(self, o: Any) -> MultiTensor: return self._elementwise("__ge__", o)
    def __eq__(self, o: Any) -> MultiTensor: return self._elementwise("__eq__", o)  # type: ignore[override]
    def __ne__(self, o: Any) -> MultiTensor: return self._elementwise("__ne__", o)  # type: ignore[override]
    __hash__ = object.__hash__

    def maximum(self, o: Any) -> MultiTensor: return self._elementwise("maximum", o)
    def minimum(self, o: Any) -> MultiTensor: return self._elementwise("minimum", o)

    def where(self, a: Any, b: Any) -> MultiTensor:
        return self._elementwise("where", a, b)

    # ---- reductions ---------------------------------------------------------------------------

    def _reduce(self, op: str, axis: Any, keepdim: bool, algorithm: str) -> MultiTensor:
        axes = normalize_axes(axis, self.ndim)
        # Reducing a shard over an axis of size 1 (one row per device) is the identity: leave
        # those axes out, so the allreduce reads the shard itself instead of a copy of it.
        partial = [getattr(s, op)(axis=tuple(a for a in axes if s.shape[a] != 1), keepdim=True) if axes else s
                   for s in self.shards]
        if self.axis is not None and self.axis in axes:
            result = MultiTensor(allreduce(partial, op, algorithm), None)
            new_axis = None
        else:
            result = MultiTensor(partial, self.axis)
            new_axis = self.axis
        if keepdim:
            return result
        kept = [i for i in range(self.ndim) if i not in axes]
        shards = [s.reshape(tuple(s.shape[i] for i in kept)) for s in result.shards]
        return MultiTensor(shards, None if new_axis is None else kept.index(new_axis))

    def sum(self, axis: Any = None, keepdim: bool = False, algorithm: str = "auto") -> MultiTensor:
        return self._reduce("sum", axis, keepdim, algorithm)

    def max(self, axis: Any = None, keepdim: bool = False, algorithm: str = "auto") -> MultiTensor:
        return self._reduce("max", axis, keepdim, algorithm)

    def min(self, axis: Any = None, keepdim: bool = False, algorithm: str = "auto") -> MultiTensor:
        return self._reduce("min", axis, keepdim, algorithm)

    def prod(self, axis: Any = None, keepdim: bool = False, algorithm: str = "auto") -> MultiTensor:
        return self._reduce("prod", axis, keepdim, algorithm)

    def mean(self, axis: Any = None, keepdim: bool = False, algorithm: str = "auto") -> MultiTensor:
        axes = normalize_axes(axis, self.ndim)
        count = math.prod(self.shape[a] for a in axes)
        total = self.cast(dtypes.float_result(self.dtype))._reduce("sum", axis, keepdim, algorithm)
        return total / count

    # ---- movement -----------------------------------------------------------------------------

    def reshape(self, *shape: Any) -> MultiTensor:
        new = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)
        if self.axis is None:
            return MultiTensor([s.reshape(new) for s in self.shards], None)
        prefix = self.shape[:self.axis + 1]
        if tuple(new[:self.axis + 1]) != prefix:
            raise ShardError(f"reshape {self.shape} -> {new} would move elements between shards "
                             f"(axes up to the sharded axis {self.axis} must stay {prefix})")
        shards = [s.reshape(s.shape[:self.axis + 1] + tuple(new[self.axis + 1:])) for s in self.shards]
        return MultiTensor(shards, self.axis)

    def permute(self, *order: Any) -> MultiTensor:
        order_t = tuple(order[0]) if len(order) == 1 and isinstance(order[0], (tuple, list)) else tuple(order)
        shards = [s.permute(order_t) for s in self.shards]
        axis = None if self.axis is None else [normalize_axis(a, self.ndim) for a in order_t].index(self.axis)
        return MultiTensor(shards, axis)

    def transpose(self, *axes: int) -> MultiTensor:
        if not axes:
            return self.permute(tuple(reversed(range(self.ndim))))
        order = list(range(self.ndim))
        a, b = (normalize_axis(x, self.ndim) for x in axes)
        order[a], order[b] = order[b], order[a]
        return self.permute(tuple(order))

    def matmul(self, other: Tensor) -> MultiTensor:
        """Sharded rows (any axis but the contracted one) times a replicated/plain matrix."""
        if isinstance(other, MultiTensor):
            raise ShardError("matmul of two sharded tensors is not supported; gather one with .to()")
        if self.axis is not None and self.axis >= self.ndim - 1:
            raise ShardError(f"matmul contracts the sharded axis {self.axis}; shard along a batch or row axis instead")
        return MultiTensor([s.matmul(other.to(s.device)) for s in self.shards], self.axis)

    __matmul__ = matmul


_PER_SHARD = frozenset({"exp", "exp2", "log", "log2", "sqrt", "sin", "cos", "tanh", "sigmoid", "relu", "abs", "neg",
                        "cast", "astype", "reciprocal", "square", "clip", "floor", "logical_not", "contiguous"})


def shard(tensor: Tensor, devices: Sequence[str], axis: int | None = 0) -> MultiTensor:
    return MultiTensor.shard(tensor, devices, axis)
