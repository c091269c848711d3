"""ONNX op handlers: each maps one node onto td.Tensor ops.

A handler is `fn(ctx, *inputs) -> value | tuple[value, ...]`. Inputs at the op's *param* positions
(shape, axes, pads, scales, weights worth preparing once, ...) arrive as numpy arrays when they are
constant and as Tensors when they are not; every other input arrives as a Tensor (constants lifted
once at load). A handler may return numpy arrays: those outputs are constants (e.g. `Shape`).

Work that depends only on attributes and static shapes (index maps, divisors, re-laid-out weights)
goes through `ctx.memo` / `ctx.lift` so it happens once, at load, not on every call.

`FOLDS` holds numpy implementations used when every input of a node is constant (shape arithmetic
such as Shape→Gather→Concat→Reshape chains); other all-constant nodes are folded by running the
handler once at load and reading the result back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tinydist as td
from tinydist.onnx.ops._common import SUPPORTED_NP, erf, require_float, scalar_like, tanh
from tinydist.onnx.ops.elementwise import (
    _variadic, op_cast, op_cast_like, op_clip, op_div, op_dropout, op_elu, op_gelu, op_hard_sigmoid,
    op_hard_swish, op_identity, op_leaky_relu, op_mean, op_pow, op_softplus,
)
from tinydist.onnx.ops.folds import FOLDS
from tinydist.onnx.ops.nn import (
    _softmax_like, op_average_pool, op_batch_norm, op_conv, op_conv_transpose, op_gemm,
    op_global_average_pool, op_global_max_pool, op_layer_norm, op_matmul, op_max_pool, op_resize,
)
from tinydist.onnx.ops.shape import (
    _arg, _reduce, op_concat, op_constant, op_constant_of_shape, op_expand, op_flatten, op_gather,
    op_pad, op_range, op_reshape, op_shape, op_size, op_slice, op_split, op_squeeze, op_tile,
    op_transpose, op_unsqueeze,
)
from tinydist.tensor import Tensor


# ---- the table -----------------------------------------------------------------------------

class OpSpec:
    __slots__ = ("fn", "params", "attrs", "min_inputs")

    def __init__(self, fn: Callable[..., Any], params: Sequence[int] = (), attrs: Sequence[str] = (), min_inputs: int = 1):
        self.fn, self.params, self.attrs, self.min_inputs = fn, frozenset(params), frozenset(attrs), min_inputs


def _u(fn: Callable[[Tensor], Tensor]) -> Callable[..., Tensor]:
    return lambda ctx, x: fn(x)


def _uf(fn: Callable[[Tensor], Tensor]) -> Callable[..., Tensor]:
    def handler(ctx: Any, x: Tensor) -> Tensor:
        require_float(ctx, x)
        return fn(x)
    return handler


def _b(fn: Callable[[Tensor, Tensor], Tensor]) -> Callable[..., Tensor]:
    return lambda ctx, a, b: fn(a, b)


_POOL = ("auto_pad", "ceil_mode", "kernel_shape", "pads", "strides")
_REDUCE = ("keepdims", "noop_with_empty_axes", "axes")

OPS: dict[str, OpSpec] = {
    "Add": OpSpec(_b(lambda a, b: a + b), min_inputs=2), "Sub": OpSpec(_b(lambda a, b: a - b), min_inputs=2),
    "Mul": OpSpec(_b(lambda a, b: a * b), min_inputs=2), "Div": OpSpec(op_div, min_inputs=2),
    "Pow": OpSpec(op_pow, params=(1,), min_inputs=2),
    "Neg": OpSpec(_u(lambda x: x.neg())), "Abs": OpSpec(_u(lambda x: x.abs())),
    "Sqrt": OpSpec(_uf(lambda x: x.sqrt())), "Exp": OpSpec(_uf(lambda x: x.exp())), "Log": OpSpec(_uf(lambda x: x.log())),
    "Reciprocal": OpSpec(_uf(lambda x: x.reciprocal())), "Floor": OpSpec(_uf(lambda x: x.floor())),
    "Relu": OpSpec(_u(lambda x: x.maximum(scalar_like(x, 0)))),
    "LeakyRelu": OpSpec(op_leaky_relu, attrs=("alpha",)), "Elu": OpSpec(op_elu, attrs=("alpha",)),
    "Sigmoid": OpSpec(_uf(lambda x: x.sigmoid())), "HardSigmoid": OpSpec(op_hard_sigmoid, attrs=("alpha", "beta")),
    "HardSwish": OpSpec(op_hard_swish), "Tanh": OpSpec(_uf(tanh)), "Softplus": OpSpec(op_softplus),
    "Gelu": OpSpec(op_gelu, attrs=("approximate",)), "Erf": OpSpec(_uf(erf)),
    "Sin": OpSpec(_uf(lambda x: x.sin())), "Cos": OpSpec(_uf(lambda x: x.cos())),
    "Clip": OpSpec(op_clip, params=(1, 2)),
    "Min": OpSpec(_variadic(Tensor.minimum)), "Max": OpSpec(_variadic(Tensor.maximum)),
    "Sum": OpSpec(_variadic(lambda a, b: a + b)), "Mean": OpSpec(op_mean),
    "Where": OpSpec(lambda ctx, c, a, b: td.where(c, a, b), min_inputs=3),
    "Equal": OpSpec(_b(lambda a, b: a == b), min_inputs=2), "Less": OpSpec(_b(lambda a, b: a < b), min_inputs=2),
    "Greater": OpSpec(_b(lambda a, b: a > b), min_inputs=2),
    "LessOrEqual": OpSpec(_b(lambda a, b: a <= b), min_inputs=2), "GreaterOrEqual": OpSpec(_b(lambda a, b: a >= b), min_inputs=2),
    "Not": OpSpec(_u(lambda x: x.logical_not())), "And": OpSpec(_b(lambda a, b: a & b), min_inputs=2),
    "Or": OpSpec(_b(lambda a, b: a | b), min_inputs=2), "Xor": OpSpec(_b(lambda a, b: a ^ b), min_inputs=2),
    "Cast": OpSpec(op_cast, attrs=("to", "saturate")), "CastLike": OpSpec(op_cast_like, params=(1,), attrs=("saturate",), min_inputs=2),
    "Identity": OpSpec(op_identity),
    "Dropout": OpSpec(op_dropout, params=(1, 2), attrs=("ratio", "seed", "is_test")),
    "MatMul": OpSpec(op_matmul, params=(1,), min_inputs=2),
    "Gemm": OpSpec(op_gemm, params=(1, 2), attrs=("alpha", "beta", "transA", "transB"), min_inputs=2),
    "Conv": OpSpec(op_conv, params=(1, 2), attrs=("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"), min_inputs=2),
    "ConvTranspose": OpSpec(op_conv_transpose, params=(1, 2), attrs=("auto_pad", "dilations", "group", "kernel_shape", "output_padding",
                                                                      "output_shape", "pads", "strides"), min_inputs=2),
    "MaxPool": OpSpec(op_max_pool, attrs=_POOL + ("dilations", "storage_order")),
    "AveragePool": OpSpec(op_average_pool, attrs=_POOL + ("count_include_pad", "dilations")),
    "GlobalAveragePool": OpSpec(op_global_average_pool), "GlobalMaxPool": OpSpec(op_global_max_pool),
    "BatchNormalization": OpSpec(op_batch_norm, params=(1, 2, 3, 4), attrs=("epsilon", "momentum", "training_mode"), min_inputs=5),
    "LayerNormalization": OpSpec(op_layer_norm, attrs=("axis", "epsilon", "stash_type"), min_inputs=2),
    "Softmax": OpSpec(lambda ctx, x: _softmax_like(ctx, x, False), attrs=("axis",)),
    "LogSoftmax": OpSpec(lambda ctx, x: _softmax_like(ctx, x, True), attrs=("axis",)),
    "ReduceSum": OpSpec(_reduce("sum", 13), params=(1,), attrs=_REDUCE),
    "ReduceMean": OpSpec(_reduce("mean", 18), params=(1,), attrs=_REDUCE),
    "ReduceMax": OpSpec(_reduce("max", 18), params=(1,), attrs=_REDUCE),
    "ReduceMin": OpSpec(_reduce("min", 18), params=(1,), attrs=_REDUCE),
    "ReduceProd": OpSpec(_reduce("prod", 18), params=(1,), attrs=_REDUCE),
    "ReduceSumSquare": OpSpec(_reduce("sumsquare", 18), params=(1,), attrs=_REDUCE),
    "ReduceL1": OpSpec(_reduce("l1", 18), params=(1,), attrs=_REDUCE),
    "ReduceL2": OpSpec(_reduce("l2", 18), params=(1,), attrs=_REDUCE),
    "ReduceLogSumExp": OpSpec(_reduce("logsumexp", 18), params=(1,), attrs=_REDUCE),
    "ArgMax": OpSpec(_arg("max"), attrs=("axis", "keepdims", "select_last_index")),
    "ArgMin": OpSpec(_arg("min"), attrs=("axis", "keepdims", "select_last_index")),
    "Reshape": OpSpec(op_reshape, params=(1,), attrs=("allowzero",), min_inputs=2),
    "Flatten": OpSpec(op_flatten, attrs=("axis",)),
    "Transpose": OpSpec(op_transpose, attrs=("perm",)),
    "Squeeze": OpSpec(op_squeeze, params=(1,), attrs=("axes",)),
    "Unsqueeze": OpSpec(op_unsqueeze, params=(1,), attrs=("axes",)),
    "Concat": OpSpec(op_concat, attrs=("axis",)),
    "Split": OpSpec(op_split, params=(1,), attrs=("axis", "split", "num_outputs")),
    "Slice": OpSpec(op_slice, params=(1, 2, 3, 4), min_inputs=3),
    "Gather": OpSpec(op_gather, params=(0, 1), attrs=("axis",), min_inputs=2),
    "Expand": OpSpec(op_expand, params=(1,), min_inputs=2),
    "Tile": OpSpec(op_tile, params=(1,), min_inputs=2),
    "Pad": OpSpec(op_pad, params=(1, 2, 3), attrs=("mode",), min_inputs=2),
    "Resize": OpSpec(op_resize, params=(1, 2, 3), attrs=("antialias", "axes", "coordinate_transformation_mode", "cubic_coeff_a",
                                                         "exclude_outside", "extrapolation_value", "keep_aspect_ratio_policy",
                                                         "mode", "nearest_mode")),
    "Shape": OpSpec(op_shape, params=(0,), attrs=("start", "end")),
    "Size": OpSpec(op_size, params=(0,)),
    "ConstantOfShape": OpSpec(op_constant_of_shape, params=(0,), attrs=("value",)),
    "Range": OpSpec(op_range, params=(0, 1, 2), min_inputs=3),
    "Constant": OpSpec(op_constant, attrs=("value", "value_float", "value_floats", "value_int", "value_ints", "sparse_value",
                                           "value_string", "value_strings"), min_inputs=0),
}

__all__ = ["FOLDS", "OPS", "SUPPORTED_NP", "OpSpec"]
