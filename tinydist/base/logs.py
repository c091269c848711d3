"""Structured logging: readable console lines by default, JSON lines on request.

Every logger carries the ids of what it speaks for (device, queue, timeline), bound once where
the object is made, so each record can be filtered by them.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

from tinydist.base.config import SettingError, settings

_configured: tuple[str, str] | None = None


class _CurrentStderr:
    """Writes to whatever `sys.stderr` is at the time of the write (it is replaced by test
    runners, daemons and notebooks after loggers are configured)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure(log_format: str | None = None, level: str | None = None) -> None:
    """(Re)configure rendering; arguments default to TINYDIST_LOG_FORMAT / TINYDIST_LOG_LEVEL."""
    global _configured
    log_format = log_format or settings.LOG_FORMAT
    level = level or settings.LOG_LEVEL
    if log_format not in ("console", "json"):
        raise ValueError(f"log format must be 'console' or 'json', got {log_format!r}")
    renderer: Any = (structlog.processors.JSONRenderer() if log_format == "json"
                     else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),  # type: ignore[arg-type]  # it writes and flushes only
        cache_logger_on_first_use=False,
    )
    _configured = (log_format, level)


def rendering() -> str:
    """"console" or "json": how records are rendered now (for code that prints lines of its own beside them)."""
    if _configured is None:
        get_logger()
    assert _configured is not None
    return _configured[0]


def get_logger(**ids: Any) -> structlog.typing.FilteringBoundLogger:
    """A logger bound to `ids` (e.g. device="CPU:1", queue="compute")."""
    if _configured is None:
        try:
            configure()
        except SettingError as exc:     # at import time: a bad variable must not make `import tinydist` fail
            configure("console", "warning")
            structlog.get_logger("tinydist").warning(f"{exc}; logging to the console at warning level")
    return structlog.get_logger("tinydist").bind(**ids)
