"""The optimizer's kept update (`tinydist.train.optim._UpdateReplay`): from the third step on, an update
step runs the schedule the second step built, over the current buffers. Checked against
torch.optim on the same model and data, against the same optimizer made to build its graph every
step (bit for bit), and in the cases where a replay must not run: a lazy reader of the old
parameters still alive, an assign of the caller's not yet computed, hyper-parameters or state
changed between steps."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import tinydist as td
from tests.train.helpers import data, make_mlp, train, weights
from tinydist import optim

F = td.nn.functional


@pytest.fixture
def replays(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Every replay attempt's outcome (True: the kept schedule ran)."""
    seen: list[bool] = []
    original = optim.Optimizer._replay

    def counting(self: optim.Optimizer, replay: optim._UpdateReplay) -> bool:
        seen.append(original(self, replay))
        return seen[-1]

    monkeypatch.setattr(optim.Optimizer, "_replay", counting)
    return seen


TORCH_OPTIMIZERS: dict[str, tuple[Callable[..., optim.Optimizer], str, dict[str, object]]] = {
    "adam": (td.optim.Adam, "Adam", {"lr": 1e-2}),
    "adam_l2": (td.optim.Adam, "Adam", {"lr": 1e-2, "betas": (0.8, 0.99), "weight_decay": 0.1}),
    "sgd_nesterov": (td.optim.SGD, "SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}),
    "sgd_dampened": (td.optim.SGD, "SGD", {"lr": 0.05, "momentum": 0.5, "dampening": 0.25}),
}


@pytest.mark.parametrize("name", sorted(TORCH_OPTIMIZERS))
def test_replayed_steps_match_torch(name: str, replays: list[bool]) -> None:
    torch = pytest.importorskip("torch")
    mine_cls, torch_name, kwargs = TORCH_OPTIMIZERS[name]
    model = make_mlp(seed=1)
    theirs = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
    theirs.load_state_dict({k: torch.tensor(v) for k, v in weights(model).items()})
    opt = mine_cls(model.parameters(), **kwargs)
    topt = getattr(torch.optim, torch_name)(theirs.parameters(), **kwargs)
    x, y = data(seed=2)
    for step in range(8):
        xb, yb = x[step * 16:(step + 1) * 16], y[step * 16:(step + 1) * 16]
        loss = F.cross_entropy(model(td.Tensor(xb)), td.Tensor(yb))
        opt.zero_grad()
        loss.backward()
        opt.step()
        tloss = torch.nn.functional.cross_entropy(theirs(torch.from_numpy(xb)), torch.from_numpy(yb))
        topt.zero_grad()
        tloss.backward()
        topt.step()
        np.testing.assert_allclose(loss.item(), tloss.item(), rtol=1e-5, err_msg=f"step {step}")
    for key, value in weights(model).items():
        np.testing.assert_allclose(value, theirs.state_dict()[key].numpy(), rtol=1e-4, atol=1e-6, err_msg=key)
    assert replays and all(replays), "steps 3..8 replay the kept update"


@pytest.mark.parametrize("make_opt", [lambda p: td.optim.Adam(p, lr=1e-2),
                                      lambda p: td.optim.SGD(p, lr=0.05, momentum=0.9)], ids=["adam", "sgd"])
def test_replay_is_bitwise_the_built_graph(make_opt: Callable[..., optim.Optimizer], replays: list[bool],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    replayed = make_mlp(seed=4)
    train(replayed, make_opt(replayed.parameters()), data(), steps=6)
    assert replays and all(replays)
    monkeypatch.setattr(optim.Optimizer, "_replay", lambda self, replay: False)  # build the graph every step
    built = make_mlp(seed=4)
    train(built, make_opt(built.parameters()), data(), steps=6)
    for key, value in weights(replayed).items():
        np.testing.assert_array_equal(value, weights(built)[key], err_msg=key)


def _step(model: td.nn.Module, opt: optim.Optimizer, x: np.ndarray, y: np.ndarray) -> None:
    loss = F.cross_entropy(model(td.Tensor(x)), td.Tensor(y))
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_lazy_reader_of_old_parameters_sees_old_values(replays: list[bool]) -> None:
    model = make_mlp(seed=5)
    opt = td.optim.Adam(model.parameters(), lr=0.1)
    x, y = data()
    for _ in range(3):
        _step(model, opt, x[:32], y[:32])
    weight = model[0].weight
    old = weight.numpy()
    doubled = weight * 2  # lazy: reads the weight as it is now
    _step(model, opt, x[32:64], y[32:64])
    assert replays[-1] is False, "a live reader of the weight makes the step build its graph"
    np.testing.assert_array_equal(doubled.numpy(), old * 2)
    assert not np.array_equal(weight.numpy(), old)
    _step(model, opt, x[64:96], y[64:96])
    assert replays[-1] is True


def test_pending_assign_before_step_is_applied_first(replays: list[bool]) -> None:
    results = []
    for assign in (False, True):
        model = make_mlp(seed=6)
        opt = td.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x, y = data()
        for _ in range(3):
            _step(model, opt, x[:32], y[:32])
        bias = model[2].bias
        expected_start = bias.numpy() * 0.5
        loss = F.cross_entropy(model(td.Tensor(x[32:64])), td.Tensor(y[32:64]))
        opt.zero_grad()
        loss.backward()
        if assign:
            bias.assign(bias * 0.5)  # lazy, after the backward read the old bias
        opt.step()
        results.append((bias.numpy(), expected_start, opt.state[3]["momentum_buffer"].numpy()))
    (plain, _, buf_plain), (halved, start, buf_halved) = results
    np.testing.assert_allclose(buf_plain, buf_halved, rtol=1e-6)  # the same gradient either way
    np.testing.assert_allclose(halved, start - np.float32(0.1) * buf_halved, rtol=1e-6, atol=1e-7)
    assert not np.allclose(plain, halved)


def test_changed_learning_rate_and_loaded_state_are_used(replays: list[bool]) -> None:
    torch = pytest.importorskip("torch")
    model = make_mlp(seed=7)
    theirs = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
    theirs.load_state_dict({k: torch.tensor(v) for k, v in weights(model).items()})
    opt = td.optim.Adam(model.parameters(), lr=1e-2)
    topt = torch.optim.Adam(theirs.parameters(), lr=1e-2)
    x, y = data(seed=8)
    for step in range(9):
        if step == 4:
            opt.lr = topt.param_groups[0]["lr"] = 3e-3
        if step == 6:  # a round trip through a checkpoint: new state tensors, same values
            opt.load_state_dict(opt.state_dict())
        xb, yb = x[step * 8:(step + 1) * 8], y[step * 8:(step + 1) * 8]
        _step(model, opt, xb, yb)
        tloss = torch.nn.functional.cross_entropy(theirs(torch.from_numpy(xb)), torch.from_numpy(yb))
        topt.zero_grad()
        tloss.backward()
        topt.step()
    for key, value in weights(model).items():
        np.testing.assert_allclose(value, theirs.state_dict()[key].numpy(), rtol=1e-4, atol=1e-6, err_msg=key)
    assert replays.count(True) >= 4  # steps 3-4, 6 (after the new lr's first step), 7-9 on the loaded state
