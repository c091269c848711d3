"""Errors of process-group collectives; every rank of a failed collective raises one of these
(drawn with the rest of the tree in tinydist/base/errors.py)."""

from __future__ import annotations

from tinydist.base.errors import TinydistError


class CollectiveError(TinydistError):
    """A process-group collective failed."""


class CollectiveMismatch(CollectiveError, ValueError):
    """The ranks disagree about the collective (kind, shape, dtype, op, algorithm, root); raised on every rank."""


class RankFailed(CollectiveError):
    """A rank died (or left) while the group still needed it. Every later collective raises it too."""

    def __init__(self, rank: int, message: str) -> None:
        self.rank = rank
        super().__init__(message)


class CollectiveTimeout(CollectiveError, TimeoutError):
    """The collective did not finish within TINYDIST_COLLECTIVE_TIMEOUT; the group is unusable after it."""

    def __init__(self, ranks: list[int], message: str) -> None:
        self.ranks = ranks
        super().__init__(message)
