"""Shared helpers for the benchmarks in bench/.

Every benchmark measures its baseline in the same run and reports medians of repeats, because this
machine is shared and noisy: absolute times drift between runs, ratios measured side by side hold.

    from _common import Report, median, time_repeats

    report = Report.from_argv("runtime")          # parses --json PATH
    t = time_repeats(fn, repeats=7)               # list of seconds, one per repeat
    report.add("launch/direct", median(t) * 1e6, "us", repeats=7)
    report.finish()                               # writes the JSON list when --json was given

Benchmarks that compare against a BLAS-backed baseline (numpy) run that baseline in a subprocess
with `baseline_env()`: the OpenBLAS tuning variables this project's environment may set
(OPENBLAS_CORETYPE, OPENBLAS_L2_SIZE) are removed there, so the baseline runs as OpenBLAS would
pick for itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# OpenBLAS tuning knobs stripped from a baseline subprocess's environment.
OPENBLAS_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")

clock = time.perf_counter


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def time_repeats(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds per call of `fn()`, one entry per repeat, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return times


async def atime_repeats(fn: Callable[[], Awaitable[Any]], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds per `await fn()`, one entry per repeat, after `warmup` untimed calls."""
    for _ in range(warmup):
        await fn()
    times = []
    for _ in range(repeats):
        start = clock()
        await fn()
        times.append(clock() - start)
    return times


def baseline_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a baseline subprocess: ours without the OpenBLAS tuning variables."""
    env = {k: v for k, v in os.environ.items() if k not in OPENBLAS_VARS}
    if extra:
        env.update(extra)
    return env


def _fmt(value: float) -> str:
    """Three significant figures without scientific notation for the ranges benchmarks print."""
    if value == 0 or abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


@dataclass
class Result:
    name: str
    value: float
    unit: str
    baseline: float | None = None          # the same-run baseline, in `unit` unless baseline_unit says
    baseline_label: str | None = None      # what the baseline is, e.g. "direct call"
    baseline_unit: str | None = None
    ratio: float | None = None             # as the benchmark defines it (printed as "N.NNx")
    ratio_label: str | None = None
    target: str | None = None              # e.g. "<=5 us", ">=1.7x"
    passed: bool | None = None
    repeats: int | None = None
    detail: str | None = None              # printed in the parentheses, after baseline and ratio
    extra: dict[str, Any] = field(default_factory=dict)  # JSON only
    value_label: str | None = None         # printed before the value, e.g. "tinydist"

    def line(self) -> str:
        label = f"{self.value_label} " if self.value_label else ""
        text = f"{self.name}: {label}{_fmt(self.value)} {self.unit}"
        details = []
        if self.baseline is not None:
            unit = self.baseline_unit or self.unit.split("/")[0].split(" ")[0]
            details.append(f"{self.baseline_label or 'baseline'} {_fmt(self.baseline)} {unit}")
        if self.ratio is not None:
            details.append(f"{self.ratio_label + ' ' if self.ratio_label else ''}{_fmt(self.ratio)}x")
        if self.detail:
            details.append(self.detail)
        if details:
            text += f" ({'; '.join(details)})"
        if self.target is not None:
            text += f" target {self.target}: {'PASS' if self.passed else 'MISS'}"
        if self.repeats is not None:
            text += f" (median of {self.repeats})"
        return text

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["pass"] = d.pop("passed")
        return d


class Report:
    """Collects results, prints one line per result as it arrives, writes `--json PATH` at the end."""

    def __init__(self, title: str, json_path: Path | None = None, stream: Any = None) -> None:
        self.title = title
        self.json_path = json_path
        self.results: list[Result] = []
        self.stream = stream if stream is not None else sys.stdout

    @classmethod
    def from_argv(cls, title: str, argv: Sequence[str] | None = None, description: str | None = None) -> Report:
        parser = argparse.ArgumentParser(description=description or f"{title} benchmarks")
        parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results as a JSON list to PATH")
        args = parser.parse_args(argv)
        return cls(title, args.json)

    def add(self, name: str, value: float, unit: str, **fields: Any) -> Result:
        result = Result(name, value, unit, **fields)
        self.results.append(result)
        print(result.line(), file=self.stream, flush=True)
        return result

    def note(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    @property
    def misses(self) -> list[Result]:
        return [r for r in self.results if r.target is not None and not r.passed]

    def finish(self) -> None:
        if self.json_path is not None:
            self.json_path.parent.mkdir(parents=True, exist_ok=True)
            self.json_path.write_text(json.dumps([r.as_dict() for r in self.results], indent=2) + "\n")
