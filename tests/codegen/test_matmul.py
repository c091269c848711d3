"""The generated matmul kernel against numpy: edge tiles, blocking, batching, workspace bounds."""

from __future__ import annotations

import numpy as np
import pytest

from tinydist.codegen.compiler import HostCompiler
from tinydist.codegen.matmul import DEFAULT_TILINGS, SIGNATURE, StridedOperand, Tiling, matmul_ir, workspace_bytes
from tinydist.runtime.cpu.loader import native_loader

GUARD = 0xA5
# Tiny cache blocks make even small problems cross every block boundary (several jc, pc, ic
# blocks, partial ones included), which the default tiling only does for huge shapes.
SMALL_TILING = {"float32": Tiling(mr=2, nr=16, kc=5, mc=4, nc=32),
                "float64": Tiling(mr=3, nr=8, kc=7, mc=6, nc=16)}
TOLERANCE = {"float32": 1e-4, "float64": 1e-10}


def _compile(dtype: str, tiling: Tiling | None):
    name = f"test_codegen_matmul_{dtype}_{'small' if tiling else 'default'}"
    obj = HostCompiler().compile(matmul_ir(name, dtype, tiling))
    return native_loader.load(obj, name, SIGNATURE).cfunc


@pytest.fixture(scope="module")
def kernels():
    return {(dtype, small): _compile(dtype, SMALL_TILING[dtype] if small else None)
            for dtype in ("float32", "float64") for small in (False, True)}


def _run(kernel, a: np.ndarray, b: np.ndarray, c: np.ndarray, batch: int, M: int, N: int, K: int,
         strides: tuple[int, int, int], tiling: Tiling | None = None, strided: StridedOperand | None = None) -> None:
    """Calls the kernel with a workspace of exactly workspace_bytes, followed by guard bytes."""
    dtype = str(c.dtype)
    size = workspace_bytes(M, N, K, dtype, tiling, strided)
    raw = np.full(size + 64 + 256, GUARD, np.uint8)
    start = -raw.ctypes.data % 64
    kernel(c.ctypes.data, a.ctypes.data, b.ctypes.data, raw.ctypes.data + start, batch, M, N, K, *strides)
    assert (raw[start + size:] == GUARD).all(), "kernel wrote past its workspace"
    assert (raw[:start] == GUARD).all(), "kernel wrote before its workspace"


def _operands(rng: np.random.Generator, dtype: str, *shapes: tuple[int, ...]) -> list[np.ndarray]:
    return [rng.uniform(-1, 1, shape).astype(dtype) for shape in shapes]


def _check(c: np.ndarray, a: np.ndarray, b: np.ndarray, dtype: str) -> None:
    K = a.shape[-1]
    expected = np.matmul(a.astype(np.float64), b.astype(np.float64))
    # uniform(-1, 1) terms: absolute error grows with K even where the sum cancels to ~0.
    np.testing.assert_allclose(c, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * K)


SHAPES = [(1, 1, 1), (7, 13, 29), (6, 32, 1), (5, 31, 3), (13, 33, 1), (1, 100, 17), (100, 1, 17),
          (1, 1, 300), (300, 2, 3), (2, 300, 3), (49, 65, 64), (50, 97, 1030), (6, 32, 8), (97, 129, 40)]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("small", [False, True], ids=["default_tiling", "small_tiling"])
@pytest.mark.parametrize("M,N,K", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
def test_matches_numpy(kernels, dtype: str, small: bool, M: int, N: int, K: int) -> None:
    a, b = _operands(np.random.default_rng(M * 10007 + N * 101 + K), dtype, (M, K), (K, N))
    c = np.full((M, N), np.nan, dtype)   # every element must be written, none read before
    _run(kernels[dtype, small], a, b, c, 1, M, N, K, (0, 0, 0), SMALL_TILING[dtype] if small else None)
    _check(c, a, b, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_result_does_not_depend_on_tiling(kernels, dtype: str) -> None:
    """The K sum is one sequential FMA chain per element, so the blocking must not change a bit."""
    M, N, K = 37, 70, 1100   # K > the default KC: several KC blocks either way
    a, b = _operands(np.random.default_rng(1), dtype, (M, K), (K, N))
    results = []
    for small in (False, True):
        c = np.empty((M, N), dtype)
        _run(kernels[dtype, small], a, b, c, 1, M, N, K, (0, 0, 0), SMALL_TILING[dtype] if small else None)
        results.append(c)
    np.testing.assert_array_equal(results[0], results[1])
    _check(results[0], a, b, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("broadcast", ["none", "A", "B"])
def test_batched_with_strides(kernels, dtype: str, broadcast: str) -> None:
    batch, M, N, K = 4, 11, 35, 9
    rng = np.random.default_rng(2)
    a = _operands(rng, dtype, (M, K) if broadcast == "A" else (batch, M, K))[0]
    b = _operands(rng, dtype, (K, N) if broadcast == "B" else (batch, K, N))[0]
    # C items padded apart: the kernel must honour strideC and leave the gaps alone.
    padded = np.full((batch, M * N + 5), -7.0, dtype)
    strides = (0 if broadcast == "A" else M * K, 0 if broadcast == "B" else K * N, M * N + 5)
    _run(kernels[dtype, False], a, b, padded, batch, M, N, K, strides)
    c = padded[:, :M * N].reshape(batch, M, N)
    _check(c, np.broadcast_to(a, (batch, M, K)), np.broadcast_to(b, (batch, K, N)), dtype)
    assert (padded[:, M * N:] == -7.0).all()


def test_workspace_covers_every_block() -> None:
    t = DEFAULT_TILINGS["float32"]
    small = workspace_bytes(1, 1, 1)
    assert small >= 4 * (t.nr + t.mr + t.mr * t.nr)
    # Big problems are blocked: the workspace stops growing once every block is full size.
    assert workspace_bytes(10 * t.mc, 10 * t.nc, 10 * t.kc) == workspace_bytes(t.mc, t.nc, t.kc)
    assert workspace_bytes(10, 10, 10, "float64") > workspace_bytes(10, 10, 10, "float32")


def test_unsupported_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="float16"):
        matmul_ir("never_compiled", "float16")
    with pytest.raises(ValueError, match="float16"):
        workspace_bytes(1, 1, 1, "float16")


# A convolution's im2col columns as a view of its padded (N, C, H, W) input: rows (C, KH, KW),
# columns (N, OH, OW). Odd sizes: partial micro-panels and blocks, runs (OW) that do or do not
# divide NR, and a strided window whose columns are not consecutive at all.
CONVOLUTIONS = [  # (n, c, h, w, kh, kw, stride)
    (3, 2, 7, 10, 3, 3, 1), (2, 5, 6, 6, 3, 2, 1), (1, 3, 9, 11, 2, 3, 2), (5, 1, 4, 8, 1, 1, 1), (2, 4, 10, 18, 3, 3, 1),
]


def _columns_view(x: np.ndarray, kh: int, kw: int, stride: int) -> tuple[np.ndarray, StridedOperand, StridedOperand]:
    """im2col of x as numpy computes it, and the same matrix described as operand A and as B."""
    n, c, h, w = x.shape
    oh, ow = (h - kh) // stride + 1, (w - kw) // stride + 1
    cols = np.lib.stride_tricks.sliding_window_view(x, (kh, kw), axis=(2, 3))[:, :, ::stride, ::stride]
    matrix = cols.transpose(1, 4, 5, 0, 2, 3).reshape(c * kh * kw, n * oh * ow)
    rows = ((c, h * w), (kh, w), (kw, 1))
    columns = ((n, c * h * w), (oh, stride * w), (ow, stride))
    return matrix, StridedOperand("a", rows, columns, 0), StridedOperand("b", rows, columns, 0)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("small", [False, True], ids=["default_tiling", "small_tiling"])
@pytest.mark.parametrize("conv", CONVOLUTIONS, ids=["x".join(map(str, conv)) for conv in CONVOLUTIONS])
def test_strided_operand_matches_numpy(dtype: str, small: bool, conv: tuple[int, ...]) -> None:
    """Each operand read through a convolution's window view, against numpy on the copied columns."""
    n, c, h, w, kh, kw, stride = conv
    rng = np.random.default_rng(sum(conv))
    x = rng.uniform(-1, 1, (n, c, h, w)).astype(dtype)
    columns, as_a, as_b = _columns_view(x, kh, kw, stride)
    rows, cols = columns.shape
    tiling = SMALL_TILING[dtype] if small else None
    for strided in (as_a, as_b):
        name = f"test_strided_{dtype}_{'small' if small else 'default'}_{strided.operand}_{'_'.join(map(str, conv))}"
        kernel = native_loader.load(HostCompiler().compile(matmul_ir(name, dtype, tiling, strided)), name, SIGNATURE).cfunc
        if strided.operand == "b":   # weights @ columns, as a convolution's forward
            a, b, M, N, K = _operands(rng, dtype, (7, rows))[0], x, 7, cols, rows
            expected_b = columns
        else:                        # columns @ output gradient, as its weight gradient
            a, b, M, N, K = x, _operands(rng, dtype, (cols, 6))[0], rows, 6, cols
            expected_b = b
        c_out = np.full((M, N), np.nan, dtype)
        _run(kernel, a, b, c_out, 1, M, N, K, (0, 0, 0), tiling, strided)
        _check(c_out, columns if strided.operand == "a" else a, expected_b, dtype)


def test_strided_operand_run() -> None:
    """Consecutive columns: the innermost unit-stride axes, merged while they continue each other."""
    assert StridedOperand("b", ((4, 1),), ((2, 64), (8, 1)), 0).run == 8
    assert StridedOperand("b", ((4, 1),), ((2, 8), (8, 1)), 0).run == 16
    assert StridedOperand("b", ((4, 1),), ((2, 64), (8, 2)), 0).run == 1
