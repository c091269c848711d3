"""AffineGrid (20), GridSample (16, 20, 22), DeformConv (19, 22), RoiAlign (10, 16, 22) and
ImageDecoder (20).

GridSample, DeformConv and RoiAlign sample the input at positions computed at run time (a grid,
offsets, boxes): each sampled axis becomes a (…, points, size) matrix of interpolation weights
(one-hot compares with the pixel indices), and one batched matmul reads the samples.
O(points × pixels): sized for the spatial transformers, detection heads and small feature maps
these ops run on.
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np

from tinydist.frontend.movement import cat
from tinydist.frontend.tensor import Tensor
from tinydist.graph import dtypes
from tinydist.onnx.ops._common import Value, as_tensor, ints, require_float, shrink_axis
from tinydist.onnx.ops.elementwise import round_half_even


def op_affine_grid(ctx: Any, theta: Tensor, size: Value) -> Tensor:
    """AffineGrid (20): the sampling grid theta · (x, y[, z], 1) over normalised output coordinates
    in [-1, 1] (pixel centres, or corners under align_corners), as one batched matmul with a
    constant (H·W, 3) or (D·H·W, 4) base grid."""
    dims = ints(ctx, size, "size")
    spatial = dims[2:]
    if len(spatial) not in (2, 3) or theta.shape[1:] != (len(spatial), len(spatial) + 1):
        raise ctx.error(f"size {dims} and theta of shape {theta.shape} do not describe a 2-D or 3-D grid")
    align = bool(ctx.attr("align_corners", 0))

    def axis(n: int) -> np.ndarray:
        if align:
            return np.linspace(-1.0, 1.0, n) if n > 1 else np.zeros(1)
        return (2.0 * np.arange(n) + 1.0) / n - 1.0

    coords = np.meshgrid(*[axis(n) for n in spatial], indexing="ij")  # (D,) H, W
    base = np.stack([c.reshape(-1) for c in reversed(coords)] + [np.ones(math.prod(spatial))], axis=1)
    grid = ctx.lift(("grid", tuple(dims), align), base.astype(theta.dtype.np).reshape((1,) + base.shape))
    out = grid.matmul(theta.permute(0, 2, 1))  # (N, points, rank)
    return out.reshape((theta.shape[0],) + tuple(spatial) + (len(spatial),))


def _reflect(v: Tensor, low: float, high: float) -> Tensor:
    """Reflect coordinates by the near border until they lie in [low, high] (onnx's _gs_reflect)."""
    span = high - low
    if span <= 0:
        return v * 0.0 + low
    below, above = low - v, v - high
    out = v
    for dist, near, far, sign in ((below, low, high, 1.0), (above, high, low, -1.0)):
        folds = (dist / span).floor()
        rest = dist - folds * span
        even = (folds - (folds * 0.5).floor() * 2.0) == 0.0
        moved = even.where(rest * sign + near, far - rest * sign)
        out = (dist > 0.0).where(moved, out)
    return out


def _cubic_coeffs(t: Tensor) -> list[Tensor]:
    a = -0.75
    x0, x1, x2, x3 = t + 1.0, t, 1.0 - t, 2.0 - t
    return [((x0 * a - 5 * a) * x0 + 8 * a) * x0 - 4 * a, ((x1 * (a + 2)) - (a + 3)) * x1 * x1 + 1.0,
            ((x2 * (a + 2)) - (a + 3)) * x2 * x2 + 1.0, ((x3 * a - 5 * a) * x3 + 8 * a) * x3 - 4 * a]


def op_grid_sample(ctx: Any, x: Tensor, grid: Tensor) -> Tensor:
    """GridSample (16, 20, 22) as onnx's reference: per spatial axis, the sampled coordinates'
    neighbours (1 nearest, 2 linear, 4 cubic) with their weights and padded pixel indices become
    an (N, points, size) weight matrix; the axes' matrices multiply into one (N, points, pixels)
    matrix, applied to x with one batched matmul. O(points × pixels): for the small images and
    grids of spatial transformers, not for resampling large images. Cubic with border padding
    clamps only its taps, not the coordinate, as onnxruntime and PyTorch (the reference clamps
    both; its node cases agree either way)."""
    require_float(ctx, x)
    spatial = x.shape[2:]
    nd = len(spatial)
    if grid.ndim != nd + 2 or grid.shape[-1] != nd or grid.shape[0] != x.shape[0]:
        raise ctx.error(f"grid of shape {grid.shape} does not match input of shape {x.shape}")
    raw_mode = ctx.attr("mode", "linear" if ctx.since >= 20 else "bilinear")
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(raw_mode, raw_mode)  # version 16's names
    padding = ctx.attr("padding_mode", "zeros")
    if mode not in ("nearest", "linear", "cubic") or padding not in ("zeros", "border", "reflection"):
        raise ctx.error(f"mode={mode!r} / padding_mode={padding!r} is not supported")
    align = bool(ctx.attr("align_corners", 0))
    n, out_spatial = x.shape[0], grid.shape[1:-1]
    points = math.prod(out_spatial)
    g = grid.reshape(n, points, nd).cast(x.dtype)
    total: Tensor | None = None
    for i, size in enumerate(spatial):
        coord = shrink_axis(g, 2, nd - 1 - i, nd - i)  # (N, P, 1): the grid lists x (width) first
        v = (coord + 1.0) * 0.5 * (size - 1) if align else ((coord + 1.0) * size - 1.0) * 0.5
        low, high = (0.0, size - 1.0) if align else (-0.5, size - 0.5)
        if mode == "nearest":
            v = round_half_even(v)
        outside = (v < low) | (v > high)
        if padding == "border" and mode != "cubic":  # cubic clamps its taps only (onnxruntime, PyTorch)
            v = outside.where(v.maximum(0.0).minimum(size - 1.0), v)
        elif padding == "reflection":
            v = outside.where(_reflect(v, low, high), v)
        base = v.floor()
        frac = v - base
        taps: list[tuple[Tensor, Tensor | None]]
        if mode == "nearest":
            taps = [(v, None)]
        elif mode == "linear":
            taps = [(base, 1.0 - frac), (base + 1.0, frac)]
        else:
            taps = list(zip([base - 1.0, base, base + 1.0, base + 2.0], _cubic_coeffs(frac)))
        pixels = ctx.lift(("pixels", size, x.dtype.name), np.arange(size, dtype=x.dtype.np).reshape(1, 1, size))
        weights: Tensor | None = None
        for j, w in taps:
            if padding == "border":
                j = j.maximum(0.0).minimum(size - 1.0)
            elif padding == "reflection":
                j = _reflect(j, low, high)
            j = j.cast(dtypes.int64).cast(x.dtype)  # the reference's int(): toward zero
            hit = j == pixels  # (N, P, size); out of range hits nothing: zero padding
            term = hit.cast(x.dtype) if w is None else hit.where(w, 0.0)
            weights = term if weights is None else weights + term
        assert weights is not None
        total = weights if total is None else (total.reshape(n, points, -1, 1) * weights.reshape(n, points, 1, size)).reshape(
            n, points, -1)
    assert total is not None
    y = x.reshape(n, x.shape[1], -1).matmul(total.permute(0, 2, 1))  # (N, C, P)
    return y.reshape((n, x.shape[1]) + tuple(out_spatial))



def _bilinear_weights(ctx: Any, v: Tensor, size: int, key: str) -> Tensor:
    """(…, size) weights of the two neighbours of coordinates `v` (…): 1 - frac and frac, a
    neighbour outside [0, size) weighing nothing (zero padding)."""
    base = v.floor()
    frac = v - base
    pixels = ctx.lift((key, size, v.dtype.name), np.arange(size, dtype=v.dtype.np))
    lo = base.reshape(v.shape + (1,)) == pixels
    hi = (base + 1.0).reshape(v.shape + (1,)) == pixels
    return lo.where((1.0 - frac).reshape(v.shape + (1,)), 0.0) + hi.where(frac.reshape(v.shape + (1,)), 0.0)


def op_deform_conv(ctx: Any, x: Tensor, w: Value, offset: Tensor, bias: Value = None, mask: Tensor | None = None) -> Tensor:
    """2-D DeformConv as onnx's reference: kernel tap (a, b) of output (i, j) reads x bilinearly
    (zero outside) at (i·stride - pad + a·dilation + Δh, j·stride - pad + b·dilation + Δw), its
    offsets from the tap's offset group, times the mask; then the grouped convolution's weights
    (one matmul over channels × taps) and the bias."""
    require_float(ctx, x)
    weight = as_tensor(ctx, w, "W")
    if x.ndim != 4 or weight.ndim != 4:
        raise ctx.error(f"only 2-D DeformConv is supported: X {x.shape}, W {weight.shape}")
    n, c, ih, iw = x.shape
    oc, cpg, kh, kw = weight.shape
    kernel = list(ctx.attr("kernel_shape", [kh, kw]))
    group, og = ctx.attr("group", 1), ctx.attr("offset_group", 1)
    if kernel != [kh, kw] or c != cpg * group or oc % group or c % og:
        raise ctx.error(f"X {x.shape}, W {weight.shape}, kernel_shape {kernel}, group {group} and offset_group {og} disagree")
    taps = kh * kw
    oh, ow = offset.shape[2:]
    if offset.shape[:2] != (n, og * taps * 2):
        raise ctx.error(f"offset of shape {offset.shape} is not (N, offset_group·{taps}·2, OH, OW) = ({n}, {og * taps * 2}, …)")
    sh, sw = ctx.attr("strides", [1, 1])
    dh, dw = ctx.attr("dilations", [1, 1])
    pads = ctx.attr("pads", [0, 0, 0, 0])
    if oh != (ih + pads[0] + pads[2] - (kh - 1) * dh - 1) // sh + 1 or ow != (iw + pads[1] + pads[3] - (kw - 1) * dw - 1) // sw + 1:
        raise ctx.error(f"offset's output size {(oh, ow)} does not follow from X {x.shape}, pads {pads}, strides, dilations")
    points = oh * ow
    # static base positions (taps, points) per axis
    grid_h = (np.arange(kh) * dh)[:, None, None, None] + (np.arange(oh) * sh - pads[0])[None, None, :, None]
    grid_w = (np.arange(kw) * dw)[None, :, None, None] + (np.arange(ow) * sw - pads[1])[None, None, None, :]
    shape = (1, 1, taps, points)
    base_h = ctx.lift("base_h", np.broadcast_to(grid_h, (kh, kw, oh, ow)).astype(x.dtype.np).reshape(shape))
    base_w = ctx.lift("base_w", np.broadcast_to(grid_w, (kh, kw, oh, ow)).astype(x.dtype.np).reshape(shape))
    off = offset.reshape(n, og, taps, 2, points)
    ph = base_h + off[:, :, :, 0, :]                                       # (N, G, taps, P)
    pw = base_w + off[:, :, :, 1, :]
    wh, ww = _bilinear_weights(ctx, ph, ih, "rows"), _bilinear_weights(ctx, pw, iw, "cols")
    sample = (wh.reshape(n, og, taps * points, ih, 1) * ww.reshape(n, og, taps * points, 1, iw)).reshape(
        n, og, taps * points, ih * iw)
    cols = x.reshape(n, og, c // og, ih * iw).matmul(sample.permute(0, 1, 3, 2))   # (N, G, C/G, taps·P)
    cols = cols.reshape(n, og, c // og, taps, points)
    if mask is not None:
        if mask.shape != (n, og * taps, oh, ow):
            raise ctx.error(f"mask of shape {mask.shape} is not {(n, og * taps, oh, ow)}")
        cols = cols * mask.reshape(n, og, 1, taps, points)
    cols = cols.reshape(n, group, cpg * taps, points)
    y = weight.reshape(1, group, oc // group, cpg * taps).matmul(cols)     # (N, group, OC/group, P)
    y = y.reshape(n, oc, oh, ow)
    if bias is not None:
        y = y + as_tensor(ctx, bias, "B").reshape(1, oc, 1, 1)
    return y


def _roi_axis(ctx: Any, start: Tensor, length: Tensor, pooled: int, grid: int, size: int, key: str) -> tuple[Tensor, Tensor]:
    """RoiAlign's sample coordinates along one axis, as onnx's reference places them: (R, pooled·grid),
    clamped at 0 and at size - 1 (where the last pixel's weight is then 1), and whether each lies
    in [-1, size] (a sample outside weighs nothing)."""
    steps = (np.arange(pooled)[:, None] + (np.arange(grid)[None, :] + 0.5) / grid).reshape(1, -1)
    at = start.reshape(-1, 1) + length.reshape(-1, 1) / pooled * ctx.lift((key, pooled, grid), steps.astype(start.dtype.np))
    inside = (at >= -1.0) & (at <= float(size))
    clamped = at.maximum(0.0)
    clamped = (clamped >= size - 1.0).where(float(size - 1), clamped)
    return clamped, inside


def _corner_weights(ctx: Any, v: Tensor, size: int, key: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(one-hot low, weight low, one-hot high, weight high) of coordinates v (R, S): (R, S, size)
    and (R, S, 1); a neighbour past the last pixel hits nothing (its weight is 0 there)."""
    low = v.floor()
    frac = v - low
    pixels = ctx.lift((key, size, v.dtype.name), np.arange(size, dtype=v.dtype.np))
    shape = v.shape + (1,)
    hot_lo = (low.reshape(shape) == pixels).cast(v.dtype)
    hot_hi = ((low + 1.0).reshape(shape) == pixels).cast(v.dtype)
    return hot_lo, (1.0 - frac).reshape(shape), hot_hi, frac.reshape(shape)


def _roi_align(ctx: Any, x: Tensor, rois: Tensor, batch: Tensor, grid_h: int, grid_w: int) -> Tensor:
    n, c, h, w = x.shape
    ph, pw = ctx.attr("output_height", 1), ctx.attr("output_width", 1)
    scale = float(ctx.attr("spatial_scale", 1.0))
    default = "half_pixel" if ctx.since >= 16 else "output_half_pixel"
    ctm = ctx.attr("coordinate_transformation_mode", default)
    if ctm not in ("half_pixel", "output_half_pixel"):
        raise ctx.error(f"coordinate_transformation_mode={ctm!r} is not supported (half_pixel, output_half_pixel)")
    shift = 0.5 if ctm == "half_pixel" else 0.0
    r = rois.shape[0]
    box = rois.cast(x.dtype) * scale - shift
    x1, y1, x2, y2 = (box[:, i] for i in range(4))
    width, height = x2 - x1, y2 - y1
    if ctm == "output_half_pixel":  # a box is at least one pixel
        width, height = width.maximum(1.0), height.maximum(1.0)
    ys, y_in = _roi_axis(ctx, y1, height, ph, grid_h, h, "roi_y")
    xs, x_in = _roi_axis(ctx, x1, width, pw, grid_w, w, "roi_x")
    inside = y_in.reshape(r, -1, 1) & x_in.reshape(r, 1, -1)  # (R, PH·gh, PW·gw): outside either axis weighs nothing
    yl, wyl, yh, wyh = _corner_weights(ctx, ys, h, "rows")
    xl, wxl, xh, wxh = _corner_weights(ctx, xs, w, "cols")
    images = ctx.lift(("images", n), np.arange(n, dtype=np.int64))
    pick = (batch.cast(dtypes.int64).reshape(r, 1) == images).cast(x.dtype)           # (R, N)
    picked = pick.matmul(x.reshape(n, c * h * w)).reshape(r, c, h, w)
    zero = Tensor.full((), 0.0, x.dtype, x.device)
    if ctx.attr("mode", "avg") == "avg":
        rows = (yl * wyl + yh * wyh).reshape(r, 1, ph * grid_h, h)
        cols = (xl * wxl + xh * wxh).reshape(r, 1, pw * grid_w, w)
        samples = rows.matmul(picked).matmul(cols.permute(0, 1, 3, 2))              # (R, C, PH·gh, PW·gw)
        samples = inside.reshape(r, 1, ph * grid_h, pw * grid_w).where(samples, zero)
        return samples.reshape(r, c, ph, grid_h, pw, grid_w).mean((3, 5))
    best: Tensor | None = None
    for hot_y, wy in ((yl, wyl), (yh, wyh)):
        for hot_x, wx in ((xl, wxl), (xh, wxh)):
            value = hot_y.reshape(r, 1, ph * grid_h, h).matmul(picked).matmul(hot_x.reshape(r, 1, pw * grid_w, w).permute(0, 1, 3, 2))
            value = value * wy.reshape(r, 1, -1, 1) * wx.reshape(r, 1, 1, -1)
            best = value if best is None else best.maximum(value)
    assert best is not None
    best = inside.reshape(r, 1, ph * grid_h, pw * grid_w).where(best, zero)
    return best.reshape(r, c, ph, grid_h, pw, grid_w).max((3, 5))


def op_roi_align(ctx: Any, x: Tensor, rois: Value, batch_indices: Tensor) -> Tensor:
    """RoiAlign as onnx's reference: per box and output cell, grid_h × grid_w bilinear samples,
    averaged (avg) or the largest of the four weighted corner values (max). The separable sample
    weights make avg two batched matmuls per box batch. With sampling_ratio 0 the grid depends on
    each box's size (ceil(box / output)): the boxes must then be constant."""
    require_float(ctx, x)
    if x.ndim != 4:
        raise ctx.error(f"X must be 4-D (N, C, H, W), got shape {x.shape}")
    if len(rois.shape) != 2 or rois.shape[1] != 4 or tuple(batch_indices.shape) != (rois.shape[0],):
        raise ctx.error(f"rois {tuple(rois.shape)} and batch_indices {batch_indices.shape} must be (R, 4) and (R,)")
    if ctx.attr("mode", "avg") not in ("avg", "max"):
        raise ctx.error(f"mode={ctx.attr('mode')!r} is not supported (avg, max)")
    ratio = ctx.attr("sampling_ratio", 0)
    if ratio > 0:
        return _roi_align(ctx, x, as_tensor(ctx, rois, "rois"), batch_indices, ratio, ratio)
    if isinstance(rois, Tensor):
        raise ctx.error("sampling_ratio 0 takes each box's sample grid from its size: the rois must be constant "
                        "(an initializer); give sampling_ratio > 0 for boxes computed at run time")
    boxes = rois.astype(np.float64) * float(ctx.attr("spatial_scale", 1.0))
    aligned = ctx.attr("coordinate_transformation_mode", "half_pixel" if ctx.since >= 16 else "output_half_pixel") == "half_pixel"
    ph, pw = ctx.attr("output_height", 1), ctx.attr("output_width", 1)
    parts = []
    for i, (x1, y1, x2, y2) in enumerate(boxes):
        height, width = (y2 - y1, x2 - x1) if aligned else (max(y2 - y1, 1.0), max(x2 - x1, 1.0))
        grid_h, grid_w = max(math.ceil(height / ph), 1), max(math.ceil(width / pw), 1)
        one = ctx.lift(("roi", i), rois[i:i + 1])
        parts.append(_roi_align(ctx, x, one, batch_indices[i:i + 1], grid_h, grid_w))
    return cat(parts, 0)


def op_image_decoder(ctx: Any, encoded: Value) -> np.ndarray:
    """ImageDecoder (20): the (H, W, 3) RGB / BGR or (H, W, 1) grayscale uint8 pixels of an encoded
    image (JPEG, PNG, BMP, TIFF, WebP, PNM, JPEG 2000 …), decoded on the host with Pillow as onnx's
    reference does. The pixels' shape is the image's, so the bytes are read when the model is
    called (a graph input of any length is a value input: a new image is a new plan) and the
    pixels enter the graph as a constant."""
    if isinstance(encoded, Tensor):
        raise ctx.error("the encoded image is computed from tensor values at run time: its pixels' shape depends on "
                        "the bytes, so they must come from a graph input or an initializer")
    pixel_format = ctx.attr("pixel_format", "RGB")
    if pixel_format not in ("RGB", "BGR", "Grayscale"):
        raise ctx.error(f"pixel_format={pixel_format!r} is not supported (RGB, BGR, Grayscale)")
    if encoded.dtype != np.uint8 or encoded.ndim != 1:
        raise ctx.error(f"the encoded image must be a 1-D uint8 tensor, got {encoded.dtype}{list(encoded.shape)}")
    try:
        import PIL.Image
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("ImageDecoder needs the optional 'pillow' package: pip install 'tinydist[image]'") from e
    try:
        with PIL.Image.open(io.BytesIO(encoded.tobytes())) as image:
            if pixel_format == "Grayscale":
                return np.ascontiguousarray(np.asarray(image.convert("L"))[:, :, None])
            rgb = np.asarray(image.convert("RGB"))
    except (OSError, ValueError, PIL.Image.DecompressionBombError) as e:  # UnidentifiedImageError is an OSError
        raise ctx.error(f"the {encoded.size} bytes are not an image Pillow can decode ({e})") from e
    return np.ascontiguousarray(rgb[:, :, ::-1] if pixel_format == "BGR" else rgb)
