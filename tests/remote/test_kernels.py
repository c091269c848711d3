"""The node accepts every kernel the project itself generates (issue 23, item 7): a broad matrix of
tensor ops (elementwise, reductions, matmul, views, over several dtypes) computed on a remote
device through the node's verifier and compiler, each equal to numpy's float64 or exact result, and
an elementwise op large enough for the codegen's streaming stores (which end with a fence)."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import tinydist as td

DTYPES = {"f32": np.float32, "f64": np.float64, "i32": np.int32, "i64": np.int64}


@pytest.fixture(scope="module")
def remote(server, lab, tmp_path_factory) -> Iterator[str]:
    """The module server's CPU:0 as an engine device, under bob's certificate."""
    folder = tmp_path_factory.mktemp("bob")
    with pytest.MonkeyPatch.context() as env:
        for part in ("cert", "key", "ca"):
            (folder / part).write_bytes(getattr(lab.creds["bob"], part))
            env.setenv(f"TINYDIST_{part.upper()}", str(folder / part))
        name = f"remote://127.0.0.1:{server.port}/CPU:0"
        yield name
        engine = td.get_engine()
        gc.collect()
        engine.synchronize(30)
        device = engine._devices.pop(name, None)
        if device is not None:
            engine.run(device.aclose)


def sample(dtype: type, shape: tuple[int, ...], seed: int, positive: bool = False) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        values = rng.uniform(0.25, 4.0, shape) if positive else rng.uniform(-4.0, 4.0, shape)
    else:
        values = rng.integers(1 if positive else -50, 50, shape)
    return values.astype(dtype)


def same(got: td.Tensor, expected: np.ndarray) -> None:
    expected = np.asarray(expected)
    result = got.numpy()
    assert result.shape == expected.shape and result.dtype == expected.dtype, (result.shape, result.dtype, expected.dtype)
    if expected.dtype.kind == "f":
        tolerance = 2e-5 if expected.dtype == np.float32 else 1e-12
        np.testing.assert_allclose(result, expected, rtol=tolerance, atol=tolerance)
    else:
        np.testing.assert_array_equal(result, expected)


Op = Callable[..., object]
# name -> (tinydist op, numpy op, operands' shapes, needs positive inputs, dtypes kinds it takes)
ELEMENTWISE: dict[str, tuple[Op, Op, bool, str]] = {
    "add": (lambda a, b: a + b, np.add, False, "fi"),
    "sub": (lambda a, b: a - b, np.subtract, False, "fi"),
    "mul": (lambda a, b: a * b, np.multiply, False, "fi"),
    "div": (lambda a, b: a / b, np.true_divide, True, "f"),
    "maximum": (lambda a, b: a.maximum(b), np.maximum, False, "fi"),
    "lt": (lambda a, b: a < b, np.less, False, "fi"),
    "where": (lambda a, b: (a > b).where(a, b), lambda a, b: np.where(a > b, a, b), False, "fi"),
}
UNARY: dict[str, tuple[Op, Op, bool, str]] = {
    "neg": (lambda a: -a, np.negative, False, "fi"),
    "abs": (lambda a: a.abs(), np.abs, False, "fi"),
    "relu": (lambda a: a.relu(), lambda a: np.maximum(a, 0), False, "fi"),
    "exp": (lambda a: a.exp(), np.exp, False, "f"),
    "log": (lambda a: a.log(), np.log, True, "f"),
    "sqrt": (lambda a: a.sqrt(), np.sqrt, True, "f"),
    "sin": (lambda a: a.sin(), np.sin, False, "f"),
    "tanh": (lambda a: a.tanh(), np.tanh, False, "f"),
}
REDUCE: dict[str, tuple[Op, Op, str]] = {
    "sum_all": (lambda a: a.sum(), lambda a: a.sum(), "fi"),
    "sum_rows": (lambda a: a.sum(axis=1), lambda a: a.sum(axis=1), "fi"),
    "max_cols": (lambda a: a.max(axis=0), lambda a: a.max(axis=0), "fi"),
    "mean_keepdim": (lambda a: a.mean(axis=1, keepdim=True), lambda a: a.mean(axis=1, keepdims=True), "f"),
    "argmax": (lambda a: a.argmax(axis=1), lambda a: a.argmax(axis=1), "fi"),
    "softmax": (lambda a: a.softmax(axis=-1), lambda a: np.exp(a - a.max(-1, keepdims=True)) / np.exp(a - a.max(-1, keepdims=True)).sum(-1, keepdims=True), "f"),
}
VIEWS: dict[str, tuple[Op, Op]] = {
    "transpose_add": (lambda a: a.transpose(1, 0) + 1, lambda a: a.T + 1),
    "reshape_mul": (lambda a: a.reshape(24, 40) * 2, lambda a: a.reshape(24, 40) * 2),
    "slice_sub": (lambda a: a[1:20:2, 3:] - a[0:10, 3:], lambda a: a[1:20:2, 3:] - a[0:10, 3:]),
    "broadcast_row": (lambda a: a + a[0:1, :], lambda a: a + a[0:1, :]),
    "pad": (lambda a: a.pad(((1, 2), (0, 3))), lambda a: np.pad(a, ((1, 2), (0, 3)))),
}


def _cases(table: dict, kinds_at: int) -> list:
    return [pytest.param(name, dt, id=f"{name}-{dt}") for name, spec in table.items() for dt in DTYPES
            if np.dtype(DTYPES[dt]).kind in spec[kinds_at]]


@pytest.mark.parametrize("name,dt", _cases(ELEMENTWISE, 3))
def test_binary(remote, name, dt) -> None:
    ours, theirs, positive, _ = ELEMENTWISE[name]
    a, b = sample(DTYPES[dt], (32, 30), 1, positive), sample(DTYPES[dt], (32, 30), 2, positive)
    same(ours(td.Tensor(a, device=remote), td.Tensor(b, device=remote)), theirs(a, b))


@pytest.mark.parametrize("name,dt", _cases(UNARY, 3))
def test_unary(remote, name, dt) -> None:
    ours, theirs, positive, _ = UNARY[name]
    a = sample(DTYPES[dt], (32, 30), 3, positive)
    same(ours(td.Tensor(a, device=remote)), theirs(a))


@pytest.mark.parametrize("name,dt", _cases(REDUCE, 2))
def test_reduce(remote, name, dt) -> None:
    ours, theirs, _ = REDUCE[name]
    a = sample(DTYPES[dt], (32, 30), 4)
    same(ours(td.Tensor(a, device=remote)), theirs(a))


@pytest.mark.parametrize("name", list(VIEWS))
@pytest.mark.parametrize("dt", ["f32", "i32"])
def test_views(remote, name, dt) -> None:
    ours, theirs = VIEWS[name]
    a = sample(DTYPES[dt], (32, 30), 5)
    same(ours(td.Tensor(a, device=remote)), theirs(a))


@pytest.mark.parametrize("dt", ["f32", "f64", "i32"])
def test_matmul(remote, dt) -> None:
    a, b = sample(DTYPES[dt], (40, 56), 6), sample(DTYPES[dt], (56, 24), 7)
    expected = (a.astype(np.float64) @ b.astype(np.float64)).astype(DTYPES[dt])
    same(td.Tensor(a, device=remote) @ td.Tensor(b, device=remote), expected)


def test_conv2d_and_a_chain(remote) -> None:
    x, w = sample(np.float32, (2, 3, 12, 12), 8), sample(np.float32, (4, 3, 3, 3), 9)
    expected = np.zeros((2, 4, 10, 10))
    for i in range(10):
        for j in range(10):
            expected[:, :, i, j] = np.einsum("nchw,ochw->no", x[:, :, i:i + 3, j:j + 3].astype(np.float64), w)
    got = td.Tensor(x, device=remote).conv2d(td.Tensor(w, device=remote)).relu().sum(axis=(2, 3))
    same(got, np.maximum(expected, 0).sum(axis=(2, 3)).astype(np.float32))


def test_a_48_mib_elementwise_op_equals_numpy(remote, server) -> None:
    """48 MiB of output: past the size where the codegen switches to streaming stores and its fence."""
    x = np.random.default_rng(10).standard_normal(12 << 20).astype(np.float32)  # 12 Mi floats = 48 MiB
    got = (td.Tensor(x, device=remote) * 3 + 1).numpy()
    # against float64: the kernel may fuse the multiply-add (one rounding), numpy rounds twice
    np.testing.assert_allclose(got, x.astype(np.float64) * 3 + 1, rtol=2e-7, atol=2e-7)
