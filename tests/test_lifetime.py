"""Memory is given back by reference counting alone: no reference cycles keep buffers alive."""

from __future__ import annotations

import gc

import numpy as np

import tinydist as td


def test_dropping_the_last_reference_frees_results_and_intermediates_without_gc() -> None:
    allocator = td.get_engine().device("CPU:0").allocator
    x = td.Tensor(np.ones((64, 64), np.float32))
    td.synchronize()
    baseline = allocator.statistics().live_buffers
    gc.disable()
    try:
        for i in range(3):
            y = ((x * 2 + i).softmax(1) @ x).sum(0)
            assert y.numpy().shape == (64,)
            del y
            assert allocator.statistics().live_buffers == baseline
    finally:
        gc.enable()
