"""Learning-rate schedulers with torch's names and semantics (`td.optim.lr_scheduler`).

    opt = td.optim.SGD(model.parameters(), lr=0.1)
    warmup = td.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=5)
    cosine = td.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=95)
    sched = td.optim.lr_scheduler.SequentialLR(opt, [warmup, cosine], milestones=[5])
    for epoch in range(100):
        train(...); opt.step()
        sched.step()                       # after the optimizer's step, as in torch
        print(sched.get_last_lr())

What torch does, step for step: a scheduler's constructor records each group's `initial_lr` and
makes its first step (epoch 0); `step()` advances `last_epoch` and writes the new rate into the
optimizer's `param_groups`; the rates follow torch's recursive ("chainable") formulas, so two
schedulers on one optimizer compose as they do there, and every rate equals torch's to the last
bit (tests/train/test_lr_scheduler.py compares the sequences); `state_dict()` holds everything but
the optimizer (a `LambdaLR`'s functions as None, a callable object's attributes as a dict).
Not here: torch's warning when `scheduler.step()` comes before `optimizer.step()` (it wraps the
optimizer's `step` method to find out), `ReduceLROnPlateau`, the cyclic schedules, and the
deprecated `step(epoch)`.

A rate is a Python float baked into the update's kernels (tinydist.train.optim): a schedule that
changes the rate every step compiles one update per distinct rate.
"""

from __future__ import annotations

import math
import types
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tinydist.train.optim import Optimizer

__all__ = ["CosineAnnealingLR", "ExponentialLR", "LRScheduler", "LambdaLR", "LinearLR", "MultiStepLR", "SequentialLR",
           "StepLR"]


class LRScheduler:
    """The base: subclasses give `get_lr()` (the next rates from the current ones, torch's form)
    and, for `SequentialLR`'s milestones, `_closed_form_lr()` (the rates at `last_epoch` from `base_lrs`)."""

    _is_initial = False

    def __init__(self, optimizer: Optimizer, last_epoch: int = -1) -> None:
        groups = getattr(optimizer, "param_groups", None)
        if not isinstance(groups, list):
            raise TypeError(f"{type(optimizer).__name__} is not an optimizer (it has no param_groups list): "
                            "pass a td.optim optimizer")
        self.optimizer = optimizer
        if last_epoch == -1:
            for group in groups:
                group.setdefault("initial_lr", group["lr"])
        else:
            for i, group in enumerate(groups):
                if "initial_lr" not in group:
                    raise KeyError(f"param_groups[{i}] has no 'initial_lr' to resume a scheduler at last_epoch="
                                   f"{last_epoch} from: load the optimizer's state_dict first, or start at -1")
        self.base_lrs: list[float] = [group["initial_lr"] for group in groups]
        self.last_epoch = last_epoch
        self._initial_step()

    def _initial_step(self) -> None:
        self._step_count = 0
        self._is_initial = True
        try:
            self.step()
        finally:
            self._is_initial = False

    def get_lr(self) -> list[float]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _closed_form_lr(self) -> list[float]:
        return self.get_lr()

    def get_last_lr(self) -> list[float]:
        """The rates the last `step()` set, one per parameter group."""
        return self._last_lr

    def step(self) -> None:
        """Advance one epoch (or iteration) and set the optimizer's rates; call after `optimizer.step()`."""
        self._step_count += 1
        self._update_lr()

    def _update_lr(self, epoch: int | None = None) -> None:
        if epoch is None:
            self.last_epoch += 1
            values = self.get_lr()
        else:
            self.last_epoch = epoch
            values = self._closed_form_lr()
        for group, lr in zip(self.optimizer.param_groups, values, strict=True):
            group["lr"] = lr
        self._last_lr: list[float] = [group["lr"] for group in self.optimizer.param_groups]

    def _current(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """Everything but the optimizer (torch's layout: `last_epoch`, `base_lrs`, `_last_lr`, ...)."""
        return {key: value for key, value in self.__dict__.items() if key != "optimizer"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.__dict__.update(state_dict)


class LambdaLR(LRScheduler):
    """lr = initial lr × `lr_lambda(epoch)` (one function, or one per parameter group)."""

    def __init__(self, optimizer: Optimizer, lr_lambda: Callable[[int], float] | Sequence[Callable[[int], float]],
                 last_epoch: int = -1) -> None:
        self.optimizer = optimizer
        count = len(optimizer.param_groups)
        if isinstance(lr_lambda, (list, tuple)):
            if len(lr_lambda) != count:
                raise ValueError(f"LambdaLR got {len(lr_lambda)} lr_lambdas for {count} parameter groups: give one "
                                 "function, or one per group")
            self.lr_lambdas = list(lr_lambda)
        else:
            self.lr_lambdas = [lr_lambda] * count
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        return [base * fn(self.last_epoch) for fn, base in zip(self.lr_lambdas, self.base_lrs, strict=True)]

    def state_dict(self) -> dict[str, Any]:
        """As torch: a plain function or lambda is saved as None (it cannot be), a callable object as its attributes."""
        state = {key: value for key, value in self.__dict__.items() if key not in ("optimizer", "lr_lambdas")}
        state["lr_lambdas"] = [None if isinstance(fn, types.FunctionType) or not hasattr(fn, "__dict__")
                               else dict(fn.__dict__) for fn in self.lr_lambdas]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        saved = state.pop("lr_lambdas")
        self.__dict__.update(state)
        for fn, attributes in zip(self.lr_lambdas, saved):
            if attributes is not None:
                fn.__dict__.update(attributes)


class StepLR(LRScheduler):
    """lr × gamma every `step_size` epochs."""

    def __init__(self, optimizer: Optimizer, step_size: int, gamma: float = 0.1, last_epoch: int = -1) -> None:
        if not isinstance(step_size, int) or step_size < 1:
            raise ValueError(f"StepLR step_size must be a positive int, got {step_size!r}")
        self.step_size = step_size
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        if self.last_epoch == 0 or self.last_epoch % self.step_size != 0:
            return self._current()
        return [lr * self.gamma for lr in self._current()]

    def _closed_form_lr(self) -> list[float]:
        return [base * self.gamma ** (self.last_epoch // self.step_size) for base in self.base_lrs]


class MultiStepLR(LRScheduler):
    """lr × gamma at each milestone epoch (a milestone given twice multiplies twice)."""

    def __init__(self, optimizer: Optimizer, milestones: Iterable[int], gamma: float = 0.1, last_epoch: int = -1) -> None:
        self.milestones = Counter(milestones)
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        if self.last_epoch not in self.milestones:
            return self._current()
        return [lr * self.gamma ** self.milestones[self.last_epoch] for lr in self._current()]

    def _closed_form_lr(self) -> list[float]:
        milestones = sorted(self.milestones.elements())
        return [base * self.gamma ** bisect_right(milestones, self.last_epoch) for base in self.base_lrs]


class ExponentialLR(LRScheduler):
    """lr × gamma every epoch."""

    def __init__(self, optimizer: Optimizer, gamma: float, last_epoch: int = -1) -> None:
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        if self._is_initial:
            return self._current()
        return [lr * self.gamma for lr in self._current()]

    def _closed_form_lr(self) -> list[float]:
        return [base * self.gamma ** self.last_epoch for base in self.base_lrs]


class LinearLR(LRScheduler):
    """A linear ramp of the factor from `start_factor` to `end_factor` over `total_iters` epochs,
    then constant: the usual warmup (`LinearLR(opt, start_factor=0.01, total_iters=warmup)`)."""

    def __init__(self, optimizer: Optimizer, start_factor: float = 1.0 / 3, end_factor: float = 1.0,
                 total_iters: int = 5, last_epoch: int = -1) -> None:
        if not 0 < start_factor <= 1:
            raise ValueError(f"LinearLR start_factor must be in (0, 1], got {start_factor}")
        if not 0 <= end_factor <= 1:
            raise ValueError(f"LinearLR end_factor must be in [0, 1], got {end_factor}")
        self.start_factor = start_factor
        self.end_factor = end_factor
        self.total_iters = total_iters
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        if self.last_epoch == 0:
            return [lr * self.start_factor for lr in self._current()]
        if self._is_initial or self.last_epoch > self.total_iters:
            return self._current()
        delta = self.end_factor - self.start_factor
        return [lr * (1.0 + delta / (self.total_iters * self.start_factor + (self.last_epoch - 1) * delta))
                for lr in self._current()]

    def _closed_form_lr(self) -> list[float]:
        factor = self.start_factor + (self.end_factor - self.start_factor) * min(self.total_iters, self.last_epoch) / self.total_iters
        return [base * factor for base in self.base_lrs]


class CosineAnnealingLR(LRScheduler):
    """eta_min + (initial lr − eta_min)(1 + cos(π·epoch/T_max))/2, by torch's recursive form (which
    keeps composing with other schedulers); past T_max it rises again, as torch's does."""

    def __init__(self, optimizer: Optimizer, T_max: int, eta_min: float = 0.0, last_epoch: int = -1) -> None:
        self.T_max = T_max
        self.eta_min = eta_min
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        if self._is_initial:
            return self._current()
        if self._step_count == 1 and self.last_epoch > 0:
            return [self.eta_min + (base - self.eta_min) * (1 + math.cos(self.last_epoch * math.pi / self.T_max)) / 2
                    for base in self.base_lrs]
        if (self.last_epoch - 1 - self.T_max) % (2 * self.T_max) == 0:
            return [lr + (base - self.eta_min) * (1 - math.cos(math.pi / self.T_max)) / 2
                    for base, lr in zip(self.base_lrs, self._current(), strict=True)]
        return [(1 + math.cos(math.pi * self.last_epoch / self.T_max))
                / (1 + math.cos(math.pi * (self.last_epoch - 1) / self.T_max)) * (lr - self.eta_min) + self.eta_min
                for lr in self._current()]

    def _closed_form_lr(self) -> list[float]:
        return [self.eta_min + (base - self.eta_min) * (1 + math.cos(math.pi * self.last_epoch / self.T_max)) / 2
                for base in self.base_lrs]


class SequentialLR(LRScheduler):
    """Schedulers one after another: `schedulers[i]` runs from `milestones[i - 1]` (warmup, then cosine)."""

    def __init__(self, optimizer: Optimizer, schedulers: Sequence[LRScheduler], milestones: Sequence[int],
                 last_epoch: int = -1) -> None:
        if not schedulers:
            raise ValueError("SequentialLR needs at least one scheduler")
        for i, scheduler in enumerate(schedulers):
            if scheduler.optimizer is not optimizer:
                raise ValueError(f"SequentialLR's scheduler {i} ({type(scheduler).__name__}) drives another optimizer: "
                                 "all must belong to the one given")
        if len(milestones) != len(schedulers) - 1:
            raise ValueError(f"SequentialLR needs one milestone fewer than schedulers: got {len(schedulers)} "
                             f"schedulers and {len(milestones)} milestones")
        self._schedulers = list(schedulers)
        self._milestones = list(milestones)
        self.last_epoch = last_epoch + 1
        self.optimizer = optimizer
        for group in optimizer.param_groups:   # undo the steps the schedulers' constructors made
            group["lr"] = group["initial_lr"]
        for scheduler in self._schedulers:
            _undo(scheduler)
        first = self._schedulers[bisect_right(self._milestones, 0)]
        first._initial_step()
        self._last_lr = first.get_last_lr()

    def step(self) -> None:
        self.last_epoch += 1
        i = bisect_right(self._milestones, self.last_epoch)
        scheduler = self._schedulers[i]
        if i > 0 and self._milestones[i - 1] == self.last_epoch:
            scheduler._update_lr(0)   # the next phase starts from its own epoch 0
        else:
            scheduler.step()
        self._last_lr = scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        state = {key: value for key, value in self.__dict__.items() if key not in ("optimizer", "_schedulers")}
        state["_schedulers"] = [scheduler.state_dict() for scheduler in self._schedulers]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        saved = state.pop("_schedulers")
        self.__dict__.update(state)
        for scheduler, inner in zip(self._schedulers, saved):
            scheduler.load_state_dict(inner)


def _undo(scheduler: LRScheduler) -> None:
    """Take back the first step a scheduler's constructor made (nested SequentialLRs included)."""
    if isinstance(scheduler, SequentialLR):
        for inner in scheduler._schedulers:
            _undo(inner)
    else:
        scheduler.last_epoch -= 1
