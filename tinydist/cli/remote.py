"""CLI commands for remote access: `tinydist node serve` and `tinydist certs init|issue`."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from tinydist.observability import metrics


def _serve(args: argparse.Namespace) -> int:
    from tinydist.nodes.daemon import NodeOptions, prepare, serve
    options = NodeOptions(listen=args.listen, pki=Path(args.pki), policy=Path(args.policy) if args.policy else None,
                          devices=tuple(d.strip() for d in args.devices.split(",") if d.strip()),
                          allow_wildcard=args.allow_wildcard, insecure_loopback_only=args.insecure_loopback_only,
                          insecure_listen=args.insecure_listen, audit=args.audit, lease_ttl_s=args.lease_ttl)
    try:    # the addresses, certificates and policy the flags name: what is wrong with them is a usage error
        prepare(options)
    except (OSError, ValueError) as exc:
        args.parser.error(str(exc))
    with metrics.serving_from_args(args):  # --metrics: Prometheus text on loopback
        asyncio.run(serve(options))
    return 0


def _certs_init(args: argparse.Namespace) -> int:
    from tinydist.security import pki
    try:
        directory = pki.init(Path(args.dir), args.trust_domain, force=args.force)
    except pki.PKIError as exc:
        print(f"tinydist certs init: {exc}", file=sys.stderr)
        return 2
    print(f"lab CA, server certificate and starter policy in {directory}; enrol users in {directory / 'policy.toml'}")
    return 0


def _certs_issue(args: argparse.Namespace) -> int:
    from tinydist.security import pki
    try:
        issued = pki.issue(Path(args.dir), args.name, days=args.days)
    except pki.PKIError as exc:
        print(f"tinydist certs issue: {exc}", file=sys.stderr)
        return 2
    print(f"certificate {issued.cert_path}\nkey         {issued.key_path}\nidentity    {issued.identity}\n"
          f"fingerprint {issued.fingerprint}\nenrol with: \"{issued.identity}\" = \"operator\"  under [identities]")
    return 0


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    node = subparsers.add_parser("node", help="run a node daemon serving local devices over mutual TLS")
    node_commands = node.add_subparsers(dest="node_command", required=True, metavar="ACTION")
    serve = node_commands.add_parser("serve", help="serve this machine's devices (mTLS, roles, audit)")
    serve.add_argument("--listen", default="127.0.0.1:7070", help="HOST:PORT (default 127.0.0.1:7070, loopback)")
    metrics.add_metrics_argument(serve)
    serve.add_argument("--pki", required=True, help="directory with ca.pem, server.pem, server.key (tinydist certs init)")
    serve.add_argument("--policy", help="policy file (default PKI/policy.toml)")
    serve.add_argument("--devices", default="CPU:0", help="comma-separated local devices to export (default CPU:0)")
    serve.add_argument("--allow-wildcard", action="store_true", help="permit listening on the wildcard address")
    serve.add_argument("--insecure-loopback-only", action="store_true",
                       help="also open a plaintext port on loopback for health checks (the device service refuses it)")
    serve.add_argument("--insecure-listen", default="127.0.0.1:7071", help="where --insecure-loopback-only listens")
    serve.add_argument("--audit", default="-", help="audit log file (JSON lines; default stderr)")
    serve.add_argument("--lease-ttl", type=float, default=30.0, help="seconds a client's lease lives without renewal")
    serve.set_defaults(run=_serve)

    certs = subparsers.add_parser("certs", help="lab certificate authority for node access")
    certs_commands = certs.add_subparsers(dest="certs_command", required=True, metavar="ACTION")
    init = certs_commands.add_parser("init", help="create a lab CA, a server certificate and a starter policy")
    init.add_argument("dir")
    init.add_argument("--trust-domain", default="tinydist.lab")
    init.add_argument("--force", action="store_true", help="replace an existing CA")
    init.set_defaults(run=_certs_init)
    issue = certs_commands.add_parser("issue", help="issue a client certificate and key")
    issue.add_argument("dir")
    issue.add_argument("--name", required=True)
    issue.add_argument("--days", type=float, default=30.0)
    issue.set_defaults(run=_certs_issue)
