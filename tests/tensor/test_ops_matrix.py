"""Op x dtype x broadcast matrix against numpy: values and result dtypes.

Every result is compared with numpy's on the same inputs; result dtypes must be numpy's.
The narrower dtypes (int8 … uint64, float16) have their own matrix in test_dtype_matrix.py.
"""

from __future__ import annotations

import operator

import numpy as np
import pytest

import tinydist as td

DTYPES = [np.float32, np.float64, np.int32, np.int64, np.bool_]
DT_IDS = ["f32", "f64", "i32", "i64", "bool"]


def sample(dtype, shape, seed=0, nonneg=False):
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if dtype.kind == "f":
        # multiples of 0.5 in [-4, 4]: ties for comparisons, exact-ish arithmetic, zeros included
        values = rng.integers(-8, 9, size=shape) / 2
        return np.abs(values).astype(dtype) if nonneg else values.astype(dtype)
    values = rng.integers(0 if nonneg else -6, 7, size=shape)
    return values.astype(dtype)


def tol(dtype):
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        return dict(rtol=1e-5, atol=1e-6)
    if dtype == np.float64:
        return dict(rtol=1e-12, atol=1e-14)
    return dict(rtol=0, atol=0)


def check(result: td.Tensor, expected, tolerance=None):
    expected = np.asarray(expected)
    assert result.shape == expected.shape, (result.shape, expected.shape)
    assert result.dtype.np == expected.dtype, (result.dtype, expected.dtype)
    got = result.numpy()
    assert got.dtype == expected.dtype
    if expected.dtype.kind == "f":
        np.testing.assert_allclose(got, expected, equal_nan=True, **(tolerance or tol(expected.dtype)))
    else:
        np.testing.assert_array_equal(got, expected)


# ---- binary ops -------------------------------------------------------------------------------

BINARY = {
    "add": (operator.add, np.add),
    "sub": (operator.sub, np.subtract),
    "mul": (operator.mul, np.multiply),
    "truediv": (operator.truediv, np.true_divide),
    "floordiv": (operator.floordiv, np.floor_divide),
    "mod": (operator.mod, np.remainder),
    "pow": (operator.pow, np.power),
    "maximum": (lambda a, b: a.maximum(b), np.maximum),
    "minimum": (lambda a, b: a.minimum(b), np.minimum),
    "and": (operator.and_, np.bitwise_and),
    "or": (operator.or_, np.bitwise_or),
    "xor": (operator.xor, np.bitwise_xor),
    "lt": (operator.lt, np.less),
    "le": (operator.le, np.less_equal),
    "gt": (operator.gt, np.greater),
    "ge": (operator.ge, np.greater_equal),
    "eq": (operator.eq, np.equal),
    "ne": (operator.ne, np.not_equal),
}


def numpy_binary(name, a, b):
    """numpy's result, or the exception class numpy raises."""
    with np.errstate(all="ignore"):
        try:
            return BINARY[name][1](a, b)
        except TypeError:
            return TypeError
        except ValueError:
            return ValueError


@pytest.mark.parametrize("name", list(BINARY))
@pytest.mark.parametrize("db", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("da", DTYPES, ids=DT_IDS)
def test_binary_dtype_pairs(name, da, db):
    a = sample(da, (3, 4), seed=1)
    b = sample(db, (3, 4), seed=2, nonneg=(name == "pow"))
    expected = numpy_binary(name, a, b)
    op = BINARY[name][0]
    if expected is TypeError:
        with pytest.raises(TypeError):
            op(td.Tensor(a), td.Tensor(b))
        return
    check(op(td.Tensor(a), td.Tensor(b)), expected)


def test_bool_minus_bool_raises():
    t = td.Tensor(np.array([True, False]))
    with pytest.raises(TypeError):
        t - t


BROADCAST_SHAPES = [((3, 4), (4,)), ((4,), (3, 4)), ((2, 1, 4), (3, 1)), ((3, 1), (1, 5)), ((1,), (2, 3)),
                    ((), (2, 3)), ((2, 3), ()), ((2, 0, 3), (1, 3))]


@pytest.mark.parametrize("name", ["add", "sub", "mul", "truediv", "floordiv", "mod", "maximum", "lt", "eq", "and"])
@pytest.mark.parametrize("shapes", BROADCAST_SHAPES, ids=str)
@pytest.mark.parametrize("da,db", [(np.float32, np.float32), (np.int32, np.float64), (np.int64, np.int32)],
                         ids=["f32f32", "i32f64", "i64i32"])
def test_binary_broadcast(name, shapes, da, db):
    a, b = sample(da, shapes[0], seed=3), sample(db, shapes[1], seed=4)
    expected = numpy_binary(name, a, b)
    op = BINARY[name][0]
    if expected is TypeError:
        with pytest.raises(TypeError):
            op(td.Tensor(a), td.Tensor(b))
        return
    check(op(td.Tensor(a), td.Tensor(b)), expected)


SCALARS = [2, -3, 0, 2.5, -0.5, True, False]


@pytest.mark.parametrize("scalar", SCALARS, ids=repr)
@pytest.mark.parametrize("name", ["add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "maximum", "lt", "ge",
                                  "eq", "and", "or", "xor"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("side", ["left", "right"])
def test_binary_python_scalar(side, dtype, name, scalar):
    a = sample(dtype, (2, 3), seed=5, nonneg=(name == "pow" and side == "right"))
    if name == "pow" and side == "right" and isinstance(scalar, (int, float)) and not isinstance(scalar, bool) and scalar < 0 \
            and np.dtype(dtype).kind in "ib":
        pytest.skip("integers to negative integer powers: numpy raises ValueError (tested in test_errors-like tests)")
    if name == "pow" and side == "left" and np.dtype(dtype).kind in "ib":
        a = np.abs(a) if dtype is not np.bool_ else a
    fn_np = BINARY[name][1]
    op = BINARY[name][0]
    with np.errstate(all="ignore"):
        try:
            expected = fn_np(a, scalar) if side == "right" else fn_np(scalar, a)
        except TypeError:
            expected = TypeError
        except (ValueError, OverflowError):
            pytest.skip("numpy rejects this value")
    t = td.Tensor(a)
    if name in ("maximum",) and side == "left":
        pytest.skip("maximum has no reflected form")
    build = (lambda: op(t, scalar)) if side == "right" else (lambda: op(scalar, t))
    if expected is TypeError:
        with pytest.raises(TypeError):
            build()
        return
    check(build(), expected)


@pytest.mark.parametrize("op", [operator.and_, operator.or_, operator.xor], ids=["and", "or", "xor"])
def test_reflected_bitwise_with_python_scalar(op):
    a = np.array([1, 2, 3, -4], np.int32)
    check(op(3, td.Tensor(a)), op(3, a))


@pytest.mark.parametrize("name", ["add", "mul", "truediv", "maximum", "lt", "floordiv"])
@pytest.mark.parametrize("d0,d1", [(np.float64, np.float32), (np.int64, np.int32), (np.int32, np.float32),
                                   (np.float32, np.int64), (np.bool_, np.int32)], ids=str)
def test_zero_dim_tensors_are_strong(name, d0, d1):
    """0-d tensors take part in promotion with their own dtype (unlike Python scalars)."""
    a = np.asarray(sample(d0, (), seed=6) if d0 is not np.bool_ else True, dtype=d0)
    b = sample(d1, (2, 3), seed=7)
    op = BINARY[name][0]
    with np.errstate(all="ignore"):
        expected = BINARY[name][1](a, b)
        expected_rev = BINARY[name][1](b, a)
    check(op(td.Tensor(a), td.Tensor(b)), expected)
    check(op(td.Tensor(b), td.Tensor(a)), expected_rev)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_zero_dim_tensor_keeps_shape(dtype):
    a = np.asarray(1, dtype=dtype)
    assert td.Tensor(a).shape == ()
    check(td.Tensor(a) + td.Tensor(a), np.asarray(a + a))


def test_zero_dim_from_full_and_reductions():
    s = td.Tensor.full((), 2.5)
    assert s.shape == () and s.dtype == td.float64
    check(s * s, np.asarray(6.25))
    check(td.Tensor(np.arange(4, dtype=np.float32)).sum() + 1, np.asarray(np.float32(7)))
    assert td.Tensor(np.arange(4, dtype=np.float32)).sum().item() == 6.0


def test_numpy_scalar_operands_are_strong():
    a = sample(np.float32, (2, 3))
    check(td.Tensor(a) + np.float64(1.5), a + np.float64(1.5))
    i = sample(np.int32, (2, 3))
    check(td.Tensor(i) * np.int64(3), i * np.int64(3))


# ---- integer division and modulo ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_int_floordiv_mod_signs_and_zero(dtype):
    a = np.array([7, -7, 7, -7, 0, 5, -5, 0, 6, -6], dtype)
    b = np.array([2, 2, -2, -2, 3, 0, 0, 0, -3, 3], dtype)
    with np.errstate(all="ignore"):
        check(td.Tensor(a) // td.Tensor(b), a // b)
        check(td.Tensor(a) % td.Tensor(b), a % b)
        check(td.Tensor(a) // 0, a // 0)
        check(td.Tensor(a) % 0, a % 0)
        check(7 // td.Tensor(b), 7 // b)
        check(-7 % td.Tensor(b), -7 % b)


_INT_MIN_SCRIPT = """
import numpy as np, tinydist as td
dtype = np.{dtype}
low = np.iinfo(dtype).min
a = np.array([low, low, 5], dtype)
b = np.array([-1, 1, -1], dtype)
with np.errstate(all="ignore"):
    fd, md = a // b, a % b
got_fd = (td.Tensor(a) // td.Tensor(b)).numpy()
got_md = (td.Tensor(a) % td.Tensor(b)).numpy()
assert (got_fd == fd).all() and got_fd.dtype == fd.dtype, (got_fd, fd)
assert (got_md == md).all(), (got_md, md)
print("ok")
"""


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_int_min_floordiv_minus_one_wraps(dtype, tmp_path):
    # run in a child: the bug is a hardware trap that would kill the test process
    import os
    import subprocess
    import sys
    env = dict(os.environ, TINYDIST_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", _INT_MIN_SCRIPT.format(dtype=dtype)], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 0 and "ok" in proc.stdout, (proc.returncode, proc.stderr[-2000:])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_float_floordiv_mod_signs_and_zero(dtype):
    a = np.array([7.5, -7.5, 7.5, -7.5, 0.0, -0.0, 5.0, -5.0, 0.0, 6.0, np.inf, 3.0, np.nan, 0.25], dtype)
    b = np.array([2.0, 2.0, -2.0, -2.0, 3.0, 3.0, 0.0, 0.0, 0.0, -3.0, 2.0, np.inf, 1.0, -0.5], dtype)
    with np.errstate(all="ignore"):
        fd, md = a // b, a % b
    check(td.Tensor(a) // td.Tensor(b), fd)
    check(td.Tensor(a) % td.Tensor(b), md)
    # the sign of a zero remainder follows the divisor
    got = (td.Tensor(a) % td.Tensor(b)).numpy()
    zero = md == 0
    np.testing.assert_array_equal(np.signbit(got[zero]), np.signbit(md[zero]))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_float_floordiv_by_infinity(dtype):
    a = np.array([1.0, -1.0, 5.0, -5.0], dtype)
    b = np.array([-np.inf, np.inf, np.inf, -np.inf], dtype)
    with np.errstate(all="ignore"):
        check(td.Tensor(a) // td.Tensor(b), a // b)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_float_mod_by_infinity(dtype):
    a = np.array([1.0, -1.0, 5.0, -5.0, 0.0], dtype)
    b = np.array([-np.inf, np.inf, np.inf, -np.inf, np.inf], dtype)
    with np.errstate(all="ignore"):
        check(td.Tensor(a) % td.Tensor(b), a % b)


# ---- comparisons with NaN -----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["lt", "le", "gt", "ge", "eq", "ne", "maximum", "minimum"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_comparisons_with_nan_and_inf(name, dtype):
    a = np.array([np.nan, 1.0, np.nan, np.inf, -np.inf, 0.0, -0.0, 2.0], dtype)
    b = np.array([1.0, np.nan, np.nan, np.inf, np.inf, -0.0, 0.0, 2.0], dtype)
    op = BINARY[name][0]
    check(op(td.Tensor(a), td.Tensor(b)), BINARY[name][1](a, b))
    check(op(td.Tensor(a), float("nan")), BINARY[name][1](a, float("nan")))


# ---- unary ops --------------------------------------------------------------------------------

def np_sigmoid(x):
    x = np.asarray(x)
    out_dtype = x.dtype if x.dtype.kind == "f" else np.float64
    x = x.astype(out_dtype)
    with np.errstate(all="ignore"):
        return (1 / (1 + np.exp(-x))).astype(out_dtype)


UNARY = {
    "neg": (lambda t: -t, np.negative),
    "abs": (lambda t: abs(t), np.abs),
    "exp": (lambda t: t.exp(), np.exp),
    "log": (lambda t: t.log(), np.log),
    "sqrt": (lambda t: t.sqrt(), np.sqrt),
    "sin": (lambda t: t.sin(), np.sin),
    "cos": (lambda t: t.cos(), np.cos),
    "tanh": (lambda t: t.tanh(), np.tanh),
    "sigmoid": (lambda t: t.sigmoid(), np_sigmoid),
    "relu": (lambda t: t.relu(), lambda x: np.maximum(x, 0)),
    "exp2": (lambda t: t.exp2(), np.exp2),
    "log2": (lambda t: t.log2(), np.log2),
    "floor": (lambda t: t.floor(), np.floor),
    "invert": (lambda t: ~t, np.invert),
}
FLOAT_RESULT = {"exp", "log", "sqrt", "sin", "cos", "tanh", "sigmoid", "exp2", "log2"}


def unary_sample(dtype):
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return np.array([-3.5, -1.0, -0.25, 0.0, 0.5, 1.0, 2.0, 7.25, 30.0, -30.0], dtype)
    if dtype == np.bool_:
        return np.array([True, False, True, False])
    return np.array([-7, -1, 0, 1, 2, 5, 20], dtype)


def unary_tol(dtype, name):
    if np.dtype(dtype) == np.float16:
        return dict(rtol=1e-3, atol=1e-4)
    if np.dtype(dtype) == np.float32:
        return dict(rtol=1e-5, atol=1e-6)
    return dict(rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", list(UNARY))
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_unary(name, dtype):
    x = unary_sample(dtype)
    fn, fn_np = UNARY[name]
    with np.errstate(all="ignore"):
        try:
            expected = fn_np(x)
        except TypeError:
            with pytest.raises(TypeError):
                fn(td.Tensor(x))
            return
    if name == "floor" and np.dtype(dtype).kind in "ib":
        # numpy >= 2.1 keeps the integer dtype for floor of integers; bool → float16 in older numpy
        expected = x if dtype is not np.bool_ else expected
    result = fn(td.Tensor(x))
    if name == "floor" and dtype is np.bool_:
        assert result.dtype in (td.bool_, td.float64)
        np.testing.assert_array_equal(result.numpy(), x)
        return
    check(result, expected, unary_tol(expected.dtype, name) if expected.dtype.kind == "f" else None)


EDGE = [np.nan, np.inf, -np.inf, 0.0, -0.0, -1.0, -2.5, 1e-30, 1e30, 88.0, -88.0, 700.0, -700.0, 1e-300]


@pytest.mark.parametrize("name", ["neg", "abs", "exp", "log", "sqrt", "sin", "cos", "tanh", "sigmoid", "relu",
                                  "exp2", "log2", "floor"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_unary_domain_edges(name, dtype):
    with np.errstate(all="ignore"):
        x = np.array(EDGE, dtype)
        fn, fn_np = UNARY[name]
        expected = fn_np(x)
    got = fn(td.Tensor(x))
    assert got.dtype.np == expected.dtype
    out = got.numpy()
    if name in ("sin", "cos"):  # documented (docs/transcendentals.md): NaN for finite |x| > 2**48
        big = np.abs(x) > 2.0 ** 48
        assert np.isnan(out[big]).all()
        np.testing.assert_allclose(out[~big], expected[~big], equal_nan=True, **unary_tol(dtype, name))
    else:
        np.testing.assert_allclose(out, expected, equal_nan=True, **unary_tol(dtype, name))
    # zeros keep numpy's sign for the sign-exact ops
    if name in ("neg", "abs", "sqrt", "floor", "relu"):
        finite_zero = expected == 0
        np.testing.assert_array_equal(np.signbit(out[finite_zero]), np.signbit(expected[finite_zero]),
                                      err_msg=f"sign of zero differs for {name}")


# ---- where --------------------------------------------------------------------------------------

@pytest.mark.parametrize("db", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("da", DTYPES, ids=DT_IDS)
def test_where_mixed_dtypes(da, db):
    cond = sample(np.bool_, (3, 4), seed=8)
    a, b = sample(da, (4,), seed=9), sample(db, (3, 1), seed=10)
    check(td.where(td.Tensor(cond), td.Tensor(a), td.Tensor(b)), np.where(cond, a, b))
    check(td.Tensor(cond).where(td.Tensor(a), td.Tensor(b)), np.where(cond, a, b))


@pytest.mark.parametrize("cond_dtype", [np.float32, np.int32, np.bool_])
def test_where_non_bool_condition(cond_dtype):
    cond = np.array([0, 1, 2, 0], cond_dtype) if cond_dtype is not np.bool_ else np.array([0, 1, 1, 0], bool)
    a, b = np.arange(4, dtype=np.float32), -np.arange(4, dtype=np.float32)
    check(td.where(td.Tensor(cond), td.Tensor(a), td.Tensor(b)), np.where(cond, a, b))


@pytest.mark.parametrize("scalars", [(1, 2.5), (1, 2), (True, 0), (0.5, -1.5)], ids=repr)
@pytest.mark.parametrize("dtype", [np.float64, np.int64, np.bool_], ids=["f64", "i64", "bool"])
def test_where_scalar_branch(dtype, scalars):
    cond = sample(np.bool_, (2, 3), seed=11)
    a = sample(dtype, (2, 3), seed=12)
    check(td.where(td.Tensor(cond), td.Tensor(a), scalars[0]), np.where(cond, a, scalars[0]))
    check(td.where(td.Tensor(cond), scalars[1], td.Tensor(a)), np.where(cond, scalars[1], a))


@pytest.mark.parametrize("dtype,scalars", [(np.float32, (1, 2)), (np.float32, (0.5, -1.5)), (np.int32, (1, 2))],
                         ids=["f32-int", "f32-float", "i32-int"])
def test_where_scalar_branch_is_weak(dtype, scalars):
    """numpy: a Python scalar branch adopts the other (tensor) branch's dtype kind when it can."""
    cond = sample(np.bool_, (2, 3), seed=11)
    a = sample(dtype, (2, 3), seed=12)
    check(td.where(td.Tensor(cond), td.Tensor(a), scalars[0]), np.where(cond, a, scalars[0]))
    check(td.where(td.Tensor(cond), scalars[1], td.Tensor(a)), np.where(cond, scalars[1], a))


def test_where_both_scalars():
    cond = sample(np.bool_, (2, 3), seed=11)
    check(td.where(td.Tensor(cond), 1, 2.5), np.where(cond, 1, 2.5))
    check(td.where(td.Tensor(cond), 1, 2), np.where(cond, 1, 2))


# ---- casts --------------------------------------------------------------------------------------

def cast_sample(src):
    src = np.dtype(src)
    if src.kind == "f":
        return np.array([-2.75, -1.5, -0.5, -0.0, 0.0, 0.25, 0.99, 1.5, 2.5, 1e6, np.nan, np.inf, -np.inf], src)
    if src == np.bool_:
        return np.array([True, False, True])
    info = np.iinfo(src)
    return np.array([info.min, -(2 ** 20) - 3, -1, 0, 1, 7, 2 ** 24 + 1, info.max], src)


@pytest.mark.parametrize("dst", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("src", DTYPES, ids=DT_IDS)
def test_cast_matrix(src, dst):
    x = cast_sample(src)
    if np.dtype(src).kind == "f" and np.dtype(dst).kind == "i":
        x = x[np.isfinite(x)]  # NaN / inf → int is undefined in numpy
    with np.errstate(all="ignore"):
        expected = x.astype(dst)
    check(td.Tensor(x).cast(dst), expected)
    td_dtype = {"float32": td.float32, "float64": td.float64, "int32": td.int32, "int64": td.int64,
                "bool": td.bool_}[np.dtype(dst).name]
    check(td.Tensor(x).cast(td_dtype), expected)
    check((td.Tensor(x) + 0 if np.dtype(src) != np.bool_ else td.Tensor(x) | False).cast(td_dtype),
          expected)  # a cast fused after computation


def test_cast_of_computed_and_float_to_int_truncates():
    x = np.array([-2.9, -2.1, -0.9, 0.9, 2.1, 2.9], np.float32)
    check((td.Tensor(x) * 1).cast(td.int32), (x * 1).astype(np.int32))
    check(td.Tensor(x).astype(np.int64) + 1, x.astype(np.int64) + 1)


def test_nan_casts_to_true():
    x = np.array([np.nan, 0.0, -0.0, 1e-45], np.float32)
    check(td.Tensor(x).cast(td.bool_), x.astype(bool))


# ---- reductions ---------------------------------------------------------------------------------

AXES = [None, 0, 1, -1, (0, 2), (1, 2), (0, 1, 2), ()]
REDUCE = {
    "sum": (lambda t, ax, kd: t.sum(ax, keepdim=kd), lambda x, ax, kd: np.sum(x, ax, keepdims=kd)),
    "mean": (lambda t, ax, kd: t.mean(ax, keepdim=kd), lambda x, ax, kd: np.mean(x, ax, keepdims=kd)),
    "max": (lambda t, ax, kd: t.max(ax, keepdim=kd), lambda x, ax, kd: np.max(x, ax, keepdims=kd)),
    "min": (lambda t, ax, kd: t.min(ax, keepdim=kd), lambda x, ax, kd: np.min(x, ax, keepdims=kd)),
    "prod": (lambda t, ax, kd: t.prod(ax, keepdim=kd), lambda x, ax, kd: np.prod(x, ax, keepdims=kd)),
}


def reduce_sample(dtype):
    x = sample(dtype, (2, 3, 4), seed=13)
    if np.dtype(dtype).kind == "i":
        x = np.clip(x, -2, 2).astype(dtype)  # prod stays small
    return x


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("axis", AXES, ids=str)
@pytest.mark.parametrize("name", list(REDUCE))
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_reductions(dtype, name, axis, keepdim):
    x = reduce_sample(dtype)
    fn, fn_np = REDUCE[name]
    expected = np.asarray(fn_np(x, axis, keepdim))
    check(fn(td.Tensor(x), axis, keepdim), expected)


@pytest.mark.parametrize("name", ["sum", "max", "min", "prod", "mean"])
def test_reductions_of_computed_values(name):
    x = sample(np.float32, (2, 3, 4), seed=14)
    fn, fn_np = REDUCE[name]
    check(fn(td.Tensor(x) * 2 + 1, 1, False), fn_np(x * 2 + 1, 1, False))
    check(fn(td.Tensor(x) * 2 + 1, None, False) * 3, fn_np(x * 2 + 1, None, False) * np.float32(3))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_reductions_propagate_nan(dtype):
    x = np.array([[1.0, np.nan, 3.0], [-np.inf, 2.0, np.inf]], dtype)
    for name in REDUCE:
        fn, fn_np = REDUCE[name]
        for axis in (None, 0, 1):
            with np.errstate(all="ignore"):
                expected = np.asarray(fn_np(x, axis, False))
            check(fn(td.Tensor(x), axis, False), expected)


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("axis", [None, 0, 1, -1, 2], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("name", ["argmax", "argmin"])
def test_argmax_argmin(name, dtype, axis, keepdim):
    x = sample(dtype, (2, 3, 4), seed=15)
    if np.dtype(dtype).kind in "if":
        x = np.clip(x, -1, 1).astype(dtype)  # many ties: first occurrence must win
    expected = getattr(np, name)(x, axis=axis, keepdims=keepdim)
    check(getattr(td.Tensor(x), name)(axis, keepdim), np.asarray(expected))


def test_argmax_none_keepdim_shape():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert td.Tensor(x).argmax(None, keepdim=True).shape == np.argmax(x, keepdims=True).shape


@pytest.mark.parametrize("name", ["argmax", "argmin"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_argmax_argmin_nan_is_first(name, dtype):
    x = np.array([[1.0, np.nan, 5.0, np.nan], [np.inf, 2.0, np.inf, -np.inf], [-np.inf, -np.inf, 0.0, 0.0]], dtype)
    for axis in (None, 0, 1):
        check(getattr(td.Tensor(x), name)(axis), np.asarray(getattr(np, name)(x, axis=axis)))


def test_empty_reductions():
    x = np.zeros((0, 3), np.float32)
    t = td.Tensor(x)
    check(t.sum(), np.sum(x))
    check(t.sum(0), np.sum(x, 0))
    check(t.sum(1), np.sum(x, 1))
    check(t.prod(0), np.prod(x, 0))
    check(t.max(1), np.max(x, 1))  # reduces non-empty axes of an empty tensor: fine
    check(td.Tensor(np.zeros((0,), np.int32)).sum(), np.sum(np.zeros((0,), np.int32)))
    check(td.Tensor(np.zeros((2, 0), bool)).sum(1, keepdim=True), np.sum(np.zeros((2, 0), bool), 1, keepdims=True))
    for op in ("max", "min"):
        with pytest.raises(ValueError):
            getattr(t, op)()
        with pytest.raises(ValueError):
            getattr(t, op)(0)
    with pytest.raises(ValueError):
        t.argmax(0)
    with np.errstate(all="ignore"), pytest.warns(RuntimeWarning):
        expected = np.mean(x, 0)
    check(t.mean(0), expected)
