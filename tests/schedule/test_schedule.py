"""Scheduling: WAR ordering around assign, cycles, fusion structure, the schedule cache, the memory plan."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

import tinydist as td
from tinydist.codegen import kernel as K
from tinydist.engine.realize import realize
from tinydist.graph import dtypes
from tinydist.graph.lazy import Op
from tinydist.graph.shape import ShapeTracker
from tinydist.schedule import create_schedule, schedule_cache
from tinydist.schedule.items import CopyCall, GatherCall, KernelCall, MatmulCall, SliceCall
from tinydist.schedule.items import BufferSpec
from tinydist.schedule.linear import linearize
from tinydist.schedule.memory import BLOCK, plan_memory

A = np.arange(12, dtype=np.float32).reshape(3, 4)


def kernels(t: td.Tensor) -> list:
    schedule, _ = create_schedule([t.node])
    return [c for c in schedule.linear if isinstance(c, KernelCall)]


# ---- WAR ordering on assign ---------------------------------------------------------------------

def test_reader_before_assign_sees_old_value_realized_together():
    x = td.Tensor(A)
    reader = x * 2
    view_reader = x.T[1:]
    x.assign(x + 1)
    realize([x.node, reader.node, view_reader.node])
    np.testing.assert_array_equal(x.numpy(), A + 1)
    np.testing.assert_array_equal(reader.numpy(), A * 2)
    np.testing.assert_array_equal(view_reader.numpy(), A.T[1:])


@pytest.mark.parametrize("first", ["target", "reader"])
def test_reader_before_assign_sees_old_value_realized_separately(first):
    x = td.Tensor(A)
    reader = (x * 2).sum(0)
    x.assign(td.Tensor(np.zeros_like(A)))
    if first == "target":
        x.realize()
        np.testing.assert_array_equal(x.numpy(), np.zeros_like(A))
        np.testing.assert_array_equal(reader.numpy(), (A * 2).sum(0))
    else:
        np.testing.assert_array_equal(reader.numpy(), (A * 2).sum(0))
        np.testing.assert_array_equal(x.numpy(), np.zeros_like(A))


def test_assign_in_place_repeatedly():
    x = td.Tensor(A)
    x.assign(x + 1)
    x.assign(x * 2)          # built on the first assign's version: both apply, in order
    np.testing.assert_array_equal(x.numpy(), (A + 1) * 2)
    x.assign(x + 1)
    np.testing.assert_array_equal(x.numpy(), (A + 1) * 2 + 1)


def test_assign_reads_own_transpose_in_place():
    """x.assign(x.T) on a square matrix: the kernel reads memory it overwrites."""
    s = np.arange(16, dtype=np.float32).reshape(4, 4)
    x = td.Tensor(s)
    x.assign(x.T + 0)
    np.testing.assert_array_equal(x.numpy(), s.T)


def test_assign_broadcast_and_cast():
    x = td.Tensor(A)
    x.assign(td.Tensor(np.arange(4, dtype=np.int32)))
    assert x.dtype == td.float32
    np.testing.assert_array_equal(x.numpy(), np.broadcast_to(np.arange(4, dtype=np.float32), (3, 4)))
    x.assign(7)
    np.testing.assert_array_equal(x.numpy(), np.full((3, 4), 7, np.float32))


def test_assign_keeps_reader_from_other_device_consistent():
    x = td.Tensor(A)
    moved = x.to("CPU:1")
    x.assign(x * 0)
    np.testing.assert_array_equal(moved.numpy(), A)
    np.testing.assert_array_equal(x.numpy(), np.zeros_like(A))


def test_swap_through_assign_reads_old_values_as_numpy_does():
    """Each assign reads what the other overwrites: the old value is copied aside, not a cycle."""
    x, y = td.Tensor(A), td.Tensor(-A)
    new_x, new_y = y + 0, x + 0
    x.assign(new_x)
    y.assign(new_y)
    schedule, _ = create_schedule([x.node, y.node])
    assert sum(isinstance(c, CopyCall) for c in schedule.linear) == 1
    realize([x.node, y.node])
    np.testing.assert_array_equal(x.numpy(), -A)
    np.testing.assert_array_equal(y.numpy(), A)


def test_kernel_reading_before_and_after_an_assign_sees_both_values():
    t = td.Tensor(A)
    old = t + t
    t.assign(t * 3)
    both = old + t
    np.testing.assert_array_equal(both.numpy(), A * 2 + A * 3)
    np.testing.assert_array_equal(t.numpy(), A * 3)


def test_only_a_call_cycle_is_an_error():
    """Calls ordered against each other by RAW edges alone can't be reordered by a copy."""
    load = K.load(0, ShapeTracker.contiguous((16,)), dtypes.float32)
    ast = K.KernelAST((16,), (), load, (dtypes.float32,), dtypes.float32, outputs=1)
    first, second = KernelCall(ast, 1, (2,), "CPU:0"), KernelCall(ast, 2, (1,), "CPU:0")
    with pytest.raises(td.ScheduleCycleError, match="cycle through 2 call"):
        linearize([first, second], {}, [])


def test_assign_from_realized_computed_tensor():
    v = td.Tensor(A) * 2
    v.realize()
    y = td.Tensor(np.zeros_like(A))
    y.assign(v)
    np.testing.assert_array_equal(y.numpy(), A * 2)


def test_assign_value_realized_later_as_war_reader():
    schedule_cache.clear()  # a cached schedule from a structurally-equal graph hides the bug
    x, y = td.Tensor(A), td.Tensor(-A)
    ny = x * 1
    x.assign(7)
    y.assign(ny)
    x.realize()          # realizes ny too (it reads x's old value)
    np.testing.assert_array_equal(y.numpy(), A)


def test_swap_realized_one_at_a_time():
    schedule_cache.clear()
    x, y = td.Tensor(A), td.Tensor(-A)
    nx, ny = y * 1, x * 1
    x.assign(nx)
    y.assign(ny)
    x.realize()          # realizes ny too (it reads x's old value), before x is overwritten
    np.testing.assert_array_equal(x.numpy(), -A)
    np.testing.assert_array_equal(y.numpy(), A)


# ---- fusion structure ---------------------------------------------------------------------------

def test_elementwise_chain_is_one_kernel():
    a, b, c = (td.Tensor(A + i) for i in range(3))
    t = (a * b + c).relu()
    schedule, inputs = create_schedule([t.node])
    assert len(schedule.linear) == 1 and isinstance(schedule.linear[0], KernelCall)
    assert len(inputs) == 3 and schedule.n_inputs == 3
    np.testing.assert_allclose(t.numpy(), np.maximum(A * (A + 1) + (A + 2), 0))


def test_transposed_elementwise_stays_one_kernel():
    a, b = td.Tensor(A), td.Tensor(A * 2)
    assert len(kernels(((a + b).T * 3)[1:])) == 1


def test_sum_keepdim_then_scale_is_one_kernel():
    a = td.Tensor(A)
    t = a.sum(keepdim=True) * 2
    assert len(kernels(t)) == 1
    np.testing.assert_allclose(t.numpy(), A.sum(keepdims=True) * 2)


def test_sum_then_scale_is_one_kernel():
    a = td.Tensor(A)
    assert len(kernels(a.sum() * 2)) == 1
    assert len(kernels((a * 2).sum())) == 1


def test_softmax_rows_is_few_kernels():
    x = td.Tensor(np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32))
    n = len(kernels(x.softmax(1)))
    assert 2 <= n <= 4
    assert len(kernels(x.log_softmax(1))) <= 3


def test_matmul_is_one_matmul_call():
    wide = td.Tensor(np.random.default_rng(1).standard_normal((40, 64)).astype(np.float32))
    schedule, _ = create_schedule([(wide @ wide.T).node])
    assert sum(isinstance(c, MatmulCall) for c in schedule.linear) == 1


def test_prepacked_matmul_reads_the_packed_weight_as_it_is():
    """A weight packed at load is the matmul's B buffer itself: no copy, no repacking workspace."""
    from tinydist.codegen.matmul_packing import pack_b_array
    from tinydist.codegen.matmul_tiling import workspace_bytes
    from tinydist.frontend.functional import matmul_prepacked
    rng = np.random.default_rng(2)
    weight = rng.standard_normal((64, 300)).astype(np.float32)
    x = td.Tensor(rng.standard_normal((3, 40, 64)).astype(np.float32))
    packed = td.Tensor(pack_b_array(weight)).realize()
    schedule, _ = create_schedule([matmul_prepacked(x * 2, packed, 64, 300).node])
    (call,) = [c for c in schedule.linear if isinstance(c, MatmulCall)]
    assert call.prepacked == "b" and (call.batch, call.m, call.n, call.k, call.b_batch_stride) == (3, 40, 300, 64, 0)
    assert not [c for c in schedule.linear if isinstance(c, CopyCall)]
    assert schedule.specs[call.workspace].nbytes == workspace_bytes(40, 300, 64, prepacked="b") < workspace_bytes(40, 300, 64)


def test_conv_with_a_packed_weight_reads_it_and_gathers_its_columns():
    """A convolution given its weight packed at load (an ONNX Conv's constant weight): one matmul,
    A the packed weight buffer itself and B gathered from the padded input through the columns'
    view (no im2col copy, no A block in the workspace); the output equals numpy's within rounding."""
    from tinydist.codegen.matmul_packing import pack_a_array
    from tinydist.frontend.functional import conv2d
    rng = np.random.default_rng(4)
    x_np = rng.standard_normal((1, 16, 12, 12)).astype(np.float32)
    w_np = rng.standard_normal((24, 16, 3, 3)).astype(np.float32)
    packed = td.Tensor(pack_a_array(w_np.reshape(24, -1))).realize()
    y = conv2d(td.Tensor(x_np) * 1, td.Tensor(w_np), padding=1, packed_weight=packed)
    schedule, _ = create_schedule([y.node])
    (call,) = [c for c in schedule.linear if isinstance(c, MatmulCall)]
    assert call.prepacked == "a" and call.strided is not None and call.strided.operand == "b"
    assert (call.batch, call.m, call.n, call.k, call.a_batch_stride) == (1, 24, 144, 144, 0)
    windows = np.lib.stride_tricks.sliding_window_view(np.pad(x_np, ((0, 0), (0, 0), (1, 1), (1, 1))), (3, 3), axis=(2, 3))
    expected = np.einsum("nchwij,ocij->nohw", windows.astype(np.float64), w_np.astype(np.float64))
    np.testing.assert_allclose(y.numpy(), expected, rtol=1e-4, atol=1e-4)


def test_conv_turned_around_gathers_its_windows_as_rows_of_a():
    """A convolution given its weight's transpose packed as B (`packed_weight_t`: the product turned
    around, pixels x weight): one matmul, B the packed buffer itself and A gathered from the padded
    input through the windows' view, one row per output pixel (no im2col copy, no A or B block
    in the workspace but A's); strided and padded, the output equals numpy's within rounding."""
    from tinydist.codegen.matmul_packing import pack_b_array
    from tinydist.codegen.matmul_tiling import workspace_bytes
    from tinydist.frontend.functional import conv2d
    rng = np.random.default_rng(6)
    x_np = rng.standard_normal((2, 16, 11, 11)).astype(np.float32)
    w_np = rng.standard_normal((40, 16, 3, 3)).astype(np.float32)
    b_np = rng.standard_normal(40).astype(np.float32)
    packed = td.Tensor(pack_b_array(np.ascontiguousarray(w_np.reshape(40, -1).T))).realize()
    y = conv2d(td.Tensor(x_np) * 1, td.Tensor(w_np), td.Tensor(b_np), stride=2, padding=1, packed_weight_t=packed)
    schedule, _ = create_schedule([y.node])
    (call,) = [c for c in schedule.linear if isinstance(c, MatmulCall)]
    assert call.prepacked == "b" and call.strided is not None and call.strided.operand == "a"
    assert (call.batch, call.m, call.n, call.k) == (1, 2 * 6 * 6, 40, 144)
    assert schedule.specs[call.workspace].nbytes == workspace_bytes(72, 40, 144, strided=call.strided, prepacked="b")
    assert not [c for c in schedule.linear if isinstance(c, CopyCall) and schedule.specs[c.dst].nbytes >= 72 * 144 * 4]
    padded = np.pad(x_np, ((0, 0), (0, 0), (1, 1), (1, 1)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, (3, 3), axis=(2, 3))[:, :, ::2, ::2]
    expected = np.einsum("nchwij,ocij->nohw", windows.astype(np.float64), w_np.astype(np.float64)) + b_np[:, None, None]
    np.testing.assert_allclose(y.numpy(), expected, rtol=1e-4, atol=1e-4)


def test_depthwise_conv_is_one_direct_kernel():
    """A depthwise convolution (one input channel per group) reads its windows in place: no
    im2col copy, no per-channel matmul; one reduce kernel, computed once however often its
    consumers read it (SiLU after a folded batch norm: z * sigmoid(z))."""
    rng = np.random.default_rng(3)
    x = td.Tensor(rng.standard_normal((2, 8, 10, 10)).astype(np.float32)).realize()
    w = td.Tensor(rng.standard_normal((8, 1, 3, 3)).astype(np.float32)).realize()
    z = x.conv2d(w, stride=2, groups=8) * 2 + 1   # batch norm, folded
    schedule, _ = create_schedule([(z * z.sigmoid()).node])
    assert not [c for c in schedule.linear if isinstance(c, (MatmulCall, CopyCall))]
    reducing = [c for c in kernels(z * z.sigmoid()) if any(node.op == "reduce" for node in c.ast.root.walk())]
    assert len(reducing) == 1


def test_single_row_matmul_is_one_fused_kernel():
    row = td.Tensor(np.ones((1, 64), np.float32))
    schedule, _ = create_schedule([(row @ td.Tensor(np.ones((64, 128), np.float32))).node])
    assert len(schedule.linear) == 1 and isinstance(schedule.linear[0], KernelCall)


def test_copy_is_a_copy_call():
    t = (td.Tensor(A) * 2).to("CPU:1")
    schedule, _ = create_schedule([t.node])
    assert any(isinstance(c, CopyCall) for c in schedule.linear)
    np.testing.assert_array_equal(t.numpy(), A * 2)


def test_reading_a_peer_devices_value_is_no_copy():
    """CPU devices of one process share memory: the kernel on CPU:1 loads CPU:0's result in
    place; the doubling still runs on CPU:0, where the graph put it."""
    t = (td.Tensor(A) * 2).to("CPU:1") + 1
    schedule, _ = create_schedule([t.node])
    assert [(type(c), c.device) for c in schedule.linear] == [(KernelCall, "CPU:0"), (KernelCall, "CPU:1")]
    np.testing.assert_array_equal(t.numpy(), A * 2 + 1)


def test_arithmetic_over_constants_is_folded_into_one_constant():
    """Exactly rounded float arithmetic over constants is done when the graph is built, as a
    kernel would round it; anything else (integer division, a transcendental) stays a node."""
    seed = td.Tensor.full((), 1.0, td.float32) / 256
    assert seed.node.op is Op.CONST and seed.node.arg == np.float32(1) / np.float32(256)
    assert (-(td.Tensor.full((), 3.0) * 0.1 - 1.0)).node.arg == -(np.float64(3.0) * 0.1 - 1.0)
    inf, nan = td.Tensor.full((), 1.0) / 0.0, td.Tensor.full((), 0.0) / 0.0
    assert inf.node.op is Op.CONST and inf.numpy() == np.inf and np.isnan(nan.numpy())
    for kept in (td.Tensor.full((), 7) // 2, td.Tensor.full((), 2.0).exp()):
        assert kept.node.op is not Op.CONST
    np.testing.assert_array_equal((td.Tensor.full((), 7) // 2).numpy(), 3)


def test_a_constant_moved_to_another_device_is_that_constant_there():
    """`.to()` of a constant (or a broadcast of one) needs no copy and no kernel on the source
    device: the reader's kernel inlines it, so it waits for nothing there (a loss's 1/N seed read
    by a data-parallel replica)."""
    half = (td.Tensor.full((), 1.0, td.float32) / 2).to("CPU:1")
    assert half.node.op is Op.CONST and half.device == "CPU:1"
    t = td.Tensor(A, device="CPU:1") * half + td.Tensor.full((3, 4), 2.0, td.float32).to("CPU:1")
    schedule, _ = create_schedule([t.node])
    assert [(type(c), c.device) for c in schedule.linear] == [(KernelCall, "CPU:1")]
    np.testing.assert_array_equal(t.numpy(), A * 0.5 + 2)
    w = td.Tensor.full((3,), 2.0, td.float32)
    w.requires_grad_()  # a leaf that wants its gradient keeps the copy the gradient flows back through
    moved = w.to("CPU:1")
    assert moved.node.op is Op.COPY
    (moved * 3).sum().backward()
    np.testing.assert_array_equal(w.grad.numpy(), [3, 3, 3])


def test_views_of_a_peers_view_read_it_in_place():
    b = td.Tensor(A).realize()
    window = b[1:3, ::2].to("CPU:1")                         # a strided window of CPU:0's buffer
    out = window.T * 10 + window.pad(((1, 0), (0, 0)))[1:].sum(0, keepdim=True).T
    schedule, _ = create_schedule([out.node])
    assert [(type(c), c.device) for c in schedule.linear] == [(KernelCall, "CPU:1")] * len(schedule.linear)
    sub = A[1:3, ::2]
    np.testing.assert_allclose(out.numpy(), sub.T * 10 + sub.sum(0, keepdims=True).T, rtol=1e-6)


def test_cat_of_buffers_along_the_first_axis_is_one_gather():
    a, b = td.Tensor(A).realize(), td.Tensor(A[:1] + 5).realize()
    joined = td.cat([a, (b * 2).to("CPU:1").to("CPU:0"), a], 0)
    schedule, _ = create_schedule([joined.node])
    assert isinstance(schedule.linear[-1], GatherCall) and len(schedule.linear[-1].srcs) == 3
    np.testing.assert_array_equal(joined.numpy(), np.concatenate([A, (A[:1] + 5) * 2, A]))
    flat = td.cat([a.reshape(-1), a.reshape(-1)]).reshape(2, *A.shape)  # the reshape is pushed into the pieces
    assert [type(c) for c in create_schedule([flat.node])[0].linear] == [GatherCall]
    np.testing.assert_array_equal(flat.numpy(), np.stack([A, A]))
    beside = td.cat([a, a], 1)  # not contiguous ranges of the result: a kernel
    assert not any(isinstance(c, GatherCall) for c in create_schedule([beside.node])[0].linear)
    np.testing.assert_array_equal(beside.numpy(), np.concatenate([A, A], 1))


def test_linear_keeps_each_device_together_and_feeds_other_devices_first():
    # targets alternate between devices, and device 1's input is computed on device 0 after other
    # work there: device 0 computes that input first, then each device's calls form one stretch
    a, b = td.Tensor(A), td.Tensor(A * 3, device="CPU:1")
    first0 = (a * 2).exp().sum(0)
    first1 = (b + 1).exp().sum(0)
    second0 = first0.log().sum(0)
    remote = ((a - 1).to("CPU:1") * first1).sum(0)
    targets = [first0, first1, second0, remote]
    schedule, _ = create_schedule([t.node for t in targets])
    streams = [(c.device, c.queue) for c in schedule.linear]
    assert sum(1 for x, y in zip(streams, streams[1:]) if x != y) == 1, schedule.describe()
    # CPU:1 reads device 0's `a - 1` in place (a peer read, no copy): it is device 0's first call
    peer_reads = {n for c in schedule.linear if c.device == "CPU:1" for n in c.reads}
    assert schedule.linear[0].device == "CPU:0" and schedule.linear[0].out in peer_reads, schedule.describe()
    realize([t.node for t in targets])
    expected = [np.exp(A * 2).sum(0), np.exp(A * 3 + 1).sum(0)]
    expected += [np.log(expected[0]).sum(0), ((A - 1) * expected[1]).sum(0)]
    for t, want in zip(targets, expected):
        np.testing.assert_allclose(t.numpy(), want, rtol=1e-5)


def test_shared_expensive_subexpression_is_computed_once():
    a = td.Tensor(A)
    e = a.exp()
    t = e + e.sum(1, keepdim=True)
    ks = kernels(t)
    exps = sum(1 for k in ks for n in k.ast.root.walk() if n.op == "exp")
    assert exps == 1
    np.testing.assert_allclose(t.numpy(), np.exp(A) + np.exp(A).sum(1, keepdims=True), rtol=1e-5)


# ---- schedule cache -----------------------------------------------------------------------------

def test_schedule_cache_hit_on_structurally_equal_graph():
    def build(seed):
        x = td.Tensor(np.random.default_rng(seed).standard_normal((5, 7)).astype(np.float32))
        y = td.Tensor(np.random.default_rng(seed + 1).standard_normal((7,)).astype(np.float32))
        return ((x * y).exp().sum(0) + 3).relu(), x, y

    first, x1, y1 = build(1)
    first.realize()
    hits = schedule_cache.hits
    second, x2, y2 = build(2)
    result = second.numpy()
    assert schedule_cache.hits == hits + 1
    x, y = x2.numpy(), y2.numpy()
    np.testing.assert_allclose(result, np.maximum(np.exp(x * y).sum(0) + 3, 0), rtol=1e-5)
    # a different constant is a different structure
    misses = schedule_cache.misses
    third, _, _ = build(3)
    (third + 1).realize()
    assert schedule_cache.misses > misses


def test_schedule_cache_tells_apart_graphs_whose_keys_hash_alike():
    """The key is compared, not only hashed: in CPython hash(-1) == hash(-2), and an int 1 and a
    float 1.0 are equal; a view's strides or a shared source are structure too."""
    x = td.Tensor(A)
    for c in (-1, -2, 1, 1.0, -1):
        np.testing.assert_array_equal((x * c).numpy(), A * c)
    np.testing.assert_array_equal((x.T + 0).numpy(), A.T)
    np.testing.assert_array_equal((x.reshape(4, 3) + 0).numpy(), A.reshape(4, 3))  # the same shape as x.T
    y = td.Tensor(A + 1)
    np.testing.assert_array_equal((x + x).numpy(), A + A)      # one input read twice
    np.testing.assert_array_equal((x + y).numpy(), A + A + 1)  # two inputs


def test_the_key_walk_recursing_and_on_its_own_stack_numbers_alike_in_walk_postorders_order():
    """canonical_walk recurses and walks again on a stack of its own past the recursion limit:
    both must number nodes as walk.postorder does (input order and buffer numbers follow it)."""
    from tinydist.schedule import _deep_walk, canonical_walk
    from tinydist.base.walk import postorder
    g = random.Random(5)
    for trial in range(40):
        pool = [td.Tensor(np.full((2, 3), i, np.float32)) for i in range(3)]
        for _ in range(g.randint(1, 25)):
            a, b, c = (g.choice(pool) for _ in range(3))
            pool.append(g.choice([lambda: a + b, lambda: a * b.T.T, lambda: td.where(a > b, b, c), lambda: a - a.max(1, keepdim=True),
                                  lambda: (a * 2).exp()])())
        targets = list(dict.fromkeys(t.node for t in g.sample(pool[3:] or pool, min(3, len(pool) - 3) or 1)))
        walked, deep = canonical_walk(targets), _deep_walk(targets)
        assert walked.key == deep.key and walked.inputs == deep.inputs and walked.assigns == deep.assigns, trial
        order = postorder(targets, lambda node: () if node.realized else node.srcs)
        assert list(walked.nodes) == order, trial
    x = td.Tensor(np.ones(3, np.float32))
    for i in range(3000):  # past the recursion limit: walked on its own stack
        x = x * 1.5 if i % 2 else x - 1
    assert canonical_walk([x.node]).key == _deep_walk([x.node]).key


# ---- memory planner -----------------------------------------------------------------------------

def random_graph(rng: random.Random):
    """A graph with materialized intermediates (reduces broadcast back, expands over computed values,
    matmuls) and its numpy value."""
    n = rng.choice([8, 16, 33])
    xs = [np.random.default_rng(rng.randrange(10 ** 6)).standard_normal((n, n)).astype(np.float32) for _ in range(2)]
    pool = [(td.Tensor(x), x.astype(np.float64)) for x in xs]
    for _ in range(rng.randint(3, 8)):
        (t, v), (u, w) = rng.choice(pool), rng.choice(pool)
        kind = rng.choice(["softmaxish", "matmul", "expand", "add", "tanh"])
        if kind == "softmaxish":
            t, v = t - t.max(1, keepdim=True), v - v.max(1, keepdims=True)
        elif kind == "matmul":
            t, v = (t @ u) * (1.0 / n), (v @ w) / n
        elif kind == "expand":
            t, v = t.sum(0, keepdim=True).expand(n, n) * 0.1 + u, np.broadcast_to(v.sum(0, keepdims=True), (n, n)) * 0.1 + w
        elif kind == "add":
            t, v = t + u.T, v + w.T
        else:
            t, v = t.tanh(), np.tanh(v)
        pool.append((t, v))
    return pool[-1]


@pytest.mark.parametrize("seed", range(8))
def test_memory_plan_has_no_overlap(seed):
    t, expected = random_graph(random.Random(seed))
    schedule, inputs = create_schedule([t.node])
    plan, specs = schedule.plan, schedule.specs
    input_numbers = set(range(schedule.n_inputs))
    held = input_numbers | set(schedule.targets) | set(schedule.aliases) | set(schedule.aliases.values())
    assert not held & set(plan.offsets), "inputs / targets / assigned buffers must never be planned"
    assert set(plan.offsets) == set(plan.arena_of) == set(plan.lifetimes)

    def rounded(number):
        return (specs[number].nbytes + BLOCK - 1) // BLOCK * BLOCK

    planned = list(plan.offsets)
    for number in planned:
        assert plan.offsets[number] % 256 == 0
        first, last = plan.lifetimes[number]
        assert 0 <= first <= last < len(schedule.linear)
        assert plan.offsets[number] + specs[number].nbytes <= plan.arena_bytes[plan.arena_of[number]]
    for i, p in enumerate(planned):
        for q in planned[i + 1:]:
            if plan.arena_of[p] != plan.arena_of[q]:
                continue
            (f1, l1), (f2, l2) = plan.lifetimes[p], plan.lifetimes[q]
            if f1 <= l2 and f2 <= l1:  # lifetimes intersect: byte ranges must not
                o1, o2 = plan.offsets[p], plan.offsets[q]
                assert o1 + specs[p].nbytes <= o2 or o2 + specs[q].nbytes <= o1, (p, q, plan)
    assert plan.peak_bytes <= sum(rounded(n) for n in planned)
    assert plan.planned_bytes == sum(specs[n].nbytes for n in planned)
    # lifetimes match the linear order: written first, read last
    for number in planned:
        first, last = plan.lifetimes[number]
        assert schedule.linear[first].out == number or number == getattr(schedule.linear[first], "workspace", None)
        touching = [i for i, c in enumerate(schedule.linear)
                    if number in c.reads or c.out == number or number == getattr(c, "workspace", None)]
        assert (touching[0], touching[-1]) == (first, last)
    # and the plan runs correctly
    np.testing.assert_allclose(t.numpy(), expected, rtol=1e-3, atol=1e-3)


def test_memory_plan_reuses_memory_in_a_chain():
    x = td.Tensor(np.random.default_rng(0).standard_normal((32, 32)).astype(np.float32))
    t = x
    for _ in range(6):
        t = (t @ x) * 0.1  # every matmul operand is materialized: a chain of intermediates
    schedule, _ = create_schedule([t.node])
    plan = schedule.plan
    assert len(plan.offsets) >= 4
    assert plan.peak_bytes < sum((schedule.specs[n].nbytes + 255) // 256 * 256 for n in plan.offsets)


def test_a_shared_reduce_behind_a_reshape_is_computed_once():
    # the view has two consumers: inlining the reduce into both would compute it twice
    a = td.Tensor(A)
    total = a.sum(axis=1)
    schedule, _ = create_schedule([(total * 2).node, (total + 1).node])
    reduces = [c for c in schedule.linear if isinstance(c, KernelCall) and c.ast.reduce_axes]
    assert len(reduces) == 1


def test_readers_of_a_buffer_written_in_ranges_follow_every_writer() -> None:
    """Several SliceCalls write disjoint ranges of buffer 5: a reader of 5 comes after all of
    them, even after one that waits for a producer listed last."""
    load = K.load(0, ShapeTracker.contiguous((16,)), dtypes.float32)
    ast = K.KernelAST((16,), (), load, (dtypes.float32,), dtypes.float32, outputs=1)
    first_half = SliceCall(ast, (5,), (8,), 0, 64, "CPU:0")
    reader = KernelCall(ast, 6, (5,), "CPU:0")
    second_half = SliceCall(ast, (5,), (0,), 64, 64, "CPU:1")
    producer = KernelCall(ast, 8, (0,), "CPU:0")
    order = linearize([first_half, reader, second_half, producer], {}, [])
    assert order.index(reader) > max(order.index(first_half), order.index(second_half))
    assert order.index(producer) < order.index(first_half)


@dataclasses.dataclass
class _Call:
    """What the memory planner reads of a call."""
    writes: tuple[int, ...]
    reads: tuple[int, ...]
    device: str = "CPU:0"
    queue: str = "compute"


def test_memory_plan_gives_buffers_of_several_streams_their_own_bytes():
    """A buffer another device reads is not reused after its last reader, even by a buffer whose
    lifetime is disjoint from it: a replay would have to wait for the other device first."""
    specs = [BufferSpec(1024, dtypes.float32, (256,), device) for device in ("CPU:0", "CPU:0", "CPU:1", "CPU:0")]
    linear = [_Call(writes=(0,), reads=()), _Call(writes=(2,), reads=(0,), device="CPU:1"),
              _Call(writes=(1,), reads=()), _Call(writes=(3,), reads=(1,))]
    plan = plan_memory(linear, specs, planned=[0, 1, 2])
    assert plan.lifetimes[0] == (0, 1) and plan.lifetimes[1] == (2, 3)
    assert plan.offsets[0] != plan.offsets[1]
    linear[1] = _Call(writes=(2,), reads=(0,))             # the reader on the same device:
    one_stream = plan_memory(linear, specs, planned=[0, 1, 2])
    assert one_stream.offsets[0] == one_stream.offsets[1]  # buffer 1 reuses buffer 0's bytes


def _np_conv2d(x: np.ndarray, w: np.ndarray, padding: int) -> np.ndarray:
    padded = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, w.shape[2:], axis=(2, 3))  # N C OH OW KH KW
    return np.einsum("ncyxij,ocij->noyx", windows, w)


def test_convolution_columns_are_packed_from_the_padded_input():
    """The im2col columns are never written out: the forward matmul packs them from the padded
    input, and so does the weight gradient's (as A), with the same values as numpy."""
    rng = np.random.default_rng(3)
    x_np, w_np = rng.standard_normal((3, 2, 5, 7)).astype(np.float32), rng.standard_normal((4, 2, 3, 3)).astype(np.float32)
    x, w = td.Tensor(x_np), td.Tensor(w_np, requires_grad=True)
    out = x.conv2d(w, padding=1)
    loss = (out * out).sum()
    loss.backward()
    schedule, _ = create_schedule([out.node])
    (forward,) = [c for c in schedule.linear if isinstance(c, MatmulCall)]
    assert forward.strided is not None and forward.strided.operand == "b"
    assert not any(isinstance(c, KernelCall) and c.ast.shape[-3:] == (3, 5, 7) and len(c.ast.shape) == 7
                   for c in schedule.linear), "the columns were copied"
    expected = _np_conv2d(x_np, w_np, 1)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-4, atol=1e-4)
    columns = np.lib.stride_tricks.sliding_window_view(np.pad(x_np, ((0, 0), (0, 0), (1, 1), (1, 1))), (3, 3), axis=(2, 3))
    np.testing.assert_allclose(w.grad.numpy(), np.einsum("ncyxij,noyx->ocij", columns, 2 * expected), rtol=1e-3, atol=1e-3)


def test_strided_operand_that_another_kernel_reads_is_still_right():
    """Columns a kernel also reads are copied for it; the matmul's values do not depend on which
    of the two reads first."""
    from tinydist.frontend.functional import _im2col
    rng = np.random.default_rng(4)
    x_np = rng.standard_normal((2, 3, 6, 6)).astype(np.float32)
    weights = rng.standard_normal((1, 5, 27)).astype(np.float32)
    columns_np = np.lib.stride_tricks.sliding_window_view(x_np, (3, 3), axis=(2, 3)).transpose(1, 4, 5, 0, 2, 3).reshape(1, 27, 32)
    for matmul_first in (True, False):
        columns = _im2col(td.Tensor(x_np), (3, 3), (1, 1), (1, 1), 1)
        product, total = td.Tensor(weights).matmul(columns), columns.sum()
        realize([product.node, total.node] if matmul_first else [total.node, product.node])
        np.testing.assert_allclose(product.numpy(), weights @ columns_np, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(total.numpy(), columns_np.sum(), rtol=1e-4, atol=1e-3)
