"""Chrome Trace Event Format: building it from a Tracer, merging per-rank files, checking it.

Layout (opens in Perfetto, ui.perfetto.dev, and chrome://tracing):

- one process per device (`CPU:0`, …) and one per named span process (a rank, a node);
- one thread lane per queue (`compute`, `copy`), then `host sync` lanes (host threads waiting on
  that device's timelines) and one lane per span lane, split into `lane 2`, `lane 3`, … where
  spans overlap, so every lane nests properly;
- complete events (`ph: "X"`) only: a `batch N` event per submission, and inside it one event per
  command (a kernel by its label, `add+max 8x16x4x4 f32`, its symbol in the args; `copy` with its
  bytes; `wait <timeline>@<value>`; host callables);
- flow arrows (`ph: "s"` → `ph: "f"`, one id per arrow) from the batch that signalled a timeline
  value to each wait — on a queue or on the host — that it released;
- a `bytes in flight` counter (`ph: "C"`) per device, from its copies;
- `otherData.tinydist`: the clock origin (monotonic and wall ns), host and rank, for `merge`.

Timestamps are microseconds since the tracer started, from `time.perf_counter_ns`.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tinydist.observability.tracing import Tracer

FORMAT_VERSION = 1
QUEUE_ORDER = {"compute": 1, "copy": 2}
CATEGORIES = ("kernel", "copy", "wait", "host", "host sync", "compile", "schedule", "python", "collective", "transport",
              "rpc", "scheduler", "span")


def _us(ns: int) -> float:
    return round(ns / 1000.0, 3)


def _command_event(fn: Any, args: tuple[Any, ...], copy_fn: Any,
                   symbol_events: dict[str, tuple[str, str, dict[str, Any]]]) -> tuple[str, str, dict[str, Any]]:
    """(name, category, args) of one queue command. `symbol_events`: the export's kernel events
    that depend on the symbol alone, built once per symbol (a trace repeats a few kernels many
    times; looking their labels up per event made `trace/export` 1.7x slower)."""
    if copy_fn is not None and fn is copy_fn:
        return "copy", "copy", {"bytes": int(args[2])}
    target = getattr(fn, "__self__", None)
    if getattr(fn, "__func__", None) is not None and fn.__func__ is _wait_blocking() and target is not None:
        return f"wait {target.name}@{args[0]}", "wait", {"timeline": target.name, "target": int(args[0])}
    name = getattr(fn, "__name__", None)
    if name is not None and hasattr(fn, "argtypes"):  # a native kernel (ctypes function)
        event = symbol_events.get(name) or _call_event(name, args)
        if event is None:
            event = symbol_events[name] = _symbol_event(name)
        return event
    qualname = getattr(fn, "__qualname__", None) or name or type(fn).__name__
    return qualname, "host", {}


def _call_event(symbol: str, args: tuple[Any, ...]) -> tuple[str, str, dict[str, Any]] | None:
    """The event of a kernel whose shape is in the call's arguments, None for any other. The
    matmul kernel is one program for every shape (`engine.commands.lower_call`: out, a, b,
    workspace, batch, m, n, k, …); the command interpreter's count is its last argument."""
    if symbol.startswith("tinydist_matmul_") and len(args) >= 8:
        batch, m, n, k = (int(a) for a in args[4:8])
        dtype = _MATMUL_DTYPES.get(symbol.split("_")[2], symbol.split("_")[2])
        shape = f"{m}x{k}x{n}" if batch == 1 else f"{batch}x{m}x{k}x{n}"
        strided = " strided" if "_strided_" in symbol else ""
        return (f"matmul {shape} {dtype}{strided}", "kernel",
                {"program": symbol, "op": "matmul", "batch": batch, "m": m, "k": k, "n": n, "dtype": dtype})
    if symbol == "tinydist_commands" and args and isinstance(args[-1], int):   # engine.lowered's interpreter
        return f"{args[-1]} kernels (one native call)", "kernel", {"program": symbol, "kernels": args[-1]}
    return None


def _symbol_event(symbol: str) -> tuple[str, str, dict[str, Any]]:
    """The event of a kernel compiled for one shape: its label, or its symbol if it has none."""
    from tinydist.runtime.program import LABELS
    label = LABELS.get(symbol)
    if label is None:
        return symbol, "kernel", {"program": symbol}
    ops, _, rest = label.partition(" ")
    shape, _, dtype = rest.rpartition(" ")
    return label, "kernel", {"program": symbol, "ops": ops, "shape": shape, "dtype": dtype}


_MATMUL_DTYPES = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16", "int32": "i32", "int64": "i64"}
_WAIT: Any = None


def _wait_blocking() -> Any:
    global _WAIT
    if _WAIT is None:
        from tinydist.runtime.timeline import Timeline
        _WAIT = Timeline.wait_blocking
    return _WAIT


def _device_sort_key(name: str) -> tuple[Any, ...]:
    kind, _, index = name.partition(":")
    return (0, kind, int(index)) if index.isdigit() else (0, kind, 1 << 30, index)


def _partition(intervals: list[tuple[int, int, Any]]) -> list[tuple[int, Any]]:
    """Interval partitioning: (sub-lane, item) so no two items on one sub-lane overlap."""
    ends: list[int] = []
    out = []
    for start, end, item in sorted(intervals, key=lambda x: (x[0], -x[1])):
        for lane, last in enumerate(ends):
            if last <= start:
                ends[lane] = end
                out.append((lane, item))
                break
        else:
            ends.append(end)
            out.append((len(ends) - 1, item))
    return out


def build(tracer: Tracer, rank: int | None = None) -> dict[str, Any]:
    from tinydist.observability.tracing import host_name

    origin = tracer.origin_ns
    events: list[dict[str, Any]] = []
    meta: list[dict[str, Any]] = []

    devices = {info.device for info, *_ in tracer.batches} | {w[0] for w in tracer.host_waits}
    processes = sorted(devices, key=_device_sort_key) + sorted({s[0] for s in tracer.spans} - devices)
    pid_of = {name: i + 1 for i, name in enumerate(processes)}
    lanes: dict[str, dict[str, int]] = defaultdict(dict)  # process -> lane name -> tid

    def tid(process: str, lane: str) -> int:
        table = lanes[process]
        if lane not in table:
            table[lane] = QUEUE_ORDER.get(lane, 10 + len(table))
        return table[lane]

    # batches and their commands; where each (timeline, value) was signalled
    signalled: dict[tuple[str, int], tuple[int, int, float]] = {}  # -> (pid, tid, ts of the signal)
    copies: dict[int, list[tuple[int, int]]] = defaultdict(list)
    waits: list[tuple[int, int, float, str, int]] = []  # (pid, tid, ts of the release, timeline, value)
    symbol_events: dict[str, tuple[str, str, dict[str, Any]]] = {}
    for info, value, start, end, failed, timed in sorted(tracer.batches, key=lambda b: b[2]):
        pid, t = pid_of[info.device], tid(info.device, info.kind)
        common = {"device": info.device, "queue": info.kind, "timeline": info.timeline, "value": value}
        ts, dur = _us(start - origin), _us(end - start)
        events.append({"ph": "X", "name": f"batch {value}", "cat": "batch", "pid": pid, "tid": t, "ts": ts, "dur": dur,
                       "args": dict(common, commands=len(timed), failed=failed)})
        if not failed:
            signalled[(info.timeline, value)] = (pid, t, max(ts, round(ts + dur - 0.001, 3)))
        for c_start, c_end, fn, args in timed:
            name, cat, extra = _command_event(fn, args, info.copy_fn, symbol_events)
            c_ts, c_dur = _us(c_start - origin), _us(c_end - c_start)
            events.append({"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": t, "ts": c_ts,
                           "dur": c_dur, "args": dict(common, **extra)})
            if cat == "copy":
                copies[pid].append((c_start, extra["bytes"]))
                copies[pid].append((c_end, -extra["bytes"]))
            elif cat == "wait":
                waits.append((pid, t, max(c_ts, round(c_ts + c_dur - 0.0005, 4)), extra["timeline"], extra["target"]))

    # host syncs: per device, lanes split so they nest
    by_device: dict[str, list[tuple[int, int, Any]]] = defaultdict(list)
    for w in tracer.host_waits:
        by_device[w[0]].append((w[3], w[4], w))
    for intervals in by_device.values():
        for sub, (dev, timeline, value, start, end, thread, ok) in _partition(intervals):
            pid, t = pid_of[dev], tid(dev, "host sync" if sub == 0 else f"host sync {sub + 1}")
            ts, dur = _us(start - origin), _us(end - start)
            events.append({"ph": "X", "name": f"sync {timeline}@{value}", "cat": "host sync", "pid": pid, "tid": t,
                           "ts": ts, "dur": dur,
                           "args": {"device": dev, "timeline": timeline, "target": value, "thread": thread, "ok": ok}})
            waits.append((pid, t, max(ts, round(ts + dur - 0.0005, 4)), timeline, value))

    # spans
    by_lane: dict[tuple[str, str], list[tuple[int, int, Any]]] = defaultdict(list)
    for s in tracer.spans:
        by_lane[(s[0], s[1])].append((s[4], s[5], s))
    for (process, lane), intervals in sorted(by_lane.items()):
        for sub, (_, _, name, cat, start, end, args) in _partition(intervals):
            pid, t = pid_of[process], tid(process, lane if sub == 0 else f"{lane} {sub + 1}")
            events.append({"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": t, "ts": _us(start - origin),
                           "dur": _us(end - start), "args": {k: _jsonable(v) for k, v in args.items()}})

    # flows: the batch that signalled a value → each wait it released
    flow_id = 0
    for pid, t, ts, timeline, value in waits:
        source = signalled.get((timeline, value))
        if source is None:
            continue  # signalled before tracing started
        flow_id += 1
        s_pid, s_tid, s_ts = source
        events.append({"ph": "s", "name": "signal", "cat": "flow", "id": flow_id, "pid": s_pid, "tid": s_tid, "ts": s_ts})
        events.append({"ph": "f", "bp": "e", "name": "signal", "cat": "flow", "id": flow_id, "pid": pid, "tid": t, "ts": ts})

    # counters: bytes in flight per device
    for pid, points in copies.items():
        level = 0
        for when, delta in sorted(points, key=lambda p: (p[0], p[1])):
            level += delta
            events.append({"ph": "C", "name": "bytes in flight", "cat": "copy", "pid": pid, "ts": _us(when - origin),
                           "args": {"bytes": level}})

    for process, pid in pid_of.items():
        meta.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": process}})
        meta.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for lane, t in lanes[process].items():
            meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": t, "args": {"name": lane}})
            meta.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": t, "args": {"sort_index": t}})

    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ns",
        "otherData": {"tinydist": {
            "version": FORMAT_VERSION, "clock": "CLOCK_MONOTONIC (time.perf_counter_ns)",
            "origin_monotonic_ns": origin, "origin_wall_ns": tracer.origin_wall_ns, "host": host_name(),
            "rank": rank, "pid": os.getpid(), "events": tracer.events, "dropped": tracer.dropped}},
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    data = json.loads(Path(path).read_text())
    if isinstance(data, list):  # the JSON Array Format
        data = {"traceEvents": data}
    return data


# ---- merging ranks -------------------------------------------------------------------------------

PID_STRIDE = 1000


def merge(traces: Sequence[dict[str, Any]], labels: Sequence[str] | None = None) -> dict[str, Any]:
    """Combine traces (one per rank) onto one clock.

    Files from one host share CLOCK_MONOTONIC: each is shifted by the difference of its origin to
    the earliest one. Files from several hosts are aligned on their wall-clock origins instead
    (as good as the hosts' clock sync). Processes are renumbered (file i: pid + i·1000) and named
    `rank{N} <name>`; flow ids are renumbered so arrows stay within their file."""
    infos = [t.get("otherData", {}).get("tinydist", {}) for t in traces]
    one_host = len({i.get("host") for i in infos}) == 1 and all("origin_monotonic_ns" in i for i in infos)
    key = "origin_monotonic_ns" if one_host else "origin_wall_ns"
    origins = [i.get(key) for i in infos]
    known = [o for o in origins if o is not None]
    base = min(known) if known else 0
    out: list[dict[str, Any]] = []
    next_flow = 0
    for n, (trace, info) in enumerate(zip(traces, infos)):
        shift = ((origins[n] - base) / 1000.0) if origins[n] is not None else 0.0
        label = labels[n] if labels else (f"rank{info['rank']}" if info.get("rank") is not None else f"file{n}")
        flow_map: dict[Any, int] = {}
        for event in trace["traceEvents"]:
            e = dict(event)
            if "pid" in e and isinstance(e["pid"], int):
                e["pid"] = e["pid"] + n * PID_STRIDE
            if "ts" in e:
                e["ts"] = round(e["ts"] + shift, 3)
            if e.get("ph") == "M" and e.get("name") == "process_name":
                name = e["args"].get("name", "")     # a rank's own lane ("rank0") is not named twice
                e["args"] = {"name": name if name == label or name.startswith(f"{label} ") else f"{label} {name}".strip()}
            if e.get("ph") == "M" and e.get("name") == "process_sort_index":
                e["args"] = {"sort_index": e["args"].get("sort_index", 0) + n * PID_STRIDE}
            if e.get("ph") in ("s", "t", "f"):
                if e["id"] not in flow_map:
                    next_flow += 1
                    flow_map[e["id"]] = next_flow
                e["id"] = flow_map[e["id"]]
            out.append(e)
    return {"traceEvents": out, "displayTimeUnit": "ns",
            "otherData": {"tinydist": {"version": FORMAT_VERSION, "merged": [
                dict(info, label=labels[n] if labels else None, shift_us=((origins[n] - base) / 1000.0) if origins[n] is not None else 0.0)
                for n, info in enumerate(infos)], "aligned_on": key}}}


def merge_files(out: str | os.PathLike[str], inputs: Iterable[str | os.PathLike[str]]) -> Path:
    traces = [load(p) for p in inputs]
    merged = merge(traces)
    target = Path(out)
    target.write_text(json.dumps(merged, separators=(",", ":")))
    return target


# ---- checking ------------------------------------------------------------------------------------

PHASES = {"X", "B", "E", "C", "M", "s", "t", "f", "i", "I"}


def validate(trace: dict[str, Any]) -> list[str]:
    """Problems with `trace` as Trace Event Format ([] if none): required fields per phase, B/E
    balance per lane, proper nesting of complete events per lane, and flows whose both ends lie
    inside a complete event on their lane."""
    problems: list[str] = []
    events = trace.get("traceEvents")
    if not isinstance(events, list):
        return ["traceEvents is not a list"]
    slices: dict[tuple[Any, Any], list[tuple[float, float, str]]] = defaultdict(list)
    open_b: dict[tuple[Any, Any], list[str]] = defaultdict(list)
    flows: dict[Any, dict[str, dict[str, Any]]] = defaultdict(dict)
    for i, e in enumerate(events):
        ph = e.get("ph")
        if ph not in PHASES:
            problems.append(f"event {i}: unknown phase {ph!r}")
            continue
        if "name" not in e or "pid" not in e:
            problems.append(f"event {i}: missing name or pid")
        if ph != "M" and not isinstance(e.get("ts"), (int, float)):
            problems.append(f"event {i} ({e.get('name')}): missing numeric ts")
        lane = (e.get("pid"), e.get("tid"))
        if ph == "X":
            if not isinstance(e.get("dur"), (int, float)) or e["dur"] < 0:
                problems.append(f"event {i} ({e.get('name')}): X without a non-negative dur")
                continue
            slices[lane].append((e["ts"], e["ts"] + e["dur"], e["name"]))
        elif ph == "B":
            open_b[lane].append(e["name"])
        elif ph == "E":
            if not open_b[lane]:
                problems.append(f"event {i}: E without B on lane {lane}")
            else:
                open_b[lane].pop()
        elif ph == "C":
            if not isinstance(e.get("args"), dict) or not all(isinstance(v, (int, float)) for v in e["args"].values()):
                problems.append(f"event {i}: counter without numeric args")
        elif ph in ("s", "f", "t"):
            if "id" not in e:
                problems.append(f"event {i}: flow without id")
            else:
                flows[e["id"]][ph] = e
    for lane, names in open_b.items():
        if names:
            problems.append(f"lane {lane}: B without E: {names}")
    eps = 1e-3
    for lane, spans in slices.items():
        stack: list[tuple[float, float, str]] = []
        for start, end, name in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1][1] <= start + eps:
                stack.pop()
            if stack and end > stack[-1][1] + eps:
                problems.append(f"lane {lane}: {name} [{start}, {end}] overlaps {stack[-1][2]} [{stack[-1][0]}, {stack[-1][1]}] without nesting")
            stack.append((start, end, name))
    for fid, ends in flows.items():
        if "s" not in ends or "f" not in ends:
            problems.append(f"flow {fid}: has {sorted(ends)} (needs s and f)")
            continue
        for ph, e in ends.items():
            lane = (e["pid"], e.get("tid"))
            if not any(s - eps <= e["ts"] <= t + eps for s, t, _ in slices.get(lane, ())):
                problems.append(f"flow {fid}: {ph} at {e['ts']} on lane {lane} is inside no slice")
        if ends["f"]["ts"] + eps < ends["s"]["ts"]:
            problems.append(f"flow {fid}: ends before it starts")
    return problems
