"""Loading an ONNX model into a plan of closures over td.Tensor ops, and running it.

Load: parse the protobuf (here and in `parse`, the only places `onnx` is imported), check every
node's domain, op type and attributes, upload initializers, then *plan* for the inputs' static
shapes: walk the nodes once over placeholder tensors (lazy constants: nothing is computed or
allocated), folding every node whose inputs are constant (or depend only on shapes) into numpy
values, and turning each remaining node into one closure `step(env)` over a flat list of value
slots. Inputs with symbolic dimensions get a plan per distinct set of shapes, made on the first
call that uses it.

Call: validate the feed, upload it, run the closures (building one lazy graph), realize all
outputs together (one schedule), read them back with one copy batch per device.

The parts it is built from, each below it: `kinds` (a value's type; ONNX element types as numpy
dtypes), `node` (what a handler sees of its node; subgraph bodies), `parse` (nodes checked against
the op table), `values` (constants lifted, outputs' templates), `plan` (the closures over slots)
and `ops` (the handlers).
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
from tinydist.onnx.kinds import GraphCtx, Kind, kind_of, kind_text, value_type
from tinydist.onnx.node import Body, Node
from tinydist.onnx.ops import DOMAIN_OPS, FOLDS
from tinydist.onnx.ops._common import EMPTY
from tinydist.onnx.parse import NodeParser
from tinydist.onnx.plan import Plan, make_step
from tinydist.onnx.values import arrays, dynamic, fill, host, is_const, leaves, lift, nest, template
from tinydist.runtime.engine import get_engine
from tinydist.runtime.registry import canonical_name

# Default-domain opsets from 1 to the installed onnx's newest: below 7 (onnxruntime's oldest) a
# model loads when each node's op version there is one implemented (Not-1, Abs-6 …), and is
# refused by node otherwise, like any version not implemented.
MIN_OPSET = 1
_MAX_VALUE_INPUT = 64  # elements: shape vectors, axes, pads, scales are a handful
# plans (and captures) kept per model when value inputs key them, the oldest dropped first: a
# value input that changes every call (an ImageDecoder's encoded bytes) would otherwise keep one each
_MAX_VALUE_PLANS = 32
# ops that read only their input's shape (or a sequence's length), never its values
_SHAPE_ONLY = frozenset({"Shape", "Size", "SequenceLength"})
# input shapes (a sequence input's: ("seq", element shapes...); an empty optional's: ("none",)),
# values of the value inputs
_Key = tuple[tuple[Any, ...], tuple[bytes, ...]]


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
                self._kinds[vi.name] = kind_of(vi.type, f"graph input {vi.name!r}")
                self.inputs.append((vi.name, None, None))
            else:
                self.inputs.append((vi.name, *value_type(vi, "graph input")))
        self.outputs: list[tuple[str, tuple[int | None, ...] | None, np.dtype | None]] = []
        for vi in graph.output:
            if vi.type.WhichOneof("value") not in (None, "tensor_type"):  # an untyped output takes what the graph computes
                self._kinds[vi.name] = kind_of(vi.type, f"graph output {vi.name!r}")
                self.outputs.append((vi.name, None, None))
                continue
            shape, dtype = value_type(vi, "graph output", required=False)
            self.outputs.append((vi.name, shape, dtype))
        self.input_names = [name for name, _, _ in self.inputs]
        self.output_names = [name for name, _, _ in self.outputs]

        used: set[str] = {name for name in self.output_names}
        for node in graph.node:
            used.update(i for i in node.input if i)
        self._nodes = NodeParser(self.opset, opsets, self.device, self._run_body).nodes(graph.node, used, "")
        self.value_inputs = self._find_value_inputs()
        self._plans: dict[_Key, Plan] = {}
        # per input shapes (and values of value inputs): the graph captured once and replayed per
        # frame (None: nothing to capture)
        self._jits: dict[_Key, TinyJit | None] = {}
        # constant values uploaded once, per name and value (see _lift_value)
        self._lifted: dict[str, list[tuple[np.ndarray, Tensor]]] = {}
        if all(shape is not None and None not in shape for _, shape, _ in self.inputs) and not self.value_inputs:
            self._plan(tuple(tuple(shape) for _, shape, _ in self.inputs), {})  # type: ignore[arg-type]

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
                if all(not i or is_const(values[i]) for i in node.inputs):
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

    def __repr__(self) -> str:
        return f"<OnnxModel {self.graph_name!r} opset {self.opset} ({self._inputs_text()}) -> {self.output_names}>"

    def _inputs_text(self) -> str:
        return ", ".join(f"{n}: {kind_text(self._kinds.get(n) or ('tensor', s, d))}" for n, s, d in self.inputs)

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
        return nest(key, kind, lambda shape, dtype: Tensor.full(shape, 0, dtypes.to_dtype(dtype), self.device))

    def _key(self, shapes: tuple[tuple[int, ...], ...], values: Mapping[str, np.ndarray]) -> _Key:
        return shapes, tuple(values[name].tobytes() for name in self.input_names if name in self.value_inputs)

    def _plan(self, shapes: tuple[tuple[int, ...], ...], values: Mapping[str, np.ndarray]) -> Plan:
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
                if dynamic(value) and out:
                    slot_of[out] = len(dry)
                    out_slots.append(len(dry))
                    dry.append(value)
                else:
                    out_slots.append(-1)
                    if out and value is not None:
                        consts[out] = value
            if any(s >= 0 for s in out_slots):
                steps.append(make_step(spec.fn, ctx, spec_args, out_slots, multi))
        outputs: list[tuple[int, Any]] = []
        for name, declared_shape, declared_dtype in self.outputs:
            gctx = GraphCtx(f"graph output {name!r}")
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
        templates = [template(dry[slot]) if slot >= 0 else const for slot, const in outputs]
        plan = Plan(steps, len(dry), [slot_of.get(name, -1) for name in self.input_names], outputs, templates)
        self._plans[key] = plan
        if self.value_inputs and len(self._plans) > _MAX_VALUE_PLANS:
            del self._plans[next(iter(self._plans))]
        return plan

    def _fold(self, node: Node, consts: dict[str, np.ndarray]) -> Sequence[Any]:
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
        return [host(r) for r in results]

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
        return value if isinstance(value, Tensor) else self._lift_value(GraphCtx("output"), name, value)

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
                fed.extend(arrays(value))
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
                return {name: fill(tmpl, results) for name, tmpl in zip(self.output_names, plan.templates)}
        return self._run_eagerly(shapes, self._inputs_of(shapes, [Tensor(a, self.device) for a in fed]), values)

    def _inputs_of(self, shapes: tuple[Any, ...], fed: Sequence[Tensor]) -> list[Any]:
        """The inputs in graph order from the fed tensors (a sequence's elements in turn; None
        for a value input)."""
        it = iter(fed)
        out: list[Any] = []
        for (name, _, _), shape in zip(self.inputs, shapes):
            if name in self._kinds:
                out.append(nest(shape, self._kinds[name], lambda _shape, _dtype: next(it)))
            else:
                out.append(None if name in self.value_inputs else next(it))
        return out

    def _tensor_outputs(self, shapes: tuple[Any, ...], values: Mapping[str, np.ndarray], *fed: Tensor) -> tuple[Tensor, ...]:
        """The run-time tensors of every output, in template order (what the capture returns)."""
        return tuple(t for r in self._run(shapes, self._inputs_of(shapes, fed), values) for t in leaves(r))

    def _run_eagerly(self, shapes: tuple[Any, ...], tensors: list[Any], values: Mapping[str, np.ndarray]) -> dict[str, Any]:
        results = self._run(shapes, tensors, values)
        outs = [t for r in results for t in leaves(r)]
        realize([t.node for t in outs])
        engine = get_engine()
        copies: dict[str, list[tuple[np.ndarray, Any]]] = {}
        on_host: dict[int, np.ndarray] = {}
        for t in outs:
            if id(t) in on_host:
                continue
            array = on_host[id(t)] = np.empty(t.shape, t.dtype.np)
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
                return on_host[id(value)]
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
