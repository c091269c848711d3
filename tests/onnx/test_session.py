"""tinydist.onnx.InferenceSession answers as onnxruntime's does: the same calls on both sessions
of one model give the same descriptions and the same outputs."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import tinydist.onnx as tdo


def _model() -> onnx.ModelProto:
    """Two inputs reached out of declaration order, a symbolic batch dimension, three outputs
    (one of them int64), metadata the session reports."""
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "w")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["xw"]),
        helper.make_node("Add", ["xw", "bias"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
        helper.make_node("ArgMax", ["logits"], ["label"], axis=-1, keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "scorer",
        [helper.make_tensor_value_info("bias", TensorProto.FLOAT, [4]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", 4]),
         helper.make_tensor_value_info("label", TensorProto.INT64, ["batch"]),
         helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4])],
        [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="tests")
    model.ir_version = 8
    model.model_version = 3
    helper.set_model_props(model, {"task": "scoring"})
    onnx.checker.check_model(model)
    return model


@pytest.fixture(scope="module")
def sessions():
    data = _model().SerializeToString()
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"]), tdo.InferenceSession(data)


def _describe(args):
    return [(a.name, list(a.shape), a.type) for a in args]


def test_descriptions_match_onnxruntime(sessions) -> None:
    reference, ours = sessions
    assert _describe(ours.get_inputs()) == _describe(reference.get_inputs())
    assert _describe(ours.get_outputs()) == _describe(reference.get_outputs())
    assert ours.get_providers() == ["CPUExecutionProvider"]
    meta, expected = ours.get_modelmeta(), reference.get_modelmeta()
    assert (meta.producer_name, meta.graph_name, meta.version, meta.custom_metadata_map) == (
        expected.producer_name, expected.graph_name, expected.version, expected.custom_metadata_map)


@pytest.mark.parametrize("names", [None, [], ["label"], ["logits", "probs"], ["label", "label"]])
def test_run_returns_the_outputs_named_in_order(sessions, names) -> None:
    reference, ours = sessions
    rng = np.random.default_rng(0)
    for batch in (1, 5, 5, 2):  # new shapes and repeats of one (captured, then replayed)
        feed = {"x": rng.standard_normal((batch, 8)).astype(np.float32), "bias": rng.standard_normal(4).astype(np.float32)}
        got, expected = ours.run(names, feed), reference.run(names, feed)
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            assert g.dtype == e.dtype and g.shape == e.shape
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


def test_a_path_loads_as_bytes_do(tmp_path, sessions) -> None:
    path = tmp_path / "scorer.onnx"
    path.write_bytes(_model().SerializeToString())
    session = tdo.InferenceSession(str(path), providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    feed = {"x": np.ones((2, 8), np.float32), "bias": np.zeros(4, np.float32)}
    np.testing.assert_allclose(session.run(["logits"], feed)[0], sessions[0].run(["logits"], feed)[0], rtol=1e-5)


def test_a_tinydist_device_is_a_provider() -> None:
    session = tdo.InferenceSession(_model().SerializeToString(), providers=["CPU:1"])
    assert session.get_providers() == ["CPUExecutionProvider"] and session.model.device == "CPU:1"
    out = session.run(None, {"x": np.ones((1, 8), np.float32), "bias": np.zeros(4, np.float32)})
    assert [o.shape for o in out] == [(1, 4), (1,), (1, 4)]


def test_errors_name_what_was_wrong(sessions) -> None:
    _, ours = sessions
    feed = {"x": np.ones((1, 8), np.float32), "bias": np.zeros(4, np.float32)}
    with pytest.raises(ValueError, match=r"'nope'.*outputs: \['label', 'logits', 'probs'\]"):
        ours.run(["nope"], feed)
    with pytest.raises(ValueError, match="missing input"):
        ours.run(None, {"x": feed["x"]})
    with pytest.raises(ValueError, match="CUDAExecutionProvider.*CPUExecutionProvider"):
        tdo.InferenceSession(_model().SerializeToString(), providers=["CUDAExecutionProvider"])
    with pytest.raises(tdo.ModelLoadError, match="not an ONNX model"):
        tdo.InferenceSession(b"\x08\x07garbage that is not protobuf \xff\xff")
