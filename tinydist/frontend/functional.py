"""Compound tensor ops built from the primitive ones: matmul, softmax, layernorm, convolution, pooling.

Matmul of float tensors becomes one MATMUL node (a packed, register-tiled native kernel); every
other op here is composition, so it fuses and schedules like the rest of the graph.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from tinydist.base.config import settings
from tinydist.base.errors import WorkTooLarge
from tinydist.codegen.matmul_tiling import DEFAULT_TILINGS, packed_a_elements, packed_b_elements
from tinydist.frontend.autograd import custom_gradient, no_grad
from tinydist.frontend.arguments import normalize_axes
from tinydist.frontend.tensor import Tensor
from tinydist.graph import dtypes
from tinydist.graph.lazy import LazyNode, Op


def _pair(value: Any, name: str) -> tuple[int, int]:
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or any(not isinstance(v, int) for v in pair):
        raise ValueError(f"{name} must be an int or a pair of ints, got {value!r}")
    return pair


# ---- matmul -----------------------------------------------------------------------------------

FEW_OUTPUTS, LONG_REDUCTION = 256, 1024   # below / above these, dot products beat packing operands
PIXELS_FIRST_PER_CHANNEL = 8   # a convolution with at most this many output pixels per channel turns its product around

def matmul(a: Tensor, b: Tensor) -> Tensor:
    """numpy.matmul semantics: 1-D operands are promoted and the added axis removed; batch axes broadcast."""
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError(f"matmul: scalar operands are not allowed (shapes {a.shape} and {b.shape}); use *")
    if a.device != b.device:
        raise ValueError(f"matmul: operands are on different devices: {a.device} and {b.device}")
    x = a.reshape(1, a.shape[0]) if a.ndim == 1 else a
    y = b.reshape(b.shape[0], 1) if b.ndim == 1 else b
    if x.shape[-1] != y.shape[-2]:
        raise ValueError(f"matmul: inner dimensions differ: shapes {a.shape} and {b.shape} "
                         f"({x.shape[-1]} is not {y.shape[-2]})")
    try:
        batch = tuple(np.broadcast_shapes(x.shape[:-2], y.shape[:-2]))
    except ValueError:
        raise ValueError(f"matmul: batch dimensions of shapes {a.shape} and {b.shape} do not broadcast") from None
    dtype = dtypes.result_type(x.dtype, y.dtype)
    m, k, n = x.shape[-2], x.shape[-1], y.shape[-1]
    _check_work(a.shape, b.shape, math.prod(batch), m, k, n)
    if dtype.is_narrow_float:  # float16 products accumulate in float32 and round once, as numpy's float16 matmul
        result = matmul(x.cast(dtypes.float32), y.cast(dtypes.float32)).cast(dtype)
    elif dtype.is_float and _native(math.prod(batch) * m, k, n):
        result = _native_matmul(x.cast(dtype), y.cast(dtype), batch, m, k, n)
    elif dtype.is_bool:  # numpy: a logical or of ands
        result = (x.unsqueeze(-1) & y.unsqueeze(-3)).any(axis=-2)
    else:
        result = (x.cast(dtype).unsqueeze(-1) * y.cast(dtype).unsqueeze(-3)).sum(axis=-2, dtype=dtype)
    if a.ndim == 1:
        result = result.squeeze(-2)
    if b.ndim == 1:
        result = result.squeeze(-1)
    return result


def _check_work(a_shape: tuple[int, ...], b_shape: tuple[int, ...], count: int, m: int, k: int, n: int) -> None:
    work = 2 * count * m * k * n
    if work > settings.MAX_KERNEL_WORK:
        raise WorkTooLarge(f"matmul of shapes {a_shape} and {b_shape} is {work:.3g} operations, more than "
                           f"TINYDIST_MAX_KERNEL_WORK={settings.MAX_KERNEL_WORK:.3g} allows in one kernel: "
                           "split it (over the batch, or into row blocks), or raise the setting")


def _native(rows: int, k: int, n: int) -> bool:
    """Whether a float product of `rows` rows in all (batch × M) runs the native kernel. A single
    row is a matrix-vector product: the fused multiply-reduce streams the matrix once, where the
    packed kernel would repack (and for a transposed weight, first copy) it. So do a few outputs
    of a long reduction (a small layer's weight gradient): as dot products."""
    few_long = rows * n <= FEW_OUTPUTS and k >= LONG_REDUCTION
    return bool(rows * n * k) and rows > 1 and not few_long


def prepacked_matmul_applies(rows: int, k: int, n: int, dtype: dtypes.DType) -> bool:
    """Whether `matmul_prepacked` serves a product of `rows` rows (batch × M) by a constant K×N
    weight of `dtype`: where `matmul` would run the native kernel, for float32 and float64."""
    return dtype in (dtypes.float32, dtypes.float64) and _native(rows, k, n)


def matmul_prepacked(a: Tensor, packed: Tensor, k: int, n: int) -> Tensor:
    """a (…, M, K) @ B, B a constant K×N weight packed once at load by
    `tinydist.codegen.matmul_packing.pack_b_array` (`packed`: its 1-D result, uploaded): the native
    kernel reads it as it is, where `matmul` would pack B again on every call. The same bits as
    `a.matmul(B)` (the packing does not change the reduction order). Host (CPU) devices only;
    no gradient flows into a packed weight, nor through this product."""
    if a.ndim < 2 or a.shape[-1] != k:
        raise ValueError(f"matmul_prepacked: A must be (…, M, {k}), got shape {a.shape}")
    if a.dtype != packed.dtype or a.dtype not in (dtypes.float32, dtypes.float64):
        raise ValueError(f"matmul_prepacked: A and the packed B must both be float32 or both float64, "
                         f"got {a.dtype} and {packed.dtype}")
    if packed.shape != (packed_b_elements(k, n, a.dtype.name),):
        raise ValueError(f"matmul_prepacked: a packed {k}x{n} B has shape ({packed_b_elements(k, n, a.dtype.name)},), "
                         f"got {packed.shape}: pack it with tinydist.codegen.matmul_packing.pack_b_array")
    if a.device != packed.device:
        raise ValueError(f"matmul_prepacked: operands are on different devices: {a.device} and {packed.device}")
    count, m = math.prod(a.shape[:-2]), a.shape[-2]
    _check_work(a.shape, (k, n), count, m, k, n)
    left = a.reshape(count, m, k).contiguous()
    node = LazyNode(Op.MATMUL, (left.node, packed.node), ("b", k, n), a.dtype, (count, m, n), a.device)
    return Tensor(node).reshape(a.shape[:-1] + (n,))


def matmul_prepacked_a(packed: Tensor, b: Tensor, m: int, k: int) -> Tensor:
    """A @ b (G, K, N), A a constant M×K weight — or G of them, one per item — packed once at load by
    `tinydist.codegen.matmul_packing.pack_a_array` (`packed`: its 1-D result(s), concatenated and
    uploaded): a convolution's weight times its columns, the kernel reading its blocks where they lie
    where `matmul` would pack them again on every call. The same bits as `A.matmul(b)`. Host (CPU)
    devices only; no gradient flows into a packed weight, nor through this product."""
    if b.ndim != 3 or b.shape[1] != k:
        raise ValueError(f"matmul_prepacked_a: B must be (G, {k}, N), got shape {b.shape}")
    if b.dtype != packed.dtype or b.dtype not in (dtypes.float32, dtypes.float64):
        raise ValueError(f"matmul_prepacked_a: the packed A and B must both be float32 or both float64, "
                         f"got {packed.dtype} and {b.dtype}")
    per_item = packed_a_elements(m, k, b.dtype.name)
    count, n = b.shape[0], b.shape[2]
    if packed.shape not in ((per_item,), (count * per_item,)):
        raise ValueError(f"matmul_prepacked_a: a packed {m}x{k} A has shape ({per_item},) (or {count} of them), "
                         f"got {packed.shape}: pack it with tinydist.codegen.matmul_packing.pack_a_array")
    if b.device != packed.device:
        raise ValueError(f"matmul_prepacked_a: operands are on different devices: {packed.device} and {b.device}")
    _check_work((m, k), b.shape, count, m, k, n)
    node = LazyNode(Op.MATMUL, (packed.node, b.node), ("a", m, k), b.dtype, (count, m, n), b.device)
    return Tensor(node)


def _native_matmul(x: Tensor, y: Tensor, batch: tuple[int, ...], m: int, k: int, n: int) -> Tensor:
    count = math.prod(batch)

    def operand(t: Tensor, rows: int, cols: int) -> Tensor:
        own = t.shape[:-2]
        if math.prod(own) == 1:  # one matrix shared by the whole batch: the kernel broadcasts it
            return t.reshape(1, rows, cols).contiguous()
        return t.expand(batch + (rows, cols)).reshape(count, rows, cols).contiguous()

    left, right = operand(x, m, k), operand(y, k, n)
    node = LazyNode(Op.MATMUL, (left.node, right.node), None, x.dtype, (count, m, n), x.device)
    return Tensor(node).reshape(batch + (m, n))


# ---- normalisation ----------------------------------------------------------------------------

def softmax(x: Tensor, axis: int = -1) -> Tensor:
    x = x.cast(dtypes.float_result(x.dtype))
    shifted = x - x.max(axis, keepdim=True)
    e = shifted.exp()
    return e / e.sum(axis, keepdim=True)


def log_softmax(x: Tensor, axis: int = -1) -> Tensor:
    x = x.cast(dtypes.float_result(x.dtype))
    shifted = x - x.max(axis, keepdim=True)
    return shifted - shifted.exp().sum(axis, keepdim=True).log()


def layernorm(x: Tensor, axis: int | Sequence[int] = -1, eps: float = 1e-5) -> Tensor:
    x = x.cast(dtypes.float_result(x.dtype))
    axes = normalize_axes(axis, x.ndim)
    mean = x.mean(axes, keepdim=True)
    centered = x - mean
    variance = (centered * centered).mean(axes, keepdim=True)
    return centered / (variance + eps).sqrt()


# ---- windows: convolution and pooling ---------------------------------------------------------

def _windows(x: Tensor, kernel: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int]) -> Tensor:
    """(N, C, H, W) → (N, C, OH, OW, KH, KW) strided view of every window (x must be padded already)."""
    n, c, h, w = x.shape
    (kh, kw), (sh, sw), (dh, dw) = kernel, stride, dilation
    oh, ow = _windows_out(x.shape, kernel, stride, dilation)
    return x._as_strided((n, c, oh, ow, kh, kw), (c * h * w, h * w, sh * w, sw, dh * w, dw))


def _windows_out(shape: tuple[int, ...], kernel: tuple[int, int], stride: tuple[int, int],
                 dilation: tuple[int, int]) -> tuple[int, int]:
    """How many windows fit along H and W of a padded (N, C, H, W) input."""
    (kh, kw), (sh, sw), (dh, dw) = kernel, stride, dilation
    oh, ow = (shape[2] - dh * (kh - 1) - 1) // sh + 1, (shape[3] - dw * (kw - 1) - 1) // sw + 1
    if oh <= 0 or ow <= 0:
        raise ValueError(f"window {kernel} (dilation {dilation}) does not fit the padded input of shape {shape}")
    return oh, ow


def _check_nchw(x: Tensor, op: str) -> None:
    if x.ndim != 4:
        raise ValueError(f"{op} expects an (N, C, H, W) input, got shape {x.shape}")


def _im2col(x: Tensor, kernel: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int],
            groups: int) -> Tensor:
    """(N, C, H, W) padded input → (G, Cg·KH·KW, N·OH·OW) columns, one per output pixel.

    The batch sits inside the columns, so a convolution is one wide matmul per group and its
    weight gradient reads these same columns (columns @ output-gradient rows) without a transpose.
    Materialized in this 7-D order (one affine view: no div/mod per element); the reshapes are free."""
    n, c, _, _ = x.shape
    cols = _windows(x, kernel, stride, dilation)                                  # N C OH OW KH KW
    _, _, oh, ow, kh, kw = cols.shape
    cg = c // groups
    cols = cols.reshape(n, groups, cg, oh, ow, kh, kw).permute(1, 2, 5, 6, 0, 3, 4).contiguous()  # G Cg KH KW N OH OW
    return cols.reshape(groups, cg * kh * kw, n * oh * ow)


def _col2im(cols: Tensor, shape: tuple[int, ...], out_hw: tuple[int, int], kernel: tuple[int, int],
            stride: tuple[int, int], dilation: tuple[int, int]) -> Tensor:
    """The adjoint of _im2col: (G, Cg·KH·KW, N·OH·OW) columns summed back into the (N, C, H, W)
    padded input they were read from. One shifted term per kernel tap, each a single strided
    view of the columns (stride 1), so the sum is one kernel gathering KH·KW values per pixel."""
    n, c, h, w = shape
    (oh, ow), (kh, kw), (sh, sw), (dh, dw) = out_hw, kernel, stride, dilation
    cols = cols.reshape(c, kh, kw, n, oh, ow)
    total: Tensor | None = None
    for i in range(kh):
        for j in range(kw):
            part = cols.shrink(((0, c), (i, i + 1), (j, j + 1), (0, n), (0, oh), (0, ow))).reshape(c, n, oh, ow)
            part = part.permute(1, 0, 2, 3)                                       # N C OH OW
            if sh > 1 or sw > 1:  # spread the taps a stride apart
                part = part.reshape(n, c, oh, 1, ow, 1).pad(((0, 0), (0, 0), (0, 0), (0, sh - 1), (0, 0), (0, sw - 1)))
                part = part.reshape(n, c, oh * sh, ow * sw).shrink(((0, n), (0, c), (0, (oh - 1) * sh + 1), (0, (ow - 1) * sw + 1)))
            top, left = i * dh, j * dw
            part = part.pad(((0, 0), (0, 0), (top, h - top - part.shape[2]), (left, w - left - part.shape[3])))
            total = part if total is None else total + part
    assert total is not None
    return total


def conv_pixels_first(out_channels: int, pixels: int, kernel_area: int, groups: int, dtype: str = "float32") -> bool:
    """Whether a convolution's product runs turned around, pixels × weight (`conv2d`'s
    `packed_weight_t`), rather than weight × columns: where the output has few pixels for its
    channels, and channels enough to fill the kernel's vectors. The kernel vectorises the
    product's columns, NR (32 float32) at a time, so weight × columns of resnet18's 7x7 layers
    (49 pixels) computes 64 columns for 49; turned around the 512 channels are the columns and
    nothing is wasted. Kernel alone, one core, CPU time, pixels-first / weight-first (load 8-13 on
    2 CPUs): 512 channels 7x7 0.62-0.81, 256 at 14x14 0.89-0.91, 128 at 28x28 0.87-1.00 (batch 8:
    0.84-0.89) — but 64 channels at 56x56 1.11-1.19, where the pixels are many. The coverage
    set's 8-16-channel convolutions turned around lost (densenet 0.72-0.77x onnxruntime -> 0.90-0.92x):
    8 channels fill a quarter of a vector, hence at least 4·NR channels, a multiple of NR. A 1x1
    convolution's rows would gather single channels a plane apart, so only spatial kernels turn,
    and one group."""
    nr = DEFAULT_TILINGS[dtype].nr if dtype in DEFAULT_TILINGS else 0
    return (groups == 1 and kernel_area > 1 and nr > 0 and out_channels % nr == 0 and out_channels >= 4 * nr
            and pixels <= PIXELS_FIRST_PER_CHANNEL * out_channels)


def conv2d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride: Any = 1, padding: Any = 0,
           dilation: Any = 1, groups: int = 1, packed_weight: Tensor | None = None,
           packed_weight_t: Tensor | None = None) -> Tensor:
    """2-D cross-correlation (as torch.nn.functional.conv2d): im2col, then weights @ columns.

    `packed_weight`: the weight, a constant, packed at load per group (`pack_a_array` of each
    (OC/G, Cg·KH·KW) matrix, concatenated): where nothing needs a gradient and the product runs
    the native kernel, it reads that (`matmul_prepacked_a`) instead of packing the weight per call.
    `packed_weight_t` (one group only): the weight's (Cg·KH·KW, OC) transpose packed as B
    (`pack_b_array`): the product is then turned around, pixels × weight (`conv_pixels_first`
    says where that pays), each pixel's window gathered as a row of A, the output pixel-major.
    Either is read through `conv2d_prepacked`, as a caller holding only the packed form calls it.

    Its gradient is its own rule (autograd.custom_gradient), all matmuls on the packed kernel:
    weight gradient = columns @ output-gradientᵀ, input gradient = col2im(weightsᵀ @ output-gradient).
    The generic rule would scatter through the overlapping window view term by term."""
    _check_nchw(x, "conv2d")
    if weight.ndim != 4:
        raise ValueError(f"conv2d weight must be (out_channels, in_channels/groups, KH, KW), got shape {weight.shape}")
    n, c, _, _ = x.shape
    oc, cg, kh, kw = weight.shape
    if groups < 1 or c % groups or oc % groups or cg != c // groups:
        raise ValueError(f"conv2d: input channels {c}, weight shape {weight.shape} and groups={groups} do not match "
                         f"(need in_channels/groups == weight.shape[1] and out_channels divisible by groups)")
    if bias is not None and bias.shape != (oc,):
        raise ValueError(f"conv2d bias must have shape ({oc},), got {bias.shape}")
    (ph, pw), stride2, dilation2 = _pair(padding, "padding"), _pair(stride, "stride"), _pair(dilation, "dilation")
    dtype = dtypes.float_result(dtypes.result_type(x.dtype, weight.dtype))
    xs, ws = x.cast(dtype), weight.cast(dtype)
    bs = bias.cast(dtype) if bias is not None else None
    ocg, k = oc // groups, cg * kh * kw
    if _direct_depthwise(cg, groups) and not any(t is not None and t.requires_grad for t in (xs, ws, bs)):
        return _depthwise(xs.pad(((0, 0), (0, 0), (ph, ph), (pw, pw))), ws, bs, stride2, dilation2)
    inference = not any(t is not None and t.requires_grad for t in (xs, ws, bs))
    for packed, turned in ((packed_weight_t, True), (packed_weight, False)):
        if (packed is not None and inference
                and conv2d_reads_packed(xs, weight.shape, stride, padding, dilation, groups, turned=turned)):
            out = conv2d_prepacked(xs, packed, weight.shape, stride, padding, dilation, groups, turned=turned)
            return out if bs is None else out + bs.reshape(1, oc, 1, 1)
    with no_grad():
        padded = xs.pad(((0, 0), (0, 0), (ph, ph), (pw, pw)))
        cols = _im2col(padded, (kh, kw), stride2, dilation2, groups)             # G K (N OH OW)
        oh, ow = _windows_out(padded.shape, (kh, kw), stride2, dilation2)
        out = ws.reshape(groups, ocg, k).matmul(cols)                            # G OCg (N OH OW)
        out = out.reshape(oc, n, oh, ow).permute(1, 0, 2, 3)
        if bs is not None:
            out = out + bs.reshape(1, oc, 1, 1)

    # With stride and dilation 1 the input gradient is itself a convolution: of the output
    # gradient padded by K-1-P, with the weights flipped and their channel axes swapped. Its matmul
    # packs the gradient's windows in place, as the forward packs its columns; col2im would write
    # KH·KW values per input pixel (the matmul's output) and read them back.
    transposed = (xs.requires_grad and stride2 == (1, 1) and dilation2 == (1, 1) and groups == 1
                  and ph < kh and pw < kw)

    def rule(g: Tensor, w: Tensor, columns: Tensor) -> list[Tensor | None]:
        dx = dw = db = None
        if transposed:
            # the output gradient computed once, padded for the transposed convolution
            margin = ((0, 0), (0, 0), (kh - 1 - ph, kh - 1 - ph), (kw - 1 - pw, kw - 1 - pw))
            grad = g.pad(margin)._buffered()
            flipped = w._as_strided(w.shape, (cg * kh * kw, kh * kw, -kw, -1), (kh - 1) * kw + kw - 1)
            dx = conv2d(grad, flipped.permute(1, 0, 2, 3))
            g = grad.shrink(tuple((lo, lo + size) for (lo, _), size in zip(margin, g.shape)))  # read, not recomputed
        # the output gradient in the columns' pixel order: G OCg (N OH OW); permuted in 4-D so every
        # load of the graph computing it stays one strided view
        gt = g.permute(1, 0, 2, 3)._buffered().reshape(groups, ocg, n * oh * ow)
        if xs.requires_grad and not transposed:
            dcols = w.reshape(groups, ocg, k).permute(0, 2, 1).matmul(gt)        # G K (N OH OW)
            dx = _col2im(dcols, padded.shape, (oh, ow), (kh, kw), stride2, dilation2)
            dx = dx.shrink(((0, n), (0, c), (ph, ph + x.shape[2]), (pw, pw + x.shape[3])))
        if ws.requires_grad:
            dw = columns.matmul(gt.permute(0, 2, 1)).permute(0, 2, 1).reshape(oc, cg, kh, kw)
        if bs is not None and bs.requires_grad:
            db = gt.sum(axis=2).reshape(oc)
        return [dx, dw, db] if bs is not None else [dx, dw]

    inputs = [xs, ws] if bs is None else [xs, ws, bs]
    return custom_gradient(out, inputs, [ws, cols], rule)


def conv2d_reads_packed(x: Tensor, weight_shape: tuple[int, ...], stride: Any = 1, padding: Any = 0,
                        dilation: Any = 1, groups: int = 1, turned: bool = False) -> bool:
    """Whether `conv2d_prepacked` computes this convolution of x by a constant weight of
    `weight_shape` (x's dtype): no gradient to compute, not depthwise (computed directly), and a
    product the native kernel runs — weight × columns, or `turned` (one group), pixels × weight.
    Where it does, the weight's packed form is all it reads."""
    _check_nchw(x, "conv2d")
    oc, cg, kh, kw = weight_shape
    if x.requires_grad or _direct_depthwise(cg, groups) or groups < 1 or oc % groups or (turned and groups != 1):
        return False
    (ph, pw), stride2, dilation2 = _pair(padding, "padding"), _pair(stride, "stride"), _pair(dilation, "dilation")
    n, _, h, w = x.shape
    oh, ow = _windows_out((n, cg * groups, h + 2 * ph, w + 2 * pw), (kh, kw), stride2, dilation2)
    if turned:
        return prepacked_matmul_applies(n * oh * ow, cg * kh * kw, oc, x.dtype)
    return prepacked_matmul_applies(oc, cg * kh * kw, n * oh * ow, x.dtype)


def conv2d_prepacked(x: Tensor, packed_weight: Tensor, weight_shape: tuple[int, ...], stride: Any = 1,
                     padding: Any = 0, dilation: Any = 1, groups: int = 1, turned: bool = False) -> Tensor:
    """`conv2d(x, weight, None, …)` from the weight's packed form alone (`packed_weight`, as
    conv2d takes it, or with `turned` its `packed_weight_t`), where `conv2d_reads_packed` holds: a
    caller that packs a constant weight at load need not upload the weight itself as well
    (resnet18: 44 MB of fresh memory less per load)."""
    if not conv2d_reads_packed(x, weight_shape, stride, padding, dilation, groups, turned=turned):
        raise ValueError(f"conv2d_prepacked: a convolution of {x.shape} by a {weight_shape} weight (groups={groups}) "
                         "does not read a packed weight (conv2d_reads_packed): call conv2d with the weight")
    oc, cg, kh, kw = weight_shape
    if x.shape[1] != cg * groups:
        raise ValueError(f"conv2d: input channels {x.shape[1]}, weight shape {weight_shape} and groups={groups} do not match "
                         f"(need in_channels/groups == weight.shape[1] and out_channels divisible by groups)")
    (ph, pw), stride2, dilation2 = _pair(padding, "padding"), _pair(stride, "stride"), _pair(dilation, "dilation")
    padded = x.pad(((0, 0), (0, 0), (ph, ph), (pw, pw)))
    oh, ow = _windows_out(padded.shape, (kh, kw), stride2, dilation2)
    n, k = x.shape[0], cg * kh * kw
    if turned:  # pixels × weight: (N OH OW) K rows, each a window gathered from the padded input
        rows = _windows(padded, (kh, kw), stride2, dilation2).permute(0, 2, 3, 1, 4, 5).contiguous()
        return matmul_prepacked(rows.reshape(n * oh * ow, k), packed_weight, k, oc).reshape(n, oh, ow, oc).permute(0, 3, 1, 2)
    cols = _im2col(padded, (kh, kw), stride2, dilation2, groups)                 # G K (N OH OW)
    out = matmul_prepacked_a(packed_weight, cols, oc // groups, k)               # G OCg (N OH OW)
    return out.reshape(oc, n, oh, ow).permute(1, 0, 2, 3)


def _direct_depthwise(in_per_group: int, groups: int) -> bool:
    """Whether a convolution is depthwise (one input channel per group) and so computed directly."""
    return in_per_group == 1 and groups > 1


def _depthwise(padded: Tensor, weight: Tensor, bias: Tensor | None, stride: tuple[int, int],
               dilation: tuple[int, int]) -> Tensor:
    """A depthwise convolution (one input channel per group, `weight` (C·M, 1, KH, KW) for a
    channel multiplier M) of a padded input, computed directly: each output a sum of KH·KW products
    over its window, one reduce kernel reading the input in place. As im2col and a batched matmul
    it was a copy of the columns and a product per channel of 1×KH·KW by KH·KW×OH·OW (M = 1: no
    tile of the matmul kernel fits), several times the cost of the convolution itself (efficientnet's
    5x5 144-channel convolution: 21 µs of matmul and 2 µs of copy)."""
    n, c = padded.shape[:2]
    oc, _, kh, kw = weight.shape
    mult = oc // c
    # float16 taps are multiplied and summed in float32 and rounded once, as the matmul path does
    # (onnxruntime's CausalConvWithState fp16 cases differ in the last bit otherwise)
    narrow = padded.dtype if padded.dtype.is_narrow_float else None
    if narrow is not None:
        padded, weight = padded.cast(dtypes.float32), weight.cast(dtypes.float32)
    windows = _windows(padded, (kh, kw), stride, dilation)                      # N C OH OW KH KW
    oh, ow = windows.shape[2:4]
    taps = windows.reshape(n, c, 1, oh, ow, kh, kw) * weight.reshape(1, c, mult, 1, 1, kh, kw)
    out = taps.sum(axis=(5, 6)).reshape(n, oc, oh, ow)
    if narrow is not None:
        out = out.cast(narrow)
    # computed once into its own buffer: left inline, a consumer reading it twice (SiLU's
    # y * sigmoid(y)) recomputed the whole reduce in a second kernel (efficientnet, one thread,
    # CPU time per frame: batch 8 0.54 -> 0.41 ms, batch 1 0.08 -> 0.06)
    return (out if bias is None else out + bias.reshape(1, oc, 1, 1))._buffered()


def _pool_args(kernel_size: Any, stride: Any, padding: Any, dilation: Any = 1) -> tuple[tuple[int, int], ...]:
    kernel = _pair(kernel_size, "kernel_size")
    return kernel, _pair(stride if stride is not None else kernel, "stride"), _pair(padding, "padding"), _pair(dilation, "dilation")


def max_pool2d(x: Tensor, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1) -> Tensor:
    _check_nchw(x, "max_pool2d")
    kernel, stride2, (ph, pw), dilation2 = _pool_args(kernel_size, stride, padding, dilation)
    if ph > kernel[0] // 2 or pw > kernel[1] // 2:
        raise ValueError(f"max_pool2d: padding {padding} must be at most half the kernel size {kernel}")
    if stride2 == kernel and (ph, pw) == (0, 0) and dilation2 == (1, 1):
        with no_grad():
            out = _tiles(x, kernel).max(axis=(3, 5))
        return custom_gradient(out, [x], [x, out], lambda g, xv, outv: [_tiled_max_grad(g, xv, outv, kernel)])
    low = float("-inf") if x.dtype.is_float else 0 if x.dtype.kind in "bu" else -(1 << (x.dtype.itemsize * 8 - 1))
    padded = x.pad(((0, 0), (0, 0), (ph, ph), (pw, pw)), value=low)
    return _windows(padded, kernel, stride2, dilation2).max(axis=(4, 5))


def _tiles(x: Tensor, kernel: tuple[int, int]) -> Tensor:
    """(N, C, H, W) → (N, C, OH, KH, OW, KW): the windows that tile the input (rows and columns
    left over dropped), as a reshape — which, unlike the strided window view, is pushed through
    elementwise producers (an activation is computed inline, not stored first)."""
    n, c, h, w = x.shape
    (kh, kw), (oh, ow) = kernel, (h // kernel[0], w // kernel[1])
    return x.shrink(((0, n), (0, c), (0, oh * kh), (0, ow * kw))).reshape(n, c, oh, kh, ow, kw)


def _tiled_max_grad(g: Tensor, x: Tensor, out: Tensor, kernel: tuple[int, int]) -> Tensor:
    """Max-pool gradient for windows that tile the input (stride = kernel, no padding): each
    window's gradient goes to its maxima, split evenly between ties (as the generic reduce rule).
    Built in the (N, C, OH, KH, OW, KW) order, the input's own memory order (a free reshape), and
    left unbuffered: the next gradient kernel (an activation's) computes it inline. The generic
    rule goes through the window view's adjoint instead."""
    n, c, h, w = x.shape
    (kh, kw), (oh, ow) = kernel, out.shape[2:]
    tiles = _tiles(x, kernel)
    top = out.reshape(n, c, oh, 1, ow, 1)
    count: Tensor | None = None
    for i in range(kh):
        for j in range(kw):
            tap = tiles.shrink(((0, n), (0, c), (0, oh), (i, i + 1), (0, ow), (j, j + 1))) == top
            count = tap.cast(g.dtype) if count is None else count + tap.cast(g.dtype)
    share = g.reshape(n, c, oh, 1, ow, 1) / count
    grad = (tiles == top).where(share, 0).reshape(n, c, oh * kh, ow * kw)
    return grad.pad(((0, 0), (0, 0), (0, h - oh * kh), (0, w - ow * kw)))


def avg_pool2d(x: Tensor, kernel_size: Any, stride: Any = None, padding: Any = 0) -> Tensor:
    """Average over each window, zero padding counted (torch's count_include_pad=True)."""
    _check_nchw(x, "avg_pool2d")
    kernel, stride2, (ph, pw), dilation2 = _pool_args(kernel_size, stride, padding)
    if ph > kernel[0] // 2 or pw > kernel[1] // 2:
        raise ValueError(f"avg_pool2d: padding {padding} must be at most half the kernel size {kernel}")
    padded = x.cast(dtypes.float_result(x.dtype)).pad(((0, 0), (0, 0), (ph, ph), (pw, pw)))
    return _windows(padded, kernel, stride2, dilation2).mean(axis=(4, 5))


__all__ = ["avg_pool2d", "conv2d", "layernorm", "log_softmax", "matmul", "max_pool2d", "softmax"]
