"""MatMul and Gemm (a constant weight packed once at load for the native kernel), and Det."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tinydist.codegen.matmul_packing import pack_b_array
from tinydist.frontend.functional import matmul_prepacked, prepacked_matmul_applies
from tinydist.frontend.tensor import Tensor
from tinydist.graph import dtypes
from tinydist.onnx.ops._common import Value, as_tensor, require_float, scalar_like, shrink_axis
from tinydist.runtime.registry import peer_group


def _times_weight(ctx: Any, a: Tensor, b: np.ndarray) -> Tensor:
    """a (…, M, K) @ a constant K×N weight. On a host device, where the native kernel runs, B is
    packed once here, at load, into the layout the kernel reads (not again on every call:
    packing cost the product ~1/M of its multiply-adds, all of it at small M). Otherwise B is
    uploaded as (1, K, N), so the kernel reads it in place."""
    k, n = b.shape
    if (peer_group(a.device) == "host" and a.dtype == dtypes.to_dtype(b.dtype) and not a.requires_grad
            and prepacked_matmul_applies(math.prod(a.shape[:-1]), k, n, a.dtype)):
        return matmul_prepacked(a, ctx.lift_made("B packed", lambda: pack_b_array(np.ascontiguousarray(b))), k, n)
    b3 = ctx.lift("B3", np.ascontiguousarray(b.reshape((1,) + b.shape)))
    return a.matmul(b3).reshape(a.shape[:-1] + (n,))


def op_matmul(ctx: Any, a: Tensor, b: Value) -> Tensor:
    if isinstance(b, np.ndarray) and b.ndim == 2 and a.ndim >= 2 and a.dtype.is_float:
        return _times_weight(ctx, a, b)
    return a.matmul(as_tensor(ctx, b, "B"))


def op_gemm(ctx: Any, a: Tensor, b: Value, c: Value = None) -> Tensor:
    alpha, beta = ctx.attr("alpha", 1.0), ctx.attr("beta", 1.0)
    if a.ndim != 2:
        raise ctx.error(f"A must be 2-D, got shape {a.shape}")
    if ctx.attr("transA", 0):
        a = a.permute(1, 0)
    if isinstance(b, np.ndarray):
        if b.ndim != 2:
            raise ctx.error(f"B must be 2-D, got shape {b.shape}")
        y = _times_weight(ctx, a, b.T if ctx.attr("transB", 0) else b)
    else:
        y = a.matmul(b.permute(1, 0) if ctx.attr("transB", 0) else b)
    if alpha != 1.0:
        y = y * scalar_like(y, alpha)
    if c is not None and beta != 0.0:
        if isinstance(c, np.ndarray):
            ct = ctx.lift("C", (c * c.dtype.type(beta)).astype(c.dtype) if beta != 1.0 else c)
        else:
            ct = c * scalar_like(c, beta) if beta != 1.0 else c
        y = y + ct
    return y


def op_det(ctx: Any, x: Tensor) -> Tensor:
    """Det over the last two axes by the Leibniz formula (n! products of n entries): exact
    arithmetic order for the small matrices it is for; n > 6 is refused."""
    require_float(ctx, x)
    n = x.shape[-1]
    if x.ndim < 2 or x.shape[-2] != n:
        raise ctx.error(f"input of shape {x.shape} is not a (batch of) square matrices")
    if n > 6:
        raise ctx.error(f"a {n}x{n} determinant is not supported (the Leibniz formula is used, up to 6x6)")
    import itertools

    rows = [shrink_axis(x, x.ndim - 2, i, i + 1).reshape(x.shape[:-2] + (n,)) for i in range(n)]
    entries = [[shrink_axis(row, row.ndim - 1, j, j + 1).reshape(x.shape[:-2]) for j in range(n)] for row in rows]
    total: Tensor | None = None
    for perm in itertools.permutations(range(n)):
        inversions = sum(perm[i] > perm[j] for i in range(n) for j in range(i + 1, n))
        term = entries[0][perm[0]]
        for i in range(1, n):
            term = term * entries[i][perm[i]]
        if total is None:
            total = term if inversions % 2 == 0 else term * -1.0
        else:
            total = total - term if inversions % 2 else total + term
    assert total is not None
    return total
