"""The node side of membership: join the coordinator, heartbeat, learn of deaths, start tinydist.dist.

    agent = NodeAgent("127.0.0.1:29500", "node-0", ["CPU:0", "CPU:1"], world_size=2,
                      credentials=Credentials.load())       # TINYDIST_CERT / TINYDIST_KEY / TINYDIST_CA
    agent.join(); agent.wait(); agent.init_dist()           # rank and world from the membership table

A heartbeat thread calls Heartbeat every interval (each call bounded). When the reply names a dead
member of this job, or the coordinator says this node itself was declared dead or superseded, the
agent records the failure and calls every callback (scheduler.execute uses one to fail the
tinydist.dist group, so a collective in flight raises at once on this rank instead of waiting for
its timeout).

Losing the coordinator is not fatal: the data plane (tinydist.dist) never talks to it, so the job's
collectives go on. The agent logs `node.coordinator_unreachable`, retries on a fresh channel with
exponential backoff (one interval, doubling, capped at half the dead-after window so a recovered
coordinator hears from it before it would declare it dead; `CoordinatorWatch`), and once the
coordinator answers again re-registers (`Join` with the rank and incarnation it holds; logged as
`node.coordinator_back`). Only a coordinator away longer than TINYDIST_SCHEDULER_LOST_AFTER seconds
(default 60) fails the job, with `CoordinatorLost` naming the coordinator and how long it was gone.

Several coordinators (`coordinator="10.0.0.1:29500,10.0.0.2:29500"`, coordinators sharing one etcd,
scheduler.store): the agent talks to one at a time and moves to the next address of the list
whenever the one it has is unreachable or a standby (a standby answers UNAVAILABLE), so after the
leader dies it finds the new leader on its next retry and re-registers there.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from tinydist.scheduler._generated import cluster_pb2 as pb
from tinydist.scheduler._generated import cluster_pb2_grpc as pb_grpc
from tinydist.scheduler.errors import ClusterError, CoordinatorLost, MembershipError, NodeFailed, SchedulerNameMismatch
from tinydist.scheduler.membership import LinkRecord
from tinydist.scheduler.topology import LinkModel, NodeSpec, Topology
from tinydist.base.config import settings
from tinydist.base.logs import get_logger
from tinydist.security.bind import format_address, is_loopback, parse_host_port
from tinydist.security.pki import ClientCredentials as Credentials


def open_channel(target: str, credentials: Credentials | None) -> grpc.Channel:
    if credentials is None:
        if not is_loopback(parse_host_port(target, what="scheduler address")[0]):
            raise ClusterError(f"refusing an insecure channel to {target}: insecure mode is loopback-only")
        return grpc.insecure_channel(target)
    return grpc.secure_channel(target, credentials.channel_credentials())


def name_mismatch(target: str, credentials: Credentials | None, exc: grpc.RpcError,
                  who: str = "this node") -> SchedulerNameMismatch | None:
    """A failed call to the scheduler at `target` as SchedulerNameMismatch when its certificate does not
    name the address dialled (gRPC's UNAVAILABLE says only "Hostname Verification Check failed", and
    retrying cannot cure it); None for anything else (a scheduler still starting: keep retrying)."""
    if credentials is None or exc.code() != grpc.StatusCode.UNAVAILABLE or "connection refused" in (exc.details() or "").lower():
        return None
    from tinydist.security.diagnose import names_not_dialled, split_target
    where = split_target(target)
    names = None if where is None else names_not_dialled(*where)
    if where is None or names is None:
        return None
    return SchedulerNameMismatch(
        f"{who}: the scheduler at {target} presents a certificate for {names}, not {where[0]}, the address dialled, so "
        f"TLS refuses it (gRPC: {exc.details()}); re-issue it on the scheduler's host with `tinydist certs server DIR "
        f"--this-host` (or `--server-san {where[0]}`) and restart the scheduler, or dial one of those names")


def coordinator_list(targets: str) -> list[str]:
    """`A,B,...` → the addresses of the coordinators that may lead (one address: a list of one)."""
    out = [t.strip() for t in targets.split(",") if t.strip()]
    if not out:
        raise ClusterError(f"no coordinator address in {targets!r}: give HOST:PORT[,HOST:PORT...]")
    return out


def status(target: str, credentials: Credentials | None, timeout: float = 10.0) -> pb.ClusterStatus:
    """The cluster status from the first coordinator of `target` (`A,B,...`) that serves it (a
    standby or a dead one answers UNAVAILABLE: the next is asked)."""
    targets = coordinator_list(target)
    for i, one in enumerate(targets):
        with open_channel(one, credentials) as channel:
            try:
                return pb_grpc.ClusterStub(channel).Status(pb.StatusRequest(), timeout=timeout)
            except grpc.RpcError as exc:
                mismatch = name_mismatch(one, credentials, exc, "cluster status")
                if mismatch is not None:
                    raise mismatch from exc
                if exc.code() != grpc.StatusCode.UNAVAILABLE or i == len(targets) - 1:
                    raise
    raise AssertionError("unreachable: the loop returns or raises")


def topology_from_status(st: pb.ClusterStatus) -> Topology:
    nodes = [NodeSpec(m.node.node_id, m.node.rank, m.node.host_key, [d.name for d in m.node.devices],
                      tuple(m.node.transports), alive=m.state == "alive") for m in st.members if m.state != "left"]
    topo = Topology(nodes, epoch=st.epoch)
    for link in st.links:
        if link.bandwidth_bps > 0:
            topo.set_measured(link.src, link.dst, LinkModel(link.kind, link.latency_s, 1.0 / link.bandwidth_bps))
    return topo


# what a coordinator that is down, restarting or partitioned away looks like; anything else is an answer
_UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                          grpc.StatusCode.UNKNOWN})


class CoordinatorWatch:
    """When to retry an unreachable coordinator, and when to give up on it. Pure logic, clock injected.

    `failed()` after each failed call returns the seconds to wait before the next try, `interval`
    doubling up to `cap`; past `lost_after` seconds since the last answer it raises CoordinatorLost.
    `answered()` resets it and says whether an outage just ended (the agent then re-registers)."""

    def __init__(self, coordinator: str, interval: float, cap: float, lost_after: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.coordinator, self.interval, self.cap, self.lost_after = coordinator, interval, max(cap, interval), lost_after
        self.clock = clock
        self.last_ok = clock()
        self.failures = 0

    @property
    def outage(self) -> bool:
        return self.failures > 0

    def answered(self) -> bool:
        ended = self.outage
        self.last_ok, self.failures = self.clock(), 0
        return ended

    def away(self) -> float:
        """Seconds since the coordinator last answered."""
        return self.clock() - self.last_ok

    def near_bound(self) -> bool:
        """In an outage and within one backoff step (plus one heartbeat phase) of the bound: a peer
        that lost the same coordinator may have reached it first."""
        return self.outage and self.away() >= self.lost_after - self.cap - self.interval

    def failed(self, why: str) -> float:
        away = self.clock() - self.last_ok
        if away > self.lost_after:
            raise CoordinatorLost(f"coordinator {self.coordinator} unreachable for {away:.1f} s ({why}), past "
                                  f"TINYDIST_SCHEDULER_LOST_AFTER={self.lost_after:g} s; restart it (with its "
                                  f"--state-dir, the nodes re-register) or raise the bound")
        delay = min(self.cap, self.interval * 2.0 ** self.failures)
        self.failures += 1
        return min(delay, max(self.lost_after - away, 0.0) + self.interval)


class NodeAgent:
    def __init__(self, coordinator: str, node_id: str, devices: Sequence[str], *, rank: int = -1, world_size: int = 0,
                 host_key: str | None = None, credentials: Credentials | None = None, address: str | None = None,
                 transports: Sequence[str] = ("mem", "shm", "tcp")) -> None:
        """`address`: where this node's rendezvous binds and what it advertises to the other nodes (the
        one they reach it at); default `environment.node_host()`: TINYDIST_NODE_HOST, the Slurm node's
        address, else loopback."""
        from tinydist.dist.environment import node_host
        from tinydist.dist.rendezvous import host_key as default_host_key
        self.coordinators = coordinator_list(coordinator)
        self.coordinator = self.coordinators[0]        # the one this agent talks to now
        self.node_id = node_id
        self.devices = list(devices)
        self.requested_rank = rank
        self.world_size = world_size
        self.host_key = host_key or default_host_key()
        self.address = node_host() if address is None else address
        self.transports = tuple(transports)
        self.credentials = credentials
        self.channel = open_channel(self.coordinator, credentials)
        self.stub = pb_grpc.ClusterStub(self.channel)
        self.rejoins = 0                                # re-registrations after losing the coordinator
        self.rejoined = threading.Event()               # set at each one
        self.watch: CoordinatorWatch | None = None      # the heartbeat thread's, once joined
        self.log = get_logger(component="node-agent", node=node_id)
        self.rank = -1
        self.incarnation = 0
        self.interval = 1.0
        self.miss_limit = 5
        self.table: dict[str, pb.Member] = {}          # the job's members (from wait() or rendezvous())
        self.round = 0                                 # the last elastic round this node was in
        self.last_status: pb.ClusterStatus | None = None
        self.failure: ClusterError | NodeFailed | None = None
        self._callbacks: list[Callable[[ClusterError | NodeFailed], None]] = []
        self._pending_links: list[LinkRecord] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rendezvous: socket.socket | None = None
        self._lock = threading.Lock()

    # ---- membership ----------------------------------------------------------------------------

    def join(self, timeout: float = 30.0) -> int:
        from tinydist.dist.rendezvous import coordinator_listener
        self._rendezvous = coordinator_listener((self.address, 0))   # our tinydist.dist coordinator, should we be rank 0
        host, port = self._rendezvous.getsockname()[:2]
        info = pb.NodeInfo(node_id=self.node_id, host_key=self.host_key, address=self.address,
                           devices=[pb.NodeDevice(name=d, kind=d.split(":")[0].lower()) for d in self.devices],
                           transports=list(self.transports), rank=self.requested_rank,
                           rendezvous=format_address(host, port), pid=os.getpid())
        deadline = time.monotonic() + timeout
        delay = 0.05
        while True:                                        # the coordinator may still be starting
            try:
                reply = self.stub.Join(pb.JoinRequest(node=info, world_size=self.world_size),
                                       timeout=max(0.1, min(5.0, deadline - time.monotonic())))
                break
            except grpc.RpcError as exc:
                mismatch = name_mismatch(self.coordinator, self.credentials, exc, f"node {self.node_id}")
                if mismatch is not None:                   # waiting will not change the certificate
                    self.close()
                    raise mismatch from exc
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() + delay > deadline:
                    self.close()
                    raise MembershipError(f"node {self.node_id}: join at {self.coordinator} failed: "
                                          f"{exc.code().name}: {exc.details()}") from exc
                if len(self.coordinators) > 1:
                    self._reopen()                         # a standby or a dead one: ask the next
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
        self.rank, self.incarnation = reply.rank, reply.epoch
        self.interval, self.miss_limit = reply.heartbeat_interval_s, reply.miss_limit
        self._thread = threading.Thread(target=self._heartbeats, args=(info,), name=f"tinydist-heartbeat-{self.node_id}", daemon=True)
        self._thread.start()
        self.log.info("node.joined", rank=self.rank, coordinator=self.coordinator)
        return self.rank

    def wait(self, world_size: int | None = None, timeout: float = 60.0) -> list[pb.Member]:
        """Block until `world_size` nodes are alive; returns the job's members in rank order."""
        world = world_size or self.world_size
        try:
            st = self.stub.WaitForMembers(pb.WaitRequest(node_id=self.node_id, world_size=world, timeout_s=timeout),
                                          timeout=timeout + 5)
        except grpc.RpcError as exc:
            raise MembershipError(f"waiting for {world} nodes failed: {exc.code().name}: {exc.details()}") from exc
        self.last_status = st
        members = [m for m in st.members if m.state == "alive" and m.node.rank < world]
        self.table = {m.node.node_id: m for m in members}
        self.world_size = world
        return members

    def rendezvous(self, min_size: int, max_size: int, last_call: float = 1.0,
                   timeout: float = 60.0) -> list[pb.Member]:
        """Elastic: block until this node's rendezvous round closes (scheduler.membership: it counts only
        incarnations that asked since it opened; closes at `max_size`, or at `min_size` once
        `last_call` s pass without another arrival). Returns the round's members in rank order
        (node.rank is the round rank); init_dist() then forms a group of that size."""
        from tinydist.dist.rendezvous import coordinator_listener
        if self._rendezvous is None:                # the last round's socket went to its group
            self._rendezvous = coordinator_listener((self.address, 0))
        host, port = self._rendezvous.getsockname()[:2]
        deadline = time.monotonic() + timeout
        while True:     # a standby or a coordinator that is down answers UNAVAILABLE: ask the next until the deadline
            left = deadline - time.monotonic()
            try:
                reply = self.stub.Rendezvous(pb.RendezvousRequest(
                    node_id=self.node_id, incarnation=self.incarnation, min_size=min_size, max_size=max_size,
                    last_call_s=last_call, timeout_s=max(left, 0.0), rendezvous=format_address(host, port)),
                    timeout=max(left, 0.0) + 5)
                break
            except grpc.RpcError as exc:
                mismatch = name_mismatch(self.coordinator, self.credentials, exc, f"node {self.node_id}")
                if mismatch is not None:               # the coordinator moved to (_reopen): as in join
                    raise mismatch from exc
                if exc.code() != grpc.StatusCode.UNAVAILABLE or left <= self.interval:
                    raise MembershipError(f"node {self.node_id}: rendezvous ({min_size}..{max_size} members) at "
                                          f"{self.coordinator} failed: {exc.code().name}: {exc.details()}") from exc
                self._reopen()
                time.sleep(self.interval)
        self.round = reply.round
        self.table = {m.node.node_id: m for m in reply.members}
        self.world_size = reply.world_size
        self.log.info("node.round", round=reply.round, rank=reply.rank, world_size=reply.world_size)
        return list(reply.members)

    def status(self, timeout: float = 10.0) -> pb.ClusterStatus:
        self.last_status = self.stub.Status(pb.StatusRequest(), timeout=timeout)
        return self.last_status

    def topology(self) -> Topology:
        st = self.last_status or self.status()
        return topology_from_status(st)

    def report_links(self, links: Sequence[LinkRecord]) -> None:
        with self._lock:
            self._pending_links.extend(links)

    def on_failure(self, callback: Callable[[ClusterError | NodeFailed], None]) -> None:
        self._callbacks.append(callback)
        if self.failure is not None:
            callback(self.failure)

    def node_of_rank(self, rank: int) -> str:
        for node_id, m in self.table.items():
            if m.node.rank == rank:
                return node_id
        return f"rank-{rank}"

    # ---- heartbeats ------------------------------------------------------------------------------

    def _fail(self, failure: ClusterError | NodeFailed) -> None:
        if self.failure is not None:
            return
        self.failure = failure
        self.log.warning("node.failure", error=str(failure))
        for callback in list(self._callbacks):
            try:
                callback(failure)
            except Exception as exc:  # a callback's own failure must not stop the others
                self.log.warning("node.failure_callback", error=repr(exc))

    def _heartbeats(self, info: pb.NodeInfo) -> None:
        dead_after = self.interval * self.miss_limit
        watch = self.watch = CoordinatorWatch(",".join(self.coordinators), self.interval, dead_after / 2,
                                              settings.SCHEDULER_LOST_AFTER)
        delay = self.interval
        while not self._stop.wait(delay):
            with self._lock:
                links, self._pending_links = self._pending_links, []
            request = pb.HeartbeatRequest(node_id=self.node_id, epoch=self.incarnation, links=[
                pb.LinkReport(src=x.src, dst=x.dst, kind=x.kind, latency_s=x.latency_s, bandwidth_bps=x.bandwidth_bps)
                for x in links])
            try:
                if watch.outage:
                    self._rejoin(info)             # re-register before anything else once it answers
                try:
                    reply = self.stub.Heartbeat(request, timeout=max(0.2, dead_after))
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.NOT_FOUND:
                        raise
                    self._rejoin(info)             # it came back without our record faster than we noticed
                    reply = self.stub.Heartbeat(request, timeout=max(0.2, dead_after))
            except grpc.RpcError as exc:
                if self._stop.is_set():
                    return
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    self._fail(NodeFailed(self.node_id, self.rank, f"node {self.node_id!r} (rank {self.rank}) was "
                                                                   f"removed by the coordinator: {exc.details()}"))
                    return
                # the coordinator moved to (_reopen) may present a certificate not naming the address
                # dialled: that is not an outage, and waiting for it to end would only end in CoordinatorLost
                mismatch = name_mismatch(self.coordinator, self.credentials, exc, f"node {self.node_id}")
                if mismatch is not None:
                    self._fail(mismatch)
                    return
                if exc.code() not in _UNREACHABLE:     # it answered, and refused: waiting will not change that
                    self._fail(MembershipError(f"node {self.node_id}: coordinator {self.coordinator} refused its "
                                               f"heartbeat: {exc.code().name}: {exc.details()}"))
                    return
                with self._lock:
                    self._pending_links = links + self._pending_links
                if not watch.outage:
                    self.log.warning("node.coordinator_unreachable", coordinator=self.coordinator, code=exc.code().name,
                                     lost_after_s=watch.lost_after)
                try:
                    delay = watch.failed(exc.code().name)
                except CoordinatorLost as lost:
                    self._fail(CoordinatorLost(f"node {self.node_id}: {lost}"))
                    return
                self._reopen()                     # a fresh channel: no gRPC reconnect backoff of its own
                continue
            except ClusterError as exc:            # re-registered under another rank or incarnation
                self._fail(exc)
                return
            if watch.answered():
                self.log.warning("node.coordinator_back", coordinator=self.coordinator, epoch=reply.epoch)
            delay = self.interval
            for member in reply.dead:
                known = self.table.get(member.node.node_id)
                if known is not None and known.node.pid == member.node.pid and member.node.node_id != self.node_id:
                    self._fail(NodeFailed(member.node.node_id, known.node.rank,
                                          f"node {member.node.node_id!r} (rank {known.node.rank}) declared dead by the "
                                          f"coordinator: {member.reason}"))
                    return

    def _rejoin(self, joined_as: pb.NodeInfo) -> None:
        """Join again, as `joined_as` at first but under this node's rank and incarnation (raises
        grpc.RpcError when refused or unreachable)."""
        info = pb.NodeInfo()
        info.CopyFrom(joined_as)
        info.rank = self.rank
        reply = self.stub.Join(pb.JoinRequest(node=info, world_size=self.world_size, incarnation=self.incarnation),
                               timeout=max(0.2, self.interval * self.miss_limit))
        if reply.rank != self.rank or reply.epoch != self.incarnation:
            raise ClusterError(f"node {self.node_id}: re-registered as rank {reply.rank} incarnation {reply.epoch}, "
                               f"expected rank {self.rank} incarnation {self.incarnation}")
        self.rejoins += 1
        self.rejoined.set()
        self.log.info("node.rejoined", rank=self.rank, incarnation=self.incarnation, coordinator=self.coordinator)

    def _reopen(self) -> None:
        """A fresh channel (no gRPC reconnect backoff of its own) to the next coordinator of the list."""
        old = self.channel
        self.coordinator = self.coordinators[(self.coordinators.index(self.coordinator) + 1) % len(self.coordinators)]
        self.channel = open_channel(self.coordinator, self.credentials)
        self.stub = pb_grpc.ClusterStub(self.channel)
        old.close()

    # ---- tinydist.dist ------------------------------------------------------------------------------

    def init_dist(self, timeout: float | None = None) -> None:
        """td.dist.init with this job's rank and world size; rank 0 serves the rendezvous on the
        socket it bound at join (no port race). Node deaths then fail the group's collectives."""
        from tinydist import dist
        if not self.table:
            raise ClusterError("call wait() before init_dist()")
        me = self.table[self.node_id].node.rank
        root = next(m for m in self.table.values() if m.node.rank == 0)
        sock, self._rendezvous = self._rendezvous, None
        if me != 0 and sock is not None:
            sock.close()
            sock = None
        dist.init(rank=me, world_size=len(self.table), coordinator=root.node.rendezvous, timeout=timeout,
                  coordinator_sock=sock)

        def fail_group(failure: ClusterError | NodeFailed) -> None:
            rank = failure.rank if isinstance(failure, NodeFailed) else self.rank
            if dist.is_initialized():
                dist.fail(rank, str(failure))

        self.on_failure(fail_group)

    # ---- life cycle ------------------------------------------------------------------------------------

    def leave(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(max(1.0, self.interval * 2))
        if self.failure is None and self.incarnation:
            try:
                self.stub.Leave(pb.LeaveRequest(node_id=self.node_id), timeout=2.0)
            except grpc.RpcError:
                pass
        self.close()

    def close(self) -> None:
        self._stop.set()
        if self._rendezvous is not None:
            self._rendezvous.close()
            self._rendezvous = None
        self.channel.close()

    def __enter__(self) -> NodeAgent:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.leave()
