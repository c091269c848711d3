"""The ops real exports use beyond the first set (rounding, trig, activations, index ops, the other
normalisations, block rearrangements), each tinydist vs onnxruntime; and run-time values for
shape-determining inputs (a new value is a new plan and capture)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import tinydist.onnx as tdo

N = helper.make_node
F32 = np.float32
I64 = np.int64


def f(rng, *shape, low=-3.0, high=3.0):
    return rng.uniform(low, high, shape).astype(F32)


@pytest.mark.parametrize("op,low,high", [
    ("Ceil", -3, 3), ("Round", -4, 4), ("Sign", -3, 3), ("Tan", -1.4, 1.4), ("Asin", -1, 1), ("Acos", -1, 1),
    ("Atan", -20, 20), ("Sinh", -5, 5), ("Cosh", -5, 5), ("Asinh", -20, 20), ("Acosh", 1, 20), ("Atanh", -0.99, 0.99),
    ("Selu", -4, 4), ("Celu", -4, 4), ("Mish", -10, 10), ("Softsign", -4, 4), ("Shrink", -2, 2),
    ("ThresholdedRelu", -3, 3), ("Softplus", -30, 30)])
def test_unary(check, rng, op, low, high):
    x = f(rng, 4, 37, low=low, high=high)
    if op == "Round":
        x[0, :8] = [-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5, 0.0]
    check([N(op, ["x"], ["y"])], {"x": x}, opset=18, rtol=2e-5, atol=2e-6)


def test_is_nan_is_inf_and_mod(check, rng):
    x = np.array([1.0, np.nan, np.inf, -np.inf, -0.0, 3.0], F32)
    check([N("IsNaN", ["x"], ["a"]), N("IsInf", ["x"], ["b"]), N("IsInf", ["x"], ["c"], detect_negative=0)],
          {"x": x}, outputs=("a", "b", "c"), opset=20)
    a = np.array([-7, 7, 9, -9, 5, -4], I64)
    b = np.array([2, -2, -4, 4, 5, 3], I64)
    check([N("Mod", ["a", "b"], ["y0"]), N("Mod", ["a", "b"], ["y1"], fmod=1)], {"a": a, "b": b}, outputs=("y0", "y1"), opset=13)
    check([N("Mod", ["a", "b"], ["y"], fmod=1)], {"a": f(rng, 3, 5), "b": f(rng, 5, low=0.5, high=2)}, opset=13)


def test_prelu_broadcasts_the_slope(check, rng):
    check([N("PRelu", ["x", "s"], ["y"])], {"x": f(rng, 2, 3, 4, 4)}, inits={"s": f(rng, 3, 1, 1)}, opset=16)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_elements(check, rng, axis):
    x = f(rng, 3, 4)
    idx = rng.integers(-x.shape[axis], x.shape[axis], (3, 4) if axis else (2, 4)).astype(I64)
    check([N("GatherElements", ["x", "i"], ["y"], axis=axis)], {"x": x, "i": idx}, opset=13)


@pytest.mark.parametrize("batch_dims", [0, 1])
def test_gather_nd(check, rng, batch_dims):
    x = f(rng, 2, 3, 4)
    idx = np.array([[[0, 1], [1, 2]], [[1, 0], [0, 3]]], I64) if batch_dims else np.array([[0, 2], [1, -1]], I64)
    check([N("GatherND", ["x", "i"], ["y"], batch_dims=batch_dims)], {"x": x, "i": idx}, opset=13)


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
def test_scatter_elements_and_nd(check, rng, reduction):
    data = f(rng, 3, 4)
    idx = np.array([[1, 0, 2, 1], [0, 2, 1, 0]], I64)  # no duplicates along axis 0 per column
    check([N("ScatterElements", ["d", "i", "u"], ["y"], axis=0, reduction=reduction)],
          {"d": data, "i": idx, "u": f(rng, 2, 4)}, opset=18)
    nd_idx = np.array([[2], [0]], I64)
    check([N("ScatterND", ["d", "i", "u"], ["y"], reduction=reduction)], {"d": data, "i": nd_idx, "u": f(rng, 2, 4)}, opset=18)


def test_one_hot_trilu_cumsum_topk(check, rng):
    idx = np.array([[0, 3, -1], [2, 1, 4]], I64)
    check([N("OneHot", ["i", "depth", "vals"], ["y"], axis=1)], {"i": idx},
          inits={"depth": np.array(5, I64), "vals": np.array([-1.0, 2.0], F32)}, opset=11)
    x = f(rng, 2, 4, 5)
    for upper in (0, 1):
        check([N("Trilu", ["x", "k"], ["y"], upper=upper)], {"x": x}, inits={"k": np.array(-1, I64)}, opset=14)
    for exclusive in (0, 1):
        for reverse in (0, 1):
            check([N("CumSum", ["x", "ax"], ["y"], exclusive=exclusive, reverse=reverse)], {"x": x},
                  inits={"ax": np.array(1, I64)}, opset=14)
    check([N("CumSum", ["x", "ax"], ["y"])], {"x": rng.integers(-5, 5, (3, 6)).astype(I64)}, inits={"ax": np.array(-1, I64)}, opset=14)
    ties = np.round(f(rng, 3, 7), 0)
    for largest in (0, 1):
        check([N("TopK", ["x", "k"], ["v", "i"], axis=1, largest=largest)], {"x": ties}, inits={"k": np.array([3], I64)},
              outputs=("v", "i"), opset=11)


def test_normalisations(check, rng):
    x = f(rng, 2, 6, 5, 4)
    y = (("y", TensorProto.FLOAT, [2, 6, 5, 4]),)  # typed: shape inference leaves function ops' outputs open
    check([N("InstanceNormalization", ["x", "s", "b"], ["y"], epsilon=1e-4)], {"x": x},
          inits={"s": f(rng, 6), "b": f(rng, 6)}, opset=13, rtol=1e-4, atol=1e-5, outputs=y)
    check([N("GroupNormalization", ["x", "s", "b"], ["y"], num_groups=3)], {"x": x},
          inits={"s": f(rng, 6), "b": f(rng, 6)}, opset=21, rtol=1e-4, atol=1e-5, outputs=y)
    check([N("RMSNormalization", ["x", "s"], ["y"], axis=-2)], {"x": x}, inits={"s": f(rng, 5, 4)}, opset=23, rtol=1e-4, atol=1e-5, outputs=y)
    for p in (1, 2):
        check([N("LpNormalization", ["x"], ["y"], axis=1, p=p)], {"x": x}, opset=13, rtol=1e-4, atol=1e-6, outputs=y)
    check([N("MeanVarianceNormalization", ["x"], ["y"])], {"x": x}, opset=9, rtol=1e-4, atol=1e-4, outputs=y)
    check([N("LRN", ["x"], ["y"], size=3, alpha=0.01, beta=0.5, bias=2.0)], {"x": x}, opset=13, rtol=1e-4, atol=1e-5, outputs=y)


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_to_space_and_back(check, rng, mode):
    x = f(rng, 2, 8, 3, 5)
    check([N("DepthToSpace", ["x"], ["y"], blocksize=2, mode=mode)], {"x": x}, opset=13)
    check([N("SpaceToDepth", ["x"], ["y"], blocksize=3)], {"x": f(rng, 1, 2, 6, 9)}, opset=13)


# ---- run-time values for shape-determining inputs ---------------------------------------------

@pytest.mark.parametrize("case", ["reshape", "slice", "pad", "reduce", "resize", "split", "unsqueeze", "topk", "tile"])
def test_shape_input_fed_at_run_time(make_model, reference, rng, case):
    x = f(rng, 2, 3, 4)
    nodes, feeds, variants, outputs = {
        "reshape": ([N("Reshape", ["x", "v"], ["y"])], {"x": x}, [np.array([4, 6], I64), np.array([-1, 3], I64)], ["y"]),
        "slice": ([N("Slice", ["x", "v", "e"], ["y"])], {"x": x, "e": np.array([3, 4], I64)},
                  [np.array([0, 1], I64), np.array([1, 2], I64)], ["y"]),
        "pad": ([N("Pad", ["x", "v"], ["y"])], {"x": x}, [np.zeros(6, I64), np.array([0, 1, 0, 1, 0, 2], I64)], ["y"]),
        "reduce": ([N("ReduceSum", ["x", "v"], ["y"])], {"x": x}, [np.array([1], I64), np.array([0, 2], I64)], ["y"]),
        "resize": ([N("Resize", ["x", "", "v"], ["y"])], {"x": x}, [np.array([1, 1, 2], F32), np.array([1, 2, 0.5], F32)], ["y"]),
        "split": ([N("Split", ["x", "v"], ["y", "z"], axis=2)], {"x": x}, [np.array([1, 3], I64), np.array([2, 2], I64)], ["y", "z"]),
        "unsqueeze": ([N("Unsqueeze", ["x", "v"], ["y"])], {"x": x}, [np.array([0], I64), np.array([-1], I64)], ["y"]),
        "topk": ([N("TopK", ["x", "v"], ["y", "z"])], {"x": x}, [np.array([1], I64), np.array([3], I64)], ["y", "z"]),
        "tile": ([N("Tile", ["x", "v"], ["y"])], {"x": x}, [np.array([1, 2, 1], I64), np.array([2, 1, 3], I64)], ["y"]),
    }[case]
    ranks = {"reshape": 2, "unsqueeze": 4}
    typed = [(o, TensorProto.FLOAT if o == "y" or case != "topk" else TensorProto.INT64,
              [f"{o}{i}" for i in range(ranks.get(case, 3))]) for o in outputs]
    model = make_model(nodes, {**feeds, "v": variants[0]}, typed, opset=18, shapes={"v": [None]})
    loaded = tdo.load(model)
    assert "v" in loaded.value_inputs and "x" not in loaded.value_inputs
    for value in variants + variants[:1]:  # a new value is a new plan; the first one again replays its capture
        feed = {**feeds, "v": value}
        got = loaded(feed)
        for name, want in zip(outputs, reference(model, feed)):
            np.testing.assert_allclose(got[name], want, rtol=1e-6, err_msg=f"{case} with {value}")
    assert len(loaded._plans) == len(variants)


def test_value_input_through_arithmetic_and_run_tensors(make_model, reference, rng):
    import tinydist as td
    x = f(rng, 6, 4)
    model = make_model([N("Add", ["n", "one"], ["n1"]), N("Concat", ["n1", "m"], ["shape"], axis=0),
                        N("Reshape", ["x", "shape"], ["y"])],
                       {"x": x, "n": np.array([1], I64), "m": np.array([-1], I64)}, ["y"], inits={"one": np.array([1], I64)})
    loaded = tdo.load(model)
    assert loaded.value_inputs == {"n", "m"}
    for n in (1, 3, 5):
        feed = {"x": x, "n": np.array([n], I64), "m": np.array([-1], I64)}
        np.testing.assert_array_equal(loaded(feed)["y"], reference(model, feed)[0])
        (y,) = loaded.run_tensors({k: td.Tensor(v) for k, v in feed.items()})
        np.testing.assert_array_equal(y.numpy(), reference(model, feed)[0])


def test_shape_computed_from_a_large_tensor_is_refused(make_model, rng):
    # the Reshape shape is computed from the values of x, a (8, 16) data tensor: too large to key
    # plans on (more than 64 elements), so it stays a tensor and the Reshape refuses, saying why
    x = f(rng, 8, 16)
    model = make_model([N("Cast", ["x"], ["xi"], to=TensorProto.INT64), N("ReduceMax", ["xi"], ["m"], axes=[0, 1]),
                        N("Reshape", ["x", "m"], ["y"])], {"x": x}, [("y", TensorProto.FLOAT, ["a", "b"])], opset=13)
    with pytest.raises(tdo.UnsupportedModelError, match=r"\(Reshape, opset 13\): input 'shape' must be constant"):
        tdo.load(model)
