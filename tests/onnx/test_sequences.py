"""Sequence and optional values, compared with onnxruntime: sequences built and consumed inside a
graph (captured, replayed with new inputs), sequence / optional graph inputs and outputs through
`InferenceSession` (lists of arrays, None for an empty optional), SequenceMap and a Loop carrying
a sequence, and the refusals (a run-time position, a map value)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import tinydist.onnx as tdo

F32 = np.float32
N = helper.make_node
SEQ_F = helper.make_sequence_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, None))


def _model(nodes, inputs, outputs, opset=18, inits=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model.SerializeToString()


def _ort(model, feed):
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feed)


def _same(have, want):
    if isinstance(want, list):
        assert isinstance(have, list) and len(have) == len(want), (have, want)
        for h, w in zip(have, want):
            _same(h, w)
    elif want is None:
        assert have is None
    else:
        assert have.dtype == want.dtype and have.shape == want.shape, (have.dtype, have.shape, want.dtype, want.shape)
        np.testing.assert_allclose(have, want, rtol=1e-6, atol=1e-6)


def _tensor(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def test_sequence_ops_inside_a_graph_capture_and_match_onnxruntime(rng):
    """Split → insert / erase / at → concat and stack, every graph value a tensor: the model is
    captured on its second call, so the later calls replay it with new inputs."""
    nodes = [
        N("SplitToSequence", ["x", "sizes"], ["parts"], axis=1),               # widths 1, 2, 3
        N("SequenceInsert", ["parts", "extra", "front"], ["with_extra"]),       # extra at position 0
        N("SequenceErase", ["with_extra", "minus_one"], ["erased"]),            # drop the last (width 3)
        N("SequenceLength", ["erased"], ["n"]),
        N("SequenceAt", ["erased", "minus_one"], ["last"]),                     # the width-2 part
        N("ConcatFromSequence", ["erased"], ["joined"], axis=1),
        N("SplitToSequence", ["x"], ["rows"], axis=0, keepdims=0),
        N("ConcatFromSequence", ["rows"], ["stacked"], axis=-1, new_axis=1),
        N("SequenceConstruct", ["x", "x"], ["pair"]),
        N("ConcatFromSequence", ["pair"], ["doubled"], axis=0),
    ]
    inits = [helper.make_tensor("sizes", TensorProto.INT64, [3], [1, 2, 3]),
             helper.make_tensor("front", TensorProto.INT64, [], [0]), helper.make_tensor("minus_one", TensorProto.INT64, [], [-1])]
    outputs = [_tensor("n", []), _tensor("last", [4, 2]), _tensor("joined", [4, 5]), _tensor("stacked", [6, 4]),
               _tensor("doubled", [8, 6])]
    outputs[0] = _tensor("n", [], TensorProto.INT64)
    model = _model(nodes, [_tensor("x", [4, 6]), _tensor("extra", [4, 2])], outputs, inits=inits)
    loaded = tdo.load(model)
    for _ in range(3):
        feed = {"x": rng.normal(size=(4, 6)).astype(F32), "extra": rng.normal(size=(4, 2)).astype(F32)}
        got = loaded(feed)
        for name, want in zip(got, _ort(model, feed)):
            _same(got[name], want)


def test_sequence_graph_inputs_and_outputs_round_trip_as_lists(rng):
    """A sequence input is a list of arrays and a sequence output comes back as one, through
    InferenceSession as through onnxruntime; a new length is a new plan and a new capture."""
    nodes = [N("Add", ["x", "x"], ["x2"]), N("SequenceInsert", ["seq", "x2"], ["grown"]), N("SequenceAt", ["seq", "zero"], ["at"]),
             N("Neg", ["at"], ["first"]), N("Identity", ["seq"], ["same"])]
    zero = helper.make_tensor("zero", TensorProto.INT64, [], [0])
    model = _model(nodes, [helper.make_value_info("seq", SEQ_F), _tensor("x", [3])],
                   [helper.make_value_info("grown", SEQ_F), helper.make_value_info("first", helper.make_tensor_type_proto(TensorProto.FLOAT, None)),
                    helper.make_value_info("same", SEQ_F)], inits=[zero])
    session = tdo.InferenceSession(model, providers=["CPUExecutionProvider"])
    reference = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    assert [(a.name, a.type, a.shape) for a in session.get_inputs()] == \
        [(a.name, a.type, a.shape) for a in reference.get_inputs()]
    assert [a.type for a in session.get_outputs()] == [a.type for a in reference.get_outputs()]
    for length in (1, 3, 3, 3, 2):
        feed = {"seq": [rng.normal(size=(k + 1,)).astype(F32) for k in range(length)], "x": rng.normal(size=3).astype(F32)}
        _same(session.run(None, feed), reference.run(None, feed))
    # length 3's three calls: captured on the second, replayed on the third (the elements passed flat)
    captured = [j for j in session.model._jits.values() if j is not None and j.captured is not None]
    assert [j.calls for j in captured] == [3]
    with pytest.raises(TypeError, match=r"input 'seq': expected a sequence \(a list of arrays\)"):
        session.run(None, {"seq": np.zeros(3, F32), "x": np.zeros(3, F32)})
    with pytest.raises(ValueError, match=r"input 'seq\[1\]': expected dtype float32, got int64"):
        session.run(None, {"seq": [np.zeros(2, F32), np.zeros(2, np.int64)], "x": np.zeros(3, F32)})


@pytest.mark.parametrize("present", [True, False])
def test_optional_input_present_or_empty(rng, present):
    """An optional input fed an array or None: OptionalHasElement, an If on it (the condition is
    known at plan time: the optional's presence is part of the input's key), the optional passed out."""
    opt = helper.make_optional_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, [3]))
    then = helper.make_graph([N("OptionalGetElement", ["o"], ["v"]), N("Add", ["v", "x"], ["r"])], "then", [], [_tensor("r", [3])])
    other = helper.make_graph([N("Identity", ["x"], ["r2"])], "else", [], [_tensor("r2", [3])])
    nodes = [N("OptionalHasElement", ["o"], ["has"]), N("If", ["has"], ["y"], then_branch=then, else_branch=other),
             N("Identity", ["o"], ["o_out"]), N("Optional", ["x"], ["wrapped"]), N("OptionalGetElement", ["wrapped"], ["unwrapped"])]
    model = _model(nodes, [helper.make_value_info("o", opt), _tensor("x", [3])],
                   [_tensor("has", [], TensorProto.BOOL), _tensor("y", [3]), helper.make_value_info("o_out", opt), _tensor("unwrapped", [3])])
    feed = {"o": rng.normal(size=3).astype(F32) if present else None, "x": rng.normal(size=3).astype(F32)}
    got = tdo.InferenceSession(model).run(None, feed)
    _same(got, _ort(model, feed))
    assert bool(got[0]) is present


def test_empty_optional_from_the_optional_op():
    empty = N("Optional", [], ["e"], type=helper.make_tensor_type_proto(TensorProto.FLOAT, [2]))
    model = _model([empty, N("OptionalHasElement", ["e"], ["has"])], [], [_tensor("has", [], TensorProto.BOOL)])
    _same(list(tdo.load(model)({}).values()), _ort(model, {}))
    get = _model([empty, N("OptionalGetElement", ["e"], ["v"])], [], [_tensor("v", [2])])
    with pytest.raises(tdo.UnsupportedModelError, match="OptionalGetElement of an empty optional"):
        tdo.load(get)


def test_sequence_map_and_a_loop_carrying_a_sequence(rng):
    """SequenceMap (a body per element, an extra tensor given to each) and a Loop that grows a
    sequence each iteration, then concatenates it."""
    body = helper.make_graph([N("Mul", ["e", "w"], ["m"]), N("ReduceSum", ["m"], ["s"], keepdims=0)], "map",
                             [_tensor("e", None), _tensor("w", [3])], [_tensor("m", None), _tensor("s", None)])
    loop_body = helper.make_graph(
        [N("Identity", ["cond_in"], ["cond_out"]), N("Cast", ["i"], ["fi"], to=TensorProto.FLOAT), N("Mul", ["x", "fi"], ["scaled"]),
         N("SequenceInsert", ["acc", "scaled"], ["acc_out"])], "loop",
        [_tensor("i", [], TensorProto.INT64), _tensor("cond_in", [], TensorProto.BOOL), helper.make_value_info("acc", SEQ_F)],
        [_tensor("cond_out", [], TensorProto.BOOL), helper.make_value_info("acc_out", SEQ_F)])
    nodes = [N("SplitToSequence", ["xs"], ["seq"], axis=0, keepdims=0),
             N("SequenceMap", ["seq", "x"], ["products", "sums"], body=body),
             N("ConcatFromSequence", ["sums"], ["sum_vec"], axis=0, new_axis=1),
             N("SequenceEmpty", [], ["empty"], dtype=TensorProto.FLOAT),
             N("Loop", ["trips", "true", "empty"], ["grown"], body=loop_body),
             N("ConcatFromSequence", ["grown"], ["flat"], axis=0)]
    inits = [helper.make_tensor("trips", TensorProto.INT64, [], [4]), helper.make_tensor("true", TensorProto.BOOL, [], [True])]
    model = _model(nodes, [_tensor("xs", [5, 3]), _tensor("x", [3])],
                   [helper.make_value_info("products", SEQ_F), _tensor("sum_vec", [5]), _tensor("flat", [12])], inits=inits)
    for _ in range(2):
        feed = {"xs": rng.normal(size=(5, 3)).astype(F32), "x": rng.normal(size=3).astype(F32)}
        _same(tdo.InferenceSession(model).run(None, feed), _ort(model, feed))


def test_a_run_time_position_is_refused():
    """A position computed from tensor data decides which element flows where: refused at load,
    saying so (x has more elements than a value input may: it is data, not a shape). A position
    fed as a graph input is read at call time instead, and a new value is a new plan."""
    nodes = [N("SplitToSequence", ["x"], ["seq"], axis=0, keepdims=0), N("ArgMax", ["x"], ["where"], axis=0, keepdims=0),
             N("ReduceMax", ["where"], ["pos"], keepdims=0), N("SequenceAt", ["seq", "pos"], ["y"])]
    model = _model(nodes, [_tensor("x", [40, 2])], [_tensor("y", [2])])
    with pytest.raises(tdo.UnsupportedModelError, match=r"SequenceAt.*input 'position' must be constant"):
        tdo.load(model)
    fed = _model(nodes[:1] + nodes[3:], [_tensor("x", [3, 2]), _tensor("pos", [], TensorProto.INT64)], [_tensor("y", [2])])
    x = np.arange(6, dtype=F32).reshape(3, 2)
    for pos in (2, -3, 1):
        feed = {"x": x, "pos": np.array(pos, np.int64)}
        _same(list(tdo.load(fed)(feed).values()), _ort(fed, feed))
    with pytest.raises(tdo.UnsupportedModelError, match=r"position 3 is out of range for a sequence of length 3 \(accepted: -3 to 2\)"):
        tdo.load(fed)({"x": x, "pos": np.array(3, np.int64)})


def test_a_map_value_is_refused_naming_it():
    mapped = helper.make_map_type_proto(TensorProto.INT64, helper.make_tensor_type_proto(TensorProto.FLOAT, []))
    model = _model([N("Identity", ["m"], ["y"])], [helper.make_value_info("m", mapped)], [helper.make_value_info("y", mapped)])
    with pytest.raises(tdo.UnsupportedModelError, match=r"graph input 'm': map values are not supported"):
        tdo.load(model)


def test_a_run_time_condition_choosing_between_sequences_is_refused():
    then = helper.make_graph([N("SequenceConstruct", ["x"], ["s1"])], "then", [], [helper.make_value_info("s1", SEQ_F)])
    other = helper.make_graph([N("SequenceConstruct", ["x", "x"], ["s2"])], "else", [], [helper.make_value_info("s2", SEQ_F)])
    nodes = [N("ReduceSum", ["x"], ["total"], keepdims=0), N("Greater", ["total", "zero"], ["cond"]),
             N("If", ["cond"], ["s"], then_branch=then, else_branch=other)]
    model = _model(nodes, [_tensor("x", [100])], [helper.make_value_info("s", SEQ_F)],
                   inits=[helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])])
    with pytest.raises(tdo.UnsupportedModelError, match="a branch gives a sequence or optional"):
        tdo.InferenceSession(model).run(None, {"x": np.ones(100, F32)})


def test_run_tensors_takes_and_gives_lists_of_tensors(rng):
    """run_tensors: a sequence input is a list of td.Tensors, a sequence output a list of lazy ones."""
    from tinydist.frontend.tensor import Tensor

    nodes = [N("SequenceMap", ["seq"], ["doubled"], body=helper.make_graph(
        [N("Add", ["e", "e"], ["d"])], "map", [_tensor("e", None)], [_tensor("d", None)]))]
    model = _model(nodes, [helper.make_value_info("seq", SEQ_F)], [helper.make_value_info("doubled", SEQ_F)])
    arrays = [rng.normal(size=(2, k + 1)).astype(F32) for k in range(3)]
    (out,) = tdo.load(model).run_tensors({"seq": [Tensor(a) for a in arrays]})
    assert isinstance(out, list) and all(isinstance(t, Tensor) for t in out)
    _same([t.numpy() for t in out], _ort(model, {"seq": arrays})[0])
