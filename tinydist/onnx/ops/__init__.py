"""ONNX op handlers: each maps one node onto Tensor ops.

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

from tinydist.frontend.tensor import Tensor, where
from tinydist.onnx.ops._common import SUPPORTED_NP, erf, require_float, scalar_like, tanh
from tinydist.onnx.ops.attention import op_attention, op_flex_attention, op_linear_attention, op_rotary_embedding
from tinydist.onnx.ops.control import op_if, op_loop, op_scan
from tinydist.onnx.ops.data_dependent import op_compress, op_non_max_suppression, op_nonzero, op_unique
from tinydist.onnx.ops.einsum import op_einsum
from tinydist.onnx.ops.elementwise import (
    _variadic, op_bitcast, op_cast, op_cast_like, op_clip, op_div, op_dropout, op_elu, op_gelu, op_hard_sigmoid,
    op_hard_swish, op_identity, op_leaky_relu, op_mean, op_pow, op_softplus,
)
from tinydist.onnx.ops.elementwise import (
    ceil, op_celu, op_is_inf, op_is_nan, op_mish, op_mod, op_prelu, op_selu, op_shrink, op_sign, op_softsign,
    op_bit_shift, op_swiglu, op_swish, op_thresholded_relu, op_trig, round_half_even,
)
from tinydist.onnx.ops.folds import FOLDS
from tinydist.onnx.ops.indexing import (
    op_cumprod, op_cumsum, op_gather_elements, op_tensor_scatter, op_reverse_sequence, op_gather_nd, op_one_hot, op_scatter_elements, op_scatter_nd, op_top_k, op_trilu,
)
from tinydist.onnx.ops.loss import op_nll_loss, op_softmax_cross_entropy
from tinydist.onnx.ops.conv import op_causal_conv_with_state, op_col2im, op_conv, op_conv_transpose
from tinydist.onnx.ops.linalg import op_det, op_gemm, op_matmul
from tinydist.onnx.ops.norm import (
    op_batch_norm, op_layer_norm, op_depth_to_space, op_group_norm, op_instance_norm, op_lp_norm, op_lrn, op_mean_variance_norm, op_rms_norm,
    op_space_to_depth,
)
from tinydist.onnx.ops.quant import (
    op_conv_integer, op_dequantize_linear, op_dynamic_quantize_linear, op_matmul_integer, op_qlinear_conv,
    op_qlinear_matmul, op_quantize_linear,
)
from tinydist.onnx.ops.pool import (
    op_average_pool, op_global_average_pool, op_global_max_pool, op_lp_pool, op_max_pool, op_max_unpool,
)
from tinydist.onnx.ops.resize import op_resize, op_upsample
from tinydist.onnx.ops.softmax import op_hardmax, op_log_softmax, op_softmax
from tinydist.onnx.ops.spectral import op_dft, op_mel_weight_matrix, op_stft, op_window
from tinydist.onnx.ops.ml import op_array_feature_extractor, op_binarizer, op_tree_ensemble
from tinydist.onnx.ops.recurrent import op_recurrent
from tinydist.onnx.ops.text import op_tfidf_vectorizer
from tinydist.onnx.ops.vision import op_affine_grid, op_deform_conv, op_grid_sample, op_image_decoder, op_roi_align
from tinydist.onnx.ops.sequence import (
    op_concat_from_sequence, op_optional, op_optional_get_element, op_optional_has_element, op_sequence_at,
    op_sequence_construct, op_sequence_empty, op_sequence_erase, op_sequence_insert, op_sequence_length,
    op_sequence_map, op_split_to_sequence,
)
from tinydist.onnx.ops.training import op_adagrad, op_adam, op_momentum
from tinydist.onnx.ops.shape import (
    _arg, _reduce, op_center_crop_pad, op_eye_like, op_concat, op_constant, op_constant_of_shape, op_expand, op_flatten, op_gather,
    op_pad, op_range, op_reshape, op_shape, op_size, op_slice, op_split, op_squeeze, op_tile,
    op_transpose, op_unsqueeze,
)


# ---- the table -----------------------------------------------------------------------------

class OpSpec:
    """One op's handler, its param positions, the attributes it reads (of every version) and, set
    from `VERSIONS`, the schema since_versions whose semantics it implements."""

    __slots__ = ("fn", "params", "static", "data", "attrs", "min_inputs", "versions", "subgraphs")

    def __init__(self, fn: Callable[..., Any], params: Sequence[int] = (), attrs: Sequence[str] = (), min_inputs: int = 1,
                 static: Sequence[int] = (), subgraphs: bool = False, data: Sequence[int] = ()):
        # subgraphs: GRAPH attributes are bodies the handler evaluates (If / Loop / Scan); every
        # input, declared or read by a body from the outer scope, arrives as numpy when constant
        # static: params whose values the graph's shapes depend on; fed from graph inputs, they are
        # read at call time and key the plan (see OnnxModel.value_inputs)
        # data: static params read at call time whatever their size (an encoded image), where other
        # static inputs past a few dozen elements are taken for data and refused
        self.fn, self.params, self.static = fn, frozenset(params) | frozenset(static) | frozenset(data), \
            frozenset(static) | frozenset(data)
        self.data = frozenset(data)
        self.attrs, self.min_inputs, self.subgraphs = frozenset(attrs), min_inputs, subgraphs
        self.versions: frozenset[int] = frozenset()


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
_CONV = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")

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
    "Clip": OpSpec(op_clip, params=(1, 2), attrs=("min", "max")),
    "Min": OpSpec(_variadic(Tensor.minimum)), "Max": OpSpec(_variadic(Tensor.maximum)),
    "Sum": OpSpec(_variadic(lambda a, b: a + b)), "Mean": OpSpec(op_mean),
    "Where": OpSpec(lambda ctx, c, a, b: where(c, a, b), min_inputs=3),
    "Equal": OpSpec(_b(lambda a, b: a == b), min_inputs=2), "Less": OpSpec(_b(lambda a, b: a < b), min_inputs=2),
    "Greater": OpSpec(_b(lambda a, b: a > b), min_inputs=2),
    "LessOrEqual": OpSpec(_b(lambda a, b: a <= b), min_inputs=2), "GreaterOrEqual": OpSpec(_b(lambda a, b: a >= b), min_inputs=2),
    "Not": OpSpec(_u(lambda x: x.logical_not())), "And": OpSpec(_b(lambda a, b: a & b), min_inputs=2),
    "Or": OpSpec(_b(lambda a, b: a | b), min_inputs=2), "Xor": OpSpec(_b(lambda a, b: a ^ b), min_inputs=2),
    "Cast": OpSpec(op_cast, attrs=("to", "saturate", "round_mode")),
    "BitCast": OpSpec(op_bitcast, attrs=("to",)),
    "CastLike": OpSpec(op_cast_like, params=(1,), attrs=("saturate", "round_mode"), min_inputs=2),
    "Identity": OpSpec(op_identity),
    "If": OpSpec(op_if, static=(0,), attrs=("then_branch", "else_branch"), subgraphs=True),
    "Loop": OpSpec(op_loop, static=(0, 1), attrs=("body",), min_inputs=0, subgraphs=True),
    "Scan": OpSpec(op_scan, attrs=("body", "directions", "num_scan_inputs", "scan_input_axes", "scan_input_directions", "scan_output_axes",
                                   "scan_output_directions"), subgraphs=True),
    "GridSample": OpSpec(op_grid_sample, attrs=("align_corners", "mode", "padding_mode"), min_inputs=2),
    "NonMaxSuppression": OpSpec(op_non_max_suppression, static=(0, 1, 2, 3, 4), attrs=("center_point_box",), min_inputs=2),
    "Col2Im": OpSpec(op_col2im, static=(1, 2), attrs=("dilations", "pads", "strides"), min_inputs=3),
    "MaxUnpool": OpSpec(op_max_unpool, static=(2,), attrs=("kernel_shape", "pads", "strides"), min_inputs=2),
    "Det": OpSpec(op_det),
    "STFT": OpSpec(op_stft, params=(2,), static=(1, 3), attrs=("onesided",), min_inputs=2),
    "TensorScatter": OpSpec(op_tensor_scatter, attrs=("axis", "mode"), min_inputs=2),
    "AffineGrid": OpSpec(op_affine_grid, static=(1,), attrs=("align_corners",), min_inputs=2),
    "OptionalHasElement": OpSpec(op_optional_has_element, params=(0,), min_inputs=0),
    "OptionalGetElement": OpSpec(op_optional_get_element, params=(0,)),
    "Optional": OpSpec(op_optional, params=(0,), attrs=("type",), min_inputs=0),
    # sequences: positions decide which element flows where, so they are static (see ops/sequence.py)
    "SequenceEmpty": OpSpec(op_sequence_empty, attrs=("dtype",), min_inputs=0),
    "SequenceConstruct": OpSpec(op_sequence_construct),
    "SequenceInsert": OpSpec(op_sequence_insert, static=(2,), min_inputs=2),
    "SequenceErase": OpSpec(op_sequence_erase, static=(1,)),
    "SequenceAt": OpSpec(op_sequence_at, static=(1,), min_inputs=2),
    "SequenceLength": OpSpec(op_sequence_length),
    "SplitToSequence": OpSpec(op_split_to_sequence, static=(1,), attrs=("axis", "keepdims")),
    "ConcatFromSequence": OpSpec(op_concat_from_sequence, attrs=("axis", "new_axis")),
    "SequenceMap": OpSpec(op_sequence_map, attrs=("body",), subgraphs=True),
    "Dropout": OpSpec(op_dropout, static=(1, 2), attrs=("ratio", "seed", "is_test")),
    "MatMul": OpSpec(op_matmul, params=(1,), min_inputs=2),
    "Gemm": OpSpec(op_gemm, params=(1, 2), attrs=("alpha", "beta", "transA", "transB"), min_inputs=2),
    "Conv": OpSpec(op_conv, params=(1, 2), attrs=("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"), min_inputs=2),
    "ConvTranspose": OpSpec(op_conv_transpose, params=(1, 2), attrs=("auto_pad", "dilations", "group", "kernel_shape", "output_padding",
                                                                      "output_shape", "pads", "strides"), min_inputs=2),
    "MaxPool": OpSpec(op_max_pool, attrs=_POOL + ("dilations", "storage_order")),
    "AveragePool": OpSpec(op_average_pool, attrs=_POOL + ("count_include_pad", "dilations")),
    "GlobalAveragePool": OpSpec(op_global_average_pool), "GlobalMaxPool": OpSpec(op_global_max_pool),
    "BatchNormalization": OpSpec(op_batch_norm, params=(1, 2, 3, 4), attrs=("epsilon", "momentum", "training_mode", "spatial"),
                                  min_inputs=5),
    "LayerNormalization": OpSpec(op_layer_norm, attrs=("axis", "epsilon", "stash_type"), min_inputs=2),
    "Softmax": OpSpec(op_softmax, attrs=("axis",)),
    "LogSoftmax": OpSpec(op_log_softmax, attrs=("axis",)),
    "Hardmax": OpSpec(op_hardmax, attrs=("axis",)),
    "ReduceSum": OpSpec(_reduce("sum", 13), static=(1,), attrs=_REDUCE),
    "ReduceMean": OpSpec(_reduce("mean", 18), static=(1,), attrs=_REDUCE),
    "ReduceMax": OpSpec(_reduce("max", 18), static=(1,), attrs=_REDUCE),
    "ReduceMin": OpSpec(_reduce("min", 18), static=(1,), attrs=_REDUCE),
    "ReduceProd": OpSpec(_reduce("prod", 18), static=(1,), attrs=_REDUCE),
    "ReduceSumSquare": OpSpec(_reduce("sumsquare", 18), static=(1,), attrs=_REDUCE),
    "ReduceL1": OpSpec(_reduce("l1", 18), static=(1,), attrs=_REDUCE),
    "ReduceL2": OpSpec(_reduce("l2", 18), static=(1,), attrs=_REDUCE),
    "ReduceLogSumExp": OpSpec(_reduce("logsumexp", 18), static=(1,), attrs=_REDUCE),
    "ArgMax": OpSpec(_arg("max"), attrs=("axis", "keepdims", "select_last_index")),
    "ArgMin": OpSpec(_arg("min"), attrs=("axis", "keepdims", "select_last_index")),
    "Reshape": OpSpec(op_reshape, static=(1,), attrs=("allowzero",), min_inputs=2),
    "Flatten": OpSpec(op_flatten, attrs=("axis",)),
    "Transpose": OpSpec(op_transpose, attrs=("perm",)),
    "Squeeze": OpSpec(op_squeeze, static=(1,), attrs=("axes",)),
    "Unsqueeze": OpSpec(op_unsqueeze, static=(1,), attrs=("axes",)),
    "Concat": OpSpec(op_concat, attrs=("axis",)),
    "Split": OpSpec(op_split, static=(1,), attrs=("axis", "split", "num_outputs")),
    "Slice": OpSpec(op_slice, static=(1, 2, 3, 4), attrs=("starts", "ends", "axes")),
    "Gather": OpSpec(op_gather, params=(0, 1), attrs=("axis",), min_inputs=2),
    "Expand": OpSpec(op_expand, static=(1,), min_inputs=2),
    "Tile": OpSpec(op_tile, static=(1,), min_inputs=2),
    "Pad": OpSpec(op_pad, params=(2,), static=(1, 3), attrs=("mode", "pads", "value")),
    "Resize": OpSpec(op_resize, static=(1, 2, 3), attrs=("antialias", "axes", "coordinate_transformation_mode", "cubic_coeff_a",
                                                         "exclude_outside", "extrapolation_value", "keep_aspect_ratio_policy",
                                                         "mode", "nearest_mode")),
    "Upsample": OpSpec(op_upsample, static=(1,), attrs=("mode", "scales")),
    "Shape": OpSpec(op_shape, params=(0,), attrs=("start", "end")),
    "Size": OpSpec(op_size, params=(0,)),
    "ConstantOfShape": OpSpec(op_constant_of_shape, static=(0,), attrs=("value",)),
    "Range": OpSpec(op_range, static=(0, 1, 2), attrs=("stash_type",), min_inputs=3),
    "Ceil": OpSpec(_uf(ceil)), "Round": OpSpec(_uf(round_half_even)), "Sign": OpSpec(op_sign),
    "Mod": OpSpec(op_mod, attrs=("fmod",), min_inputs=2),
    **{op: OpSpec(op_trig(op.lower())) for op in ("Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh")},
    "PRelu": OpSpec(op_prelu, params=(1,), min_inputs=2), "Selu": OpSpec(op_selu, attrs=("alpha", "gamma")),
    "Celu": OpSpec(op_celu, attrs=("alpha",)), "Mish": OpSpec(op_mish), "Softsign": OpSpec(op_softsign),
    "Shrink": OpSpec(op_shrink, attrs=("bias", "lambd")), "ThresholdedRelu": OpSpec(op_thresholded_relu, attrs=("alpha",)),
    "Swish": OpSpec(op_swish, attrs=("alpha",)),
    "IsInf": OpSpec(op_is_inf, attrs=("detect_negative", "detect_positive")), "IsNaN": OpSpec(op_is_nan),
    "BitwiseAnd": OpSpec(_b(lambda a, b: a & b), min_inputs=2), "BitwiseOr": OpSpec(_b(lambda a, b: a | b), min_inputs=2),
    "BitwiseXor": OpSpec(_b(lambda a, b: a ^ b), min_inputs=2), "BitwiseNot": OpSpec(_u(lambda x: ~x)),
    "GatherElements": OpSpec(op_gather_elements, attrs=("axis",), min_inputs=2),
    "GatherND": OpSpec(op_gather_nd, attrs=("batch_dims",), min_inputs=2),
    "ScatterElements": OpSpec(op_scatter_elements, attrs=("axis", "reduction"), min_inputs=3),
    "Scatter": OpSpec(op_scatter_elements, attrs=("axis",), min_inputs=3),
    "ScatterND": OpSpec(op_scatter_nd, attrs=("reduction",), min_inputs=3),
    "OneHot": OpSpec(op_one_hot, params=(2,), static=(1,), attrs=("axis",), min_inputs=3),
    "Trilu": OpSpec(op_trilu, static=(1,), attrs=("upper",)),
    "CumSum": OpSpec(op_cumsum, static=(1,), attrs=("exclusive", "reverse"), min_inputs=2),
    "TopK": OpSpec(op_top_k, static=(1,), attrs=("axis", "largest", "sorted", "k")),
    "InstanceNormalization": OpSpec(op_instance_norm, params=(1, 2), attrs=("epsilon",), min_inputs=3),
    "GroupNormalization": OpSpec(op_group_norm, params=(1, 2), attrs=("epsilon", "num_groups", "stash_type"), min_inputs=3),
    "RMSNormalization": OpSpec(op_rms_norm, params=(1,), attrs=("axis", "epsilon", "stash_type"), min_inputs=2),
    "LpNormalization": OpSpec(op_lp_norm, attrs=("axis", "p")),
    "MeanVarianceNormalization": OpSpec(op_mean_variance_norm, attrs=("axes",)),
    "LRN": OpSpec(op_lrn, attrs=("alpha", "beta", "bias", "size")),
    "DepthToSpace": OpSpec(op_depth_to_space, attrs=("blocksize", "mode")),
    "SpaceToDepth": OpSpec(op_space_to_depth, attrs=("blocksize", "mode")),
    "Constant": OpSpec(op_constant, attrs=("value", "value_float", "value_floats", "value_int", "value_ints", "sparse_value",
                                           "value_string", "value_strings"), min_inputs=0),
    "Attention": OpSpec(op_attention, attrs=("is_causal", "kv_num_heads", "q_num_heads", "qk_matmul_output_mode", "scale",
                                             "softcap", "softmax_precision", "left_window_size", "right_window_size"),
                        min_inputs=3),
    "LinearAttention": OpSpec(op_linear_attention, attrs=("chunk_size", "kv_num_heads", "q_num_heads", "scale", "update_rule"),
                              min_inputs=3),
    "RotaryEmbedding": OpSpec(op_rotary_embedding, params=(1, 2), attrs=("interleaved", "num_heads", "rotary_embedding_dim"),
                              min_inputs=3),
    **{op: OpSpec(op_recurrent, params=(4,), min_inputs=3,
                  attrs=("activation_alpha", "activation_beta", "activations", "clip", "direction", "hidden_size", "layout",
                         "linear_before_reset", "input_forget")) for op in ("RNN", "GRU", "LSTM")},
    "NonZero": OpSpec(op_nonzero, static=(0,)), "Unique": OpSpec(op_unique, static=(0,), attrs=("axis", "sorted")),
    "Compress": OpSpec(op_compress, params=(0,), static=(1,), attrs=("axis",), min_inputs=2),
    "ReverseSequence": OpSpec(op_reverse_sequence, params=(1,), attrs=("batch_axis", "time_axis"), min_inputs=2),
    "DFT": OpSpec(op_dft, static=(1, 2), attrs=("axis", "inverse", "onesided")),
    "CausalConvWithState": OpSpec(op_causal_conv_with_state, attrs=("activation",), min_inputs=2),
    "BitShift": OpSpec(op_bit_shift, attrs=("direction",), min_inputs=2),
    "SwiGLU": OpSpec(op_swiglu, attrs=("alpha",), min_inputs=2),
    **{f"{kind.capitalize()}Window": OpSpec(op_window(kind), static=(0,), attrs=("output_datatype", "periodic"))
       for kind in ("hann", "hamming", "blackman")},
    "MelWeightMatrix": OpSpec(op_mel_weight_matrix, static=(0, 1, 2, 3, 4), attrs=("output_datatype",), min_inputs=5),
    "EyeLike": OpSpec(op_eye_like, params=(0,), attrs=("dtype", "k")),
    "CenterCropPad": OpSpec(op_center_crop_pad, static=(1,), attrs=("axes",), min_inputs=2),
    "Einsum": OpSpec(op_einsum, attrs=("equation",)),
    "RoiAlign": OpSpec(op_roi_align, params=(1,), attrs=("coordinate_transformation_mode", "mode", "output_height", "output_width",
                                                        "sampling_ratio", "spatial_scale"), min_inputs=3),
    "ImageDecoder": OpSpec(op_image_decoder, data=(0,), attrs=("pixel_format",)),
    "DeformConv": OpSpec(op_deform_conv, params=(1, 3), attrs=("dilations", "group", "kernel_shape", "offset_group", "pads",
                                                              "strides"), min_inputs=3),
    "TfIdfVectorizer": OpSpec(op_tfidf_vectorizer, attrs=("max_gram_length", "max_skip_count", "min_gram_length", "mode",
                                                          "ngram_counts", "ngram_indexes", "pool_int64s", "pool_strings",
                                                          "weights")),
    "LpPool": OpSpec(op_lp_pool, attrs=_POOL + ("dilations", "p")),
    "CumProd": OpSpec(op_cumprod, static=(1,), attrs=("exclusive", "reverse"), min_inputs=2),
    "ReduceLogSum": OpSpec(_reduce("logsum", 18), static=(1,), attrs=_REDUCE),
    "NegativeLogLikelihoodLoss": OpSpec(op_nll_loss, params=(2,), attrs=("ignore_index", "reduction"), min_inputs=2),
    "SoftmaxCrossEntropyLoss": OpSpec(op_softmax_cross_entropy, params=(2,), attrs=("ignore_index", "reduction"), min_inputs=2),
    "QuantizeLinear": OpSpec(op_quantize_linear, params=(1, 2), attrs=("axis", "block_size", "output_dtype", "precision",
                                                                      "saturate"), min_inputs=2),
    "DequantizeLinear": OpSpec(op_dequantize_linear, params=(1, 2), attrs=("axis", "block_size", "output_dtype"), min_inputs=2),
    "DynamicQuantizeLinear": OpSpec(op_dynamic_quantize_linear),
    "MatMulInteger": OpSpec(op_matmul_integer, params=(1, 2, 3), min_inputs=2),
    "QLinearMatMul": OpSpec(op_qlinear_matmul, params=(1, 2, 3, 4, 5, 6, 7), min_inputs=7),
    "ConvInteger": OpSpec(op_conv_integer, params=(1, 2, 3), attrs=_CONV, min_inputs=2),
    "QLinearConv": OpSpec(op_qlinear_conv, params=(1, 2, 3, 4, 5, 6, 7, 8), attrs=_CONV, min_inputs=8),
}

# The since_versions each handler implements, from opset 7 (the oldest accepted) to the installed
# onnx's newest. A version absent here is refused at load, naming the ones that are here; versions
# that only add element types (bfloat16, float8, int4 …) are listed: the dtype check refuses those.
VERSIONS: dict[str, tuple[int, ...]] = {
    "Abs": (6, 13), "Add": (7, 13, 14), "And": (7,), "ArgMax": (1, 11, 12, 13), "ArgMin": (1, 11, 12, 13),
    "AveragePool": (7, 10, 11, 19, 22), "BatchNormalization": (7, 9, 14, 15),
    "Cast": (6, 9, 13, 19, 21, 23, 24, 25, 28), "BitCast": (26,), "CastLike": (15, 19, 21, 23, 24, 25), "Clip": (6, 11, 12, 13),
    "Concat": (4, 11, 13), "Constant": (1, 9, 11, 12, 13, 19, 21, 23, 24, 25),
    "ConstantOfShape": (9, 20, 21, 23, 24, 25), "Conv": (1, 11, 22), "ConvTranspose": (1, 11, 22), "Cos": (7, 22),
    "Div": (7, 13, 14), "Dropout": (7, 10, 12, 13, 22), "Elu": (6, 22), "Equal": (7, 11, 13, 19), "Erf": (9, 13),
    "Exp": (6, 13), "Expand": (8, 13), "Flatten": (1, 9, 11, 13, 21, 23, 24, 25), "Floor": (6, 13),
    "Gather": (1, 11, 13), "Gelu": (20,), "Gemm": (7, 9, 11, 13), "GlobalAveragePool": (1, 22),
    "GlobalMaxPool": (1, 22), "Greater": (7, 9, 13), "GreaterOrEqual": (12, 16), "Hardmax": (1, 11, 13),
    "HardSigmoid": (6, 22), "HardSwish": (14, 22), "Identity": (1, 13, 14, 16, 19, 21, 23, 24, 25),
    "LayerNormalization": (17,), "LeakyRelu": (6, 16), "Less": (7, 9, 13), "LessOrEqual": (12, 16),
    "Log": (6, 13), "LogSoftmax": (1, 11, 13), "MatMul": (1, 9, 13), "Max": (6, 8, 12, 13),
    "MaxPool": (1, 8, 10, 11, 12, 22), "Mean": (6, 8, 13), "Min": (6, 8, 12, 13), "Mul": (7, 13, 14),
    "Neg": (6, 13), "Not": (1,), "Or": (7,), "Pad": (2, 11, 13, 18, 19, 21, 23, 24, 25), "Pow": (7, 12, 13, 15),
    "Range": (11, 27), "Reciprocal": (6, 13), "ReduceL1": (1, 11, 13, 18), "ReduceL2": (1, 11, 13, 18),
    "ReduceLogSumExp": (1, 11, 13, 18, 28), "ReduceMax": (1, 11, 12, 13, 18, 20), "ReduceMean": (1, 11, 13, 18),
    "ReduceMin": (1, 11, 12, 13, 18, 20), "ReduceProd": (1, 11, 13, 18), "ReduceSum": (1, 11, 13),
    "ReduceSumSquare": (1, 11, 13, 18), "Relu": (6, 13, 14), "Reshape": (5, 13, 14, 19, 21, 23, 24, 25),
    "Resize": (10, 11, 13, 18, 19), "Shape": (1, 13, 15, 19, 21, 23, 24, 25), "Sigmoid": (6, 13), "Sin": (7, 22),
    "Size": (1, 13, 19, 21, 23, 24, 25), "Slice": (1, 10, 11, 13), "Softmax": (1, 11, 13), "Softplus": (1, 22),
    "Split": (2, 11, 13, 18), "Sqrt": (6, 13), "Squeeze": (1, 11, 13, 21, 23, 24, 25), "Sub": (7, 13, 14),
    "Sum": (6, 8, 13), "Tanh": (6, 13), "Tile": (6, 13), "Transpose": (1, 13, 21, 23, 24, 25),
    "Unsqueeze": (1, 11, 13, 21, 23, 24, 25), "Upsample": (7, 9), "Where": (9, 16), "Xor": (7,),
    "Ceil": (6, 13), "Round": (11, 22), "Sign": (9, 13), "Mod": (10, 13, 28), "Tan": (7, 22), "Asin": (7, 22),
    "Acos": (7, 22), "Atan": (7, 22), "Sinh": (9, 22), "Cosh": (9, 22), "Asinh": (9, 22), "Acosh": (9, 22),
    "Atanh": (9, 22), "PRelu": (7, 9, 16), "Selu": (6, 22), "Celu": (12, 28), "Mish": (18, 22), "Softsign": (1, 22),
    "Shrink": (9,), "ThresholdedRelu": (10, 22), "Swish": (24,), "IsInf": (10, 20), "IsNaN": (9, 13, 20),
    "BitwiseAnd": (18,), "BitwiseOr": (18,), "BitwiseXor": (18,), "BitwiseNot": (18,),
    "GatherElements": (11, 13), "GatherND": (11, 12, 13), "ScatterElements": (11, 13, 16, 18), "Scatter": (9,),
    "ScatterND": (11, 13, 16, 18), "OneHot": (9, 11, 28), "Trilu": (14,), "CumSum": (11, 14), "TopK": (1, 10, 11, 24),
    "InstanceNormalization": (6, 22), "GroupNormalization": (18, 21), "RMSNormalization": (23,),
    "LpNormalization": (1, 22), "MeanVarianceNormalization": (9, 13), "LRN": (1, 13),
    "DepthToSpace": (1, 11, 13, 28), "SpaceToDepth": (1, 13, 28), "Attention": (23, 24, 25), "RotaryEmbedding": (23,), "LinearAttention": (27,),
    "NegativeLogLikelihoodLoss": (12, 13, 22), "SoftmaxCrossEntropyLoss": (12, 13),
    "LpPool": (2, 11, 18, 22), "CumProd": (26,), "ReduceLogSum": (1, 11, 13, 18, 28),
    "Einsum": (12, 28), "DeformConv": (19, 22), "ImageDecoder": (20,), "RoiAlign": (10, 16, 22), "TfIdfVectorizer": (9,), "RNN": (7, 14, 22),
    "BitShift": (11, 28), "CausalConvWithState": (27,), "DFT": (17, 20), "ReverseSequence": (10, 28), "SwiGLU": (28,), "HannWindow": (17,), "HammingWindow": (17,), "BlackmanWindow": (17,), "EyeLike": (9, 22), "MelWeightMatrix": (17,),
    "CenterCropPad": (18,), "NonZero": (9, 13), "Unique": (11, 28), "Compress": (9, 11, 28), "GRU": (7, 14, 22), "LSTM": (7, 14, 22),
    "QuantizeLinear": (10, 13, 19, 21, 23, 24, 25, 28), "DequantizeLinear": (10, 13, 19, 21, 23, 24, 25, 28),
    "DynamicQuantizeLinear": (11,), "MatMulInteger": (10,), "QLinearMatMul": (10, 21), "ConvInteger": (10,),
    "QLinearConv": (10,), "OptionalHasElement": (15, 18, 28), "OptionalGetElement": (15, 18, 28), "Optional": (15, 28),
    "SequenceEmpty": (11,), "SequenceConstruct": (11,), "SequenceInsert": (11,), "SequenceErase": (11,), "SequenceAt": (11,),
    "SequenceLength": (11,), "SplitToSequence": (11, 24), "ConcatFromSequence": (11,), "SequenceMap": (17,),
    "If": (1, 11, 13, 16, 19, 21, 23, 24, 25), "Loop": (1, 11, 13, 16, 19, 21, 23, 24, 25), "Scan": (8, 9, 11, 16, 19, 21, 23, 24, 25),
    "AffineGrid": (20,), "GridSample": (16, 20, 22), "NonMaxSuppression": (10, 11), "Col2Im": (18,),
    "MaxUnpool": (9, 11, 22), "Det": (11, 22), "TensorScatter": (24,), "STFT": (17,),
}
for _name, _spec in OPS.items():
    _spec.versions = frozenset(VERSIONS.get(_name, ()))  # an op missing here is refused at every version

# Other domains: their ops by domain, with the since_versions implemented.
TRAINING, PREVIEW, ML = "ai.onnx.preview.training", "ai.onnx.preview", "ai.onnx.ml"
DOMAIN_OPS: dict[str, dict[str, OpSpec]] = {PREVIEW: {
    "FlexAttention": OpSpec(op_flex_attention, attrs=("prob_mod", "scale", "score_mod", "softmax_precision"), min_inputs=3,
                            subgraphs=True),
}, ML: {
    "ArrayFeatureExtractor": OpSpec(op_array_feature_extractor, params=(1,), min_inputs=2),
    "Binarizer": OpSpec(op_binarizer, attrs=("threshold",)),
    "TreeEnsemble": OpSpec(op_tree_ensemble, attrs=(
        "aggregate_function", "leaf_targetids", "leaf_weights", "membership_values", "n_targets", "nodes_falseleafs",
        "nodes_falsenodeids", "nodes_featureids", "nodes_hitrates", "nodes_missing_value_tracks_true", "nodes_modes",
        "nodes_splits", "nodes_trueleafs", "nodes_truenodeids", "post_transform", "tree_roots")),
}, TRAINING: {
    "Adagrad": OpSpec(op_adagrad, static=(0, 1), attrs=("decay_factor", "epsilon", "norm_coefficient"), min_inputs=5),
    "Momentum": OpSpec(op_momentum, static=(0, 1), attrs=("alpha", "beta", "mode", "norm_coefficient"), min_inputs=5),
    "Adam": OpSpec(op_adam, static=(0, 1), attrs=("alpha", "beta", "epsilon", "norm_coefficient", "norm_coefficient_post"),
                   min_inputs=6),
}}
DOMAIN_VERSIONS: dict[str, dict[str, tuple[int, ...]]] = {
    PREVIEW: {"FlexAttention": (1,)},
    ML: {"ArrayFeatureExtractor": (1,), "Binarizer": (1,), "TreeEnsemble": (5,)},
    TRAINING: {"Adagrad": (1,), "Momentum": (1,), "Adam": (1,)},
}
for _domain, _ops in DOMAIN_OPS.items():
    for _name, _spec in _ops.items():
        _spec.versions = frozenset(DOMAIN_VERSIONS[_domain][_name])

__all__ = ["DOMAIN_OPS", "DOMAIN_VERSIONS", "FOLDS", "OPS", "SUPPORTED_NP", "VERSIONS", "OpSpec"]
