"""A work estimate at build time: absurd sizes are refused with a clear error, before anything runs."""

from __future__ import annotations

import numpy as np
import pytest

import tinydist as td
from tinydist.base.config import settings
from tinydist.base.errors import TinydistError, WorkTooLarge


def test_a_reduction_over_more_elements_than_a_kernel_can_index_is_refused() -> None:
    with pytest.raises(ValueError, match=r"shape \(4611686018427387904, 4\) has 18,446,744,073,709,551,616 elements"):
        td.Tensor.ones((1 << 62, 4)).sum()


def test_a_matmul_past_the_work_limit_is_refused_when_built() -> None:
    a = td.Tensor.ones((1 << 20, 1 << 20))  # 2**40 elements each: within the element limit, never realized
    b = td.Tensor.ones((1 << 20, 1 << 20))
    with pytest.raises(WorkTooLarge, match=r"matmul of shapes \(1048576, 1048576\) and \(1048576, 1048576\) is 2\.31e\+18 "
                                           r"operations, more than TINYDIST_MAX_KERNEL_WORK=1\.13e\+15") as info:
        a @ b
    assert isinstance(info.value, TinydistError) and isinstance(info.value, ValueError)
    assert "split it" in str(info.value)


def test_the_limit_is_a_setting_and_work_under_it_runs() -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.arange(20, dtype=np.float32).reshape(4, 5)
    with settings.override(MAX_KERNEL_WORK=2 * 3 * 4 * 5 - 1):
        with pytest.raises(WorkTooLarge):
            td.Tensor(a) @ td.Tensor(b)
    with settings.override(MAX_KERNEL_WORK=2 * 3 * 4 * 5):
        np.testing.assert_allclose((td.Tensor(a) @ td.Tensor(b)).numpy(), a.astype(np.float64) @ b, rtol=1e-6)
