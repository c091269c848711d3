"""Who holds which device memory on the remote service: leases, the allocations they own, and the
bytes and handles each identity holds.

A lease names an identity and an expiry that every use renews. An allocation is a device buffer
behind an opaque random handle, owned by (identity, lease). An allocation that an in-flight operation
uses (`in_use`) is not freed under it: releasing it then frees it when the operation ends. Every free
is an audit `effect` record.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from tinydist.nodes.audit import AuditLog, handle_tag
from tinydist.nodes.tenants import Segment
from tinydist.runtime.buffer import Buffer
from tinydist.runtime.device import Device

HANDLE_BYTES = 16


@dataclass(eq=False)
class Lease:
    id: bytes
    identity: str
    expires: float  # monotonic
    handles: set[bytes] = field(default_factory=set)
    programs: dict[tuple[str, str], int] = field(default_factory=dict)  # (device, program id) -> bytes charged


@dataclass(eq=False)
class Allocation:
    handle: bytes
    identity: str
    lease: Lease
    device: Device
    buffer: Buffer | Segment  # a tenant segment on host-memory devices (nodes.tenants)
    nbytes: int
    busy: int = 0
    free_pending: bool = False


class LeaseTable:
    """Every open lease and live allocation of one service, and what each identity holds."""

    def __init__(self, audit: AuditLog, ttl: float) -> None:
        self.audit, self.ttl = audit, ttl
        self.leases: dict[bytes, Lease] = {}
        self.allocations: dict[bytes, Allocation] = {}
        self.bytes_by_identity: Counter[str] = Counter()
        self.handles_by_identity: Counter[str] = Counter()
        self.on_release: Callable[[Lease], None] | None = None  # the service unloads the lease's programs

    def identity_leases(self, identity: str) -> list[Lease]:
        return [lease for lease in self.leases.values() if lease.identity == identity]

    def count(self, identity: str) -> int:
        """How many leases `identity` holds open."""
        return sum(1 for lease in self.leases.values() if lease.identity == identity)

    def open(self, identity: str) -> Lease:
        lease = Lease(secrets.token_bytes(HANDLE_BYTES), identity, time.monotonic() + self.ttl)
        self.leases[lease.id] = lease
        return lease

    def lease(self, identity: str, lease_id: bytes) -> Lease | None:
        """`identity`'s unexpired lease `lease_id`, renewed; None for a missing, foreign or expired one."""
        lease = self.leases.get(lease_id)
        now = time.monotonic()
        if lease is None or lease.identity != identity or lease.expires <= now:
            return None
        lease.expires = now + self.ttl
        return lease

    def allocation(self, identity: str, lease: Lease, handle: bytes) -> Allocation | None:
        """The allocation `handle` if `identity` holds it under `lease` and it is not being freed."""
        alloc = self.allocations.get(handle)
        if alloc is None or alloc.identity != identity or alloc.lease is not lease or alloc.free_pending:
            return None
        return alloc

    def add(self, identity: str, lease: Lease, device: Device, buffer: Buffer | Segment, nbytes: int) -> Allocation:
        """Record `buffer` under a fresh handle of `lease`."""
        handle = secrets.token_bytes(HANDLE_BYTES)
        while handle in self.allocations:
            handle = secrets.token_bytes(HANDLE_BYTES)
        alloc = self.allocations[handle] = Allocation(handle, identity, lease, device, buffer, nbytes)
        lease.handles.add(handle)
        self.bytes_by_identity[identity] += nbytes
        self.handles_by_identity[identity] += 1
        return alloc

    @contextlib.contextmanager
    def in_use(self, *allocs: Allocation) -> Iterator[None]:
        """Hold `allocs` for an operation; a release asked for meanwhile happens when it ends."""
        for alloc in allocs:
            alloc.busy += 1
        try:
            yield
        finally:
            for alloc in allocs:
                alloc.busy -= 1
                if alloc.busy == 0 and alloc.free_pending:
                    alloc.free_pending = False
                    self.release(alloc, "-", "deferred")

    def release(self, alloc: Allocation, method: str, reason: str) -> None:
        """Free `alloc` now, or when the operation using it ends."""
        if alloc.busy:
            alloc.free_pending = True
            return
        if self.allocations.pop(alloc.handle, None) is None:
            return
        alloc.lease.handles.discard(alloc.handle)
        self.bytes_by_identity[alloc.identity] -= alloc.nbytes
        self.handles_by_identity[alloc.identity] -= 1
        alloc.buffer.free()
        self.audit.effect(identity=alloc.identity, method=method, action="free",
                          handle=handle_tag(alloc.handle), nbytes=alloc.nbytes, reason=reason)

    def release_lease(self, lease: Lease, reason: str) -> int:
        """Close `lease` and release its allocations; returns how many it held."""
        if self.leases.pop(lease.id, None) is not None and self.on_release is not None:
            self.on_release(lease)
        count = 0
        for handle in list(lease.handles):
            alloc = self.allocations.get(handle)
            if alloc is not None:
                self.release(alloc, "-", reason)
                count += 1
        self.audit.effect(identity=lease.identity, method="-", action="lease_released", reason=reason, handles=count)
        return count

    def reap(self) -> int:
        """Release every expired lease; returns how many."""
        now = time.monotonic()
        expired = [lease for lease in self.leases.values() if lease.expires <= now]
        for lease in expired:
            self.release_lease(lease, "lease expired")
        return len(expired)
