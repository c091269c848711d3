"""Losses and activations. Losses take (N, C) logits / predictions and reduce with a mean by default.

A `MultiTensor` input (the output of an in-process `DistributedDataParallel`, sharded along the
batch) gives the loss of the whole batch as one Tensor on the first device: each shard's sum is
computed on its device and copied over, so backward() sends each replica its part of the gradient.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tinydist.frontend.autograd import no_grad
from tinydist.frontend.functional import avg_pool2d, conv2d, layernorm, log_softmax, max_pool2d, softmax
from tinydist.frontend.tensor import Tensor
from tinydist.graph import dtypes

__all__ = ["avg_pool2d", "conv2d", "cross_entropy", "gelu", "layernorm", "log_softmax", "max_pool2d", "mse_loss",
           "nll_loss", "relu", "sigmoid", "softmax", "tanh"]

_aranges: dict[tuple[int, str, str], Tensor] = {}


def relu(x: Tensor) -> Tensor:
    return x.relu()


def sigmoid(x: Tensor) -> Tensor:
    return x.sigmoid()


def tanh(x: Tensor) -> Tensor:
    return x.tanh()


def gelu(x: Tensor) -> Tensor:
    """GELU, tanh approximation (torch's approximate='tanh')."""
    return x * 0.5 * (1 + ((x + x * x * x * 0.044715) * math.sqrt(2 / math.pi)).tanh())


def _labels(target: Any, device: str) -> Tensor:
    if not isinstance(target, Tensor):
        target = Tensor(np.asarray(target, dtype=np.int64), device=device)
    if target.dtype.is_float:
        raise TypeError(f"class labels must be integers, got {target.dtype.name}")
    return target.to(device)


def check_indices(index: Tensor, count: int, what: str) -> None:
    """An index outside [0, count) would select a zero one-hot row and return a wrong value
    silently; where torch checks (indices that already hold values, as ones from numpy do) it is
    an IndexError here too. Computed indices are not read back: that would wait for the device in
    the middle of building the graph; and a replay reads its inputs without this check. The
    check reads the indices once on the host: ~2 us for 256 labels."""
    if index.node.realized and index.numel():
        values = index.numpy()
        low, high = int(values.min()), int(values.max())
        if low < 0 or high >= count:
            raise IndexError(f"{what} {low if low < 0 else high} is out of range: valid are 0 to {count - 1}")


def _one_hot(target: Tensor, classes: int, dtype: Any) -> Tensor:
    key = (classes, target.dtype.name, target.device)
    positions = _aranges.get(key)
    if positions is None:
        positions = _aranges[key] = Tensor.arange(classes, dtype=target.dtype, device=target.device).reshape(1, classes)
    return (target.reshape(-1, 1) == positions).cast(dtype)


def _reduce(per_sample: Tensor, reduction: str) -> Tensor:
    if reduction == "mean":
        return per_sample.mean()
    if reduction == "sum":
        return per_sample.sum()
    if reduction == "none":
        return per_sample
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def _sharded(loss: Any, input: Any, target: Any, reduction: str) -> Tensor:
    """The loss of a batch sharded over devices, reduced on the first device."""
    if reduction == "none":
        raise ValueError("reduction='none' is not supported for sharded inputs")
    if input.axis != 0:
        raise ValueError(f"a sharded loss input must be split along the batch axis, got axis {input.axis}")
    total: Tensor | None = None
    first = input.shards[0].device
    for shard, (lo, hi) in zip(input.shards, input.bounds):
        part_target = target[lo:hi] if isinstance(target, Tensor) else np.asarray(target)[lo:hi]
        if not isinstance(part_target, Tensor) or part_target.device != shard.device:
            part_target = part_target.to(shard.device) if isinstance(part_target, Tensor) else part_target
        part = loss(shard, part_target, reduction="sum").to(first)
        total = part if total is None else total + part
    assert total is not None
    count = input.shape[0] * (math.prod(input.shape[1:]) if loss is mse_loss else 1)
    return total / count if reduction == "mean" else total


def _is_sharded(x: Any) -> bool:
    from tinydist.multi.sharded import MultiTensor
    return isinstance(x, MultiTensor)


def cross_entropy(input: Any, target: Any, reduction: str = "mean") -> Tensor:
    """Softmax cross-entropy of (N, C) logits against (N,) integer class labels."""
    if _is_sharded(input):
        return _sharded(cross_entropy, input, target, reduction)
    if input.ndim != 2:
        raise ValueError(f"cross_entropy expects (N, C) logits, got shape {input.shape}")
    n, c = input.shape
    target = _labels(target, input.device)
    if target.shape != (n,):
        raise ValueError(f"cross_entropy: labels of shape {target.shape} for logits of shape {input.shape}")
    check_indices(target, c, f"cross_entropy: class label (of {c} classes)")
    x = input.cast(dtypes.float_result(input.dtype))
    with no_grad():  # the shift only keeps exp() in range; its gradient is exactly zero
        shift = x.max(1, keepdim=True)
    shifted = x - shift
    log_norm = shifted.exp().sum(1, keepdim=True).log()
    picked = (shifted * _one_hot(target, c, x.dtype)).sum(1)
    return _reduce(log_norm.reshape(n) - picked, reduction)


def nll_loss(input: Any, target: Any, reduction: str = "mean") -> Tensor:
    """Negative log-likelihood of (N, C) log-probabilities against (N,) integer labels."""
    if _is_sharded(input):
        return _sharded(nll_loss, input, target, reduction)
    n, c = input.shape
    target = _labels(target, input.device)
    check_indices(target, c, f"nll_loss: class label (of {c} classes)")
    return _reduce(-(input * _one_hot(target, c, input.dtype)).sum(1), reduction)


def mse_loss(input: Any, target: Any, reduction: str = "mean") -> Tensor:
    if _is_sharded(input):
        return _sharded(mse_loss, input, target, reduction)
    target = target if isinstance(target, Tensor) else Tensor(np.asarray(target, dtype=input.dtype.np), device=input.device)
    diff = input - target.to(input.device)
    return _reduce(diff * diff, reduction)
