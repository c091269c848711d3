"""The narrow dtypes (int8, int16, uint8 … uint64, float16) against numpy: elementwise ops,
casts, reductions, matmul, argmax and where, values and result dtypes.

Integer results must equal numpy's exactly, wrapping included; float16's basic arithmetic too
(both compute in float32 and round to float16 after every op); float16's transcendental ops and
sums within a few float16 ulps (numpy's loops and tinydist's polynomials / summation order differ).
Dtype pairs and values are drawn by hypothesis with a fixed seed and a bounded number of examples.
"""

from __future__ import annotations

import operator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tinydist as td

NEW = [np.int8, np.int16, np.uint8, np.uint16, np.uint32, np.uint64, np.float16]
ALL = NEW + [np.int32, np.int64, np.float32, np.float64, np.bool_]
IDS = [np.dtype(d).name for d in NEW]
BOUNDED = settings(max_examples=60, derandomize=True, deadline=None, database=None,
                   suppress_health_check=[HealthCheck.too_slow])


def sample(dtype, n, seed, edges=True, nonneg=False):
    """Random values of `dtype` over its whole range, with its extremes and zero among them."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(n) < 0.5
    if dtype.kind == "f":
        values = (rng.standard_normal(n) * 8).astype(dtype)
        if edges:
            values[:6] = [0.0, -0.0, 1.5, -2.5, 65504.0 if dtype == np.float16 else 1e6, 1e-3][:min(6, n)]
        return np.abs(values) if nonneg else values
    info = np.iinfo(dtype)
    values = rng.integers(0 if nonneg else info.min, info.max, n, dtype=dtype, endpoint=True)
    if edges:
        values[:4] = [0, 1, info.max, 0 if nonneg else info.min][:min(4, n)]
    return values


def check(result, expected, rtol=0.0):
    expected = np.asarray(expected)
    assert result.dtype.np == expected.dtype, (result.dtype, expected.dtype)
    got = result.numpy()
    assert got.shape == expected.shape
    if expected.dtype.kind == "f" and rtol:
        np.testing.assert_allclose(got.astype(np.float64), expected.astype(np.float64), rtol=rtol, atol=rtol, equal_nan=True)
    else:
        np.testing.assert_array_equal(got, expected)


BINARY = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
    "floordiv": operator.floordiv, "mod": operator.mod, "maximum": np.maximum, "minimum": np.minimum,
    "and": operator.and_, "or": operator.or_, "xor": operator.xor,
    "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge, "eq": operator.eq, "ne": operator.ne,
}


def _apply(name, a, b):
    op = BINARY[name]
    if isinstance(a, td.Tensor) and name in ("maximum", "minimum"):
        return getattr(a, name)(b)
    return op(a, b)


@pytest.mark.parametrize("name", list(BINARY))
@pytest.mark.parametrize("dtype", NEW, ids=IDS)
def test_binary_same_dtype_matches_numpy_exactly(dtype, name):
    a, b = sample(dtype, 64, 1), sample(dtype, 64, 2)
    with np.errstate(all="ignore"):
        try:
            expected = _apply(name, a, b)
        except TypeError:
            with pytest.raises(TypeError):
                _apply(name, td.Tensor(a), td.Tensor(b))
            return
    check(_apply(name, td.Tensor(a), td.Tensor(b)), expected)


@BOUNDED
@given(name=st.sampled_from(sorted(BINARY)), da=st.sampled_from(ALL), db=st.sampled_from(ALL), seed=st.integers(0, 2 ** 16))
def test_binary_mixed_dtypes_promote_as_numpy(name, da, db, seed):
    a, b = sample(da, 12, seed), sample(db, 12, seed + 1)
    with np.errstate(all="ignore"):
        try:
            expected = _apply(name, a, b)
        except TypeError:
            with pytest.raises(TypeError):
                _apply(name, td.Tensor(a), td.Tensor(b))
            return
    # float16 results of mixed operands: numpy may compute in a wider type than float32
    check(_apply(name, td.Tensor(a), td.Tensor(b)), expected, rtol=1e-3 if expected.dtype == np.float16 else 0)


@BOUNDED
@given(dtype=st.sampled_from(NEW), scalar=st.sampled_from([0, 1, 3, 100, -1, 2.5, True]),
       name=st.sampled_from(["add", "sub", "mul", "floordiv", "mod", "maximum", "lt", "eq"]))
def test_python_scalars_are_weak(dtype, scalar, name):
    a = sample(dtype, 16, 3)
    if np.dtype(dtype).kind in "iu" and not np.iinfo(dtype).min <= scalar <= np.iinfo(dtype).max:
        with pytest.raises(OverflowError):  # numpy 2 refuses it too (but compares it: a case left out)
            _apply(name, td.Tensor(a), scalar)
        return
    with np.errstate(all="ignore"):
        try:
            expected = _apply(name, a, scalar)
        except TypeError:
            with pytest.raises(TypeError):
                _apply(name, td.Tensor(a), scalar)
            return
    check(_apply(name, td.Tensor(a), scalar), expected)


UNARY = {
    "neg": (lambda t: -t, np.negative), "abs": (abs, np.abs), "invert": (operator.invert, np.invert),
    "floor": (lambda t: t.floor(), np.floor),
    "exp": (lambda t: t.exp(), np.exp), "log": (lambda t: t.log(), np.log), "sqrt": (lambda t: t.sqrt(), np.sqrt),
    "sin": (lambda t: t.sin(), np.sin), "cos": (lambda t: t.cos(), np.cos), "tanh": (lambda t: t.tanh(), np.tanh),
}


@pytest.mark.parametrize("name", list(UNARY))
@pytest.mark.parametrize("dtype", NEW, ids=IDS)
def test_unary(dtype, name):
    fn, fn_np = UNARY[name]
    x = sample(dtype, 64, 4, nonneg=name in ("log", "sqrt"))
    if np.dtype(dtype).kind == "f" and name in ("exp",):
        x = np.clip(x, -12, 11).astype(dtype)
    if np.dtype(dtype).kind in "iu" and name in ("sin", "cos"):
        x = x % 100  # past 2**48, sin and cos are NaN (docs/transcendentals.md)
    with np.errstate(all="ignore"):
        try:
            expected = fn_np(x)
        except TypeError:
            with pytest.raises(TypeError):
                fn(td.Tensor(x))
            return
    if name == "floor" and np.dtype(dtype).kind != "f":
        expected = x  # numpy >= 2.1 keeps integer dtypes; tinydist does too
    got = fn(td.Tensor(x))
    exact = name in ("neg", "abs", "invert", "floor")
    check(got, expected, rtol=0 if exact else 2e-3)


CAST_FLOATS = np.array([0.0, -0.0, 0.4, -0.6, 1.5, -2.5, 127.9, -128.9, 255.5, 300.7, -300.2, 65504.0, 70000.0, 1e10,
                        -1e10, np.inf, -np.inf, np.nan], np.float64)


@pytest.mark.parametrize("dst", ALL, ids=[np.dtype(d).name for d in ALL])
@pytest.mark.parametrize("src", ALL, ids=[np.dtype(d).name for d in ALL])
def test_cast_matches_numpy_astype(src, dst):
    """numpy's astype (ONNX's Cast reference): truncation toward zero, wrapping into narrow and
    unsigned ints (for |x| < 2**31), round-to-nearest-even into float16. Float → int out of those
    bounds is undefined behaviour in C, and numpy's result depends on which SIMD loop it takes
    (float32 1e10 → uint32 is 0, not 1e10 mod 2**32): those values are left out, as are
    out-of-range values into int32/int64, which tinydist saturates."""
    if np.dtype(src).kind == "f":
        with np.errstate(all="ignore"):
            x = CAST_FLOATS.astype(src)
        if np.dtype(dst).kind in "iu":
            info = np.iinfo(dst)
            bound = info.max if np.dtype(dst) in (np.dtype(np.int32), np.dtype(np.int64)) else 2 ** 31 - 1
            x = x[np.isfinite(x) & (np.abs(x.astype(np.float64)) < bound)]
    else:
        x = sample(src, 64, 5)
    with np.errstate(all="ignore"):
        expected = x.astype(dst)
    check(td.Tensor(x).cast(dst), expected)


SAME_SIZE = [(a, b) for a in ALL for b in ALL if np.dtype(a).itemsize == np.dtype(b).itemsize]


@pytest.mark.parametrize("src,dst", SAME_SIZE, ids=[f"{np.dtype(a).name}-{np.dtype(b).name}" for a, b in SAME_SIZE])
def test_bitcast_matches_numpy_view(src, dst):
    """bitcast is numpy's .view (ONNX BitCast's reference), in a fused kernel after an op of the
    source dtype: its bits, whatever they mean (NaNs compare equal as NaNs). Into bool only the
    bytes 0 and 1 are bools numpy can hold."""
    x = sample(src, 64, 7)
    if np.dtype(dst) == np.bool_:
        x = (np.arange(64) % 2).astype(src)
    t = td.Tensor(x)
    check((t.maximum(t) if np.dtype(src) != np.bool_ else t | t).bitcast(dst), x.view(dst))


def test_bitcast_in_a_chain_and_refused_sizes():
    """|x| by clearing the sign bit of the float32 bits, as the bit trick computes it; sizes that differ are refused."""
    x = sample(np.float32, 64, 3)
    got = (td.Tensor(x).bitcast(np.int32) & 0x7FFFFFFF).bitcast(np.float32)
    np.testing.assert_array_equal(got.numpy(), np.abs(x))
    with pytest.raises(ValueError, match="sizes must match"):
        td.Tensor(x).bitcast(np.int64)


def test_float64_to_float16_rounds_once():
    """Through float32 these would round twice: 1 + 2**-11 + 2**-40 is just above a float16 tie."""
    x = np.array([1 + 2.0 ** -11 + 2.0 ** -40, 65519.99, 65520.0, 2.0 ** -25, 2.0 ** -24 * 1.5], np.float64)
    with np.errstate(over="ignore"):
        expected = x.astype(np.float16)
    check(td.Tensor(x).cast(np.float16), expected)


@pytest.mark.parametrize("op", ["sum", "prod", "max", "min"])
@pytest.mark.parametrize("dtype", NEW, ids=IDS)
@pytest.mark.parametrize("axis", [None, 0, 1])
def test_reductions(dtype, op, axis):
    """sum and prod accumulate as numpy does: small signed ints in int64, unsigned in uint64."""
    x = sample(dtype, 6 * 40, 6, edges=np.dtype(dtype).kind != "f").reshape(6, 40)  # (65504 + 65504 is inf)
    if op == "prod":
        x = (x % 3).astype(dtype) if np.dtype(dtype).kind != "f" else (1 + np.clip(x, -1, 1) / 64).astype(dtype)
    with np.errstate(all="ignore"):
        expected = getattr(x, op)(axis=axis)
    got = getattr(td.Tensor(x), op)(axis=axis)
    if np.dtype(dtype) == np.float16 and op in ("sum", "prod"):
        # numpy's float16 sum: pairwise in float32 along a contiguous axis, float16 steps across rows
        scale = np.abs(x.astype(np.float64)).sum(axis=axis) + 1
        assert got.dtype == td.float16
        np.testing.assert_array_less(np.abs(got.numpy().astype(np.float64) - expected.astype(np.float64)), scale * 4e-3)
    else:
        check(got, expected)


@pytest.mark.parametrize("dtype", NEW, ids=IDS)
def test_mean_argmax_argmin_where(dtype):
    x = sample(dtype, 5 * 7, 7).reshape(5, 7)
    check(td.Tensor(x).argmax(axis=1), x.argmax(axis=1))
    check(td.Tensor(x).argmin(axis=0), x.argmin(axis=0))
    check(td.Tensor(x).argmax(), np.asarray(x.argmax()))
    mean = td.Tensor(x).mean(axis=1)
    assert mean.dtype.np == x.mean(axis=1).dtype
    np.testing.assert_allclose(mean.numpy().astype(np.float64), x.astype(np.float64).mean(axis=1), rtol=2e-3)
    cond = sample(np.bool_, 5 * 7, 8).reshape(5, 7)
    y = sample(dtype, 5 * 7, 9).reshape(5, 7)
    check(td.where(td.Tensor(cond), td.Tensor(x), td.Tensor(y)), np.where(cond, x, y))


@pytest.mark.parametrize("dtype", NEW, ids=IDS)
def test_matmul(dtype):
    """Integer matmul wraps in its dtype (as numpy's); float16 accumulates in float32, rounds once."""
    if np.dtype(dtype).kind == "f":
        a, b = sample(dtype, 9 * 33, 10, edges=False).reshape(9, 33), sample(dtype, 33 * 5, 11, edges=False).reshape(33, 5)
        expected = (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float16)
    else:
        a, b = sample(dtype, 9 * 33, 10).reshape(9, 33), sample(dtype, 33 * 5, 11).reshape(33, 5)
        expected = a @ b
    check(td.Tensor(a) @ td.Tensor(b), expected)


@pytest.mark.parametrize("dtype", NEW, ids=IDS)
def test_save_load_round_trip(dtype, tmp_path):
    x = sample(dtype, 30, 12).reshape(5, 6)
    td.save({"x": td.Tensor(x)}, tmp_path / "c.safetensors")
    back = td.load(tmp_path / "c.safetensors")["x"]
    check(back, x)


@pytest.mark.parametrize("dtype", NEW, ids=IDS)
def test_strided_and_fused_chains(dtype):
    """A transposed read and a fused chain (each float16 op rounds, as numpy's)."""
    x = sample(dtype, 8 * 9, 13).reshape(8, 9)
    with np.errstate(all="ignore"):
        expected = (x.T * x.T[0] + x.T[1]) // 3
    with np.errstate(all="ignore"):
        check((td.Tensor(x).T * td.Tensor(x).T[0] + td.Tensor(x).T[1]) // 3, expected)


_HALF_SCRIPT = """
import numpy as np
from tinydist.codegen import llvm_types
llvm_types._host_converts_half = lambda: {native}
import tinydist as td
every = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
got = td.Tensor(every).cast(np.float32).numpy()
assert np.array_equal(got, every.astype(np.float32), equal_nan=True)
assert np.array_equal(got.view(np.uint32)[~np.isnan(got)], every.astype(np.float32).view(np.uint32)[~np.isnan(got)])
rng = np.random.default_rng(0)
wide = np.concatenate([rng.standard_normal(1 << 16).astype(np.float32) * s for s in (1e-6, 1e-3, 1, 1e3, 6e4, 1e5)])
ties = (np.arange(1 << 16, dtype=np.uint32) << 13).view(np.float32) + 0  # float16 ties and near-ties
wide = np.concatenate([wide, ties, -ties, np.array([np.inf, -np.inf, np.nan, 65519.0, 65520.0, 2.0 ** -25], np.float32)])
with np.errstate(all="ignore"):
    want = wide.astype(np.float16)
out = td.Tensor(wide).cast(np.float16).numpy()
nan = np.isnan(want)
assert np.array_equal(np.isnan(out), nan)
assert np.array_equal(out.view(np.uint16)[~nan], want.view(np.uint16)[~nan]), np.flatnonzero(out.view(np.uint16) != want.view(np.uint16))[:5]
print("ok")
"""


@pytest.mark.parametrize("native", [True, False], ids=["hardware", "integer-ops"])
def test_float16_conversions_bit_exact(native, tmp_path):
    """Every float16 → float32, and float32 → float16 over many magnitudes and every tie, bit for
    bit with numpy — with the CPU's conversion instructions and with the integer-op fallback used
    where the CPU has none (run in a child: the kernels compile differently)."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, TINYDIST_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", _HALF_SCRIPT.format(native=native)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0 and "ok" in proc.stdout, (proc.returncode, proc.stderr[-2000:])


@pytest.mark.parametrize("dtype", NEW[:-1] + [np.int32, np.int64], ids=IDS[:-1] + ["int32", "int64"])
def test_shifts(dtype):
    """numpy's left_shift / right_shift, counts past the width (and negative ones) included."""
    x = sample(dtype, 64, 14)
    bits = np.dtype(dtype).itemsize * 8
    counts = np.resize(np.arange(-2, bits + 3), 64).astype(dtype) if np.dtype(dtype).kind == "i" else \
        np.resize(np.arange(0, bits + 3), 64).astype(dtype)
    check(td.Tensor(x) << td.Tensor(counts), np.left_shift(x, counts))
    check(td.Tensor(x) >> td.Tensor(counts), np.right_shift(x, counts))
    check(td.Tensor(x) >> 3, x >> 3)
    check(1 << td.Tensor(counts % 5), 1 << (counts % 5))
    with pytest.raises(TypeError):
        td.Tensor(x) << 1.5


# ---- bfloat16 (numpy's through ml_dtypes, registered on first use) ------------------------------

@pytest.fixture
def bf16():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    return np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("name", ["add", "sub", "mul", "truediv", "maximum", "lt", "eq"])
def test_bfloat16_arithmetic_is_ml_dtypes_bit_for_bit(bf16, name):
    rng = np.random.default_rng(15)
    a, b = (rng.standard_normal(300) * 20).astype(bf16), (rng.standard_normal(300) * 20).astype(bf16)
    got, want = _apply(name, td.Tensor(a), td.Tensor(b)), _apply(name, a, b)
    assert got.dtype.np == want.dtype
    np.testing.assert_array_equal(got.numpy().view(np.uint16 if want.dtype == bf16 else want.dtype), want.view(np.uint16)
                                  if want.dtype == bf16 else want)


def test_bfloat16_casts_round_to_nearest_even_once(bf16):
    rng = np.random.default_rng(16)
    x32 = np.concatenate([rng.standard_normal(1 << 14).astype(np.float32) * s for s in (1e-30, 1, 1e30)]
                         + [np.array([np.inf, -np.inf, np.nan, 3.4e38], np.float32)])
    x64 = np.array([1 + 2.0 ** -8 + 2.0 ** -40, 1e39, -1e39, np.nan, 1.00390625], np.float64)  # via float32: rounds twice
    for x in (x32, x64):
        with np.errstate(all="ignore"):
            want = x.astype(bf16)
        got = td.Tensor(x).cast("bfloat16").numpy()
        nan = np.isnan(want.astype(np.float32))
        np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
        np.testing.assert_array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])
    ints = np.arange(-300, 300, dtype=np.int16)
    np.testing.assert_array_equal(td.Tensor(ints).cast(td.bfloat16).numpy().view(np.uint16), ints.astype(bf16).view(np.uint16))
    np.testing.assert_array_equal(td.Tensor(ints.astype(bf16)).cast(np.int32).numpy(), ints.astype(bf16).astype(np.int32))


def test_bfloat16_promotion_reductions_and_checkpoints(bf16, tmp_path):
    rng = np.random.default_rng(17)
    a = rng.standard_normal((8, 50)).astype(bf16)
    assert td.Tensor(a).dtype is td.bfloat16 and td.bfloat16.np == bf16
    assert (td.Tensor(a) + td.Tensor(a.astype(np.float16))).dtype.np == (a + a.astype(np.float16)).dtype
    assert (td.Tensor(a) * 2.5).dtype is td.bfloat16
    total = td.Tensor(a).sum(axis=1)
    assert total.dtype is td.bfloat16
    np.testing.assert_allclose(total.numpy().astype(np.float64), a.astype(np.float64).sum(axis=1), rtol=1e-2, atol=0.05)
    check(td.Tensor(a).argmax(axis=1), a.argmax(axis=1))
    td.save({"a": td.Tensor(a)}, tmp_path / "bf.safetensors")
    np.testing.assert_array_equal(td.load(tmp_path / "bf.safetensors")["a"].numpy().view(np.uint16), a.view(np.uint16))
