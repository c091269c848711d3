"""The `ai.onnx.preview.training` optimizer ops (Adagrad, Momentum, Adam), as onnx's reference.

Each updates one or more tensors X with gradients G and optimizer state from a learning rate R
and a step count T (scalars, read when the plan is made: constant or value inputs). Several
tensors in one node come as X1, X2 …, G1, G2 …, state1, state2 …; the outputs likewise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tinydist.frontend.tensor import Tensor
from tinydist.onnx.ops._common import Value, static


def _scalar(ctx: Any, value: Value, what: str) -> float:
    return float(static(ctx, value, what).reshape(-1)[0])


def _groups(ctx: Any, tensors: tuple[Tensor, ...], per_tensor: int) -> list[list[Tensor]]:
    if not tensors or len(tensors) % per_tensor:
        raise ctx.error(f"expected {per_tensor} inputs per optimized tensor after R and T, got {len(tensors)}")
    n = len(tensors) // per_tensor
    return [[tensors[k * n + i] for k in range(per_tensor)] for i in range(n)]


def _outputs(ctx: Any, per_tensor: Sequence[Sequence[Tensor]]) -> Any:
    columns = [value for k in range(len(per_tensor[0])) for value in (p[k] for p in per_tensor)]
    return tuple(columns) if len(columns) > 1 else columns[0]


def op_adagrad(ctx: Any, r: Value, t: Value, *tensors: Tensor) -> Any:
    rate = _scalar(ctx, r, "R") / (1.0 + _scalar(ctx, t, "T") * ctx.attr("decay_factor", 0.0))
    norm, eps = ctx.attr("norm_coefficient", 0.0), ctx.attr("epsilon", 0.0)
    results = []
    for x, g, h in _groups(ctx, tensors, 3):
        g = x * norm + g
        h_new = h + g * g
        results.append((x - g / (h_new.sqrt() + eps) * rate, h_new))
    return _outputs(ctx, results)


def op_momentum(ctx: Any, r: Value, t: Value, *tensors: Tensor) -> Any:
    rate, step = _scalar(ctx, r, "R"), _scalar(ctx, t, "T")
    alpha, beta, norm = ctx.attr("alpha"), ctx.attr("beta"), ctx.attr("norm_coefficient")
    mode = ctx.attr("mode")
    if mode not in ("standard", "nesterov"):
        raise ctx.error(f"mode={mode!r} is not supported (standard, nesterov)")
    beta = beta if step > 0 else 1.0
    results = []
    for x, g, v in _groups(ctx, tensors, 3):
        g = x * norm + g
        v_new = v * alpha + g * beta
        step_dir = v_new if mode == "standard" else g + v_new * alpha
        results.append((x - step_dir * rate, v_new))
    return _outputs(ctx, results)


def op_adam(ctx: Any, r: Value, t: Value, *tensors: Tensor) -> Any:
    rate, step = _scalar(ctx, r, "R"), _scalar(ctx, t, "T")
    alpha, beta = ctx.attr("alpha", 0.9), ctx.attr("beta", 0.999)
    norm, norm_post, eps = ctx.attr("norm_coefficient", 0.0), ctx.attr("norm_coefficient_post", 0.0), ctx.attr("epsilon", 0.0)
    if step > 0:  # bias correction of the moments
        rate = float(np.float32(rate) * np.sqrt(np.float32(1 - beta ** step)) / np.float32(1 - alpha ** step))
    results = []
    for x, g, v, h in _groups(ctx, tensors, 4):
        g = x * norm + g
        v_new = v * alpha + g * (1 - alpha)
        h_new = h * beta + g * g * (1 - beta)
        x_new = x - v_new / (h_new.sqrt() + eps) * rate
        results.append((x_new * (1 - norm_post), v_new, h_new))
    return _outputs(ctx, results)
