"""The caller's identity, read from the gRPC auth context of a mutually-authenticated TLS call.

TLS (OpenSSL/BoringSSL inside gRPC) already verified the chain to our CA and the validity dates;
here the leaf certificate itself (`x509_pem_cert`) is parsed and must have exactly one URI SAN of
the form spiffe://<trust-domain>/user/<name>, the clientAuth extended key usage, and be within
its validity period. `peer_identities()` is not used: it is whatever gRPC chose to surface (all
SANs, or the CN) and says nothing about ambiguity.
"""

from __future__ import annotations

import datetime as dt
import re
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import ExtendedKeyUsageOID

from tinydist.base.errors import TinydistError

_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")


class IdentityError(TinydistError):
    """The peer certificate does not name exactly one acceptable identity."""


@dataclass(frozen=True)
class Peer:
    identity: str
    fingerprint: str          # sha256 of the DER certificate, hex
    not_after: dt.datetime
    expires: float            # not_after as POSIX seconds: checked on every call, against time.time()


def _parse(pem: bytes, trust_domain: str) -> Peer:
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise IdentityError("peer certificate does not parse") from exc
    now = dt.datetime.now(dt.timezone.utc)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise IdentityError("peer certificate is outside its validity period")
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound as exc:
        raise IdentityError("peer certificate has no extended key usage; clientAuth is required") from exc
    if ExtendedKeyUsageOID.CLIENT_AUTH not in eku:
        raise IdentityError("peer certificate is not for client authentication (no clientAuth EKU)")
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    if len(uris) != 1:
        raise IdentityError(f"peer certificate must carry exactly one URI SAN, it has {len(uris)}")
    uri = uris[0]
    prefix = f"spiffe://{trust_domain}/user/"
    if not uri.startswith(prefix) or not _NAME.match(uri[len(prefix):]):
        raise IdentityError(f"peer identity is not of the form {prefix}<name>")
    not_after = cert.not_valid_after_utc
    return Peer(uri, cert.fingerprint(hashes.SHA256()).hex(), not_after, not_after.timestamp())


class PeerCache:
    """Parsed peers keyed by certificate bytes and trust domain (bounded: the oldest entry goes
    first): parsing is paid once per certificate, and a call whose certificate was seen before
    costs one dict lookup and the expiry check. The lookup takes no lock (a dict read is atomic);
    filling and trimming do. Lock, LRU reordering and a `datetime.now()` per call were ~3 us of the
    gate's Python work per Ping (`bench/remote_calls.py`)."""

    def __init__(self, size: int = 1024) -> None:
        self._size = size
        self._lock = threading.Lock()
        self._items: dict[tuple[bytes, str], Peer | IdentityError] = {}

    def peer(self, pem: bytes, trust_domain: str) -> Peer:
        key = (pem, trust_domain)
        found = self._items.get(key)
        if found is None:
            try:
                found = _parse(pem, trust_domain)
            except IdentityError as exc:
                found = exc
            with self._lock:
                self._items[key] = found
                while len(self._items) > self._size:
                    del self._items[next(iter(self._items))]
        if type(found) is not Peer:
            raise IdentityError(str(found))
        if time.time() > found.expires:
            raise IdentityError("peer certificate is outside its validity period")
        return found


TLS_VERSION = b"TLSv1.3"  # the only TLS version a call is admitted over


_SSL = [b"ssl"]
_TLS_1_3 = [TLS_VERSION]


def _listed(values: Iterable[bytes] | None) -> list[bytes]:
    return [] if values is None else list(values)


def peer_from_auth_context(auth: Mapping[str, Iterable[bytes]], trust_domain: str, cache: PeerCache) -> Peer:
    """`auth` is gRPC's `context.auth_context()`: property name -> values (lists, compared as they
    come; any other iterable is copied into one first)."""
    security = auth.get("transport_security_type")
    if security != _SSL and _listed(security) != _SSL:
        raise IdentityError("the call is not protected by TLS")
    versions = auth.get("ssl_tls_version")
    if versions != _TLS_1_3 and _listed(versions) != _TLS_1_3:
        # grpc's TLS stack offers no minimum version: the negotiated one is checked here
        reported = _listed(versions)
        got = bytes(reported[0]).decode() if reported else "a version gRPC did not report"
        raise IdentityError(f"TLS 1.3 is required and the connection negotiated {got}: use a client whose TLS "
                            "library speaks TLS 1.3 (grpcio, OpenSSL 1.1.1 or newer)")
    pems = auth.get("x509_pem_cert")
    if type(pems) is not list:
        pems = _listed(pems)
    if len(pems) != 1:
        raise IdentityError("no client certificate was presented")
    return cache.peer(pems[0], trust_domain)
