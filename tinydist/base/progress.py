"""Progress that suits where it goes: a tqdm bar on a terminal, plain lines into a pipe or file.

    for step in progress(range(steps), desc=f"epoch {epoch}", file=sys.stdout):
        ...
        bar.set_postfix_str(f"loss {loss:.4f}")

A bar redraws itself with `\\r`, which a terminal understands and a pipe does not: a log file, CI
output or `tinydist launch` (whose ranks write into pipes, read line by line) would get one line
per epoch holding every redraw. So a stream that is not a TTY gets whole lines instead, each
flushed as written: one when every `1/lines` of the total is done and one at the end (every
`every` items when the total is unknown), `desc n/total pct% elapsed rate postfix`. tqdm is
imported only when a terminal draws a bar.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, Any, Generic, TypeVar

T = TypeVar("T")


def is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if isatty is not None else False
    except ValueError:   # a closed stream
        return False


class Progress(Generic[T]):
    """One task's progress (see the module's docstring); also a context manager and an iterable."""

    def __init__(self, iterable: Iterable[T] | None = None, total: int | None = None, desc: str = "",
                 file: IO[str] | None = None, unit: str = "it", lines: int = 10, every: int = 100) -> None:
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        self.stream = file if file is not None else sys.stderr
        self.n = 0
        self.postfix = ""
        self._start = time.perf_counter()
        self._printed = -1   # the count of the last line written
        self._step = max(1, math.ceil(total / max(lines, 1))) if total else max(1, every)
        self._bar: Any = None
        self._closed = False
        if is_terminal(self.stream):
            from tqdm import tqdm
            self._bar = tqdm(total=total, desc=desc, file=self.stream, unit=unit, dynamic_ncols=True)

    def __iter__(self) -> Iterator[T]:
        if self.iterable is None:
            raise TypeError("this Progress has no iterable: call update() instead")
        try:
            for item in self.iterable:
                yield item
                self.update()
        finally:
            self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.n - max(self._printed, 0) >= self._step or (self.total is not None and self.n >= self.total):
            self._line()

    def set_postfix_str(self, text: str) -> None:
        """Text after the count (a loss, a rate): shown with the next redraw or line."""
        self.postfix = text
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)

    def write(self, text: str) -> None:
        """A line of its own that does not break the bar."""
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def _line(self) -> None:
        if self._printed == self.n:
            return
        self._printed = self.n
        elapsed = time.perf_counter() - self._start
        count = f"{self.n}/{self.total} {100 * self.n / self.total:3.0f}%" if self.total else f"{self.n}"
        rate = f"{self.n / elapsed:,.1f} {self.unit}/s" if elapsed > 0 else f"- {self.unit}/s"
        fields = [self.desc, count, f"{elapsed:.1f}s", rate, self.postfix]
        print(" ".join(f for f in fields if f), file=self.stream, flush=True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        elif self.n:
            self._line()   # the final count, unless its line is out already

    def __enter__(self) -> Progress[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress(iterable: Iterable[T] | None = None, total: int | None = None, desc: str = "", file: IO[str] | None = None,
             unit: str = "it", lines: int = 10, every: int = 100) -> Progress[T]:
    """`Progress(...)`: a bar on a terminal, `lines` plain lines over the total otherwise."""
    return Progress(iterable, total, desc, file, unit, lines, every)
