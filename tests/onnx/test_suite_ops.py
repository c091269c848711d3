"""The single-tensor ops added for the node suite's last families, beyond its few cases: BitCast,
TfIdfVectorizer, DeformConv, RoiAlign, MelWeightMatrix, 3-D Conv / ConvTranspose and LinearAttention
in float16 against onnxruntime; FlexAttention (which onnxruntime lacks) against onnx's reference
evaluator; ImageDecoder against the pixels that were encoded."""

from __future__ import annotations

import io

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import tinydist.onnx as tdo
from tests.onnx.conftest import make_model

N = helper.make_node
F32 = np.float32


def f(rng, *shape, scale=2.0):
    return rng.uniform(-scale, scale, shape).astype(F32)


@pytest.mark.parametrize("src,to", [(np.float32, TensorProto.INT32), (np.int32, TensorProto.FLOAT),
                                    (np.float64, TensorProto.INT64), (np.int64, TensorProto.DOUBLE),
                                    (np.uint16, TensorProto.INT16), (np.int8, TensorProto.UINT8),
                                    (np.float16, TensorProto.INT16)])
def test_bitcast(check, rng, src, to):
    if np.dtype(src).kind == "f":
        x = (rng.standard_normal((3, 5)) * 100).astype(src)
        x[0, :3] = [np.inf, -np.inf, -0.0]
    else:
        info = np.iinfo(src)
        x = rng.integers(info.min, info.max, (3, 5), endpoint=True).astype(src)
        x[0, :2] = [info.min, info.max]
    # through an op first, so the bitcast is fused into a kernel, not applied to the fed buffer
    op = "Neg" if np.dtype(src).kind in "fi" and np.dtype(src).kind != "u" else "Identity"
    check([N(op, ["x"], ["n"]), N("BitCast", ["n"], ["y"], to=to)], {"x": x}, opset=26)


def test_bitcast_of_another_size_is_refused():
    node = N("BitCast", ["x"], ["y"], to=TensorProto.INT64)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.INT64, [3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 26)])
    with pytest.raises(tdo.UnsupportedModelError, match=r"float32 \(32 bits\) to int64 \(64 bits\)"):
        tdo.load(model)


@pytest.mark.parametrize("mode,weights", [("TF", False), ("IDF", False), ("IDF", True), ("TFIDF", True), ("TFIDF", False)])
@pytest.mark.parametrize("grams,skip", [((1, 3), 2), ((2, 2), 0), ((1, 1), 3), ((2, 3), 4)])
def test_tfidf_vectorizer(check, rng, mode, weights, grams, skip):
    pool = [3, 5, 1,  3, 5, 5, 1, 2, 3,  5, 1, 2, 3, 3, 5, 1, 2, 3]   # 3 unigrams, 3 bigrams, 3 trigrams
    attrs = dict(mode=mode, min_gram_length=grams[0], max_gram_length=grams[1], max_skip_count=skip,
                 ngram_counts=[0, 3, 9], ngram_indexes=[8, 0, 1, 2, 3, 4, 5, 6, 7], pool_int64s=pool)
    if weights:
        attrs["weights"] = rng.uniform(0.5, 2.0, 9).astype(F32).tolist()
    x = rng.integers(0, 6, (4, 12)).astype(np.int32)
    check([N("TfIdfVectorizer", ["x"], ["y"], **attrs)], {"x": x}, opset=9)
    check([N("TfIdfVectorizer", ["x"], ["y"], **attrs)], {"x": x[0].astype(np.int64)}, opset=9)


@pytest.mark.parametrize("attrs,mask,bias", [
    ({}, False, False),
    ({"strides": [2, 1], "pads": [1, 0, 1, 2], "dilations": [1, 2]}, True, True),
    ({"group": 2, "offset_group": 2, "pads": [1, 1, 1, 1]}, True, False),
])
def test_deform_conv(check, rng, attrs, mask, bias):
    """Offsets of up to ±3 pixels: many taps land between pixels and some past the border (zeros)."""
    group, og = attrs.get("group", 1), attrs.get("offset_group", 1)
    x, w = f(rng, 2, 4, 7, 6), f(rng, 6, 4 // group, 3, 2)
    sh, sw = attrs.get("strides", [1, 1])
    dh, dw = attrs.get("dilations", [1, 1])
    p = attrs.get("pads", [0, 0, 0, 0])
    oh, ow = (7 + p[0] + p[2] - 2 * dh - 1) // sh + 1, (6 + p[1] + p[3] - dw - 1) // sw + 1
    feeds = {"x": x, "offset": f(rng, 2, og * 6 * 2, oh, ow, scale=3.0)}
    inputs = ["x", "W", "offset", "B" if bias else "", "mask" if mask else ""]
    if mask:
        feeds["mask"] = rng.uniform(0, 1, (2, og * 6, oh, ow)).astype(F32)
    inits = {"W": w, **({"B": f(rng, 6)} if bias else {})}
    check([N("DeformConv", inputs, ["y"], kernel_shape=[3, 2], **attrs)], feeds, inits=inits, opset=19, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("ctm", ["half_pixel", "output_half_pixel"])
@pytest.mark.parametrize("ratio", [2, 0])
def test_roi_align(check, rng, mode, ctm, ratio):
    """RoiAlign 16 (onnxruntime has no 22): boxes over two images, some past the border; with
    sampling_ratio 0 each box's grid follows its size, so the boxes are an initializer."""
    x = f(rng, 2, 3, 12, 10)
    rois = np.array([[0.5, 1.0, 6.2, 7.9], [2.0, 2.0, 3.0, 3.5], [-2.0, 4.0, 9.5, 13.0], [1.0, 0.0, 8.0, 11.0]], F32)
    batch = np.array([0, 1, 1, 0], np.int64)
    attrs = dict(mode=mode, coordinate_transformation_mode=ctm, output_height=3, output_width=4, sampling_ratio=ratio,
                 spatial_scale=0.9)
    if ratio:
        check([N("RoiAlign", ["x", "rois", "batch"], ["y"], **attrs)], {"x": x, "rois": rois, "batch": batch}, opset=16,
              rtol=1e-4, atol=1e-5)
    else:
        check([N("RoiAlign", ["x", "rois", "batch"], ["y"], **attrs)], {"x": x, "batch": batch}, inits={"rois": rois},
              opset=16, rtol=1e-4, atol=1e-5)


def test_roi_align_sampling_ratio_0_needs_constant_boxes(rng):
    model = make_model([N("RoiAlign", ["x", "rois", "batch"], ["y"], output_height=2, output_width=2)],
                       {"x": f(rng, 1, 1, 6, 6), "rois": f(rng, 2, 4), "batch": np.zeros(2, np.int64)}, ["y"], opset=16)
    with pytest.raises(tdo.UnsupportedModelError, match="the rois must be constant"):
        tdo.load(model)


@pytest.mark.parametrize("bins,length,rate,low,high", [(8, 64, 8000, 0.0, 4000.0), (13, 100, 16000, 60.0, 7600.0)])
def test_mel_weight_matrix(check, bins, length, rate, low, high):
    feeds = {"bins": np.array(bins, np.int64), "length": np.array(length, np.int64), "rate": np.array(rate, np.int64),
             "low": np.array(low, F32), "high": np.array(high, F32)}
    check([N("MelWeightMatrix", list(feeds), ["y"])], feeds, outputs=[("y", TensorProto.FLOAT, [length // 2 + 1, bins])],
          opset=17)


@pytest.mark.parametrize("attrs", [{}, {"strides": [2, 1, 2], "pads": [1, 0, 1, 0, 2, 1]},
                                   {"dilations": [2, 1, 1], "group": 2}])
def test_conv_3d(check, rng, attrs):
    groups = attrs.get("group", 1)
    check([N("Conv", ["x", "W", "B"], ["y"], **attrs)], {"x": f(rng, 2, 4, 6, 5, 7)},
          inits={"W": f(rng, 6, 4 // groups, 3, 2, 3), "B": f(rng, 6)}, opset=11, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("attrs", [{}, {"strides": [2, 1, 2], "pads": [1, 0, 1, 0, 1, 1], "output_padding": [1, 0, 1]},
                                   {"dilations": [1, 2, 1], "group": 2}])
def test_conv_transpose_3d(check, rng, attrs):
    groups = attrs.get("group", 1)
    check([N("ConvTranspose", ["x", "W", "B"], ["y"], **attrs)], {"x": f(rng, 2, 4, 3, 4, 5)},
          inits={"W": f(rng, 4, 6 // groups, 3, 2, 3), "B": f(rng, 6)}, opset=11, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rule", ["linear", "gated_delta"])
def test_linear_attention_float16(check, rng, rule):
    """float16 activations, the state accumulated in float32 (onnxruntime and onnx's reference)."""
    b, t, hq, hk, dk, dv = 2, 6, 4, 2, 8, 8
    feeds = {"q": f(rng, b, t, hq * dk, scale=0.5).astype(np.float16), "k": f(rng, b, t, hk * dk, scale=0.5).astype(np.float16),
             "v": f(rng, b, t, hk * dv).astype(np.float16)}
    inputs = ["q", "k", "v", ""]
    if rule == "gated_delta":
        feeds["decay"] = (-rng.uniform(0.01, 0.5, (b, t, hk))).astype(np.float16)
        feeds["beta"] = rng.uniform(0.1, 0.9, (b, t, hk)).astype(np.float16)
        inputs += ["decay", "beta"]
    check([N("LinearAttention", inputs, ["y", "state"], q_num_heads=hq, kv_num_heads=hk, update_rule=rule)], feeds,
          outputs=["y", "state"], opset=27, rtol=2e-3, atol=2e-3)


def test_flex_attention_with_outer_scope_bias(rng):
    """GQA, a score_mod that reads a graph input from the outer scope (a per-key bias) and masks
    causally, a prob_mod, softmax in double — against numpy float64 (onnx's reference evaluator
    cannot bind outer-scope names inside FlexAttention's bodies)."""
    b, hq, hk, lq, s, d, scale = 2, 4, 2, 5, 7, 8, 0.3
    causal = np.where(np.arange(lq)[:, None] + 2 >= np.arange(s), 0.0, -np.inf)
    score_mod = helper.make_graph(
        [N("Add", ["scores", "key_bias"], ["biased"]), N("Add", ["biased", "causal"], ["scores_out"])], "score_mod",
        [helper.make_tensor_value_info("scores", TensorProto.DOUBLE, [b, hq, lq, s])],
        [helper.make_tensor_value_info("scores_out", TensorProto.DOUBLE, [b, hq, lq, s])],
        [numpy_helper.from_array(causal, "causal")])
    prob_mod = helper.make_graph(
        [N("Mul", ["probs", "half"], ["probs_out"])], "prob_mod",
        [helper.make_tensor_value_info("probs", TensorProto.DOUBLE, [b, hq, lq, s])],
        [helper.make_tensor_value_info("probs_out", TensorProto.DOUBLE, [b, hq, lq, s])],
        [numpy_helper.from_array(np.array(0.5), "half")])
    node = helper.make_node("FlexAttention", ["Q", "K", "V"], ["Y"], domain="ai.onnx.preview", score_mod=score_mod,
                            prob_mod=prob_mod, softmax_precision=TensorProto.DOUBLE, scale=scale)
    graph = helper.make_graph([node], "flex", [
        helper.make_tensor_value_info("Q", TensorProto.FLOAT, [b, hq, lq, d]),
        helper.make_tensor_value_info("K", TensorProto.FLOAT, [b, hk, s, d]),
        helper.make_tensor_value_info("V", TensorProto.FLOAT, [b, hk, s, d]),
        helper.make_tensor_value_info("key_bias", TensorProto.DOUBLE, [1, 1, 1, s])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [b, hq, lq, d])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 26), helper.make_opsetid("ai.onnx.preview", 1)])
    loaded = tdo.load(model)
    for _ in range(2):  # a second call replays the capture
        feeds = {"Q": f(rng, b, hq, lq, d), "K": f(rng, b, hk, s, d), "V": f(rng, b, hk, s, d),
                 "key_bias": rng.uniform(-1, 1, (1, 1, 1, s))}
        q, k, v = (feeds[n].astype(np.float64) for n in "QKV")
        k, v = np.repeat(k, hq // hk, axis=1), np.repeat(v, hq // hk, axis=1)
        scores = q @ k.swapaxes(-1, -2) * scale + feeds["key_bias"] + causal
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        want = (probs / probs.sum(-1, keepdims=True) * 0.5) @ v
        np.testing.assert_allclose(loaded(feeds)["Y"], want, rtol=1e-5, atol=1e-6)


def _encoder_model(pixel_format: str, length: int | None = None) -> onnx.ModelProto:
    graph = helper.make_graph([N("ImageDecoder", ["data"], ["pixels"], pixel_format=pixel_format)], "decode",
                              [helper.make_tensor_value_info("data", TensorProto.UINT8, [length or "n"])],
                              [helper.make_tensor_value_info("pixels", TensorProto.UINT8, [None, None, None])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


@pytest.mark.parametrize("pixel_format", ["RGB", "BGR", "Grayscale"])
def test_image_decoder_gives_back_the_encoded_pixels(rng, pixel_format):
    """Lossless PNG / BMP / TIFF of random pixels, two sizes through one model (the bytes are read
    per call): RGB gives the pixels, BGR them reversed, Grayscale ITU-R 601-2 luma (Pillow's L)."""
    image = pytest.importorskip("PIL.Image")
    model = tdo.load(_encoder_model(pixel_format))
    for shape, fmt in (((9, 13, 3), "PNG"), ((20, 7, 3), "BMP"), ((9, 13, 3), "TIFF")):
        pixels = rng.integers(0, 256, shape, dtype=np.uint8)
        buffer = io.BytesIO()
        image.fromarray(pixels).save(buffer, format=fmt)
        got = model({"data": np.frombuffer(buffer.getvalue(), np.uint8)})["pixels"]
        if pixel_format == "Grayscale":
            r, g, b = (pixels[..., i].astype(np.int64) for i in range(3))
            want = ((r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16).astype(np.uint8)[:, :, None]
        else:
            want = pixels[:, :, ::-1] if pixel_format == "BGR" else pixels
        np.testing.assert_array_equal(got, want)


def test_image_decoder_refuses_bytes_that_are_no_image():
    pytest.importorskip("PIL.Image")
    model = tdo.load(_encoder_model("RGB", 100))
    with pytest.raises(tdo.UnsupportedModelError, match="the 100 bytes are not an image Pillow can decode"):
        model({"data": np.arange(100, dtype=np.uint8)})
