"""The generated matmul kernel against numpy: edge tiles, blocking, batching, workspace bounds."""

from __future__ import annotations

import numpy as np
import pytest

from tinydist.codegen.compiler import HostCompiler
from tinydist.codegen.matmul import DEFAULT_TILINGS, SIGNATURE, Tiling, matmul_ir, workspace_bytes
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
         strides: tuple[int, int, int], tiling: Tiling | None = None) -> None:
    """Calls the kernel with a workspace of exactly workspace_bytes, followed by guard bytes."""
    dtype = str(c.dtype)
    size = workspace_bytes(M, N, K, dtype, tiling)
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
