"""Intra-op parallelism: a capture's big calls split across threads (`tinydist.engine.parallel`).

Every piece computes its elements with the same code as one thread does (matmul: the same FMA
chain per element; kernels: the same expression per element), so 1 and N threads must agree
bitwise; both are compared against numpy in float64 too. Each test also checks that the capture
did run split (a phase with several pieces), so a change that silently stops splitting fails."""

from __future__ import annotations

import numpy as np
import pytest

import tinydist as td
from tinydist.engine.parallel import MATMUL_SPLIT_FLOPS, _bounds


def _run(fn, threads: int, *arrays: np.ndarray, calls: int = 4) -> tuple[list[np.ndarray], object]:
    jitted = td.jit(fn, threads=threads)
    outs = [jitted(*(td.Tensor(a) for a in arrays)).numpy() for _ in range(calls)]
    return outs, jitted.captured.capture.strategy  # type: ignore[union-attr]


def _split_phases(strategy: object) -> int:
    phases = getattr(strategy, "phases", None)
    return sum(len(phase) > 1 for phase in phases) if phases else 0


def _check(fn, want: np.ndarray, *arrays: np.ndarray, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    single, strategy1 = _run(fn, 1, *arrays)
    assert _split_phases(strategy1) == 0
    for threads in (2, 3):
        many, strategy = _run(fn, threads, *arrays)
        assert _split_phases(strategy) >= 1, f"nothing split on {threads} threads"
        for one, other in zip(single, many):
            np.testing.assert_array_equal(one, other)  # bitwise: the same code per element
    np.testing.assert_allclose(single[-1], want, rtol=rtol, atol=atol)


def test_bounds_cover_the_range_in_aligned_pieces() -> None:
    assert _bounds(10, 3) == [(0, 4), (4, 8), (8, 10)]
    assert _bounds(100, 2, 8) == [(0, 56), (56, 100)]
    assert _bounds(8, 4, 8) == [(0, 8)]  # too little to go round: fewer pieces


def test_matmul_split_over_rows_with_a_packed_weight_and_an_epilogue() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((200, 384)).astype(np.float32)  # M not a multiple of MR: an edge tile
    w = rng.standard_normal((384, 136)).astype(np.float32)
    assert 2 * 200 * 384 * 136 >= MATMUL_SPLIT_FLOPS
    weight = td.Tensor(w)
    want = np.maximum(x.astype(np.float64) @ w, 0) * 0.5
    _check(lambda t: (t @ weight).relu() * 0.5, want, x, rtol=1e-4, atol=1e-4)


def test_batched_matmul_split_over_the_batch() -> None:
    rng = np.random.default_rng(1)
    q = rng.standard_normal((24, 64, 32)).astype(np.float32)  # 2 frames x 12 heads of 64x32x64
    k = rng.standard_normal((24, 32, 64)).astype(np.float32)
    assert 2 * 24 * 64 * 32 * 64 >= MATMUL_SPLIT_FLOPS
    want = q.astype(np.float64) @ k
    _check(lambda a, b: a @ b, want, q, k, rtol=1e-4, atol=1e-4)


def test_bert_layer_shapes_split_in_pieces_of_rows_heads_and_rows_of_scores() -> None:
    """bert6_384 at batch 1 (sequence 64, 12 heads of 32): its 3.1 MFLOP attention products and
    its 12x64x64 softmax split too (left to one thread, the other idled through them), and a
    64-row product with a packed weight splits into two pieces of 32 rows, not four of 16 (each
    piece streams all of the weight: four summed 1.18x the unsplit product's time)."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((12, 64, 32)).astype(np.float32)
    k = rng.standard_normal((12, 32, 64)).astype(np.float32)
    v = rng.standard_normal((12, 64, 32)).astype(np.float32)
    w = rng.standard_normal((384, 1536)).astype(np.float32)
    weight = td.Tensor(w)
    # the layer's attention (scores, softmax, value product) and the product of its heads with a
    # weight: alone, a 23 µs product is a frame too small for a split to pay for waking the worker
    # (`FRAME_MIN_SAVING`)
    scores = q.astype(np.float64) @ k
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    heads = (e / e.sum(axis=-1, keepdims=True)) @ v
    want = heads.transpose(1, 0, 2).reshape(64, 384) @ w

    def layer(a: td.Tensor, b: td.Tensor, c: td.Tensor) -> td.Tensor:
        return ((a @ b).softmax(-1) @ c).permute(1, 0, 2).reshape(64, 384) @ weight
    _check(layer, want, q, k, v, rtol=1e-4, atol=1e-4)
    _, strategy = _run(layer, 2, q, k, v)
    pieces = [len(phase) for phase in strategy.phases]  # type: ignore[attr-defined]
    assert pieces.count(4) == 2 and pieces.count(2) >= 2, pieces  # both products over the heads in 4 runs; rows in 2
    x = rng.standard_normal((64, 384)).astype(np.float32)
    _check(lambda t: t @ weight, x.astype(np.float64) @ w, x, rtol=1e-4, atol=1e-4)
    _, strategy = _run(lambda t: t @ weight, 2, x)
    assert max(len(phase) for phase in strategy.phases) == 2  # type: ignore[attr-defined]


def test_convolution_split_over_output_channels() -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 16, 32, 32)).astype(np.float32)
    w = rng.standard_normal((32, 16, 3, 3)).astype(np.float32)
    weight = td.Tensor(w)
    torch = pytest.importorskip("torch")
    want = torch.nn.functional.conv2d(torch.from_numpy(x).double(), torch.from_numpy(w).double(), padding=1).numpy()
    _check(lambda t: t.conv2d(weight, padding=1), want, x, rtol=1e-4, atol=1e-4)


def test_convolution_turned_around_split_over_output_rows() -> None:
    """A convolution run pixels x weight (its windows a strided A, its weight packed as B) splits
    into pieces of its output rows, each gathering its own view of the windows (29 MFLOP: a frame
    worth a second thread, `FRAME_MIN_SAVING`)."""
    from tinydist.codegen.matmul_packing import pack_b_array
    from tinydist.frontend.functional import conv2d
    rng = np.random.default_rng(7)
    x = rng.standard_normal((1, 64, 16, 16)).astype(np.float32)
    w = rng.standard_normal((128, 64, 3, 3)).astype(np.float32)
    assert 2 * 14 * 14 * 128 * 576 >= MATMUL_SPLIT_FLOPS
    weight = td.Tensor(w)
    packed = td.Tensor(pack_b_array(np.ascontiguousarray(w.reshape(128, -1).T))).realize()
    windows = np.lib.stride_tricks.sliding_window_view(x, (3, 3), axis=(2, 3))
    want = np.einsum("nchwij,ocij->nohw", windows.astype(np.float64), w.astype(np.float64))
    _check(lambda t: conv2d(t * 1, weight, packed_weight_t=packed), want, x, rtol=1e-4, atol=1e-4)


def test_elementwise_and_row_reduce_split_over_rows() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((300, 512)).astype(np.float32)
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(axis=1, keepdims=True))
    _check(lambda t: t.softmax(-1), e / e.sum(axis=1, keepdims=True), x, rtol=1e-5, atol=1e-6)
    _check(lambda t: (t * 2.0 + 1.0).tanh(), np.tanh(x64 * 2 + 1), x, rtol=1e-5, atol=1e-6)


def _one_thread_entry(fn, want: np.ndarray, *arrays: np.ndarray) -> None:
    """`fn` on 2 threads runs as one thread's entry point (nothing split) and is still right."""
    outs, strategy = _run(fn, 2, *arrays)
    assert getattr(strategy, "phases", None) is None, "split although the split cannot pay for its waits"
    np.testing.assert_allclose(outs[-1], want, rtol=1e-4, atol=1e-4)


def test_cheap_kernels_stay_on_one_thread() -> None:
    """A kernel of 65,536 elements and one add is ~5 µs of one thread: halves of 2-3 µs save less
    than the waits they add (the old rule split it from 32K elements; densenet at batch 8, made of
    such kernels, ran 0.47x of its own one thread on two). A costly expression over twice as many
    elements (a tanh each: an exp, a division, ~100 µs in all) still splits."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((256, 256)).astype(np.float32)
    _one_thread_entry(lambda t: t + 1.0, x.astype(np.float64) + 1.0, x)
    y = rng.standard_normal((512, 256)).astype(np.float32)
    _check(lambda t: (t * 2.0).tanh(), np.tanh(y.astype(np.float64) * 2), y, rtol=1e-5, atol=1e-6)


def test_a_frame_whose_splits_save_less_than_its_waits_stays_on_one_thread() -> None:
    """A 64x128x128 product is just over the matmul rule (2.1 MFLOP, ~14 µs): on its own it is the
    whole frame, and the ~7 µs its halves save does not pay for waking the worker; the frame runs
    on one thread. Twice its size on either side the split pays, and the frame splits."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((64, 128)).astype(np.float32)
    w = rng.standard_normal((128, 128)).astype(np.float32)
    assert 2 * 64 * 128 * 128 >= MATMUL_SPLIT_FLOPS
    weight = td.Tensor(w)
    _one_thread_entry(lambda t: t @ weight, x.astype(np.float64) @ w, x)
    big = rng.standard_normal((512, 128)).astype(np.float32)
    _check(lambda t: t @ weight, big.astype(np.float64) @ w, big, rtol=1e-4, atol=1e-4)


def test_two_captures_alternating_on_one_pool() -> None:
    """Frames of two programs posted in turn to the same workers: a worker late for one frame
    must not run pieces of the next program under the old frame's number (the counters' tags)."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((256, 256)).astype(np.float32)
    w1, w2 = (td.Tensor(rng.standard_normal((256, 256)).astype(np.float32)) for _ in range(2))
    f1, f2 = td.jit(lambda t: t @ w1, threads=2), td.jit(lambda t: (t @ w2).relu(), threads=2)
    want1 = (td.Tensor(x) @ w1).numpy()
    want2 = (td.Tensor(x) @ w2).relu().numpy()
    for _ in range(200):
        np.testing.assert_array_equal(f1(td.Tensor(x)).numpy(), want1)
        np.testing.assert_array_equal(f2(td.Tensor(x)).numpy(), want2)
    assert _split_phases(f1.captured.capture.strategy) >= 1  # type: ignore[union-attr]


@pytest.mark.parametrize("threads", [0, -1, 1.5, True])
def test_threads_must_be_a_positive_int(threads) -> None:
    with pytest.raises(ValueError, match="threads must be a positive int"):
        td.jit(lambda t: t + 1, threads=threads)
