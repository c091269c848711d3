"""CLI commands for remote access: `tinydist node serve|status` and `tinydist certs init|server|issue|enrol|revoke|list`."""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
from pathlib import Path
from typing import Any

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


def _sans(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    from tinydist.security import pki
    try:
        this_host = pki.this_host_sans() if args.this_host else []
        return pki.split_sans(["localhost", "127.0.0.1", "::1", *this_host, *args.server_san])
    except pki.PKIError as exc:
        args.parser.error(str(exc))
        raise  # parser.error exits


def _certs_init(args: argparse.Namespace) -> int:
    from tinydist.security import pki
    dns, ips = _sans(args)
    try:
        directory = pki.init(Path(args.dir), args.trust_domain, server_dns=dns, server_ips=ips, force=args.force)
    except pki.PKIError as exc:   # an existing CA, a bad trust domain: what the flags asked for
        print(f"tinydist certs init: error: {exc}", file=sys.stderr)
        return 2
    names = ", ".join([f"DNS:{d}" for d in dns] + [f"IP:{i}" for i in ips])
    print(f"lab CA (key in {directory / pki.CA_KEY}), server certificate for {names}, starter policy in {directory}\n"
          f"next: tinydist certs issue {directory} --name NAME, then tinydist certs enrol {directory} --name NAME --role operator")
    return 0


def _certs_server(args: argparse.Namespace) -> int:
    from tinydist.security import pki
    dns, ips = _sans(args)
    names = pki.issue_server(Path(args.dir), dns, ips, days=args.days)
    print(f"server certificate {Path(args.dir) / 'server.pem'} for {', '.join(names)}; restart the node to serve it")
    return 0


def _certs_etcd(args: argparse.Namespace) -> int:
    from tinydist.security import pki
    dns, ips = _sans(args)
    names = pki.issue_etcd(Path(args.dir), dns, ips, days=args.days)
    etcd = Path(args.dir) / pki.ETCD_DIR
    print(f"etcd server certificate {etcd / 'server.pem'} for {', '.join(names)}; serve it with\n"
          f"  etcd --client-cert-auth --trusted-ca-file {Path(args.dir) / 'ca.pem'} --cert-file {etcd / 'server.pem'} "
          f"--key-file {etcd / 'server.key'} --listen-client-urls https://HOST:2379 ...\n"
          f"and point the scheduler at it: TINYDIST_ETCD_CA={Path(args.dir) / 'ca.pem'} TINYDIST_ETCD_CERT=... "
          f"TINYDIST_ETCD_KEY=... (a client certificate: tinydist certs issue {args.dir} --name NAME)")
    return 0


def _certs_issue(args: argparse.Namespace) -> int:
    from tinydist.security import pki
    try:
        issued = pki.issue(Path(args.dir), args.name, days=args.days)
    except pki.PKIError as exc:   # a bad name or validity, or no CA here
        print(f"tinydist certs issue: error: {exc}", file=sys.stderr)
        return 2
    print(f"certificate {issued.cert_path}\nkey         {issued.key_path}\nidentity    {issued.identity}\n"
          f"fingerprint {issued.fingerprint}\nenrol with:  tinydist certs enrol {args.dir} --name {args.name} --role operator")
    return 0


def _policy_path(args: argparse.Namespace) -> Path:
    return Path(args.policy) if args.policy else Path(args.dir) / "policy.toml"


def _identity(args: argparse.Namespace) -> str:
    from tinydist.security import pki
    if args.name.startswith("spiffe://"):
        return str(args.name)
    if not pki.NAME_RE.match(args.name):
        args.parser.error(f"--name {args.name!r} is neither a client name ({pki.NAME_RE.pattern}) nor a spiffe:// identity")
    return pki.identity_uri(pki.trust_domain_of(Path(args.dir)), args.name)


def _certs_enrol(args: argparse.Namespace) -> int:
    from tinydist.security.policy import enrol
    identity, path = _identity(args), _policy_path(args)
    old = enrol(path, identity, args.role)
    change = f"{old} -> {args.role}" if old and old != args.role else args.role if not old else f"{args.role} (unchanged)"
    print(f"{identity}: {change} in {path}; a node reading it applies this at the next call")
    return 0


def _certs_revoke(args: argparse.Namespace) -> int:
    from tinydist.security import pki
    from tinydist.security.policy import revoke
    if args.fingerprint:
        if not re.fullmatch(r"[0-9a-fA-F]{64}", args.fingerprint.replace(":", "")):
            args.parser.error(f"--fingerprint {args.fingerprint!r} is not a sha256 fingerprint (64 hex digits, colons allowed)")
        fingerprint, what = args.fingerprint, f"fingerprint {args.fingerprint}"
    else:
        cert = Path(args.cert) if args.cert else Path(args.dir) / "clients" / f"{args.name}.pem"
        try:
            fingerprint = pki.fingerprint(cert.read_bytes())
        except ValueError as exc:
            raise pki.PKIError(f"{cert} is not a PEM certificate ({exc})") from exc
        what = str(cert)
    added = revoke(_policy_path(args), fingerprint, note=args.name or "")
    state = "revoked" if added else "already revoked"
    print(f"{what}: {state} (sha256 {fingerprint.replace(':', '').lower()}); nodes reading {_policy_path(args)} refuse it "
          "from their next call")
    return 0


def _certs_list(args: argparse.Namespace) -> int:
    import datetime as dt
    import json

    from cryptography import x509

    from tinydist.security import pki
    from tinydist.security.policy import PolicyStore
    policy, denied = PolicyStore(_policy_path(args)).current()
    rows: list[dict[str, Any]] = []
    seen = set()
    for cert_path in sorted((Path(args.dir) / "clients").glob("*.pem")):
        data = cert_path.read_bytes()
        cert = x509.load_pem_x509_certificate(data)
        uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.UniformResourceIdentifier)
        identity = uris[0] if uris else ""
        fingerprint = pki.fingerprint(data)
        expired = cert.not_valid_after_utc < dt.datetime.now(dt.timezone.utc)
        seen.add(identity)
        rows.append({"name": cert_path.stem, "identity": identity, "role": policy.role_of(identity),
                     "revoked": fingerprint in denied, "expires": cert.not_valid_after_utc.isoformat(),
                     "expired": expired, "fingerprint": fingerprint, "certificate": str(cert_path)})
    for identity, role in sorted(policy.identities.items()):
        if identity not in seen:   # enrolled, its certificate issued elsewhere
            rows.append({"name": identity.rsplit("/", 1)[-1], "identity": identity, "role": role, "revoked": None,
                         "expires": None, "expired": None, "fingerprint": None, "certificate": None})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max([len(r["name"]) for r in rows] + [4])
    print(f"{'NAME':<{width}}  {'ROLE':<8}  {'STATE':<11}  {'EXPIRES':<10}  IDENTITY")
    for r in rows:
        state = "revoked" if r["revoked"] else "expired" if r["expired"] else "no cert here" if r["certificate"] is None else "valid"
        expires = (r["expires"] or "-")[:10]
        print(f"{r['name']:<{width}}  {r['role'] or '-':<8}  {state:<11}  {expires:<10}  {r['identity']}")
    return 0


def _node_status(args: argparse.Namespace) -> int:
    import json
    from dataclasses import asdict

    from tinydist.runtime.remote import connect
    with connect(args.target, cert=args.cert, key=args.key, ca=args.ca, timeout=args.timeout) as node:
        status = node.status()
    if args.json:
        print(json.dumps({**asdict(status), "devices": list(status.devices)}, indent=2))
        return 0
    print(f"node        {status.target} (boot {status.boot[:12]})\nyou         {status.identity} ({status.role})\n"
          f"fingerprint {status.fingerprint}\ndevices     {', '.join(status.devices) or 'none'}\n"
          f"round trip  {status.round_trip_s * 1e3:.2f} ms (Ping through the node's gate)")
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

    status = node_commands.add_parser("status", help="check a node: reachable, who you are to it, its devices",
                                      description="Connect to a node with mutual TLS and show how it sees you (identity, "
                                                  "role) and what it exports. A TLS failure or a refusal is explained: the "
                                                  "file, the mismatch and the fix, or the policy line to add.")
    status.add_argument("target", metavar="HOST:PORT", help="the node's address (its --listen)")
    status.add_argument("--cert", help="client certificate (default TINYDIST_CERT)")
    status.add_argument("--key", help="its key (default TINYDIST_KEY)")
    status.add_argument("--ca", help="the lab CA certificate (default TINYDIST_CA)")
    status.add_argument("--timeout", type=float, default=10.0, help="seconds per call (default 10)")
    status.add_argument("--json", action="store_true", help="one JSON object")
    status.set_defaults(run=_node_status)

    certs = subparsers.add_parser("certs", help="lab certificate authority and enrolment for node access")
    certs_commands = certs.add_subparsers(dest="certs_command", required=True, metavar="ACTION")
    san_help = ("another name a client dials the node by: a DNS name or an IP address (repeat, or comma-separate); "
                "localhost, 127.0.0.1 and ::1 are always in")
    this_host_help = ("also name this host: its hostname, FQDN and the addresses they resolve to (a scheduler or node "
                      "the others dial at this host's name or address, e.g. a Slurm job's first node)")
    init = certs_commands.add_parser("init", help="create a lab CA, a server certificate and a starter policy")
    init.add_argument("dir")
    init.add_argument("--trust-domain", default="tinydist.lab", help="identities are spiffe://DOMAIN/user/NAME (default tinydist.lab)")
    init.add_argument("--server-san", action="append", default=[], metavar="NAME", help=san_help)
    init.add_argument("--this-host", action="store_true", help=this_host_help)
    init.add_argument("--force", action="store_true", help="replace an existing CA")
    init.set_defaults(run=_certs_init)
    server = certs_commands.add_parser("server", help="reissue the server certificate (new names) with the lab's CA")
    server.add_argument("dir")
    server.add_argument("--server-san", action="append", default=[], metavar="NAME", help=san_help)
    server.add_argument("--this-host", action="store_true", help=this_host_help)
    server.add_argument("--days", type=float, default=365.0, help="validity in days (default 365)")
    server.set_defaults(run=_certs_server)
    etcd = certs_commands.add_parser("etcd", help="issue an etcd server certificate (the scheduler's membership store "
                                                  "over mutual TLS) with the lab's CA")
    etcd.add_argument("dir")
    etcd.add_argument("--server-san", action="append", default=[], metavar="NAME",
                      help="another name the scheduler dials etcd by: a DNS name or an IP address (repeat, or "
                           "comma-separate); localhost, 127.0.0.1 and ::1 are always in")
    etcd.add_argument("--days", type=float, default=365.0, help="validity in days (default 365)")
    etcd.set_defaults(run=_certs_etcd)
    issue = certs_commands.add_parser("issue", help="issue a client certificate and key")
    issue.add_argument("dir")
    issue.add_argument("--name", required=True)
    issue.add_argument("--days", type=float, default=30.0, help="validity in days (default 30, at most 825)")
    issue.set_defaults(run=_certs_issue)
    enrol = certs_commands.add_parser("enrol", help="give a client a role in the policy (applied at its next call)")
    enrol.add_argument("dir")
    enrol.add_argument("--name", required=True, help="client name (as issued) or its spiffe:// identity")
    enrol.add_argument("--role", choices=["viewer", "operator", "admin"], default="operator", help="default operator")
    enrol.add_argument("--policy", help="the policy file (default DIR/policy.toml)")
    enrol.set_defaults(run=_certs_enrol)
    revoke = certs_commands.add_parser("revoke", help="put a client certificate on the deny-list (refused at its next call)")
    revoke.add_argument("dir")
    which = revoke.add_mutually_exclusive_group(required=True)
    which.add_argument("--name", help="the client issued as NAME (DIR/clients/NAME.pem)")
    which.add_argument("--cert", help="a certificate file")
    which.add_argument("--fingerprint", help="a sha256 fingerprint (hex, colons allowed)")
    revoke.add_argument("--policy", help="the policy file naming the deny-list (default DIR/policy.toml)")
    revoke.set_defaults(run=_certs_revoke)
    listing = certs_commands.add_parser("list", help="issued and enrolled clients: role, revoked, expiry")
    listing.add_argument("dir")
    listing.add_argument("--policy", help="the policy file (default DIR/policy.toml)")
    listing.add_argument("--json", action="store_true", help="a JSON list")
    listing.set_defaults(run=_certs_list)
