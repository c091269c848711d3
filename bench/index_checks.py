"""What the index bounds checks cost (issue 20): `cross_entropy`, `nll_loss` and `Embedding` read
labels / indices that already hold values once on the host and refuse one outside [0, count)
with an IndexError, where a one-hot select would otherwise give a wrong value silently.

Measured in one run, the sides alternating repeat by repeat, medians:

    check       `check_indices` alone on 256 int64 labels of 10 classes
    numpy       the floor: numpy's min and max of the same labels
    step        an eager training step of the digits MLP (forward, cross_entropy, backward,
                Adam; batch 256), with the check, and with it replaced by nothing; the check's
                share of the step is its own time over the step's (the with/without difference
                is printed too, but a fraction of a percent is below a step's noise)
    torch       PyTorch's cross_entropy on the same batch (it checks too), for scale

    .venv/bin/python bench/index_checks.py [--json PATH]
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import Report, median  # noqa: E402

import tinydist as td  # noqa: E402
from tinydist.train.nn import functional as F  # noqa: E402

BATCH, CLASSES = 256, 10


def per_call_us(fn: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def alternate(sides: dict[str, Callable[[], Any]], repeats: int, calls: int) -> dict[str, float]:
    for fn in sides.values():
        per_call_us(fn, max(calls // 5, 5))
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            times[name].append(per_call_us(fn, calls))
    return {name: median(values) for name, values in times.items()}


def main() -> None:
    report = Report.from_argv("index_checks", description=__doc__)
    rng = np.random.default_rng(0)
    labels_h = rng.integers(0, CLASSES, BATCH).astype(np.int64)
    x_h = rng.random((BATCH, 64), dtype=np.float32)
    labels, x = td.Tensor(labels_h), td.Tensor(x_h)

    td.manual_seed(0)
    model = td.nn.Sequential(td.nn.Linear(64, 128), td.nn.ReLU(), td.nn.Linear(128, 10))
    optimizer = td.optim.Adam(model.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), labels)
        loss.backward()
        optimizer.step()
        loss.numpy()

    checked = F.check_indices

    def step_unchecked() -> None:
        F.check_indices = lambda *args: None  # type: ignore[assignment]
        try:
            step()
        finally:
            F.check_indices = checked

    parts = alternate({
        "check": lambda: checked(labels, CLASSES, "label"),
        "numpy": lambda: (labels_h.min(), labels_h.max()),
    }, repeats=15, calls=2000)
    steps = alternate({"step": step, "unchecked": step_unchecked}, repeats=9, calls=40)
    report.add("index_checks/check", parts["check"], "us per call", value_label=f"check_indices, {BATCH} labels",
               baseline=parts["numpy"], baseline_label="numpy min+max", ratio=parts["numpy"] / parts["check"],
               ratio_label="numpy/ours", repeats=15)
    share = 100 * parts["check"] / steps["step"]
    report.add("index_checks/step", steps["step"], "us per step", value_label="eager MLP step with the check",
               baseline=steps["unchecked"], baseline_label="without it", ratio=steps["unchecked"] / steps["step"],
               ratio_label="unchecked/checked",
               detail=(f"the check alone is {share:.2f} % of the step; the with/without difference "
                       f"({steps['step'] - steps['unchecked']:+.1f} us) is within the step's run-to-run noise"), repeats=9)
    try:
        import torch
        torch.set_num_threads(1)
        logits_t, labels_t = torch.from_numpy(rng.random((BATCH, CLASSES), dtype=np.float32)), torch.from_numpy(labels_h)
        ce = alternate({"torch": lambda: torch.nn.functional.cross_entropy(logits_t, labels_t)}, repeats=9, calls=500)
        report.note(f"torch.nn.functional.cross_entropy on the same batch (it checks labels too): {ce['torch']:.2f} us")
    except ImportError:
        report.note("torch is not installed (pip install 'tinydist[bench]'): no PyTorch line")
    report.finish()


if __name__ == "__main__":
    main()
