"""The generated matmul kernel against numpy: edge tiles, blocking, batching, workspace bounds."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np
import pytest

from tinydist.codegen.compiler import HostCompiler
from tinydist.codegen.matmul import SIGNATURE, matmul_ir, signature
from tinydist.codegen.matmul_packing import PACK_B_SIGNATURE, pack_a_array, pack_b_array, pack_b_array_of_transpose, pack_b_ir
from tinydist.codegen.matmul_tiling import (
    DEFAULT_TILINGS, GATHERED_B_TILINGS, StridedOperand, Tiling, packed_a_elements, packed_b_elements, tiling_for,
    workspace_bytes,
)
from tinydist.runtime.cpu.loader import native_loader

GUARD = 0xA5
# Tiny cache blocks make even small problems cross every block boundary (several jc, pc, ic
# blocks, partial ones included), which the default tiling only does for huge shapes. They also
# sweep an in-place B (M <= MR) two or three rows at a time.
SMALL_TILING = {"float32": Tiling(mr=2, nr=16, kc=5, mc=4, nc=32, direct_kc=2),
                "float64": Tiling(mr=3, nr=8, kc=7, mc=6, nc=16, direct_kc=3)}
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
    kernel(c.ctypes.data, a.ctypes.data, b.ctypes.data, raw.ctypes.data + start, batch, M, N, K, *strides,
           *(strided.arguments() if strided is not None else ()))
    assert (raw[start + size:] == GUARD).all(), "kernel wrote past its workspace"
    assert (raw[:start] == GUARD).all(), "kernel wrote before its workspace"


def _operands(rng: np.random.Generator, dtype: str, *shapes: tuple[int, ...]) -> list[np.ndarray]:
    return [rng.uniform(-1, 1, shape).astype(dtype) for shape in shapes]


def _check(c: np.ndarray, a: np.ndarray, b: np.ndarray, dtype: str) -> None:
    K = a.shape[-1]
    expected = np.matmul(a.astype(np.float64), b.astype(np.float64))
    # uniform(-1, 1) terms: absolute error grows with K even where the sum cancels to ~0.
    np.testing.assert_allclose(c, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * K)


# M <= MR (B read in place, several panels wide) and above; N on and off the panel width; K over
# the default KC; N over the default NC.
SHAPES = [(1, 1, 1), (7, 13, 29), (6, 32, 1), (5, 31, 3), (13, 33, 1), (1, 100, 17), (100, 1, 17),
          (1, 1, 300), (300, 2, 3), (2, 300, 3), (49, 65, 64), (50, 97, 1030), (6, 32, 8), (97, 129, 40),
          (3, 2100, 70), (1, 127, 1100), (8, 161, 9), (9, 128, 33), (19, 250, 6)]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("small", [False, True], ids=["default_tiling", "small_tiling"])
@pytest.mark.parametrize("M,N,K", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
def test_matches_numpy(kernels, dtype: str, small: bool, M: int, N: int, K: int) -> None:
    a, b = _operands(np.random.default_rng(M * 10007 + N * 101 + K), dtype, (M, K), (K, N))
    fenced = np.full(M * N + 64, -7.0, dtype)   # C, then guard elements an edge tile's stores must not reach
    c = fenced[:M * N].reshape(M, N)
    c[...] = np.nan   # every element must be written, none read before
    _run(kernels[dtype, small], a, b, c, 1, M, N, K, (0, 0, 0), SMALL_TILING[dtype] if small else None)
    _check(c, a, b, dtype)
    assert (fenced[M * N:] == -7.0).all(), "kernel wrote past C"


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
    assert small >= 4 * (t.nr + t.mr)   # one micro-panel of B and one of A
    assert workspace_bytes(100, 300, 200, prepacked="b") < workspace_bytes(100, 300, 200)   # no B block
    assert workspace_bytes(100, 300, 200, prepacked="a") < workspace_bytes(100, 300, 200)   # no A block
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
        form = strided.form(tiling or DEFAULT_TILINGS[dtype])
        kernel = native_loader.load(HostCompiler().compile(matmul_ir(name, dtype, tiling, strided)), name,
                                    signature(form)).cfunc
        _check_strided(kernel, rng, x, columns, strided, dtype, tiling)


def _check_strided(kernel, rng: np.random.Generator, x: np.ndarray, columns: np.ndarray, strided: StridedOperand,
                   dtype: str, tiling: Tiling | None) -> None:
    rows, cols = columns.shape
    if strided.operand == "b":   # weights @ columns, as a convolution's forward
        a, b, M, N, K = _operands(rng, dtype, (7, rows))[0], x, 7, cols, rows
        expected_b = columns
    else:                        # columns @ output gradient, as its weight gradient
        a, b, M, N, K = x, _operands(rng, dtype, (cols, 6))[0], rows, 6, cols
        expected_b = b
    c_out = np.full((M, N), np.nan, dtype)
    _run(kernel, a, b, c_out, 1, M, N, K, (0, 0, 0), tiling, strided)
    _check(c_out, columns if strided.operand == "a" else a, expected_b, dtype)


@pytest.mark.parametrize("operand", ["a", "b"])
def test_views_of_one_form_share_a_kernel(operand: str) -> None:
    """One kernel, compiled from the form of one view, reads views of other sizes, strides and
    offsets of that form (a network's convolutions): each against numpy."""
    convs = [(2, 3, 9, 12, 3, 3, 2), (1, 5, 7, 7, 2, 3, 2), (3, 2, 12, 9, 1, 1, 2)]  # run 1 each: one form
    if operand == "b":   # B's pieces are chosen from the run at run time: runs 8, 4, 7 and 16 are the same form
        convs += [(1, 2, 10, 10, 3, 3, 1), (2, 3, 6, 6, 3, 3, 1), (1, 2, 9, 9, 3, 3, 1), (1, 1, 18, 18, 3, 3, 1)]
    rng = np.random.default_rng(7)
    views = []
    for conv in convs:
        n, c, h, w, kh, kw, stride = conv
        x = rng.uniform(-1, 1, (n, c, h, w)).astype("float32")
        columns, as_a, as_b = _columns_view(x, kh, kw, stride)
        views.append((x, columns, as_a if operand == "a" else as_b))
    forms = {view.form(DEFAULT_TILINGS["float32"]) for _, _, view in views}
    assert len(forms) == 1
    name = f"test_shared_form_{operand}"
    kernel = native_loader.load(HostCompiler().compile(matmul_ir(name, "float32", strided=views[0][2])), name,
                                signature(forms.pop())).cfunc
    for x, columns, view in views:
        _check_strided(kernel, rng, x, columns, view, "float32", None)


@pytest.mark.parametrize("conv", [(1, 64, 34, 50, 3, 3, 1), (2, 72, 45, 47, 3, 3, 2)], ids=["64ch", "72ch_stride2"])
def test_gathered_b_past_the_l2_is_blocked_smaller(conv: tuple[int, ...]) -> None:
    """A convolution's columns whose default KC×NC block outgrows the L2 get GATHERED_B_TILINGS
    (several KC and NC blocks here, partial ones too), and still match numpy; operand A, a
    transposed matrix and a small convolution keep the default blocking."""
    n, c, h, w, kh, kw, stride = conv
    rng = np.random.default_rng(sum(conv))
    x = rng.uniform(-1, 1, (n, c, h, w)).astype(np.float32)
    columns, as_a, as_b = _columns_view(x, kh, kw, stride)
    assert tiling_for("float32", as_b) == GATHERED_B_TILINGS["float32"]
    assert tiling_for("float32", as_a) == tiling_for("float32", None) == DEFAULT_TILINGS["float32"]
    assert tiling_for("float32", StridedOperand("b", ((4096, 1),), ((4096, 4096),), 0)) == DEFAULT_TILINGS["float32"]
    assert tiling_for("float32", _columns_view(x[:, :4], kh, kw, stride)[2]) == DEFAULT_TILINGS["float32"]
    rows, cols = columns.shape
    name = f"test_gathered_b_{'_'.join(map(str, conv))}"
    kernel = native_loader.load(HostCompiler().compile(matmul_ir(name, "float32", strided=as_b)), name,
                                signature(as_b.form(GATHERED_B_TILINGS["float32"]))).cfunc
    a = _operands(rng, "float32", (20, rows))[0]
    c_out = np.full((20, cols), np.nan, np.float32)
    _run(kernel, a, x, c_out, 1, 20, cols, rows, (0, 0, 0), None, as_b)
    _check(c_out, a, columns, "float32")


def test_strided_operand_run() -> None:
    """Consecutive columns: the innermost unit-stride axes, merged while they continue each other."""
    assert StridedOperand("b", ((4, 1),), ((2, 64), (8, 1)), 0).run == 8
    assert StridedOperand("b", ((4, 1),), ((2, 8), (8, 1)), 0).run == 16
    assert StridedOperand("b", ((4, 1),), ((2, 64), (8, 2)), 0).run == 1


def _compile_packed(dtype: str, tiling: Tiling | None):
    suffix = f"{dtype}_{'small' if tiling else 'default'}"
    matmul = native_loader.load(HostCompiler().compile(matmul_ir(f"test_prepacked_{suffix}", dtype, tiling, prepacked="b")),
                                f"test_prepacked_{suffix}", SIGNATURE).cfunc
    pack = native_loader.load(HostCompiler().compile(pack_b_ir(f"test_pack_b_{suffix}", dtype, tiling)),
                              f"test_pack_b_{suffix}", PACK_B_SIGNATURE).cfunc
    return matmul, pack


@pytest.fixture(scope="module")
def packed_kernels():
    return {(dtype, small): _compile_packed(dtype, SMALL_TILING[dtype] if small else None)
            for dtype in ("float32", "float64") for small in (False, True)}


PACKED_SHAPES = [(1, 1, 1, 1), (1, 7, 13, 29), (1, 1, 100, 17), (1, 3, 2100, 70), (1, 50, 97, 1030), (4, 11, 35, 9),
                 (3, 64, 64, 32), (2, 9, 129, 1100)]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("small", [False, True], ids=["default_tiling", "small_tiling"])
@pytest.mark.parametrize("batch,M,N,K", PACKED_SHAPES, ids=["x".join(map(str, s)) for s in PACKED_SHAPES])
def test_prepacked_b_matches_packing_per_call(kernels, packed_kernels, dtype: str, small: bool,
                                              batch: int, M: int, N: int, K: int) -> None:
    """B packed once by pack_b_ir (a weight at load), then read by the prepacked kernel: the same
    bits as the kernel that packs per call (the reduction order is the contract), and numpy's
    product within rounding. Packed items are `packed_b_elements` apart; the packer writes
    exactly that many elements."""
    tiling = SMALL_TILING[dtype] if small else None
    matmul, pack = packed_kernels[dtype, small]
    a, b = _operands(np.random.default_rng(batch * 7 + M * 13 + N + K), dtype, (batch, M, K), (batch, K, N))
    per_item = packed_b_elements(K, N, dtype, tiling)
    itemsize = np.dtype(dtype).itemsize
    raw = np.full(batch * per_item * itemsize + 64 + 256, GUARD, np.uint8)
    start = -raw.ctypes.data % 64
    for item in range(batch):
        pack(raw.ctypes.data + start + item * per_item * itemsize, b[item].ctypes.data, K, N)
    assert (raw[start + batch * per_item * itemsize:] == GUARD).all(), "pack_b wrote past packed_b_elements"
    packed_c = np.full((batch, M, N), np.nan, dtype)
    size = workspace_bytes(M, N, K, dtype, tiling, prepacked="b")
    workspace = np.full(size + 64 + 256, GUARD, np.uint8)
    w = -workspace.ctypes.data % 64
    matmul(packed_c.ctypes.data, a.ctypes.data, raw.ctypes.data + start, workspace.ctypes.data + w, batch, M, N, K,
           M * K, per_item, M * N)
    assert (workspace[w + size:] == GUARD).all(), "kernel wrote past its workspace"
    per_call = np.full((batch, M, N), np.nan, dtype)
    _run(kernels[dtype, small], a, b, per_call, batch, M, N, K, (M * K, K * N, M * N), tiling)
    np.testing.assert_array_equal(packed_c, per_call)
    _check(packed_c, a, b, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("small", [False, True], ids=["default_tiling", "small_tiling"])
@pytest.mark.parametrize("N,K", [(512, 4608), (128, 1030), (64, 7), (96, 2100), (16, 9), (2048, 3), (4096, 5), (100, 33)])
def test_pack_b_array_of_transpose_is_pack_b_array(dtype: str, small: bool, N: int, K: int) -> None:
    """A turned-around convolution's weight (N x K) packed as B straight from its rows: the same
    elements as packing its transpose, with and without the fast path (N a multiple of NR in one NC block)."""
    tiling = SMALL_TILING[dtype] if small else None
    a = _operands(np.random.default_rng(K * N), dtype, (N, K))[0]
    np.testing.assert_array_equal(pack_b_array_of_transpose(a, tiling), pack_b_array(np.ascontiguousarray(a.T), tiling))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("small", [False, True], ids=["default_tiling", "small_tiling"])
@pytest.mark.parametrize("K,N", [(1, 1), (29, 13), (1030, 97), (70, 2100), (9, 129)])
def test_pack_b_array_is_pack_b_ir(packed_kernels, dtype: str, small: bool, K: int, N: int) -> None:
    """The numpy packer (weights at load) writes exactly what the generated one does."""
    tiling = SMALL_TILING[dtype] if small else None
    b = _operands(np.random.default_rng(K + N), dtype, (K, N))[0]
    raw = np.full(packed_b_elements(K, N, dtype, tiling) * np.dtype(dtype).itemsize + 64, 0xFF, np.uint8)
    start = -raw.ctypes.data % 64
    packed_kernels[dtype, small][1](raw.ctypes.data + start, b.ctypes.data, K, N)
    generated = raw[start:start + packed_b_elements(K, N, dtype, tiling) * np.dtype(dtype).itemsize].view(dtype)
    np.testing.assert_array_equal(pack_b_array(b, tiling), generated)


def test_prepacked_operand_cannot_be_strided() -> None:
    with pytest.raises(ValueError, match="prepacked B"):
        matmul_ir("never_compiled", "float32", strided=StridedOperand("b", ((4, 1),), ((8, 4),), 0), prepacked="b")
    with pytest.raises(ValueError, match="prepacked A"):
        matmul_ir("never_compiled", "float32", strided=StridedOperand("a", ((4, 1),), ((8, 4),), 0), prepacked="a")
    with pytest.raises(ValueError, match="'a' or 'b'"):
        matmul_ir("never_compiled", "float32", prepacked="c")


def _run_prepacked_a(kernel, packed: np.ndarray, b: np.ndarray, batch: int, M: int, N: int, K: int, b_stride: int,
                     tiling: Tiling | None, strided: StridedOperand | None = None) -> np.ndarray:
    """The prepacked-A kernel on `packed` (items `packed_a_elements` apart) with a workspace of exactly
    workspace_bytes(prepacked="a") followed by guard bytes; C."""
    dtype = str(b.dtype)
    c = np.full((batch, M, N), np.nan, dtype)
    size = workspace_bytes(M, N, K, dtype, tiling, strided, prepacked="a")
    raw = np.full(size + 64 + 256, GUARD, np.uint8)
    start = -raw.ctypes.data % 64
    per_item = packed_a_elements(M, K, dtype, tiling) if batch > 1 else 0
    kernel(c.ctypes.data, packed.ctypes.data, b.ctypes.data, raw.ctypes.data + start, batch, M, N, K, per_item, b_stride,
           M * N, *(strided.arguments() if strided is not None else ()))
    assert (raw[start + size:] == GUARD).all(), "kernel wrote past its workspace"
    return c


@pytest.fixture(scope="module")
def prepacked_a_kernels():
    def load(dtype: str, small: bool):
        name = f"test_prepacked_a_{dtype}_{'small' if small else 'default'}"
        ir_text = matmul_ir(name, dtype, SMALL_TILING[dtype] if small else None, prepacked="a")
        return native_loader.load(HostCompiler().compile(ir_text), name, SIGNATURE).cfunc
    return {(dtype, small): load(dtype, small) for dtype in ("float32", "float64") for small in (False, True)}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("small", [False, True], ids=["default_tiling", "small_tiling"])
@pytest.mark.parametrize("batch,M,N,K", PACKED_SHAPES, ids=["x".join(map(str, s)) for s in PACKED_SHAPES])
def test_prepacked_a_matches_packing_per_call(kernels, prepacked_a_kernels, dtype: str, small: bool,
                                              batch: int, M: int, N: int, K: int) -> None:
    """A packed once by pack_a_array (a convolution's weight at load), read by the prepacked-A
    kernel: the same bits as the kernel that packs A per call, and numpy's product within rounding;
    nothing past the packed rows is read (a guard of NaNs after the packed items)."""
    tiling = SMALL_TILING[dtype] if small else None
    kernel = prepacked_a_kernels[dtype, small]
    a, b = _operands(np.random.default_rng(batch * 5 + M * 11 + N + K), dtype, (batch, M, K), (batch, K, N))
    packed = np.concatenate([pack_a_array(item, tiling) for item in a] + [np.full(64, np.nan, dtype)])
    assert packed.size - 64 == batch * packed_a_elements(M, K, dtype, tiling)
    c = _run_prepacked_a(kernel, packed, b, batch, M, N, K, K * N, tiling)
    per_call = np.full((batch, M, N), np.nan, dtype)
    _run(kernels[dtype, small], a, b, per_call, batch, M, N, K, (M * K, K * N, M * N), tiling)
    np.testing.assert_array_equal(c, per_call)
    _check(c, a, b, dtype)


@pytest.mark.parametrize("small", [False, True], ids=["default_tiling", "small_tiling"])
@pytest.mark.parametrize("conv", CONVOLUTIONS + [(1, 72, 12, 12, 3, 3, 1), (1, 64, 34, 50, 3, 3, 1)],
                         ids=["x".join(map(str, conv)) for conv in CONVOLUTIONS] + ["72ch", "64ch_gathered_tiling"])
def test_prepacked_a_times_strided_b(small: bool, conv: tuple[int, ...]) -> None:
    """A convolution's forward as it runs: its weight packed at load times the columns gathered from
    its input, whichever blocking the columns' view gets (GATHERED_B_TILINGS past the L2, with its
    KC of 256 over K = 576): bitwise the kernel that packs the weight per call, and numpy's within rounding."""
    n, c, h, w, kh, kw, stride = conv
    rng = np.random.default_rng(sum(conv) + 1)
    x = rng.uniform(-1, 1, (n, c, h, w)).astype(np.float32)
    columns, _, as_b = _columns_view(x, kh, kw, stride)
    K, N = columns.shape
    M = 20
    tiling = SMALL_TILING["float32"] if small else None
    form = as_b.form(tiling or tiling_for("float32", as_b))
    kernels = {}
    for prepacked in (None, "a"):
        name = f"test_conv_prepacked_{prepacked}_{'small' if small else 'default'}_{'_'.join(map(str, conv))}"
        kernels[prepacked] = native_loader.load(HostCompiler().compile(
            matmul_ir(name, "float32", tiling, as_b, prepacked=prepacked)), name, signature(form)).cfunc
    weight = _operands(rng, "float32", (M, K))[0]
    packed = _run_prepacked_a(kernels["a"], pack_a_array(weight, tiling), x, 1, M, N, K, 0, tiling, as_b)[0]
    per_call = np.full((M, N), np.nan, np.float32)
    _run(kernels[None], weight, x, per_call, 1, M, N, K, (0, 0, 0), tiling, as_b)
    np.testing.assert_array_equal(packed, per_call)
    _check(packed, weight, columns, "float32")


_PROT_NONE = 0   # not in Python's mmap module
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


@pytest.mark.parametrize("M,N,K", [(1, 33, 5), (3, 100, 7), (8, 17, 70), (5, 161, 2)])
def test_in_place_operands_read_nothing_past_their_end(kernels, M: int, N: int, K: int) -> None:
    """A small-M product reads B in place with masked loads (and packs A): A and B are laid out
    to end exactly where an inaccessible page begins, so a read of one element past either faults."""
    page = mmap.PAGESIZE
    regions = []
    try:
        arrays = []
        for rows, cols in ((M, K), (K, N)):
            nbytes = rows * cols * 4
            span = -(-nbytes // page) * page
            base = _libc.mmap(None, span + page, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
            assert base not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
            regions.append((base, span + page))
            assert _libc.mprotect(base + span, page, _PROT_NONE) == 0, ctypes.get_errno()
            array = np.ctypeslib.as_array((ctypes.c_float * (rows * cols)).from_address(base + span - nbytes)).reshape(rows, cols)
            arrays.append(array)
        a, b = arrays
        a[...], b[...] = _operands(np.random.default_rng(M + N + K), "float32", (M, K), (K, N))
        c = np.full((M, N), np.nan, np.float32)
        _run(kernels["float32", False], a, b, c, 1, M, N, K, (0, 0, 0))
        _check(c, a, b, "float32")
    finally:
        for base, length in regions:
            _libc.munmap(base, length)
