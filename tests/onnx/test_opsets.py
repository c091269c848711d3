"""Opsets as onnxruntime treats them: every default-domain opset from 7 to the installed onnx's
newest loads, each node dispatched on its schema's since_version; a version without an
implementation is refused at load, naming node, op, domain, since_version and the versions that are.
Below opset 7 (onnxruntime's guaranteed range) a model loads when each of its op versions is one
implemented (Not-1, Relu-6), and is refused by that rule otherwise.

The per-opset model spells each op the way its version at that opset does (attributes that became
inputs: Clip, Pad, Slice, Split, Squeeze/Unsqueeze, Reduce*; Upsample before Resize; Softmax and
Hardmax flattening to 2-D before 13), and must equal onnxruntime at that opset."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import tinydist.onnx as tdo
from tinydist.onnx.ops import OPS, VERSIONS

N = helper.make_node
F32 = np.float32
LATEST = onnx.defs.onnx_opset_version()


def _versioned_graph(opset: int) -> tuple[list, dict[str, np.ndarray], dict[str, list[int]]]:
    """Nodes (each in its opset-`opset` form), initializers and outputs over x: (2, 3, 4, 4)."""
    nodes, inits = [], {"scale": np.array([1.5, 0.5, 2.0], F32), "bias": np.array([0.1, -0.2, 0.3], F32),
                        "mean": np.array([0.05, 0.0, -0.1], F32), "var": np.array([1.0, 2.0, 0.5], F32)}
    nodes.append(N("BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["bn"], epsilon=1e-3))
    if opset < 11:
        nodes.append(N("Clip", ["bn"], ["clip"], min=-1.0, max=1.5))
    else:
        inits.update(lo=np.array(-1.0, F32), hi=np.array(1.5, F32))
        nodes.append(N("Clip", ["bn", "lo", "hi"], ["clip"]))
    if opset < 11:
        nodes.append(N("Pad", ["clip"], ["pad"], pads=[0, 0, 1, 0, 0, 0, 0, 2], value=0.25))
    else:
        inits.update(pads=np.array([0, 0, 1, 0, 0, 0, 0, 2], np.int64), padv=np.array(0.25, F32))
        nodes.append(N("Pad", ["clip", "pads", "padv"], ["pad"]))  # (2, 3, 5, 6)
    if opset < 10:
        nodes.append(N("Slice", ["pad"], ["sl"], starts=[1, 0], ends=[5, 5], axes=[2, 3]))
    else:
        inits.update(st=np.array([1, 0], np.int64), en=np.array([5, 5], np.int64), ax=np.array([2, 3], np.int64))
        nodes.append(N("Slice", ["pad", "st", "en", "ax"], ["sl"]))  # (2, 3, 4, 5)
    if opset < 13:
        nodes.append(N("Split", ["sl"], ["s1", "s2"], axis=3, split=[2, 3]))
        nodes.append(N("ReduceSum", ["s2"], ["rs"], axes=[3], keepdims=1))
        nodes.append(N("Unsqueeze", ["rs"], ["un"], axes=[0]))
        nodes.append(N("Squeeze", ["un"], ["sq"], axes=[0]))
    else:
        inits.update(split=np.array([2, 3], np.int64), rax=np.array([3], np.int64), uax=np.array([0], np.int64))
        nodes.append(N("Split", ["sl", "split"], ["s1", "s2"], axis=3))
        nodes.append(N("ReduceSum", ["s2", "rax"], ["rs"], keepdims=1))
        nodes.append(N("Unsqueeze", ["rs", "uax"], ["un"]))
        nodes.append(N("Squeeze", ["un", "uax"], ["sq"]))
    if opset < 18:
        nodes.append(N("ReduceMean", ["s1"], ["rm"], axes=[3], keepdims=1))
    else:
        nodes.append(N("ReduceMean", ["s1", "rax"], ["rm"], keepdims=1))
    nodes.append(N("Add", ["sq", "rm"], ["sum"]))  # (2, 3, 4, 1)
    nodes.append(N("Dropout", ["sum"], ["drop"]))
    if opset < 9:
        nodes.append(N("Upsample", ["drop"], ["up"], scales=[1.0, 1.0, 1.0, 3.0]))
    else:
        inits["scales"] = np.array([1.0, 1.0, 1.0, 3.0], F32)
        if opset == 9:
            nodes.append(N("Upsample", ["drop", "scales"], ["up"]))
        elif opset == 10:
            nodes.append(N("Resize", ["drop", "scales"], ["up"]))
        else:  # roi: a required input in 11 and 12
            inits["roi"] = np.zeros(0, F32)
            nodes.append(N("Resize", ["drop", "roi" if opset < 13 else "", "scales"], ["up"], mode="nearest"))  # (2, 3, 4, 3)
    nodes.append(N("Softmax", ["up"], ["sm"], axis=1))   # before 13: over the flattened (3, 4, 3)
    nodes.append(N("Hardmax", ["up"], ["hm"], axis=2))
    nodes.append(N("LogSoftmax", ["x"], ["lsm"], axis=-1))
    return nodes, inits, {"sm": [2, 3, 4, 3], "hm": [2, 3, 4, 3], "lsm": [2, 3, 4, 4]}


def _model(opset: int) -> onnx.ModelProto:
    nodes, inits, outs = _versioned_graph(opset)
    graph = helper.make_graph(nodes, f"opset{opset}", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4, 4])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, shape) for o, shape in outs.items()],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10 if opset >= 21 else 7
    onnx.checker.check_model(model)
    return model


@pytest.mark.parametrize("opset", range(7, LATEST + 1))
def test_every_opset_loads_and_matches_onnxruntime(opset, reference, rng):
    model = _model(opset)
    x = rng.normal(0, 1.5, (2, 3, 4, 4)).astype(F32)
    loaded = tdo.load(model)
    assert loaded.opset == opset
    got = loaded({"x": x})
    for name, want in zip(got, reference(model, {"x": x})):
        np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6, err_msg=f"{name} at opset {opset}")


def test_versions_table_covers_every_op():
    assert set(VERSIONS) == set(OPS)
    for op, versions in VERSIONS.items():
        at_opsets = set()
        for opset in range(7, LATEST + 1):
            try:
                at_opsets.add(onnx.defs.get_schema(op, opset, "").since_version)
            except onnx.defs.SchemaError:
                pass
        # every listed version is one the schema has; and every version since opset 7 is listed
        # unless it is a deliberate refusal
        assert set(versions) <= at_opsets, (op, sorted(set(versions) - at_opsets))
        deliberate = {"Upsample": {10}, "Scatter": {11}}.get(op, set())  # deprecated versions: refused
        assert at_opsets - set(versions) <= deliberate, (op, sorted(at_opsets - set(versions)))


def test_unimplemented_version_names_node_op_domain_and_versions(monkeypatch):
    graph = helper.make_graph([N("Relu", ["x"], ["y"], name="act")], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])
    monkeypatch.setattr(OPS["Relu"], "versions", frozenset({6, 13}))
    with pytest.raises(tdo.UnsupportedModelError,
                       match=r"node 'act' \(Relu, opset 15\): Relu \(domain ai.onnx\) version 14 \(the version at "
                             r"opset 15\) is not implemented; implemented versions: 6, 13$"):
        tdo.load(model)


def test_deprecated_upsample_at_opset_10_is_refused():
    graph = helper.make_graph([N("Upsample", ["x", "s"], ["y"], name="up")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 2, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 4, 4])],
                              [numpy_helper.from_array(np.array([1, 1, 2, 2], F32), "s")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 10)])
    with pytest.raises(tdo.UnsupportedModelError, match=r"Upsample \(domain ai.onnx\) version 10 .* implemented versions: 7, 9"):
        tdo.load(model)


def _one_op(op, opset, elem=TensorProto.FLOAT):
    graph = helper.make_graph([N(op, ["x"], ["y"], name="act")], "g", [helper.make_tensor_value_info("x", elem, [2, 3])],
                              [helper.make_tensor_value_info("y", elem, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)] if opset else [])
    model.ir_version = 3
    return model


@pytest.mark.parametrize("opset", [0, LATEST + 1])
def test_opset_outside_the_range_is_refused(opset):
    """Above the installed onnx's newest opset, and a default-domain node in a model that imports
    no default opset (opset 0)."""
    with pytest.raises(tdo.UnsupportedModelError, match=rf"model opset {opset} is not supported \(default-domain opsets 1–{LATEST}"):
        tdo.load(_one_op("Relu", opset))


@pytest.mark.parametrize("op,opset,elem", [("Not", 1, TensorProto.BOOL), ("Relu", 6, TensorProto.FLOAT), ("Abs", 6, TensorProto.FLOAT)])
def test_an_opset_below_7_loads_when_its_op_versions_are_implemented(reference, rng, op, opset, elem):
    """Not-1 and Relu-6 / Abs-6 are the versions opsets 7+ still use: a model stamped with the old
    opset loads and equals onnxruntime (which runs it with a warning: it guarantees opset 7+ only).
    The rule changed from "refuse below 7" to "refuse the op versions not implemented"."""
    model = _one_op(op, opset, elem)
    x = rng.normal(size=(2, 3)).astype(np.float32)
    feed = {"x": x > 0 if elem == TensorProto.BOOL else x}
    got = tdo.load(model)(feed)["y"]
    np.testing.assert_array_equal(got, reference(model, feed)[0])


def test_an_opset_below_7_refuses_an_op_version_not_implemented():
    with pytest.raises(tdo.UnsupportedModelError,
                       match=r"node 'act' \(Relu, opset 5\): Relu \(domain ai.onnx\) version 1 \(the version at opset 5\) "
                             r"is not implemented; implemented versions: 6, 13, 14$"):
        tdo.load(_one_op("Relu", 5))


@pytest.mark.parametrize("opset,scales", [(9, [1, 1, 2, 3]), (10, [1, 1, 0.5, 0.75]), (10, [1, 1, 1.5, 2.5])])
@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_legacy_resize_and_upsample(check, rng, opset, scales, mode):
    op_inputs = ["x", "s"]
    node = N("Upsample" if opset < 10 else "Resize", op_inputs, ["y"], mode=mode)
    check([node], {"x": rng.normal(size=(1, 2, 4, 4)).astype(F32)}, inits={"s": np.array(scales, F32)}, opset=opset)


@pytest.mark.parametrize("spatial", [0, 1])
def test_batchnorm_v7_spatial(check, rng, spatial):
    shape = (3,) if spatial else (3, 2, 2)
    inits = {"s": rng.uniform(0.5, 2, shape).astype(F32), "b": rng.normal(size=shape).astype(F32),
             "m": rng.normal(size=shape).astype(F32), "v": rng.uniform(0.5, 2, shape).astype(F32)}
    check([N("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], spatial=spatial)],
          {"x": rng.normal(size=(2, 3, 2, 2)).astype(F32)}, inits=inits, opset=7)


def test_dropout_v7_mask_has_the_input_dtype_and_is_zero_as_in_onnxruntime(check, rng):
    check([N("Dropout", ["x"], ["y", "mask"], ratio=0.3)], {"x": rng.normal(size=(2, 3)).astype(F32)},
          outputs=(("y", TensorProto.FLOAT, [2, 3]), ("mask", TensorProto.FLOAT, [2, 3])), opset=7)
