"""Where the coordinator's membership lives between processes: one interface, two implementations.

- `Journal` (scheduler.journal, `--state-dir DIR`): the embedded default, a write-ahead log and a
  snapshot on local disk; one coordinator, restarted in place.
- `EtcdStore` (here, `--etcd http://HOST:PORT`): the same records and snapshot as keys in an etcd
  cluster, for labs that run several coordinators: they campaign for one lease-backed leader key,
  the winner recovers the membership from etcd and serves, the others stand by (answering
  UNAVAILABLE, which nodes treat as an outage and retry on the next address they were given).

Both are driven the same way by `Membership` (scheduler.membership): `load()` once, then `append`
each change, `compact` the whole state when `due()`, `close()` at the end.

etcd layout under the prefix (default `/tinydist/scheduler/`):

    leader              {"name": ..., "address": ...}, attached to the leader's lease (TTL seconds)
    snapshot            {"seq": N, "state": {...}}: the whole membership at record N
    log/00000000000000000042   one change (the journal's record: its JSON, with "seq")

Fencing: every write is a transaction whose compare says "the leader key was created at the
revision my campaign created it" — the etcd election idiom (clientv3/concurrency's `IsOwner`). A
coordinator that stalled past its lease, and whose key another coordinator has since created,
cannot write a single record: its transaction fails and it raises `LeadershipLost`, and the
coordinator steps down. etcd commits a write through raft before it answers, so `sync` changes
nothing here (the journal's link reports are not fsynced; etcd's are as durable as the rest).

Failover time: a SIGKILLed leader's key lives until its lease expires (TTL seconds, renewed every
TTL/3); a standby polls the key every TTL/4, so it takes over within about TTL·1.25 of the kill.
A coordinator stopped cleanly revokes its lease: a standby takes over within one poll.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from tinydist.scheduler.errors import LeadershipLost, MembershipStoreError
from tinydist.scheduler.etcd import (EtcdClient, create_revision_is, delete_range_op, prefix_end, put_op, range_op)
from tinydist.base.logs import get_logger


class MembershipStore(Protocol):
    """What Membership needs of its persistence (scheduler.journal.Journal and EtcdStore)."""

    def load(self) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]: ...

    def append(self, change: dict[str, Any], *, sync: bool = True) -> int: ...

    def due(self) -> bool: ...

    def compact(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def _json(data: bytes, where: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise MembershipStoreError(f"etcd key {where}: not JSON this coordinator wrote ({exc}); delete the "
                                   f"prefix (etcdctl del --prefix) to start with an empty membership") from exc
    if not isinstance(doc, dict):
        raise MembershipStoreError(f"etcd key {where}: expected a JSON object, found {type(doc).__name__}")
    return doc


class EtcdStore:
    """The membership in etcd behind a leader election. `campaign()` blocks until this coordinator
    leads; then `load`, `append`, `compact` as the journal; `lost` is set if the lease is lost."""

    def __init__(self, endpoints: str, name: str, *, prefix: str = "/tinydist/scheduler/", ttl: int = 5,
                 compact_every: int = 1000, client: EtcdClient | None = None) -> None:
        if ttl < 2:
            raise MembershipStoreError(f"etcd leader lease TTL {ttl} s: give at least 2 s (it is renewed every TTL/3)")
        self.client = client or EtcdClient(endpoints, timeout=max(1.0, ttl / 3))
        self.name = name
        self.prefix = prefix.encode()
        self.ttl = ttl
        self.compact_every = compact_every
        self.seq = 0
        self.lease = 0
        self.leader_revision = 0                   # create revision of our leader key; the fencing token
        self.lost = threading.Event()
        self._since_compact = 0
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        self.log = get_logger(component="scheduler.etcd", name=name)

    def _key(self, suffix: str) -> bytes:
        return self.prefix + suffix.encode()

    @property
    def leader_key(self) -> bytes:
        return self._key("leader")

    def _log_key(self, seq: int) -> bytes:
        return self._key(f"log/{seq:020d}")

    # ---- election --------------------------------------------------------------------------------

    def leader(self) -> dict[str, Any] | None:
        """The current leader's record ({"name", "address"}), or None."""
        kv = self.client.get(self.leader_key)
        return _json(kv.value, kv.key.decode()) if kv is not None else None

    def campaign(self, address: str, stop: Callable[[], bool] = lambda: False) -> bool:
        """Block until this coordinator holds the leader key (True), or `stop()` (False). Polls every
        TTL/4; a standby logs the leader it waits behind, once per leader."""
        record = json.dumps({"name": self.name, "address": address}, sort_keys=True).encode()
        waiting_on = None
        while not stop():
            if not self.lease:
                self._start_keeper(self.client.grant(self.ttl))
            result = self.client.txn([create_revision_is(self.leader_key, 0)],
                                     [put_op(self.leader_key, record, self.lease)], [range_op(self.leader_key)])
            if result.succeeded:
                self.leader_revision = result.revision
                self.log.info("etcd.leader", lease=self.lease, revision=result.revision)
                return True
            holder = result.ranges[0][0].value.decode() if result.ranges and result.ranges[0] else "?"
            if holder != waiting_on:
                self.log.info("etcd.standby", leader=holder)
                waiting_on = holder
            if self._stop.wait(self.ttl / 4) or self.lost.is_set():
                self.lease = 0                     # the lease expired while we waited: a fresh one next round
        return False

    def _start_keeper(self, lease: int) -> None:
        if self._keeper is not None:               # it ends once self.lease no longer names its lease
            self._keeper.join()
        self.lease = lease
        self.lost.clear()
        self._keeper = threading.Thread(target=self._keep, args=(lease,), name=f"tinydist-etcd-lease-{lease}",
                                        daemon=True)
        self._keeper.start()

    def _keep(self, lease: int) -> None:
        """Renew every TTL/3; the lease is lost when etcd says it is gone, or after a whole TTL without
        a renewal (etcd will have expired it by then, whatever we hear later)."""
        renewed = time.monotonic()
        while not self._stop.wait(self.ttl / 3) and self.lease == lease:
            try:
                ttl = self.client.keepalive(lease)
            except MembershipStoreError as exc:
                if time.monotonic() - renewed >= self.ttl:
                    self.log.warning("etcd.lease_lost", lease=lease, error=str(exc))
                    self.lost.set()
                    return
                continue
            if ttl <= 0:
                self.log.warning("etcd.lease_lost", lease=lease, error="expired or revoked")
                self.lost.set()
                return
            renewed = time.monotonic()

    # ---- the store interface -------------------------------------------------------------------------

    def _fence(self) -> list[dict[str, Any]]:
        if not self.leader_revision or self.lost.is_set():
            raise LeadershipLost(f"coordinator {self.name!r} does not lead (lease {self.lease} lost or never won) "
                                 f"in etcd {self.client.endpoints} under {self.prefix.decode()!r}; it stands down")
        return [create_revision_is(self.leader_key, self.leader_revision)]

    def _write(self, ops: list[dict[str, Any]]) -> None:
        if not self.client.txn(self._fence(), ops).succeeded:
            self.lost.set()
            holder = self.leader()
            raise LeadershipLost(f"coordinator {self.name!r} lost the leadership it won at etcd revision "
                                 f"{self.leader_revision}: the leader key now names {holder}; it stands down")

    def load(self) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """(the snapshot's state or None, the records after it, in order), read after winning."""
        self._fence()
        snap_kv = self.client.get(self._key("snapshot"))
        state, snap_seq = None, 0
        if snap_kv is not None:
            doc = _json(snap_kv.value, "snapshot")
            state, snap_seq = doc.get("state"), int(doc.get("seq", 0))
        self.seq = snap_seq
        records = []
        for kv in self.client.get_prefix(self._key("log/")):
            record = _json(kv.value, kv.key.decode())
            seq = int(record.get("seq", 0))
            if seq <= snap_seq:
                continue                           # the snapshot holds it (a compaction's delete still pending)
            if seq != self.seq + 1:
                raise MembershipStoreError(f"etcd key {kv.key.decode()}: record {seq} does not follow {self.seq}; "
                                           f"the membership under {self.prefix.decode()!r} is not one this "
                                           f"coordinator can vouch for: delete the prefix to start empty")
            records.append(record)
            self.seq = seq
        return state, records

    def append(self, change: dict[str, Any], *, sync: bool = True) -> int:
        seq = self.seq + 1
        self._write([put_op(self._log_key(seq), json.dumps({**change, "seq": seq}, sort_keys=True).encode())])
        self.seq = seq
        self._since_compact += 1
        return seq

    def due(self) -> bool:
        return self._since_compact >= self.compact_every

    def compact(self, state: dict[str, Any]) -> None:
        """The snapshot at the last record, and the records it holds deleted, in one transaction."""
        log = self._key("log/")
        self._write([put_op(self._key("snapshot"), json.dumps({"seq": self.seq, "state": state}, sort_keys=True).encode()),
                     delete_range_op(log, self._log_key(self.seq + 1) if self.seq else prefix_end(log))])
        self._since_compact = 0

    def resign(self) -> None:
        """Give up the leadership (and the lease) so a standby takes over within one poll."""
        self.leader_revision = 0
        lease, self.lease = self.lease, 0
        if lease:
            try:
                self.client.revoke(lease)
            except MembershipStoreError as exc:      # it expires by itself within TTL
                self.log.warning("etcd.revoke_failed", lease=lease, error=str(exc))

    def close(self) -> None:
        self._stop.set()
        if self._keeper is not None:
            self._keeper.join()
            self._keeper = None
        self.resign()
