"""Compound tensor ops built from the primitive ones: matmul, softmax, layernorm, convolution, pooling.

Matmul of float tensors becomes one MATMUL node (a packed, register-tiled native kernel); every
other op here is composition, so it fuses and schedules like the rest of the graph.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tinydist import dtypes
from tinydist.lazy import LazyNode, Op
from tinydist.tensor import Tensor, _normalize_axes


def _pair(value: Any, name: str) -> tuple[int, int]:
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or any(not isinstance(v, int) for v in pair):
        raise ValueError(f"{name} must be an int or a pair of ints, got {value!r}")
    return pair  # type: ignore[return-value]


# ---- matmul -----------------------------------------------------------------------------------

def matmul(a: Tensor, b: Tensor) -> Tensor:
    """numpy.matmul semantics: 1-D operands are promoted and the added axis removed; batch axes broadcast."""
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError(f"matmul: scalar operands are not allowed (shapes {a.shape} and {b.shape}); use *")
    if a.device != b.device:
        raise ValueError(f"matmul: operands are on different devices: {a.device} and {b.device}")
    x = a.reshape(1, a.shape[0]) if a.ndim == 1 else a
    y = b.reshape(b.shape[0], 1) if b.ndim == 1 else b
    if x.shape[-1] != y.shape[-2]:
        raise ValueError(f"matmul: inner dimensions differ: shapes {a.shape} and {b.shape} "
                         f"({x.shape[-1]} is not {y.shape[-2]})")
    try:
        batch = tuple(np.broadcast_shapes(x.shape[:-2], y.shape[:-2]))
    except ValueError:
        raise ValueError(f"matmul: batch dimensions of shapes {a.shape} and {b.shape} do not broadcast") from None
    dtype = dtypes.result_type(x.dtype, y.dtype)
    m, k, n = x.shape[-2], x.shape[-1], y.shape[-1]
    # A single row is a matrix-vector product: the fused multiply-reduce below streams the matrix
    # once, where the packed kernel would repack (and for a transposed weight, first copy) it.
    if dtype.is_float and m * n * k and m * math.prod(batch) > 1:
        result = _native_matmul(x.cast(dtype), y.cast(dtype), batch, m, k, n)
    elif dtype.is_bool:  # numpy: a logical or of ands
        result = (x.unsqueeze(-1) & y.unsqueeze(-3)).any(axis=-2)
    else:
        result = (x.cast(dtype).unsqueeze(-1) * y.cast(dtype).unsqueeze(-3)).sum(axis=-2, dtype=dtype)
    if a.ndim == 1:
        result = result.squeeze(-2)
    if b.ndim == 1:
        result = result.squeeze(-1)
    return result


def _native_matmul(x: Tensor, y: Tensor, batch: tuple[int, ...], m: int, k: int, n: int) -> Tensor:
    count = math.prod(batch)

    def operand(t: Tensor, rows: int, cols: int) -> Tensor:
        own = t.shape[:-2]
        if math.prod(own) == 1:  # one matrix shared by the whole batch: the kernel broadcasts it
            return t.reshape(1, rows, cols).contiguous()
        return t.expand(batch + (rows, cols)).reshape(count, rows, cols).contiguous()

    left, right = operand(x, m, k), operand(y, k, n)
    node = LazyNode(Op.MATMUL, (left.node, right.node), None, x.dtype, (count, m, n), x.device)
    return Tensor(node).reshape(batch + (m, n))


# ---- normalisation ----------------------------------------------------------------------------

def softmax(x: Tensor, axis: int = -1) -> Tensor:
    x = x.cast(dtypes.float_result(x.dtype))
    shifted = x - x.max(axis, keepdim=True)
    e = shifted.exp()
    return e / e.sum(axis, keepdim=True)


def log_softmax(x: Tensor, axis: int = -1) -> Tensor:
    x = x.cast(dtypes.float_result(x.dtype))
    shifted = x - x.max(axis, keepdim=True)
    return shifted - shifted.exp().sum(axis, keepdim=True).log()


def layernorm(x: Tensor, axis: int | tuple[int, ...] = -1, eps: float = 1e-5) -> Tensor:
    x = x.cast(dtypes.float_result(x.dtype))
    axes = _normalize_axes(axis, x.ndim)
    mean = x.mean(axes, keepdim=True)
    centered = x - mean
    variance = (centered * centered).mean(axes, keepdim=True)
    return centered / (variance + eps).sqrt()


# ---- windows: convolution and pooling ---------------------------------------------------------

def _windows(x: Tensor, kernel: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int]) -> Tensor:
    """(N, C, H, W) → (N, C, OH, OW, KH, KW) strided view of every window (x must be padded already)."""
    n, c, h, w = x.shape
    (kh, kw), (sh, sw), (dh, dw) = kernel, stride, dilation
    oh, ow = (h - dh * (kh - 1) - 1) // sh + 1, (w - dw * (kw - 1) - 1) // sw + 1
    if oh <= 0 or ow <= 0:
        raise ValueError(f"window {kernel} (dilation {dilation}) does not fit the padded input of shape {x.shape}")
    return x._as_strided((n, c, oh, ow, kh, kw), (c * h * w, h * w, sh * w, sw, dh * w, dw))


def _check_nchw(x: Tensor, op: str) -> None:
    if x.ndim != 4:
        raise ValueError(f"{op} expects an (N, C, H, W) input, got shape {x.shape}")


def conv2d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride: Any = 1, padding: Any = 0,
           dilation: Any = 1, groups: int = 1) -> Tensor:
    """2-D cross-correlation (as torch.nn.functional.conv2d): im2col, then weights @ columns."""
    _check_nchw(x, "conv2d")
    if weight.ndim != 4:
        raise ValueError(f"conv2d weight must be (out_channels, in_channels/groups, KH, KW), got shape {weight.shape}")
    n, c, _, _ = x.shape
    oc, cg, kh, kw = weight.shape
    if groups < 1 or c % groups or oc % groups or cg != c // groups:
        raise ValueError(f"conv2d: input channels {c}, weight shape {weight.shape} and groups={groups} do not match "
                         f"(need in_channels/groups == weight.shape[1] and out_channels divisible by groups)")
    if bias is not None and bias.shape != (oc,):
        raise ValueError(f"conv2d bias must have shape ({oc},), got {bias.shape}")
    (ph, pw), stride2, dilation2 = _pair(padding, "padding"), _pair(stride, "stride"), _pair(dilation, "dilation")
    dtype = dtypes.float_result(dtypes.result_type(x.dtype, weight.dtype))
    padded = x.cast(dtype).pad(((0, 0), (0, 0), (ph, ph), (pw, pw)))
    cols = _windows(padded, (kh, kw), stride2, dilation2)                       # N C OH OW KH KW
    _, _, oh, ow, _, _ = cols.shape
    # Weights on the left: (OC × C·KH·KW) @ (C·KH·KW × OH·OW) per image gives NCHW directly,
    # with the many pixels as the wide dimension of the packed kernel, and no transpose after.
    # materialized in this 7-D order (one affine view: no div/mod per element); the reshape after is free
    cols = cols.reshape(n, groups, cg, oh, ow, kh, kw).permute(0, 1, 2, 5, 6, 3, 4).contiguous()  # N G Cg KH KW OH OW
    cols = cols.reshape(n, groups, cg * kh * kw, oh * ow)
    w = weight.cast(dtype).reshape(groups, oc // groups, cg * kh * kw)             # G OCg K
    out = w.matmul(cols).reshape(n, oc, oh, ow)                                 # N G OCg (OH OW)
    if bias is not None:
        out = out + bias.cast(dtype).reshape(1, oc, 1, 1)
    return out


def _pool_args(kernel_size: Any, stride: Any, padding: Any, dilation: Any = 1) -> tuple[tuple[int, int], ...]:
    kernel = _pair(kernel_size, "kernel_size")
    return kernel, _pair(stride if stride is not None else kernel, "stride"), _pair(padding, "padding"), _pair(dilation, "dilation")


def max_pool2d(x: Tensor, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1) -> Tensor:
    _check_nchw(x, "max_pool2d")
    kernel, stride2, (ph, pw), dilation2 = _pool_args(kernel_size, stride, padding, dilation)
    if ph > kernel[0] // 2 or pw > kernel[1] // 2:
        raise ValueError(f"max_pool2d: padding {padding} must be at most half the kernel size {kernel}")
    low = float("-inf") if x.dtype.is_float else -(1 << (x.dtype.itemsize * 8 - 1))
    padded = x.pad(((0, 0), (0, 0), (ph, ph), (pw, pw)), value=low)
    return _windows(padded, kernel, stride2, dilation2).max(axis=(4, 5))


def avg_pool2d(x: Tensor, kernel_size: Any, stride: Any = None, padding: Any = 0) -> Tensor:
    """Average over each window, zero padding counted (torch's count_include_pad=True)."""
    _check_nchw(x, "avg_pool2d")
    kernel, stride2, (ph, pw), dilation2 = _pool_args(kernel_size, stride, padding)
    if ph > kernel[0] // 2 or pw > kernel[1] // 2:
        raise ValueError(f"avg_pool2d: padding {padding} must be at most half the kernel size {kernel}")
    padded = x.cast(dtypes.float_result(x.dtype)).pad(((0, 0), (0, 0), (ph, ph), (pw, pw)))
    return _windows(padded, kernel, stride2, dilation2).mean(axis=(4, 5))


__all__ = ["avg_pool2d", "conv2d", "layernorm", "log_softmax", "matmul", "max_pool2d", "softmax"]
