"""RNN, GRU and LSTM (opset 7, 14, 22), unrolled over the static sequence length.

The input projection X·Wᵀ for every step is one matmul before the loop; each step adds H·Rᵀ (one
matmul per step and direction) and applies the gates. A step past a batch entry's
`sequence_lens` keeps that entry's state and writes zeros to Y (forward direction; a run-time
`sequence_lens` with a reverse direction is refused: each entry would reverse over its own length).
Gate order and formulas as the ONNX spec: RNN one gate; GRU z, r, h (`linear_before_reset`); LSTM
i, o, f, c with peepholes P (i, o, f) and `input_forget`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tinydist.frontend.movement import stack
from tinydist.frontend.tensor import Tensor
from tinydist.graph import dtypes
from tinydist.onnx.ops._common import Value, as_tensor, require_float, tanh

_GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
_DEFAULT_ACTIVATIONS = {"RNN": ["Tanh"], "GRU": ["Sigmoid", "Tanh"], "LSTM": ["Sigmoid", "Tanh", "Tanh"]}


def _activation(ctx: Any, name: str, alpha: float | None, beta: float | None) -> Callable[[Tensor], Tensor]:
    key = name.lower()
    if key == "sigmoid":
        return lambda x: x.sigmoid()
    if key == "tanh":
        return tanh
    if key == "relu":
        return lambda x: x.maximum(0.0)
    if key == "leakyrelu":
        a = 0.01 if alpha is None else alpha
        return lambda x: (x >= 0.0).where(x, x * a)
    if key == "hardsigmoid":
        a, b = (0.2 if alpha is None else alpha), (0.5 if beta is None else beta)
        return lambda x: (x * a + b).maximum(0.0).minimum(1.0)
    if key == "affine":
        a, b = (1.0 if alpha is None else alpha), (0.0 if beta is None else beta)
        return lambda x: x * a + b
    if key == "scaledtanh":
        a, b = (1.0 if alpha is None else alpha), (1.0 if beta is None else beta)
        return lambda x: tanh(x * b) * a
    if key == "elu":
        a = 1.0 if alpha is None else alpha
        return lambda x: (x >= 0.0).where(x, (x.exp() - 1.0) * a)
    if key == "softsign":
        return lambda x: x / (x.abs() + 1.0)
    raise ctx.error(f"activation {name!r} is not supported (Sigmoid, Tanh, Relu, LeakyRelu, HardSigmoid, Affine, "
                    "ScaledTanh, Elu, Softsign)")


def _activations(ctx: Any, dirs: int) -> list[list[Callable[[Tensor], Tensor]]]:
    """Per direction, the op's activation functions (f; f, g; f, g, h)."""
    per = len(_DEFAULT_ACTIVATIONS[ctx.op_type])
    names = [n.decode() if isinstance(n, bytes) else n for n in ctx.attr("activations", [])]
    if not names:
        names = _DEFAULT_ACTIVATIONS[ctx.op_type] * dirs
    elif len(names) == per and dirs == 2:
        names = names * 2
    if len(names) != per * dirs:
        raise ctx.error(f"activations {names} must name {per} function(s) per direction ({dirs} directions)")
    alphas, betas = list(ctx.attr("activation_alpha", [])), list(ctx.attr("activation_beta", []))
    fns = [_activation(ctx, n, alphas[i] if i < len(alphas) else None, betas[i] if i < len(betas) else None)
           for i, n in enumerate(names)]
    return [fns[d * per:(d + 1) * per] for d in range(dirs)]


def _split(t: Tensor, parts: int) -> list[Tensor]:
    size = t.shape[-1] // parts
    return [t[..., k * size:(k + 1) * size] for k in range(parts)]


def op_recurrent(ctx: Any, x: Tensor, w: Value, r: Value, b: Value = None, sequence_lens: Value = None,
                 initial_h: Value = None, *rest: Value) -> tuple[Tensor | None, ...]:
    require_float(ctx, x)
    op = ctx.op_type
    gates = _GATES[op]
    initial_c, peep = (rest + (None, None))[:2] if op == "LSTM" else (None, None)
    direction = ctx.attr("direction", "forward")
    dirs = 2 if direction == "bidirectional" else 1
    if direction not in ("forward", "reverse", "bidirectional"):
        raise ctx.error(f"direction={direction!r} is not supported (forward, reverse, bidirectional)")
    layout = ctx.attr("layout", 0)
    if layout:
        x = x.permute(1, 0, 2)
    seq, batch, _ = x.shape
    wt, rt = as_tensor(ctx, w, "W"), as_tensor(ctx, r, "R")
    hidden = rt.shape[-1]
    if ctx.has_attr("hidden_size") and ctx.attr("hidden_size") != hidden:
        raise ctx.error(f"hidden_size={ctx.attr('hidden_size')} does not match R's shape {rt.shape}")
    if wt.shape[:2] != (dirs, gates * hidden) or rt.shape != (dirs, gates * hidden, hidden):
        raise ctx.error(f"W {wt.shape} / R {rt.shape} do not match {dirs} direction(s) × {gates} gate(s) × hidden {hidden}")
    clip = ctx.attr("clip", None)
    acts = _activations(ctx, dirs)
    linear_before_reset = bool(ctx.attr("linear_before_reset", 0))
    input_forget = bool(ctx.attr("input_forget", 0))
    dtype = x.dtype

    def state(value: Value, key: str) -> Tensor:
        if value is None:
            return Tensor.zeros((dirs, batch, hidden), dtype=dtype, device=x.device)
        t = as_tensor(ctx, value, key)
        return t.permute(1, 0, 2) if layout else t

    h0, c0 = state(initial_h, "initial_h"), state(initial_c, "initial_c")
    lens: Tensor | None = None
    if sequence_lens is not None:
        if isinstance(sequence_lens, np.ndarray) and (sequence_lens == seq).all():
            lens = None  # every entry runs the whole sequence
        else:
            if direction != "forward":
                raise ctx.error(f"sequence_lens shorter than the sequence with direction={direction!r} is not supported "
                                "(each batch entry would reverse over its own length)")
            lens = as_tensor(ctx, sequence_lens, "sequence_lens").cast(dtypes.int64).reshape(batch, 1)
    bias = as_tensor(ctx, b, "B") if b is not None else None
    pt = as_tensor(ctx, peep, "P") if peep is not None else None

    ys, hs, cs = [], [], []
    for d in range(dirs):
        wd, rd = wt[d], rt[d].permute(1, 0)                                   # (G·H, I), (H, G·H)
        proj = x.reshape(seq * batch, x.shape[2]).matmul(wd.permute(1, 0)).reshape(seq, batch, gates * hidden)
        wb, rb = (bias[d][:gates * hidden], bias[d][gates * hidden:]) if bias is not None else (None, None)
        if wb is not None and not (op == "GRU" and linear_before_reset):
            proj = proj + (wb + rb)
        f_act = acts[d][0]
        g_act = acts[d][1] if gates > 1 else f_act
        h_act = acts[d][2] if gates == 4 else g_act
        h, c = h0[d], c0[d]
        outs: list[Tensor] = [None] * seq  # type: ignore[list-item]
        steps = range(seq - 1, -1, -1) if (direction == "reverse" or d == 1) else range(seq)
        for t in steps:
            pre = proj[t]

            def cap(v: Tensor) -> Tensor:
                return v.maximum(-clip).minimum(clip) if clip is not None else v
            if op == "RNN":
                new_h, new_c = f_act(cap(pre + h.matmul(rd))), c
            elif op == "GRU":
                xz, xr, xh = _split(pre, 3)
                if linear_before_reset and wb is not None:
                    bz, br, bh = _split(wb + rb, 3)
                    xz, xr, xh = xz + bz, xr + br, xh + _split(wb, 3)[2]
                rz, rr, rh = _split(rd, 3)
                z = f_act(cap(xz + h.matmul(rz)))
                rg = f_act(cap(xr + h.matmul(rr)))
                if linear_before_reset:
                    recur = h.matmul(rh) + (_split(rb, 3)[2] if rb is not None else 0.0)
                    cand = g_act(cap(xh + rg * recur))
                else:
                    cand = g_act(cap(xh + (rg * h).matmul(rh)))
                new_h, new_c = (1.0 - z) * cand + z * h, c
            else:
                gi, go, gf, gc = _split(pre + h.matmul(rd), 4)
                pi, po, pf = _split(pt[d], 3) if pt is not None else (None, None, None)
                i = f_act(cap(gi + pi * c if pi is not None else gi))
                fg = (1.0 - i) if input_forget else f_act(cap(gf + pf * c if pf is not None else gf))
                new_c = fg * c + i * g_act(cap(gc))
                o = f_act(cap(go + po * new_c if po is not None else go))
                new_h = o * h_act(new_c)
            if lens is not None:
                live = lens > t                                              # (B, 1)
                h, c = live.where(new_h, h), live.where(new_c, c)
                outs[t] = live.where(new_h, 0.0)
            else:
                h, c = new_h, new_c
                outs[t] = new_h
        ys.append(stack(outs, 0))
        hs.append(h)
        cs.append(c)
    y = stack(ys, 1)                                                          # (S, dirs, B, H)
    y_h, y_c = stack(hs, 0), stack(cs, 0)                                     # (dirs, B, H)
    if layout:
        y, y_h, y_c = y.permute(2, 0, 1, 3), y_h.permute(1, 0, 2), y_c.permute(1, 0, 2)
    results = (y, y_h, y_c) if op == "LSTM" else (y, y_h)
    return results[:max(ctx.n_outputs, 1)]
