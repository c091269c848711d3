"""Float sums stay accurate at scale: the error against float64 is within a few ulp × log2(n) of
the sum of magnitudes, where a sequential float32 accumulator drifts with n (relative error 2e-4
at 1e6 elements, 3e-2 at 1e8, and 2**29 for the sum of 2**32 ones, before the cascade)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import tinydist as td

EPS32 = float(np.finfo(np.float32).eps)


def _bound(values: np.ndarray, count: int) -> float:
    """A few ulp per level of the cascade, plus the in-block additions (lanes of 1,024 elements)."""
    return EPS32 * (math.log2(count) + 16) * float(np.abs(values.astype(np.float64)).sum())


@pytest.mark.parametrize("n", [1025, 65_537, 1_000_003])
def test_sum_within_the_bound(n: int) -> None:
    values = np.random.default_rng(n).standard_normal(n, dtype=np.float32)
    got = float(td.Tensor(values).sum().numpy())
    assert abs(got - values.astype(np.float64).sum()) <= _bound(values, n)


def test_sum_of_1e8_elements_against_float64() -> None:
    values = np.random.default_rng(8).random(10 ** 8, dtype=np.float32)
    exact = values.astype(np.float64).sum()
    got = float(td.Tensor(values).sum().numpy())
    assert abs(got - exact) <= _bound(values, values.size)
    assert abs(got - exact) / exact < 1e-6   # the sequential accumulator was off by ~1e-2 here


def test_mean_of_1e7_elements_against_float64() -> None:
    values = np.random.default_rng(7).random(10 ** 7, dtype=np.float32) + 1000
    got = float(td.Tensor(values).mean().numpy())
    assert abs(got - values.astype(np.float64).mean()) <= _bound(values, values.size) / values.size


def test_sum_of_2_to_the_32_ones_is_exact() -> None:
    # a broadcast constant: nothing is allocated; a float32 accumulator stalls at 2**24 per lane
    assert float(td.Tensor.ones((65536, 65536)).sum().numpy()) == 2.0 ** 32


@pytest.mark.parametrize(("shape", "axis"), [((3, 700_001), 1), ((2_000_003, 3), 0), ((1500, 3000), None)])
def test_axis_and_strided_sums_within_the_bound(shape: tuple[int, int], axis: int | None) -> None:
    values = np.random.default_rng(sum(shape)).standard_normal(shape, dtype=np.float32)
    tensor = td.Tensor(values)
    if axis is None:   # through a transposed view: the innermost reduced axis is strided
        got, expect, count = tensor.T.sum().numpy(), values.astype(np.float64).T.sum(), values.size
        assert abs(float(got) - expect) <= _bound(values, count)
        return
    got, expect = tensor.sum(axis=axis).numpy(), values.astype(np.float64).sum(axis=axis)
    magnitudes = np.abs(values.astype(np.float64)).sum(axis=axis)
    bound = EPS32 * (math.log2(shape[axis]) + 16) * magnitudes
    assert np.all(np.abs(got - expect) <= bound)


def test_float64_sum_keeps_its_precision() -> None:
    values = np.random.default_rng(64).standard_normal(3_000_001)
    got = float(td.Tensor(values).sum().numpy())
    bound = float(np.finfo(np.float64).eps) * (math.log2(values.size) + 16) * float(np.abs(values).sum())
    assert abs(got - math.fsum(values)) <= bound
