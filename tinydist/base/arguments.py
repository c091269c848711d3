"""argparse `type=` validators for the CLI's numbers and addresses: a bad value is a usage error
(exit 2) whose message names the flag and the value, never a traceback from deep inside a command."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def integer(minimum: int) -> Callable[[str], int]:
    """A whole number of at least `minimum` (a count: 1, an index or a count that may be zero: 0)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    return parse


def seconds(text: str) -> float:
    """A duration: a number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text!r}")
    return value


def port(text: str) -> int:
    """A TCP port, 0-65535 (0: pick a free one, where the command allows it)."""
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {text!r}")
    return int(text)


def endpoint(text: str) -> tuple[str, int]:
    """HOST:PORT ([::1]:PORT for IPv6) as (host without brackets, port)."""
    host, sep, number = text.rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), port(number)
