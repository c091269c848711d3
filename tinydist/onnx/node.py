"""A parsed node and what its handler sees of it: `NodeCtx` (attributes, opset, output use, a
per-node cache), `Node` (the handler's spec, its context and its value names), `Body` (a parsed
subgraph of If / Loop / Scan), and the schema version a node's semantics follow."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from tinydist.frontend.tensor import Tensor
from tinydist.graph import dtypes
from tinydist.onnx.errors import UnsupportedModelError
from tinydist.onnx.kinds import np_dtype_of
from tinydist.onnx.values import lift

_REQUIRED = object()


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


def since_version(defs: Any, op_type: str, opset: int, domain: str = "") -> int | None:
    """The since_version of `op_type`'s schema in `domain` at `opset` (None: no such op there)."""
    try:
        return int(defs.get_schema(op_type, opset, domain).since_version)
    except defs.SchemaError:
        return None


class Body:
    """A parsed subgraph: its nodes, input and output names, initializers, and the outer-scope
    names it reads (from the graph around it)."""

    __slots__ = ("nodes", "inputs", "outputs", "consts", "outer")

    def __init__(self, nodes: list[Any], inputs: list[str], outputs: list[str], consts: dict[str, np.ndarray],
                 outer: list[str]) -> None:
        self.nodes, self.inputs, self.outputs, self.consts, self.outer = nodes, inputs, outputs, consts, outer


class Node:
    """A checked node of a graph: its handler's spec (`ops.OpSpec`), context, input and output names."""

    __slots__ = ("spec", "ctx", "inputs", "outputs")

    def __init__(self, spec: Any, ctx: NodeCtx, inputs: list[str], outputs: list[str]) -> None:
        self.spec, self.ctx, self.inputs, self.outputs = spec, ctx, inputs, outputs
