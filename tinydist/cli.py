"""The `tinydist` command line."""

from __future__ import annotations

import argparse
import sys
from importlib import import_module
from collections.abc import Sequence

from tinydist import logs


def _devices(args: argparse.Namespace) -> int:
    from tinydist.runtime.registry import discover
    infos = discover()
    width = max(len(info.name) for info in infos)
    for info in infos:
        status = "ok " if info.usable else "n/a"
        print(f"{info.name:<{width}}  {status}  {info.detail}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from tinydist.demo import main
    main()
    return 0


# Modules contributing subcommands, each with `add_commands(subparsers)`.
_COMMAND_MODULES = ("tinydist.cli_infer", "tinydist.cli_remote", "tinydist.cli_dist", "tinydist.cli_profile",
                    "tinydist.cli_cluster")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tinydist", description="asyncio-native distributed tensor runtime")
    parser.add_argument("--log-format", choices=["console", "json"], help="log rendering (default: TINYDIST_LOG_FORMAT or console)")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="lowest level printed")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("devices", help="list usable devices, and why others cannot open").set_defaults(run=_devices)
    commands.add_parser("demo", help="run the demo job on local CPU devices").set_defaults(run=_demo)
    for module in _COMMAND_MODULES:  # each adds its own subcommands; imported only to build the parser
        import_module(module).add_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.configure(args.log_format, args.log_level)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
