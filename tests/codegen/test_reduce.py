"""The fused reduction kernel the group-segment collectives use: bitwise numpy's result, in place too."""

from __future__ import annotations

import numpy as np
import pytest

from tinydist.codegen.reduce import reduce_ir, supported
from tinydist.runtime.compiler import host_reduce

UFUNCS = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}
COMPILED = [(op, dtype) for dtype in ("f4", "f8", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8")
            for op in UFUNCS if supported(op, np.dtype(dtype))]


def sources(dtype: np.dtype, count: int, n: int, offset: int, seed: int) -> list[np.ndarray]:
    """`count` arrays of `n` elements starting `offset` elements into their allocation (misaligned)."""
    rng = np.random.default_rng(seed)
    if dtype.kind == "f":
        return [rng.uniform(0.5, 1.5, n + offset).astype(dtype)[offset:] for _ in range(count)]
    info = np.iinfo(dtype)   # the whole range: sums and products wrap, as numpy's do
    return [rng.integers(info.min, info.max, n + offset, dtype=dtype, endpoint=True)[offset:] for _ in range(count)]


def expected(op: str, srcs: list[np.ndarray]) -> np.ndarray:
    acc = UFUNCS[op](srcs[0], srcs[1])
    for src in srcs[2:]:
        acc = UFUNCS[op](acc, src)
    return acc


def test_covers_sum_prod_everywhere_and_integer_max_min() -> None:
    assert {op for op, dtype in COMPILED if dtype == "f4"} == {"sum", "prod"}
    assert {op for op, dtype in COMPILED if dtype == "i8"} == {"sum", "prod", "max", "min"}
    assert not supported("sum", np.dtype("f2")) and not supported("sum", np.dtype(bool))
    assert not supported("sum", np.dtype(">f4")) and not supported("avg", np.dtype("f4"))
    with pytest.raises(ValueError, match="max over float32 is not compiled"):
        reduce_ir("k", "max", np.dtype("f4"), 2, 1)
    with pytest.raises(ValueError, match="needs >= 2 sources and 1 or 2 outputs, got 1 and 1"):
        reduce_ir("k", "sum", np.dtype("f4"), 1, 1)


@pytest.mark.parametrize("op,dtype", COMPILED)
@pytest.mark.parametrize("count", [2, 3, 4])
@pytest.mark.parametrize("n,offset", [(0, 0), (1, 1), (67, 3), ((1 << 16) + 13, 1)])
def test_matches_numpy_bitwise_into_both_outputs(op: str, dtype: str, count: int, n: int, offset: int) -> None:
    dt = np.dtype(dtype)
    srcs = sources(dt, count, n, offset, seed=count * 1000 + n)
    want = expected(op, srcs)
    d0, d1 = np.zeros(n + 2, dt), np.zeros(n + 5, dt)
    host_reduce(op, dt, count, 2).cfunc(d0.ctypes.data, d1[3:].ctypes.data, *[s.ctypes.data for s in srcs], n)
    np.testing.assert_array_equal(d0[:n].view(np.uint8), want.view(np.uint8))
    np.testing.assert_array_equal(d1[3:3 + n].view(np.uint8), want.view(np.uint8))
    assert not d0[n:].any() and not d1[:3].any() and not d1[3 + n:].any()   # nothing written outside


@pytest.mark.parametrize("op,dtype", [("sum", "f4"), ("prod", "f8"), ("max", "i8"), ("min", "u2")])
def test_in_place_into_the_first_source(op: str, dtype: str) -> None:
    dt = np.dtype(dtype)
    srcs = sources(dt, 3, 100_003, 0, seed=7)
    want = expected(op, srcs)
    host_reduce(op, dt, 3, 1).cfunc(srcs[0].ctypes.data, *[s.ctypes.data for s in srcs], srcs[0].size)
    np.testing.assert_array_equal(srcs[0].view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("shift", [0, 4, 20])
def test_a_result_not_aligned_to_its_element_size(shift: int) -> None:
    """A float64 result 4 bytes off its element alignment gets no aligned head: still every element right."""
    dt, n = np.dtype("f8"), 1000
    srcs = sources(dt, 2, n, 0, seed=shift)
    raw = np.zeros(n * 8 + 64, np.uint8)
    host_reduce("sum", dt, 2, 1).cfunc(raw.ctypes.data + shift, *[s.ctypes.data for s in srcs], n)
    got = np.frombuffer(raw[shift:shift + n * 8].tobytes(), dt)
    np.testing.assert_array_equal(got.view(np.uint8), expected("sum", srcs).view(np.uint8))
    assert not raw[:shift].any() and not raw[shift + n * 8:].any()
