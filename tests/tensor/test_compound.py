"""Compound ops (matmul, softmax, layernorm, conv2d, pooling) and factories against numpy references."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import tinydist as td

RNG = np.random.default_rng(1234)


def check(result: td.Tensor, expected, rtol=1e-4, atol=1e-5) -> None:
    expected = np.asarray(expected)
    assert result.shape == expected.shape, (result.shape, expected.shape)
    assert result.dtype.np == expected.dtype, (result.dtype, expected.dtype)
    got = result.numpy()
    if expected.dtype.kind == "f":
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol)
    else:
        np.testing.assert_array_equal(got, expected)


def rand(shape, dtype=np.float32):
    if np.dtype(dtype).kind == "i":
        return RNG.integers(-5, 6, size=shape).astype(dtype)
    return RNG.standard_normal(shape).astype(dtype)


# ---- matmul -------------------------------------------------------------------------------------

MATMUL_SHAPES = [
    ((5,), (5,)), ((5,), (5, 3)), ((4, 5), (5,)), ((4, 5), (5, 3)), ((1, 1), (1, 1)), ((2, 4, 5), (5, 3)),
    ((4, 5), (2, 5, 3)), ((2, 4, 5), (2, 5, 3)), ((3, 1, 4, 5), (2, 5, 3)), ((1, 4, 5), (3, 5, 2)),
    ((2, 3, 4), (4,)), ((4,), (2, 4, 3)), ((17, 33), (33, 9)), ((3, 0), (0, 4)), ((0, 3), (3, 2)),
]


@pytest.mark.parametrize("shapes", MATMUL_SHAPES, ids=str)
@pytest.mark.parametrize("da,db", [(np.float32, np.float32), (np.float64, np.float64), (np.int32, np.int32),
                                   (np.float32, np.float64), (np.int32, np.float32), (np.int64, np.int32)],
                         ids=["f32", "f64", "i32", "f32f64", "i32f32", "i64i32"])
def test_matmul(shapes, da, db):
    a, b = rand(shapes[0], da), rand(shapes[1], db)
    expected = np.matmul(a, b)
    rtol = 1e-4 if expected.dtype == np.float32 else 1e-10
    check(td.Tensor(a) @ td.Tensor(b), expected, rtol=rtol, atol=rtol)
    check(td.Tensor(a).matmul(td.Tensor(b)), expected, rtol=rtol, atol=rtol)


def test_matmul_of_computed_and_transposed():
    a, b = rand((6, 4)), rand((6, 5))
    check((td.Tensor(a) * 2).T @ (td.Tensor(b) + 1), (a * 2).T @ (b + 1))
    check(td.Tensor(a).T @ td.Tensor(a), a.T @ a)
    check((td.Tensor(a) @ td.Tensor(a).T).sum(1), (a @ a.T).sum(1))
    check(td.Tensor(a)[1:, ::2].T @ td.Tensor(b)[1:, 1:4], a[1:, ::2].T @ b[1:, 1:4])
    check(td.Tensor(a) @ a.T, a @ a.T)  # numpy operand on the right


@pytest.mark.parametrize("m,k,n", [(9, 4096, 16), (2, 1024, 3), (16, 2048, 16)])
def test_matmul_few_outputs_long_reduction(m, k, n):
    # computed as dot products (no packing), operands given transposed as in a weight gradient
    a, b = rand((m, k)), rand((n, k))
    check(td.Tensor(a) @ td.Tensor(b).T, a @ b.T, rtol=1e-4, atol=1e-4)
    check(td.Tensor(a).T.T @ (td.Tensor(b) * 2).T, a @ (b * 2).T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("a_shape,n", [((4, 5), 3), ((2, 9, 70), 33), ((3, 1, 130), 2100), ((64, 384), 200), ((2, 1, 6, 40), 129)],
                         ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_matmul_prepacked_is_matmul(a_shape, n, dtype):
    """B packed once (as a weight at load) and multiplied by the packed kernel: the bits of the
    plain matmul (packing does not reorder the reduction), numpy's float64 product within rounding."""
    from tinydist.codegen.matmul_packing import pack_b_array
    from tinydist.frontend.functional import matmul_prepacked
    k = a_shape[-1]
    a, b = rand(a_shape, dtype), rand((k, n), dtype)
    got = matmul_prepacked(td.Tensor(a), td.Tensor(pack_b_array(b)), k, n)
    np.testing.assert_array_equal(got.numpy(), (td.Tensor(a) @ td.Tensor(b)).numpy())
    rtol = 1e-4 if dtype == np.float32 else 1e-10
    check(got, (a.astype(np.float64) @ b).astype(dtype), rtol=rtol, atol=rtol * np.sqrt(k))


def test_matmul_prepacked_refuses_what_it_cannot_read():
    from tinydist.codegen.matmul_packing import pack_b_array
    from tinydist.frontend.functional import matmul_prepacked
    a, b = rand((4, 5)), rand((5, 3))
    packed = td.Tensor(pack_b_array(b))
    with pytest.raises(ValueError, match=r"\(…, M, 6\)"):
        matmul_prepacked(td.Tensor(a), packed, 6, 3)
    with pytest.raises(ValueError, match="float64"):
        matmul_prepacked(td.Tensor(a.astype(np.float64)), packed, 5, 3)
    with pytest.raises(ValueError, match="pack_b_array"):
        matmul_prepacked(td.Tensor(a), td.Tensor(b.reshape(-1)), 5, 3)
    x = td.Tensor(a, requires_grad=True)
    with pytest.raises(NotImplementedError, match="matmul_prepacked"):
        matmul_prepacked(x, packed, 5, 3).sum().backward()


def test_numpy_array_on_the_left_defers_to_tensor():
    x = rand((3, 3))
    assert isinstance(x @ td.Tensor(x), td.Tensor)
    assert isinstance(x + td.Tensor(x), td.Tensor)


def test_matmul_bool():
    a, b = RNG.random((3, 4)) < 0.5, RNG.random((4, 2)) < 0.5
    check(td.Tensor(a) @ td.Tensor(b), a @ b)


# ---- softmax / log_softmax / layernorm ------------------------------------------------------

X3 = (RNG.standard_normal((3, 4, 5)) * 3).astype(np.float32)


def np_softmax(x, axis):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def np_log_softmax(x, axis):
    s = x - x.max(axis, keepdims=True)
    return s - np.log(np.exp(s).sum(axis, keepdims=True))


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softmax_log_softmax(axis, dtype):
    x = X3.astype(dtype)
    ref = x.astype(np.float64)
    check(td.Tensor(x).softmax(axis), np_softmax(ref, axis).astype(dtype), rtol=1e-5, atol=1e-6)
    check(td.Tensor(x).log_softmax(axis), np_log_softmax(ref, axis).astype(dtype), rtol=1e-5, atol=1e-5)


def test_softmax_extremes_and_ints():
    x = np.array([[1000.0, 0.0, -1000.0], [-np.inf, 0.0, 1.0], [5.0, 5.0, 5.0]], np.float32)
    with np.errstate(all="ignore"):
        check(td.Tensor(x).softmax(-1), np_softmax(x.astype(np.float64), -1).astype(np.float32), rtol=1e-5, atol=1e-6)
    i = np.arange(6, dtype=np.int32).reshape(2, 3)
    check(td.Tensor(i).softmax(1), np_softmax(i.astype(np.float64), 1), rtol=1e-12, atol=1e-14)
    check(td.Tensor(i).softmax(), np_softmax(i.astype(np.float64), -1), rtol=1e-12, atol=1e-14)


def np_layernorm(x, axis, eps):
    x = x.astype(np.float64)
    mean = x.mean(axis, keepdims=True)
    var = ((x - mean) ** 2).mean(axis, keepdims=True)
    return (x - mean) / np.sqrt(var + eps)


@pytest.mark.parametrize("axis", [-1, 0, 1, (1, 2), (0, 2)], ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_layernorm(axis, dtype):
    x = X3.astype(dtype)
    check(td.Tensor(x).layernorm(axis), np_layernorm(x, axis, 1e-5).astype(dtype), rtol=1e-4, atol=1e-5)
    check(td.Tensor(x).layernorm(axis, eps=0.5), np_layernorm(x, axis, 0.5).astype(dtype), rtol=1e-4, atol=1e-5)


def test_layernorm_default_and_int():
    x = X3
    check(td.Tensor(x).layernorm(), np_layernorm(x, -1, 1e-5).astype(np.float32), rtol=1e-4, atol=1e-5)
    i = np.arange(12, dtype=np.int64).reshape(3, 4)
    check(td.Tensor(i).layernorm(), np_layernorm(i, -1, 1e-5), rtol=1e-10, atol=1e-12)


# ---- conv2d -------------------------------------------------------------------------------------

def pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


def np_conv2d(x, w, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """Direct float64 cross-correlation with torch semantics."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    (sh, sw), (ph, pw), (dh, dw) = pair(stride), pair(padding), pair(dilation)
    n, c, h, wid = x.shape
    oc, cg, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (wid + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    out = np.zeros((n, oc, oh, ow))
    ocg = oc // groups
    for o in range(oc):
        g = o // ocg
        for i, j in itertools.product(range(kh), range(kw)):
            patch = xp[:, g * cg:(g + 1) * cg, i * dh: i * dh + sh * (oh - 1) + 1: sh, j * dw: j * dw + sw * (ow - 1) + 1: sw]
            out[:, o] += np.einsum("nchw,c->nhw", patch, w[o, :, i, j])
    if bias is not None:
        out += bias.astype(np.float64).reshape(1, oc, 1, 1)
    return out


CONV_CASES = [
    dict(x=(1, 1, 5, 5), w=(1, 1, 3, 3)),
    dict(x=(2, 3, 7, 6), w=(4, 3, 3, 2)),
    dict(x=(2, 3, 7, 6), w=(4, 3, 3, 3), stride=2),
    dict(x=(2, 3, 7, 6), w=(4, 3, 3, 3), padding=1),
    dict(x=(2, 3, 7, 6), w=(4, 3, 3, 3), padding=(2, 0), stride=(1, 2)),
    dict(x=(1, 2, 9, 9), w=(3, 2, 3, 3), dilation=2),
    dict(x=(1, 2, 9, 8), w=(3, 2, 2, 3), dilation=(2, 1), padding=1, stride=2),
    dict(x=(2, 4, 6, 6), w=(6, 2, 3, 3), groups=2),
    dict(x=(1, 4, 5, 5), w=(4, 1, 3, 3), groups=4, padding=1),   # depthwise
    dict(x=(2, 6, 9, 8), w=(12, 1, 5, 5), groups=6, padding=2, stride=2),          # depthwise, 2 per channel
    dict(x=(1, 3, 9, 9), w=(3, 1, 3, 2), groups=3, padding=(1, 2), dilation=(2, 1)),
    dict(x=(2, 3, 4, 4), w=(5, 3, 1, 1)),                        # pointwise
    dict(x=(1, 2, 3, 3), w=(2, 2, 3, 3)),                        # output 1x1
]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_conv2d(case, bias):
    case = dict(case)
    x, w = rand(case.pop("x")), rand(case.pop("w"))
    b = rand((w.shape[0],)) if bias else None
    expected = np_conv2d(x, w, b, **case)
    got = td.Tensor(x).conv2d(td.Tensor(w), td.Tensor(b) if bias else None, **case)
    check(got, expected.astype(np.float32), rtol=1e-4, atol=1e-4)


def test_conv2d_float64_and_computed_input():
    x, w = rand((2, 3, 6, 6), np.float64), rand((4, 3, 3, 3), np.float64)
    check(td.Tensor(x).conv2d(td.Tensor(w), padding=1), np_conv2d(x, w, padding=1), rtol=1e-10, atol=1e-10)
    xs = rand((2, 3, 6, 6))
    w32 = w.astype(np.float32)
    got = (td.Tensor(xs) * 2 - 1).relu().conv2d(td.Tensor(w32), stride=2)
    check(got, np_conv2d(np.maximum(xs * 2 - 1, 0), w32, stride=2).astype(np.float32), rtol=1e-4, atol=1e-4)


def test_conv2d_int_input_gives_float64():
    x = np.arange(32, dtype=np.int32).reshape(1, 2, 4, 4)
    w = np.ones((1, 2, 2, 2), np.int32)
    check(td.Tensor(x).conv2d(td.Tensor(w)), np_conv2d(x, w), rtol=1e-12, atol=1e-12)


# ---- pooling ------------------------------------------------------------------------------------

def np_pool(x, kernel, stride=None, padding=0, dilation=1, op="max"):
    (kh, kw) = pair(kernel)
    (sh, sw) = pair(stride if stride is not None else kernel)
    (ph, pw), (dh, dw) = pair(padding), pair(dilation)
    fill = -np.inf if op == "max" else 0.0
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=fill)
    n, c, h, w = xp.shape
    oh, ow = (h - dh * (kh - 1) - 1) // sh + 1, (w - dw * (kw - 1) - 1) // sw + 1
    windows = np.stack([xp[:, :, i * dh: i * dh + sh * (oh - 1) + 1: sh, j * dw: j * dw + sw * (ow - 1) + 1: sw]
                        for i in range(kh) for j in range(kw)], axis=-1)
    return windows.max(-1) if op == "max" else windows.mean(-1)


POOL_CASES = [dict(kernel=2), dict(kernel=3, stride=1), dict(kernel=(2, 3), stride=(1, 2)), dict(kernel=3, padding=1),
              dict(kernel=3, stride=2, padding=1), dict(kernel=(3, 2), padding=(1, 0))]


@pytest.mark.parametrize("case", POOL_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("op", ["max", "avg"])
def test_pool2d(op, case):
    x = rand((2, 3, 7, 6))
    kwargs = {k: v for k, v in case.items() if k != "kernel"}
    expected = np_pool(x, case["kernel"], op=op, **kwargs).astype(np.float32)
    got = getattr(td.Tensor(x), f"{op}_pool2d")(case["kernel"], **kwargs)
    check(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_max_pool2d_padding_keeps_dtype(dtype):
    x = np.arange(2 * 5 * 5, dtype=dtype).reshape(1, 2, 5, 5)
    check(td.Tensor(x).max_pool2d(3, stride=1, padding=1), np_pool(x, 3, 1, padding=1).astype(dtype))


def test_max_pool2d_dilation_and_int():
    x = rand((1, 2, 8, 8))
    check(td.Tensor(x).max_pool2d(2, stride=2, dilation=2), np_pool(x, 2, 2, dilation=2).astype(np.float32), rtol=1e-6)
    i = np.arange(2 * 2 * 5 * 5, dtype=np.int32).reshape(2, 2, 5, 5) * -1
    check(td.Tensor(i).max_pool2d(3, stride=1), np_pool(i, 3, 1).astype(np.int32))
    check(td.Tensor(i).max_pool2d(3, stride=1, padding=1), np_pool(i, 3, 1, padding=1).astype(np.int32))
    check(td.Tensor(i).avg_pool2d(2), np_pool(i, 2, op="avg"), rtol=1e-12)


# ---- factories ----------------------------------------------------------------------------------

def test_factories():
    check(td.Tensor.zeros(2, 3), np.zeros((2, 3), np.float32))
    check(td.Tensor.zeros((2, 3), dtype=td.int32), np.zeros((2, 3), np.int32))
    check(td.Tensor.ones(4), np.ones(4, np.float32))
    check(td.Tensor.ones(2, 2, dtype=np.bool_), np.ones((2, 2), bool))
    check(td.Tensor.full((2, 3), 7), np.full((2, 3), 7))
    check(td.Tensor.full((2, 3), 1.5), np.full((2, 3), 1.5))
    check(td.Tensor.full((2,), True), np.full((2,), True))
    check(td.Tensor.full(3, -2, dtype=td.float32), np.full(3, -2, np.float32))
    check(td.Tensor.full((2, 2), float("nan")) != 0, np.full((2, 2), True))
    check(td.Tensor.arange(5), np.arange(5))
    check(td.Tensor.arange(2, 11, 3), np.arange(2, 11, 3))
    check(td.Tensor.arange(0, 1, 0.25), np.arange(0, 1, 0.25))
    check(td.Tensor.arange(5, dtype=td.float32), np.arange(5, dtype=np.float32))
    check(td.Tensor.eye(3), np.eye(3, dtype=np.float32))
    check(td.Tensor.eye(2, 4, dtype=td.int64), np.eye(2, 4, dtype=np.int64))
    check(td.Tensor.zeros(0, 3), np.zeros((0, 3), np.float32))
    check(td.Tensor.zeros(2, 3) + td.Tensor.ones(3), np.zeros((2, 3), np.float32) + 1)
    assert td.Tensor.zeros(2, device="CPU:1").device == "CPU:1"


def test_rand_randn_reproducible():
    td.manual_seed(42)
    a, b = td.Tensor.rand(3, 4), td.Tensor.randn(3, 4)
    td.manual_seed(42)
    a2, b2 = td.Tensor.rand(3, 4), td.Tensor.randn(3, 4)
    np.testing.assert_array_equal(a.numpy(), a2.numpy())
    np.testing.assert_array_equal(b.numpy(), b2.numpy())
    assert a.dtype == td.float32 and b.dtype == td.float32 and a.shape == (3, 4)
    assert not np.array_equal(a.numpy(), td.Tensor.rand(3, 4).numpy())  # the stream moves on
    td.manual_seed(7)
    c = td.Tensor.rand(1000, dtype=td.float64).numpy()
    assert c.dtype == np.float64 and (c >= 0).all() and (c < 1).all() and 0.4 < c.mean() < 0.6
    d = td.Tensor.randn(2000).numpy()
    assert abs(d.mean()) < 0.1 and 0.9 < d.std() < 1.1
    td.manual_seed(42)
    np.testing.assert_array_equal(td.Tensor.rand((3, 4)).numpy(), a.numpy())


# ---- devices ------------------------------------------------------------------------------------

def test_to_other_device_and_compute_there():
    a = rand((3, 4))
    t = (td.Tensor(a) * 2).to("CPU:1")
    assert t.device == "CPU:1"
    check(t + td.Tensor(np.ones((3, 4), np.float32), device="CPU:1"), a * 2 + 1)
    check(t.to("CPU:0").sum(), np.asarray((a * 2).sum()))
    assert td.Tensor(a).to("CPU").device == "CPU:0"
    td.synchronize()
