"""The kernel IR: what the scheduler hands to code generation.

A kernel computes one output buffer (contiguous, `out_shape`) from input buffer slots (an
elementwise kernel may store the same values into several: `outputs`). Its
expression tree has at most one `reduce`: nodes below it are evaluated over the full iteration
`shape`, nodes above it over the output shape (the reduced axes have size 1 there). Loads carry a
ShapeTracker mapping the iteration index to an element of their slot's buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tinydist.base.walk import postorder
from tinydist.graph.dtypes import DType
from tinydist.graph.shape import Shape, ShapeTracker


@dataclass(frozen=True, eq=False)
class KNode:
    op: str                      # "load", "const", "reduce", or an elementwise op name ("add", "exp", "cast" …)
    srcs: tuple[KNode, ...]
    arg: Any                     # load: (slot, ShapeTracker); const: value; reduce: "sum"/"max"/"min"/"prod"
    dtype: DType
    _hash: int = field(default=0, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.op, self.srcs, self.arg, self.dtype)))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        """Structural equality, as a dataclass's (fields compared as in a tuple: identity, then
        ==), but iterative: a fused chain of 100,000 ops is a tree that deep. Pairs already found
        equal are not compared again, so shared subtrees cost once."""
        if not isinstance(other, KNode):
            return NotImplemented
        pending, equal = [(self, other)], set()
        while pending:
            a, b = pending.pop()
            if a is b or (id(a), id(b)) in equal:
                continue
            if (a._hash != b._hash or len(a.srcs) != len(b.srcs)
                    or not all(x is y or x == y for x, y in ((a.op, b.op), (a.arg, b.arg), (a.dtype, b.dtype)))):
                return False
            equal.add((id(a), id(b)))  # provisional: any unequal pair below ends the whole comparison
            pending.extend(zip(a.srcs, b.srcs))
        return True

    def walk(self) -> list[KNode]:
        """Every node once, sources before users (depth-first post-order)."""
        return postorder((self,), lambda node: node.srcs)


def short_dtype(dtype: DType) -> str:
    """`f32`, `i64`, `u8`, `bool`: numpy's kind and the width in bits."""
    return "bool" if dtype.kind == "b" else f"{dtype.kind}{dtype.itemsize * 8}"


def load(slot: int, tracker: ShapeTracker, dtype: DType) -> KNode:
    return KNode("load", (), (slot, tracker), dtype)


def const(value: Any, dtype: DType) -> KNode:
    return KNode("const", (), value, dtype)


@dataclass(frozen=True)
class KernelAST:
    shape: Shape                         # iteration space
    reduce_axes: tuple[int, ...]         # axes of `shape` that are reduced
    root: KNode                          # the value stored at each output index
    slot_dtypes: tuple[DType, ...]       # input slots' element types
    out_dtype: DType
    aliased_slots: tuple[int, ...] = ()  # input slots that are the output buffer itself (in-place assign)
    outputs: int = 1                     # buffers each receiving the value (an elementwise kernel's copies)
    stream_stores: bool = False          # non-temporal stores at any size: the scheduler knows no one re-reads them soon

    def __post_init__(self) -> None:
        if self.outputs > 1 and self.reduce_axes:
            raise ValueError("a kernel with a reduce writes one output")

    @property
    def out_shape(self) -> Shape:
        return tuple(1 if axis in self.reduce_axes else size for axis, size in enumerate(self.shape))

    def label(self) -> str:
        """A name for people (traces, profiles): the ops in evaluation order, the iteration shape
        (→ the output shape where it reduces) and the output dtype, e.g. `mul+add+max 64x384 f32`
        or `exp+sum 8x128→8x1 f32`. The symbol stays the IR's hash (`lowering.lower`)."""
        ops = dict.fromkeys(node.arg if node.op == "reduce" else node.op for node in self.root.walk()
                            if node.op not in ("load", "const"))
        shape = "x".join(map(str, self.shape)) or "1"
        if self.reduce_axes:
            shape += "→" + ("x".join(map(str, self.out_shape)) or "1")
        return f"{'+'.join(ops) or 'copy'} {shape} {short_dtype(self.out_dtype)}"

    def source(self) -> str | None:
        """A text naming this kernel exactly, for the compile cache's generated key (equal text,
        equal IR: every field, and the tree node by node, iteratively: a fused chain may be
        100,000 deep); None when an argument has no exact text (the IR is then the key)."""
        nodes = self.root.walk()
        if not all(_exact(node.arg) for node in nodes):
            return None
        number = {id(node): i for i, node in enumerate(nodes)}
        head = repr((self.shape, self.reduce_axes, self.slot_dtypes, self.out_dtype, self.aliased_slots,
                     self.outputs, self.stream_stores))
        return "\n".join([head, *(f"{node.op} {node.dtype!r} {[number[id(src)] for src in node.srcs]} {node.arg!r}"
                                   for node in nodes)])

    def describe(self) -> str:
        ops = sorted({node.op for node in self.root.walk() if node.op not in ("load", "const")})
        reduce = f" reduce{list(self.reduce_axes)}" if self.reduce_axes else ""
        return f"{self.out_dtype.name}{list(self.out_shape)} <- {'+'.join(ops) or 'copy'}{reduce} over {list(self.shape)}"


def _exact(arg: Any) -> bool:
    """Whether repr(arg) determines arg (no numpy array: its repr elides elements)."""
    if isinstance(arg, tuple):
        return all(_exact(item) for item in arg)
    return arg is None or isinstance(arg, (str, int, float, bool, np.generic, DType, ShapeTracker))
