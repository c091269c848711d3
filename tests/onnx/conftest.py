"""Shared helpers for the ONNX importer tests: build small models with onnx.helper, compare with onnxruntime.

The whole directory is skipped when the optional extras (onnx, onnxruntime) are absent."""

from __future__ import annotations

import numpy as np
import pytest
import structlog

pytest.importorskip("onnx.helper")  # not just `onnx`: tests/onnx itself could pass as a namespace package
pytest.importorskip("onnxruntime")

import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import tinydist.onnx as tdo  # noqa: E402
from tinydist.base import logs  # noqa: E402

NP_TO_ELEM = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float64): TensorProto.DOUBLE,
              np.dtype(np.int32): TensorProto.INT32, np.dtype(np.int64): TensorProto.INT64,
              np.dtype(np.bool_): TensorProto.BOOL, np.dtype(np.float16): TensorProto.FLOAT16,
              np.dtype(np.int8): TensorProto.INT8, np.dtype(np.uint8): TensorProto.UINT8,
              np.dtype(np.int16): TensorProto.INT16, np.dtype(np.uint16): TensorProto.UINT16}


def make_model(nodes, feeds, outputs, inits=None, opset=17, shapes=None):
    """A checked ModelProto: graph inputs typed from `feeds` (or `shapes` overrides, None dims symbolic),
    outputs typed by ONNX shape inference."""
    inputs = []
    for name, value in feeds.items():
        shape = (shapes or {}).get(name, list(value.shape))
        shape = [d if d is not None else f"d{name}{i}" for i, d in enumerate(shape)]
        inputs.append(helper.make_tensor_value_info(name, NP_TO_ELEM[value.dtype], shape))
    outs = [helper.make_tensor_value_info(*name) if isinstance(name, tuple)
            else helper.make_value_info(name, onnx.TypeProto()) for name in outputs]
    initializers = [numpy_helper.from_array(np.asarray(v), k) for k, v in (inits or {}).items()]
    graph = helper.make_graph(nodes, "test", inputs, outs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10 if opset >= 21 else 8
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    onnx.checker.check_model(model)
    return model


def reference(model, feeds):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def check(nodes, feeds, outputs=("y",), inits=None, opset=17, rtol=1e-5, atol=1e-5, shapes=None, device="CPU"):
    """Run the one model on tinydist (on `device`) and onnxruntime; outputs must agree in name, dtype, shape and value."""
    model = make_model(nodes, feeds, list(outputs), inits, opset, shapes)
    outputs = [name[0] if isinstance(name, tuple) else name for name in outputs]
    expected = reference(model, feeds)
    got = tdo.load(model, device=device)(feeds)
    assert list(got) == list(outputs)
    for name, want in zip(outputs, expected):
        have = got[name]
        assert have.dtype == want.dtype, f"{name}: dtype {have.dtype} vs onnxruntime {want.dtype}"
        assert have.shape == want.shape, f"{name}: shape {have.shape} vs onnxruntime {want.shape}"
        if want.dtype.kind in "biu":
            np.testing.assert_array_equal(have, want, err_msg=name)
        else:
            np.testing.assert_allclose(have, want, rtol=rtol, atol=atol, err_msg=name)
    return got


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture(name="check")
def check_fixture():
    return check


@pytest.fixture(name="make_model")
def make_model_fixture():
    return make_model


@pytest.fixture(name="reference")
def reference_fixture():
    return reference


@pytest.fixture
def restore_logging():
    """`cli.main` reconfigures logging onto the captured stream; put the old configuration back."""
    saved, configured = structlog.get_config(), logs._configured
    yield
    structlog.configure(**saved)
    logs._configured = configured
