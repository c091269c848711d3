"""The audit trail: one structured (JSON lines) record per decision and per side effect.

Every RPC ends in exactly one `decision` record (identity, method, status, reason, peer
fingerprint); every side effect (allocation, free, write, copy, launch, program load, token mint,
reset, BAR write, lease release) adds one `effect` record. Payloads and tokens are never passed
here: records carry sizes and opaque ids only (handles as an 8-hex-digit prefix of their sha256).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import threading
import time
from json.encoder import encode_basestring_ascii
from pathlib import Path
from typing import Any, TextIO

_FORBIDDEN = frozenset({"token", "data", "payload", "llvm_ir", "key"})
_dumps = functools.partial(json.dumps, sort_keys=True, default=repr)
_CACHED_PARTS = 4096  # distinct (identity, fingerprint, method, status, reason) a decision line's parts are kept for


def _json(value: str | None) -> str:
    """`value` as json.dumps writes it (ASCII, escaped), `null` for None."""
    return "null" if value is None else encode_basestring_ascii(value)


class _Clock:
    """The records' timestamps, ISO 8601 UTC with microseconds and `Z`: the date and time of day
    formatted once a second, the microseconds appended (a `datetime.now().isoformat()` a record
    was ~3 us)."""

    def __init__(self) -> None:
        self._formatted = (-1, "")  # (second, its date and time): one tuple, replaced whole (threads)

    def stamp(self) -> str:
        second, micros = divmod(time.time_ns() // 1000, 1_000_000)
        formatted = self._formatted
        if formatted[0] != second:
            formatted = self._formatted = (second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)))
        return f"{formatted[1]}.{micros:06d}Z"


def handle_tag(handle: bytes) -> str:
    """A short non-reversible tag for a handle, so records can be correlated without leaking it."""
    return hashlib.sha256(handle).hexdigest()[:8]


class AuditLog:
    """JSON lines, one record each: `audit`, `event` (decision / effect), `level`, `timestamp` (ISO 8601,
    UTC, microseconds, `Z`), and the record's fields, keys sorted — the lines structlog's JSONRenderer
    wrote, built here with one `json.dumps` (through structlog's processor chain a record cost ~70
    Python function calls). Every record is written when it is made, one `write(2)` of the whole line
    to a file opened O_APPEND (so lines from several writers never interleave), never held in a buffer:
    a record exists before the call it records has answered.

    A decision (one per RPC) is built from parts kept per (identity, fingerprint, method, status,
    reason) and the peer and timestamp of this call: the same bytes `json.dumps` writes
    (tests/remote/test_audit_lines.py), ~1.5 us instead of ~8 for the dict and the encoder."""

    def __init__(self, sink: str | Path | TextIO | None = None) -> None:
        self._lock = threading.Lock()
        self._clock = _Clock()
        self._parts: dict[tuple[str | None, str | None, str, str, str], tuple[str, str]] = {}
        self._fd: int | None = None
        self._file: TextIO | None = None
        if sink is None or sink == "-":
            self._file = sys.stderr
        elif isinstance(sink, (str, Path)):
            self._fd = os.open(sink, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o666)
        else:
            self._file = sink

    def _write(self, line: str) -> None:
        with self._lock:
            if self._fd is None:
                if self._file is None:
                    raise ValueError("the audit log is closed")
                self._file.write(line + "\n")
                return
            data = (line + "\n").encode()
            while data:
                data = data[os.write(self._fd, data):]

    def _emit(self, event: str, fields: dict[str, Any]) -> None:
        leaked = _FORBIDDEN & fields.keys()
        if leaked:  # a programming error; refuse loudly instead of writing a secret
            raise ValueError(f"audit record may not carry {sorted(leaked)}")
        self._write(_dumps({**fields, "audit": "tinydist.remote", "event": event, "level": "info",
                            "timestamp": self._clock.stamp()}))

    def decision(self, *, identity: str | None, method: str, status: str, reason: str,
                 fingerprint: str | None = None, peer: str | None = None) -> None:
        key = (identity, fingerprint, method, status, reason)
        parts = self._parts.get(key)
        if parts is None:
            # keys sorted: audit, event, fingerprint, identity, level, method | peer | reason, status, timestamp
            parts = (f'{{"audit": "tinydist.remote", "event": "decision", "fingerprint": {_json(fingerprint)}, '
                     f'"identity": {_json(identity)}, "level": "info", "method": {_json(method)}, "peer": ',
                     f', "reason": {_json(reason)}, "status": {_json(status)}, "timestamp": "')
            if len(self._parts) >= _CACHED_PARTS:
                self._parts.clear()
            self._parts[key] = parts
        self._write(f'{parts[0]}{_json(peer)}{parts[1]}{self._clock.stamp()}"}}')

    def effect(self, *, identity: str | None, method: str, action: str, **details: Any) -> None:
        self._emit("effect", {"identity": identity, "method": method, "action": action, **details})

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self._file = None
