"""NegativeLogLikelihoodLoss (opset 12, 13, 22) and SoftmaxCrossEntropyLoss (12, 13).

The class pick is a one-hot select over the class axis (target == c), not a gather: a target equal
to ignore_index (which may lie outside [0, C)) simply selects nothing and gets weight 0. The
"mean" reduction divides by the summed weights of the elements that count, as onnx's reference.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tinydist.frontend.tensor import Tensor
from tinydist.onnx.ops._common import Value, as_tensor, require_float


def _nll(ctx: Any, log_prob: Tensor, target: Tensor, weight: Value) -> Tensor:
    if log_prob.ndim < 2:
        raise ctx.error(f"input must have a class axis (N, C, ...), got shape {log_prob.shape}")
    n, c = log_prob.shape[:2]
    if target.shape != (n,) + log_prob.shape[2:]:
        raise ctx.error(f"target shape {target.shape} does not match input shape {log_prob.shape} (N, d1, ... expected)")
    if target.dtype.is_float or target.dtype.is_bool:
        raise ctx.error(f"target dtype {target.dtype.name} is not supported (int32 / int64)")
    spatial = (1,) * (log_prob.ndim - 2)
    classes = ctx.lift(("classes", c, log_prob.ndim, target.dtype.name),
                       np.arange(c, dtype=target.dtype.np).reshape((1, c) + spatial))
    onehot = target.reshape((n, 1) + target.shape[1:]) == classes
    picked = onehot.where(log_prob, 0.0).sum(1, dtype=log_prob.dtype)
    ignore = ctx.attr("ignore_index", None)
    gw: Tensor | None = None
    if weight is not None:
        w = as_tensor(ctx, weight, "weight").cast(log_prob.dtype).reshape((1, c) + spatial)
        gw = onehot.where(w, 0.0).sum(1, dtype=log_prob.dtype)
    if ignore is not None:
        valid = target != int(ignore)
        gw = valid.where(gw if gw is not None else 1.0, 0.0).cast(log_prob.dtype)
    loss = -picked if gw is None else -(picked * gw)
    reduction = ctx.attr("reduction", "mean")
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum(dtype=log_prob.dtype)
    if reduction == "mean":
        return loss.mean() if gw is None else loss.sum(dtype=log_prob.dtype) / gw.sum(dtype=log_prob.dtype)
    raise ctx.error(f"reduction={reduction!r} is not supported (none, sum, mean)")


def op_nll_loss(ctx: Any, x: Tensor, target: Tensor, weight: Value = None) -> Tensor:
    require_float(ctx, x)
    return _nll(ctx, x, target, weight)


def op_softmax_cross_entropy(ctx: Any, x: Tensor, target: Tensor, weight: Value = None) -> Any:
    require_float(ctx, x)
    if x.ndim < 2:
        raise ctx.error(f"scores must have a class axis (N, C, ...), got shape {x.shape}")
    log_prob = x.log_softmax(1)
    loss = _nll(ctx, log_prob, target, weight)
    return (loss, log_prob) if ctx.n_outputs > 1 else loss
