"""`tinydist launch`: the command-line side of tinydist.dist (registered by tinydist.cli)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any


def _launch(args: argparse.Namespace) -> int:
    from tinydist.dist.launcher import run
    from tinydist.observability import tracing
    env = dict(os.environ)
    # `tinydist --log-format json --log-level info launch ...` is meant for the ranks too
    if args.log_format is not None:
        env["TINYDIST_LOG_FORMAT"] = args.log_format
    if args.log_level is not None:
        env["TINYDIST_LOG_LEVEL"] = args.log_level
    trace = tracing.take_environment_trace()   # TINYDIST_TRACE names the ranks' trace, not this process's
    code = run(args, env)
    if trace is not None:
        _merge_rank_traces(trace, range(args.node_rank * args.nproc, (args.node_rank + 1) * args.nproc))
    return code


def _merge_rank_traces(path: Path, ranks: range) -> None:
    """Merge the traces this node's ranks wrote (`path.rankN.json`) into `path`, so one file opens
    the whole job in Perfetto; a rank that died before writing is named, not silently missing."""
    from tinydist.observability import chrome
    from tinydist.observability.tracing import rank_path
    written = {r: rank_path(path, r).is_file() for r in ranks}
    found = [rank_path(path, r) for r, ok in written.items() if ok]
    missing = [r for r, ok in written.items() if not ok]
    if not found:
        print(f"tinydist launch: no rank wrote a trace ({rank_path(path, ranks.start)} …); nothing merged",
              file=sys.stderr)
        return
    chrome.merge_files(path, found)
    note = f"; rank(s) {', '.join(map(str, missing))} wrote none" if missing else ""
    print(f"tinydist launch: merged {len(found)} rank trace(s) into {path}{note}", file=sys.stderr)


def add_commands(subparsers: Any) -> None:
    from tinydist.dist import launcher as launch
    parser = subparsers.add_parser("launch", help="start the ranks of a tinydist.dist job (torchrun's flags), "
                                   "output prefixed by rank", description=launch.__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    launch.add_arguments(parser)
    parser.set_defaults(run=_launch)
