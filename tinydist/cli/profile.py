"""`tinydist profile`: trace a whole program, summarise it, draw it; merge per-rank traces.

    tinydist profile script.py [args ...]                  # writes tinydist-trace.json, prints a summary
    tinydist profile -o run.json --png run.png script.py   # also a Gantt chart (needs matplotlib)
    tinydist profile -m package.module [args ...]          # a module, like python -m
    tinydist profile --merge all.json run.rank0.json run.rank1.json
    tinydist profile --from all.json --png all.png         # summarise / draw a saved trace
    tinydist profile --from run.json --png run.png --zoom last   # and a panel over the last batch
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any


def _load_trace(args: argparse.Namespace, path: str | os.PathLike[str]) -> dict[str, Any]:
    """A saved trace, or a usage error naming the file and why it is not one."""
    from tinydist.observability import chrome
    try:
        data = chrome.load(path)
    except OSError as e:
        args.parser.error(f"{path}: {e.strerror}")
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        args.parser.error(f"{path} is not a trace: not JSON ({e})")
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        args.parser.error(f"{path} is not a trace: no traceEvents list (write one with `tinydist profile` or TINYDIST_TRACE)")
    return data


def _check_target(args: argparse.Namespace) -> None:
    """The script or module exists, else a usage error naming it (as `python nosuch.py` would)."""
    import importlib.util
    if args.module:
        try:
            found = importlib.util.find_spec(args.script) is not None
        except ImportError:    # a parent package is missing
            found = False
        if not found:
            args.parser.error(f"-m {args.script}: no module named {args.script!r}")
    elif not os.path.isfile(args.script):
        args.parser.error(f"{args.script}: no such script")


def _profile(args: argparse.Namespace) -> int:
    from tinydist.observability import chrome, tracing

    if args.merge:
        if len(args.merge) < 2:
            args.parser.error("--merge OUT IN [IN ...]: give the output and at least one input")
        out, *inputs = args.merge
        for path in inputs:
            _load_trace(args, path)
        merged = chrome.merge_files(out, inputs)
        data = chrome.load(merged)
        print(f"merged {len(inputs)} trace(s) into {merged} ({len(data['traceEvents'])} events)")
        _report(data, args)
        return 0
    if args.source is not None:
        _report(_load_trace(args, args.source), args)
        return 0
    if args.script is None:
        args.parser.error("give a script (or -m MODULE), --from TRACE or --merge OUT IN...")
    _check_target(args)

    code: Any = 0
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    tracer = tracing.start()
    try:
        if args.module:
            sys.argv = [args.script, *args.args]
            runpy.run_module(args.script, run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(args.script)
            sys.argv = [script, *args.args]
            sys.path.insert(0, os.path.dirname(script))
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        tracing.stop(tracer, wait=True)
        written = tracer.write(args.output)
        dropped = f", {tracer.dropped} dropped (raise TINYDIST_TRACE_MAX_EVENTS)" if tracer.dropped else ""
        print(f"\ntinydist profile: trace written to {written} ({tracer.events} events{dropped}); "
              f"open it in https://ui.perfetto.dev or chrome://tracing", file=sys.stderr)
    _report(json.loads(Path(written).read_text()), args)
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def _report(data: dict[str, Any], args: argparse.Namespace) -> None:
    from tinydist.observability import report
    if not args.no_summary:
        print(report.format_summary(data, top=args.top))
    if args.png is not None:
        zoom = args.zoom
        if zoom == "last":
            try:
                zoom = report.last_batch_window(data)
            except ValueError as e:
                args.parser.error(f"--zoom last: {e}")
        path = report.plot_gantt(data, args.png, title=args.title, zoom=zoom)
        print(f"Gantt chart written to {path}", file=sys.stderr)


def _zoom(text: str) -> str | tuple[float, float]:
    """`last`, or START:END in ms since the first event → µs."""
    if text == "last":
        return text
    start, sep, end = text.partition(":")
    try:
        lo, hi = float(start), float(end)
    except ValueError:
        lo = hi = -1.0
    if not sep or not 0 <= lo < hi:
        raise argparse.ArgumentTypeError(f"--zoom wants START:END in ms with 0 <= START < END (e.g. 250:251.5) or "
                                         f"`last`, got {text!r}")
    return lo * 1e3, hi * 1e3


def add_commands(subparsers: Any) -> None:
    parser = subparsers.add_parser("profile", help="trace a program's device work; summary table, Gantt PNG, merge ranks",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-o", "--output", type=Path, default=Path("tinydist-trace.json"),
                        help="trace file to write (default tinydist-trace.json; .rank{N} is added under tinydist launch)")
    parser.add_argument("--png", type=Path, metavar="PNG", help="also draw the lanes as a Gantt chart (needs matplotlib)")
    parser.add_argument("--title", help="title of the Gantt chart")
    parser.add_argument("--zoom", type=_zoom, metavar="START:END|last",
                        help="with --png, a second panel over START:END (ms since the first event) or the last batch")
    parser.add_argument("--no-summary", action="store_true", help="do not print the summary table")
    parser.add_argument("--top", type=int, default=20, help="rows of the per-kernel table (default 20)")
    parser.add_argument("-m", dest="module", action="store_true", help="SCRIPT is a module name, run like python -m")
    parser.add_argument("--merge", nargs="+", metavar="FILE", help="OUT IN [IN ...]: merge per-rank traces onto one clock")
    parser.add_argument("--from", dest="source", type=Path, metavar="TRACE", help="summarise (and --png) a saved trace")
    parser.add_argument("script", nargs="?", help="the Python script (or module with -m) to run under tracing")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    parser.set_defaults(run=_profile)
