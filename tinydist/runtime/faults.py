"""Named fault points, so tests can prove that a failure half way through leaves nothing behind.

Code that takes resources step by step calls `faults.check("cpu.alloc.memalign")` before each
step. Normally that is one dict lookup. A test arms a point:

    with faults.inject("cpu.alloc.register", after=2):   # the 3rd pass through the point fails
        ...

and the check raises `InjectedFault` there, exercising the real rollback path.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class InjectedFault(RuntimeError):
    """Raised by an armed fault point."""


class FaultPoints:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: dict[str, list[int]] = {}  # name -> [passes left before failing]
        self.hits: dict[str, int] = {}

    @property
    def armed(self) -> bool:
        """Whether any point is armed (a hot path takes its short way only when none is)."""
        return bool(self._armed)

    def check(self, name: str) -> None:
        if not self._armed:
            return
        with self._lock:
            slot = self._armed.get(name)
            if slot is None:
                return
            self.hits[name] = self.hits.get(name, 0) + 1
            if slot[0] > 0:
                slot[0] -= 1
                return
        raise InjectedFault(f"injected fault at {name}")

    @contextlib.contextmanager
    def inject(self, name: str, after: int = 0) -> Iterator[None]:
        """Fail the point `name` on its (after+1)-th pass, and every pass after that, in this scope."""
        with self._lock:
            if name in self._armed:
                raise ValueError(f"fault point {name} is already armed")
            self._armed[name] = [after]
            self.hits[name] = 0
        try:
            yield
        finally:
            with self._lock:
                del self._armed[name]


faults = FaultPoints()
