"""Reduce ops: the one vocabulary for how values combine, wherever they are combined.

A reduction (`Tensor.sum`, an allreduce inside one process, a process-group collective, a compiled
host reduce kernel) names its op with a `ReduceOp`. Each op says, once, how two values combine:

    graph     `binary`: the elementwise graph op that combines two partials, by the name
              `tinydist.graph.lazy.Op` and the kernel IR give it ("add", "mul", "max", "min")
    numpy     `ufunc`: the numpy ufunc (np.add, ...), what the process collectives reduce with
    kernel    `llvm(kind)`: the LLVM instruction of a compiled host reduce (tinydist.codegen.reduce),
              or None where numpy's rules are kept (float max/min: numpy's NaN and signed-zero
              handling differs between its own scalar and SIMD loops)

`mean` is not a reduce op but a collective one (tinydist.dist, scheduler.execute): a sum divided
by the number of contributions; `collective_op` parses both.

`ReduceOp` is a `str` enum, so `ReduceOp.SUM == "sum"` and an op travels in JSON headers and
cache keys as its plain name. The module imports nothing of tinydist: the graph, the code generator
and the collectives all sit above it.
"""

from __future__ import annotations

import enum

import numpy as np


class ReduceOp(str, enum.Enum):
    SUM = "sum"
    PROD = "prod"
    MAX = "max"
    MIN = "min"

    def __str__(self) -> str:
        return self.value

    @property
    def binary(self) -> str:
        """The elementwise op combining two partial results: `tinydist.graph.lazy.Op(op.binary)`, or as
        the kernel IR names it (`KNode.op`)."""
        return _BINARY[self]

    @property
    def ufunc(self) -> np.ufunc:
        """The numpy ufunc that combines two arrays (in argument order, as the kernels do)."""
        return _UFUNC[self]

    def llvm(self, kind: str) -> str | None:
        """The LLVM combine for numpy dtype kind `kind` ('f', 'i', 'u'): an arithmetic instruction
        (`fadd`, `mul`, ...) or an `icmp` predicate whose winner is selected (`sgt`, `ult`, ...);
        None where the op is not compiled for that kind (float max/min stay with numpy)."""
        return _LLVM.get((self, kind))


_BINARY = {ReduceOp.SUM: "add", ReduceOp.PROD: "mul", ReduceOp.MAX: "max", ReduceOp.MIN: "min"}
_UFUNC: dict[ReduceOp, np.ufunc] = {ReduceOp.SUM: np.add, ReduceOp.PROD: np.multiply, ReduceOp.MAX: np.maximum,
                                    ReduceOp.MIN: np.minimum}
_LLVM = {(ReduceOp.SUM, "f"): "fadd", (ReduceOp.SUM, "i"): "add", (ReduceOp.SUM, "u"): "add",
         (ReduceOp.PROD, "f"): "fmul", (ReduceOp.PROD, "i"): "mul", (ReduceOp.PROD, "u"): "mul",
         (ReduceOp.MAX, "i"): "sgt", (ReduceOp.MAX, "u"): "ugt", (ReduceOp.MIN, "i"): "slt", (ReduceOp.MIN, "u"): "ult"}

REDUCE_OPS: tuple[str, ...] = tuple(op.value for op in ReduceOp)
MEAN = "mean"
COLLECTIVE_OPS: tuple[str, ...] = (*REDUCE_OPS, MEAN)


# By name, for the collectives' per-call parse: a dict lookup, where `ReduceOp(name)` runs enum's
# __call__ and __new__ in Python (measured: 2 Python calls, 66 bytecodes of a 4 KiB allreduce's ~1,600).
_BY_NAME: dict[str, ReduceOp] = {op.value: op for op in ReduceOp}
_COLLECTIVE: dict[str, ReduceOp] = {**_BY_NAME, MEAN: ReduceOp.SUM}


def reduce_op(name: str) -> ReduceOp:
    """`name` as a ReduceOp; a ValueError naming the choices for anything else."""
    op = _BY_NAME.get(name) if isinstance(name, str) else None
    if op is None:
        raise ValueError(f"unknown reduce op {name!r}; choose one of {', '.join(REDUCE_OPS)}")
    return op


def collective_op(name: str) -> ReduceOp:
    """The reduce op a collective `name` combines with: `mean` sums (its caller divides)."""
    op = _COLLECTIVE.get(name) if isinstance(name, str) else None
    if op is None:
        raise ValueError(f"unknown op {name!r}; expected one of {', '.join(COLLECTIVE_OPS)}")
    return op
