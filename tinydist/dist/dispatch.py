"""Algorithm dispatch for one process group: which algorithm each allreduce runs (memoised), and
the log line saying why, once per change.

The choice itself is the one chooser's (`tinydist.graph.collectives.resolve`); this adds what the
group knows — its medium, whether its segment and single copy are open — and remembers the answer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tinydist.base.config import settings
from tinydist.graph.collectives import AUTO, Algorithm, resolve

if TYPE_CHECKING:
    from tinydist.dist.group import ProcessGroup

CHOICES = 256   # allreduce choices a group memoises (`Dispatch.allreduce`)


class Dispatch:
    """The algorithm choices of `group`'s collectives."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        self._last: dict[str, str] = {}
        self._choices: dict[tuple[str, int, str, bool], tuple[Algorithm, str, str, str]] = {}

    def allreduce(self, algorithm: str, nbytes: int) -> tuple[Algorithm, str, str, str]:
        """`resolve(algorithm, ...)` for an allreduce of `nbytes` here: the algorithm, its name (the
        header's), why, and the path its data takes (for the log). Memoised per (algorithm, bytes,
        TINYDIST_ALLREDUCE for auto, medium): the inputs decide it, and a repeated call (a training
        loop's) then spends one dict lookup, not resolve's, check's and the enum's Python (counted
        with the op parsed once: 8-9 of a 4 KiB two-process allreduce's ~70 Python calls, 90-128 of
        its ~1,700 bytecodes). An illegal
        `algorithm` raises ValueError every time, uncached. The memo is dropped when it holds
        `CHOICES` keys (a loop over ever new sizes)."""
        group = self.group
        key = (algorithm, nbytes, settings.ALLREDUCE if algorithm == AUTO else "", group.same_host)
        choice = self._choices.get(key)
        if choice is None:
            chosen, reason = resolve(algorithm, group.medium, group.world, nbytes)
            on_segment = group.shm is not None and chosen is not Algorithm.RING
            threshold = None if group.shm is None else group.shm.single_copy_bytes
            single_copy = on_segment and chosen is Algorithm.ALL2ALL and threshold is not None and nbytes >= threshold
            link = "single copy" if single_copy else "shm segment" if on_segment else "shm" if group.same_host else "tcp"
            if len(self._choices) >= CHOICES:
                self._choices.clear()
            choice = self._choices[key] = (chosen, chosen.value, reason, link)
        return choice

    def log(self, coll: str, algorithm: str, reason: str, **fields: Any) -> None:
        key = f"{algorithm}:{reason}"
        if self._last.get(coll) != key:
            self._last[coll] = key
            self.group.log.info("dist.algorithm", collective=coll, algorithm=algorithm, reason=reason, **fields)
        else:
            self.group.log.debug("dist.algorithm", collective=coll, algorithm=algorithm, reason=reason, **fields)
