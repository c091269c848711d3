"""`tinydist scheduler serve` and `tinydist cluster status` (registered by tinydist.cli)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tinydist.base.arguments import integer, seconds


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


def format_status(st: Any, plan_bytes: int | None = None) -> str:
    from tinydist.scheduler.node import topology_from_status
    lines = [f"cluster epoch {st.epoch}: {sum(m.state == 'alive' for m in st.members)} alive of {len(st.members)} nodes "
             f"(heartbeat {st.heartbeat_interval_s:g} s, dead after {st.miss_limit} misses)", "", "nodes:"]
    lines.append(f"  {'rank':>4}  {'node':<14} {'state':<6} {'host':<28} {'devices':<24} {'transports':<16} seen")
    for m in st.members:
        n = m.node
        state = m.state + (f" ({m.reason})" if m.reason and m.state == "dead" else "")
        lines.append(f"  {n.rank:>4}  {n.node_id:<14} {m.state:<6} {n.host_key[:28]:<28} "
                     f"{','.join(d.name for d in n.devices)[:24]:<24} {','.join(n.transports)[:16]:<16} "
                     f"{m.last_seen_age_s:.2f} s ago" + (f"  [{state}]" if m.state == "dead" else ""))
    lines += ["", "peer groups:"]
    for g in st.groups:
        lines.append(f"  {g.group_id:<4} {g.kind:<8} nodes {','.join(g.nodes)}  devices {' '.join(g.devices)}")
    lines += ["", "links (measured):"]
    if not st.links:
        lines.append("  none reported yet (jobs measure links at start: scheduler.ClusterJob)")
    for link in sorted(st.links, key=lambda x: (x.src, x.dst)):
        lines.append(f"  {link.src:>14} <-> {link.dst:<14} {link.kind:<5} latency {link.latency_s * 1e6:9.1f} µs  "
                     f"bandwidth {link.bandwidth_bps / 1e9:7.3f} GB/s")
    if plan_bytes:
        from tinydist.scheduler.plan import plan_allreduce
        from tinydist.scheduler.errors import PlanError
        try:
            lines += ["", "plan:", plan_allreduce(topology_from_status(st), plan_bytes, log=False).explain()]
        except PlanError as exc:
            lines += ["", f"plan: none ({exc})"]
    return "\n".join(lines)


def _status(args: argparse.Namespace) -> int:
    import grpc

    from tinydist.scheduler.node import status
    from tinydist.security.pki import PKIError
    try:
        st = status(args.coordinator, _credentials(args), timeout=args.timeout)
    except PKIError as exc:
        args.parser.error(str(exc))
    except grpc.RpcError as exc:
        print(f"{args.parser.prog}: error: {args.coordinator}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    if args.json:
        from google.protobuf.json_format import MessageToDict
        print(json.dumps(MessageToDict(st), indent=2))
    else:
        print(format_status(st, args.plan_bytes))
    return 0


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

    cluster = subparsers.add_parser("cluster", help="inspect a running cluster")
    cluster_cmds = cluster.add_subparsers(dest="cluster_command", required=True, metavar="COMMAND")
    st = cluster_cmds.add_parser("status", help="nodes, devices, peer groups and measured links")
    st.add_argument("--coordinator", default="127.0.0.1:29500", help="host:port of `tinydist scheduler serve`")
    st.add_argument("--insecure", action="store_true", help="plaintext to a loopback --insecure-loopback-only coordinator")
    st.add_argument("--cert", help="client certificate (default TINYDIST_CERT)")
    st.add_argument("--key", help="client key (default TINYDIST_KEY)")
    st.add_argument("--ca", help="CA certificate (default TINYDIST_CA)")
    st.add_argument("--json", action="store_true", help="the ClusterStatus message as JSON")
    st.add_argument("--plan-bytes", type=integer(1), help="also print the allreduce plan for this many bytes")
    st.add_argument("--timeout", type=seconds, default=10.0, help="seconds to wait for the coordinator (default 10)")
    st.set_defaults(run=_status)
