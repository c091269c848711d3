"""td.optim.lr_scheduler against torch.optim.lr_scheduler: the same rates, step for step, bit for
bit; state_dict() resumes where it left off, as torch's does."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

import tinydist as td

torch = pytest.importorskip("torch")
sched = td.optim.lr_scheduler
tsched = torch.optim.lr_scheduler

STEPS = 40


def optimizers(kind: str = "SGD", lr: float = 0.1):
    mine = getattr(td.optim, kind)([td.Tensor(np.zeros(3, np.float32), requires_grad=True)], lr=lr)
    theirs = getattr(torch.optim, kind)([torch.zeros(3, requires_grad=True)], lr=lr)
    return mine, theirs


class Halving:
    """A callable object: its attributes go into LambdaLR's state_dict (a lambda's do not)."""

    def __init__(self, every: int) -> None:
        self.every = every

    def __call__(self, epoch: int) -> float:
        return 0.5 ** (epoch // self.every)


CASES = {
    "StepLR": lambda m, o: m.StepLR(o, step_size=7, gamma=0.3),
    "StepLR-1": lambda m, o: m.StepLR(o, step_size=1),
    "MultiStepLR": lambda m, o: m.MultiStepLR(o, milestones=[3, 10, 10, 25], gamma=0.5),
    "ExponentialLR": lambda m, o: m.ExponentialLR(o, gamma=0.93),
    "LambdaLR": lambda m, o: m.LambdaLR(o, lambda e: 1 / (1 + e) ** 0.5),
    "LambdaLR-object": lambda m, o: m.LambdaLR(o, Halving(6)),
    "LinearLR": lambda m, o: m.LinearLR(o, start_factor=0.05, total_iters=10),
    "LinearLR-decay": lambda m, o: m.LinearLR(o, start_factor=1.0, end_factor=0.1, total_iters=30),
    "LinearLR-default": lambda m, o: m.LinearLR(o),
    "CosineAnnealingLR": lambda m, o: m.CosineAnnealingLR(o, T_max=25),
    "CosineAnnealingLR-eta": lambda m, o: m.CosineAnnealingLR(o, T_max=12, eta_min=1e-3),   # past T_max: rises again
    "warmup-then-cosine": lambda m, o: m.SequentialLR(o, [m.LinearLR(o, start_factor=0.01, total_iters=5),
                                                           m.CosineAnnealingLR(o, T_max=30)], milestones=[5]),
    "three-phases": lambda m, o: m.SequentialLR(o, [m.LinearLR(o, start_factor=0.5, total_iters=4),
                                                     m.ExponentialLR(o, gamma=0.9), m.StepLR(o, step_size=3)],
                                                milestones=[4, 15]),
}


def sequences(name: str, kind: str = "SGD"):
    mine_opt, their_opt = optimizers(kind)
    mine, theirs = CASES[name](sched, mine_opt), CASES[name](tsched, their_opt)
    got, expected = [mine.get_last_lr()], [theirs.get_last_lr()]
    for _ in range(STEPS):
        their_opt.step()
        theirs.step()
        mine.step()
        got.append(mine.get_last_lr())
        expected.append(theirs.get_last_lr())
    return mine_opt, their_opt, got, expected


@pytest.mark.parametrize("name", CASES)
def test_rates_are_torchs_step_for_step(name):
    mine_opt, their_opt, got, expected = sequences(name)
    assert got == expected   # the same formulas in the same order: equal floats, not close ones
    assert mine_opt.param_groups[0]["lr"] == their_opt.param_groups[0]["lr"] == got[-1][0]
    assert mine_opt.param_groups[0]["initial_lr"] == their_opt.param_groups[0]["initial_lr"] == 0.1
    assert len(set(map(tuple, got))) > 1   # the schedule moved


def test_two_schedulers_on_one_optimizer_compose_as_torchs():
    """torch's chainable form: each scheduler scales the rate the other left."""
    mine_opt, their_opt = optimizers()
    mine = [sched.StepLR(mine_opt, step_size=5, gamma=0.5), sched.CosineAnnealingLR(mine_opt, T_max=20)]
    theirs = [tsched.StepLR(their_opt, step_size=5, gamma=0.5), tsched.CosineAnnealingLR(their_opt, T_max=20)]
    for _ in range(STEPS):
        their_opt.step()
        for a, b in zip(mine, theirs):
            a.step()
            b.step()
        assert mine_opt.param_groups[0]["lr"] == their_opt.param_groups[0]["lr"]
        assert [s.get_last_lr() for s in mine] == [s.get_last_lr() for s in theirs]


def test_cosine_follows_the_closed_form():
    """The recursive form torch uses and the textbook formula agree (what the schedule means)."""
    _, _, got, _ = sequences("CosineAnnealingLR")
    for epoch, (lr,) in enumerate(got[:26]):
        assert lr == pytest.approx(0.1 * (1 + math.cos(math.pi * epoch / 25)) / 2, abs=1e-15)


@pytest.mark.parametrize("name", ["StepLR", "LambdaLR-object", "CosineAnnealingLR", "warmup-then-cosine", "LinearLR"])
def test_state_dict_resumes_as_torchs(name):
    mine_opt, their_opt = optimizers()
    mine, theirs = CASES[name](sched, mine_opt), CASES[name](tsched, their_opt)
    for _ in range(13):
        their_opt.step()
        theirs.step()
        mine.step()
    saved, their_saved = copy.deepcopy(mine.state_dict()), copy.deepcopy(theirs.state_dict())
    mine_keys = {k for k in saved if not k.startswith("_") or k in ("_last_lr", "_step_count", "_schedulers")}
    assert mine_keys <= set(their_saved), mine_keys - set(their_saved)
    for key in ("last_epoch", "base_lrs", "_last_lr", "_step_count"):
        if key in their_saved:
            assert saved[key] == their_saved[key], key
    # a new optimizer and scheduler, loaded: the rest of the schedule is the same as torch's
    mine_opt2, their_opt2 = optimizers()
    mine_opt2.load_state_dict(mine_opt.state_dict())
    their_opt2.load_state_dict(their_opt.state_dict())
    mine2, theirs2 = CASES[name](sched, mine_opt2), CASES[name](tsched, their_opt2)
    mine2.load_state_dict(saved)
    theirs2.load_state_dict(their_saved)
    for _ in range(20):
        their_opt2.step()
        theirs2.step()
        mine2.step()
        assert mine2.get_last_lr() == theirs2.get_last_lr()


def test_lambda_state_dict_holds_an_objects_attributes_not_a_lambdas():
    mine_opt, _ = optimizers()
    assert sched.LambdaLR(mine_opt, lambda e: 1.0).state_dict()["lr_lambdas"] == [None]
    mine_opt, _ = optimizers()
    state = sched.LambdaLR(mine_opt, Halving(4)).state_dict()
    assert state["lr_lambdas"] == [{"every": 4}]
    other_opt, _ = optimizers()
    restored = sched.LambdaLR(other_opt, Halving(99))
    restored.load_state_dict(state)
    assert restored.lr_lambdas[0].every == 4


def test_the_rate_reaches_the_update():
    """A schedule's rate is what the optimizer steps with: SGD with StepLR equals torch's, parameter for parameter."""
    x = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
    w = td.Tensor(np.ones((3, 1), np.float32), requires_grad=True)
    tw = torch.ones(3, 1, requires_grad=True)
    opt, topt = td.optim.SGD([w], lr=0.2), torch.optim.SGD([tw], lr=0.2)
    s, ts = sched.StepLR(opt, step_size=2, gamma=0.5), tsched.StepLR(topt, step_size=2, gamma=0.5)
    for _ in range(5):
        ((td.Tensor(x) @ w) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        ((torch.from_numpy(x) @ tw) ** 2).mean().backward()
        topt.step()
        topt.zero_grad()
        s.step()
        ts.step()
    np.testing.assert_allclose(w.numpy(), tw.detach().numpy(), rtol=1e-5)
    assert opt.lr == topt.param_groups[0]["lr"]


def test_errors_say_what_was_wrong():
    mine_opt, _ = optimizers()
    with pytest.raises(TypeError, match="is not an optimizer"):
        sched.StepLR(object(), step_size=3)
    with pytest.raises(ValueError, match="step_size must be a positive int, got 0"):
        sched.StepLR(mine_opt, step_size=0)
    with pytest.raises(ValueError, match="start_factor must be in"):
        sched.LinearLR(mine_opt, start_factor=0)
    with pytest.raises(KeyError, match="initial_lr"):
        sched.StepLR(optimizers()[0], step_size=3, last_epoch=4)
    with pytest.raises(ValueError, match="one milestone fewer than schedulers"):
        sched.SequentialLR(mine_opt, [sched.StepLR(mine_opt, 2), sched.StepLR(mine_opt, 3)], milestones=[])
    with pytest.raises(ValueError, match="drives another optimizer"):
        sched.SequentialLR(mine_opt, [sched.StepLR(optimizers()[0], 2)], milestones=[])
