"""HOST:PORT listen addresses for tinydist's servers: one parser and one bind policy.

Servers bind loopback by default. A wildcard bind would expose every interface, so it is refused
unless the caller's configuration says it is meant; an insecure (plaintext) port listens on
loopback only. Host names are refused: what a name resolves to can change under a running server.
"""

from __future__ import annotations

import errno
import ipaddress
from typing import Any


def bind_address(listen: str, *, allow_wildcard: bool = False, loopback_only: bool = False,
                 wildcard_hint: str = "pass --allow-wildcard if that is really meant") -> str:
    """`listen` as the bind string gRPC takes (`127.0.0.1:7070`, `[::1]:7070`), after refusing
    host names, a wildcard bind unless `allow_wildcard`, and with `loopback_only` any other interface."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"listen address {listen!r} must be HOST:PORT (e.g. 127.0.0.1:7070 or [::1]:7070)")
    if int(port) > 65535:
        raise ValueError(f"port {port} of listen address {listen!r} is out of range (0-65535)")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if host == "localhost":
        host = "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"listen host {host!r} must be an IP address (127.0.0.1, ::1, or an interface address)") from None
    if address.is_unspecified and not allow_wildcard:
        raise ValueError(f"refusing to bind the wildcard address {host}: every interface would be exposed; {wildcard_hint}")
    if loopback_only and not address.is_loopback:
        raise ValueError(f"an insecure port may only listen on loopback (127.0.0.1 or ::1), not {host}")
    return f"[{address}]:{int(port)}" if address.version == 6 else f"{address}:{int(port)}"


def split_bind(bind: str) -> tuple[str, int]:
    """(host without brackets, port) of a string `bind_address` returned."""
    host, _, port = bind.rpartition(":")
    return host.strip("[]"), int(port)


def add_port(server: Any, bind: str, credentials: Any = None) -> int:
    """Bind `bind` on a gRPC server (TLS with `credentials`, else plaintext); returns the port.

    gRPC reports a refused bind as a RuntimeError that says only "Failed to bind"; this raises an
    OSError (EADDRINUSE) naming the address and what to do, the way a socket bind would."""
    cause: RuntimeError | None = None
    try:
        port = server.add_secure_port(bind, credentials) if credentials is not None else server.add_insecure_port(bind)
    except RuntimeError as exc:
        port, cause = 0, exc
    if port == 0:
        raise OSError(errno.EADDRINUSE, f"cannot listen on {bind}: the address is in use (or not this machine's); "
                                        "pick another port or stop the process holding it") from cause
    return int(port)
