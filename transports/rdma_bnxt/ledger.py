"""ResourceLedger: every object the driver creates, with its undo, torn down in reverse order.

Firmware objects (rings, contexts, CQs, QPs, MRs, GIDs, registration) are undone in reverse order of
creation. Host pages are freed last, and only when the function reset that stops device DMA
succeeded; otherwise they go to quarantine (kept pinned, never reused, reported), because a device
that may still DMA into a page must never see that page reused.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

Undo = Callable[[], Awaitable[object] | None]  # an awaitable's result (a firmware reply) is dropped
PAGES = "pages"


@dataclass
class Entry:
    id: int
    kind: str
    handle: Any
    undo: Undo


class ResourceLedger:
    def __init__(self) -> None:
        self.entries: dict[int, Entry] = {}
        self._ids = itertools.count(1)
        self.created: collections.Counter[str] = collections.Counter()
        self.released: collections.Counter[str] = collections.Counter()
        self.quarantined: list[Entry] = []

    def push(self, kind: str, handle: Any, undo: Undo) -> Entry:
        entry = Entry(next(self._ids), kind, handle, undo)
        self.entries[entry.id] = entry
        self.created[kind] += 1
        return entry

    def forget(self, entry: Entry) -> None:
        """The object was destroyed explicitly (its undo already ran)."""
        if self.entries.pop(entry.id, None) is not None:
            self.released[entry.kind] += 1

    async def release(self, entry: Entry) -> None:
        """Run one entry's undo now and drop it (on success)."""
        if entry.id not in self.entries:
            return
        result = entry.undo()
        if result is not None:
            await result
        self.forget(entry)

    def live(self) -> dict[str, int]:
        counts = collections.Counter(e.kind for e in self.entries.values())
        return dict(counts)

    def firmware_entries(self) -> list[Entry]:
        return sorted((e for e in self.entries.values() if e.kind != PAGES), key=lambda e: -e.id)

    def page_entries(self) -> list[Entry]:
        return sorted((e for e in self.entries.values() if e.kind == PAGES), key=lambda e: -e.id)

    def quarantine(self) -> int:
        """Move every page entry to quarantine; returns the number of pages kept pinned."""
        pages = self.page_entries()
        for e in pages:
            self.entries.pop(e.id)
            self.quarantined.append(e)
        return sum(len(e.handle) for e in pages)
