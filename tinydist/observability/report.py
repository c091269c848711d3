"""Reading a trace without a browser: a summary table for the terminal and a Gantt chart (PNG).

Both work from the Trace Event Format object (a fresh `Tracer.chrome()` or a loaded file), so
`tinydist profile --png out.png --summary trace.json`-style use on saved files works the same.
"""

from __future__ import annotations

import os
from collections import defaultdict
from operator import itemgetter
from pathlib import Path
from typing import Any

COLORS = {"kernel": "#1f77b4", "copy": "#ff7f0e", "wait": "#bdbdbd", "host sync": "#d62728", "host": "#9467bd",
          "compile": "#e377c2", "schedule": "#bcbd22", "python": "#7f7f7f", "collective": "#2ca02c",
          "transport": "#98df8a", "rpc": "#17becf", "scheduler": "#aec7e8", "span": "#8c564b"}


def _names(trace: dict[str, Any]) -> tuple[dict[int, str], dict[tuple[int, int], str]]:
    processes: dict[int, str] = {}
    threads: dict[tuple[int, int], str] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    return processes, threads


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, t in sorted(intervals):
        if t <= end:
            continue
        total += t - max(s, end)
        end = t
    return total


def summarize(trace: dict[str, Any]) -> dict[str, Any]:
    """Per-name totals (kernels, copies, waits, host syncs, spans) and per-lane busy shares."""
    processes, threads = _names(trace)
    xs = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    if not xs:
        return {"span_us": 0.0, "names": [], "lanes": []}
    t0 = min(e["ts"] for e in xs)
    t1 = max(e["ts"] + e["dur"] for e in xs)
    span = max(t1 - t0, 1e-9)
    by_name: dict[tuple[str, str], list[float]] = defaultdict(list)
    busy: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for e in xs:
        lane = (e["pid"], e.get("tid", 0))
        if e.get("cat") == "batch":
            busy[lane].append((e["ts"], e["ts"] + e["dur"]))
            continue
        by_name[(e.get("cat", ""), e["name"] if e.get("cat") not in ("wait", "host sync") else e.get("cat"))].append(e["dur"])
        if e.get("cat") not in ("kernel", "copy", "wait", "host"):  # spans and host syncs have no batch
            busy[lane].append((e["ts"], e["ts"] + e["dur"]))
    work = sum(sum(d) for (cat, _), d in by_name.items() if cat in ("kernel", "copy")) or 1e-9
    names = sorted(({"category": cat, "name": name, "count": len(d), "total_us": sum(d), "mean_us": sum(d) / len(d),
                     "share": sum(d) / work if cat in ("kernel", "copy") else None}
                    for (cat, name), d in by_name.items()), key=itemgetter("total_us"), reverse=True)  # stable, as -total
    lanes = [{"process": processes.get(pid, str(pid)), "lane": threads.get((pid, tid), str(tid)),
              "busy_us": _union(iv), "busy": _union(iv) / span, "events": len(iv)}
             for (pid, tid), iv in sorted(busy.items())]
    return {"span_us": span, "names": names, "lanes": lanes}


def _intersection(a: tuple[float, float], intervals: list[tuple[float, float]]) -> float:
    """How much of interval `a` the union of `intervals` covers."""
    return _union([(max(s, a[0]), min(t, a[1])) for s, t in intervals if s < a[1] and t > a[0]])


def collective_overlap(trace: dict[str, Any], step: str = "step") -> list[dict[str, Any]]:
    """Per span named `step` (a training step the caller marked, its device work waited for inside
    it): how much of its process collectives' time ran while backward kernels ran, from the device
    lanes' events. A collective is a graph node's program run on a queue (`td_dist_*`, the copy
    queue's); backward kernels are the compute queue's kernels that ended by the time the step's
    last collective started (that collective's input is the last gradient backward makes, so the
    optimizer's kernels come after it). Returns per step: the span's `args` and `window` (µs), `collectives` [(start, end) µs],
    `collective_us` (their total), `overlap_us` (their time covered by backward kernels),
    `backward_end` (the last backward kernel's end), `matmul_end` (the last backward matmul's end)
    `started_before_backward_end` (collectives that started before it) and `ahead` (whether the
    queues let the first collective run beside the last backward matmul, `_ahead`)."""
    _, threads = _names(trace)
    xs = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    found = []
    for mark in (e for e in xs if e["name"] == step and e.get("cat") == "span"):
        lo, hi = mark["ts"], mark["ts"] + mark["dur"]
        inside = [e for e in xs if lo <= e["ts"] <= hi and e.get("cat") == "kernel"]
        collectives = sorted((e["ts"], e["ts"] + e["dur"]) for e in inside if e["name"].startswith("td_dist_"))
        compute = [e for e in inside if threads.get((e["pid"], e["tid"])) == "compute" and not e["name"].startswith("td_dist_")]
        last_start = collectives[-1][0] if collectives else hi
        backward = [e for e in compute if e["ts"] + e["dur"] <= last_start]
        spans = [(e["ts"], e["ts"] + e["dur"]) for e in backward]
        end = max((t for _, t in spans), default=lo)
        matmuls = [e for e in backward if e["name"].startswith("matmul")]
        found.append({"args": mark.get("args", {}), "window": (lo, hi), "collectives": collectives, "collective_us": sum(t - s for s, t in collectives),
                      "overlap_us": sum(_intersection(c, spans) for c in collectives), "backward_end": end,
                      "matmul_end": max((e["ts"] + e["dur"] for e in matmuls), default=lo),
                      "started_before_backward_end": sum(1 for s, _ in collectives if s < end),
                      "ahead": _ahead(inside, [e for e in xs if lo <= e["ts"] <= hi and e.get("cat") == "wait"], matmuls)})
    return found


def _ahead(kernels: list[dict[str, Any]], waits: list[dict[str, Any]], matmuls: list[dict[str, Any]]) -> bool:
    """From the queues' batches and waits, not their timing: whether the step's first collective
    ran on a queue of its own, its batch waited only for compute batches before the one running
    backward's last matmul, and no compute work before that matmul waited for it — so it could
    run while that matmul ran, however the threads were scheduled."""
    collectives = [e for e in kernels if e["name"].startswith("td_dist_")]
    if not collectives or not matmuls:
        return False
    first, last = min(collectives, key=lambda e: e["ts"]), max(matmuls, key=lambda e: e["ts"])
    mine, theirs = first["args"], last["args"]
    if mine.get("queue") == theirs.get("queue"):
        return False
    waited_for = [w["args"]["target"] for w in waits if w["args"]["value"] == mine["value"]
                  and w["args"]["queue"] == mine["queue"] and w["args"]["timeline"] == theirs["timeline"]]
    held = [w for w in waits if w["args"]["queue"] == theirs["queue"] and w["args"]["timeline"] == mine["timeline"]
            and w["args"]["target"] >= mine["value"] and w["ts"] < last["ts"]]
    return all(t < theirs["value"] for t in waited_for) and not held


def _fmt_us(us: float) -> str:
    if us >= 1e6:
        return f"{us / 1e6:.3g} s"
    if us >= 1e3:
        return f"{us / 1e3:.3g} ms"
    return f"{us:.3g} us"


def format_summary(trace: dict[str, Any], top: int = 20) -> str:
    s = summarize(trace)
    lines = [f"trace: {_fmt_us(s['span_us'])} from first to last event"]
    if not s["names"]:
        return lines[0] + " (no events)"
    lines.append("")
    width = min(max(len(r["name"]) for r in s["names"][:top]), 48)
    lines.append(f"{'category':<10} {'name':<{width}} {'count':>7} {'total':>10} {'mean':>10} {'share':>6}")
    for r in s["names"][:top]:
        share = f"{r['share'] * 100:5.1f}%" if r["share"] is not None else "     -"
        lines.append(f"{r['category']:<10} {r['name'][:width]:<{width}} {r['count']:>7} {_fmt_us(r['total_us']):>10} "
                     f"{_fmt_us(r['mean_us']):>10} {share}")
    if len(s["names"]) > top:
        lines.append(f"... {len(s['names']) - top} more")
    lines.append("(share: of all kernel + copy time)")
    lines.append("")
    pw = max(len(r["process"]) for r in s["lanes"])
    lw = max(len(r["lane"]) for r in s["lanes"])
    lines.append(f"{'process':<{pw}} {'lane':<{lw}} {'busy':>10} {'busy %':>7} {'events':>7}")
    for r in s["lanes"]:
        lines.append(f"{r['process']:<{pw}} {r['lane']:<{lw}} {_fmt_us(r['busy_us']):>10} {r['busy'] * 100:6.1f}% {r['events']:>7}")
    return "\n".join(lines)


def last_batch_window(trace: dict[str, Any], pad: float = 0.02) -> tuple[float, float]:
    """(start, end) in µs since the first event: the last batch to start on any queue, with `pad`
    of its length either side; a `zoom` for `plot_gantt` that shows one step's kernels."""
    xs = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    batches = [e for e in xs if e.get("cat") == "batch"]
    if not batches:
        raise ValueError("the trace has no batches to zoom on")
    t0 = min(e["ts"] for e in xs)
    last = max(batches, key=lambda e: e["ts"])
    margin = last["dur"] * pad
    return last["ts"] - t0 - margin, last["ts"] - t0 + last["dur"] + margin


def _fit(name: str, width: int, lines: int) -> str:
    """`name` in at most `lines` lines of at most `width` characters, broken at spaces (a kernel's
    ops, shape and dtype each on a line of their own if need be); "" when even a short first
    word does not fit, and a cut word ends in "…"."""
    if width >= len(name):
        return name
    if width < 4:
        return ""
    rows: list[str] = []
    for word in name.split(" "):
        if rows and len(rows[-1]) + 1 + len(word) <= width:
            rows[-1] += " " + word
        else:
            rows.append(word)
    if len(rows) > lines:
        rows = rows[:lines]
    return "\n".join(r if len(r) <= width else r[:width - 1] + "…" for r in rows)


def plot_gantt(trace: dict[str, Any], path: str | os.PathLike[str], title: str | None = None,
               max_flows: int = 300, zoom: tuple[float, float] | None = None) -> Path:
    """Draw the lanes as a Gantt chart (commands coloured by category, batches as outlines, flow
    arrows, a bytes-in-flight panel) with a legend and a time axis; needs matplotlib (`[plot]`).

    `zoom=(start, end)`, in µs since the first event, adds a panel of the same lanes over that
    window only, where short kernels are wide enough to carry their names (a cold run's compile
    time is milliseconds, its kernels microseconds). Names are written on every bar they fit in."""
    try:
        import matplotlib
        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
        from matplotlib.artist import Artist
        from matplotlib.patches import Patch
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError("drawing a PNG needs matplotlib: pip install 'tinydist[plot]'") from exc

    processes, threads = _names(trace)
    events = trace["traceEvents"]
    xs = [e for e in events if e.get("ph") == "X"]
    counters = [e for e in events if e.get("ph") == "C"]
    if not xs:
        raise ValueError("the trace has no complete events to draw")
    t0 = min(e["ts"] for e in xs)
    t1 = max(e["ts"] + e["dur"] for e in xs)
    span_us = max(t1 - t0, 1e-3)
    scale, unit = (1e3, "ms") if span_us >= 2e3 else (1.0, "µs")

    lanes = sorted({(e["pid"], e.get("tid", 0)) for e in xs})
    row = {lane: i for i, lane in enumerate(lanes)}
    labels = [f"{processes.get(p, p)} / {threads.get((p, t), t)}" for p, t in lanes]
    width_in = 13.0
    lane_h = max(len(lanes), 2)
    ratios = [lane_h] + ([lane_h] if zoom else []) + ([1.6] if counters else [])
    fig_h = max(2.5, 0.5 * len(lanes) + 1.6) * (2 if zoom else 1) + (1.6 if counters else 0)
    fig, axes = plt.subplots(len(ratios), 1, figsize=(width_in, fig_h), squeeze=False,
                             gridspec_kw={"height_ratios": ratios})
    used: set[str] = set()
    text_w = 6.0 / 72 * 0.62  # inches per character at 6 pt
    lane_in = (fig_h - (1.6 if counters else 0)) / (2 if zoom else 1) / max(len(lanes), 2) * 0.64
    lines = max(1, min(3, int(lane_in * 72 / 7.5)))  # lines of 6 pt text a bar holds
    plot_w = width_in * 0.72  # the axes' share of the figure, beside the lane names and legend

    def draw(ax: Any, lo: float, hi: float, sc: float, u: str, heading: str, base: float) -> None:
        window = max(hi - lo, 1e-3)
        inside = [e for e in xs if e["ts"] + e["dur"] >= t0 + lo and e["ts"] <= t0 + hi]
        by_cat: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
        for e in inside:
            y = row[(e["pid"], e.get("tid", 0))]
            x, w = (e["ts"] - t0 - base) / sc, e["dur"] / sc
            cat = e.get("cat", "span")
            if cat == "batch":
                ax.add_patch(plt.Rectangle((x, y - 0.42), w, 0.84, fill=False, edgecolor="#555555", linewidth=0.6))
                used.add("batch")
                continue
            by_cat[cat].append((y, x, w))
        for cat, bars in by_cat.items():
            color = COLORS.get(cat, COLORS["span"])
            used.add(cat)
            for y, x, w in bars:
                ax.broken_barh([(x, max(w, window / sc / 2000))], (y - 0.32, 0.64), facecolors=color, edgecolor="none")
        # names on the bars wide enough to hold them (kernels by op and shape, spans, compiles)
        us_per_char = window / plot_w * text_w
        for e in inside:
            if e.get("cat") in ("batch", "wait", "copy", "host sync"):
                continue
            text = _fit(e["name"], int(e["dur"] / us_per_char) - 1, lines)
            if text:
                ax.text((e["ts"] - t0 - base + e["dur"] / 2) / sc, row[(e["pid"], e.get("tid", 0))], text,
                        ha="center", va="center", fontsize=6, color="white", clip_on=True)
        starts = {e["id"]: e for e in events if e.get("ph") == "s"}
        drawn = 0
        for e in events:
            if e.get("ph") == "f" and e["id"] in starts and drawn < max_flows:
                s = starts[e["id"]]
                if (s["pid"], s.get("tid")) in row and (e["pid"], e.get("tid")) in row:
                    ax.annotate("", xy=((e["ts"] - t0 - base) / sc, row[(e["pid"], e.get("tid"))]),
                                xytext=((s["ts"] - t0 - base) / sc, row[(s["pid"], s.get("tid"))]),
                                arrowprops={"arrowstyle": "->", "color": "#444444", "lw": 0.6, "alpha": 0.7})
                    drawn += 1
                    used.add("signal → wait")
        ax.set_yticks(range(len(lanes)))
        ax.set_yticklabels(labels, fontsize=8)
        ax.set_ylim(len(lanes) - 0.5, -0.5)
        ax.set_xlim((lo - base) / sc, (lo - base + window * 1.01) / sc)
        ax.grid(axis="x", alpha=0.3)
        ax.set_title(heading, fontsize=10)
        ax.set_xlabel(f"time since {'trace start' if not base else _fmt_us(base)} ({u})", fontsize=8)

    draw(axes[0][0], 0.0, span_us, scale, unit, title or "tinydist trace", 0.0)
    if zoom:
        lo, hi = zoom
        zscale, zunit = (1e3, "ms") if hi - lo >= 2e3 else (1.0, "µs")
        draw(axes[1][0], lo, hi, zscale, zunit, f"zoom: {_fmt_us(hi - lo)} from {_fmt_us(lo)}", lo)
    handles: list[Artist] = [Patch(facecolor=COLORS.get(c, COLORS["span"]), label=c) for c in COLORS if c in used]
    if "batch" in used:
        handles.append(Patch(facecolor="none", edgecolor="#555555", label="batch (one submission)"))
    if "signal → wait" in used:
        from matplotlib.lines import Line2D
        handles.append(Line2D([0], [0], color="#444444", lw=0.8, marker=">", label="signal → wait it releases"))
    axes[0][0].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False)
    if counters:
        cax = axes[-1][0]
        per_pid: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for c in counters:
            per_pid[c["pid"]].append(((c["ts"] - t0) / scale, sum(c["args"].values())))
        for pid, pts in sorted(per_pid.items()):
            pts.sort()
            xs_, ys_ = [0.0] + [p[0] for p in pts], [0.0] + [p[1] for p in pts]
            cax.step(xs_, ys_, where="post", label=f"{processes.get(pid, pid)} bytes in flight", lw=1)
        cax.set_xlim(0, span_us / scale * 1.01)
        cax.set_ylabel("bytes", fontsize=8)
        cax.legend(fontsize=7, loc="upper right")
        cax.grid(alpha=0.3)
        cax.set_xlabel(f"time since trace start ({unit})", fontsize=8)
    fig.tight_layout()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target
