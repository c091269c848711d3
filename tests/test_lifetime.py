"""Memory is given back by reference counting alone: no reference cycles keep buffers alive."""

from __future__ import annotations

import gc

import numpy as np

import tinydist as td


def test_dropping_the_last_reference_frees_results_and_intermediates_without_gc() -> None:
    allocator = td.get_engine().device("CPU:0").allocator
    x = td.Tensor(np.ones((64, 64), np.float32))
    gc.collect()  # what earlier tests left to the collector goes now, not during the measurement
    td.synchronize()
    baseline = allocator.statistics().live_buffers
    gc.disable()
    try:
        for i in range(3):
            y = ((x * 2 + i).softmax(1) @ x).sum(0)
            assert y.numpy().shape == (64,)
            del y
            # (<=: a recycled buffer an earlier test still held may go idle meanwhile, and idle ones
            # count as cached; what this proves is that nothing this graph made stays alive)
            assert allocator.statistics().live_buffers <= baseline
    finally:
        gc.enable()


def test_a_training_step_through_custom_gradient_rules_leaves_nothing_alive_without_gc() -> None:
    # conv2d and max_pool2d register their own gradient rules: the rule's bookkeeping goes with
    # the graph, whether or not a backward ran
    allocator = td.get_engine().device("CPU:0").allocator
    w = td.Tensor(np.ones((4, 2, 3, 3), np.float32), requires_grad=True)
    x = td.Tensor(np.ones((2, 2, 6, 6), np.float32))
    td.autograd.pending_roots.clear()  # roots earlier tests' backward passes left for an optimizer
    gc.collect()  # what earlier tests left to the collector goes now, not during the measurement
    td.synchronize()
    baseline = allocator.statistics().live_buffers
    gc.disable()
    try:
        for backward in (True, False):
            loss = x.conv2d(w, padding=1).relu().max_pool2d(2).sum()
            if backward:
                loss.backward()
                w.grad = None
            assert loss.numpy().shape == ()
            del loss
            td.autograd.pending_roots.clear()  # what an optimizer step does with the backward's root
            assert allocator.statistics().live_buffers <= baseline  # (<=: see the test above)
            assert len(td.autograd._custom) == 0
    finally:
        gc.enable()
