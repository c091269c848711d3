from __future__ import annotations

import numpy as np

import tinydist as td

F = td.nn.functional


def data(n: int = 128, features: int = 16, classes: int = 5, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    g = np.random.default_rng(seed)
    return g.standard_normal((n, features)).astype(np.float32), g.integers(0, classes, n).astype(np.int64)


def make_mlp(seed: int = 0, device: str | None = None) -> td.nn.Module:
    td.manual_seed(seed)
    return td.nn.Sequential(td.nn.Linear(16, 32, device=device), td.nn.ReLU(), td.nn.Linear(32, 5, device=device))


def make_cnn(seed: int = 0, batchnorm: bool = False) -> td.nn.Module:
    td.manual_seed(seed)
    layers = [td.nn.Conv2d(1, 4, 3, padding=1)] + ([td.nn.BatchNorm2d(4)] if batchnorm else []) + \
        [td.nn.ReLU(), td.nn.MaxPool2d(2), td.nn.Flatten(), td.nn.Linear(4 * 4 * 4, 5)]
    return td.nn.Sequential(*layers)


def train(model, opt, dataset, steps: int, batch: int = 32, rank: int = 0, world: int = 1, start: int = 0,
          image: bool = False) -> list[float]:
    x, y = dataset
    losses = []
    local = batch // world
    for step in range(start, start + steps):
        lo = (step * batch) % len(x) + rank * local
        xb = x[lo:lo + local]
        if image:
            xb = xb.reshape(-1, 1, 4, 4).repeat(2, axis=2).repeat(2, axis=3)
        loss = F.cross_entropy(model(td.Tensor(xb)), td.Tensor(y[lo:lo + local]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def weights(model) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in model.state_dict().items()}
