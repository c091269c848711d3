"""Errors of the ONNX importer."""

from __future__ import annotations

from tinydist.base.errors import TinydistError


class UnsupportedModelError(TinydistError, ValueError):
    """The model uses an op, dtype, opset or attribute value tinydist cannot run exactly.

    Raised at load time (or, for inputs with symbolic dimensions, on the first call with new
    shapes), never instead of a wrong answer. The message names the node, op type and opset."""


class ModelLoadError(TinydistError, ValueError):
    """The file or bytes are not an ONNX model (the protobuf does not decode); the message names
    the file. Its `__cause__` is the decoder's own error."""
