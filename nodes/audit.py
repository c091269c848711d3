"""The audit trail: one structured (JSON lines) record per decision and per side effect.

Every RPC ends in exactly one `decision` record (identity, method, status, reason, peer
fingerprint); every side effect (allocation, free, write, copy, launch, program load, token mint,
reset, BAR write, lease release) adds one `effect` record. Payloads and tokens are never passed
here: records carry sizes and opaque ids only (handles as an 8-hex-digit prefix of their sha256).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import sys
import threading
from pathlib import Path
from typing import Any, TextIO

_FORBIDDEN = frozenset({"token", "data", "payload", "llvm_ir", "key"})
_dumps = functools.partial(json.dumps, sort_keys=True, default=repr)


def handle_tag(handle: bytes) -> str:
    """A short non-reversible tag for a handle, so records can be correlated without leaking it."""
    return hashlib.sha256(handle).hexdigest()[:8]


class AuditLog:
    """JSON lines, one record each: `audit`, `event` (decision / effect), `level`, `timestamp` (ISO 8601,
    UTC, `Z`), and the record's fields, keys sorted — the lines structlog's JSONRenderer wrote, built
    here with one `json.dumps`: through structlog's processor chain a record cost ~70 Python function
    calls, a third of what the node's gate adds to a Ping (`bench/remote.py`)."""

    def __init__(self, sink: str | Path | TextIO | None = None) -> None:
        self._lock = threading.Lock()
        if sink is None or sink == "-":
            self._file: TextIO = sys.stderr
            self._owned = False
        elif isinstance(sink, (str, Path)):
            self._file = open(sink, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - closed in close()
            self._owned = True
        else:
            self._file = sink
            self._owned = False

    def _emit(self, event: str, fields: dict[str, Any]) -> None:
        leaked = _FORBIDDEN & fields.keys()
        if leaked:  # a programming error; refuse loudly instead of writing a secret
            raise ValueError(f"audit record may not carry {sorted(leaked)}")
        stamp = datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")
        line = _dumps({**fields, "audit": "tinydist.remote", "event": event, "level": "info", "timestamp": stamp})
        with self._lock:
            self._file.write(line + "\n")

    def decision(self, *, identity: str | None, method: str, status: str, reason: str,
                 fingerprint: str | None = None, peer: str | None = None) -> None:
        self._emit("decision", {"identity": identity, "method": method, "status": status, "reason": reason,
                                "fingerprint": fingerprint, "peer": peer})

    def effect(self, *, identity: str | None, method: str, action: str, **details: Any) -> None:
        self._emit("effect", {"identity": identity, "method": method, "action": action, **details})

    def close(self) -> None:
        if self._owned:
            self._file.close()
