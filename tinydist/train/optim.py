"""Optimizers: SGD (momentum, dampening, Nesterov, weight decay), Adam, AdamW.

    opt = td.optim.Adam(model.parameters(), lr=1e-3)
    opt.zero_grad(); loss.backward(); opt.step()

`step()` realizes the losses `backward()` was called on since the last step together with the
gradients (one schedule: the forward runs once), then builds every update as lazy graph (assigns
into the parameters and the state tensors) and realizes it. The update's graph is the same every
step: its schedule is kept, with the role of each input and target (a parameter, its gradient, a
state tensor), and later steps run it over the current buffers without building or walking any
graph (`_UpdateReplay`: the digits MLP's Adam update is 164 nodes, about half of an eager step's
host time). Inside a td.jit capture nothing is realized: the JIT captures the assigns as the
step's side effects. All state (including Adam's step count) is tensors, so a captured step
replays correctly and `state_dict()` / `load_state_dict()` resume bit for bit.

Hyper-parameters are Python floats baked into the graph: changing `lr` between steps works but
compiles new kernels (and a td.jit capture keeps the captured value).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any, NamedTuple

import numpy as np

import tinydist.frontend.tensor as _tensor_module
from tinydist.base.logs import get_logger
from tinydist.engine.realize import Realized, realize, run_schedule
from tinydist.frontend import autograd
from tinydist.frontend.autograd import no_grad
from tinydist.frontend.tensor import Tensor
from tinydist.graph.lazy import buffer_node
from tinydist.schedule import Schedule
from tinydist.train import lr_scheduler

log = get_logger(layer="optim")

# A tensor an update reads or writes: (parameter index, "param" | "grad" | a state name)
Role = tuple[int, str]


class _UpdateReplay(NamedTuple):
    """An update step's schedule and what each of its inputs and targets is."""
    schedule: Schedule
    inputs: tuple[Role, ...]
    targets: tuple[Role, ...]

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "lr_scheduler"]


class Optimizer:
    _state_names: tuple[str, ...] = ()

    def __init__(self, params: Iterable[Tensor], **defaults: Any) -> None:
        self.params: list[Tensor] = list(dict.fromkeys(params))
        if not self.params:
            raise ValueError("optimizer got an empty parameter list")
        for p in self.params:
            if not p.requires_grad:
                raise ValueError(f"optimizer parameters must require grad: {p!r}")
        self.defaults = dict(defaults)
        self._groups = [self.defaults]
        self.state: list[dict[str, Tensor]] = [{} for _ in self.params]
        self._replays: dict[Hashable, _UpdateReplay] = {}

    def __getattr__(self, name: str) -> Any:
        defaults = self.__dict__.get("defaults", {})
        if name in defaults:
            return defaults[name]
        raise AttributeError(name)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """torch's view of the hyper-parameters: one group over every parameter (this optimizer has
        one set of them), the same dict as `defaults`; `param_groups[0]["lr"] = x` is how a
        scheduler (tinydist.train.lr_scheduler) or a user sets the rate."""
        return self._groups

    @property
    def lr(self) -> float:
        return self.defaults["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        self.defaults["lr"] = float(value)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def _zeros_like(self, p: Tensor) -> Tensor:
        return Tensor(np.zeros(p.shape, p.dtype.np), device=p.device)

    def step(self) -> None:
        if _tensor_module._assign_observers:  # inside a td.jit capture: the JIT takes the assigns
            self._build_updates()
            self.realize()
            return
        self.realize()  # the losses, the gradients and whatever else is pending: one schedule
        key = self._update_key()
        replay = self._replays.get(key)
        if replay is not None and self._replay(replay):
            return
        before = {id(tensor.node): role for role, tensor in self._roles()}
        self._build_updates()
        targets = [(role, tensor.node) for role, tensor in self._roles() if id(tensor.node) not in before]
        ran: list[Realized] = []
        realize([node for _, node in targets], ran)
        if ran and ran[0].targets == [node for _, node in targets] and all(id(n) in before for n in ran[0].inputs):
            self._replays[key] = _UpdateReplay(ran[0].schedule, tuple(before[id(n)] for n in ran[0].inputs),
                                               tuple(role for role, _ in targets))
        elif ran:
            log.debug("update not kept for replay", reason="the update reads other tensors or overwrites what it reads")

    def _build_updates(self) -> None:
        with no_grad():
            for i, p in enumerate(self.params):
                if p.grad is not None:
                    self._update(i, p, p.grad)

    def _roles(self) -> Iterable[tuple[Role, Tensor]]:
        """Every tensor an update step may read or write, by role (gradients that exist)."""
        for i, p in enumerate(self.params):
            yield (i, "param"), p
            if p.grad is not None:
                yield (i, "grad"), p.grad
            for name, tensor in self.state[i].items():
                yield (i, name), tensor

    def _tensor(self, role: Role) -> Tensor:
        i, name = role
        p = self.params[i]
        if name == "param":
            return p
        if name == "grad":
            assert p.grad is not None
            return p.grad
        return self.state[i][name]

    def _update_key(self) -> Hashable:
        """What decides an update step's graph: the hyper-parameters, and per parameter whether it
        has a gradient, its state's names, and every tensor's dtype, shape and device."""
        return (tuple(self.defaults.items()),
                tuple((role, tensor.dtype, tensor.shape, tensor.device) for role, tensor in self._roles()))

    def _replay(self, replay: _UpdateReplay) -> bool:
        """Run a kept update over the current tensors; False, with nothing done, where the graph
        built anew could differ: an input not yet computed (an assign of the caller's), or a
        tensor to overwrite that a lazy graph still alive reads (it must read the old values
        first, as realize's WAR check orders)."""
        inputs = [self._tensor(role).node for role in replay.inputs]
        targets = [self._tensor(role) for role in replay.targets]
        if not all(node.realized for node in inputs) or any(next(t.node.live_readers(), None) is not None for t in targets):
            return False
        _, buffers = run_schedule(replay.schedule, inputs)
        for tensor, buffer in zip(targets, buffers):
            old = tensor.node
            tensor.node = buffer_node(buffer, old.dtype, old.shape, old.device)  # type: ignore[arg-type]
            if old.requires_grad:  # a parameter stays a leaf across its in-place update
                autograd.after_assign(tensor, old)
        return True

    def realize(self) -> None:
        """Run the pending step: losses, gradients, updates and state in one schedule."""
        nodes = [*autograd.pending_roots, *autograd.pending_updates]
        autograd.pending_roots.clear()
        autograd.pending_updates.clear()
        if _tensor_module._assign_observers:  # inside a td.jit capture: the JIT takes the assigns
            return
        nodes += [p.grad.node for p in reversed(self.params) if p.grad is not None]
        nodes += [p.node for p in self.params] + [t.node for state in self.state for t in state.values()]
        realize(nodes)

    def _update(self, i: int, p: Tensor, g: Tensor) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    # ---- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"state": {i: dict(state) for i, state in enumerate(self.state) if state},
                "param_groups": [dict(self.defaults, params=list(range(len(self.params))))]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = state_dict["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != len(self.params):
            raise ValueError(f"optimizer state is for {len(groups[0]['params'])} parameters, this optimizer has {len(self.params)}")
        self.defaults.update({k: v for k, v in groups[0].items() if k != "params"})
        if isinstance(self.defaults.get("betas"), list):
            self.defaults["betas"] = tuple(self.defaults["betas"])
        nodes = []
        for key, saved in state_dict["state"].items():
            i = int(key)
            p = self.params[i]
            for name, value in saved.items():
                array = value.numpy() if isinstance(value, Tensor) else np.asarray(value)
                self.state[i][name] = Tensor(np.asarray(array, order="C"), device=p.device)
                nodes.append(self.state[i][name].node)
        realize(nodes)


class SGD(Optimizer):
    def __init__(self, params: Iterable[Tensor], lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False) -> None:
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum needs momentum > 0 and zero dampening")
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov)

    def _update(self, i: int, p: Tensor, g: Tensor) -> None:
        d = self.defaults
        if d["weight_decay"]:
            g = g + p * d["weight_decay"]
        if d["momentum"]:
            buf = self.state[i].get("momentum_buffer")
            if buf is None:  # torch: the first step's buffer is the gradient itself
                buf = self.state[i]["momentum_buffer"] = self._zeros_like(p)
                buf.assign(g)
            else:
                buf.assign(buf * d["momentum"] + g * (1 - d["dampening"]))
            g = g + buf * d["momentum"] if d["nesterov"] else buf
        p.assign(p - g * d["lr"])


class Adam(Optimizer):
    """Adam (Kingma & Ba) with torch's update formula; `weight_decay` is L2 added to the gradient."""

    _decoupled = False

    def __init__(self, params: Iterable[Tensor], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)

    def _update(self, i: int, p: Tensor, g: Tensor) -> None:
        d = self.defaults
        lr, (b1, b2), eps, wd = d["lr"], d["betas"], d["eps"], d["weight_decay"]
        state = self.state[i]
        if not state:
            state["step"] = Tensor(np.zeros((), p.dtype.np), device=p.device)
            state["exp_avg"] = self._zeros_like(p)
            state["exp_avg_sq"] = self._zeros_like(p)
        step, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
        if wd and self._decoupled:
            p.assign(p * (1 - lr * wd))
        elif wd:
            g = g + p * wd
        step.assign(step + 1)
        m.assign(m * b1 + g * (1 - b1))
        v.assign(v * b2 + g * g * (1 - b2))
        one = Tensor.full((), 1, p.dtype, p.device)
        bias1 = one - Tensor.full((), b1, p.dtype, p.device).pow(step)
        bias2 = one - Tensor.full((), b2, p.dtype, p.device).pow(step)
        denom = v.sqrt() / bias2.sqrt() + eps
        p.assign(p - m / denom * (lr / bias1))


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter): p ← p·(1 − lr·wd) before the Adam step."""

    _decoupled = True

    def __init__(self, params: Iterable[Tensor], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
