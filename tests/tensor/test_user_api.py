"""The tensor API people reach for first (issue 22): nbytes, float()/int()/bool(), std/var with
torch's `correction` and numpy's `ddof`, view, cpu(), and the module-level factories — each
against torch (CPU) and numpy float64."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import tinydist as td

torch = pytest.importorskip("torch")

SHAPES = [(), (1,), (7,), (3, 4), (2, 3, 5)]
DTYPES = ["float32", "float64", "int32", "int64", "uint8", "bool"]


def sample(shape: tuple[int, ...], dtype: str, seed: int = 0) -> np.ndarray:
    values = np.random.default_rng(seed).normal(0, 3, shape)
    array = (values > 0) if dtype == "bool" else np.abs(values).astype(dtype) if dtype == "uint8" else values.astype(dtype)
    return np.asarray(array)   # a 0-d array, not a numpy scalar


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_nbytes_is_numpys_and_torchs(shape, dtype):
    x = sample(shape, dtype)
    t = td.Tensor(x)
    assert t.nbytes == x.nbytes == torch.from_numpy(x).nbytes
    assert t.itemsize == x.itemsize
    assert (t * 2).nbytes == (x * 2).nbytes   # lazy values know it too, from shape and dtype


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64", "bool"])
@pytest.mark.parametrize("shape", [(), (1,), (1, 1, 1)], ids=str)
def test_python_scalars_of_one_element_tensors(shape, dtype):
    x = sample(shape, dtype, seed=3) if dtype != "bool" else np.ones(shape, bool)
    t, ref = td.Tensor(x), torch.from_numpy(np.array(x))
    assert float(t) == float(ref)
    assert int(t) == int(ref)
    assert bool(t) == bool(ref)
    assert type(float(t)) is float and type(int(t)) is int
    assert float(t + 1) == float(ref + 1)   # a lazy value is computed first


@pytest.mark.parametrize("convert", [float, int, bool])
@pytest.mark.parametrize("shape", [(2, 3), (0,), (5,)], ids=str)
def test_python_scalars_of_other_tensors_name_the_shape(shape, convert):
    with pytest.raises((RuntimeError, ValueError)):
        convert(torch.zeros(shape))   # torch refuses these too
    with pytest.raises(ValueError, match=rf"shape \({', '.join(map(str, shape))},?\)"):
        convert(td.zeros(*shape))


VAR_CASES = [((7,), None), ((7,), 0), ((3, 4), None), ((3, 4), 0), ((3, 4), 1), ((3, 4), -1), ((2, 3, 5), (0, 2)),
             ((2, 3, 5), 1), ((2, 3, 5), None)]


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("correction", [0, 1, 2, 0.5])
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
@pytest.mark.parametrize("shape,axis", VAR_CASES, ids=str)
def test_std_and_var_against_numpy_float64_and_torch(shape, axis, dtype, correction, keepdim):
    x = sample(shape, dtype, seed=1)
    t = td.Tensor(x)
    reference = x.astype(np.float64)
    for name in ("var", "std"):
        expected = getattr(np, name)(reference, axis=axis, ddof=correction, keepdims=keepdim)
        by_torch_name = getattr(t, name)(axis, keepdim=keepdim, correction=correction)
        by_numpy_name = getattr(t, name)(axis, keepdim=keepdim, ddof=correction)
        rtol = 1e-5 if dtype == "float32" else 1e-12
        for got in (by_torch_name, by_numpy_name):
            assert got.shape == expected.shape
            assert got.dtype.np == getattr(np, name)(x, axis=axis, ddof=correction).dtype   # numpy's result type
            np.testing.assert_allclose(got.numpy(), expected, rtol=rtol, atol=rtol)
        if dtype != "int32":   # torch has no var of integers
            theirs = getattr(torch.from_numpy(x), name)(dim=axis, correction=correction, keepdim=keepdim)
            np.testing.assert_allclose(by_torch_name.numpy(), theirs.numpy(), rtol=rtol, atol=rtol)


def test_var_defaults_to_numpys_correction_and_says_so():
    x = sample((4, 5), "float64", seed=2)
    np.testing.assert_allclose(td.Tensor(x).var().numpy(), np.var(x), rtol=1e-12)
    np.testing.assert_allclose(td.Tensor(x).std(correction=1).numpy(), torch.from_numpy(x).std().numpy(), rtol=1e-12)
    with pytest.raises(TypeError, match="both correction=1 and ddof=1"):
        td.Tensor(x).std(correction=1, ddof=1)


def test_var_with_no_degrees_of_freedom_is_inf_or_nan_as_numpy():
    x = np.array([1.0, 2.0, 4.0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # numpy warns "Degrees of freedom <= 0"
        for correction in (3, 4):
            np.testing.assert_array_equal(td.Tensor(x).var(correction=correction).numpy(), np.var(x, ddof=correction))
        np.testing.assert_array_equal(td.Tensor(np.ones(3)).var(correction=3).numpy(), np.var(np.ones(3), ddof=3))


VIEWS = [((2, 3, 4), (24,)), ((2, 3, 4), (-1,)), ((2, 3, 4), (6, 4)), ((2, 3, 4), (2, -1)), ((6,), (3, 2)),
         ((1, 6), (6, 1, 1))]


@pytest.mark.parametrize("shape,new", VIEWS, ids=str)
def test_view_is_torchs_view_of_contiguous_tensors(shape, new):
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    theirs = torch.from_numpy(x).view(*new)
    for got in (td.Tensor(x).view(*new), td.Tensor(x).view(new), (td.Tensor(x) + 0).view(*new)):
        assert got.shape == tuple(theirs.shape)
        np.testing.assert_array_equal(got.numpy(), theirs.numpy())


def test_view_of_a_transposed_tensor_is_its_reshape():
    """torch refuses this view (the strides cannot express it); with no aliasing observable here
    it is the reshape torch's error message suggests."""
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        torch.from_numpy(x).t().view(-1)
    np.testing.assert_array_equal(td.Tensor(x).T.view(-1).numpy(), torch.from_numpy(x).t().reshape(-1).numpy())
    with pytest.raises(ValueError, match=r"cannot reshape tensor of shape \(4, 3\) into shape \(5,\)"):
        td.Tensor(x).T.view(5)


@pytest.mark.parametrize("src,dst", [("float32", "int32"), ("int32", "float32"), ("float64", "int64"), ("int16", "float16"),
                                     ("uint8", "int8")])
def test_view_as_a_dtype_reinterprets_bits_as_torch(src, dst):
    x = sample((3, 4), src, seed=5) if src != "uint8" else np.arange(12, dtype=np.uint8).reshape(3, 4) * 20
    got = td.Tensor(x).view(dst)
    theirs = torch.from_numpy(x).view(getattr(torch, dst))
    assert got.dtype.name == dst
    np.testing.assert_array_equal(got.numpy().view(np.uint8), theirs.numpy().view(np.uint8))
    with pytest.raises(ValueError, match="the sizes must match"):
        td.Tensor(x).view("float64" if np.dtype(src).itemsize != 8 else "int8")


def test_cpu_brings_a_tensor_to_the_first_cpu_device():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    elsewhere = (td.Tensor(x, device="CPU:1") * 2)
    assert elsewhere.device == "CPU:1"
    back = elsewhere.cpu()
    assert back.device == "CPU:0" == torch.zeros(1).cpu().device.type.upper() + ":0"
    np.testing.assert_array_equal(back.numpy(), x * 2)
    here = td.Tensor(x)
    assert here.cpu() is here


@pytest.mark.parametrize("dtype", [None, "float32", "float64", "int32", "int64", "bool"])
@pytest.mark.parametrize("shape", [(), (4,), (2, 3), (2, 0, 3)], ids=str)
def test_constant_factories_against_torch(shape, dtype):
    kw = {} if dtype is None else {"dtype": getattr(td, dtype if dtype != "bool" else "bool_")}
    tkw = {} if dtype is None else {"dtype": getattr(torch, dtype)}
    for name in ("zeros", "ones", "empty"):
        got, theirs = getattr(td, name)(shape, **kw), getattr(torch, name)(shape, **tkw)
        assert getattr(td, name)(*shape, **kw).shape == got.shape
        assert got.shape == tuple(theirs.shape)
        assert got.dtype.name == str(theirs.dtype).removeprefix("torch.")
        if name != "empty":   # torch's empty is uninitialised memory
            np.testing.assert_array_equal(got.numpy(), theirs.numpy())
        else:
            np.testing.assert_array_equal(got.numpy(), np.zeros(shape))
    got = td.full(shape, 3, **kw)
    np.testing.assert_array_equal(got.numpy(), torch.full(shape, 3, **tkw).numpy())
    like = td.Tensor(sample(shape, dtype or "float32"))
    tlike = torch.from_numpy(like.numpy())
    for name, args in (("zeros_like", ()), ("ones_like", ()), ("full_like", (2.5,))):
        mine, theirs = getattr(td, name)(like, *args), getattr(torch, name)(tlike, *args)
        assert mine.dtype.name == str(theirs.dtype).removeprefix("torch.") and mine.shape == tuple(theirs.shape)
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())
        recast = getattr(td, name)(like, *args, dtype=td.float64)
        np.testing.assert_array_equal(recast.numpy(), getattr(torch, name)(tlike, *args, dtype=torch.float64).numpy())
    assert td.empty_like(like).shape == like.shape and td.empty_like(like).dtype == like.dtype


def test_full_takes_numpys_dtype_from_its_value():
    for value in (3, 2.5, True):
        assert td.full((2,), value).dtype.np == np.full((2,), value).dtype


@pytest.mark.parametrize("args", [(5,), (2, 9), (2, 9, 3), (0.0, 1.0, 0.25), (10, 0, -3), (3, 3)], ids=str)
def test_arange_against_numpy_and_torch(args):
    expected = np.arange(*args)
    got = td.arange(*args)
    assert got.dtype.np == expected.dtype
    np.testing.assert_array_equal(got.numpy(), expected)
    np.testing.assert_allclose(td.arange(*args, dtype=td.float32).numpy(),
                               torch.arange(*args, dtype=torch.float32).numpy())


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize("shape", [(4,), (3, 5), (2, 3, 4)], ids=str)
def test_random_factories_draw_numpys_seeded_values(shape, dtype):
    td.manual_seed(1234)
    uniform = td.rand(*shape, dtype=dtype)
    normal = td.randn(shape, dtype=dtype)
    rng = np.random.default_rng(1234)
    np.testing.assert_array_equal(uniform.numpy(), rng.random(shape).astype(dtype))
    np.testing.assert_array_equal(normal.numpy(), rng.standard_normal(shape).astype(dtype))
    assert uniform.dtype.name == normal.dtype.name == dtype


def test_eye_against_torch():
    for n, m in ((3, None), (2, 4), (4, 2)):
        theirs = torch.eye(n, m) if m is not None else torch.eye(n)
        np.testing.assert_array_equal(td.eye(n, m).numpy(), theirs.numpy())


def test_factories_on_a_device_and_as_leaves_of_a_training_step():
    w = td.zeros(3, 2, device="CPU:1", requires_grad=True)
    assert w.device == "CPU:1" and w.requires_grad and w.is_leaf
    b = td.full((2,), 0.5, device="CPU:1", requires_grad=True)
    x = td.ones(4, 3, device="CPU:1")
    opt = td.optim.SGD([w, b], lr=0.1)
    ((x @ w + b) ** 2).sum().backward()
    opt.step()
    tw = torch.zeros(3, 2, requires_grad=True)
    tb = torch.full((2,), 0.5, requires_grad=True)
    topt = torch.optim.SGD([tw, tb], lr=0.1)
    ((torch.ones(4, 3) @ tw + tb) ** 2).sum().backward()
    topt.step()
    np.testing.assert_allclose(w.numpy(), tw.detach().numpy(), rtol=1e-6)
    np.testing.assert_allclose(b.numpy(), tb.detach().numpy(), rtol=1e-6)


def test_assign_into_a_factory_constant():
    """td.zeros(3) is a broadcast constant with no memory of its own; assign gives it some."""
    a, b = td.zeros(3), td.zeros(3)
    a.assign(td.ones(3) * 2)
    a.assign(a + 1)
    np.testing.assert_array_equal(a.numpy(), [3, 3, 3])
    np.testing.assert_array_equal(b.numpy(), [0, 0, 0])
    s = td.zeros(())
    s.assign(7)
    assert float(s) == 7.0
