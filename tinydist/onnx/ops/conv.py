"""Convolutions: Conv (1-D, 2-D, 3-D), ConvTranspose, CausalConvWithState, and Col2Im (im2col's inverse)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from tinydist.codegen.matmul_packing import pack_a_array, pack_b_array_of_transpose
from tinydist.frontend.functional import conv2d, conv2d_prepacked, conv2d_reads_packed, conv_pixels_first
from tinydist.frontend.movement import cat
from tinydist.frontend.tensor import Tensor
from tinydist.graph import dtypes
from tinydist.onnx.ops._common import Value, as_tensor, ints, pad_or_crop, require_float, spatial_args
from tinydist.runtime.registry import peer_group


def _to_2d(x: Tensor) -> Tensor:
    return x.reshape(x.shape[:2] + (1,) + x.shape[2:]) if x.ndim == 3 else x


def _conv3d(x: Tensor, w: Tensor, strides: Sequence[int], dilations: Sequence[int], groups: int) -> Tensor:
    """A 3-D convolution of an already padded x as a sum over the kernel's depth of 2-D ones: tap
    kd reads the depth slices kd·d, kd·d + s, …, folded into the batch, with w[:, :, kd]."""
    n, c, depth = x.shape[:3]
    oc, kd_size = w.shape[0], w.shape[2]
    (sd, *s2), (dd, *d2) = strides, dilations
    out_d = (depth - (kd_size - 1) * dd - 1) // sd + 1
    total: Tensor | None = None
    for kd in range(kd_size):
        start = kd * dd
        part = x[:, :, start:start + (out_d - 1) * sd + 1:sd]                     # (N, C, D', H, W)
        flat = part.permute(0, 2, 1, 3, 4).reshape(n * out_d, c, part.shape[3], part.shape[4])
        y = conv2d(flat, w[:, :, kd], None, tuple(s2), 0, tuple(d2), groups)
        total = y if total is None else total + y
    assert total is not None
    return total.reshape(n, out_d, oc, total.shape[2], total.shape[3]).permute(0, 2, 1, 3, 4)


def op_conv(ctx: Any, x: Tensor, w: Value, b: Value = None) -> Tensor:
    nd = x.ndim - 2
    if nd not in (1, 2, 3):
        raise ctx.error(f"{nd}-D convolution is not supported (1-D, 2-D and 3-D only)")
    require_float(ctx, x)
    if w.ndim != x.ndim:
        raise ctx.error(f"weight shape {w.shape} does not match input rank {x.ndim}")
    groups = ctx.attr("group", 1)
    oc, cg = w.shape[0], w.shape[1]
    kernel = list(w.shape[2:])
    if list(ctx.attr("kernel_shape", kernel)) != kernel:
        raise ctx.error(f"kernel_shape {ctx.attr('kernel_shape')} does not match weight shape {w.shape}")
    if x.shape[1] != cg * groups or oc % groups:
        raise ctx.error(f"input channels {x.shape[1]}, weight shape {w.shape} and group={groups} do not match")
    strides, dilations, pairs = spatial_args(ctx, nd, x.shape[2:], kernel)
    if nd == 1:
        x, kernel, strides, dilations, pairs = _to_2d(x), [1] + kernel, [1] + strides, [1] + dilations, [(0, 0)] + pairs
        w = w.reshape(w.shape[:2] + (1,) + w.shape[2:])
    x = pad_or_crop(x, [(0, 0), (0, 0)] + pairs)
    if nd == 3:
        out = _conv3d(x, as_tensor(ctx, w, "W"), strides, dilations, groups)
    elif _packable(x, w, groups) and conv2d_reads_packed(x, w.shape, tuple(strides), 0, tuple(dilations), groups,
                                                        turned=(turned := _turned(x, w.shape, strides, dilations, groups))):
        # the packed form only: the weight itself is uploaded where some call reads it
        packed = _packed_weight_t(ctx, w) if turned else _packed_weight(ctx, w, groups)
        out = conv2d_prepacked(x, packed, w.shape, tuple(strides), 0, tuple(dilations), groups, turned=turned)
    else:
        out = conv2d(x, as_tensor(ctx, w, "W"), None, tuple(strides), 0, tuple(dilations), groups)
    if b is not None:
        out = out + as_tensor(ctx, b, "bias").reshape((1, oc) + (1,) * (out.ndim - 2))
    return out.reshape(out.shape[:2] + out.shape[3:]) if nd == 1 else out


def _packable(x: Tensor, w: Value, groups: int) -> bool:
    """Whether the weight is packed at load (`_packed_weight`): a constant, on a host device, of
    x's float dtype, no gradient to compute, not depthwise (computed directly)."""
    return (isinstance(w, np.ndarray) and peer_group(x.device) == "host" and not x.requires_grad
            and x.dtype in (dtypes.float32, dtypes.float64) and dtypes.to_dtype(w.dtype) == x.dtype
            and not (w.shape[1] == 1 and groups > 1))


def _turned(x: Tensor, weight_shape: tuple[int, ...], strides: list[int], dilations: list[int], groups: int) -> bool:
    """Whether this convolution's product runs pixels × weight (`conv_pixels_first`)."""
    oc, kernel = weight_shape[0], weight_shape[2:]
    sizes = [(size - d * (k - 1) - 1) // s + 1 for size, k, s, d in zip(x.shape[2:], kernel, strides, dilations)]
    return conv_pixels_first(oc, x.shape[0] * math.prod(sizes), math.prod(kernel), groups, x.dtype.name)


def _packed_weight(ctx: Any, w: np.ndarray, groups: int) -> Tensor:
    """A constant weight of a convolution run as a matmul on a host device, packed once here, at
    load, into the layout the native kernel reads as operand A (`pack_a_array`, per group), not
    again on every call (resnet18's 512-channel 3x3 convolution, M=512 K=4608 N=49, kernel alone:
    96.7 -> 108.9 GFLOP/s)."""
    matrices = np.ascontiguousarray(w).reshape(groups, w.shape[0] // groups, -1)
    if groups == 1:
        return ctx.lift_made(("W packed A", groups), lambda: pack_a_array(matrices[0]))
    return ctx.lift_made(("W packed A", groups), lambda: np.concatenate([pack_a_array(m) for m in matrices]))


def _packed_weight_t(ctx: Any, w: np.ndarray) -> Tensor:
    """A one-group convolution's constant weight for the product turned around (pixels × weight,
    `conv_pixels_first`): its (Cg·KH·KW, OC) transpose packed at load as operand B
    (`pack_b_array_of_transpose`)."""
    return ctx.lift_made(("W packed B",), lambda: pack_b_array_of_transpose(np.ascontiguousarray(w).reshape(w.shape[0], -1)))


def op_conv_transpose(ctx: Any, x: Tensor, w: Value, b: Value = None) -> Tensor:
    nd = x.ndim - 2
    if nd not in (1, 2, 3):
        raise ctx.error(f"{nd}-D ConvTranspose is not supported (1-D, 2-D and 3-D only)")
    require_float(ctx, x)
    groups = ctx.attr("group", 1)
    cin, ocg = w.shape[0], w.shape[1]
    oc = ocg * groups
    kernel = list(w.shape[2:])
    if x.shape[1] != cin or cin % groups:
        raise ctx.error(f"input channels {x.shape[1]}, weight shape {w.shape} and group={groups} do not match")
    strides = list(ctx.attr("strides", [1] * nd))
    dilations = list(ctx.attr("dilations", [1] * nd))
    out_pad = list(ctx.attr("output_padding", [0] * nd))
    in_sizes = x.shape[2:]
    auto_pad = ctx.attr("auto_pad", "NOTSET")
    full = [(i - 1) * s + (k - 1) * d + 1 + op for i, s, k, d, op in zip(in_sizes, strides, kernel, dilations, out_pad)]
    if ctx.has_attr("output_shape") or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        if ctx.has_attr("output_shape"):
            target = list(ctx.attr("output_shape"))[-nd:]
        else:
            target = [i * s for i, s in zip(in_sizes, strides)]
        # a negative total (output_shape past the full output) is a negative crop: zeros appended at the end
        totals = [f - t for f, t in zip(full, target)]
        upper = auto_pad == "SAME_UPPER"
        pairs = [(t // 2, t - t // 2) if upper else (t - t // 2, t // 2) for t in totals]
    elif auto_pad in ("NOTSET", "VALID"):
        pads = list(ctx.attr("pads", [0] * (2 * nd))) if auto_pad == "NOTSET" else [0] * (2 * nd)
        pairs = [(pads[i], pads[i + nd]) for i in range(nd)]
    else:
        raise ctx.error(f"auto_pad={auto_pad!r} is not supported")
    # ConvTranspose = zero-stuffed input, padded by d(k-1) - pad, convolved with the flipped kernel
    regroup = ((groups, cin // groups, ocg) + tuple(kernel), (oc, cin // groups) + tuple(kernel))
    if isinstance(w, np.ndarray):  # constant: flipped and regrouped once, at load
        wflip = w[(slice(None), slice(None)) + (slice(None, None, -1),) * nd]
        wconv: Value = wflip.reshape(regroup[0]).swapaxes(1, 2).reshape(regroup[1])
    else:  # run-time weights: the flip is a negative-stride view, the regroup a permute
        wconv = _flip_spatial(w, nd).reshape(regroup[0]).permute((0, 2, 1) + tuple(range(3, 3 + nd))).reshape(regroup[1])
    if nd == 1:
        x = _to_2d(x)
        wconv = wconv.reshape(wconv.shape[:2] + (1,) + wconv.shape[2:])
        kernel, strides, dilations, out_pad, pairs = [1] + kernel, [1] + strides, [1] + dilations, [0] + out_pad, [(0, 0)] + pairs
    if any(st != 1 for st in strides):  # zero-stuff: s - 1 zeros after each input element of every axis
        n, c, *sizes = x.shape
        x = x.reshape([n, c] + [v for size in sizes for v in (size, 1)])
        x = x.pad([(0, 0), (0, 0)] + [p for st in strides for p in ((0, 0), (0, st - 1))])
        x = x.reshape([n, c] + [size * st for size, st in zip(sizes, strides)])
        x = x.shrink([(0, n), (0, c)] + [(0, (size - 1) * st + 1) for size, st in zip(sizes, strides)])
    edge = [(d * (k - 1) - pb, d * (k - 1) - pe + op) for d, k, (pb, pe), op in zip(dilations, kernel, pairs, out_pad)]
    x = pad_or_crop(x, [(0, 0), (0, 0)] + edge)
    if len(kernel) == 3:
        out = _conv3d(x, as_tensor(ctx, wconv, "W"), [1, 1, 1], dilations, groups)
    else:
        out = conv2d(x, as_tensor(ctx, wconv, "W"), None, 1, 0, tuple(dilations), groups)
    if b is not None:
        out = out + as_tensor(ctx, b, "bias").reshape((1, oc) + (1,) * (out.ndim - 2))
    return out.reshape(out.shape[:2] + out.shape[3:]) if nd == 1 else out


def _flip_spatial(w: Tensor, nd: int) -> Tensor:
    """w reversed along its last `nd` axes (a strided view with negative strides)."""
    strides, acc = [], 1
    for size in reversed(w.shape):
        strides.append(acc)
        acc *= size
    strides.reverse()
    offset = sum((size - 1) * st for size, st in zip(w.shape[2:], strides[2:]))
    return w._as_strided(w.shape, tuple(strides[:2]) + tuple(-st for st in strides[2:]), offset)


def op_causal_conv_with_state(ctx: Any, x: Tensor, w: Value, b: Value = None, past: Value = None) -> tuple[Tensor, Tensor]:
    """Depthwise causal 1-D conv (27): [past_state or zeros | input] convolved per channel with a
    kernel of k, optional SiLU; present_state = the last k - 1 steps of that concatenation."""
    require_float(ctx, x)
    if x.ndim != 3 or w.ndim != 3 or w.shape[1] != 1 or w.shape[0] != x.shape[1]:
        raise ctx.error(f"input (N, C, L) {x.shape} and weight (C, 1, k) {w.shape} do not match")
    activation = ctx.attr("activation", "none")
    if activation not in ("none", "silu", "swish"):
        raise ctx.error(f"activation={activation!r} is not supported (none, silu, swish)")
    n, c, _ = x.shape
    k = w.shape[2]
    state = as_tensor(ctx, past, "past_state") if past is not None else Tensor.zeros((n, c, k - 1), dtype=x.dtype, device=x.device)
    padded = cat([state, x], 2) if k > 1 else x
    out = conv2d(_to_2d(padded), as_tensor(ctx, w, "W").reshape(c, 1, 1, k), None, 1, 0, 1, c)
    out = out.reshape(out.shape[:2] + out.shape[3:])
    if b is not None:
        out = out + as_tensor(ctx, b, "bias").reshape(1, c, 1)
    if activation != "none":
        out = out * out.sigmoid()
    length = padded.shape[2]
    present = padded[:, :, length - (k - 1):] if k > 1 else Tensor.zeros((n, c, 0), dtype=x.dtype, device=x.device)
    return out, present


def op_col2im(ctx: Any, x: Tensor, image_shape: Value, block_shape: Value) -> Tensor:
    """Col2Im (18): the inverse of im2col — every column's block values added at their image
    positions (overlaps summed), as one matmul with a constant 0/1 (blocks·columns, pixels) matrix."""
    image, block = ints(ctx, image_shape, "image_shape"), ints(ctx, block_shape, "block_shape")
    nd = len(image)
    if len(block) != nd:
        raise ctx.error(f"image_shape {image} and block_shape {block} differ in rank")
    dilations = list(ctx.attr("dilations", [1] * nd))
    strides = list(ctx.attr("strides", [1] * nd))
    pads = list(ctx.attr("pads", [0] * (2 * nd)))
    counts = [(size + pads[i] + pads[i + nd] - (dilations[i] * (block[i] - 1) + 1)) // strides[i] + 1
              for i, size in enumerate(image)]
    k, n_cols = math.prod(block), math.prod(counts)
    if x.ndim != 3 or x.shape[1] % k or x.shape[2] != n_cols:
        raise ctx.error(f"input of shape {x.shape} does not hold C·{k} block values for {n_cols} columns")

    def matrix() -> np.ndarray:
        scatter = np.zeros((k * n_cols, math.prod(image)), x.dtype.np)
        for b, offsets in enumerate(np.ndindex(*block)):
            for c, column in enumerate(np.ndindex(*counts)):
                pos = [column[i] * strides[i] - pads[i] + offsets[i] * dilations[i] for i in range(nd)]
                if all(0 <= p < s for p, s in zip(pos, image)):
                    scatter[b * n_cols + c, np.ravel_multi_index(pos, image)] = 1
        return scatter.reshape((1,) + scatter.shape)

    scatter = ctx.lift(("col2im", tuple(image), tuple(block), tuple(x.shape)), matrix())
    channels = x.shape[1] // k
    y = x.reshape(x.shape[0], channels, k * n_cols).matmul(scatter)
    return y.reshape((x.shape[0], channels) + tuple(image))
