"""The `tinydist` command line, and its one error boundary.

A user error never shows a traceback. `main` maps what goes wrong to one line on stderr,
`tinydist COMMAND: error: MESSAGE`, and an exit code scripts can rely on:

    0    success
    1    a runtime failure: a TinydistError, an OSError (a file, a port in use), a missing extra
    2    a usage error: a bad flag or value, a bad input file, a bad TINYDIST_* variable (as argparse)
    130  interrupted (Ctrl-C); 141 when stdout was closed under us (`tinydist ... | head`), silently

Anything else is a bug in tinydist: its traceback is shown, with a line asking for a report.
`--traceback` (or `--log-level debug`, TINYDIST_LOG_LEVEL=debug) shows the traceback of a user
error too, for a bug report. Commands raise; they do not print their own errors.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tomllib
import traceback
from collections.abc import Sequence
from importlib import import_module, metadata
from pathlib import Path

from tinydist.base import logs
from tinydist.base.config import SettingError
from tinydist.base.errors import TinydistError

EXIT_FAILURE, EXIT_USAGE = 1, 2
EXIT_INTERRUPTED = 128 + signal.SIGINT
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE

# A module an optional extra provides (top-level import name) -> the extra that installs it.
_EXTRAS = {"onnx": "onnx", "onnxruntime": "onnx", "matplotlib": "plot", "sklearn": "examples", "torch": "bench"}


def version() -> str:
    """This code's version. A source checkout (pyproject.toml two folders above this package, as with
    PYTHONPATH=<repo> or `pip install -e .`) reads it from pyproject.toml, since an installed
    distribution of the same name may be another copy; an installed wheel reads its metadata."""
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if pyproject.is_file():
        project = tomllib.loads(pyproject.read_text()).get("project", {})
        if project.get("name") == "tinydist":
            return f"{project['version']} (source checkout {pyproject.parent})"
    return metadata.version("tinydist")


def _devices(args: argparse.Namespace) -> int:
    from tinydist.runtime.registry import discover
    infos = discover()
    width = max(len(info.name) for info in infos)
    for info in infos:
        status = "ok " if info.usable else "n/a"
        print(f"{info.name:<{width}}  {status}  {info.detail}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from tinydist.cli.demo import main
    main()
    return 0


# Modules contributing subcommands, each with `add_commands(subparsers)`.
_COMMAND_MODULES = ("tinydist.cli.infer", "tinydist.cli.remote", "tinydist.cli.dist", "tinydist.cli.profile",
                    "tinydist.cli.cluster")


def _leaf_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every parser of a runnable command (those with no subcommands of their own)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [parser]
    return [leaf for action in subs for child in dict.fromkeys(action.choices.values()) for leaf in _leaf_parsers(child)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tinydist", description="asyncio-native distributed tensor runtime",
                                     epilog="exit codes: 0 ok, 1 runtime failure, 2 usage error, 130 interrupted")
    parser.add_argument("--version", action="version", version=f"tinydist {version()}")
    parser.add_argument("--log-format", choices=["console", "json"], help="log rendering (default: TINYDIST_LOG_FORMAT or console)")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                        help="lowest level printed (default: TINYDIST_LOG_LEVEL or warning)")
    parser.add_argument("--traceback", "--debug", dest="traceback", action="store_true",
                        help="show the traceback of an error (for a bug report); so does --log-level debug")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("devices", help="list usable devices, and why others cannot open").set_defaults(run=_devices)
    commands.add_parser("demo", help="run the demo job on local CPU devices").set_defaults(run=_demo)
    for module in _COMMAND_MODULES:  # each adds its own subcommands; imported only to build the parser
        import_module(module).add_commands(commands)
    for leaf in _leaf_parsers(parser):   # a command reports a usage error with its own parser: args.parser.error
        leaf.set_defaults(parser=leaf)
    return parser


def _message(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:     # "[Errno 2] No such file or directory: 'x'" -> "x: No such file ..."
        name = exc.filename if exc.filename is not None else ""
        return f"{name}: {exc.strerror}" if name else exc.strerror
    return str(exc) or type(exc).__name__


def _missing_extra(exc: ImportError) -> str | None:
    """The pip line for an optional package that is not installed (the error or its cause names it)."""
    names = [e.name for e in (exc, exc.__cause__) if isinstance(e, ImportError) and e.name]
    top = names[0].partition(".")[0] if names else ""
    extra = _EXTRAS.get(top)
    return None if extra is None else f"this needs the {top!r} package: pip install 'tinydist[{extra}]'"


def _wants_traceback(args: argparse.Namespace | None) -> bool:
    if args is not None and (args.traceback or args.log_level == "debug"):
        return True
    return os.environ.get("TINYDIST_LOG_LEVEL", "").strip().lower() == "debug"


def _quiet_stdout() -> None:
    """stdout's reader is gone: point it at /dev/null so the interpreter's final flush is silent."""
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), sys.stdout.fileno())


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args: argparse.Namespace | None = None
    prog = "tinydist"
    try:
        args = parser.parse_args(argv)
        prog = args.parser.prog
        try:
            logs.configure(args.log_format, args.log_level)
        except SettingError as exc:
            args.parser.error(str(exc))
        code = int(args.run(args) or 0)
        sys.stdout.flush()      # a closed pipe shows here, inside the boundary
        return code
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (TinydistError, OSError, ImportError) as exc:
        message = _missing_extra(exc) if isinstance(exc, ImportError) else _message(exc)
        if message is None:     # a module tinydist itself needs is missing: a broken install, a bug
            raise
        if _wants_traceback(args):
            traceback.print_exc()
        print(f"{prog}: error: {message}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, SettingError) else EXIT_FAILURE
    except Exception:
        traceback.print_exc()
        print(f"{prog}: this is a bug in tinydist, not in how it was called; please report it with the "
              "command line and the traceback above", file=sys.stderr)
        return EXIT_FAILURE
