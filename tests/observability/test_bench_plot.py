"""bench/plot.py: `--json` results of a bench script → a PNG chart."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import tinydist as td
from tinydist import observability

ROOT = Path(__file__).resolve().parents[2]


def test_trace_is_exported_from_the_package() -> None:
    assert td.trace is observability.trace


def test_plot_writes_a_chart_of_bench_json(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("bench_plot", ROOT / "bench" / "plot.py")
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    results = [
        {"name": "fused", "value": 10.0, "unit": "ms", "baseline": 39.6, "baseline_label": "numpy", "ratio": 3.96,
         "target": ">=3x", "pass": True},
        {"name": "launch/batch100", "value": 2.0, "unit": "us/kernel overhead", "baseline": 0.45,
         "baseline_label": "direct call", "target": "<=5 us", "pass": True},
        {"name": "parallel/speedup", "value": 1.9, "unit": "x", "baseline": 300.0, "baseline_unit": "ms",
         "baseline_label": "one device", "target": ">=1.7x", "pass": True},
        {"name": "overlap", "value": 98.0, "unit": "%"},
    ]
    source = tmp_path / "bench.json"
    source.write_text(json.dumps(results))
    out = tmp_path / "chart.png"
    assert plot.main([str(source), "-o", str(out), "--title", "test"]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert plot._target_value(">=3x", "ms") is None and plot._target_value("<=5 us", "us/kernel overhead") == 5.0
