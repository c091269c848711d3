"""Attention (opset 23, 24, 25), RotaryEmbedding (23), LinearAttention (27) and FlexAttention
(ai.onnx.preview 1), composed from Tensor matmul, softmax and where.

Attention follows onnx's reference (onnx/reference/ops/op_attention.py), the source of the node
suite's expected values: Q and K are each scaled by sqrt(scale) before QK^T; masks become an
additive bias of 0 / -inf (select, never multiply, so -inf never meets 0); causal masking is
bottom-right aligned (query i sees key j <= i + offset, offset = past length or
nonpad_kv_seqlen - q_len); a row whose bias is -inf everywhere yields zero probabilities, not NaN.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tinydist.frontend.movement import cat
from tinydist.frontend.tensor import Tensor
from tinydist.graph import dtypes
from tinydist.onnx.ops._common import Value, as_tensor, gather_where, require_float
from tinydist.onnx.ops.control import _run, _split_outer

NEG_INF = float("-inf")


def _heads(x: Tensor, heads: int) -> Tensor:
    """(B, S, H·D) → (B, H, S, D)."""
    b, s, hidden = x.shape
    return x.reshape(b, s, heads, hidden // heads).permute(0, 2, 1, 3)


def _mask_bias(ctx: Any, mask: Tensor, kv_len: int, dtype: Any) -> Tensor:
    """attn_mask as an additive bias of `dtype`, padded along the key axis to kv_len (False / -inf)."""
    short = kv_len - mask.shape[-1]
    if short < 0:
        raise ctx.error(f"attn_mask's last axis {mask.shape[-1]} is longer than the key sequence {kv_len}")
    if mask.dtype.is_bool:
        if short:
            mask = mask.pad([(0, 0)] * (mask.ndim - 1) + [(0, short)])
        return mask.where(Tensor.full((), 0.0, dtype, mask.device), Tensor.full((), NEG_INF, dtype, mask.device))
    if short:
        inside = Tensor.full(mask.shape, True, dtypes.bool_, mask.device).pad([(0, 0)] * (mask.ndim - 1) + [(0, short)])
        mask = inside.where(mask.pad([(0, 0)] * (mask.ndim - 1) + [(0, short)]), Tensor.full((), NEG_INF, mask.dtype, mask.device))
    return mask.cast(dtype)


def _frontier_bias(ctx: Any, q_len: int, kv_len: int, offset: int | Tensor, allowed_of: Any, dtype: Any, key: str) -> Tensor:
    """0 where allowed_of(diff) holds, diff = (i + offset) - j, else -inf: (q, kv) for a static
    offset, (B, 1, q, kv) for a per-batch one."""
    i = np.arange(q_len).reshape(q_len, 1)
    j = np.arange(kv_len).reshape(1, kv_len)
    if isinstance(offset, int):
        allowed = allowed_of((i + offset) - j)
        return ctx.lift((key, q_len, kv_len, offset), np.where(allowed, 0.0, -np.inf).astype(dtype.np))
    diff = offset.cast(dtypes.int64).reshape(-1, 1, 1) + ctx.lift(("ij", q_len, kv_len), (i - j).astype(np.int64))
    bias = allowed_of(diff).where(Tensor.full((), 0.0, dtype, diff.device), Tensor.full((), NEG_INF, dtype, diff.device))
    return bias.reshape(bias.shape[0], 1, q_len, kv_len)


def _safe_softmax(x: Tensor) -> Tensor:
    """Softmax over the last axis; an all -inf row gives zeros (the reference's convention)."""
    m = x.max(-1, keepdim=True)
    m = (m == NEG_INF).where(0.0, m)
    e = (x - m).exp()
    s = e.sum(-1, keepdim=True)
    return e / (s == 0.0).where(1.0, s)


def op_attention(ctx: Any, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None,
                 past_key: Tensor | None = None, past_value: Tensor | None = None,
                 nonpad_kv_seqlen: Tensor | None = None) -> tuple[Tensor, ...]:
    require_float(ctx, q)
    if not q.ndim == k.ndim == v.ndim or q.ndim not in (3, 4):
        raise ctx.error(f"Q, K and V must all be 3-D or all 4-D, got shapes {q.shape}, {k.shape}, {v.shape}")
    if (past_key is None) != (past_value is None):
        raise ctx.error("past_key and past_value must be given together")
    if nonpad_kv_seqlen is not None and past_key is not None:
        raise ctx.error("nonpad_kv_seqlen cannot be combined with past_key / past_value")
    rank3 = q.ndim == 3
    if rank3:
        q_heads, kv_heads = ctx.attr("q_num_heads", 0), ctx.attr("kv_num_heads", 0)
        if q_heads <= 0 or kv_heads <= 0:
            raise ctx.error("3-D Q, K, V need the q_num_heads and kv_num_heads attributes")
        q, k, v = _heads(q, q_heads), _heads(k, kv_heads), _heads(v, kv_heads)
    elif ctx.since >= 25 and (ctx.has_attr("q_num_heads") or ctx.has_attr("kv_num_heads")):
        raise ctx.error("q_num_heads and kv_num_heads must not be given for 4-D inputs")
    dtype = q.dtype
    scale = ctx.attr("scale", 1.0 / math.sqrt(q.shape[3]))
    root = float(np.sqrt(np.float64(scale)).astype(dtype.np))  # the reference casts sqrt(scale) to Q's dtype
    if past_key is not None:
        assert past_value is not None  # checked above: both or neither
        k, v = cat([past_key, k], 2), cat([past_value, v], 2)
    present_key, present_value = k, v
    q_len, kv_len = q.shape[2], k.shape[2]

    bias: Tensor | None = _mask_bias(ctx, attn_mask, kv_len, dtype) if attn_mask is not None else None
    offset: int | Tensor = past_key.shape[2] if past_key is not None else (
        nonpad_kv_seqlen - q_len if nonpad_kv_seqlen is not None else 0)
    if ctx.attr("is_causal", 0):
        causal = _frontier_bias(ctx, q_len, kv_len, offset, lambda d: d >= 0, dtype, "causal")
        bias = causal if bias is None else bias + causal
    left, right = ctx.attr("left_window_size", -1), ctx.attr("right_window_size", -1)
    if left < -1 or right < -1:
        raise ctx.error(f"left_window_size {left} / right_window_size {right} must be -1 or nonnegative")
    if left >= 0 or right >= 0:
        def in_window(d: Any) -> Any:
            ok = (d <= left) if left >= 0 else None
            if right >= 0:
                ok = (-d <= right) if ok is None else ok & (-d <= right)
            return ok
        window = _frontier_bias(ctx, q_len, kv_len, offset, in_window, dtype, "window")
        bias = window if bias is None else bias + window
    if nonpad_kv_seqlen is not None:
        keys = ctx.lift(("keys", kv_len), np.arange(kv_len, dtype=np.int64))
        valid = keys < nonpad_kv_seqlen.cast(dtypes.int64).reshape(-1, 1)
        padding = valid.where(Tensor.full((), 0.0, dtype, q.device), Tensor.full((), NEG_INF, dtype, q.device))
        padding = padding.reshape(padding.shape[0], 1, 1, kv_len)
        bias = padding if bias is None else bias + padding

    q_heads, k_heads = q.shape[1], k.shape[1]
    if q_heads != k_heads:
        if q_heads % k_heads or v.shape[1] != k_heads:
            raise ctx.error(f"{q_heads} query heads cannot share {k_heads} key / {v.shape[1]} value heads")
        reps = q_heads // k_heads  # grouped-query attention: each KV head serves `reps` query heads in turn

        def repeat(t: Tensor) -> Tensor:
            b, h, s, d = t.shape
            return t.reshape(b, h, 1, s, d).expand(b, h, reps, s, d).reshape(b, h * reps, s, d)
        k, v = repeat(k), repeat(v)

    scores = (q * root).matmul((k * root).permute(0, 1, 3, 2))
    softcap = ctx.attr("softcap", 0.0)
    if softcap > 0:  # before the bias, so -inf stays -inf
        scores = (scores / softcap).tanh() * softcap
    with_bias = scores if bias is None else scores + bias
    mode = ctx.attr("qk_matmul_output_mode", 0)
    precision = ctx.attr("softmax_precision", 0)
    logits = with_bias.cast(ctx.target_dtype(precision)) if precision else with_bias
    probs = _safe_softmax(logits)
    if bias is not None:  # rows the bias masks completely: zero probabilities, whatever the scores
        probs = (bias.max(-1, keepdim=True) == NEG_INF).where(0.0, probs)
    probs = probs.cast(dtype)
    qk_out = {2: with_bias, 3: probs}.get(mode, scores)
    y = probs.matmul(v)
    if rank3:
        y = y.permute(0, 2, 1, 3)
        y = y.reshape(y.shape[0], y.shape[1], -1)
    return (y, present_key, present_value, qk_out)[:max(ctx.n_outputs, 1)]


def op_rotary_embedding(ctx: Any, x: Tensor, cos_cache: Value, sin_cache: Value, position_ids: Value = None) -> Tensor:
    """Rotates pairs (halves, or even/odd when interleaved) of the first rotary_embedding_dim features."""
    require_float(ctx, x)
    shape = x.shape
    if x.ndim == 4:        # (B, H, S, D) → (B, S, H, D)
        x = x.permute(0, 2, 1, 3)
    elif x.ndim == 3:
        heads = ctx.attr("num_heads", 0)
        if heads <= 0 or shape[2] % heads:
            raise ctx.error(f"3-D input {shape} needs a num_heads attribute dividing its hidden size")
        x = x.reshape(shape[0], shape[1], heads, shape[2] // heads)
    else:
        raise ctx.error(f"input must be 3-D or 4-D, got shape {shape}")
    b, s, h, d = x.shape
    rot = ctx.attr("rotary_embedding_dim", 0) or d
    half = rot // 2
    cos, sin = as_tensor(ctx, cos_cache, "cos"), as_tensor(ctx, sin_cache, "sin")
    if cos.shape[-1] != half or sin.shape[-1] != half:
        raise ctx.error(f"cos / sin caches' last axis {cos.shape[-1]} / {sin.shape[-1]} must be rotary_embedding_dim/2 = {half}")
    if position_ids is not None:
        ids = as_tensor(ctx, position_ids, "position_ids")
        n = cos.shape[0]
        onehot = ids.reshape(ids.shape + (1,)) == ctx.lift(("pos", n, ids.dtype.name), np.arange(n, dtype=ids.dtype.np))
        cos, sin = gather_where(cos, onehot, 0, ids.ndim), gather_where(sin, onehot, 0, ids.ndim)
    cos, sin = cos.reshape(cos.shape[:-1] + (1, half)), sin.reshape(sin.shape[:-1] + (1, half))
    rotate, keep = x[..., :rot], x[..., rot:]
    if ctx.attr("interleaved", 0):
        pairs = rotate.reshape(b, s, h, half, 2)
        x1, x2 = pairs[..., 0], pairs[..., 1]
    else:
        x1, x2 = rotate[..., :half], rotate[..., half:]
    real, imag = cos * x1 - sin * x2, sin * x1 + cos * x2
    if ctx.attr("interleaved", 0):
        rotated = cat([real.reshape(b, s, h, half, 1), imag.reshape(b, s, h, half, 1)], -1).reshape(b, s, h, rot)
    else:
        rotated = cat([real, imag], -1)
    out = cat([rotated, keep], -1) if rot < d else rotated
    return out.reshape(shape) if len(shape) == 3 else out.permute(0, 2, 1, 3)


def op_linear_attention(ctx: Any, q: Tensor, k: Tensor, v: Tensor, past_state: Tensor | None = None,
                        decay: Tensor | None = None, beta: Tensor | None = None) -> tuple[Tensor, ...]:
    """LinearAttention (27), unrolled over the static sequence: a (d_k, d_v) state per KV head,
    decayed by exp(decay) (gated), corrected by beta·(v − Sᵀk) (delta), grown by k vᵀ; each
    query reads scale · qᵀS from its KV head's state."""
    require_float(ctx, q)
    rule = ctx.attr("update_rule", "gated_delta")
    if rule not in ("linear", "gated", "delta", "gated_delta"):
        raise ctx.error(f"update_rule={rule!r} is not supported (linear, gated, delta, gated_delta)")
    gating, delta = rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")
    if gating != (decay is not None) or delta != (beta is not None):
        raise ctx.error(f"update_rule={rule!r} needs {'a' if gating else 'no'} decay and {'a' if delta else 'no'} beta input")
    hq, hk = ctx.attr("q_num_heads", 0), ctx.attr("kv_num_heads", 0)
    if hq <= 0 or hk <= 0 or hq % hk:
        raise ctx.error(f"q_num_heads {hq} must be a positive multiple of kv_num_heads {hk}")
    if not q.ndim == k.ndim == v.ndim == 3:
        raise ctx.error(f"query, key and value must be 3-D (B, T, H·D), got {q.shape}, {k.shape}, {v.shape}")
    b, t, _ = q.shape
    out_dtype = q.dtype
    state_dtype = past_state.dtype if past_state is not None else out_dtype
    if out_dtype.itemsize < 4:  # float16 / bfloat16: the state accumulates in float32, as onnx's reference
        q, k, v = q.cast(dtypes.float32), k.cast(dtypes.float32), v.cast(dtypes.float32)
        decay, beta, past_state = (None if t_ is None else t_.cast(dtypes.float32) for t_ in (decay, beta, past_state))
    q4, k4, v4 = _heads(q, hq), _heads(k, hk), _heads(v, hk)           # (B, H, T, D)
    dk, dv = q4.shape[3], v4.shape[3]
    group = hq // hk
    if decay is not None:
        g4 = decay.reshape(b, t, hk, 1).permute(0, 2, 1, 3) if decay.shape[-1] == hk else _heads(decay, hk)
    if beta is not None:
        b4 = beta.reshape(b, t, beta.shape[-1], 1).permute(0, 2, 1, 3)
    state = past_state if past_state is not None else Tensor.zeros((b, hk, dk, dv), dtype=q.dtype, device=q.device)
    if state.shape != (b, hk, dk, dv):
        raise ctx.error(f"past_state shape {state.shape} is not {(b, hk, dk, dv)}")
    scale = ctx.attr("scale", 0.0) or 1.0 / math.sqrt(dk)
    outs = []
    for i in range(t):
        kt, vt = k4[:, :, i, :], v4[:, :, i, :]                            # (B, Hk, dk), (B, Hk, dv)
        if decay is not None:
            state = state * g4[:, :, i, :].exp().reshape(b, hk, -1, 1)
        if beta is not None:
            retrieved = (state * kt.reshape(b, hk, dk, 1)).sum(2)          # (B, Hk, dv)
            vt = b4[:, :, i, :] * (vt - retrieved)
        state = state + kt.reshape(b, hk, dk, 1) * vt.reshape(b, hk, 1, dv)
        read = state.reshape(b, hk, 1, dk, dv).expand(b, hk, group, dk, dv).reshape(b, hq, dk, dv) if group > 1 else state
        outs.append(((q4[:, :, i, :].reshape(b, hq, dk, 1) * read).sum(2) * scale).reshape(b, hq, 1, dv))
    y = cat(outs, 2).permute(0, 2, 1, 3).reshape(b, t, hq * dv)
    return (y.cast(out_dtype), state.cast(state_dtype))[:max(ctx.n_outputs, 1)]


def op_flex_attention(ctx: Any, *args: Value) -> Tensor:
    """FlexAttention (ai.onnx.preview 1), as onnx's reference: Q and K each scaled by sqrt(scale)
    in Q's dtype, QK^T cast to the softmax precision (float32 for float16 inputs), then the
    score_mod body, softmax over the keys, the prob_mod body, and P·V in that precision, cast to
    V's dtype. Each body is evaluated once over the (B, Hq, L, S) tensor, at plan time."""
    (q, k, v), outer = _split_outer(ctx, args)
    q, k, v = as_tensor(ctx, q, "Q"), as_tensor(ctx, k, "K"), as_tensor(ctx, v, "V")
    require_float(ctx, q)
    if not q.ndim == k.ndim == v.ndim == 4:
        raise ctx.error(f"Q, K and V must be rank 4, got shapes {q.shape}, {k.shape}, {v.shape}")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2] or q.shape[3] != k.shape[3]:
        raise ctx.error(f"Q {q.shape}, K {k.shape} and V {v.shape} do not share heads, sequence and head sizes")
    q_heads, kv_heads = q.shape[1], k.shape[1]
    if q_heads != kv_heads:
        if q_heads % kv_heads:
            raise ctx.error(f"{q_heads} query heads are not a multiple of {kv_heads} key / value heads")
        reps = q_heads // kv_heads  # grouped-query attention: query head h reads KV head h // reps

        def repeat(t: Tensor) -> Tensor:
            b, h, s, d = t.shape
            return t.reshape(b, h, 1, s, d).expand(b, h, reps, s, d).reshape(b, h * reps, s, d)
        k, v = repeat(k), repeat(v)
    scale = ctx.attr("scale", 1.0 / math.sqrt(q.shape[3]))
    root = float(np.sqrt(np.float32(scale)).astype(q.dtype.np))
    precision = ctx.attr("softmax_precision", 0)
    compute = ctx.target_dtype(precision) if precision else (dtypes.float32 if q.dtype.itemsize < 4 else q.dtype)
    scores = (q * root).matmul((k * root).permute(0, 1, 3, 2)).cast(compute)

    def modify(name: str, x: Tensor) -> Tensor:
        if not ctx.has_attr(name):
            return x
        body = ctx.attr(name)
        if len(body.inputs) != 1 or len(body.outputs) != 1:
            raise ctx.error(f"{name} must have one input and one output, has {len(body.inputs)} and {len(body.outputs)}")
        (y,) = _run(ctx, body, [x], outer)
        y = as_tensor(ctx, y, name)
        if y.shape != x.shape:
            raise ctx.error(f"{name} changed the shape {x.shape} into {y.shape}")
        return y.cast(compute)

    probs = modify("prob_mod", modify("score_mod", scores).softmax(-1))
    return probs.matmul(v.cast(compute)).cast(v.dtype)
