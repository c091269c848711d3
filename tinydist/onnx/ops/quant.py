"""Linear quantization ops: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear and the integer /
quantized-linear kernels (MatMulInteger, ConvInteger, QLinearMatMul, QLinearConv).

Semantics follow the ONNX reference (onnx.reference.ops), which onnxruntime agrees with:
quantize is `saturate(round_half_even(x / scale) + zero_point)` with the division in x's dtype
(or `precision`'s), the rounding and the zero point added in float32 (float64 for a float64 x:
every 8/16-bit integer is exact there); dequantize is `(x - zero_point) * scale` in float32, cast
to the scale's dtype. Scale and zero point are a scalar (per tensor), a 1-D vector along `axis`
(per axis) or, from version 21, a tensor of x's rank whose `axis` dimension counts blocks of
`block_size` (blocked). Integer matmuls accumulate in int32, as the ops define; integer
convolutions run the float64 convolution (exact: 8-bit products summed over < 2^37 terms).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tinydist.frontend.tensor import Tensor
from tinydist.graph import dtypes
from tinydist.onnx.ops._common import Value, norm_axis
from tinydist.onnx.ops.elementwise import round_half_even

_RANGES = {np.dtype(np.uint8): (0, 255), np.dtype(np.int8): (-128, 127), np.dtype(np.uint16): (0, 65535),
           np.dtype(np.int16): (-32768, 32767)}


def _quant_range(ctx: Any, dtype: np.dtype) -> tuple[int, int]:
    found = _RANGES.get(np.dtype(dtype))
    if found is None:
        raise ctx.error(f"quantized dtype {np.dtype(dtype)} is not supported (uint8, int8, uint16, int16)")
    return found


def _along(ctx: Any, value: Value, x_shape: tuple[int, ...], key: str) -> Tensor:
    """A scale or zero point shaped to broadcast against x: per tensor, per axis or blocked."""
    block = int(ctx.attr("block_size", 0)) if ctx.since >= 21 else 0
    shape = tuple(value.shape)
    if not block and (len(shape) == 0 or (len(shape) == 1 and shape[0] == 1)):
        if isinstance(value, np.ndarray):
            return ctx.lift(key, value.reshape(()))
        return value.reshape(())
    axis = norm_axis(ctx, ctx.attr("axis", 1), len(x_shape))  # the axis matters only per axis or blocked
    if not block:
        if len(shape) != 1 or shape[0] != x_shape[axis]:
            raise ctx.error(f"{key} of shape {shape} is neither a scalar nor a vector of x's axis {axis} "
                            f"(size {x_shape[axis]}); for blocked quantization set block_size")
        target = tuple(shape[0] if i == axis else 1 for i in range(len(x_shape)))
    else:
        blocks = -(-x_shape[axis] // block)
        if len(shape) != len(x_shape) or shape[axis] != blocks or \
                any(s != d for i, (s, d) in enumerate(zip(shape, x_shape)) if i != axis):
            raise ctx.error(f"{key} of shape {shape} does not block x of shape {x_shape} along axis {axis} "
                            f"in blocks of {block} (expected {blocks} there, x's sizes elsewhere)")
        if isinstance(value, np.ndarray):
            repeated = np.repeat(value, block, axis=axis).take(range(x_shape[axis]), axis=axis)
            return ctx.lift(key, np.ascontiguousarray(repeated))
        spread = value.reshape(shape[:axis + 1] + (1,) + shape[axis + 1:])
        spread = spread.expand(shape[:axis + 1] + (block,) + shape[axis + 1:])
        merged = spread.reshape(shape[:axis] + (blocks * block,) + shape[axis + 1:])
        return merged.shrink([(0, x_shape[axis]) if i == axis else (0, s) for i, s in enumerate(x_shape)])
    if isinstance(value, np.ndarray):
        return ctx.lift(key, np.ascontiguousarray(value.reshape(target)))
    return value.reshape(target)


def _value_dtype(value: Value) -> np.dtype:
    return value.dtype.np if isinstance(value, Tensor) else np.dtype(value.dtype)


def _wide(x: Tensor) -> dtypes.DType:
    return dtypes.float64 if x.dtype.np == np.float64 else dtypes.float32


def quantize(x: Tensor, scale: Tensor, zero_point: Tensor | None, target: np.dtype, lo: int, hi: int,
             precision: dtypes.DType | None = None) -> Tensor:
    """saturate(round_half_even(x / scale) + zero_point) as `target`."""
    if precision is not None:
        q = x.cast(precision) / scale.cast(precision)
    else:
        q = x / scale.cast(x.dtype)
    wide = _wide(q)
    q = round_half_even(q.cast(wide))
    if zero_point is not None:
        q = q + zero_point.cast(wide)
    return q.maximum(float(lo)).minimum(float(hi)).cast(dtypes.to_dtype(target))


def op_quantize_linear(ctx: Any, x: Tensor, scale: Value, zero_point: Value = None) -> Tensor:
    if not x.dtype.is_float:
        raise ctx.error(f"x must be a float tensor, got {x.dtype.name}")
    output_dtype = int(ctx.attr("output_dtype", 0)) if ctx.since >= 21 else 0
    if zero_point is not None:
        target = _value_dtype(zero_point)
        if output_dtype and ctx.target_dtype(output_dtype).np != target:
            raise ctx.error(f"output_dtype {ctx.target_dtype(output_dtype).name} differs from the zero point's "
                            f"dtype {target}")
    else:
        target = ctx.target_dtype(output_dtype).np if output_dtype else np.dtype(np.uint8)
    lo, hi = _quant_range(ctx, target)
    precision_attr = int(ctx.attr("precision", 0)) if ctx.since >= 23 else 0
    precision = ctx.target_dtype(precision_attr) if precision_attr else None
    s = _along(ctx, scale, x.shape, "y_scale")
    zp = _along(ctx, zero_point, x.shape, "y_zero_point") if zero_point is not None else None
    return quantize(x, s, zp, target, lo, hi, precision)


def op_dequantize_linear(ctx: Any, x: Tensor, scale: Value, zero_point: Value = None) -> Tensor:
    if x.dtype.is_float or x.dtype.is_bool:
        raise ctx.error(f"x must be an integer tensor, got {x.dtype.name}")
    if zero_point is not None and _value_dtype(zero_point) != x.dtype.np:
        raise ctx.error(f"the zero point's dtype {_value_dtype(zero_point)} differs from x's {x.dtype.name}")
    output_dtype = int(ctx.attr("output_dtype", 0)) if ctx.since >= 23 else 0
    out = ctx.target_dtype(output_dtype) if output_dtype else dtypes.to_dtype(_value_dtype(scale))
    wide = dtypes.float64 if out.np == np.float64 else dtypes.float32
    s = _along(ctx, scale, x.shape, "x_scale")
    y = x.cast(wide)
    if zero_point is not None:
        y = y - _along(ctx, zero_point, x.shape, "x_zero_point").cast(wide)
    return (y * s.cast(wide)).cast(out)


def op_dynamic_quantize_linear(ctx: Any, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """uint8 with the scale and zero point that span [min(x, 0), max(x, 0)]."""
    if x.dtype.np != np.float32:
        raise ctx.error(f"x must be float32, got {x.dtype.name}")
    high = x.max().maximum(0.0)
    low = x.min().minimum(0.0)
    span = high - low
    scale = (span == 0.0).where(1.0, span) / 255.0
    zero_point = round_half_even((low / scale * -1.0).maximum(0.0).minimum(255.0))
    y = (round_half_even(x / scale) + zero_point).maximum(0.0).minimum(255.0).cast(dtypes.uint8)
    return y, scale, zero_point.cast(dtypes.uint8)


# ---- integer and quantized-linear kernels ----------------------------------------------------------

def _integer(ctx: Any, value: Value, key: str) -> Tensor:
    dtype = _value_dtype(value)
    if dtype not in (np.dtype(np.uint8), np.dtype(np.int8)):
        raise ctx.error(f"{key} must be uint8 or int8, got {dtype}")
    return value if isinstance(value, Tensor) else ctx.lift(key, value)


def _centered(ctx: Any, value: Value, zero_point: Value, key: str, zp_shape: tuple[int, ...] | None,
              wide: dtypes.DType) -> Tensor:
    """value - zero_point in `wide`; zp_shape: how a 1-D zero point broadcasts (None: scalar only)."""
    t = _integer(ctx, value, key).cast(wide)
    if zero_point is None:
        return t
    if _value_dtype(zero_point) != _value_dtype(value):
        raise ctx.error(f"{key}'s zero point is {_value_dtype(zero_point)}, {key} is {_value_dtype(value)}")
    zp = zero_point if isinstance(zero_point, Tensor) else ctx.lift(key + "_zp", zero_point)
    if zp.ndim == 0 or zp.shape == (1,):
        return t - zp.reshape(()).cast(wide)
    if zp_shape is None or zp.ndim != 1:
        raise ctx.error(f"{key}'s zero point of shape {zp.shape} must be a scalar here")
    return t - zp.reshape(zp_shape).cast(wide)


def op_matmul_integer(ctx: Any, a: Value, b: Value, a_zero_point: Value = None, b_zero_point: Value = None) -> Tensor:
    a_shape, b_shape = tuple(a.shape), tuple(b.shape)
    a_zp_shape = (a_shape[-2], 1) if len(a_shape) >= 2 else None  # per row of A
    b_zp_shape = (b_shape[-1],) if b_shape else None  # per column of B
    ai = _centered(ctx, a, a_zero_point, "A", a_zp_shape, dtypes.int32)
    bi = _centered(ctx, b, b_zero_point, "B", b_zp_shape, dtypes.int32)
    return ai.matmul(bi)


def _size(t: Tensor) -> int:
    return int(np.prod(t.shape)) if t.shape else 1


def _requantize(ctx: Any, acc: Tensor, multiplier: Tensor, y_zero_point: Value, fallback: np.dtype) -> Tensor:
    """The int32 accumulator rescaled to the output's quantization (in float64, as the reference:
    int32 times a float32 scale promotes there)."""
    target = _value_dtype(y_zero_point) if y_zero_point is not None else np.dtype(fallback)
    lo, hi = _quant_range(ctx, target)
    y = round_half_even(acc.cast(dtypes.float64) * multiplier.cast(dtypes.float64))
    if y_zero_point is not None:
        zp = y_zero_point if isinstance(y_zero_point, Tensor) else ctx.lift("y_zp", y_zero_point)
        if _size(zp) != 1:
            raise ctx.error(f"y_zero_point of shape {zp.shape} must be a scalar")
        y = y + zp.reshape(()).cast(dtypes.float64)
    return y.maximum(float(lo)).minimum(float(hi)).cast(dtypes.to_dtype(target))


def _scale(ctx: Any, value: Value, key: str, shape: tuple[int, ...] | None = None) -> Tensor:
    t = value if isinstance(value, Tensor) else ctx.lift(key, value)
    t = t.cast(dtypes.float32)
    if _size(t) == 1:
        return t.reshape(())
    if shape is None:
        raise ctx.error(f"{key} of shape {t.shape} must be a scalar here")
    return t.reshape(shape)


def op_qlinear_matmul(ctx: Any, a: Value, a_scale: Value, a_zero_point: Value, b: Value, b_scale: Value,
                      b_zero_point: Value, y_scale: Value, y_zero_point: Value = None) -> Tensor:
    a_shape, b_shape = tuple(a.shape), tuple(b.shape)
    ai = _centered(ctx, a, a_zero_point, "a", (a_shape[-2], 1) if len(a_shape) >= 2 else None, dtypes.int32)
    bi = _centered(ctx, b, b_zero_point, "b", (b_shape[-1],) if b_shape else None, dtypes.int32)
    multiplier = (_scale(ctx, a_scale, "a_scale", (a_shape[-2], 1) if len(a_shape) >= 2 else None)
                  * _scale(ctx, b_scale, "b_scale", (b_shape[-1],) if b_shape else None)
                  / _scale(ctx, y_scale, "y_scale"))
    return _requantize(ctx, ai.matmul(bi), multiplier, y_zero_point, _value_dtype(a))


def _integer_conv(ctx: Any, x: Value, w: Value, x_zero_point: Value, w_zero_point: Value, bias: Value = None) -> Tensor:
    from tinydist.onnx.ops.conv import op_conv

    oc = w.shape[0]
    xi = _centered(ctx, x, x_zero_point, "x", None, dtypes.float64)
    wi = _centered(ctx, w, w_zero_point, "w", (oc,) + (1,) * (len(w.shape) - 1), dtypes.float64)
    acc = op_conv(ctx, xi, wi)
    if bias is not None:
        b = bias if isinstance(bias, Tensor) else ctx.lift("bias", bias)
        acc = acc + b.cast(dtypes.float64).reshape((1, oc) + (1,) * (acc.ndim - 2))
    return acc


def op_conv_integer(ctx: Any, x: Value, w: Value, x_zero_point: Value = None, w_zero_point: Value = None) -> Tensor:
    return _integer_conv(ctx, x, w, x_zero_point, w_zero_point).cast(dtypes.int32)


def op_qlinear_conv(ctx: Any, x: Value, x_scale: Value, x_zero_point: Value, w: Value, w_scale: Value,
                    w_zero_point: Value, y_scale: Value, y_zero_point: Value = None, bias: Value = None) -> Tensor:
    acc = _integer_conv(ctx, x, w, x_zero_point, w_zero_point, bias)
    oc = w.shape[0]
    multiplier = (_scale(ctx, x_scale, "x_scale") * _scale(ctx, w_scale, "w_scale", (1, oc) + (1,) * (acc.ndim - 2))
                  / _scale(ctx, y_scale, "y_scale"))
    return _requantize(ctx, acc.cast(dtypes.int32), multiplier, y_zero_point, _value_dtype(x))
