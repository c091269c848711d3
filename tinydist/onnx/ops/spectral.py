"""Signal processing: DFT (17, 20) and STFT (17), each transform one matmul with a constant real
matrix built at load (O(n²), no FFT); the window functions and MelWeightMatrix (17), constants
computed at load."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tinydist.frontend.movement import cat, stack
from tinydist.frontend.tensor import Tensor
from tinydist.onnx.ops._common import Value, as_tensor, ints, norm_axis, require_float, shrink_axis, static


def _dft_matrix(n_in: int, length: int, inverse: bool, onesided: bool) -> np.ndarray:
    """The transform as a real (2·n_in, 2·n_out) matrix on [re | im] (irfft: (2·n_in, n_out)),
    found by transforming each basis vector with numpy's FFT once, at load (it is linear)."""
    rows = []
    for part in (1.0, 1j):
        for j in range(n_in):
            e = np.zeros(n_in, np.complex128)
            e[j] = part
            if inverse and onesided:
                rows.append(np.fft.irfft(e, n=length))
                continue
            r = np.fft.ifft(e, n=length) if inverse else np.fft.fft(e, n=length)
            if onesided:
                r = r[:length // 2 + 1]
            rows.append(np.concatenate([r.real, r.imag]))
    return np.array(rows)


def op_dft(ctx: Any, x: Tensor, dft_length: Value = None, axis_in: Value = None) -> Tensor:
    """DFT 17 (axis attribute, default 1) and 20 (axis input, default -2): real (…, 1) or complex
    (…, 2) input along `axis`, as one matmul with a constant matrix (O(n²), no FFT)."""
    require_float(ctx, x)
    if x.ndim < 2 or x.shape[-1] not in (1, 2):
        raise ctx.error(f"input must end in a real (1) or complex (2) axis, got shape {x.shape}")
    if ctx.since >= 20:
        axis = ints(ctx, axis_in, "axis")[0] if axis_in is not None else -2
    else:
        axis = ctx.attr("axis", 1)
    axis = norm_axis(ctx, axis, x.ndim)
    if axis == x.ndim - 1:
        raise ctx.error("axis must not be the last (real / imaginary) axis")
    inverse, onesided = bool(ctx.attr("inverse", 0)), bool(ctx.attr("onesided", 0))
    n_in = x.shape[axis]
    length = ints(ctx, dft_length, "dft_length")[0] if dft_length is not None else (
        2 * (n_in - 1) if inverse and onesided else n_in)
    if length <= 0:
        raise ctx.error(f"dft_length {length} must be positive")
    order = [i for i in range(x.ndim - 1) if i != axis] + [axis, x.ndim - 1]
    moved = x.permute(tuple(order))                                    # (…, n_in, 1|2)
    lead = moved.shape[:-2]
    parts = moved.permute(tuple(range(len(lead))) + (len(lead) + 1, len(lead)))   # (…, 1|2, n_in)
    if x.shape[-1] == 1:
        parts = cat([parts, Tensor.zeros(parts.shape, dtype=x.dtype, device=x.device)], -2)
    matrix = _dft_matrix(n_in, length, inverse, onesided)
    m = ctx.lift(("dft", n_in, length, inverse, onesided), np.ascontiguousarray(matrix.astype(x.dtype.np)).reshape((1,) + matrix.shape))
    y = parts.reshape(1, -1, 2 * n_in).matmul(m)
    out_n = matrix.shape[1] if inverse and onesided else matrix.shape[1] // 2
    comps = 1 if inverse and onesided else 2
    y = y.reshape(lead + (comps, out_n)).permute(tuple(range(len(lead))) + (len(lead) + 1, len(lead)))  # (…, n_out, c)
    back = [0] * x.ndim
    for pos, src in enumerate(order):
        back[src] = pos
    return y.permute(tuple(back))


def op_stft(ctx: Any, x: Tensor, frame_step: Value, window: Value = None, frame_length: Value = None) -> Tensor:
    """STFT (17): frames of frame_length every frame_step samples, times the window, each through
    the DFT matrix (onesided by default: n // 2 + 1 bins) → (batch, frames, bins, 2)."""
    require_float(ctx, x)
    if x.ndim != 3 or x.shape[-1] not in (1, 2):
        raise ctx.error(f"signal must be (batch, length, 1 or 2), got shape {x.shape}")
    step = ints(ctx, frame_step, "frame_step")[0]
    if frame_length is not None:
        n = ints(ctx, frame_length, "frame_length")[0]
    elif window is not None:
        n = window.shape[0]
    else:
        raise ctx.error("needs a window or a frame_length")
    onesided = bool(ctx.attr("onesided", 1))
    if x.shape[-1] == 2 and onesided:
        raise ctx.error("onesided=1 needs a real signal")
    length = x.shape[1]
    if step <= 0 or n <= 0 or n > length:
        raise ctx.error(f"frame_step {step} / frame_length {n} do not fit a signal of length {length}")
    count = (length - n) // step + 1
    frames = stack([shrink_axis(x, 1, f * step, f * step + n) for f in range(count)], 1)  # (B, F, n, c)
    if window is not None:
        w = as_tensor(ctx, window, "window").cast(x.dtype)
        frames = frames * w.reshape(1, 1, n, 1)
    parts = frames.permute(0, 1, 3, 2)  # (B, F, c, n)
    if x.shape[-1] == 1:
        parts = cat([parts, Tensor.zeros(parts.shape, dtype=x.dtype, device=x.device)], 2)
    matrix = _dft_matrix(n, n, False, onesided)
    m = ctx.lift(("stft", n, onesided), np.ascontiguousarray(matrix.astype(x.dtype.np)).reshape((1,) + matrix.shape))
    bins = matrix.shape[1] // 2
    y = parts.reshape(1, -1, 2 * n).matmul(m)  # (1, B·F, 2·bins): [re | im]
    return y.reshape(x.shape[0], count, 2, bins).permute(0, 1, 3, 2)


def op_window(kind: str) -> Callable[..., np.ndarray]:
    """HannWindow / HammingWindow / BlackmanWindow (17): a constant of the size input's length."""
    def handler(ctx: Any, size: Value) -> np.ndarray:
        n = ints(ctx, size, "size")[0]
        if n < 0:
            raise ctx.error(f"window size {n} is negative")
        period = n if ctx.attr("periodic", 1) else n - 1
        phase = 2 * np.pi * np.arange(n, dtype=np.float64) / max(period, 1)
        if kind == "hann":
            w = 0.5 - 0.5 * np.cos(phase)
        elif kind == "hamming":
            w = 25.0 / 46.0 - (21.0 / 46.0) * np.cos(phase)
        else:
            w = 0.42 - 0.5 * np.cos(phase) + 0.08 * np.cos(2 * phase)
        return w.astype(ctx.target_dtype(ctx.attr("output_datatype", 1)).np)
    return handler


def op_mel_weight_matrix(ctx: Any, bins: Value, dft_length: Value, rate: Value, low: Value, high: Value) -> np.ndarray:
    """MelWeightMatrix (17): a constant (dft_length // 2 + 1, num_mel_bins) of triangular filters,
    as onnx's reference (and onnxruntime) compute it: num_mel_bins + 2 edges spaced evenly in mel
    by (high - low) / (num_mel_bins + 2), each rounded down to a spectrogram bin."""
    n_mel, length, sample_rate = (ints(ctx, v, what)[0] for v, what in
                                  ((bins, "num_mel_bins"), (dft_length, "dft_length"), (rate, "sample_rate")))
    lo, hi = (static(ctx, v, what).reshape(()) for v, what in ((low, "lower_edge_hertz"), (high, "upper_edge_hertz")))
    if n_mel <= 0 or length <= 0 or sample_rate <= 0 or not 0 <= lo < hi:
        raise ctx.error(f"num_mel_bins {n_mel}, dft_length {length}, sample_rate {sample_rate} must be positive and "
                        f"0 <= lower_edge_hertz {lo} < upper_edge_hertz {hi}")
    low_mel, high_mel = (2595 * np.log1p(f / 700) / np.log(10) for f in (lo, hi))
    edges = np.arange(0, n_mel + 2) * ((high_mel - low_mel) / (n_mel + 2)) + low_mel
    edges = (((length + 1) * (700 * np.expm1(edges / 2595 * np.log(10)))) // sample_rate).astype(np.int64)
    out = np.zeros((length // 2 + 1, n_mel))
    for i in range(n_mel):
        left, center, right = edges[i:i + 3]
        if center == left:
            out[center, i] = 1.0
        else:
            out[left:center + 1, i] = (np.arange(left, center + 1) - left) / (center - left)
        if right > center:
            out[center:right, i] = (right - np.arange(center, right)) / (right - center)
    return out.astype(ctx.target_dtype(ctx.attr("output_datatype", 1)).np)
