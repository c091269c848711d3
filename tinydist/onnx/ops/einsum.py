"""Einsum (opset 12, 28): an equation mapped onto diagonal selects, one broadcast product and a sum.

Each operand's repeated labels (a diagonal, `ii->i`) are taken with an identity-mask select and
a sum over one of the pair; the operands are then laid out on one shared label order, multiplied
with broadcasting and summed over the labels the output drops. Two operands that contract labels
go through `matmul` instead (the native kernel, not an (M, K, N) product in memory).
"""

from __future__ import annotations

import math
import string
from typing import Any

import numpy as np

from tinydist.frontend.tensor import Tensor

_ELLIPSIS_LABELS = string.ascii_uppercase[::-1]  # stand-ins for the dims under "...", unlikely in equations


def _parse(ctx: Any, equation: str, operands: list[Tensor]) -> tuple[list[str], str]:
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(operands):
        raise ctx.error(f"equation {equation!r} names {len(terms)} operands, the node has {len(operands)}")
    letters = set(eq) - set(".,->")
    if any(not c.isalpha() for c in letters):
        raise ctx.error(f"equation {equation!r} has a label that is not a letter")
    width = 0
    for term, x in zip(terms, operands):
        if "..." in term:
            width = max(width, x.ndim - (len(term) - 3))
    free = [c for c in _ELLIPSIS_LABELS if c not in letters][:width]
    expanded = []
    for term, x in zip(terms, operands):
        if "..." in term:
            n = x.ndim - (len(term) - 3)
            term = term.replace("...", "".join(free[width - n:]))
        if len(term) != x.ndim:
            raise ctx.error(f"term {term!r} of {equation!r} does not match operand shape {x.shape}")
        expanded.append(term)
    if arrow:
        out = rhs.replace("...", "".join(free))
    else:  # implicit output: the "..." dims, then the labels used once, alphabetically
        counts = {c: "".join(expanded).count(c) for c in letters}
        out = "".join(free) + "".join(sorted(c for c in letters if counts[c] == 1))
    if len(set(out)) != len(out) or any(c not in "".join(expanded) for c in out):
        raise ctx.error(f"output {rhs!r} of {equation!r} repeats a label or names one no operand has")
    return expanded, out


def _diagonals(ctx: Any, x: Tensor, term: str) -> tuple[Tensor, str]:
    while len(set(term)) != len(term):
        label = next(c for c in term if term.count(c) > 1)
        a = term.index(label)
        b = term.index(label, a + 1)
        if x.shape[a] != x.shape[b]:
            raise ctx.error(f"label {label!r} has sizes {x.shape[a]} and {x.shape[b]}")
        n = x.shape[a]
        eye_shape = [1] * x.ndim
        eye_shape[a] = eye_shape[b] = n
        eye = ctx.lift(("eye", n, x.ndim, a, b), np.eye(n, dtype=bool).reshape(eye_shape))
        x = eye.where(x, 0).sum(b, dtype=x.dtype)
        term = term[:b] + term[b + 1:]
    return x, term


def _sum_out(x: Tensor, term: str, keep: str) -> tuple[Tensor, str]:
    axes = [i for i, c in enumerate(term) if c not in keep]
    if axes:
        x = x.sum(axes, dtype=x.dtype)
    return x, "".join(c for c in term if c in keep)


def op_einsum(ctx: Any, *operands: Tensor) -> Tensor:
    terms, out = _parse(ctx, ctx.attr("equation"), list(operands))
    pieces = []
    for i, (x, term) in enumerate(zip(operands, terms)):
        x, term = _diagonals(ctx, x, term)
        elsewhere = out + "".join(t for j, t in enumerate(terms) if j != i)
        pieces.append(_sum_out(x, term, elsewhere))  # labels only this operand has: summed at once
    sizes: dict[str, int] = {}
    for x, term in pieces:
        for c, s in zip(term, x.shape):
            if sizes.setdefault(c, s) != s and 1 not in (s, sizes[c]):
                raise ctx.error(f"label {c!r} has sizes {sizes[c]} and {s}")
            sizes[c] = max(sizes[c], s)
    if len(pieces) == 2 and pieces[0][0].dtype.is_float:
        return _matmul_pair(pieces, out, sizes)
    order = out + "".join(sorted(set(sizes) - set(out)))
    product: Tensor | None = None
    for x, term in pieces:
        x = x.permute(tuple(term.index(c) for c in order if c in term)) if term else x
        present = [c for c in order if c in term]
        x = x.reshape(tuple(x.shape[present.index(c)] if c in term else 1 for c in order))
        product = x if product is None else product * x
    assert product is not None
    result, _ = _sum_out(product, order, out)
    return result


def _matmul_pair(pieces: list[tuple[Tensor, str]], out: str, sizes: dict[str, int]) -> Tensor:
    """(batch, M, K) @ (batch, K, N): batch labels in both and the output, K in both only."""
    (a, ta), (b, tb) = pieces
    batch = [c for c in out if c in ta and c in tb]
    m = [c for c in ta if c not in tb]
    n = [c for c in tb if c not in ta]
    k = [c for c in ta if c in tb and c not in out]
    full = batch + m + n

    def lay(x: Tensor, term: str, rows: list[str], cols: list[str]) -> Tensor:
        want = batch + rows + cols
        present = [c for c in want if c in term]
        x = x.permute(tuple(term.index(c) for c in present)) if term else x
        shape = [x.shape[present.index(c)] if c in term else 1 for c in want]
        x = x.reshape(tuple(shape)).expand(tuple(sizes[c] if c in batch else s for c, s in zip(want, shape)))
        return x.reshape(math.prod(sizes[c] for c in batch), math.prod(sizes[c] for c in rows),
                         math.prod(sizes[c] for c in cols))

    y = lay(a, ta, m, k).matmul(lay(b, tb, k, n)).reshape(tuple(sizes[c] for c in full))
    return y.permute(tuple(full.index(c) for c in out)) if full else y
