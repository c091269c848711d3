"""`tinydist launch`: the command-line side of tinydist.dist (registered by tinydist.cli)."""

from __future__ import annotations

import argparse
import os
from typing import Any


def _launch(args: argparse.Namespace) -> int:
    from tinydist.dist.launcher import run
    env = dict(os.environ)
    # `tinydist --log-format json --log-level info launch ...` is meant for the ranks too
    if args.log_format is not None:
        env["TINYDIST_LOG_FORMAT"] = args.log_format
    if args.log_level is not None:
        env["TINYDIST_LOG_LEVEL"] = args.log_level
    return run(args, env)


def add_commands(subparsers: Any) -> None:
    from tinydist.dist import launcher as launch
    parser = subparsers.add_parser("launch", help="start the ranks of a tinydist.dist job (torchrun's flags), "
                                   "output prefixed by rank", description=launch.__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    launch.add_arguments(parser)
    parser.set_defaults(run=_launch)
