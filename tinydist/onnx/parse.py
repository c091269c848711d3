"""Checking and preparing a graph's nodes: each node's domain, op type, schema version and
attributes against the op table (`ops.OPS`, `ops.DOMAIN_OPS`) at the model's opsets; attribute
values decoded from the protobuf; a subgraph attribute (If's branches, Loop's and Scan's body)
parsed into a `Body` whose outer-scope names become extra inputs of its node."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from tinydist.onnx.errors import UnsupportedModelError
from tinydist.onnx.node import Body, Node, NodeCtx, since_version
from tinydist.onnx.ops import DOMAIN_OPS, OPS
from tinydist.onnx.ops._common import OUTER


class NodeParser:
    """Parses the nodes of one model: its default-domain `opset`, every domain's version in
    `opsets`, the `device` its constants go to, and `run_body`, which evaluates a subgraph
    (set on every node's context for If / Loop / Scan)."""

    def __init__(self, opset: int, opsets: Mapping[str, int], device: str,
                 run_body: Callable[[Body, Mapping[str, Any]], list[Any]]) -> None:
        self.opset, self.opsets, self.device, self.run_body = opset, opsets, device, run_body

    def nodes(self, graph_nodes: Any, used: set[str], scope: str) -> list[Node]:
        """Check and prepare the nodes of a graph (`scope`: "" for the model's, a prefix for the
        node names of a subgraph); a subgraph attribute (If's branches, Loop's and Scan's body)
        becomes a `Body`, and the outer-scope names it reads become extra inputs of its node."""
        from onnx import defs, helper, numpy_helper

        nodes: list[Node] = []
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
                since = since_version(defs, node.op_type, self.opset)
            else:
                ctx_name = f"node {name!r} ({node.op_type}, {domain} opset {self.opsets.get(domain, 0)})"
                since = since_version(defs, node.op_type, self.opsets.get(domain, 0), domain)
            at = self.opset if domain == "ai.onnx" else self.opsets.get(domain, 0)
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
                    body = self.body(attr.g, f"{name}/{attr.name}/")
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
            ctx.run_body = self.run_body
            nodes.append(Node(spec, ctx, inputs, outputs))
        return nodes

    def body(self, graph: Any, scope: str) -> Body:
        from onnx import numpy_helper

        consts = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
        inputs = [vi.name for vi in graph.input]
        outputs = [vi.name for vi in graph.output]
        used = set(outputs) | {i for node in graph.node for i in node.input if i}
        nodes = self.nodes(graph.node, used, scope)
        defined = set(consts) | set(inputs)
        outer: list[str] = []
        for node in nodes:
            for name in node.inputs:
                if name and name not in defined and name not in outer:
                    outer.append(name)
            defined.update(o for o in node.outputs if o)
        outer.extend(o for o in outputs if o not in defined and o not in outer)
        return Body(nodes, inputs, outputs, consts, outer)
