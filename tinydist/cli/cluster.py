"""`tinydist scheduler serve`, `tinydist node join` and `tinydist cluster status` (registered by tinydist.cli).

`node join` is what `tinydist.scheduler.execute.ClusterJob.start` does, from flags: join the
coordinator, wait for the job's members, start tinydist.dist, measure the links and report them; it
then holds the node in the cluster (heartbeats) until SIGTERM or Ctrl-C, when it leaves cleanly.

`cluster status --json` prints every field of the ClusterStatus message under its proto (snake_case)
name, defaults included (rank 0, an empty reason), numbers as JSON numbers (protobuf's own JSON
mapping drops defaults, camelCases the names and writes 64-bit integers as strings).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from tinydist.base.arguments import endpoint, integer, seconds


def _address(text: str) -> str:
    """A coordinator's HOST:PORT, checked when the flags are parsed (a bad one is a usage error, exit 2)."""
    endpoint(text)
    return text


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from tinydist.scheduler.coordinator import serve
    from tinydist.observability import metrics
    from tinydist.security.bind import bind_address
    from tinydist.security.pki import ServerCredentials
    if args.pki is None and not args.insecure_loopback_only:
        args.parser.error("give --pki DIR (mutual TLS) or --insecure-loopback-only (plaintext, loopback, for tests)")
    try:    # what the flags name, checked before anything binds: a usage error
        bind_address(args.listen, loopback_only=args.pki is None, wildcard_hint="bind the interface the nodes reach")
        if args.pki is not None:
            ServerCredentials.load(args.pki)
    except (OSError, ValueError) as exc:
        args.parser.error(str(exc))
    if args.state_dir is not None and args.etcd is not None:
        args.parser.error("give --state-dir (one coordinator, journal on disk) or --etcd (several coordinators, "
                          "membership in etcd), not both")
    from tinydist.scheduler.errors import MembershipStoreError
    try:
        with metrics.serving_from_args(args):  # --metrics: Prometheus text on loopback
            asyncio.run(serve(args.listen, args.pki, args.insecure_loopback_only, args.heartbeat_interval,
                              args.miss_limit, args.port_file, args.state_dir, args.etcd, args.etcd_prefix,
                              args.leader_ttl, args.name))
    except MembershipStoreError as exc:     # a corrupt or locked --state-dir, an etcd it cannot use: never served
        print(f"{args.parser.prog}: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _credentials(args: argparse.Namespace) -> Any:
    from tinydist.scheduler.node import Credentials
    if args.insecure:
        return None
    return Credentials.load(args.cert, args.key, args.ca)


def message_dict(message: Any) -> dict[str, Any]:
    """Every field of a protobuf message under its proto name, defaults included, typed: integers
    (uint64 too) as ints, doubles as floats, nested messages as dicts, repeated fields as lists."""
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        nested = field.message_type is not None
        if field.is_repeated:
            out[field.name] = [message_dict(v) if nested else v for v in value]
        else:
            out[field.name] = message_dict(value) if nested else value
    return out


def plan_dict(plan: Any) -> dict[str, Any]:
    """A `scheduler.plan.Plan` as JSON-ready data: what `Plan.explain()` prints, as fields."""
    def link(model: Any) -> dict[str, Any] | None:
        if model is None:
            return None
        return {"kind": model.kind, "latency_s": model.alpha, "bandwidth_bps": model.bandwidth}
    return {"collective": plan.collective, "nbytes": plan.nbytes, "epoch": plan.epoch, "strategy": plan.strategy,
            "intra_algorithm": plan.intra_algorithm, "inter_algorithm": plan.inter_algorithm,
            "modelled_s": plan.modelled_s,
            "stages": [{"name": st.name, "algorithm": st.algorithm, "participants": st.participants,
                        "modelled_s": st.modelled_s, "link": link(st.link), "detail": st.detail} for st in plan.stages],
            "candidates": dict(plan.candidates), "reason": plan.reason, "ring_order": list(plan.ring_order),
            "notes": list(plan.notes)}


def _plan(st: Any, plan_bytes: int) -> Any:
    """The allreduce plan on the status's topology; a PlanError (no live nodes, dead links) propagates."""
    from tinydist.scheduler.node import topology_from_status
    from tinydist.scheduler.plan import plan_allreduce
    return plan_allreduce(topology_from_status(st), plan_bytes, log=False)


def _table(header: list[str], rows: list[list[str]], right: frozenset[int] = frozenset()) -> list[str]:
    """Columns as wide as their widest cell (a host key or a device list is never cut short)."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    def line(cells: list[str]) -> str:
        return "  " + "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return [line(header).rstrip()] + [line(r).rstrip() for r in rows]


def format_status(st: Any, plan_bytes: int | None = None) -> str:
    lines = [f"cluster epoch {st.epoch}: {sum(m.state == 'alive' for m in st.members)} alive of {len(st.members)} nodes "
             f"(heartbeat {st.heartbeat_interval_s:g} s, dead after {st.miss_limit} misses)", "", "nodes:"]
    rows = [[str(m.node.rank), m.node.node_id, m.state, m.node.host_key, ",".join(d.name for d in m.node.devices),
             ",".join(m.node.transports), f"{m.last_seen_age_s:.2f} s ago", m.reason if m.state == "dead" else ""]
            for m in st.members]
    lines += _table(["rank", "node", "state", "host", "devices", "transports", "seen", "reason"], rows, frozenset({0}))
    lines += ["", "peer groups:"]
    for g in st.groups:
        lines.append(f"  {g.group_id:<4} {g.kind:<8} nodes {','.join(g.nodes)}  devices {' '.join(g.devices)}")
    lines += ["", "links (measured):"]
    if not st.links:
        lines.append("  none reported yet (nodes measure links when they join: tinydist node join)")
    for link in sorted(st.links, key=lambda x: (x.src, x.dst)):
        lines.append(f"  {link.src:>14} <-> {link.dst:<14} {link.kind:<5} latency {link.latency_s * 1e6:9.1f} µs  "
                     f"bandwidth {link.bandwidth_bps / 1e9:7.3f} GB/s")
    if plan_bytes:
        from tinydist.scheduler.errors import PlanError
        try:
            lines += ["", "plan:", _plan(st, plan_bytes).explain()]
        except PlanError as exc:
            lines += ["", f"plan: none ({exc})"]
    return "\n".join(lines)


def _status(args: argparse.Namespace) -> int:
    import grpc

    from tinydist.scheduler.errors import SchedulerNameMismatch
    from tinydist.scheduler.node import status
    from tinydist.security.pki import PKIError
    try:
        st = status(args.coordinator, _credentials(args), timeout=args.timeout)
    except PKIError as exc:
        args.parser.error(str(exc))
    except SchedulerNameMismatch as exc:
        print(f"{args.parser.prog}: error: {exc}", file=sys.stderr)
        return 1
    except grpc.RpcError as exc:
        print(f"{args.parser.prog}: error: {args.coordinator}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    if args.json:
        data = message_dict(st)
        if args.plan_bytes:
            from tinydist.scheduler.errors import PlanError
            try:
                data["plan"] = plan_dict(_plan(st, args.plan_bytes))
            except PlanError as exc:       # no plan is part of the status, not a failure of the command
                data["plan"], data["plan_error"] = None, str(exc)
        print(json.dumps(data, indent=2, ensure_ascii=False))
    else:
        print(format_status(st, args.plan_bytes))
    return 0


def _join(args: argparse.Namespace) -> int:
    from tinydist.scheduler.execute import ClusterJob
    from tinydist.security.pki import PKIError
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    if not devices:
        args.parser.error(f"--devices: expected a comma-separated list like CPU:0,CPU:1, got {args.devices!r}")
    try:
        credentials = _credentials(args)
    except PKIError as exc:
        args.parser.error(str(exc))
    job = ClusterJob.start(args.coordinator, args.node_id, devices, world_size=args.world_size, rank=args.rank,
                           credentials=credentials, host_key=args.host_key, wait_timeout=args.wait_timeout,
                           probe=not args.no_probe, address=args.address)
    stop = threading.Event()
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):   # once joined, a requested stop: leave cleanly, exit 0
            signal.signal(sig, lambda *_: stop.set())
        job.agent.on_failure(lambda _failure: stop.set())   # a peer declared dead, the coordinator lost
        joined = {"node_id": job.agent.node_id, "rank": job.rank, "world_size": job.world_size,
                  "epoch": job.topology().epoch, "devices": job.devices, "host_key": job.agent.host_key,
                  "coordinator": args.coordinator, "members": job.node_ids(), "links_measured": not args.no_probe}
        if args.json:
            print(json.dumps(joined), flush=True)
        else:
            print(f"{joined['node_id']}: joined {args.coordinator} as rank {joined['rank']} of {joined['world_size']} "
                  f"(epoch {joined['epoch']}, devices {','.join(job.devices)}, members {','.join(job.node_ids())}); "
                  "holding until SIGTERM or Ctrl-C", flush=True)
        stop.wait()
        if job.agent.failure is not None:
            raise job.agent.failure
    finally:
        job.close()
    return 0


def _add_credentials(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--insecure", action="store_true",
                        help="plaintext to a loopback --insecure-loopback-only coordinator")
    parser.add_argument("--cert", help="client certificate (default TINYDIST_CERT)")
    parser.add_argument("--key", help="client key (default TINYDIST_KEY)")
    parser.add_argument("--ca", help="CA certificate (default TINYDIST_CA)")


def _node_commands(subparsers: Any) -> Any:
    """The `node` command's subcommands (tinydist.cli.remote adds `node serve`; made here if it is absent)."""
    node = subparsers.choices.get("node")
    if node is None:
        node = subparsers.add_parser("node", help="node commands")
        node.add_subparsers(dest="node_command", required=True, metavar="ACTION")
    return next(a for a in node._actions if isinstance(a, argparse._SubParsersAction))


def add_commands(subparsers: Any) -> None:
    sched = subparsers.add_parser("scheduler", help="the cluster coordinator (membership, heartbeats, status)")
    sched_cmds = sched.add_subparsers(dest="scheduler_command", required=True, metavar="COMMAND")
    serve = sched_cmds.add_parser("serve", help="serve the tinydist.v1.Cluster gRPC service until SIGTERM")
    from tinydist.observability import metrics
    metrics.add_metrics_argument(serve)
    serve.add_argument("--listen", default="127.0.0.1:29500", help="IP:port to bind (never the wildcard; port 0 picks one)")
    serve.add_argument("--pki", type=Path, help="certificate directory from `tinydist certs init` (mutual TLS)")
    serve.add_argument("--insecure-loopback-only", action="store_true", help="no TLS; loopback address and peers only (tests)")
    serve.add_argument("--heartbeat-interval", type=seconds, default=1.0, help="seconds between node heartbeats")
    serve.add_argument("--miss-limit", type=integer(1), default=5, help="missed heartbeats before a node is declared dead")
    serve.add_argument("--port-file", type=Path, help="write the bound host:port here once serving")
    serve.add_argument("--state-dir", type=Path,
                       help="journal membership and epochs here (write-ahead, fsynced) and recover them at start, so "
                            "a restarted scheduler keeps its members; default: in memory only")
    serve.add_argument("--etcd", metavar="URL[,URL...]",
                       help="keep membership and epochs in this etcd cluster (client URLs, http://HOST:PORT) instead: "
                            "several coordinators may share it, one leads (etcd lease + election), the others stand by")
    serve.add_argument("--etcd-prefix", default="/tinydist/scheduler/",
                       help="etcd key prefix of this cluster's membership and leader key (one per cluster)")
    serve.add_argument("--leader-ttl", type=integer(2), default=5,
                       help="seconds the leader's etcd lease outlives its last renewal: how long a killed leader "
                            "holds the lead before a standby takes over")
    serve.add_argument("--name", help="this coordinator's name in the etcd leader key (default HOST:PID)")
    serve.set_defaults(run=_serve)

    join = _node_commands(subparsers).add_parser(
        "join", help="join a running scheduler as a cluster node and hold until SIGTERM",
        description="Join `tinydist scheduler serve` at --coordinator, wait for --world-size nodes, start "
                    "tinydist.dist between them, measure and report the links, then heartbeat until SIGTERM or "
                    "Ctrl-C, and leave (what tinydist.scheduler.execute.ClusterJob.start does in Python).")
    join.add_argument("--coordinator", default="127.0.0.1:29500", type=_address, help="host:port of `tinydist scheduler serve`")
    join.add_argument("--node-id", required=True, help="this node's id (with mTLS: the name in its certificate)")
    join.add_argument("--world-size", type=integer(1), required=True, help="nodes in the job; waits for them all")
    join.add_argument("--devices", default="CPU:0", help="comma-separated local devices (default CPU:0)")
    join.add_argument("--rank", type=integer(-1), default=-1, help="the rank to ask for (default -1: the lowest free)")
    join.add_argument("--host-key", help="nodes with one host key share memory (default: this host's)")
    join.add_argument("--address",
                      help="interface the other nodes reach this one on (default TINYDIST_NODE_HOST, else the Slurm "
                           "node's address, else loopback; a non-loopback one needs TINYDIST_COORDINATOR_ALLOW_REMOTE=1)")
    join.add_argument("--wait-timeout", type=seconds, default=60.0, help="seconds to wait for the members (default 60)")
    join.add_argument("--no-probe", action="store_true", help="do not measure the links at start")
    join.add_argument("--json", action="store_true", help="print the joined line as one JSON object")
    _add_credentials(join)
    join.set_defaults(run=_join)

    cluster = subparsers.add_parser("cluster", help="inspect a running cluster")
    cluster_cmds = cluster.add_subparsers(dest="cluster_command", required=True, metavar="COMMAND")
    st = cluster_cmds.add_parser("status", help="nodes, devices, peer groups and measured links")
    st.add_argument("--coordinator", default="127.0.0.1:29500", type=_address, help="host:port of `tinydist scheduler serve`")
    _add_credentials(st)
    st.add_argument("--json", action="store_true",
                    help="every ClusterStatus field as JSON (snake_case, defaults included, numbers as numbers)")
    st.add_argument("--plan-bytes", type=integer(1), help="also print the allreduce plan for this many bytes")
    st.add_argument("--timeout", type=seconds, default=10.0, help="seconds to wait for the coordinator (default 10)")
    st.set_defaults(run=_status)
