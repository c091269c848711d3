"""The ai.onnx.ml ops (ArrayFeatureExtractor, Binarizer, TreeEnsemble 5) against onnxruntime, in
models that import that domain only (no default-domain opset, as the onnx node suite's are) and
beside a default-domain import."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import tinydist.onnx as tdo

F32 = np.float32
N = helper.make_node


def _model(node, inputs, outputs, default_opset=None):
    imports = [helper.make_opsetid("ai.onnx.ml", 5 if node.op_type == "TreeEnsemble" else 1)]
    if default_opset:
        imports.append(helper.make_opsetid("", default_opset))
    model = helper.make_model(helper.make_graph([node], "g", inputs, outputs), opset_imports=imports)
    model.ir_version = 8
    return model.SerializeToString()


def _agree(model, feed, rtol=1e-6):
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feed)
    got = list(tdo.load(model)(feed).values())
    for have, ref in zip(got, want):
        assert have.dtype == ref.dtype and have.shape == ref.shape, (have.dtype, have.shape, ref.dtype, ref.shape)
        np.testing.assert_allclose(have, ref, rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("shape,indices", [((3, 4), [2, 0, 2]), ((5,), [4, 1]), ((2, 3, 4), [[3, 1]])])
def test_array_feature_extractor(rng, shape, indices):
    ind = np.array(indices, np.int64)
    x = rng.normal(size=shape).astype(F32)
    node = N("ArrayFeatureExtractor", ["x", "i"], ["y"], domain="ai.onnx.ml")
    model = _model(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape)),
                          helper.make_tensor_value_info("i", TensorProto.INT64, list(ind.shape))],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    _agree(model, {"x": x, "i": ind})
    # many indices: a run-time tensor (no value input), selected by a one-hot mask
    many = rng.integers(0, shape[-1], size=80).astype(np.int64)
    model = _model(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape)),
                          helper.make_tensor_value_info("i", TensorProto.INT64, [80])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    _agree(model, {"x": x, "i": many})


def test_binarizer(rng):
    node = N("Binarizer", ["x"], ["y"], domain="ai.onnx.ml", threshold=0.25)
    model = _model(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 5])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 5])])
    x = rng.normal(size=(4, 5)).astype(F32)
    x[0, 0] = 0.25  # the threshold itself: not above it (onnxruntime refuses NaN, so none here)
    _agree(model, {"x": x})
    # float64, which onnxruntime's kernel lacks: numpy's x > threshold
    model = _model(node, [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [4, 5])],
                   [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [4, 5])])
    x64 = x.astype(np.float64)
    got = tdo.load(model)({"x": x64})["y"]
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, (x64 > 0.25).astype(np.float64))


def _ensemble(aggregate, post, n_targets=2, **extra):
    """Two trees over 3 features: tree 0 tests x0 <= 0.1 then (x2 in {1, 4} | NaN) ; tree 1 is
    x1 > -0.3 (NaN: true) then x0 != 0.5; leaves spread over the targets."""
    modes = [0, 6, 3, 5]
    attrs = dict(
        n_targets=n_targets, aggregate_function=aggregate, post_transform=post, tree_roots=[0, 2],
        nodes_featureids=[0, 2, 1, 0], nodes_modes=helper.make_tensor("m", TensorProto.UINT8, [4], modes),
        nodes_splits=helper.make_tensor("s", TensorProto.FLOAT, [4], [0.1, 0.0, -0.3, 0.5]),
        nodes_truenodeids=[1, 0, 3, 3], nodes_trueleafs=[0, 1, 0, 1], nodes_falsenodeids=[0, 1, 2, 4], nodes_falseleafs=[1, 1, 1, 1],
        nodes_missing_value_tracks_true=[0, 1, 1, 0],
        membership_values=helper.make_tensor("mv", TensorProto.FLOAT, [3], [1.0, 4.0, np.nan]),
        leaf_targetids=[0, 1, 1, 0, 1], leaf_weights=helper.make_tensor("w", TensorProto.FLOAT, [5], [0.5, -1.25, 2.0, 3.5, -0.75]))
    attrs.update(extra)
    return N("TreeEnsemble", ["X"], ["Y"], domain="ai.onnx.ml", **attrs)


def _rows(rng, n=64):
    x = rng.normal(size=(n, 3)).astype(F32)
    x[:, 2] = rng.integers(0, 6, size=n)
    x[rng.random(size=(n, 3)) < 0.1] = np.nan
    x[:8, 0] = 0.5
    return x


def _ensemble_model(aggregate, post, rows=None):
    return _model(_ensemble(aggregate, post), [helper.make_tensor_value_info("X", TensorProto.FLOAT, [rows, 3])],
                  [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [rows, 2])])


@pytest.mark.parametrize("aggregate", [0, 1, 2, 3])  # AVERAGE SUM MIN MAX
def test_tree_ensemble_matches_onnxruntime(rng, aggregate):
    model = _ensemble_model(aggregate, 0)
    _agree(model, {"X": _rows(rng)}, rtol=1e-5)
    _agree(model, {"X": _rows(rng, 5)}, rtol=1e-5)


@pytest.mark.parametrize("post", [1, 2])
def test_tree_ensemble_post_transform_as_the_spec_numbers_it(rng, post):
    """The schema numbers post_transform NONE 0, SOFTMAX 1, LOGISTIC 2; onnxruntime 1.32 reads 1 as
    LOGISTIC and 2 as SOFTMAX (its own enum's order), so the reference here is onnxruntime's raw
    scores (post_transform 0) transformed by numpy as the spec names it."""
    x = _rows(rng)
    raw = ort.InferenceSession(_ensemble_model(1, 0), providers=["CPUExecutionProvider"]).run(None, {"X": x})[0].astype(np.float64)
    want = np.exp(raw) / np.exp(raw).sum(-1, keepdims=True) if post == 1 else 1 / (1 + np.exp(-raw))
    got = tdo.load(_ensemble_model(1, post))({"X": x})["Y"]
    assert got.dtype == F32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_tree_ensemble_of_single_leaf_trees_beside_a_default_import(rng):
    node = N("TreeEnsemble", ["X"], ["Y"], domain="ai.onnx.ml", n_targets=1, tree_roots=[0], nodes_featureids=[0],
             nodes_modes=helper.make_tensor("m", TensorProto.UINT8, [1], [0]), nodes_splits=helper.make_tensor("s", TensorProto.FLOAT, [1], [0.0]),
             nodes_truenodeids=[0], nodes_trueleafs=[1], nodes_falsenodeids=[0], nodes_falseleafs=[1], leaf_targetids=[0],
             leaf_weights=helper.make_tensor("w", TensorProto.FLOAT, [1], [1.5]))
    model = _model(node, [helper.make_tensor_value_info("X", TensorProto.FLOAT, [4, 2])],
                   [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [4, 1])], default_opset=21)
    _agree(model, {"X": rng.normal(size=(4, 2)).astype(F32)})


def test_tree_ensemble_refusals():
    model = _model(_ensemble(1, 4), [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 3])],
                   [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 2])])
    with pytest.raises(tdo.UnsupportedModelError, match=r"post_transform 4 is not supported \(0 NONE, 1 SOFTMAX, 2 LOGISTIC\)"):
        tdo.load(model)
    bad = _model(_ensemble(1, 0, nodes_featureids=[0, 7, 1, 0]), [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 3])],
                 [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 2])])
    with pytest.raises(tdo.UnsupportedModelError, match=r"nodes_featureids \[0, 7, 1, 0\] are out of range for 3 features"):
        tdo.load(bad)
