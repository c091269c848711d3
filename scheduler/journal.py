"""The coordinator's write-ahead journal: membership and epochs on disk, so a restarted (or
SIGKILLed) scheduler comes back with the members, ranks, incarnations, epoch and measured links it had.

    tinydist scheduler serve --listen 127.0.0.1:29500 --pki ./lab --state-dir /var/lib/tinydist/scheduler

DIR holds three files:

- `journal.log`: append-only records, each `length (u32, big-endian) | crc32 of the payload (u32) |
  crc32 of those 8 bytes (u32) | payload` (UTF-8 JSON: a sequence number and the change). The header's
  own checksum tells a flipped length (corruption) from a record the file ends inside (a torn write). A membership change (join, leave, death,
  rejoin) is written and fsynced before the coordinator answers; a link report is written without
  fsync (a measurement the next heartbeat repeats; losing the last few costs nothing).
- `snapshot.json`: the whole state at sequence number `seq`, with the crc32 of its canonical JSON.
  Written to a temporary name, fsynced and renamed (then the directory fsynced), so it is either the
  old one or the new one, never torn. Compaction writes it at start (after replay) and every
  `compact_every` records, then empties the journal; a crash between the rename and the truncation
  leaves records the snapshot already holds, which replay skips by their sequence number.
- `lock`: flock'ed while a coordinator uses the directory, so two coordinators cannot both append.

Replay rules (the crash model: a process dies mid-`write`, the kernel keeps what reached it):

- a last record cut short (the file ends inside its header, or inside the payload a sound header
  announces) is a torn write: it was never acknowledged, so it is dropped and the file truncated to
  the last whole record;
- a last record whose payload checksum fails, and a bad record followed only by zero bytes (a
  file system that extended the file but never wrote the data), are treated the same way; both
  are logged with the file, record number and offset;
- any other checksum failure (of a header, or of a payload with records after it), a record whose JSON does not parse, a sequence number
  that does not increase, or a snapshot whose checksum fails is corruption, not a crash: the
  coordinator refuses to start with a `JournalError` naming the file, the record and its offset,
  rather than serve a membership it cannot vouch for. Move the directory aside to start empty.
"""

from __future__ import annotations

import fcntl
import json
import os
import struct
import zlib
from pathlib import Path
from typing import Any

from tinydist.scheduler.errors import JournalError
from tinydist.base.logs import get_logger

JOURNAL = "journal.log"
SNAPSHOT = "snapshot.json"
LOCK = "lock"
_HEADER = struct.Struct(">III")          # payload length, crc32 of the payload, crc32 of the first two


def _encode(payload: dict[str, Any]) -> bytes:
    body = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    head = struct.pack(">II", len(body), zlib.crc32(body))
    return head + struct.pack(">I", zlib.crc32(head)) + body


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Journal:
    """One state directory: `load()` once, then `append` changes and `compact` the whole state."""

    def __init__(self, directory: Path | str, compact_every: int = 1000) -> None:
        self.directory = Path(directory)
        self.compact_every = compact_every
        self.log = get_logger(component="scheduler.journal")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock = open(self.directory / LOCK, "a+b")  # noqa: SIM115 - held for the journal's life
        except OSError as exc:
            raise JournalError(f"state dir {self.directory}: cannot open it: {exc}; give a writable --state-dir") from exc
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            self._lock.close()
            raise JournalError(f"state dir {self.directory} is in use by another coordinator (flock on "
                               f"{self.directory / LOCK} refused); give each coordinator its own --state-dir") from exc
        self.seq = 0
        self._since_compact = 0
        self._file: Any = None

    @property
    def journal_path(self) -> Path:
        return self.directory / JOURNAL

    @property
    def snapshot_path(self) -> Path:
        return self.directory / SNAPSHOT

    # ---- replay ------------------------------------------------------------------------------------

    def load(self) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """(the snapshot's state or None, the journal's records after it, in order). Truncates a torn
        tail; raises JournalError on corruption (module docstring), closing the journal (and its lock).
        Opens the journal for appends."""
        try:
            return self._load()
        except BaseException:
            self.close()
            raise

    def _load(self) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        state, snap_seq = self._read_snapshot()
        self.seq = snap_seq
        records = []
        path = self.journal_path
        data = path.read_bytes() if path.exists() else b""
        offset = index = 0
        while offset < len(data):
            end = self._record_end(data, offset, index)
            if end is None:
                break                                        # torn tail: dropped below
            body = data[offset + _HEADER.size:end]
            try:
                record = json.loads(body)
                seq = int(record["seq"])
            except (ValueError, KeyError, TypeError) as exc:
                raise JournalError(f"{path}: record {index} at byte {offset}: checksum matches but the payload is "
                                   f"not a journal record ({exc}); the file is corrupt: move {self.directory} "
                                   f"aside to start with an empty membership") from exc
            if seq > self.seq:
                records.append(record)
                self.seq = seq
            elif seq > snap_seq or records:
                raise JournalError(f"{path}: record {index} at byte {offset}: sequence number {seq} does not follow "
                                   f"{self.seq}; the file is corrupt: move {self.directory} aside to start empty")
            offset, index = end, index + 1
        if offset < len(data):
            self.log.warning("journal.torn_tail", file=str(path), record=index, offset=offset,
                             dropped_bytes=len(data) - offset)
            with open(path, "r+b") as f:
                f.truncate(offset)
                os.fsync(f.fileno())
        self._file = open(path, "ab")  # noqa: SIM115 - the append handle, closed by close()
        return state, records

    def _record_end(self, data: bytes, offset: int, index: int) -> int | None:
        """Where the record at `offset` ends, or None when it is a torn tail (module docstring)."""
        path = self.journal_path
        if len(data) - offset < _HEADER.size:
            return None
        length, crc, head_crc = _HEADER.unpack_from(data, offset)
        zeros = not data[offset:].strip(b"\0")          # nothing but zeros from here on
        if zlib.crc32(data[offset:offset + 8]) != head_crc:
            if zeros:
                self.log.warning("journal.zero_tail", file=str(path), record=index, offset=offset)
                return None
            raise JournalError(f"{path}: record {index} at byte {offset}: its header's checksum does not match (a "
                               f"damaged length or checksum, not a torn last write: corruption); move "
                               f"{self.directory} aside to start with an empty membership, or restore it")
        end = offset + _HEADER.size + length
        if end > len(data):
            return None
        got = zlib.crc32(data[offset + _HEADER.size:end])
        if got != crc:
            if end == len(data) or not data[end:].strip(b"\0"):
                self.log.warning("journal.bad_last_record", file=str(path), record=index, offset=offset,
                                 stored_crc=f"{crc:#010x}", computed_crc=f"{got:#010x}")
                return None
            raise JournalError(f"{path}: record {index} at byte {offset}: checksum {got:#010x} does not match the stored "
                               f"{crc:#010x}, and {len(data) - end} bytes follow it (not a torn last write: corruption); "
                               f"move {self.directory} aside to start with an empty membership, or restore it")
        return end

    def _read_snapshot(self) -> tuple[dict[str, Any] | None, int]:
        path = self.snapshot_path
        if not path.exists():
            return None, 0
        try:
            doc = json.loads(path.read_bytes())
            state, seq, crc = doc["state"], int(doc["seq"]), int(doc["crc32"])
        except (ValueError, KeyError, TypeError) as exc:
            raise JournalError(f"{path}: not a snapshot this coordinator wrote ({exc}); move {self.directory} aside "
                               f"to start with an empty membership") from exc
        got = zlib.crc32(json.dumps(state, sort_keys=True, separators=(",", ":")).encode())
        if got != crc:
            raise JournalError(f"{path}: checksum {got:#010x} does not match the stored {crc:#010x} (snapshots are "
                               f"renamed into place, never torn: corruption); move {self.directory} aside or restore it")
        return state, seq

    # ---- writes -----------------------------------------------------------------------------------

    def append(self, change: dict[str, Any], *, sync: bool = True) -> int:
        """Append one change; fsync it when `sync`. Returns its sequence number."""
        if self._file is None:
            raise JournalError(f"journal {self.journal_path} is not open: call load() first")
        self.seq += 1
        self._file.write(_encode({**change, "seq": self.seq}))
        self._file.flush()
        if sync:
            os.fsync(self._file.fileno())
        self._since_compact += 1
        return self.seq

    def due(self) -> bool:
        """Whether enough records have piled up since the last compaction."""
        return self._since_compact >= self.compact_every

    def compact(self, state: dict[str, Any]) -> None:
        """Write `state` (everything up to the last appended record) as the snapshot, then empty the journal."""
        body = json.dumps(state, sort_keys=True, separators=(",", ":")).encode()
        doc = json.dumps({"seq": self.seq, "crc32": zlib.crc32(body), "state": state}, sort_keys=True).encode()
        tmp = self.snapshot_path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(doc)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.snapshot_path)
        _fsync_dir(self.directory)
        if self._file is not None:
            self._file.truncate(0)
            os.fsync(self._file.fileno())
        self._since_compact = 0

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._lock.close()
