"""Layers. Initialisation follows torch's defaults, drawn from the generator `td.manual_seed` seeds."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

import tinydist.frontend.tensor as _tensor_module
from tinydist.frontend.autograd import no_grad, pending_updates
from tinydist.frontend.functional import _pair
from tinydist.frontend.tensor import Tensor
from tinydist.train.nn import functional as F
from tinydist.train.nn.module import Module


def _uniform(shape: tuple[int, ...], bound: float, device: str | None) -> Tensor:
    values = (_tensor_module._rng.random(shape) * 2 - 1) * bound
    return Tensor(values.astype(np.float32), device=device, requires_grad=True)


def _const(shape: tuple[int, ...], value: float, device: str | None, grad: bool) -> Tensor:
    return Tensor(np.full(shape, value, np.float32), device=device, requires_grad=grad)


class Linear(Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: str | None = None) -> None:
        bound = 1 / math.sqrt(in_features) if in_features else 0.0
        self.in_features, self.out_features = in_features, out_features
        self.weight = _uniform((out_features, in_features), bound, device)
        self.bias = _uniform((out_features,), bound, device) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        y = x @ self.weight.T
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}"


class Conv2d(Module):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: Any, stride: Any = 1, padding: Any = 0,
                 dilation: Any = 1, groups: int = 1, bias: bool = True, device: str | None = None) -> None:
        kh, kw = _pair(kernel_size, "kernel_size")
        self.stride, self.padding, self.dilation, self.groups = stride, padding, dilation, groups
        self.in_channels, self.out_channels, self.kernel_size = in_channels, out_channels, (kh, kw)
        bound = 1 / math.sqrt(in_channels // groups * kh * kw)
        self.weight = _uniform((out_channels, in_channels // groups, kh, kw), bound, device)
        self.bias = _uniform((out_channels,), bound, device) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return x.conv2d(self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class BatchNorm2d(Module):
    """Batch statistics in training (biased variance to normalise, unbiased for the running
    variance, as torch); running statistics in eval. Each replica of a data-parallel model keeps
    its own running statistics (no synchronisation)."""

    _buffer_names = ("running_mean", "running_var", "num_batches_tracked")

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1, affine: bool = True,
                 device: str | None = None) -> None:
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.weight = _const((num_features,), 1.0, device, True) if affine else None
        self.bias = _const((num_features,), 0.0, device, True) if affine else None
        self.running_mean = _const((num_features,), 0.0, device, False)
        self.running_var = _const((num_features,), 1.0, device, False)
        self.num_batches_tracked = _const((), 0.0, device, False)

    def forward(self, x: Tensor) -> Tensor:
        if x.ndim != 4 or x.shape[1] != self.num_features:
            raise ValueError(f"BatchNorm2d({self.num_features}) expects (N, {self.num_features}, H, W), got {x.shape}")
        shape = (1, self.num_features, 1, 1)
        if self.training:
            mean = x.mean((0, 2, 3), keepdim=True)
            centered = x - mean
            var = (centered * centered).mean((0, 2, 3), keepdim=True)
            count = x.shape[0] * x.shape[2] * x.shape[3]
            with no_grad():
                m = self.momentum
                self.running_mean.assign(self.running_mean * (1 - m) + mean.reshape(-1) * m)
                unbiased = var.reshape(-1) * (count / max(count - 1, 1))
                self.running_var.assign(self.running_var * (1 - m) + unbiased * m)
                self.num_batches_tracked.assign(self.num_batches_tracked + 1)
                # realized with the next optimizer step, so the statistics' graph never piles up
                pending_updates.extend(t.node for t in (self.running_mean, self.running_var, self.num_batches_tracked))
            y = centered / (var + self.eps).sqrt()
        else:
            y = (x - self.running_mean.reshape(shape)) / (self.running_var.reshape(shape) + self.eps).sqrt()
        if self.weight is not None and self.bias is not None:  # both or neither: affine
            y = y * self.weight.reshape(shape) + self.bias.reshape(shape)
        return y


class LayerNorm(Module):
    def __init__(self, normalized_shape: Any, eps: float = 1e-5, elementwise_affine: bool = True,
                 device: str | None = None) -> None:
        self.normalized_shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.eps = eps
        self.weight = _const(self.normalized_shape, 1.0, device, True) if elementwise_affine else None
        self.bias = _const(self.normalized_shape, 0.0, device, True) if elementwise_affine else None

    def forward(self, x: Tensor) -> Tensor:
        axes = tuple(range(x.ndim - len(self.normalized_shape), x.ndim))
        y = F.layernorm(x, axes, self.eps)
        return y * self.weight + self.bias if self.weight is not None else y


class Embedding(Module):
    """Rows of `weight` by integer index (a one-hot matmul, so its gradient is a matmul too)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, device: str | None = None) -> None:
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        values = _tensor_module._rng.standard_normal((num_embeddings, embedding_dim)).astype(np.float32)
        self.weight = Tensor(values, device=device, requires_grad=True)

    def forward(self, index: Any) -> Tensor:
        if not isinstance(index, Tensor):
            index = Tensor(np.asarray(index, dtype=np.int64), device=self.weight.device)
        F.check_indices(index, self.num_embeddings, f"Embedding({self.num_embeddings}, {self.embedding_dim}): index")
        one_hot = F._one_hot(index.reshape(-1), self.num_embeddings, self.weight.dtype)
        return (one_hot @ self.weight).reshape(index.shape + (self.embedding_dim,))


class Dropout(Module):
    """Zeroes elements with probability p in training (mask from the seeded host generator) and
    scales the rest by 1/(1-p); the identity in eval. Under td.jit the captured mask is reused."""

    def __init__(self, p: float = 0.5) -> None:
        if not 0 <= p < 1:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0:
            return x
        keep = (_tensor_module._rng.random(x.shape) >= self.p).astype(x.dtype.np) / (1 - self.p)
        return x * Tensor(keep, device=x.device)


class ReLU(Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.relu()


class GELU(Module):
    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x)


class Sigmoid(Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.sigmoid()


class Tanh(Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.tanh()


class Flatten(Module):
    def __init__(self, start_axis: int = 1, end_axis: int = -1) -> None:
        self.start_axis, self.end_axis = start_axis, end_axis

    def forward(self, x: Tensor) -> Tensor:
        return x.flatten(self.start_axis, self.end_axis)


class MaxPool2d(Module):
    def __init__(self, kernel_size: Any, stride: Any = None, padding: Any = 0) -> None:
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding

    def forward(self, x: Tensor) -> Tensor:
        return x.max_pool2d(self.kernel_size, self.stride, self.padding)


class AvgPool2d(MaxPool2d):
    def forward(self, x: Tensor) -> Tensor:
        return x.avg_pool2d(self.kernel_size, self.stride, self.padding)


class Sequential(Module):
    def __init__(self, *layers: Module) -> None:
        for i, layer in enumerate(layers):
            setattr(self, str(i), layer)

    @property
    def layers(self) -> list[Module]:
        return list(self.children())

    def __getitem__(self, i: int) -> Module:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    def forward(self, x: Any) -> Any:
        for layer in self.children():
            x = layer(x)
        return x
