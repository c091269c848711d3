"""`Module`: parameters, buffers, children, state dicts, train/eval, replication onto a device."""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np

from tinydist.engine.realize import realize
from tinydist.frontend.autograd import no_grad
from tinydist.frontend.tensor import Tensor


class Module:
    """Base class: attributes that are Modules are children, Tensors that require grad are
    parameters, and names listed in `_buffer_names` are buffers (state without gradients)."""

    training = True
    _buffer_names: tuple[str, ...] = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__}.forward is not implemented")

    # ---- traversal ----------------------------------------------------------------------------

    def named_children(self) -> Iterator[tuple[str, Module]]:
        for name, value in vars(self).items():
            if isinstance(value, Module):
                yield name, value

    def children(self) -> Iterator[Module]:
        return (m for _, m in self.named_children())

    def modules(self) -> Iterator[Module]:
        yield self
        for child in self.children():
            yield from child.modules()

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
        for name, value in vars(self).items():
            if isinstance(value, Tensor) and name not in self._buffer_names and value.requires_grad:
                yield prefix + name, value
            elif isinstance(value, Module):
                yield from value.named_parameters(prefix + name + ".")

    def parameters(self) -> list[Tensor]:
        return [p for _, p in self.named_parameters()]

    def named_buffers(self, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
        for name, value in vars(self).items():
            if name in self._buffer_names and isinstance(value, Tensor):
                yield prefix + name, value
            elif isinstance(value, Module):
                yield from value.named_buffers(prefix + name + ".")

    # ---- state --------------------------------------------------------------------------------

    def state_dict(self) -> OrderedDict[str, Tensor]:
        """Parameters and buffers by dotted name (torch's naming)."""
        state: OrderedDict[str, Tensor] = OrderedDict()
        self._state_into(state, "")
        return state

    def _state_into(self, state: dict[str, Tensor], prefix: str) -> None:
        for name, value in vars(self).items():
            if isinstance(value, Tensor) and (name in self._buffer_names or value.requires_grad):
                state[prefix + name] = value
            elif isinstance(value, Module):
                value._state_into(state, prefix + name + ".")

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Assign every entry into the matching parameter/buffer (shapes must agree)."""
        own = self.state_dict()
        if strict:
            missing, unexpected = set(own) - set(state), set(state) - set(own)
            if missing or unexpected:
                raise KeyError(f"load_state_dict: missing keys {sorted(missing)}, unexpected keys {sorted(unexpected)}")
        with no_grad():
            for name, target in own.items():
                if name not in state:
                    continue
                value = state[name]
                value = value.numpy() if isinstance(value, Tensor) else np.asarray(value)
                if value.shape != target.shape:
                    raise ValueError(f"load_state_dict: {name} has shape {value.shape}, the model's is {target.shape}")
                target.assign(Tensor(value.astype(target.dtype.np, copy=False), device=target.device))
        realize([t.node for t in own.values()])

    def train(self, mode: bool = True) -> Module:
        for module in self.modules():
            module.training = mode
        return self

    def eval(self) -> Module:
        return self.train(False)

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def __repr__(self) -> str:
        children = [f"  ({name}): {repr(m).replace(chr(10), chr(10) + '  ')}" for name, m in self.named_children()]
        head = f"{type(self).__name__}({self.extra_repr()}"
        return head + (")" if not children else "\n" + "\n".join(children) + "\n)")

    def extra_repr(self) -> str:
        return ""


def replicate(module: Module, device: str) -> Module:
    """A copy of `module` whose parameters and buffers live on `device` (parameters stay leaves)."""
    new = copy.copy(module)
    for name, value in vars(module).items():
        if isinstance(value, Module):
            setattr(new, name, replicate(value, device))
        elif isinstance(value, Tensor):
            setattr(new, name, Tensor(value.numpy(), device=device, requires_grad=value.requires_grad))
    return new
