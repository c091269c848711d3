"""ONNX import: an ONNX graph mapped onto lazy `td.Tensor` ops (no second execution engine).

    import tinydist.onnx
    model = tinydist.onnx.load("model.onnx")        # `onnx` is an optional extra: pip install tinydist[onnx]
    outputs = model({"input": array})              # dict name -> numpy array, in the graph's output order

Initializers are uploaded once at load; `Constant`, `Shape` and everything computable from constants
and static shapes is folded at load with numpy. Each remaining node becomes one pre-resolved closure
over Tensor ops, so a call builds one lazy graph that `realize` fuses and schedules as a whole.
Unsupported ops, dtypes and attribute values raise `UnsupportedModelError` at load. See docs/onnx.md.

or, with onnxruntime's API (`tinydist.onnx.session`):

    session = tinydist.onnx.InferenceSession("model.onnx", providers=["CPUExecutionProvider"])
    outputs = session.run(None, {"input": array})  # a list, in the graph's output order

This package imports nothing from `onnx` until a model is loaded.
"""

from tinydist.onnx.errors import ModelLoadError, UnsupportedModelError
from tinydist.onnx.model import OnnxModel, load
from tinydist.onnx.session import InferenceSession, NodeArg, SessionOptions

__all__ = ["InferenceSession", "ModelLoadError", "NodeArg", "OnnxModel", "SessionOptions", "UnsupportedModelError", "load"]
