"""Errors of the cluster scheduler.

    TinydistError
    ├── ClusterError
    │   ├── MembershipError       a join/heartbeat the coordinator refuses (duplicate rank, superseded, ...)
    │   ├── CoordinatorLost       the node could not reach the coordinator for N heartbeats
    │   └── PlanError             no plan is possible (no live devices, links dead, ...)
    └── CollectiveError (tinydist.dist)
        └── NodeFailed            a node of the job died; `.node_id` and `.rank` name it
"""

from __future__ import annotations

from tinydist.dist.errors import CollectiveError
from tinydist.errors import TinydistError


class ClusterError(TinydistError):
    """The cluster scheduler refused or could not do something."""


class MembershipError(ClusterError):
    """The coordinator refused a join, heartbeat or wait."""


class CoordinatorLost(ClusterError):
    """The coordinator did not answer for `miss_limit` heartbeats in a row."""


class PlanError(ClusterError):
    """No collective plan is possible on this topology."""


class NodeFailed(CollectiveError):
    """A node of the job died (SIGKILL, crash, missed heartbeats, lost link): every survivor raises it."""

    def __init__(self, node_id: str, rank: int, message: str) -> None:
        self.node_id = node_id
        self.rank = rank
        super().__init__(message)
