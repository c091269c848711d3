"""Before/after of any benchmark in bench/: the same script at two git revisions, alternated in one run.

A refactor is held to "no benchmark slower by more than noise" (issue 19), and on this shared
2-core machine two runs an hour apart differ by more than most regressions. So both revisions run
here, interleaved round by round (base, head, base, head, ...), each from a detached worktree of
its own with its own `bench/` script, and every figure is reported as the median over rounds with
head/base beside it. Each benchmark's own same-run ratio (tinydist vs numpy, onnxruntime, ...) is
compared too: it is the figure that holds when the machine's speed drifts under both sides.

    .venv/bin/python bench/compare_revisions.py --base 3773248 [--head HEAD] [--rounds 3] \\
        bench/replay.py [-- ARGS FOR THE BENCHMARK]

Figures come from the benchmark's `--json` output where both revisions' scripts take `--json`,
else from its printed lines (`name: VALUE unit (...; N.NNx ...)`). A figure is the first number
after the colon; a ratio is the first `N.NNx`. Lower is better for times and higher for rates:
the verdict column reads the unit (`us`, `ms`, `s` are times; `/s`, `GFLOP`, `GB` rates).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
# A figure more than this far from equal is called out: the spread this machine shows between two
# rounds of one revision under load (measured: replay and train figures move 5-10 % round to round).
NOISE = 0.10
_LINE = re.compile(r"^(?P<name>[^:\n]{3,120}):\s+(?:[A-Za-z_][\w.()-]*\s+){0,3}(?P<value>-?\d+(?:\.\d+)?(?:e[-+]?\d+)?)\s+(?P<unit>[^\s,;]+)")
# A table row without a colon: its label is the text before its first number (p50 in a latency table).
_ROW = re.compile(r"^(?P<name>[A-Za-z][^\d\n]*?[A-Za-z)\]])\s+(?P<value>-?\d+(?:\.\d+)?)(?:\s|$)")
_RATIO = re.compile(r"(?P<ratio>\d+(?:\.\d+)?)x\b")


def worktree(rev: str, into: Path) -> Path:
    path = into / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(path), rev], check=True)
    return path


def takes_json(script: Path) -> bool:
    text = script.read_text()
    return "--json" in text or "Report.from_argv" in text


def run_once(tree: Path, script: str, args: list[str], scratch: Path) -> dict[str, tuple[float, str, float | None]]:
    """{figure name: (value, unit, same-run ratio or None)} of one run of `script` in `tree`."""
    path = tree / script
    if not path.exists():
        raise SystemExit(f"{script} does not exist at {tree.name}: compare only benchmarks both revisions have")
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [PYTHON, str(path), *args]
    out_json = scratch / "figures.json"
    out_json.unlink(missing_ok=True)
    if takes_json(path):
        cmd += ["--json", str(out_json)]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{script} at {tree.name} exited {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    if out_json.exists():
        records = json.loads(out_json.read_text())
        if isinstance(records, list) and all(isinstance(r, dict) and "name" in r for r in records):  # bench/_common.Report
            return {r["name"]: (float(r["value"]), r["unit"], r.get("ratio")) for r in records}
    figures: dict[str, tuple[float, str, float | None]] = {}
    for line in proc.stdout.splitlines():
        text = line.strip()
        match = _LINE.match(text)
        unit = match["unit"] if match else ""
        match = match or _ROW.match(text)
        if match:
            ratio = _RATIO.search(text[match.end():])
            figures[" ".join(match["name"].split())] = (float(match["value"]), unit, float(ratio["ratio"]) if ratio else None)
    return figures


def lower_is_better(unit: str) -> bool | None:
    first = unit.split()[0] if unit.split() else ""
    if "/s" in first or first.startswith(("GFLOP", "GB", "MB", "samples", "items", "frames")):
        return False
    if first.split("/")[0] in ("ns", "us", "ms", "s", "µs"):
        return True
    return None


def verdict(base: float, head: float, unit: str) -> str:
    better_low = lower_is_better(unit)
    if better_low is None or base == 0:
        return ""
    change = head / base
    slower = change > 1 + NOISE if better_low else change < 1 - NOISE
    faster = change < 1 - NOISE if better_low else change > 1 + NOISE
    return "SLOWER" if slower else "faster" if faster else "same"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the revision before the change (a commit, tag or branch)")
    parser.add_argument("--head", default="HEAD", help="the revision after it (default HEAD)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of each side (default 3)")
    parser.add_argument("script", help="the benchmark, relative to the repository root, e.g. bench/replay.py")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="after --: the benchmark's own arguments")
    ns = parser.parse_args(argv)
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    with tempfile.TemporaryDirectory(prefix="tinydist-ab-") as tmp:
        scratch = Path(tmp)
        trees = {side: worktree(rev, scratch) for side, rev in (("base", ns.base), ("head", ns.head))}
        try:
            runs: dict[str, list[dict[str, tuple[float, str, float | None]]]] = {"base": [], "head": []}
            for round_ in range(ns.rounds):
                for side in ("base", "head") if round_ % 2 == 0 else ("head", "base"):
                    runs[side].append(run_once(trees[side], ns.script, args, scratch))
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    print(f"{ns.script}: base {ns.base}, head {ns.head}, medians of {ns.rounds} alternating rounds "
          f"(call-out beyond ±{NOISE:.0%})")
    names = [n for n in runs["head"][0] if all(n in r for r in runs["base"] + runs["head"])]
    for name in names:
        unit = runs["head"][0][name][1]
        base = statistics.median(r[name][0] for r in runs["base"])
        head = statistics.median(r[name][0] for r in runs["head"])
        line = f"  {name}: base {base:.4g} {unit}, head {head:.4g} {unit}, head/base {head / base if base else float('nan'):.3f}"
        ratios = {side: [ratio for r in runs[side] if (ratio := r[name][2]) is not None] for side in runs}
        if ratios["base"] and ratios["head"]:
            line += f"; same-run ratio base {statistics.median(ratios['base']):.3f}x, head {statistics.median(ratios['head']):.3f}x"
        print(f"{line} {verdict(base, head, unit)}".rstrip())
    only = sorted({n for r in runs["base"] + runs["head"] for n in r} - set(names))
    if only:
        print(f"  (in one revision's output only: {', '.join(only)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
