"""Every differentiable op of the tensor API against central finite differences in float64."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import tinydist as td

F = td.nn.functional
rng = np.random.default_rng(1234)


def _value(fn: Callable[..., td.Tensor], arrays: list[np.ndarray], weight: np.ndarray | None) -> float:
    with td.no_grad():
        out = fn(*[td.Tensor(a) for a in arrays])
        out = out.cast(td.float64)
        if weight is not None:
            out = out * td.Tensor(weight)
        return float(out.sum().item())


def gradcheck(fn: Callable[..., td.Tensor], *arrays: np.ndarray, eps: float = 1e-6, rtol: float = 1e-5,
              atol: float = 1e-6) -> None:
    arrays = [np.asarray(a, np.float64) for a in arrays]
    tensors = [td.Tensor(a, requires_grad=True) for a in arrays]
    out = fn(*tensors).cast(td.float64)
    weight = rng.standard_normal(out.shape) if out.shape else None   # checks every output element
    loss = (out * td.Tensor(weight)).sum() if weight is not None else out.sum()
    loss.backward()
    for i, a in enumerate(arrays):
        numeric = np.zeros_like(a)
        for idx in np.ndindex(a.shape):
            plus, minus = [x.copy() for x in arrays], [x.copy() for x in arrays]
            plus[i][idx] += eps
            minus[i][idx] -= eps
            numeric[idx] = (_value(fn, plus, weight) - _value(fn, minus, weight)) / (2 * eps)
        assert tensors[i].grad is not None, f"input {i} got no gradient"
        np.testing.assert_allclose(tensors[i].grad.numpy(), numeric, rtol=rtol, atol=atol, err_msg=f"input {i}")


def r(*shape: int, low: float | None = None) -> np.ndarray:
    x = rng.standard_normal(shape)
    return np.abs(x) + low if low is not None else x


C142 = rng.standard_normal((1, 4, 2))
UNARY = {
    "neg": lambda x: -x, "abs": lambda x: x.abs(), "sqrt": lambda x: (x.abs() + 0.5).sqrt(), "exp": lambda x: x.exp(),
    "exp2": lambda x: x.exp2(), "log": lambda x: (x.abs() + 0.5).log(), "log2": lambda x: (x.abs() + 0.5).log2(),
    "sin": lambda x: x.sin(), "cos": lambda x: x.cos(), "relu": lambda x: x.relu(), "sigmoid": lambda x: x.sigmoid(),
    "tanh": lambda x: x.tanh(), "gelu": F.gelu, "square": lambda x: x.square(),
    "reciprocal": lambda x: (x.abs() + 0.5).reciprocal(), "clip": lambda x: x.clip(-0.5, 0.5),
    "pow_scalar": lambda x: x ** 3,
    "pow_float": lambda x: (x.abs() + 0.5) ** 1.7, "rpow": lambda x: 2.0 ** x, "contiguous": lambda x: x.T.contiguous(),
    "mean": lambda x: x.mean(axis=1), "var": lambda x: x.var(axis=0), "sum_all": lambda x: x.sum(),
    "max_axis": lambda x: x.max(axis=1), "min_axis": lambda x: x.min(axis=0), "max_all": lambda x: x.max(),
    "prod": lambda x: x.prod(axis=1), "softmax": lambda x: x.softmax(1), "log_softmax": lambda x: x.log_softmax(0),
    "layernorm": lambda x: x.layernorm(), "floor_is_flat": lambda x: x.floor() + x,
    "where_cmp": lambda x: (x > 0.1).where(x * 2, x * x), "isnan_mask": lambda x: x.isnan().where(0.0, x),
    # movement
    "reshape": lambda x: x.reshape(4, 3) * td.Tensor(np.arange(12.0).reshape(4, 3)),
    "permute": lambda x: x.reshape(2, 3, 2).permute(2, 0, 1), "transpose": lambda x: x.T,
    "expand": lambda x: x[:, :1].expand(3, 5), "broadcast": lambda x: x.reshape(3, 4, 1) * td.Tensor(C142),
    "shrink": lambda x: x.shrink(((1, 3), (0, 2))), "pad": lambda x: x.pad(((1, 2), (0, 3))),
    "pad_value": lambda x: x.pad(((1, 0), (2, 1)), value=3.0), "getitem_step": lambda x: x[::2, 1::2],
    "getitem_int": lambda x: x[1], "flatten": lambda x: x.reshape(3, 2, 2).flatten(1), "squeeze": lambda x: x[:1].squeeze(0),
    "unsqueeze": lambda x: x.unsqueeze(1), "cat": lambda x: td.cat([x, x * 2], axis=1), "stack": lambda x: td.stack([x, x.exp()]),
    "transposed_reshape": lambda x: x.T.reshape(2, 6), "pad_then_reshape": lambda x: x.pad(((0, 1), (1, 0))).reshape(-1)[3:17],
    "copy_to_device": lambda x: (x.to("CPU:1") * 2).to("CPU:0"),
}


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_and_movement(name: str) -> None:
    gradcheck(UNARY[name], r(3, 4))


def test_cast() -> None:  # through float32: a wide step keeps rounding out of the difference quotient
    gradcheck(lambda x: (x.cast(td.float32) * 2).cast(td.float64) ** 2, r(3, 4), eps=1e-2, rtol=1e-3, atol=1e-3)


BINARY = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b, "div": lambda a, b: a / (b.abs() + 0.5),
    "pow": lambda a, b: (a.abs() + 0.5) ** b, "maximum": lambda a, b: a.maximum(b), "minimum": lambda a, b: a.minimum(b),
    "mod": lambda a, b: a % (b.abs() + 1.5), "where": lambda a, b: td.where(a > b, a, b * 3),
    "broadcast_add": lambda a, b: a + b[:1], "rsub_scalar": lambda a, b: 1 - a * b,
}


@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary(name: str) -> None:
    gradcheck(BINARY[name], r(3, 4), r(3, 4))


@pytest.mark.parametrize("shapes", [((3, 4), (4, 2)), ((2, 3, 4), (2, 4, 2)), ((2, 3, 4), (4, 2)), ((3, 4), (2, 4, 2)),
                                    ((4,), (4, 2)), ((3, 4), (4,))])
def test_matmul(shapes: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    gradcheck(lambda a, b: a @ b, r(*shapes[0]), r(*shapes[1]))


# stride 1 without groups or dilation: the input gradient is a convolution of the output gradient
# (padding below the kernel size) or col2im (padding (3, 0): the 3-row kernel's margin would be negative)
@pytest.mark.parametrize("kwargs", [dict(), dict(padding=1), dict(padding=(2, 1)), dict(padding=(3, 0)),
                                    dict(stride=2, padding=1), dict(dilation=2),
                                    dict(groups=2, padding=1), dict(stride=(2, 1), padding=(0, 2), dilation=(1, 2)),
                                    dict(groups=2, stride=2, dilation=2, padding=2)])
def test_conv2d(kwargs: dict) -> None:
    groups = kwargs.get("groups", 1)
    gradcheck(lambda x, w, b: x.conv2d(w, b, **kwargs), r(2, 2, 5, 6), r(3 if groups == 1 else 2, 2 // groups, 3, 2), r(3 if groups == 1 else 2))


def test_conv2d_without_bias_and_through_later_views() -> None:
    # the convolution's own rule sits under a reshape and a relu; one operand needs no gradient
    gradcheck(lambda w: td.Tensor(C_IMAGE).conv2d(w, padding=1).relu().reshape(2, -1)[:, 3:40], r(4, 3, 3, 3))
    gradcheck(lambda x: x.conv2d(td.Tensor(C_WEIGHT), stride=2).max_pool2d(2).flatten(1), r(2, 3, 9, 9))


C_IMAGE, C_WEIGHT = rng.standard_normal((2, 3, 4, 5)), rng.standard_normal((4, 3, 2, 2))


def test_pooling() -> None:
    x = np.arange(2 * 2 * 6 * 6, dtype=np.float64).reshape(2, 2, 6, 6)   # distinct values: no max ties
    gradcheck(lambda x: x.max_pool2d(2), rng.permutation(x.reshape(-1)).reshape(x.shape) * 0.1)
    gradcheck(lambda x: x.max_pool2d(3, stride=2, padding=1), r(1, 2, 5, 5))
    gradcheck(lambda x: x.max_pool2d((2, 3)), r(2, 2, 5, 7))       # tiles, with rows and columns left over
    ties = np.array([[1.0, 1.0, 0.5, 2.0], [0.0, 1.0, 2.0, -1.0]]).reshape(1, 1, 2, 4)
    w = td.Tensor(ties, requires_grad=True)
    (w.max_pool2d(2) * td.Tensor(np.array([3.0, 4.0]).reshape(1, 1, 1, 2))).sum().backward()
    np.testing.assert_allclose(w.grad.numpy().reshape(2, 4), [[1, 1, 0, 2], [0, 1, 2, 0]])  # ties split evenly
    gradcheck(lambda x: x.avg_pool2d(3, stride=1, padding=1), r(1, 2, 4, 4))


def test_losses() -> None:
    labels = np.array([0, 2, 1, 2])
    gradcheck(lambda x: F.cross_entropy(x, td.Tensor(labels)), r(4, 3))
    gradcheck(lambda x: F.nll_loss(x.log_softmax(1), labels, reduction="sum"), r(4, 3))
    gradcheck(lambda x, y: F.mse_loss(x, y), r(4, 3), r(4, 3))


def test_layers_gradients() -> None:
    td.manual_seed(0)
    for layer, x in [(td.nn.LayerNorm(4), r(3, 4)), (td.nn.BatchNorm2d(2), r(3, 2, 2, 2)), (td.nn.Embedding(5, 3), None)]:
        if x is None:
            gradcheck(lambda w: (td.Tensor(np.array([[1, 4], [0, 1]])).reshape(-1, 1) == td.Tensor(np.arange(5))).cast(td.float64) @ w, r(5, 3))
            continue
        gradcheck(lambda x: layer(x), x)


def test_gradients_accumulate_and_flow_to_shared_inputs() -> None:
    w = td.Tensor(np.array([1.0, 2.0]), requires_grad=True)
    (w * w).sum().backward()
    (w * 3).sum().backward()
    np.testing.assert_allclose(w.grad.numpy(), [2 + 3, 4 + 3])


def test_custom_gradient_rule_is_used_once_and_freed() -> None:
    calls = []
    x = td.Tensor(np.array([1.0, 2.0]), requires_grad=True)
    with td.no_grad():
        value = x * x

    def rule(g: td.Tensor, saved: td.Tensor) -> list[td.Tensor]:
        calls.append(1)
        return [g * 2 * saved]
    y = td.autograd.custom_gradient(value, [x], [x], rule)
    assert y.requires_grad
    loss = (y * 3).sum()
    loss.backward()
    np.testing.assert_allclose(x.grad.numpy(), [6.0, 12.0])
    assert calls == [1]
    with pytest.raises(RuntimeError, match="already freed"):
        loss.backward()
    with pytest.raises(ValueError, match="no_grad"):
        td.autograd.custom_gradient(x * x, [x], [], rule)
    with td.no_grad():
        assert td.autograd.custom_gradient(value, [x], [], rule) is value


def test_no_grad_errors_and_freed_graph() -> None:
    w = td.Tensor(np.ones(3), requires_grad=True)
    with td.no_grad():
        y = (w * 2).sum()
    assert not y.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        y.backward()
    loss = (w * w).sum()
    loss.realize()                         # computing the forward first keeps the graph walkable
    loss.backward()
    np.testing.assert_allclose(w.grad.numpy(), [2, 2, 2])
    with pytest.raises(RuntimeError, match="already freed"):
        loss.backward()
    with pytest.raises(RuntimeError, match="leaf"):
        (w * 2).requires_grad_()
    assert w.detach().requires_grad is False and w.is_leaf
