"""Loading an ONNX model into a plan of closures over td.Tensor ops, and running it.

Load: parse the protobuf (the only place `onnx` is imported), check every node's domain, op type
and attributes, upload initializers, then *plan* for the inputs' static shapes: walk the nodes
once over placeholder tensors (lazy constants: nothing is computed or allocated), folding every
node whose inputs are constant (or depend only on shapes) into numpy values, and turning each
remaining node into one closure `step(env)` over a flat list of value slots. Inputs with symbolic
dimensions get a plan per distinct set of shapes, made on the first call that uses it.

Call: validate the feed, upload it, run the closures (building one lazy graph), realize all
outputs together (one schedule), read them back with one copy batch per device.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from tinydist.engine.realize import realize
from tinydist.frontend.jit import JitError, TinyJit
from tinydist.frontend.tensor import Tensor
from tinydist.graph import dtypes
from tinydist.onnx.errors import ModelLoadError, UnsupportedModelError
from tinydist.onnx.ops import DOMAIN_OPS, FOLDS, OPS, SUPPORTED_NP
from tinydist.onnx.ops._common import EMPTY, OUTER
from tinydist.runtime.engine import get_engine
from tinydist.runtime.registry import canonical_name

# Default-domain opsets from 1 to the installed onnx's newest: below 7 (onnxruntime's oldest) a
# model loads when each node's op version there is one implemented (Not-1, Abs-6 …), and is
# refused by node otherwise, like any version not implemented.
MIN_OPSET = 1
_REQUIRED = object()
_MAX_VALUE_INPUT = 64  # elements: shape vectors, axes, pads, scales are a handful
# plans (and captures) kept per model when value inputs key them, the oldest dropped first: a
# value input that changes every call (an ImageDecoder's encoded bytes) would otherwise keep one each
_MAX_VALUE_PLANS = 32
# ops that read only their input's shape (or a sequence's length), never its values
_SHAPE_ONLY = frozenset({"Shape", "Size", "SequenceLength"})
_LEAF = object()  # in an output's template: a tensor the captured graph returns
# input shapes (a sequence input's: ("seq", element shapes...); an empty optional's: ("none",)),
# values of the value inputs
_Key = tuple[tuple[Any, ...], tuple[bytes, ...]]
# a graph value's type: ("tensor", dims or None when the rank is unknown, dtype), ("sequence", element
# kind) or ("optional", element kind)
Kind = tuple[Any, ...]

# ONNX TensorProto element types that tinydist tensors can hold.
_ELEM_TO_NP = {1: np.float32, 2: np.uint8, 3: np.int8, 4: np.uint16, 5: np.int16, 6: np.int32, 7: np.int64, 9: np.bool_,
               10: np.float16, 11: np.float64, 12: np.uint32, 13: np.uint64}
_SUPPORTED_NAMES = ", ".join(d.name for d in dtypes.SUPPORTED) + ", bfloat16"
_ELEM_NAMES = {0: "UNDEFINED", 1: "FLOAT", 2: "UINT8", 3: "INT8", 4: "UINT16", 5: "INT16", 6: "INT32", 7: "INT64",
               8: "STRING", 9: "BOOL", 10: "FLOAT16", 11: "DOUBLE", 12: "UINT32", 13: "UINT64", 14: "COMPLEX64",
               15: "COMPLEX128", 16: "BFLOAT16"}


def np_dtype_of(ctx: Any, elem_type: int) -> np.dtype:
    if elem_type == 16:  # BFLOAT16: ml_dtypes' (onnx depends on it)
        return dtypes.to_dtype("bfloat16").np
    if elem_type not in _ELEM_TO_NP:
        name = _ELEM_NAMES.get(elem_type, f"elem_type {elem_type}")
        raise ctx.error(f"dtype {name} is not supported ({_SUPPORTED_NAMES})")
    return np.dtype(_ELEM_TO_NP[elem_type])


class NodeCtx:
    """What a handler knows about its node: attributes, opset, output use, and a per-node cache.

    `since` is the `since_version` of the op's schema at the model's opset: the version whose
    semantics the handler implements (handlers branch on it, never on the opset)."""

    __slots__ = ("name", "op_type", "opset", "since", "attrs", "n_outputs", "outputs_used", "_memo", "_device", "run_body")

    def __init__(self, name: str, op_type: str, opset: int, since: int, attrs: dict[str, Any], n_outputs: int,
                 outputs_used: list[bool], device: str) -> None:
        self.name, self.op_type, self.opset, self.since, self.attrs = name, op_type, opset, since, attrs
        self.n_outputs, self.outputs_used, self._device = n_outputs, outputs_used, device
        self._memo: dict[Any, Any] = {}
        # evaluates a subgraph (If / Loop / Scan bodies): set by the model
        self.run_body: Callable[[Body, Mapping[str, Any]], list[Any]] | None = None

    def error(self, message: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"node {self.name!r} ({self.op_type}, opset {self.opset}): {message}")

    def has_attr(self, name: str) -> bool:
        return name in self.attrs

    def attr(self, name: str, default: Any = _REQUIRED) -> Any:
        if name in self.attrs:
            return self.attrs[name]
        if default is _REQUIRED:
            raise self.error(f"required attribute {name!r} is missing")
        return default

    def target_dtype(self, elem_type: int) -> dtypes.DType:
        return dtypes.to_dtype(np_dtype_of(self, elem_type))

    def memo(self, key: Any, make: Callable[[], Any]) -> Any:
        """`make()`'s result, made on the key's first use and kept with the node (what depends only
        on attributes and static shapes: index maps, a tree ensemble's paths)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def lift(self, key: Any, array: np.ndarray | Callable[[], np.ndarray]) -> Tensor:
        """`array` as a Tensor, uploaded once per node and key (a scalar becomes a fused constant);
        a function making the array is called on the key's first use only (work that depends on
        attributes alone: once at load, not on every call that builds the graph)."""
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = lift(self, np.asarray(array() if callable(array) else array), self._device)
        return found

    def lift_made(self, key: Any, make: Callable[[], np.ndarray]) -> Tensor:
        """`make()` as a Tensor, made and uploaded once per node and key: a value derived from
        constants at load (a packed weight), not again on every call."""
        found = self._memo.get(key)
        if found is None:
            found = self.lift(key, make())
        return found


def _host(value: Any) -> Any:
    """A folded result as a constant of the plan: numpy arrays, sequences of them, EMPTY, None."""
    if isinstance(value, Tensor):
        return value.numpy()
    if isinstance(value, list):
        return [_host(v) for v in value]
    return value if value is None or value is EMPTY else np.asarray(value)


def _since_version(defs: Any, op_type: str, opset: int, domain: str = "") -> int | None:
    """The since_version of `op_type`'s schema in `domain` at `opset` (None: no such op there)."""
    try:
        return int(defs.get_schema(op_type, opset, domain).since_version)
    except defs.SchemaError:
        return None


def lift(ctx: Any, array: np.ndarray, device: str) -> Tensor:
    if array.dtype not in SUPPORTED_NP:
        raise ctx.error(f"constant of dtype {array.dtype} is not supported ({_SUPPORTED_NAMES})")
    if array.size == 1:
        return Tensor.full(array.shape, array.reshape(-1)[0].item(), dtypes.to_dtype(array.dtype), device)
    return Tensor(np.ascontiguousarray(array), device).realize()


def _dynamic(value: Any) -> bool:
    """Computed at run time: a Tensor, or a sequence holding one (else a constant of the plan)."""
    return isinstance(value, Tensor) or (isinstance(value, list) and any(_dynamic(v) for v in value))


def _is_const(value: Any) -> bool:
    return isinstance(value, np.ndarray) or value is EMPTY or (isinstance(value, list) and all(_is_const(v) for v in value))


def _arrays(value: Any) -> list[np.ndarray]:
    """A fed sequence's / optional's arrays, depth first (an empty optional has none)."""
    if isinstance(value, list):
        return [a for v in value for a in _arrays(v)]
    return [] if value is EMPTY else [value]


def _leaves(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    return [t for v in value for t in _leaves(v)] if isinstance(value, list) else []


def _kind_of(tp: Any, what: str) -> Kind:
    """A TypeProto as a Kind; a map (or an untyped value) is refused, naming the value."""
    field = tp.WhichOneof("value")
    if field == "tensor_type":
        tt = tp.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in tt.shape.dim) \
            if tt.HasField("shape") else None
        return ("tensor", dims, np_dtype_of(_GraphCtx(what), tt.elem_type))
    if field == "sequence_type":
        return ("sequence", _kind_of(tp.sequence_type.elem_type, f"{what} (its elements)"))
    if field == "optional_type":
        return ("optional", _kind_of(tp.optional_type.elem_type, what))
    raise _GraphCtx(what).error(f"{(field or 'untyped').replace('_type', '')} values are not supported "
                                "(tensors, sequences and optionals)")


def _nest(key: Any, kind: Kind, leaf: Callable[[Any, np.dtype], Any]) -> Any:
    """A sequence / optional input's value from its key (see `_Key`): `leaf(shape, dtype)` per tensor."""
    if kind[0] == "optional":
        return EMPTY if key == ("none",) else _nest(key, kind[1], leaf)
    if kind[0] == "sequence":
        return [_nest(k, kind[1], leaf) for k in key[1:]]
    return leaf(key, kind[2])


def _kind_text(kind: Kind) -> str:
    if kind[0] == "tensor":
        return f"{kind[2].name}{list(kind[1]) if kind[1] is not None else '[…]'}"
    return f"{kind[0]}({_kind_text(kind[1])})"


class Body:
    """A parsed subgraph: its nodes, input and output names, initializers, and the outer-scope
    names it reads (from the graph around it)."""

    __slots__ = ("nodes", "inputs", "outputs", "consts", "outer")

    def __init__(self, nodes: list[Any], inputs: list[str], outputs: list[str], consts: dict[str, np.ndarray],
                 outer: list[str]) -> None:
        self.nodes, self.inputs, self.outputs, self.consts, self.outer = nodes, inputs, outputs, consts, outer


class _GraphCtx:
    def __init__(self, what: str) -> None:
        self.what = what

    def error(self, message: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"{self.what}: {message}")


class _Node:
    __slots__ = ("spec", "ctx", "inputs", "outputs")

    def __init__(self, spec: Any, ctx: NodeCtx, inputs: list[str], outputs: list[str]) -> None:
        self.spec, self.ctx, self.inputs, self.outputs = spec, ctx, inputs, outputs


class _Plan:
    """Closures for one set of input shapes; per output, its slot (or constant value) and its
    template: the value with each run-time tensor replaced by `_LEAF` (the order in which the
    captured graph returns them)."""

    __slots__ = ("steps", "n_slots", "input_slots", "outputs", "templates")

    def __init__(self, steps: list[Callable[[list[Any]], None]], n_slots: int, input_slots: list[int],
                 outputs: list[tuple[int, Any]], templates: list[Any]) -> None:
        self.steps, self.n_slots, self.input_slots, self.outputs = steps, n_slots, input_slots, outputs
        self.templates = templates


def _template(value: Any) -> Any:
    if isinstance(value, Tensor):
        return _LEAF
    return [_template(v) for v in value] if isinstance(value, list) else value


def _fill(template: Any, leaves: Any) -> Any:
    """An output from its template: `_LEAF`s from `leaves` (an iterator of arrays), constants copied
    (an empty optional: None, as onnxruntime gives it)."""
    if template is _LEAF:
        return next(leaves)
    if isinstance(template, list):
        return [_fill(t, leaves) for t in template]
    return None if template is EMPTY else np.array(template, copy=True)


def _make_step(fn: Callable[..., Any], ctx: NodeCtx, spec: list[tuple[int, Any]], out_slots: list[int],
               multi: bool) -> Callable[[list[Any]], None]:
    slots = tuple(s for s, _ in spec)
    consts = tuple(v for _, v in spec)
    if not multi:
        out = out_slots[0]
        if len(spec) == 1 and slots[0] >= 0:
            a = slots[0]

            def step1(env: list[Any]) -> None:
                env[out] = fn(ctx, env[a])
            return step1
        if len(spec) == 2 and slots[0] >= 0 and slots[1] >= 0:
            a, b = slots

            def step2(env: list[Any]) -> None:
                env[out] = fn(ctx, env[a], env[b])
            return step2

        def step(env: list[Any]) -> None:
            env[out] = fn(ctx, *[env[s] if s >= 0 else c for s, c in zip(slots, consts)])
        return step

    def step_multi(env: list[Any]) -> None:
        results = fn(ctx, *[env[s] if s >= 0 else c for s, c in zip(slots, consts)])
        for slot, value in zip(out_slots, results):
            if slot >= 0:
                env[slot] = value
    return step_multi


class OnnxModel:
    """A loaded model: `model(feed)` → dict of numpy outputs; `model.run_tensors(feed)` → Tensors."""

    def __init__(self, proto: Any, device: str = "CPU", threads: int | None = None) -> None:
        import onnx  # the optional extra: imported only when a model is loaded
        from onnx import defs, numpy_helper

        self.threads = intra_op_threads(threads)

        # canonical ("cpu:1" -> "CPU:1"), as every Tensor names its device: compared with the feed's
        # devices, and opened now so that a device this machine lacks fails the load, not a frame
        self.device = canonical_name(device)
        get_engine().device(self.device)
        graph = proto.graph
        opsets = {imp.domain or "ai.onnx": imp.version for imp in proto.opset_import}
        self.opset = opsets.get("ai.onnx", opsets.get("", 0))
        self._opsets = opsets
        latest = defs.onnx_opset_version()
        # a model of other domains only (the training optimizers, ai.onnx.ml) imports no default opset
        other_only = self.opset == 0 and opsets and all(d in DOMAIN_OPS for d in opsets) and \
            all((n.domain or "ai.onnx") in DOMAIN_OPS for n in graph.node)
        if not other_only and not MIN_OPSET <= self.opset <= latest:
            raise UnsupportedModelError(f"model opset {self.opset} is not supported (default-domain opsets "
                                        f"{MIN_OPSET}–{latest}, the range of the installed onnx {onnx.__version__})")
        self.graph_name = graph.name
        self._consts: dict[str, np.ndarray] = {}
        for init in graph.initializer:
            self._consts[init.name] = numpy_helper.to_array(init)
        if len(graph.sparse_initializer):
            raise UnsupportedModelError("sparse initializers are not supported")
        # tensors: (name, shape, dtype); a sequence or optional: (name, None, None), its kind in _kinds
        self.inputs: list[tuple[str, tuple[int | None, ...] | None, np.dtype | None]] = []
        self._kinds: dict[str, Kind] = {}
        for vi in graph.input:
            if vi.name in self._consts:
                continue  # an initializer listed as an input: a constant with a default (not fed)
            if not vi.type.HasField("tensor_type"):  # a sequence or optional (a map is refused, naming it)
                self._kinds[vi.name] = _kind_of(vi.type, f"graph input {vi.name!r}")
                self.inputs.append((vi.name, None, None))
            else:
                self.inputs.append((vi.name, *self._value_type(vi, "graph input")))
        self.outputs: list[tuple[str, tuple[int | None, ...] | None, np.dtype | None]] = []
        for vi in graph.output:
            if vi.type.WhichOneof("value") not in (None, "tensor_type"):  # an untyped output takes what the graph computes
                self._kinds[vi.name] = _kind_of(vi.type, f"graph output {vi.name!r}")
                self.outputs.append((vi.name, None, None))
                continue
            shape, dtype = self._value_type(vi, "graph output", required=False)
            self.outputs.append((vi.name, shape, dtype))
        self.input_names = [name for name, _, _ in self.inputs]
        self.output_names = [name for name, _, _ in self.outputs]

        used: set[str] = {name for name in self.output_names}
        for node in graph.node:
            used.update(i for i in node.input if i)
        self._nodes = self._parse_nodes(graph.node, used, "")
        self.value_inputs = self._find_value_inputs()
        self._plans: dict[_Key, _Plan] = {}
        # per input shapes (and values of value inputs): the graph captured once and replayed per
        # frame (None: nothing to capture)
        self._jits: dict[_Key, TinyJit | None] = {}
        # constant values uploaded once, per name and value (see _lift_value)
        self._lifted: dict[str, list[tuple[np.ndarray, Tensor]]] = {}
        if all(shape is not None and None not in shape for _, shape, _ in self.inputs) and not self.value_inputs:
            self._plan(tuple(tuple(shape) for _, shape, _ in self.inputs), {})  # type: ignore[arg-type]

    def _parse_nodes(self, graph_nodes: Any, used: set[str], scope: str) -> list[_Node]:
        """Check and prepare the nodes of a graph (`scope`: "" for the model's, a prefix for the
        node names of a subgraph); a subgraph attribute (If's branches, Loop's and Scan's body)
        becomes a `Body`, and the outer-scope names it reads become extra inputs of its node."""
        from onnx import defs, helper, numpy_helper

        nodes: list[_Node] = []
        for index, node in enumerate(graph_nodes):
            name = scope + (node.name or f"{node.op_type}_{index}")
            ctx_name = f"node {name!r} ({node.op_type}, opset {self.opset})"
            domain = node.domain or "ai.onnx"
            if domain != "ai.onnx" and domain not in DOMAIN_OPS:
                raise UnsupportedModelError(f"{ctx_name}: domain {node.domain!r} is not supported (the default ONNX "
                                            f"domain and {', '.join(DOMAIN_OPS)})")
            spec = OPS.get(node.op_type) if domain == "ai.onnx" else DOMAIN_OPS[domain].get(node.op_type)
            if spec is None:
                raise UnsupportedModelError(f"{ctx_name}: op type {node.op_type!r} is not supported")
            if domain == "ai.onnx":
                since = _since_version(defs, node.op_type, self.opset)
            else:
                ctx_name = f"node {name!r} ({node.op_type}, {domain} opset {self._opsets.get(domain, 0)})"
                since = _since_version(defs, node.op_type, self._opsets.get(domain, 0), domain)
            at = self.opset if domain == "ai.onnx" else self._opsets.get(domain, 0)
            if since is None:
                raise UnsupportedModelError(f"{ctx_name}: op type {node.op_type!r} does not exist at {domain} opset {at}")
            if since not in spec.versions:
                raise UnsupportedModelError(
                    f"{ctx_name}: {node.op_type} (domain {domain}) version {since} (the version at opset {at}) "
                    f"is not implemented; implemented versions: {', '.join(map(str, sorted(spec.versions)))}")
            attrs: dict[str, Any] = {}
            outer: list[str] = []
            for attr in node.attribute:
                if attr.name not in spec.attrs:
                    raise UnsupportedModelError(f"{ctx_name}: attribute {attr.name!r} is not supported")
                if attr.type == attr.GRAPH and spec.subgraphs:
                    body = self._parse_body(attr.g, f"{name}/{attr.name}/")
                    outer.extend(n for n in body.outer if n not in outer)
                    attrs[attr.name] = body
                    continue
                if attr.type == attr.TYPE_PROTO:  # Optional's `type`: the element type of an empty optional
                    attrs[attr.name] = attr.tp
                    continue
                if attr.type in (attr.GRAPH, attr.GRAPHS, attr.SPARSE_TENSOR, attr.SPARSE_TENSORS, attr.TYPE_PROTOS) \
                        or attr.ref_attr_name:
                    raise UnsupportedModelError(f"{ctx_name}: attribute {attr.name!r} of this kind is not supported")
                value = helper.get_attribute_value(attr)
                if isinstance(value, bytes):
                    value = value.decode()
                elif attr.type == attr.TENSOR:
                    value = numpy_helper.to_array(value)
                elif isinstance(value, list):
                    value = [v.decode() if isinstance(v, bytes) else v for v in value]
                attrs[attr.name] = value
            inputs = list(node.input)
            while inputs and not inputs[-1]:
                inputs.pop()
            if len(inputs) < spec.min_inputs:
                raise UnsupportedModelError(f"{ctx_name}: needs at least {spec.min_inputs} inputs, has {len(inputs)}")
            if spec.subgraphs:
                attrs[OUTER] = len(outer)
                inputs += outer  # the handler gets the outer values after its declared inputs
                used.update(outer)
            outputs = list(node.output)
            ctx = NodeCtx(name, node.op_type, self.opset, since, attrs, len(outputs), [o in used for o in outputs],
                          self.device)
            ctx.run_body = self._run_body
            nodes.append(_Node(spec, ctx, inputs, outputs))
        return nodes

    def _parse_body(self, graph: Any, scope: str) -> Body:
        from onnx import numpy_helper

        consts = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
        inputs = [vi.name for vi in graph.input]
        outputs = [vi.name for vi in graph.output]
        used = set(outputs) | {i for node in graph.node for i in node.input if i}
        nodes = self._parse_nodes(graph.node, used, scope)
        defined = set(consts) | set(inputs)
        outer: list[str] = []
        for node in nodes:
            for name in node.inputs:
                if name and name not in defined and name not in outer:
                    outer.append(name)
            defined.update(o for o in node.outputs if o)
        outer.extend(o for o in outputs if o not in defined and o not in outer)
        return Body(nodes, inputs, outputs, consts, outer)

    def _run_body(self, body: Body, bound: Mapping[str, Any]) -> list[Any]:
        """Evaluate a subgraph once over `bound` (its inputs and the outer values it reads: numpy
        constants or Tensors), node by node as a plan does: all-constant nodes fold to numpy, the
        others build Tensor ops."""
        values: dict[str, Any] = dict(body.consts)
        values.update(bound)
        for node in body.nodes:
            ctx, spec = node.ctx, node.spec
            missing = [i for i in node.inputs if i and i not in values]
            if missing:
                raise ctx.error(f"input {missing[0]!r} is not produced by any earlier node, initializer or graph input")
            try:
                if all(not i or _is_const(values[i]) for i in node.inputs):
                    results: Sequence[Any] = self._fold(node, values)
                else:
                    args = [None if not i else values[i] if (pos in spec.params or spec.subgraphs)
                            else self._lift_elements(ctx, values[i]) for pos, i in enumerate(node.inputs)]
                    result = spec.fn(ctx, *args)
                    results = result if isinstance(result, tuple) else (result,)
            except UnsupportedModelError:
                raise
            except (ValueError, TypeError, IndexError, np.exceptions.AxisError) as e:
                raise ctx.error(f"{type(e).__name__}: {e}") from e
            for out, value in zip(node.outputs, results):
                if out and value is not None:
                    values[out] = value
        missing = [o for o in body.outputs if o not in values]
        if missing:
            raise UnsupportedModelError(f"subgraph output {missing[0]!r} is not produced by any node")
        return [values[o] for o in body.outputs]

    def _find_value_inputs(self) -> frozenset[str]:
        """Graph inputs whose *values* some node's static input (a shape, axes, pads, starts/ends,
        scales/sizes, split, k, repeats …) is computed from: read at call time, and part of the
        plan's and the capture's key. Walks back from each static input through the nodes that
        compute it, stopping at Shape / Size (which read only shapes). An input with more than
        `_MAX_VALUE_INPUT` elements is data, not a shape: it stays a tensor, and the node refuses —
        unless the op reads it whole (`OpSpec.data`: ImageDecoder's encoded bytes)."""
        producer = {out: node for node in self._nodes for out in node.outputs if out}
        graph_inputs = set(self.input_names)
        found: set[str] = set()
        seen: set[tuple[str, bool]] = set()
        # (name, whole): `whole` for the values an op reads whatever their size (OpSpec.data)
        stack = [(name, pos in node.spec.data) for node in self._nodes for pos, name in enumerate(node.inputs)
                 if name and pos in node.spec.static]
        while stack:
            name, whole = stack.pop()
            if (name, whole) in seen:
                continue
            seen.add((name, whole))
            if name in graph_inputs:
                shape = next(shape for n, shape, _ in self.inputs if n == name)
                if shape is not None and (whole or None in shape or math.prod(d or 0 for d in shape) <= _MAX_VALUE_INPUT):
                    found.add(name)
            node = producer.get(name)
            if node is not None and node.ctx.op_type not in _SHAPE_ONLY:
                stack.extend((i, whole) for i in node.inputs if i)
        return frozenset(found)

    @staticmethod
    def _value_type(vi: Any, what: str, required: bool = True) -> tuple[Any, Any]:
        ctx = _GraphCtx(f"{what} {vi.name!r}")
        if not vi.type.HasField("tensor_type"):  # an untyped graph output (inputs of other kinds have a Kind)
            return None, None
        tt = vi.type.tensor_type
        dtype = np_dtype_of(ctx, tt.elem_type) if (required or tt.elem_type) else None
        if not tt.HasField("shape"):
            if required:
                raise ctx.error("the rank must be known")
            return None, dtype
        dims = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in tt.shape.dim)
        return dims, dtype

    def __repr__(self) -> str:
        return f"<OnnxModel {self.graph_name!r} opset {self.opset} ({self._inputs_text()}) -> {self.output_names}>"

    def _inputs_text(self) -> str:
        return ", ".join(f"{n}: {_kind_text(self._kinds.get(n) or ('tensor', s, d))}" for n, s, d in self.inputs)

    # ---- planning ----------------------------------------------------------------------------

    def _lift_value(self, ctx: Any, name: str, array: np.ndarray) -> Tensor:
        """`array` (the constant value `name` has in this plan) as a Tensor, uploaded once per value.

        A name keeps one value for an initializer, but a value folded from shapes has one per plan:
        a ViT's class token expanded to the batch (Shape→Gather→Concat→Expand) is (1, 1, 32) at
        batch 1 and (8, 1, 32) at batch 8, so the cache is keyed on the value, not the name alone
        (keyed on the name, the batch-8 plan reused the batch-1 tensor and Concat failed)."""
        uploaded = self._lifted.setdefault(name, [])
        for value, tensor in uploaded:
            if value is array or (value.shape == array.shape and value.dtype == array.dtype and np.array_equal(value, array)):
                return tensor
        tensor = lift(ctx, array, self.device)
        uploaded.append((array, tensor))
        return tensor

    def _lift_any(self, ctx: Any, name: str, value: Any) -> Any:
        """A constant of the plan as the handlers take it: arrays as Tensors (once per value), a
        sequence element by element, the empty optional as it is."""
        if isinstance(value, list):
            return [self._lift_any(ctx, f"{name}[{k}]", v) for k, v in enumerate(value)]
        return value if value is EMPTY or isinstance(value, Tensor) else self._lift_value(ctx, name, value)

    def _lift_elements(self, ctx: Any, value: Any) -> Any:
        """As `_lift_any`, uploading each constant afresh (a body's values change per iteration)."""
        if isinstance(value, list):
            return [self._lift_elements(ctx, v) for v in value]
        return value if value is EMPTY or isinstance(value, Tensor) else lift(ctx, value, self.device)

    def _dry(self, key: Any, kind: Kind) -> Any:
        """A placeholder value of `kind` for an input's key (its shape, or its structure of shapes)."""
        return _nest(key, kind, lambda shape, dtype: Tensor.full(shape, 0, dtypes.to_dtype(dtype), self.device))

    def _key(self, shapes: tuple[tuple[int, ...], ...], values: Mapping[str, np.ndarray]) -> _Key:
        return shapes, tuple(values[name].tobytes() for name in self.input_names if name in self.value_inputs)

    def _plan(self, shapes: tuple[tuple[int, ...], ...], values: Mapping[str, np.ndarray]) -> _Plan:
        key = self._key(shapes, values)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        consts = dict(self._consts)
        slot_of: dict[str, int] = {}
        dry: list[Any] = []
        for (name, _, dtype), shape in zip(self.inputs, shapes):
            if name in self.value_inputs:
                consts[name] = values[name]
                continue
            slot_of[name] = len(dry)
            dry.append(self._dry(shape, self._kinds.get(name) or ("tensor", shape, dtype)))
        steps: list[Callable[[list[Any]], None]] = []
        for node in self._nodes:
            ctx, spec = node.ctx, node.spec
            missing = [i for i in node.inputs if i and i not in consts and i not in slot_of]
            if missing:
                raise ctx.error(f"input {missing[0]!r} is not produced by any earlier node, initializer or graph input")
            try:
                if all(not i or i in consts for i in node.inputs):
                    results = self._fold(node, consts)
                    for out, value in zip(node.outputs, results):
                        if out and value is not None:
                            consts[out] = value
                    continue
                spec_args: list[tuple[int, Any]] = []
                args: list[Any] = []
                for pos, name in enumerate(node.inputs):
                    if not name:
                        spec_args.append((-1, None))
                        args.append(None)
                    elif name in slot_of:
                        spec_args.append((slot_of[name], None))
                        args.append(dry[slot_of[name]])
                    else:
                        raw = pos in spec.params or spec.subgraphs
                        value = consts[name] if raw else self._lift_any(ctx, name, consts[name])
                        spec_args.append((-1, value))
                        args.append(value)
                results = spec.fn(ctx, *args)
            except UnsupportedModelError:
                raise
            except (ValueError, TypeError, IndexError, np.exceptions.AxisError) as e:
                raise ctx.error(f"{type(e).__name__}: {e}") from e
            multi = isinstance(results, tuple)
            results = results if multi else (results,)
            out_slots = []
            for out, value in zip(node.outputs, results):
                if _dynamic(value) and out:
                    slot_of[out] = len(dry)
                    out_slots.append(len(dry))
                    dry.append(value)
                else:
                    out_slots.append(-1)
                    if out and value is not None:
                        consts[out] = value
            if any(s >= 0 for s in out_slots):
                steps.append(_make_step(spec.fn, ctx, spec_args, out_slots, multi))
        outputs: list[tuple[int, Any]] = []
        for name, declared_shape, declared_dtype in self.outputs:
            gctx = _GraphCtx(f"graph output {name!r}")
            if name in slot_of:
                value = dry[slot_of[name]]
                outputs.append((slot_of[name], None))
            elif name in consts:
                value = consts[name] if isinstance(consts[name], list) or consts[name] is EMPTY else np.asarray(consts[name])
                outputs.append((-1, value))
            else:
                raise gctx.error("is not produced by any node")
            if name in self._kinds:
                continue  # a sequence or optional: its elements are checked as the feed's are, by the ops
            if not isinstance(value, (Tensor, np.ndarray)):
                raise gctx.error(f"computes a {'sequence' if isinstance(value, list) else 'empty optional'}, "
                                 "the graph declares a tensor")
            got_shape, got_dtype = value.shape, (value.dtype.np if isinstance(value, Tensor) else value.dtype)
            if declared_dtype is not None and got_dtype != declared_dtype:
                raise gctx.error(f"computes dtype {got_dtype}, the graph declares {declared_dtype}")
            if declared_shape is not None and (len(declared_shape) != len(got_shape) or
                                               any(d is not None and d != g for d, g in zip(declared_shape, got_shape))):
                raise gctx.error(f"computes shape {got_shape}, the graph declares {declared_shape}")
        templates = [_template(dry[slot]) if slot >= 0 else const for slot, const in outputs]
        plan = _Plan(steps, len(dry), [slot_of.get(name, -1) for name in self.input_names], outputs, templates)
        self._plans[key] = plan
        if self.value_inputs and len(self._plans) > _MAX_VALUE_PLANS:
            del self._plans[next(iter(self._plans))]
        return plan

    def _fold(self, node: _Node, consts: dict[str, np.ndarray]) -> Sequence[Any]:
        ctx, spec = node.ctx, node.spec
        values = [consts[i] if i else None for i in node.inputs]
        fold = FOLDS.get(ctx.op_type)
        if fold is not None:
            result = fold(ctx, *values)
        else:
            args = [v if (v is None or pos in spec.params or spec.subgraphs) else self._lift_elements(ctx, v)
                    for pos, v in enumerate(values)]
            result = spec.fn(ctx, *args)
        results = result if isinstance(result, tuple) else (result,)
        return [_host(r) for r in results]

    # ---- running ----------------------------------------------------------------------------

    def _check_feed(self, feed: Mapping[str, Any]) -> None:
        if not isinstance(feed, Mapping):
            raise TypeError(f"the feed must be a dict of input name -> array, got {type(feed).__name__}")
        missing = [n for n in self.input_names if n not in feed]
        extra = [n for n in feed if n not in self.input_names]
        if missing or extra:
            parts = ([f"missing input(s) {missing}"] if missing else []) + ([f"unexpected input(s) {extra}"] if extra else [])
            raise ValueError(f"{'; '.join(parts)}; the model expects {self._inputs_text()}")

    def _check_value(self, name: str, shape: tuple[int | None, ...] | None, dtype: np.dtype, got_shape: tuple[int, ...],
                     got_dtype: Any) -> None:
        if got_dtype != dtype:
            raise ValueError(f"input {name!r}: expected dtype {dtype}, got {got_dtype}")
        if shape is not None and (len(got_shape) != len(shape) or any(d is not None and d != g for d, g in zip(shape, got_shape))):
            want = "(" + ", ".join("?" if d is None else str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"
            raise ValueError(f"input {name!r}: expected shape {want}, got {tuple(got_shape)}")

    def _structured(self, name: str, kind: Kind, value: Any, tensors: bool) -> tuple[Any, Any]:
        """A sequence / optional input's key (its structure of shapes) and its value (lists of
        arrays, or of td.Tensors when `tensors`; EMPTY for None) with every element checked against
        the declared kind. A sequence is a list (or tuple) of arrays, an empty optional None, as
        onnxruntime takes them."""
        if kind[0] == "optional":
            return (("none",), EMPTY) if value is None else self._structured(name, kind[1], value, tensors)
        if kind[0] == "sequence":
            if not isinstance(value, (list, tuple)):
                raise TypeError(f"input {name!r}: expected a sequence (a list of arrays), got {type(value).__name__}")
            parts = [self._structured(f"{name}[{i}]", kind[1], v, tensors) for i, v in enumerate(value)]
            return ("seq",) + tuple(k for k, _ in parts), [v for _, v in parts]
        _, shape, dtype = kind
        if tensors:
            if not isinstance(value, Tensor):
                raise TypeError(f"input {name!r}: run_tensors takes td.Tensor values, got {type(value).__name__}")
            self._check_value(name, shape, dtype, value.shape, value.dtype.np)
            self._check_device(name, value)
            return value.shape, value
        array = self._as_array(value, dtype)
        self._check_value(name, shape, dtype, array.shape, array.dtype)
        return array.shape, array

    @staticmethod
    def _as_array(value: Any, dtype: np.dtype) -> np.ndarray:
        if isinstance(value, np.ndarray):
            return value
        array = np.asarray(value)
        return array.astype(dtype) if array.dtype != dtype and array.dtype.kind == dtype.kind else array  # Python scalars / lists

    def _check_device(self, name: str, t: Tensor) -> None:
        if t.device != self.device:
            raise ValueError(f"input {name!r} is on {t.device}, the model on {self.device}: "
                             f"move it with .to({self.device!r}), or load the model on {t.device}")

    def _run(self, shapes: tuple[Any, ...], tensors: Sequence[Any], values: Mapping[str, np.ndarray]) -> list[Any]:
        """Run the plan for these shapes and values; `tensors` in input order (a sequence input's
        a list, an empty optional's EMPTY), None for value inputs."""
        plan = self._plans.get(self._key(shapes, values)) or self._plan(shapes, values)
        env: list[Any] = [None] * plan.n_slots
        for slot, t in zip(plan.input_slots, tensors):
            if slot >= 0:
                env[slot] = t
        for step in plan.steps:
            step(env)
        return [env[slot] if slot >= 0 else const for slot, const in plan.outputs]

    def run_tensors(self, feed: Mapping[str, Any]) -> list[Any]:
        """The outputs as lazy Tensors (graph output order), built from input Tensors; nothing is realized.
        A sequence input or output is a list of Tensors, an empty optional None.

        The inputs must live on the model's device: one elsewhere would either meet the weights
        in an op that names no input ("operands are on different devices") or, in a graph that
        reaches no weight, quietly compute on its own device."""
        self._check_feed(feed)
        tensors: list[Any] = []
        shapes: list[Any] = []
        values: dict[str, np.ndarray] = {}
        for name, shape, dtype in self.inputs:
            t = feed[name]
            if name in self._kinds:
                key, value = self._structured(name, self._kinds[name], t, tensors=True)
                shapes.append(key)
                tensors.append(value)
                continue
            if not isinstance(t, Tensor):
                raise TypeError(f"input {name!r}: run_tensors takes td.Tensor values, got {type(t).__name__}")
            assert dtype is not None
            self._check_value(name, shape, dtype, t.shape, t.dtype.np)
            self._check_device(name, t)
            shapes.append(t.shape)
            if name in self.value_inputs:
                values[name] = t.numpy()  # a shape-determining value: read now, the graph is built for it
                tensors.append(None)
            else:
                tensors.append(t)
        results = self._run(tuple(shapes), tensors, values)
        return [self._output_tensors(f"\0out{i}", r) for i, r in enumerate(results)]

    def _output_tensors(self, name: str, value: Any) -> Any:
        if isinstance(value, list):
            return [self._output_tensors(f"{name}[{k}]", v) for k, v in enumerate(value)]
        if value is EMPTY:
            return None
        return value if isinstance(value, Tensor) else self._lift_value(_GraphCtx("output"), name, value)

    def __call__(self, feed: Mapping[str, Any]) -> dict[str, Any]:
        """Run on numpy inputs; returns {output name: numpy array} in the graph's output order (a
        sequence output: a list of arrays; an empty optional: None, as onnxruntime gives them).

        Each input shape's graph is captured with td.jit (on its second call) and replayed per
        frame afterwards: numpy in, one native entry point, numpy out. The arrays are passed in
        the graph's declared input order, whatever order its nodes reach them in, and uploaded to
        the model's device (the weights' device) for the calls before the capture. A sequence
        input is passed as its elements (its length and their shapes key the capture, as a
        tensor's shape does), and a sequence output is rebuilt from the tensors the capture
        returns and the constants its plan folded."""
        self._check_feed(feed)
        shapes_list: list[Any] = []
        fed: list[np.ndarray] = []
        values: dict[str, np.ndarray] = {}
        for name, shape, dtype in self.inputs:
            if name in self._kinds:
                key, value = self._structured(name, self._kinds[name], feed[name], tensors=False)
                shapes_list.append(key)
                fed.extend(_arrays(value))
                continue
            assert dtype is not None
            array = self._as_array(feed[name], dtype)
            self._check_value(name, shape, dtype, array.shape, array.dtype)
            shapes_list.append(array.shape)
            if name in self.value_inputs:
                values[name] = np.array(array, copy=True)
            else:
                fed.append(array)
        shapes = tuple(shapes_list)
        key = self._key(shapes, values)
        if key not in self._jits:
            def outputs(*tensors: Tensor) -> tuple[Tensor, ...]:
                return self._tensor_outputs(shapes, values, *tensors)
            self._jits[key] = TinyJit(outputs, threads=self.threads)
            if self.value_inputs and len(self._jits) > _MAX_VALUE_PLANS:
                del self._jits[next(iter(self._jits))]
        jitted = self._jits[key]
        if jitted is not None:
            try:
                results = iter(jitted.call_numpy(*fed, device=self.device))
            except JitError:  # e.g. every output is an input or a constant: nothing to capture
                self._jits[key] = None
            else:
                plan = self._plans.get(key) or self._plan(shapes, values)
                return {name: _fill(template, results) for name, template in zip(self.output_names, plan.templates)}
        return self._run_eagerly(shapes, self._inputs_of(shapes, [Tensor(a, self.device) for a in fed]), values)

    def _inputs_of(self, shapes: tuple[Any, ...], fed: Sequence[Tensor]) -> list[Any]:
        """The inputs in graph order from the fed tensors (a sequence's elements in turn; None
        for a value input)."""
        it = iter(fed)
        out: list[Any] = []
        for (name, _, _), shape in zip(self.inputs, shapes):
            if name in self._kinds:
                out.append(_nest(shape, self._kinds[name], lambda _shape, _dtype: next(it)))
            else:
                out.append(None if name in self.value_inputs else next(it))
        return out

    def _tensor_outputs(self, shapes: tuple[Any, ...], values: Mapping[str, np.ndarray], *fed: Tensor) -> tuple[Tensor, ...]:
        """The run-time tensors of every output, in template order (what the capture returns)."""
        return tuple(t for r in self._run(shapes, self._inputs_of(shapes, fed), values) for t in _leaves(r))

    def _run_eagerly(self, shapes: tuple[Any, ...], tensors: list[Any], values: Mapping[str, np.ndarray]) -> dict[str, Any]:
        results = self._run(shapes, tensors, values)
        leaves = [t for r in results for t in _leaves(r)]
        realize([t.node for t in leaves])
        engine = get_engine()
        copies: dict[str, list[tuple[np.ndarray, Any]]] = {}
        host: dict[int, np.ndarray] = {}
        for t in leaves:
            if id(t) in host:
                continue
            array = host[id(t)] = np.empty(t.shape, t.dtype.np)
            if array.size:
                copies.setdefault(t.device, []).append((array, t.node.buffer))
        completions = []
        for device_name, items in copies.items():
            device = engine.device(device_name)
            batch = device.batch("copy")
            for array, buffer in items:
                batch.read_to_host(array.reshape(-1).view(np.uint8), buffer)
            completions.append(batch.submit())
        for completion in completions:
            completion.wait_blocking()

        def to_host(value: Any) -> Any:
            if isinstance(value, Tensor):
                return host[id(value)]
            if isinstance(value, list):
                return [to_host(v) for v in value]
            return None if value is EMPTY else np.array(value, copy=True)
        return {name: to_host(r) for name, r in zip(self.output_names, results)}


def intra_op_threads(threads: int | None) -> int:
    """The threads a model's frames run on: `threads`, or by default this process's CPUs (as
    onnxruntime's default intra-op pool takes the machine's cores)."""
    if threads is None:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"threads must be a positive int (1: the calling thread alone) or None "
                         f"(this machine's CPUs), got {threads!r}")
    return threads


def load(model: Any, device: str = "CPU", threads: int | None = None) -> OnnxModel:
    """Load an ONNX model (a path, bytes, or an `onnx.ModelProto`) for inference on `device`.

    Each frame's big kernels (matmuls, convolutions, large elementwise ops) are split across
    `threads` threads — the caller's and the engine's own intra-op workers — by default as many
    as this process may run on; `threads=1` runs every frame on the calling thread alone.

    Raises `UnsupportedModelError` (a ValueError) naming the node, op type and opset for anything
    tinydist cannot run exactly, and `ModelLoadError` naming the file for one that is no ONNX model
    at all; needs the optional `onnx` package (pip install 'tinydist[onnx]')."""
    try:
        import onnx
        from onnx import helper, numpy_helper  # noqa: F401  (a bare namespace package named onnx is not enough)
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("tinydist.onnx needs the optional 'onnx' package: pip install 'tinydist[onnx]'") from e
    from google.protobuf.message import DecodeError

    try:
        if isinstance(model, (str, os.PathLike)):
            proto = onnx.load(os.fspath(model))
        elif isinstance(model, (bytes, bytearray)):
            proto = onnx.load_from_string(bytes(model))
        elif isinstance(model, onnx.ModelProto):
            proto = model
        else:
            raise TypeError(f"load() takes a path, bytes or onnx.ModelProto, got {type(model).__name__}")
    except DecodeError as exc:
        source = repr(os.fspath(model)) if isinstance(model, (str, os.PathLike)) else f"the {len(model)} bytes given"
        raise ModelLoadError(f"{source} is not an ONNX model ({exc}); check that it is a complete .onnx export, "
                             "not truncated and not another format") from exc
    return OnnxModel(proto, device, threads)
