"""Ops added for the node suite's biggest failing families, checked beyond the suite's few cases:
Einsum equations the suite lacks, the losses with weights and an out-of-range ignore_index, RNN /
GRU / LSTM with biases, clip, activations and a run-time sequence_lens, NonZero / Compress / Unique
on run-time values, ConvTranspose with run-time weights — each tinydist vs onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

N = helper.make_node
F32 = np.float32
I64 = np.int64


def f(rng, *shape):
    return rng.uniform(-2.0, 2.0, shape).astype(F32)


@pytest.mark.parametrize("equation,shapes", [
    ("bhqd,bhkd->bhqk", [(2, 3, 4, 5), (2, 3, 6, 5)]),
    ("ij,jk->ik", [(3, 4), (4, 5)]),
    ("i,j->ij", [(3,), (4,)]),
    ("...ij,...jk", [(2, 3, 4), (2, 4, 5)]),
    ("bij,bjk,bkl->bil", [(2, 3, 4), (2, 4, 5), (2, 5, 2)]),
    ("ii->", [(4, 4)]),
    ("ij->", [(3, 4)]),
])
def test_einsum(check, rng, equation, shapes):
    feeds = {f"x{i}": f(rng, *s) for i, s in enumerate(shapes)}
    check([N("Einsum", list(feeds), ["y"], equation=equation)], feeds, opset=12, rtol=1e-5, atol=1e-5)


def test_einsum_integers(check, rng):
    feeds = {"a": rng.integers(-5, 5, (3, 4)).astype(I64), "b": rng.integers(-5, 5, (4, 2)).astype(I64)}
    check([N("Einsum", ["a", "b"], ["y"], equation="ij,jk->ik")], feeds, opset=12)


def test_einsum_refuses_a_bad_equation(rng):
    import tinydist.onnx as tdo
    from tests.onnx.conftest import make_model
    model = make_model([N("Einsum", ["a"], ["y"], equation="ij->ij")], {"a": f(rng, 3, 4)}, ["y"], opset=12)
    model.graph.node[0].attribute[0].s = b"ijk->i"
    with pytest.raises(tdo.UnsupportedModelError, match="does not match operand shape"):
        tdo.load(model)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("op", ["NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss"])
def test_losses_with_weights_and_ignore_index(check, rng, op, reduction):
    x = f(rng, 3, 5, 2)
    target = np.array([[0, 4], [-1, 2], [3, -1]], I64)   # -1: ignored, outside [0, C)
    check([N(op, ["x", "t", "w"], ["y"], reduction=reduction, ignore_index=-1)], {"x": x, "t": target},
          inits={"w": rng.uniform(0.5, 2.0, 5).astype(F32)}, opset=13, rtol=1e-5, atol=1e-6)


def _recurrent_inits(rng, op, dirs, hidden, inputs, peepholes=False):
    gates = {"RNN": 1, "GRU": 3, "LSTM": 4}[op]
    inits = {"W": f(rng, dirs, gates * hidden, inputs) * 0.5, "R": f(rng, dirs, gates * hidden, hidden) * 0.5,
             "B": f(rng, dirs, 2 * gates * hidden) * 0.5}
    if peepholes:
        inits["P"] = f(rng, dirs, 3 * hidden) * 0.5
    return inits


@pytest.mark.parametrize("op,attrs", [
    ("RNN", {"direction": "bidirectional", "activations": ["Relu", "Tanh"]}),
    ("GRU", {"linear_before_reset": 1}),
    ("GRU", {"direction": "reverse", "clip": 0.5}),
    ("LSTM", {"direction": "bidirectional"}),
    ("LSTM", {"clip": 1.0, "input_forget": 1}),
])
def test_recurrent_vs_onnxruntime(check, rng, op, attrs):
    dirs, hidden, seq, batch, inputs = (2 if attrs.get("direction") == "bidirectional" else 1), 5, 4, 3, 6
    x = f(rng, seq, batch, inputs)
    outs = ["Y", "Y_h"] + (["Y_c"] if op == "LSTM" else [])
    check([N(op, ["x", "W", "R", "B"], outs, hidden_size=hidden, **attrs)], {"x": x},
          inits=_recurrent_inits(rng, op, dirs, hidden, inputs), outputs=outs, opset=14, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
def test_recurrent_sequence_lens_at_run_time(check, rng, op):
    hidden, seq, batch, inputs = 4, 5, 3, 2
    outs = ["Y", "Y_h"] + (["Y_c"] if op == "LSTM" else [])
    names = ["x", "W", "R", "B", "lens", "h0"] + (["c0", "P"] if op == "LSTM" else [])
    feeds = {"x": f(rng, seq, batch, inputs), "lens": np.array([5, 2, 3], np.int32), "h0": f(rng, 1, batch, hidden)}
    if op == "LSTM":
        feeds["c0"] = f(rng, 1, batch, hidden)
    check([N(op, names, outs, hidden_size=hidden)], feeds, inits=_recurrent_inits(rng, op, 1, hidden, inputs, op == "LSTM"),
          outputs=outs, opset=14, rtol=1e-4, atol=1e-5)


def test_nonzero_and_compress_follow_the_run_time_values(rng):
    import tinydist.onnx as tdo
    from tests.onnx.conftest import make_model, reference
    model = make_model([N("NonZero", ["x"], ["nz"]), N("Compress", ["d", "c"], ["y"], axis=1)],
                       {"x": f(rng, 3, 4), "d": f(rng, 2, 5), "c": np.ones(5, bool)}, ["nz", "y"], opset=13)
    loaded = tdo.load(model)
    for _ in range(3):  # new values: new output shapes, each equal to onnxruntime's
        feeds = {"x": (rng.uniform(size=(3, 4)) > 0.5).astype(F32), "d": f(rng, 2, 5), "c": rng.uniform(size=5) > 0.4}
        got = loaded(feeds)
        for (name, have), want in zip(got.items(), reference(model, feeds)):
            np.testing.assert_array_equal(have, want, err_msg=name)


def test_nonzero_of_a_large_run_time_input_is_refused_saying_why(rng):
    import tinydist.onnx as tdo
    from tests.onnx.conftest import make_model
    model = make_model([N("Relu", ["x"], ["r"]), N("NonZero", ["r"], ["y"])], {"x": f(rng, 10, 10)}, ["y"], opset=13)
    with pytest.raises(tdo.UnsupportedModelError, match="output shape depends on the values of input 'X'"):
        tdo.load(model)


@pytest.mark.parametrize("attrs", [{}, {"sorted": 0}, {"axis": 0}, {"axis": 1, "sorted": 1}])
def test_unique(check, attrs):
    x = np.array([[1, 3, 1], [2, 0, 2], [1, 3, 1]], F32)
    check([N("Unique", ["x"], ["y", "i", "inv", "n"], **attrs)], {"x": x}, outputs=("y", "i", "inv", "n"), opset=11)


@pytest.mark.parametrize("kw", [dict(strides=[2, 2], group=2), dict(strides=[3, 2], output_shape=[10, 8])])
def test_conv_transpose_with_run_time_weights(check, rng, kw):
    check([N("ConvTranspose", ["x", "w"], ["y"], **kw)], {"x": f(rng, 1, 4, 3, 3), "w": f(rng, 4, 2, 3, 3)}, opset=11)


@pytest.mark.parametrize("attrs,scales,sizes", [
    ({"mode": "cubic"}, [1, 1, 2, 1.5], None),
    ({"mode": "cubic", "cubic_coeff_a": -0.5, "exclude_outside": 1}, [1, 1, 0.6, 1.4], None),
    ({"mode": "cubic", "coordinate_transformation_mode": "asymmetric"}, [1, 1, 2, 2], None),
    ({"mode": "cubic", "coordinate_transformation_mode": "pytorch_half_pixel"}, None, [2, 3, 9, 5]),
    ({"mode": "linear", "antialias": 1}, None, [2, 3, 3, 4]),
    ({"mode": "cubic", "antialias": 1}, [1, 1, 0.5, 0.7], None),
    ({"mode": "nearest", "keep_aspect_ratio_policy": "not_larger", "axes": [2, 3]}, None, [4, 4]),
    ({"mode": "nearest", "keep_aspect_ratio_policy": "not_smaller", "axes": [2, 3]}, None, [4, 4]),
])
def test_resize_modes(check, rng, attrs, scales, sizes):
    inits = {"scales": np.array(scales, F32)} if scales else {"sizes": np.array(sizes, I64)}
    inputs = ["x", "", "scales"] if scales else ["x", "", "", "sizes"]
    check([N("Resize", inputs, ["y"], **attrs)], {"x": f(rng, 2, 3, 7, 6)}, inits=inits, opset=19, rtol=1e-4, atol=1e-5)


def test_resize_tf_crop_and_resize(check, rng):
    check([N("Resize", ["x", "roi", "", "sizes"], ["y"], mode="linear", coordinate_transformation_mode="tf_crop_and_resize",
             extrapolation_value=-3.0)], {"x": f(rng, 1, 2, 6, 5)},
          inits={"roi": np.array([0, 0, -0.2, 0.1, 1, 1, 0.9, 1.3], F32), "sizes": np.array([1, 2, 4, 6], I64)}, opset=13)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("direction", ["LEFT", "RIGHT"])
def test_bit_shift_against_numpy(rng, dtype, direction):
    # onnxruntime has BitShift for unsigned types only: numpy's shifts are the reference here
    import tinydist.onnx as tdo
    from tests.onnx.conftest import make_model
    width = np.iinfo(dtype).bits
    x = rng.integers(np.iinfo(dtype).min, np.iinfo(dtype).max, 200, dtype=dtype)
    y = rng.integers(0, width, 200).astype(dtype)
    model = make_model([N("BitShift", ["x", "y"], ["z"], direction=direction)], {"x": x, "y": y}, ["z"], opset=11)
    got = tdo.load(model)({"x": x, "y": y})["z"]
    want = np.left_shift(x.view(f"u{x.itemsize}"), y.astype(f"u{x.itemsize}")).view(dtype) if direction == "LEFT" \
        else np.right_shift(x, y)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("attrs,last", [({"axis": 1}, 1), ({"axis": 2, "onesided": 1}, 1), ({"axis": 1}, 2),
                                        ({"axis": 1, "inverse": 1}, 2)])
def test_dft(check, rng, attrs, last):
    check([N("DFT", ["x"], ["y"], **attrs)], {"x": f(rng, 2, 8, 6, last)}, opset=17, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("batch_axis,time_axis", [(1, 0), (0, 1)])
def test_reverse_sequence(check, rng, batch_axis, time_axis):
    x = f(rng, 5, 3, 2) if batch_axis == 1 else f(rng, 3, 5, 2)
    lens = np.array([5, 1, 3], I64)
    node = N("ReverseSequence", ["x", "lens"], ["y"], batch_axis=batch_axis, time_axis=time_axis)
    check([node], {"x": x, "lens": lens}, opset=10)                 # run-time lengths
    check([node], {"x": x}, inits={"lens": lens}, opset=10)         # constant lengths


@pytest.mark.parametrize("kw", [
    dict(kernel_shape=[2, 2]),
    dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
    dict(kernel_shape=[2, 3], dilations=[2, 1], ceil_mode=1, strides=[2, 2]),
    dict(kernel_shape=[3, 2], strides=[1, 2], storage_order=1),
])
def test_max_pool_indices(check, rng, kw):
    """MaxPool's Indices output: flat indices into x with batch and channel offsets, row-major or
    column-major (storage_order=1), padding never chosen; ties (integers from a small range) go
    to the first maximum in the window's scan order."""
    x = rng.integers(-3, 3, (2, 3, 7, 6)).astype(F32)
    check([N("MaxPool", ["x"], ["y", "idx"], **kw)], {"x": x}, outputs=("y", "idx"), opset=12)
    check([N("MaxPool", ["x"], ["y", "idx"], **kw)], {"x": f(rng, 2, 3, 7, 6)}, outputs=("y", "idx"), opset=12)


def test_batch_norm_training_mode(check, rng):
    """training_mode=1: normalised by the batch's statistics; the running mean and variance
    outputs blend the inputs' with the batch's by momentum."""
    feeds = {"x": f(rng, 4, 3, 5, 2)}
    inits = {"s": f(rng, 3), "b": f(rng, 3), "m": f(rng, 3), "v": rng.uniform(0.5, 2, 3).astype(F32)}
    check([N("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "rm", "rv"], training_mode=1, momentum=0.7, epsilon=1e-3)],
          feeds, outputs=("y", "rm", "rv"), inits=inits, opset=15)


def test_pow_integer_base_float_exponent(check, rng):
    """Pow(int, float) keeps the base's integer dtype (a float power, truncated; a negative base to a
    fractional power is NaN, whose cast is undefined: left out)."""
    feeds = {"x": rng.integers(0, 9, (3, 4)).astype(np.int32), "e": rng.uniform(0, 3, (3, 4)).astype(F32).round(1)}
    check([N("Pow", ["x", "e"], ["y"])], feeds, opset=15)


def _graph(nodes, inputs, outputs):
    return helper.make_graph(nodes, "body", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                             [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs])


def test_if_with_a_constant_and_a_run_time_condition(check, rng):
    """If's branches read outer values; a constant condition takes one branch at plan time, a
    run-time one selects between both (outputs alike) with where."""
    then_b = _graph([N("Mul", ["x", "x"], ["t"])], [], [("t", TensorProto.FLOAT, [3, 4])])
    else_b = _graph([N("Neg", ["x"], ["e"])], [], [("e", TensorProto.FLOAT, [3, 4])])
    x = f(rng, 3, 4)
    for cond in (True, False):
        check([N("If", ["c"], ["y"], then_branch=then_b, else_branch=else_b)], {"x": x}, opset=13,
              inits={"c": np.array(cond)})
    check([N("ReduceSum", ["x"], ["s"], keepdims=0), N("Greater", ["s", "zero"], ["c"]),
           N("If", ["c"], ["y"], then_branch=then_b, else_branch=else_b)], {"x": x}, opset=13, inits={"zero": np.array(0.0, F32)})


def test_loop_carries_state_and_stacks_scan_outputs(check, rng):
    """Loop with a trip count, a carried value updated from an outer tensor, the iteration number,
    and a per-iteration scan output stacked on a new first axis."""
    body = _graph([N("Cast", ["i"], ["fi"], to=TensorProto.FLOAT), N("Mul", ["x", "fi"], ["xi"]),
                   N("Add", ["acc", "xi"], ["acc_out"]), N("Identity", ["cond"], ["cond_out"]), N("Sin", ["acc_out"], ["each"])],
                  [("i", TensorProto.INT64, []), ("cond", TensorProto.BOOL, []), ("acc", TensorProto.FLOAT, [3])],
                  [("cond_out", TensorProto.BOOL, []), ("acc_out", TensorProto.FLOAT, [3]), ("each", TensorProto.FLOAT, [3])])
    check([N("Loop", ["m", "", "a0"], ["acc", "all"], body=body)], {"x": f(rng, 3), "a0": f(rng, 3)},
          outputs=(("acc", TensorProto.FLOAT, [3]), ("all", TensorProto.FLOAT, [4, 3])), opset=13, inits={"m": np.array(4, I64)})


def test_scan_with_reverse_input_and_output_axis(check, rng):
    """Scan 9+: a running sum over axis 1 of the input read in reverse, the partial sums stacked
    along output axis 1."""
    body = _graph([N("Add", ["s", "xt"], ["s_out"]), N("Identity", ["s_out"], ["y_t"])],
                  [("s", TensorProto.FLOAT, [2]), ("xt", TensorProto.FLOAT, [2])],
                  [("s_out", TensorProto.FLOAT, [2]), ("y_t", TensorProto.FLOAT, [2])])
    check([N("Scan", ["s0", "x"], ["s", "ys"], body=body, num_scan_inputs=1, scan_input_axes=[1],
             scan_input_directions=[1], scan_output_axes=[1])], {"s0": f(rng, 2), "x": f(rng, 2, 5)},
          outputs=(("s", TensorProto.FLOAT, [2]), ("ys", TensorProto.FLOAT, [2, 5])), opset=16)


def test_loop_refuses_a_run_time_trip_count(rng):
    import onnx

    import tinydist.onnx as tdo
    body = _graph([N("Identity", ["cond"], ["cond_out"]), N("Identity", ["v"], ["v_out"])],
                  [("i", TensorProto.INT64, []), ("cond", TensorProto.BOOL, []), ("v", TensorProto.FLOAT, [3])],
                  [("cond_out", TensorProto.BOOL, []), ("v_out", TensorProto.FLOAT, [3])])
    graph = helper.make_graph(
        [N("ReduceSum", ["x"], ["s"], keepdims=0), N("Cast", ["s"], ["m"], to=TensorProto.INT64),
         N("Loop", ["m", "", "x"], ["y"], body=body)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [100])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    assert isinstance(model, onnx.ModelProto)
    with pytest.raises(tdo.UnsupportedModelError, match="the trip count M is computed from tensor values at run time"):
        tdo.load(model)


@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align_corners", [0, 1])
def test_grid_sample(check, rng, mode, padding_mode, align_corners):
    """GridSample over a run-time grid reaching past the borders (every padding mode matters)."""
    feeds = {"x": f(rng, 2, 3, 5, 6), "grid": rng.uniform(-1.4, 1.4, (2, 4, 7, 2)).astype(F32)}
    check([N("GridSample", ["x", "grid"], ["y"], mode=mode, padding_mode=padding_mode, align_corners=align_corners)],
          feeds, opset=16, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("center_point_box", [0, 1])
def test_non_max_suppression_on_value_inputs(check, rng, center_point_box):
    """NonMaxSuppression over small run-time boxes and scores (value inputs: a new value is a new
    plan), overlapping boxes so that suppression happens, a score threshold and two classes."""
    corner = rng.uniform(0, 4, (1, 8, 2)).astype(F32)
    boxes = np.concatenate([corner, corner + rng.uniform(0.5, 3, (1, 8, 2)).astype(F32)], axis=2)
    feeds = {"boxes": boxes, "scores": rng.uniform(0, 1, (1, 2, 8)).astype(F32)}
    inits = {"m": np.array([3], I64), "iou": np.array([0.3], F32), "st": np.array([0.2], F32)}
    got = check([N("NonMaxSuppression", ["boxes", "scores", "m", "iou", "st"], ["y"], center_point_box=center_point_box)],
                feeds, inits=inits, opset=11)
    assert 0 < len(got["y"]) <= 6  # at most 3 a class


def test_col2im_with_strides_pads_and_dilations(check, rng):
    """Col2Im: overlapping blocks summed back into the image, padding cropped."""
    feeds = {"x": f(rng, 2, 2 * 2 * 3, 4 * 1)}  # 4 block positions down, 1 across
    inits = {"image": np.array([6, 5], I64), "block": np.array([2, 3], I64)}
    check([N("Col2Im", ["x", "image", "block"], ["y"], strides=[2, 1], pads=[1, 0, 1, 0], dilations=[1, 2])],
          feeds, inits=inits, opset=18)


@pytest.mark.parametrize("shape", [(3, 3), (2, 4, 4), (5, 1, 1)])
def test_det(check, rng, shape):
    check([N("Det", ["x"], ["y"])], {"x": f(rng, *shape)}, opset=13, rtol=1e-4, atol=1e-5)


def test_max_unpool_inverts_max_pool_indices(check, rng):
    """MaxPool's run-time Indices fed to MaxUnpool: each maximum back at its place, zeros elsewhere.
    (For an output_shape larger than the unpooled shape onnxruntime reads the indices in the
    larger layout, onnx's reference in the unpooled one, padding after; tinydist follows the
    reference, so that case is the node suite's.)"""
    check([N("MaxPool", ["x"], ["p", "i"], kernel_shape=[2, 2], strides=[2, 2]),
           N("MaxUnpool", ["p", "i", "shape"], ["y"], kernel_shape=[2, 2], strides=[2, 2])],
          {"x": f(rng, 2, 3, 6, 4)}, outputs=(("y", TensorProto.FLOAT, [2, 3, 6, 4]),),
          inits={"shape": np.array([2, 3, 6, 4], I64)}, opset=11)


@pytest.mark.parametrize("mode", ["linear", "circular"])
def test_tensor_scatter(check, rng, mode):
    """TensorScatter: per-batch run-time write positions into a cache along the sequence axis."""
    feeds = {"cache": f(rng, 3, 2, 6, 4), "update": f(rng, 3, 2, 2, 4), "at": np.array([0, 4, 5 if mode == "circular" else 3], I64)}
    check([N("TensorScatter", ["cache", "update", "at"], ["y"], mode=mode)], feeds, opset=24)


@pytest.mark.parametrize("op,attrs,state", [
    ("Adagrad", dict(decay_factor=0.1, epsilon=1e-5, norm_coefficient=0.01), 1),
    ("Momentum", dict(alpha=0.9, beta=0.5, mode="nesterov", norm_coefficient=0.01), 1),
    ("Adam", dict(alpha=0.9, beta=0.99, epsilon=1e-6, norm_coefficient=0.01, norm_coefficient_post=0.02), 2),
])
@pytest.mark.parametrize("step", [0, 3])
def test_training_optimizers_equal_onnx_reference(rng, op, attrs, state, step):
    """The ai.onnx.preview.training optimizers on two tensors, against onnx's reference evaluator
    (onnxruntime's default build has no training ops); T = 0 and T > 0 differ for Momentum / Adam."""
    from onnx.reference import ReferenceEvaluator

    import tinydist.onnx as tdo
    shapes = [(3, 4), (5,)]
    names = ["R", "T"] + [f"{kind}{i}" for kind in ["X", "G"] + [f"S{k}" for k in range(state)] for i in range(2)]
    feeds = {"R": np.array(0.1, F32), "T": np.array(step, I64)}
    for name in names[2:]:
        feeds[name] = (rng.uniform(0.1, 2.0, shapes[int(name[-1])])).astype(F32)
    outputs = [f"{kind}{i}_new" for kind in ["X"] + [f"S{k}" for k in range(state)] for i in range(2)]
    domain = "ai.onnx.preview.training"
    graph = helper.make_graph(
        [helper.make_node(op, names, outputs, domain=domain, **attrs)], "g",
        [helper.make_tensor_value_info(n, TensorProto.INT64 if n == "T" else TensorProto.FLOAT, list(feeds[n].shape)) for n in names],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, list(shapes[int(o[-5])])) for o in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(domain, 1)])
    want = ReferenceEvaluator(model).run(None, feeds)
    got = tdo.load(model)(feeds)
    for name, expected in zip(outputs, want):
        np.testing.assert_allclose(got[name], expected, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("onesided", [0, 1])
def test_stft_with_a_window(check, rng, onesided):
    feeds = {"signal": f(rng, 2, 50, 1)}
    inits = {"step": np.array(6, I64), "window": np.hanning(12).astype(F32), "length": np.array(12, I64)}
    check([N("STFT", ["signal", "step", "window", "length"], ["y"], onesided=onesided)], feeds, inits=inits, opset=17,
          rtol=1e-4, atol=1e-5)
