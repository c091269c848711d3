"""Native kernels built from tinydist.codegen.transcendental, checked against numpy in float64.

float64 results are checked against numpy's libm (itself < 1 ulp), so the float64 bounds here
are the documented ones plus 1; the sub-ulp float64 measurements are in bench/ulp_table.py.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import math
import platform
import re

import numpy as np
import pytest
from llvmlite import ir

from tinydist.codegen import transcendental as T
from tinydist.codegen.compiler import HostCompiler
from tinydist.runtime.cpu.loader import native_loader
from tinydist.testing import transcendental_ir

_counter = itertools.count()
_compiler = HostCompiler()

REFERENCE = {"exp2": np.exp2, "exp": np.exp, "log2": np.log2, "log": np.log, "sin": np.sin, "cos": np.cos,
             "sqrt": np.sqrt, "tanh": np.tanh, "pow": np.power,
             "sigmoid": lambda x: np.where(x >= 0, 1 / (1 + np.exp(-np.abs(x))),
                                           np.exp(-np.abs(x)) / (1 + np.exp(-np.abs(x))))}
# max ulp asserted: float32 vs a float64 reference; float64 vs numpy (+1 for numpy's own error)
BOUND = {"exp2": (1, 2), "exp": (1, 2), "log2": (1, 2), "log": (1, 2), "sin": (0.5001, 2), "cos": (0.5001, 2),
         "sqrt": (0.5, 0.5), "pow": (0.5001, 2), "tanh": (2, 2.5), "sigmoid": (2.5, 2.5)}
DTYPES = [np.float32, np.float64]


def kernel_ir(name: str, dtype: type) -> tuple[str, str, int]:
    entry = f"test_{name}_{np.dtype(dtype).name}_{next(_counter)}"
    text, arity = transcendental_ir(name, dtype, entry)
    return text, entry, arity


_kernels: dict[tuple[str, type], object] = {}


def run(name: str, dtype: type, *arrays) -> np.ndarray:
    if (name, dtype) not in _kernels:
        text, entry, arity = kernel_ir(name, dtype)
        _kernels[name, dtype] = native_loader.load(_compiler.compile(text), entry, ["w"] + ["r"] * arity + ["i64"])
    arrays = [np.ascontiguousarray(a, dtype=dtype) for a in arrays]
    out = np.empty_like(arrays[0])
    _kernels[name, dtype].cfunc(out.ctypes.data, *(a.ctypes.data for a in arrays), out.size)
    return out


def max_ulp(got: np.ndarray, exact: np.ndarray, dtype: type) -> float:
    info = np.finfo(dtype)
    exact = np.asarray(exact, np.float64)
    finite = np.isfinite(exact)
    assert np.array_equal(got[~finite], exact[~finite].astype(dtype), equal_nan=True)
    e = np.floor(np.log2(np.maximum(np.abs(exact[finite]), float(info.smallest_normal))))
    return float(np.max(np.abs(got[finite].astype(np.float64) - exact[finite]) / np.exp2(e - info.nmant), initial=0))


def sample(name: str, dtype: type, rng: np.random.Generator, n: int = 20000) -> list[np.ndarray]:
    if name == "pow":
        return [np.exp2(rng.uniform(-8, 8, n)), rng.uniform(-8, 8, n)]
    if name in ("log", "log2", "sqrt"):
        bits = (rng.integers(0x00800000, 0x7F800000, n, dtype=np.uint32).view(np.float32) if dtype == np.float32
                else rng.integers(0x0010000000000000, 0x7FF0000000000000, n, dtype=np.uint64).view(np.float64))
        return [bits]
    lo, hi = {"exp2": (-149, 127), "exp": (-103, 88), "sin": (-1e6, 1e6), "cos": (-1e6, 1e6), "tanh": (-12, 12),
              "sigmoid": (-80, 80)}[name]
    if dtype == np.float64 and name in ("exp2", "exp"):
        lo, hi = (-1074, 1023) if name == "exp2" else (-744, 709)
    return [rng.uniform(lo, hi, n)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name", sorted(BOUND))
def test_accuracy(name: str, dtype: type) -> None:
    rng = np.random.default_rng(7)
    args = [a.astype(dtype) for a in sample(name, dtype, rng)]
    with np.errstate(all="ignore"):
        exact = REFERENCE[name](*(a.astype(np.float64) for a in args))
    assert max_ulp(run(name, dtype, *args), exact, dtype) <= BOUND[name][dtype == np.float64]


def same(got: np.ndarray, want: list[float]) -> bool:
    """Bitwise-equal up to NaN payload, so the sign of zero counts."""
    want = np.array(want, dtype=got.dtype)
    return bool(np.all((got == want) & (np.signbit(got) == np.signbit(want)) | (np.isnan(got) & np.isnan(want))))


INF, NAN = math.inf, math.nan
SPECIAL_IN = [NAN, INF, -INF, 0.0, -0.0]
SPECIAL_OUT = {
    "exp2": [NAN, INF, 0.0, 1.0, 1.0], "exp": [NAN, INF, 0.0, 1.0, 1.0],
    "log2": [NAN, INF, NAN, -INF, -INF], "log": [NAN, INF, NAN, -INF, -INF],
    "sin": [NAN, NAN, NAN, 0.0, -0.0], "cos": [NAN, NAN, NAN, 1.0, 1.0], "sqrt": [NAN, INF, NAN, 0.0, -0.0],
    "tanh": [NAN, 1.0, -1.0, 0.0, -0.0], "sigmoid": [NAN, 1.0, 0.0, 0.5, 0.5],
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name", sorted(SPECIAL_OUT))
def test_special_values(name: str, dtype: type) -> None:
    assert same(run(name, dtype, np.array(SPECIAL_IN)), SPECIAL_OUT[name])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_overflow_underflow_and_subnormals(dtype: type) -> None:
    info = np.finfo(dtype)
    tiny = float(info.smallest_subnormal)
    # exp2 lands exactly on subnormal powers of two and rounds below the smallest one to zero
    emin = -149 if dtype == np.float32 else -1074
    assert same(run("exp2", dtype, np.array([emin, emin + 3, emin - 1.5, -(info.maxexp + 2 * info.nmant), info.maxexp])),
                [tiny, 8 * tiny, 0.0, 0.0, INF])
    assert same(run("exp", dtype, np.array([1000.0, -1000.0])), [INF, 0.0])
    # log2 of subnormals is exact on powers of two and accurate elsewhere
    assert same(run("log2", dtype, np.array([tiny, 2 * tiny, 2.0 ** (emin + 10)])), [emin, emin + 1, emin + 10])
    subs = (np.arange(1, 4000) * tiny * 997).astype(dtype)
    for name in ("log", "log2"):
        assert max_ulp(run(name, dtype, subs), REFERENCE[name](subs.astype(np.float64)), dtype) <= 2
    # sin x == x and tanh x == x for subnormal x, with the sign
    assert same(run("sin", dtype, -subs), list(-subs))
    assert same(run("tanh", dtype, subs), list(subs))
    assert same(run("log", dtype, np.array([-tiny, -1.0])), [NAN, NAN])


_libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
FE_UNDERFLOW = 0x10  # x86's (fenv.h)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86's FE_UNDERFLOW value")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name", ["exp", "exp2", "sigmoid"])
def test_results_that_are_zero_underflow_nothing(name: str, dtype: type) -> None:
    # far below the range (below _Format.exp_clamp), e**x is 0 without an underflowing multiply, which
    # costs an x86 core a microcode assist per lane (a softmax over a -3.4e38 causal mask ran 4x slower)
    big = float(np.finfo(dtype).max)
    x = np.array([-big, -INF, -1e4, -5000.0, -big / 3] * 4, dtype)
    run(name, dtype, x[:1])  # compiled and loaded before the flags are cleared
    out = np.empty_like(x)
    kernel = _kernels[name, dtype].cfunc
    _libm.feclearexcept(FE_UNDERFLOW)
    kernel(out.ctypes.data, x.ctypes.data, x.size)
    raised = _libm.fetestexcept(FE_UNDERFLOW)
    assert same(out, [0.0] * x.size)
    assert not raised, f"{name} {np.dtype(dtype).name} underflowed on its way to 0"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_sin_cos_large_arguments(dtype: type) -> None:
    # the floats nearest to k*pi/2 (maximal cancellation in the reduction), up to the claimed limit
    ks = np.unique(np.geomspace(1, T.SIN_COS_ACCURATE_LIMIT / (math.pi / 2), 400).astype(np.int64))
    x = (ks * (math.pi / 2)).astype(dtype)
    x = np.concatenate([x, np.nextafter(x, dtype(np.inf)), np.array([1e14, 2.0 ** 47], dtype)])
    x = x[x <= T.SIN_COS_ACCURATE_LIMIT]
    for name in ("sin", "cos"):
        assert max_ulp(run(name, dtype, x), REFERENCE[name](x.astype(np.float64)), dtype) <= BOUND[name][dtype == np.float64]
    big = np.array([T.SIN_COS_ACCURATE_LIMIT * 2, -np.finfo(dtype).max], dtype)
    assert np.isnan(run("sin", dtype, big)).all() and np.isnan(run("cos", dtype, big)).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_pow_special_cases(dtype: type) -> None:
    grid = np.array([0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 0.5, -0.5, INF, -INF, NAN, 3.0, -3.0, 2.5], dtype)
    x, y = (a.ravel() for a in np.meshgrid(grid, grid))
    x = np.concatenate([x, np.array([-2.0, -2.0, -0.5, 10.0, 10.0, -10.0], dtype)])
    y = np.concatenate([y, np.array([3.0, 0.5, -3.0, 400.0, -400.0, -401.0], dtype)])
    with np.errstate(all="ignore"):
        want = np.power(x.astype(np.float64), y.astype(np.float64))  # C99 pow
    got = run("pow", dtype, x, y)
    exact = ~np.isfinite(want) | (want == 0) | (np.abs(want) == 1) | ~np.isfinite(want.astype(dtype))
    assert same(got[exact], list(want[exact].astype(dtype)))
    assert max_ulp(got[~exact], want[~exact], dtype) <= BOUND["pow"][dtype == np.float64]


def test_exp_float32_vectorises_without_calls() -> None:
    text, _, _ = kernel_ir("exp", np.float32)
    asm = _compiler.assembly(text)
    assert re.search(r"%[yz]mm\d+", asm), "no 256/512-bit vector registers in the exp kernel"
    assert not re.search(r"^\s*call", asm, re.M), "exp kernel calls out"


def test_no_fast_math_flags_and_no_external_symbols() -> None:
    for name in sorted(BOUND):
        text, _, _ = kernel_ir(name, np.float32)
        assert not re.search(r"\b(fast|nnan|ninf|reassoc)\b", text)
        declared = re.findall(r"^declare .*@\"?([\w.]+)", text, re.M)
        assert all(d.startswith("llvm.") for d in declared), declared


def test_vector_operands() -> None:
    # the emitters accept vector types directly, not just scalars the vectoriser widens
    module = ir.Module()
    vty = ir.VectorType(ir.DoubleType(), 4)
    fn = ir.Function(module, ir.FunctionType(vty, [vty]), f"vec_{next(_counter)}")
    b = ir.IRBuilder(fn.append_basic_block())
    b.ret(T.log(b, T.exp(b, fn.args[0])))
    assert "<4 x double>" in str(module)
    _compiler.compile(str(module))
    with pytest.raises(TypeError):
        T.exp(b, ir.Constant(ir.IntType(32), 1))
