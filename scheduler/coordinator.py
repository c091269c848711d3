"""The cluster coordinator: membership over authenticated gRPC (service tinydist.v1.Cluster).

    tinydist scheduler serve --listen 127.0.0.1:29500 --pki ./lab      # mTLS (the remote agent's PKI)
    tinydist scheduler serve --listen 127.0.0.1:0 --insecure-loopback-only   # local tests only

Authentication: with --pki the server presents DIR/server.pem and requires a client certificate
from DIR/ca.pem's CA (`tinydist certs issue DIR --name node-0`); the identity
spiffe://<trust-domain>/user/<name> must name the node a Join/Heartbeat/Leave speaks for (a node
cannot act for another). Status and WaitForMembers need any valid identity. Without --pki the
server runs only with --insecure-loopback-only, binds only loopback and refuses non-loopback peers.

A sweeper runs every heartbeat interval / 2 and declares dead every node silent for `miss_limit`
intervals; heartbeat replies carry the dead list, so every survivor learns of a death within
about (miss_limit + 1) intervals.

State: with `--state-dir DIR` the membership is journaled there (scheduler.journal) and recovered at
start, so a coordinator SIGKILLed and restarted on the same port reports the same members, ranks
and epoch, and its nodes (which kept running their collectives meanwhile) re-register under the
incarnations they hold. Without it the state lives in memory only; nodes still re-register, into an
empty membership (a Heartbeat from a node the coordinator does not know is NOT_FOUND, the node's cue).

Several coordinators: with `--etcd http://HOST:PORT` the membership lives in etcd instead
(scheduler.store.EtcdStore) and any number of coordinators may run against it, each on its own
address. They campaign for one lease-backed leader key; the leader recovers the membership from
etcd and serves, the others answer every call with UNAVAILABLE ("standby; the leader is ..."),
which a node treats like a coordinator that is down: it retries on the next address of its list
(`--coordinator A,B`). When the leader dies its lease expires (`--leader-ttl`, default 5 s), a
standby wins the election, recovers the members, ranks, incarnations and epoch the leader wrote,
and the nodes re-register with it. A leader that loses its lease (stalled past the TTL) finds its
next write refused by etcd (every write is fenced on its leader key) and stands down.
The store's writes are blocking calls on the event loop, as the journal's fsyncs are: one small
request per membership change, none per heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tinydist.scheduler._generated import cluster_pb2 as pb
from tinydist.scheduler._generated import cluster_pb2_grpc as pb_grpc
from tinydist.scheduler.errors import MembershipError, MembershipStoreError
from tinydist.scheduler.membership import LinkRecord, MemberRecord, Membership
from tinydist.scheduler.store import EtcdStore, MembershipStore
from tinydist.base.logs import get_logger
from tinydist.observability import metrics, tracing
from tinydist.security.bind import add_port, bind_address, is_loopback, parse_host_port, split_bind

MAX_WAIT_S = 300.0
SERVICE = pb.DESCRIPTOR.services_by_name["Cluster"].full_name
STATES = ("alive", "dead", "left")

R = TypeVar("R")
Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[R]]


def _code(context: grpc.aio.ServicerContext, exc: BaseException) -> str:
    """The status a handler ended with: the one `context.abort` set, CANCELLED, or UNKNOWN (what
    gRPC answers for an exception it does not map)."""
    if isinstance(exc, asyncio.CancelledError):
        return "CANCELLED"
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    return "UNKNOWN"


def observed(handler: Handler[R]) -> Handler[R]:
    """Count and time each call of a Cluster RPC handler (grpc_server_* metrics, go-grpc-prometheus
    labels) and trace it as a span on the scheduler's `rpc` lane."""
    method = handler.__name__

    @functools.wraps(handler)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> R:
        started, code = tracing.clock(), "OK"
        metrics.rpc_metrics(SERVICE, method, "unary").start()
        try:
            return await handler(self, request, context)
        except BaseException as exc:
            code = _code(context, exc)
            raise
        finally:
            metrics.record_rpc(method, code, (tracing.clock() - started) / 1e9, SERVICE, "unary", started=False)
            tracing.record(f"rpc {method}", started, process="scheduler", lane="rpc", cat="rpc", method=method,
                           node=getattr(request, "node_id", "") or getattr(getattr(request, "node", None), "node_id", ""),
                           status=code)
    return wrapper


def leader_only(handler: Handler[R]) -> Handler[R]:
    """A standby coordinator answers UNAVAILABLE (the nodes' cue to try the next address); an elected
    leader whose store fails a write (LeadershipLost, an unreachable etcd) stands down and answers
    the same: it cannot vouch for a change it could not write."""

    @functools.wraps(handler)
    async def wrapper(self: ClusterService, request: Any, context: grpc.aio.ServicerContext) -> R:
        if self.standby is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.standby)
        try:
            return await handler(self, request, context)
        except MembershipStoreError as exc:
            if not self.elected:
                raise
            self.stand_down(str(exc))
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    return wrapper


class MembershipCollector(Collector):
    """The coordinator's membership, read at scrape time: members by state, the epoch, the world size."""

    def __init__(self, membership: Membership) -> None:
        self.m = membership

    def collect(self) -> Iterator[Any]:
        members = GaugeMetricFamily("tinydist_cluster_members", "Cluster members by state (alive, dead, left).",
                                    labels=["state"])
        counts = dict.fromkeys(STATES, 0)
        for record in list(self.m.members.values()):
            counts[record.state] = counts.get(record.state, 0) + 1
        for state, n in counts.items():
            members.add_metric([state], n)
        yield members
        yield GaugeMetricFamily("tinydist_cluster_epoch", "Membership epoch: it grows at every join, leave and death.",
                                value=self.m.epoch)
        yield GaugeMetricFamily("tinydist_cluster_world_size", "The world size the members joined with (0: not yet known).",
                                value=self.m.world_size or 0)


def _peer_is_loopback(peer: str) -> bool:
    # grpc peer strings: "ipv4:127.0.0.1:1234", "ipv6:[::1]:1234"
    kind, _, rest = peer.partition(":")
    return kind in ("ipv4", "ipv6") and is_loopback(parse_host_port(rest, what="peer")[0])


def member_message(record: MemberRecord, now: float) -> pb.Member:
    info = record.info
    node = pb.NodeInfo(node_id=record.node_id, host_key=record.host_key, address=info.get("address", ""),
                       devices=[pb.NodeDevice(name=d, kind=d.split(":")[0].lower()) for d in record.devices],
                       transports=list(record.transports), rank=record.rank, rendezvous=info.get("rendezvous", ""),
                       pid=int(info.get("pid", 0)))
    return pb.Member(node=node, state=record.state, last_seen_age_s=max(0.0, now - record.last_seen), reason=record.reason)


def status_message(m: Membership) -> pb.ClusterStatus:
    now = m.clock()
    topo = m.topology()
    groups = [pb.PeerGroup(group_id=g.group_id, kind=g.kind, nodes=[n.node_id for n in g.nodes], devices=g.devices)
              for g in topo.groups()]
    links = [pb.LinkReport(src=link.src, dst=link.dst, kind=link.kind, latency_s=link.latency_s,
                           bandwidth_bps=link.bandwidth_bps) for link in m.links.values()]
    return pb.ClusterStatus(epoch=m.epoch, members=[member_message(r, now) for r in m.ordered()], groups=groups, links=links,
                            heartbeat_interval_s=m.heartbeat_interval, miss_limit=m.miss_limit)


class ClusterService(pb_grpc.ClusterServicer):
    def __init__(self, membership: Membership, trust_domain: str | None) -> None:
        self.m = membership
        self.trust_domain = trust_domain            # None: insecure loopback mode
        self.standby: str | None = None             # why this coordinator does not serve (etcd: not the leader)
        self.elected = False                        # etcd mode: a leader among coordinators, which may stand down
        self.on_stand_down: Callable[[str], None] = lambda why: None
        self.changed = asyncio.Condition()
        self.log = get_logger(component="scheduler")
        if trust_domain is not None:
            from tinydist.security.identity import PeerCache
            self._cache = PeerCache()

    async def _who(self, context: grpc.aio.ServicerContext) -> str | None:
        """The caller's node name (mTLS), or None in insecure loopback mode. Aborts if not acceptable."""
        if self.trust_domain is None:
            if not _peer_is_loopback(context.peer()):
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, "insecure coordinator: loopback peers only")
            return None
        from tinydist.security.identity import IdentityError, peer_from_auth_context
        try:
            peer = peer_from_auth_context(context.auth_context(), self.trust_domain, self._cache)
        except IdentityError as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        return peer.identity.rsplit("/", 1)[-1]

    async def _check_node(self, context: grpc.aio.ServicerContext, node_id: str) -> None:
        who = await self._who(context)
        if who is not None and who != node_id:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"certificate names {who!r}; it may not speak for node {node_id!r}")

    def stand_down(self, why: str) -> None:
        if self.standby is None:
            self.log.warning("scheduler.stand_down", reason=why)
            self.standby = f"standby coordinator: {why}"
            self.on_stand_down(why)

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    @observed
    @leader_only
    async def Join(self, request: pb.JoinRequest, context: grpc.aio.ServicerContext) -> pb.JoinReply:
        node = request.node
        await self._check_node(context, node.node_id)
        try:
            record = self.m.join(node.node_id, node.host_key or node.node_id, [d.name for d in node.devices],
                                 tuple(node.transports) or ("mem", "shm", "tcp"), node.rank, request.world_size,
                                 {"address": node.address, "rendezvous": node.rendezvous, "pid": node.pid},
                                 incarnation=request.incarnation)
        except MembershipError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        self.log.info("scheduler.rejoin" if request.incarnation else "scheduler.join", node=node.node_id,
                      rank=record.rank, devices=record.devices, epoch=self.m.epoch)
        await self._notify()
        return pb.JoinReply(rank=record.rank, epoch=record.incarnation, heartbeat_interval_s=self.m.heartbeat_interval,
                            miss_limit=self.m.miss_limit)

    @observed
    @leader_only
    async def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext) -> pb.HeartbeatReply:
        await self._check_node(context, request.node_id)
        if request.node_id not in self.m.members:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"node {request.node_id} is not a member (a coordinator "
                                                           f"restarted without --state-dir?); join again")
        links = [LinkRecord(x.src, x.dst, x.kind, x.latency_s, x.bandwidth_bps) for x in request.links
                 if x.src == request.node_id]      # a node reports only its own links
        try:
            dead = self.m.heartbeat(request.node_id, request.epoch, links)
        except MembershipError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        now = self.m.clock()
        return pb.HeartbeatReply(epoch=self.m.epoch, dead=[member_message(r, now) for r in dead])

    @observed
    @leader_only
    async def WaitForMembers(self, request: pb.WaitRequest, context: grpc.aio.ServicerContext) -> pb.ClusterStatus:
        await self._who(context)
        timeout = min(max(request.timeout_s, 0.0), MAX_WAIT_S)
        world = request.world_size or self.m.world_size
        if world <= 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "world_size is unknown: pass it or join with it")

        async def ready() -> None:
            async with self.changed:
                await self.changed.wait_for(lambda: self.m.ready(world))

        try:
            await asyncio.wait_for(ready(), timeout)
        except TimeoutError:
            have = sorted(r.rank for r in self.m.members.values() if r.state == "alive")
            missing = sorted(set(range(world)) - set(have))
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"ranks {missing} of {world} did not join within {timeout:g} s")
        return status_message(self.m)

    @observed
    @leader_only
    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.ClusterStatus:
        await self._who(context)
        return status_message(self.m)

    @observed
    @leader_only
    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext) -> pb.LeaveReply:
        await self._check_node(context, request.node_id)
        self.m.leave(request.node_id)
        self.log.info("scheduler.leave", node=request.node_id, epoch=self.m.epoch)
        await self._notify()
        return pb.LeaveReply(epoch=self.m.epoch)


    @observed
    @leader_only
    async def Rendezvous(self, request: pb.RendezvousRequest, context: grpc.aio.ServicerContext) -> pb.RoundReply:
        await self._check_node(context, request.node_id)
        info = {"rendezvous": request.rendezvous} if request.rendezvous else None
        try:
            r = self.m.rendezvous(request.node_id, request.incarnation, request.min_size, request.max_size,
                                  request.last_call_s, info)
        except MembershipError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        self.log.info("scheduler.rendezvous", node=request.node_id, round=r.number, waiting=len(r.participants),
                      min=r.min_size, max=r.max_size)
        await self._notify()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(max(request.timeout_s, 0.0), MAX_WAIT_S)
        while not r.closed:
            if self.m.round is r and self.m.close_round():
                self.log.info("scheduler.round_closed", round=r.number, world_size=len(r.ranks or {}))
                await self._notify()
                break
            left = deadline - loop.time()
            if left <= 0:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"round {r.number} did not close within {request.timeout_s:g} s: "
                                    f"{len(r.participants)} of min {r.min_size} members in ({sorted(r.participants)})")
            async with self.changed:        # an arrival or a death wakes us; last call is checked each 50 ms
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), min(left, 0.05))
        ranks = r.ranks or {}                # a closed round has its ranks; none reads as having dropped out
        if ranks.get(request.node_id) is None or r.participants.get(request.node_id) != request.incarnation:
            await context.abort(grpc.StatusCode.ABORTED, f"node {request.node_id} incarnation {request.incarnation} "
                                                         f"dropped out of round {r.number} before it closed; ask again")
        now = self.m.clock()
        members = []
        for record in self.m.round_members(ranks):
            member = member_message(record, now)
            member.node.rank = ranks[record.node_id]
            members.append(member)
        return pb.RoundReply(round=r.number, rank=ranks[request.node_id], world_size=len(members), members=members,
                             epoch=self.m.epoch)


class Coordinator:
    """A running coordinator: `await Coordinator.start(...)`, `.port`, `await .stop()`."""

    def __init__(self, membership: Membership, host: str, etcd: EtcdStore | None, recovered: int) -> None:
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.host = host
        self.membership = membership                # replaced by etcd's at each win of the leadership
        self.recovered = recovered                  # store records replayed at start (after the snapshot)
        self.etcd = etcd
        self.service: ClusterService | None = None
        self.leading = asyncio.Event()              # set while this coordinator serves (always, without etcd)
        self._tasks: list[asyncio.Task[None]] = []
        self._collector: MembershipCollector | None = None
        self._stopping = False
        self._stopped = asyncio.Event()

    @classmethod
    async def start(cls, listen: str = "127.0.0.1:0", *, pki: Path | None = None, insecure_loopback_only: bool = False,
                    heartbeat_interval: float = 1.0, miss_limit: int = 5, state_dir: Path | None = None,
                    etcd: str | None = None, etcd_prefix: str = "/tinydist/scheduler/", leader_ttl: int = 5,
                    name: str | None = None) -> Coordinator:
        """`state_dir`: the journal (scheduler.journal); `etcd`: client URLs of the etcd cluster that
        holds the membership and elects one leader among the coordinators sharing `etcd_prefix`;
        neither: in memory only. With etcd, start returns once serving, leader or standby
        (`leading` tells which)."""
        if pki is None and not insecure_loopback_only:
            raise ValueError("the coordinator needs --pki DIR (mutual TLS) or --insecure-loopback-only")
        if heartbeat_interval <= 0 or miss_limit < 1:
            raise ValueError("heartbeat interval must be > 0 and miss limit >= 1")
        if state_dir is not None and etcd is not None:
            raise ValueError("give --state-dir (one coordinator, journal on disk) or --etcd (several coordinators, "
                             "membership in etcd), not both")
        bind = bind_address(listen, loopback_only=pki is None, wildcard_hint="bind the interface the nodes reach")
        store: MembershipStore | None = None
        if state_dir is not None:
            from tinydist.scheduler.journal import Journal
            store = Journal(state_dir)
        etcd_store: EtcdStore | None = None
        if etcd is not None:
            import os
            import socket
            etcd_store = EtcdStore(etcd, name or f"{socket.gethostname()}:{os.getpid()}", prefix=etcd_prefix,
                                   ttl=leader_ttl)
            etcd_store.client.get(etcd_store.leader_key)     # an etcd it cannot reach fails the start, not a task
        membership = Membership(heartbeat_interval, miss_limit, store=store)
        try:
            recovered = membership.recover()
        except BaseException:
            if store is not None:
                store.close()
            raise
        self = cls(membership, split_bind(bind)[0], etcd_store, recovered)
        self._collector = MembershipCollector(self.membership)
        metrics.REGISTRY.register(self._collector)
        trust_domain = None
        credentials = None
        if pki is not None:
            from tinydist.security.pki import trust_domain_of
            from tinydist.security.pki import ServerCredentials
            keys = ServerCredentials.load(Path(pki))
            trust_domain = trust_domain_of(Path(pki))
            credentials = grpc.ssl_server_credentials([(keys.key, keys.cert)], root_certificates=keys.ca,
                                                      require_client_auth=True)
        service = self.service = ClusterService(self.membership, trust_domain)
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_ClusterServicer_to_server(service, self.server)
        self.port = add_port(self.server, bind, credentials)
        loop = asyncio.get_running_loop()
        if self.etcd is not None:
            service.standby = "standby coordinator: campaigning for the etcd leader key"
            service.elected = True
            self._tasks.append(loop.create_task(self._lead(self.etcd, service)))
        else:
            self.leading.set()
        await self.server.start()

        async def sweep() -> None:
            log = get_logger(component="scheduler")
            while True:
                await asyncio.sleep(heartbeat_interval / 2)
                if service.standby is not None:
                    continue
                started = tracing.clock()
                m = service.m
                try:
                    dead = m.sweep()
                except MembershipStoreError as exc:
                    if not service.elected:
                        raise
                    service.stand_down(str(exc))
                    continue
                for record in dead:
                    log.warning("scheduler.node_dead", node=record.node_id, rank=record.rank, reason=record.reason)
                await service._notify()
                tracing.record("sweep", started, process="scheduler", lane="rounds", cat="scheduler",
                               epoch=m.epoch, alive=m.alive_count(), declared_dead=len(dead))

        self._tasks.append(loop.create_task(sweep()))
        return self

    async def _lead(self, store: EtcdStore, service: ClusterService) -> None:
        """Campaign; once leader, recover the membership from etcd and serve; stand by again when the
        lease is lost (or a write is refused), with a fresh membership from etcd at the next win."""
        log = get_logger(component="scheduler")
        lost = asyncio.Event()
        service.on_stand_down = lambda why: lost.set()
        while not self._stopping:
            old = service.m
            m = Membership(old.heartbeat_interval, old.miss_limit, store=store)
            try:
                won = await asyncio.to_thread(store.campaign, self.address, lambda: self._stopping)
                if not won:
                    return
                self.recovered = await asyncio.to_thread(m.recover)
            except MembershipStoreError as exc:     # etcd away, or a membership it cannot vouch for: retry
                log.error("scheduler.campaign_failed", error=str(exc), retry_s=store.ttl)
                service.standby = f"standby coordinator: {exc}"
                await asyncio.to_thread(store.resign)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopped.wait(), store.ttl)
                continue
            self.membership = service.m = m
            if self._collector is not None:
                self._collector.m = m
            lost.clear()
            service.standby = None
            self.leading.set()
            log.info("scheduler.leading", etcd=store.client.endpoints, epoch=m.epoch, members=len(m.members),
                     replayed=self.recovered)
            print(f"tinydist scheduler {self.address} leads (etcd {','.join(store.client.endpoints)}): recovered "
                  f"epoch {m.epoch}, {len(m.members)} members, {self.recovered} records replayed", flush=True)
            while not lost.is_set() and not store.lost.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(lost.wait(), store.ttl / 4)
            self.leading.clear()
            service.stand_down("the etcd lease was lost or another coordinator leads; campaigning again")
            await asyncio.to_thread(store.resign)
            # a coordinator that just lost its lease is the likely unhealthy one (it stalled): leave the
            # key to the standbys (they poll every TTL/4) for one TTL before campaigning again
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), store.ttl)

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    async def stop(self, grace: float = 0.5) -> None:
        self._stopping = True
        self._stopped.set()
        if self._collector is not None:
            metrics.REGISTRY.unregister(self._collector)
            self._collector = None
        if self.etcd is not None:                   # ends a campaign within one poll; revokes a leader's lease
            await asyncio.to_thread(self.etcd.close)
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.server is not None:
            await self.server.stop(grace)
        if self.membership.store is not None and self.etcd is None:
            self.membership.store.close()


async def serve(listen: str, pki: Path | None, insecure_loopback_only: bool, heartbeat_interval: float, miss_limit: int,
                port_file: Path | None = None, state_dir: Path | None = None, etcd: str | None = None,
                etcd_prefix: str = "/tinydist/scheduler/", leader_ttl: int = 5, name: str | None = None) -> None:
    """`tinydist scheduler serve`: run until SIGINT/SIGTERM."""
    import signal
    metrics.set_component("scheduler")
    coordinator = await Coordinator.start(listen, pki=pki, insecure_loopback_only=insecure_loopback_only,
                                          heartbeat_interval=heartbeat_interval, miss_limit=miss_limit,
                                          state_dir=state_dir, etcd=etcd, etcd_prefix=etcd_prefix,
                                          leader_ttl=leader_ttl, name=name)
    mode = "mTLS" if pki is not None else "INSECURE loopback-only"
    m = coordinator.membership
    if etcd is not None:
        state = (f"state in etcd {etcd} under {etcd_prefix!r}, one leader among the coordinators sharing it "
                 f"(lease TTL {leader_ttl} s): campaigning")
    elif state_dir is not None:
        state = (f"state in {state_dir}: recovered epoch {m.epoch}, {len(m.members)} members, "
                 f"{coordinator.recovered} journal records replayed")
    else:
        state = "state in memory only (no --state-dir)"
    print(f"tinydist scheduler serving {coordinator.address} ({mode}, heartbeat {heartbeat_interval:g} s, "
          f"dead after {miss_limit} misses; {state})", flush=True)
    if port_file is not None:
        port_file.write_text(coordinator.address)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await coordinator.stop()
