"""TfIdfVectorizer (9) over integer token ids, as Tensor compares and sums over static shapes."""

from __future__ import annotations

from typing import Any

import numpy as np

from tinydist.frontend.tensor import Tensor
from tinydist.graph import dtypes


def _pool_ngrams(ctx: Any) -> list[tuple[int, np.ndarray, np.ndarray, slice]]:
    """The pool's n-grams of each length in [min_gram_length, max_gram_length]: (n, (P, n) tokens,
    their output columns, their ids' range), from pool_int64s split by ngram_counts (the start of
    each length's run)."""
    if ctx.has_attr("pool_strings"):
        raise ctx.error("pool_strings is not supported (string tensors are not supported); use pool_int64s")
    pool = np.asarray(ctx.attr("pool_int64s"), np.int64)
    counts = list(ctx.attr("ngram_counts"))
    indexes = np.asarray(ctx.attr("ngram_indexes"), np.int64)
    lo, hi = ctx.attr("min_gram_length"), ctx.attr("max_gram_length")
    if not 1 <= lo <= hi:
        raise ctx.error(f"min_gram_length {lo} / max_gram_length {hi} must satisfy 1 <= min <= max")
    groups, first_id = [], 0
    for n, start in enumerate(counts, 1):
        end = counts[n] if n < len(counts) else len(pool)
        grams = pool[start:end]
        if len(grams) % n:
            raise ctx.error(f"the {len(grams)} pool items of {n}-grams (ngram_counts {counts}) are not a multiple of {n}")
        number = len(grams) // n
        if number and lo <= n <= hi:
            ids = slice(first_id, first_id + number)
            groups.append((n, grams.reshape(number, n), indexes[ids], ids))
        first_id += number
    if first_id != len(indexes):
        raise ctx.error(f"ngram_indexes has {len(indexes)} entries, the pool {first_id} n-grams")
    return groups


def op_tfidf_vectorizer(ctx: Any, x: Tensor) -> Tensor:
    """TfIdfVectorizer as onnx's reference counts: an n-gram of n >= 2 tokens is counted at every
    start and every skip distance 1 … max_skip_count + 1 (its tokens that far apart), a unigram
    once per occurrence. Per n-gram length and distance: the row's shifted windows compared with
    every pool n-gram, ANDed over the n tokens and summed over the start. mode TF gives the counts,
    IDF the n-gram's weight where its count is nonzero (1 without weights), TFIDF weight · count;
    the weights are the pool n-grams' (in pool order, as the spec and onnxruntime read them), and
    one matmul with a 0/1 matrix adds them into the output columns."""
    if x.dtype.is_float or x.dtype.is_bool:
        raise ctx.error(f"input dtype {x.dtype.name} is not supported (int32 / int64 token ids)")
    if x.ndim not in (1, 2):
        raise ctx.error(f"input must be [C] or [B, C], got shape {x.shape}")
    mode = ctx.attr("mode")
    if mode not in ("TF", "IDF", "TFIDF"):
        raise ctx.error(f"mode={mode!r} is not supported (TF, IDF, TFIDF)")
    rows = x.reshape(1, -1) if x.ndim == 1 else x
    b, c = rows.shape
    rows = rows.cast(dtypes.int64)
    size = int(np.max(ctx.attr("ngram_indexes"))) + 1
    skips = ctx.attr("max_skip_count", 0) + 1
    weights = np.asarray(ctx.attr("weights", []), np.float32)
    groups = _pool_ngrams(ctx)
    if weights.size and weights.size != len(ctx.attr("ngram_indexes")):
        raise ctx.error(f"weights has {weights.size} entries, the pool {len(ctx.attr('ngram_indexes'))} n-grams")
    total: Tensor | None = None
    for n, grams, columns, ids in groups:
        scatter = np.zeros((len(grams), size), np.float32)
        np.add.at(scatter, (np.arange(len(grams)), columns), 1.0)
        counts: Tensor | None = None
        for d in range(1, (skips if n > 1 else 1) + 1):
            starts = c - (n - 1) * d
            if starts <= 0:
                break
            match: Tensor | None = None
            for j in range(n):
                token = ctx.lift(("gram", n, j), np.ascontiguousarray(grams[:, j]).reshape(1, 1, -1))
                hit = rows.shrink([(0, b), (j * d, j * d + starts)]).reshape(b, starts, 1) == token
                match = hit if match is None else match & hit
            assert match is not None
            found = match.cast(dtypes.float32).sum(1)                       # (B, P)
            counts = found if counts is None else counts + found
        if counts is not None:
            if mode == "IDF":
                counts = (counts > 0).cast(dtypes.float32)
            if mode != "TF" and weights.size:
                counts = counts * ctx.lift(("weights", n), weights[ids].reshape(1, -1))
            part = counts.matmul(ctx.lift(("scatter", n), scatter))
            total = part if total is None else total + part
    y = total if total is not None else Tensor.zeros((b, size), dtype=dtypes.float32, device=x.device)
    return y.reshape(size) if x.ndim == 1 else y
