"""Errors of the cluster scheduler (drawn with the rest of the tree in tinydist/base/errors.py): a
ClusterError when the scheduler refuses or cannot do something, NodeFailed (a CollectiveError, so
collective callers catch it) when a node of the job dies."""

from __future__ import annotations

from tinydist.base.errors import TinydistError
from tinydist.dist.errors import CollectiveError


class ClusterError(TinydistError):
    """The cluster scheduler refused or could not do something."""


class MembershipError(ClusterError):
    """The coordinator refused a join, heartbeat or wait."""


class SchedulerNameMismatch(MembershipError):
    """The scheduler's certificate does not name the address a node dialled (re-issue it with `certs server --this-host`)."""


class CoordinatorLost(ClusterError):
    """The coordinator stayed unreachable past TINYDIST_SCHEDULER_LOST_AFTER seconds (the node retried with backoff)."""


class MembershipStoreError(ClusterError):
    """The coordinator's membership store (scheduler.store: the journal, or etcd) cannot be used."""


class JournalError(MembershipStoreError):
    """The coordinator's state directory cannot be used: corrupt journal or snapshot, locked, unwritable."""


class LeadershipLost(MembershipStoreError):
    """This coordinator no longer holds the etcd leader key (its lease expired, another won): it stands down."""


class PlanError(ClusterError):
    """No collective plan is possible on this topology."""


class NodeFailed(CollectiveError):
    """A node of the job died (SIGKILL, crash, missed heartbeats, lost link): every survivor raises it."""

    def __init__(self, node_id: str, rank: int, message: str) -> None:
        self.node_id = node_id
        self.rank = rank
        super().__init__(message)
