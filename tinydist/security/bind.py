"""HOST:PORT addresses of tinydist's servers: one parser and one bind policy, used by every server.

The servers: the node service (`tinydist node serve`), the remote device service, the cluster
scheduler, the metrics endpoint and rank 0's rendezvous of tinydist.dist.

Servers bind loopback by default. A wildcard bind would expose every interface, so it is refused
unless the caller's configuration says it is meant; a server without authentication (an insecure
port, the metrics endpoint, the rendezvous) listens on loopback only unless its own switch allows
more. Host names are refused: what a name resolves to can change under a running server. The one
exception is the rendezvous, whose address the launch contract spells as a host name on Slurm and
Kubernetes (`gpu02:29400`): it is resolved once, and the policy applies to the address it gives.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from typing import Any

from tinydist.base.errors import BindRefused

INSECURE_HINT = "an insecure port may only listen on loopback (127.0.0.1 or ::1)"

def parse_host_port(text: str, *, what: str = "listen address", default_host: str | None = None) -> tuple[str, int]:
    """(host without brackets, port) of `text`: `127.0.0.1:7070`, `[::1]:7070`, `name:7070`; with a
    `default_host` also `:7070` and `7070`. `what` names the address in the error."""
    text = text.strip()
    if default_host is not None and text.isdigit():
        text = f":{text}"
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host and default_host is not None:
        host = default_host
    if not sep or not port.isdigit() or not host:
        example = "127.0.0.1:7070 or [::1]:7070" + (" (or just the port)" if default_host is not None else "")
        raise BindRefused(f"{what} {text!r} must be HOST:PORT (e.g. {example})")
    if int(port) > 65535:
        raise BindRefused(f"port {port} of {what} {text!r} is out of range (0-65535)")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Whether `host` (an IP address, or `localhost`) is a loopback address; host names are not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_policy(host: str, port: int, *, allow_wildcard: bool = False, loopback_only: bool = False,
                remote_hint: str = INSECURE_HINT, wildcard_hint: str = "pass --allow-wildcard if that is really meant",
                resolve: bool = False, what: str = "listen host") -> tuple[str, int]:
    """(IP address, port) that a server may bind for `host`, `port`, or BindRefused saying why not:
    a host name (unless `resolve`: then the address it resolves to now), a non-loopback address
    when `loopback_only` (`remote_hint` says how to allow it), a wildcard unless `allow_wildcard`."""
    if host == "localhost":
        host = "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        if not resolve:
            raise BindRefused(f"{what} {host!r} must be an IP address (127.0.0.1, ::1, or an interface address)") from None
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise BindRefused(f"{what} {host!r} does not resolve ({exc}); give an IP address") from None
        address = ipaddress.ip_address(infos[0][4][0])
    if loopback_only and not address.is_loopback:
        shown = host if str(address) == host else f"{host} ({address})"
        raise BindRefused(f"refusing to bind the non-loopback address {shown}: {remote_hint}")
    if address.is_unspecified and not allow_wildcard:
        raise BindRefused(f"refusing to bind the wildcard address {address}: every interface would be exposed; {wildcard_hint}")
    return str(address), port


def bind_address(listen: str, *, allow_wildcard: bool = False, loopback_only: bool = False,
                 remote_hint: str = INSECURE_HINT,
                 wildcard_hint: str = "pass --allow-wildcard if that is really meant") -> str:
    """`listen` as the bind string gRPC takes (`127.0.0.1:7070`, `[::1]:7070`), after `bind_policy`."""
    host, port = bind_policy(*parse_host_port(listen), allow_wildcard=allow_wildcard, loopback_only=loopback_only,
                             remote_hint=remote_hint, wildcard_hint=wildcard_hint)
    return format_address(host, port)


def format_address(host: str, port: int) -> str:
    """`host:port`, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_bind(bind: str) -> tuple[str, int]:
    """(host without brackets, port) of a string `bind_address` returned."""
    return parse_host_port(bind)


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
