"""`InferenceSession`: onnxruntime's inference API over a loaded model, so code written for
onnxruntime runs on tinydist by changing its import:

    import tinydist.onnx as ort                    # was: import onnxruntime as ort
    session = ort.InferenceSession("model.onnx", providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    (logits,) = session.run(None, {name: frame})

`run(output_names, input_feed)` returns a list in `output_names`' order (every output when None),
as onnxruntime does; `get_inputs()` / `get_outputs()` describe the graph with onnxruntime's
`NodeArg` fields (`name`, `shape` with symbolic dimensions as their names, `type` as
"tensor(float)"). A provider list names where the model runs: onnxruntime's CPU provider is
tinydist's default device, and a tinydist device name ("CPU:1", "remote://host:port/CPU:0")
is accepted in its place. Each session is one `OnnxModel` (`tinydist.onnx.load`): the same
capture and replay per input shape, the same errors.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tinydist.onnx.model import OnnxModel, load
from tinydist.runtime.registry import canonical_name

CPU_PROVIDER = "CPUExecutionProvider"

# ONNX's TensorProto element types, as onnxruntime names them in NodeArg.type
_TYPE_NAMES = {1: "float", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64", 8: "string",
               9: "bool", 10: "float16", 11: "double", 12: "uint32", 13: "uint64", 14: "complex64",
               15: "complex128", 16: "bfloat16"}


@dataclass(frozen=True)
class NodeArg:
    """A graph input or output, as onnxruntime's `NodeArg` describes it."""
    name: str
    shape: list[int | str | None]
    type: str


@dataclass
class SessionOptions:
    """onnxruntime's session options, for code that builds them. `intra_op_num_threads` is
    `td.onnx.load`'s `threads` (0, onnxruntime's default: this machine's CPUs). tinydist chooses
    its own graph optimisations (every graph is fused and captured) and has no inter-op pool, so
    the others are accepted and kept, not acted on; `log_severity_level` maps to nothing either:
    set TINYDIST_LOG_LEVEL."""
    intra_op_num_threads: int = 0
    inter_op_num_threads: int = 0
    graph_optimization_level: Any = None
    log_severity_level: int = 2
    enable_profiling: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelMetadata:
    """onnxruntime's `ModelMetadata`: what the model file says about itself."""
    producer_name: str
    graph_name: str
    domain: str
    description: str
    graph_description: str
    version: int
    custom_metadata_map: dict[str, str]


class InferenceSession:
    """An ONNX model ready to run, with onnxruntime's `InferenceSession` API (module docstring)."""

    def __init__(self, path_or_bytes: str | os.PathLike[str] | bytes, sess_options: Any = None,
                 providers: Sequence[Any] | None = None, provider_options: Sequence[Any] | None = None,
                 **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"InferenceSession got unexpected keyword argument(s) {sorted(kwargs)}")
        self._device = _device_of(providers)
        self._providers = [CPU_PROVIDER] if self._device.startswith("CPU") else [self._device]
        self._options = sess_options if sess_options is not None else SessionOptions()
        proto = _read(path_or_bytes)
        threads = self._options.intra_op_num_threads
        self._model: OnnxModel = load(proto, device=self._device, threads=threads or None)
        initializers = {init.name for init in proto.graph.initializer}
        self._inputs = [_node_arg(vi) for vi in proto.graph.input if vi.name not in initializers]
        self._outputs = [_node_arg(vi) for vi in proto.graph.output]
        self._metadata = ModelMetadata(proto.producer_name, proto.graph.name, proto.domain, proto.doc_string,
                                       proto.graph.doc_string, proto.model_version,
                                       {p.key: p.value for p in proto.metadata_props})

    def __repr__(self) -> str:
        return f"InferenceSession({self._metadata.graph_name!r} on {self._device})"

    # ---- what onnxruntime's session answers ------------------------------------------------

    def get_inputs(self) -> list[NodeArg]:
        return list(self._inputs)

    def get_outputs(self) -> list[NodeArg]:
        return list(self._outputs)

    def get_overridable_initializers(self) -> list[NodeArg]:
        return []  # initializers are folded into the graph at load

    def get_providers(self) -> list[str]:
        return list(self._providers)

    def get_provider_options(self) -> dict[str, dict[str, str]]:
        return {provider: {} for provider in self._providers}

    def get_session_options(self) -> Any:
        return self._options

    def get_modelmeta(self) -> ModelMetadata:
        return self._metadata

    @property
    def model(self) -> OnnxModel:
        """The tinydist model behind the session (`run_tensors` for lazy Tensors in and out)."""
        return self._model

    # ---- running ---------------------------------------------------------------------------

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], run_options: Any = None) -> list[Any]:
        """The outputs named by `output_names` (every output, in the graph's order, when None or
        empty) for `input_feed` (input name -> array; a sequence input: a list of arrays, an empty
        optional: None), as a list in that order (a sequence output: a list of arrays)."""
        names = list(output_names) if output_names else [o.name for o in self._outputs]
        known = {o.name for o in self._outputs}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"output name(s) {unknown} are not outputs of the model; its outputs: {sorted(known)}")
        results = self._model(input_feed)
        return [results[name] for name in names]


def _read(path_or_bytes: Any) -> Any:
    """The ModelProto of a path or bytes; `load`'s error for anything that is no ONNX model."""
    import onnx
    from google.protobuf.message import DecodeError

    if isinstance(path_or_bytes, onnx.ModelProto):
        return path_or_bytes
    if not isinstance(path_or_bytes, (str, os.PathLike, bytes, bytearray)):
        raise TypeError(f"InferenceSession takes a path or the model's bytes, got {type(path_or_bytes).__name__}")
    try:
        if isinstance(path_or_bytes, (bytes, bytearray)):
            return onnx.load_from_string(bytes(path_or_bytes))
        return onnx.load(os.fspath(path_or_bytes))
    except DecodeError:
        return load(path_or_bytes)  # raises ModelLoadError, naming the file and what to check


def _device_of(providers: Sequence[Any] | None) -> str:
    """The tinydist device a provider list names: the first provider tinydist can serve."""
    if not providers:
        return canonical_name("CPU")
    refused = []
    for provider in providers:
        name = provider[0] if isinstance(provider, tuple) else provider  # (name, options) pairs, as onnxruntime takes
        if name == CPU_PROVIDER:
            return canonical_name("CPU")
        if isinstance(name, str) and name.endswith("ExecutionProvider"):  # onnxruntime's others: passed over, as it does
            refused.append(name)
            continue
        try:
            return canonical_name(name)
        except (TypeError, ValueError):
            refused.append(name)
    raise ValueError(f"providers {refused} are not available in tinydist: use {CPU_PROVIDER!r} (the default CPU "
                     "device) or a tinydist device name such as 'CPU:1' or 'remote://HOST:PORT/CPU:0'")


def _node_arg(value_info: Any) -> NodeArg:
    """As onnxruntime describes it: a sequence as "seq(tensor(float))" with shape [], an optional
    as "optional(…)" with its element's shape."""
    return NodeArg(value_info.name, _shape_of(value_info.type), _type_name(value_info.type))


def _type_name(tp: Any) -> str:
    field = tp.WhichOneof("value")
    if field == "sequence_type":
        return f"seq({_type_name(tp.sequence_type.elem_type)})"
    if field == "optional_type":
        return f"optional({_type_name(tp.optional_type.elem_type)})"
    return f"tensor({_TYPE_NAMES.get(tp.tensor_type.elem_type, 'undefined')})"


def _shape_of(tp: Any) -> list[int | str | None]:
    if tp.HasField("optional_type"):
        return _shape_of(tp.optional_type.elem_type)
    shape: list[int | str | None] = []
    if not tp.HasField("tensor_type"):
        return shape
    for dim in tp.tensor_type.shape.dim:
        if dim.HasField("dim_value"):
            shape.append(dim.dim_value)
        else:
            shape.append(dim.dim_param or None)
    return shape
