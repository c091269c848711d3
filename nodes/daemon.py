"""`tinydist node serve`: the node daemon that owns this machine's devices and serves them over
mutually-authenticated gRPC (transports.pci_remote), plus the standard gRPC health service.

It refuses to start without a CA, a server certificate and a policy; binds loopback unless told
otherwise; refuses the wildcard address unless --allow-wildcard; and opens an insecure port (health
checks only, loopback only) only with --insecure-loopback-only.
"""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass
from pathlib import Path

from tinydist.nodes.audit import AuditLog
from tinydist.nodes.server import RemoteServer
from tinydist.nodes.service import ServerConfig
from tinydist.base.logs import get_logger
from tinydist.observability import metrics
from tinydist.security.bind import bind_address
from tinydist.security.pki import CA_KEY, ServerCredentials



def _log():  # not at import: configuring logs then would bind the importer's stderr
    return get_logger(component="node")


@dataclass
class NodeOptions:
    listen: str
    pki: Path
    policy: Path | None = None
    devices: tuple[str, ...] = ("CPU:0",)
    allow_wildcard: bool = False
    insecure_loopback_only: bool = False
    insecure_listen: str = "127.0.0.1:7071"
    audit: str = "-"
    lease_ttl_s: float = 30.0
    max_message_bytes: int = 8 << 20


def prepare(options: NodeOptions) -> tuple[ServerConfig, ServerCredentials, Path, str | None]:
    """Check everything that must hold before a socket is opened; raises with the reason."""
    bind_address(options.listen, allow_wildcard=options.allow_wildcard)
    pki = ServerCredentials.load(options.pki)  # refuses a PKI directory that holds the CA key
    if (Path(options.pki) / CA_KEY).exists():
        get_logger(component="node").warning(
            "the CA key is on this node; serve from a copy of the PKI directory without ca/ (the node never needs it)",
            ca_key=str(Path(options.pki) / CA_KEY))
    policy = options.policy or (Path(options.pki) / "policy.toml")
    if not Path(policy).is_file():
        raise FileNotFoundError(f"no policy file {policy}; refusing to start (tinydist certs init writes a starter)")
    insecure = None
    if options.insecure_loopback_only:
        insecure = bind_address(options.insecure_listen, loopback_only=True)
    config = ServerConfig(listen=options.listen, devices=options.devices, allow_wildcard=options.allow_wildcard,
                          lease_ttl_s=options.lease_ttl_s, max_message_bytes=options.max_message_bytes)
    return config, pki, Path(policy), insecure


async def serve(options: NodeOptions, ready: asyncio.Event | None = None) -> None:
    config, pki, policy, insecure = prepare(options)
    metrics.set_component("node")
    audit = AuditLog(options.audit)
    server = await RemoteServer.start(config, pki, policy, audit, insecure_listen=insecure)
    print(f"tinydist node serving {config.listen.rsplit(':', 1)[0]}:{server.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        await server.stop()
        audit.close()
