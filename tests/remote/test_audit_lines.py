"""The audit trail's lines: a decision built from its cached parts is the line `json.dumps` writes,
byte for byte, and every record is in the file when the call that made it returns."""

from __future__ import annotations

import datetime as dt
import json
import threading

import pytest

from tinydist.nodes.audit import AuditLog

ODD = ['spiffe://tinydist.lab/user/a"b\\c', "caf\u00e9 \u2603 \U0001f600", "tab\there\nnewline", "", "\x00\x1f"]


def _reference(record: dict) -> str:
    """The line json.dumps writes for `record` (keys sorted, ASCII)."""
    return json.dumps(record, sort_keys=True)


@pytest.mark.parametrize("identity", [None, "spiffe://tinydist.lab/user/alice", *ODD])
@pytest.mark.parametrize("peer", [None, "ipv4:127.0.0.1:43210", "ipv6:[::1]:5"])
def test_a_decision_line_is_what_json_dumps_writes(tmp_path, identity, peer) -> None:
    path = tmp_path / "audit.jsonl"
    audit = AuditLog(path)
    cases = [dict(identity=identity, method="Ping", status="OK", reason="ok", fingerprint="ab" * 32, peer=peer),
             dict(identity=identity, method="Ping", status="OK", reason="ok", fingerprint="ab" * 32, peer=peer),  # cached parts
             dict(identity=identity, method=ODD[0], status="PERMISSION_DENIED", reason=ODD[1], fingerprint=None, peer=peer)]
    for case in cases:
        audit.decision(**case)
    audit.close()
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(cases)
    for line, case in zip(lines, cases):
        record = json.loads(line)
        expected = {**case, "audit": "tinydist.remote", "event": "decision", "level": "info", "timestamp": record["timestamp"]}
        assert line == _reference(expected)


def test_timestamps_are_utc_iso_8601_with_microseconds(tmp_path) -> None:
    path = tmp_path / "audit.jsonl"
    audit = AuditLog(path)
    before = dt.datetime.now(dt.timezone.utc)
    audit.decision(identity=None, method="Ping", status="OK", reason="ok")
    audit.effect(identity=None, method="Allocate", action="alloc", nbytes=8)
    after = dt.datetime.now(dt.timezone.utc)
    audit.close()
    for line in path.read_text().splitlines():
        stamp = json.loads(line)["timestamp"]
        assert stamp.endswith("Z") and len(stamp) == len("2026-12-02T18:49:15.123456Z")
        when = dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
        assert before - dt.timedelta(milliseconds=1) <= when <= after + dt.timedelta(milliseconds=1)


def test_every_record_is_in_the_file_at_once_and_lines_never_interleave(tmp_path) -> None:
    path = tmp_path / "audit.jsonl"
    audit = AuditLog(path)
    audit.decision(identity="spiffe://tinydist.lab/user/bob", method="Ping", status="OK", reason="ok")
    assert json.loads(path.read_text())["method"] == "Ping"  # not held in a buffer

    def write(n: int) -> None:
        for i in range(500):
            audit.decision(identity=f"spiffe://tinydist.lab/user/t{n}", method="Write", status="OK", reason="ok", peer="x" * (i % 300))
    threads = [threading.Thread(target=write, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    audit.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 1 + 4 * 500
    assert all(json.loads(line)["event"] == "decision" for line in lines)
    with pytest.raises(ValueError, match="closed"):
        audit.decision(identity=None, method="Ping", status="OK", reason="ok")
