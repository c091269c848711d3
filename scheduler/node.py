"""The node side of membership: join the coordinator, heartbeat, learn of deaths, start tinydist.dist.

    agent = NodeAgent("127.0.0.1:29500", "node-0", ["CPU:0", "CPU:1"], world_size=2,
                      credentials=Credentials.load())       # TINYDIST_CERT / TINYDIST_KEY / TINYDIST_CA
    agent.join(); agent.wait(); agent.init_dist()           # rank and world from the membership table

A heartbeat thread calls Heartbeat every interval (each call bounded). When the reply names a dead
member of this job, or the coordinator says this node itself was declared dead, or the coordinator
is unreachable for `miss_limit` intervals, the agent records the failure and calls every callback
(scheduler.execute uses one to fail the tinydist.dist group, so a collective in flight raises at
once on this rank instead of waiting for its timeout).
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
from tinydist.scheduler.errors import ClusterError, CoordinatorLost, MembershipError, NodeFailed
from tinydist.scheduler.membership import LinkRecord
from tinydist.scheduler.topology import LinkModel, NodeSpec, Topology
from tinydist.base.logs import get_logger
from tinydist.security.bind import format_address, is_loopback, parse_host_port
from tinydist.security.pki import ClientCredentials as Credentials


def open_channel(target: str, credentials: Credentials | None) -> grpc.Channel:
    if credentials is None:
        if not is_loopback(parse_host_port(target, what="scheduler address")[0]):
            raise ClusterError(f"refusing an insecure channel to {target}: insecure mode is loopback-only")
        return grpc.insecure_channel(target)
    return grpc.secure_channel(target, credentials.channel_credentials())


def status(target: str, credentials: Credentials | None, timeout: float = 10.0) -> pb.ClusterStatus:
    with open_channel(target, credentials) as channel:
        return pb_grpc.ClusterStub(channel).Status(pb.StatusRequest(), timeout=timeout)


def topology_from_status(st: pb.ClusterStatus) -> Topology:
    nodes = [NodeSpec(m.node.node_id, m.node.rank, m.node.host_key, [d.name for d in m.node.devices],
                      tuple(m.node.transports), alive=m.state == "alive") for m in st.members if m.state != "left"]
    topo = Topology(nodes, epoch=st.epoch)
    for link in st.links:
        if link.bandwidth_bps > 0:
            topo.set_measured(link.src, link.dst, LinkModel(link.kind, link.latency_s, 1.0 / link.bandwidth_bps))
    return topo


class NodeAgent:
    def __init__(self, coordinator: str, node_id: str, devices: Sequence[str], *, rank: int = -1, world_size: int = 0,
                 host_key: str | None = None, credentials: Credentials | None = None, address: str = "127.0.0.1",
                 transports: Sequence[str] = ("mem", "shm", "tcp")) -> None:
        from tinydist.dist.rendezvous import host_key as default_host_key
        self.coordinator = coordinator
        self.node_id = node_id
        self.devices = list(devices)
        self.requested_rank = rank
        self.world_size = world_size
        self.host_key = host_key or default_host_key()
        self.address = address
        self.transports = tuple(transports)
        self.channel = open_channel(coordinator, credentials)
        self.stub = pb_grpc.ClusterStub(self.channel)
        self.log = get_logger(component="node-agent", node=node_id)
        self.rank = -1
        self.incarnation = 0
        self.interval = 1.0
        self.miss_limit = 5
        self.table: dict[str, pb.Member] = {}          # the job's members (from wait())
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
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() + delay > deadline:
                    self.close()
                    raise MembershipError(f"node {self.node_id}: join at {self.coordinator} failed: "
                                          f"{exc.code().name}: {exc.details()}") from exc
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
        self.rank, self.incarnation = reply.rank, reply.epoch
        self.interval, self.miss_limit = reply.heartbeat_interval_s, reply.miss_limit
        self._thread = threading.Thread(target=self._heartbeats, name=f"tinydist-heartbeat-{self.node_id}", daemon=True)
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

    def _heartbeats(self) -> None:
        last_ok = time.monotonic()
        while not self._stop.wait(self.interval):
            with self._lock:
                links, self._pending_links = self._pending_links, []
            request = pb.HeartbeatRequest(node_id=self.node_id, epoch=self.incarnation, links=[
                pb.LinkReport(src=x.src, dst=x.dst, kind=x.kind, latency_s=x.latency_s, bandwidth_bps=x.bandwidth_bps)
                for x in links])
            try:
                reply = self.stub.Heartbeat(request, timeout=max(0.2, self.interval * self.miss_limit))
            except grpc.RpcError as exc:
                if self._stop.is_set():
                    return
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    self._fail(NodeFailed(self.node_id, self.rank, f"node {self.node_id!r} (rank {self.rank}) was "
                                                                   f"removed by the coordinator: {exc.details()}"))
                    return
                with self._lock:
                    self._pending_links = links + self._pending_links
                if time.monotonic() - last_ok > self.interval * self.miss_limit:
                    self._fail(CoordinatorLost(f"node {self.node_id}: coordinator {self.coordinator} unreachable for "
                                               f"{time.monotonic() - last_ok:.1f} s ({exc.code().name})"))
                    return
                continue
            last_ok = time.monotonic()
            for member in reply.dead:
                known = self.table.get(member.node.node_id)
                if known is not None and known.node.pid == member.node.pid and member.node.node_id != self.node_id:
                    self._fail(NodeFailed(member.node.node_id, known.node.rank,
                                          f"node {member.node.node_id!r} (rank {known.node.rank}) declared dead by the "
                                          f"coordinator: {member.reason}"))
                    return

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
