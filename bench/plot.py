"""Charts of benchmark results: `--json` output of any bench/ script → one PNG.

    .venv/bin/python bench/runtime.py --json /tmp/runtime.json
    .venv/bin/python bench/plot.py /tmp/runtime.json [more.json ...] -o docs/bench_runtime.png

One panel per result that has a same-run baseline: tinydist's figure next to the baseline's (in
the result's unit), the ratio printed above the pair (as the benchmark defines it), and the target
with PASS/MISS when the result has one. Results without a baseline are drawn as a single bar.
Needs matplotlib (`pip install 'tinydist[plot]'`).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any

TINYDIST = "#1f77b4"
BASELINE = "#bdbdbd"


def load(paths: list[Path]) -> list[dict[str, Any]]:
    results = []
    for path in paths:
        data = json.loads(path.read_text())
        for r in data:
            r = dict(r)
            r["_source"] = path.stem
            results.append(r)
    return results


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.3g}"


def _lead_unit(unit: str) -> str:
    return unit.split("/")[0].split(" ")[0]


def _target_value(target: str | None, unit: str) -> float | None:
    """The number in a target such as "<=5 us", ">=1.7x", "<=1 %", if it is in the value's unit
    (a ">=3x" ratio target on a result measured in ms has no place on its axis)."""
    if not target:
        return None
    match = re.search(r"([-+]?\d+(?:\.\d+)?)\s*(\S*)", target)
    if not match:
        return None
    target_unit = match.group(2) or ""
    return float(match.group(1)) if target_unit == _lead_unit(unit) else None


def plot(results: list[dict[str, Any]], out: Path, title: str | None = None, columns: int = 3,
         only: list[str] | None = None) -> Path:
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    if only:
        results = [r for r in results if any(key in r["name"] for key in only)]
    if not results:
        raise SystemExit("no results to plot")
    n = len(results)
    cols = min(columns, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.1 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    for ax, r in zip(axes.flat, results):
        unit = r.get("unit", "")
        labels, values, colors = [r.get("value_label") or "tinydist"], [r["value"]], [TINYDIST]
        notes = []
        if r.get("baseline") is not None:
            base_unit = r.get("baseline_unit") or _lead_unit(unit)
            if _lead_unit(base_unit) == _lead_unit(unit):  # same unit: the pair of bars
                labels.append((r.get("baseline_label") or "baseline")[:28])
                values.append(r["baseline"])
                colors.append(BASELINE)
            else:
                notes.append(f"{r.get('baseline_label') or 'baseline'}: {_fmt(r['baseline'])} {base_unit}")
        bars = ax.bar(range(len(values)), values, color=colors, width=0.6)
        for bar, v in zip(bars, values):
            ax.annotate(_fmt(v), (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=8, xytext=(0, 2), textcoords="offset points")
        ax.set_xticks(range(len(values)))
        ax.set_xticklabels(labels, fontsize=7.5, rotation=0, wrap=True)
        ax.set_ylabel(unit, fontsize=7.5)
        top = max(values)
        threshold = _target_value(r.get("target"), unit)
        if threshold is not None:
            ax.axhline(threshold, color="#d62728", linestyle="--", linewidth=1)
            ax.annotate("target", (1.0, threshold), xycoords=("axes fraction", "data"), ha="right", va="bottom",
                        fontsize=7, color="#d62728")
            top = max(top, threshold)
        if _lead_unit(unit) == "x":
            ax.axhline(1.0, color="#555555", linestyle=":", linewidth=1)
        ax.set_ylim(0, top * 1.45 if top > 0 else 1)
        if r.get("ratio") is not None:
            notes.append(f"{(r.get('ratio_label') + ' ') if r.get('ratio_label') else 'ratio '}{_fmt(r['ratio'])}x")
        if notes:
            ax.text(0.5, 0.97, "\n".join(notes), transform=ax.transAxes, ha="center", va="top", fontsize=7.5,
                    bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8})
        if r.get("target") is not None:
            ok = bool(r.get("pass"))
            ax.text(0.02, 0.97 - 0.09 * len(notes), f"target {r['target']}: {'PASS' if ok else 'MISS'}",
                    transform=ax.transAxes, ha="left", va="top", fontsize=7.5, color="#2ca02c" if ok else "#d62728",
                    fontweight="bold")
        ax.set_title(r["name"], fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title or "tinydist benchmarks (medians; baselines measured in the same run)", fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", type=Path, help="JSON files written by bench/*.py --json")
    parser.add_argument("-o", "--output", type=Path, required=True, help="PNG to write")
    parser.add_argument("--title", help="figure title")
    parser.add_argument("--columns", type=int, default=3)
    parser.add_argument("--only", action="append", help="plot only results whose name contains this (repeatable)")
    args = parser.parse_args(argv)
    out = plot(load(args.inputs), args.output, args.title, args.columns, args.only)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
