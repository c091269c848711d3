"""fp16 and int8-quantized (QDQ) models against onnxruntime, made from the real-architecture set
with tools nobody here wrote, and QuantizeLinear / DequantizeLinear's semantics op by op.

The models: onnxruntime's own static quantizer (`quantize_static(..., QuantFormat.QDQ)`, int8
activations and per-channel int8 weights, calibrated on 4 seeded batches) and onnxruntime's fp16
converter (`onnxruntime.transformers.float16.convert_float_to_float16`, fp16 inputs and outputs:
the whole graph runs in fp16), applied to files of tests/onnx/architectures/models/. They are made
once per onnxruntime version into the cache dir (`$TINYDIST_CACHE_DIR/onnx-quantized/`, < 1 s
each), then compared on 4 calls at batch 1 and 8, tolerance relative to the output's scale:

- QDQ vs onnxruntime running the graph op by op (`ORT_DISABLE_ALL`: the ONNX definition of
  QuantizeLinear / DequantizeLinear between float ops): 2e-5 of the scale (seen: 0 for the CNNs,
  whose outputs lie on the last DequantizeLinear's grid; at most 2.1e-7 for BERT).
- QDQ with 7-bit weights (`reduce_range=True`) vs onnxruntime's default session, which fuses
  DQ → Conv/MatMul → Q into integer kernels (QLinearConv, MatMulInteger) that requantize with their
  own rounding: 0.05 of the scale (seen: 0 for the CNNs, at most 9.0e-3 for BERT at opset 13,
  batch 8: single quanta flipped inside the encoder). Full-range weights would test onnxruntime's
  CPU instead: without VNNI its u8s8 kernels saturate int16 pair sums (vpmaddubsw), 6-8 % off.
- fp16: 4e-3 of the scale. Both sides round to fp16 after every op but sum in different orders
  (and tinydist's fp16 matmul accumulates in fp32), so they differ by a few fp16 ulps of the
  output (2^-10 ≈ 9.8e-4 of it); seen at most 9.9e-4 (ViT), a 4x margin. A wrong op, a lost
  scale or a float32 detour that changes the dtype is off by O(1) or fails the dtype check.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

import tinydist.onnx as tdo
from tests.onnx.test_architectures import MANIFEST, MODELS, feeds

CALLS = 4
QDQ_TOL, QDQ_FUSED_TOL, FP16_TOL = 2e-5, 0.05, 4e-3
QDQ_MODELS = ["resnet_default.onnx", "mobilenet_v3_default.onnx", "bert_default.onnx", "bert_opset13.onnx"]
FP16_MODELS = ["resnet_default.onnx", "resnet_opset13.onnx", "vit_default.onnx", "vit_opset13.onnx"]


def _cache_dir() -> Path:
    from tinydist.base.config import settings
    path = Path(settings.CACHE_DIR) / "onnx-quantized" / f"onnxruntime-{ort.__version__}"
    path.mkdir(parents=True, exist_ok=True)
    return path


class _Calibration(CalibrationDataReader):
    """onnxruntime's CalibrationDataReader protocol over 4 seeded batches of 2."""

    def __init__(self, entry: dict[str, Any]) -> None:
        self._feeds = iter([feeds(entry, 2, seed=90 + i) for i in range(4)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._feeds, None)


def _publish(made: Path, path: Path) -> Path:
    os.replace(made, path)  # atomic: a concurrent run sees the whole file or none
    return path


@functools.cache
def qdq_model(name: str, reduce_range: bool = False) -> Path:
    """onnxruntime's static QDQ quantization of `name`; `reduce_range` quantizes weights to 7 bits."""
    path = _cache_dir() / name.replace(".onnx", ".qdq7.onnx" if reduce_range else ".qdq.onnx")
    if not path.exists():
        reader = _Calibration(MANIFEST[name])
        made = path.with_suffix(f".{os.getpid()}.tmp")
        logging.getLogger().setLevel(logging.ERROR)  # the quantizer's advice to pre-process
        quantize_static(str(MODELS / name), str(made), reader, quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, per_channel=True,
                        reduce_range=reduce_range)
        _publish(made, path)
    return path


@functools.cache
def fp16_model(name: str) -> Path:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    path = _cache_dir() / name.replace(".onnx", ".fp16.onnx")
    if not path.exists():
        made = path.with_suffix(f".{os.getpid()}.tmp")
        onnx.save(convert_float_to_float16(onnx.load(str(MODELS / name)), keep_io_types=False), str(made))
        _publish(made, path)
    return path


def _session(path: Path, level: ort.GraphOptimizationLevel) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.graph_optimization_level = level
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _compare(path: Path, entry: dict[str, Any], session: ort.InferenceSession, batch: int, tol: float,
             fp16: bool = False) -> float:
    """The worst error over CALLS calls, relative to the output's scale; asserts each within `tol`."""
    model = tdo.load(str(path))
    worst = 0.0
    for call in range(CALLS):
        feed = feeds(entry, batch, seed=1000 * batch + call)
        if fp16:
            feed = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in feed.items()}
        want = session.run(None, feed)
        got = model(feed)
        for (out_name, have), expected in zip(got.items(), want):
            where = f"{path.name} batch {batch} call {call} output {out_name!r}"
            assert have.dtype == expected.dtype and have.shape == expected.shape, (
                f"{where}: {have.dtype}{have.shape} vs onnxruntime {expected.dtype}{expected.shape}")
            scale = float(np.abs(expected.astype(np.float64)).max())
            assert np.ptp(expected.astype(np.float64)) > 1e-3 * scale, f"{where}: onnxruntime's output is constant"
            err = float(np.abs(have.astype(np.float64) - expected.astype(np.float64)).max()) / scale
            assert err <= tol, f"{where}: max error {err:.3g} of the scale, tolerance {tol}"
            worst = max(worst, err)
    return worst


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("name", QDQ_MODELS)
def test_qdq_model_equals_onnxruntime(name: str, batch: int) -> None:
    path = qdq_model(name)
    ops = {node.op_type for node in onnx.load(str(path)).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops, f"{path.name} is not quantized: {sorted(ops)}"
    _compare(path, MANIFEST[name], _session(path, ort.GraphOptimizationLevel.ORT_DISABLE_ALL), batch, QDQ_TOL)


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("name", QDQ_MODELS)
def test_qdq_model_equals_onnxruntimes_integer_kernels(name: str, batch: int) -> None:
    # 7-bit weights: on x86 without VNNI, onnxruntime's u8s8 kernels add pairs of products in int16
    # (vpmaddubsw), which saturates for full-range int8 weights; the fused session is then off by
    # 6-8 % of the scale (seen on AVX2 EPYC, onnxruntime 1.31 and 1.32). 7 bits cannot saturate.
    path = qdq_model(name, reduce_range=True)
    _compare(path, MANIFEST[name], _session(path, ort.GraphOptimizationLevel.ORT_ENABLE_ALL), batch, QDQ_FUSED_TOL)


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("name", FP16_MODELS)
def test_fp16_model_equals_onnxruntime(name: str, batch: int) -> None:
    path = fp16_model(name)
    proto = onnx.load(str(path))
    assert all(vi.type.tensor_type.elem_type == TensorProto.FLOAT16 for vi in list(proto.graph.input) + list(proto.graph.output))
    assert not any(init.data_type == TensorProto.FLOAT for init in proto.graph.initializer), "float32 weights left"
    _compare(path, MANIFEST[name], _session(path, ort.GraphOptimizationLevel.ORT_ENABLE_ALL), batch, FP16_TOL, fp16=True)


# ---- QuantizeLinear / DequantizeLinear, op by op -------------------------------------------------

def _q_model(op: str, x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, opset: int, **attrs: Any) -> Any:
    inputs = ["x", "scale"] + (["zero_point"] if zero_point is not None else [])
    inits = [numpy_helper.from_array(scale, "scale")]
    if zero_point is not None:
        inits.append(numpy_helper.from_array(zero_point, "zero_point"))
    out_type = (zero_point.dtype if zero_point is not None else np.dtype(np.uint8)) if op == "QuantizeLinear" else scale.dtype
    graph = helper.make_graph(
        [helper.make_node(op, inputs, ["y"], **attrs)], "q",
        [helper.make_tensor_value_info("x", helper.np_dtype_to_tensor_dtype(x.dtype), list(x.shape))],
        [helper.make_tensor_value_info("y", helper.np_dtype_to_tensor_dtype(np.dtype(out_type)), list(x.shape))], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10 if opset >= 21 else 8
    onnx.checker.check_model(model)
    return model


def _equal_to_onnxruntime(model: Any, x: np.ndarray) -> np.ndarray:
    want = _session_of(model).run(None, {"x": x})[0]
    got = tdo.load(model)({"x": x})["y"]
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    return got


def _session_of(model: Any) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("zp_dtype", [np.uint8, np.int8, np.uint16, np.int16])
def test_quantize_rounds_half_to_even_and_saturates(zp_dtype: Any) -> None:
    """(Opset 21: 16-bit types.) Ties go to the even integer (2.5 -> 2, 3.5 -> 4, -2.5 -> -2), and values past the type's
    range clamp to it instead of wrapping (a cast would give 300 -> 44 in uint8)."""
    info = np.iinfo(zp_dtype)
    x = np.array([0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, 1e9, -1e9, info.max + 0.5, info.min - 0.5, 0.0], np.float32)
    zero_point = np.array(0, zp_dtype)
    got = _equal_to_onnxruntime(_q_model("QuantizeLinear", x, np.array(1.0, np.float32), zero_point, 21), x)
    assert got[:7].tolist() == [max(v, info.min) for v in (0, 2, 2, 4, 0, -2, -2)]
    assert got[7] == info.max and got[8] == info.min and got[9] == info.max and got[10] == info.min


def test_quantize_default_zero_point_is_uint8() -> None:
    x = np.linspace(-3, 300, 24, dtype=np.float32).reshape(2, 3, 4)
    got = _equal_to_onnxruntime(_q_model("QuantizeLinear", x, np.array(0.5, np.float32), None, 13), x)
    assert got.dtype == np.uint8 and got.min() == 0 and got.max() == 255


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_quantize_and_dequantize_per_axis(axis: int) -> None:
    """Per-axis (per-channel) scale and zero point: one per index of `axis`, negative axes counted
    from the end."""
    rng = np.random.default_rng(3)
    x = rng.normal(0, 4, (3, 4, 5)).astype(np.float32)
    n = x.shape[axis]
    scale = rng.uniform(0.01, 0.1, n).astype(np.float32)
    zero_point = rng.integers(-20, 20, n).astype(np.int8)
    q = _equal_to_onnxruntime(_q_model("QuantizeLinear", x, scale, zero_point, 13, axis=axis), x)
    y = _equal_to_onnxruntime(_q_model("DequantizeLinear", q, scale, zero_point, 13, axis=axis), q)
    shape = [1] * 3
    shape[axis] = n
    np.testing.assert_array_equal(y, (q.astype(np.float32) - zero_point.reshape(shape)) * scale.reshape(shape))


def test_quantize_blocked() -> None:
    """Blocked quantization (opset 21): the scale's `axis` dimension counts blocks of block_size,
    the last block short when block_size does not divide x's size there."""
    rng = np.random.default_rng(4)
    x = rng.normal(0, 4, (4, 7)).astype(np.float32)
    scale = rng.uniform(0.01, 0.1, (4, 3)).astype(np.float32)
    zero_point = rng.integers(-5, 5, (4, 3)).astype(np.int8)
    model = _q_model("QuantizeLinear", x, scale, zero_point, 21, axis=1, block_size=3)
    want = np.clip(np.rint(x / np.repeat(scale, 3, 1)[:, :7]) + np.repeat(zero_point, 3, 1)[:, :7], -128, 127)
    np.testing.assert_array_equal(tdo.load(model)({"x": x})["y"], want.astype(np.int8))


def test_dequantize_float16_scale_gives_float16() -> None:
    q = np.arange(-128, 128, dtype=np.int8).reshape(16, 16)
    _equal_to_onnxruntime(_q_model("DequantizeLinear", q, np.array(0.0625, np.float16), np.array(-3, np.int8), 19), q)


def test_quantize_refuses_a_scale_that_fits_no_axis() -> None:
    x = np.zeros((3, 4), np.float32)
    model = _q_model("QuantizeLinear", x, np.ones(5, np.float32), None, 13, axis=1)
    with pytest.raises(tdo.UnsupportedModelError, match=r"y_scale of shape \(5,\) is neither a scalar nor a vector of x's axis 1"):
        tdo.load(model)({"x": x})
