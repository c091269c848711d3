"""`tinydist launch`: the command-line side of tinydist.dist (registered by tinydist.cli)."""

from __future__ import annotations

import argparse
from typing import Any


def _launch(args: argparse.Namespace) -> int:
    from tinydist.launch import run
    return run(args)


def add_commands(subparsers: Any) -> None:
    from tinydist.launch import add_arguments
    parser = subparsers.add_parser("launch", help="start N local ranks of a tinydist.dist job, output prefixed by rank")
    add_arguments(parser)
    parser.set_defaults(run=_launch)
