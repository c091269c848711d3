"""A small etcd v3 client over etcd's JSON gRPC gateway (`POST http://HOST:PORT/v3/...`): the KV
range / put / delete / txn calls and leases, which is all the membership store (scheduler.store)
uses. Standard library only (urllib, json, base64).

Why the gateway and not a Python package (README, dependencies): the gateway is part of every etcd
server since 3.3 (the `/v3/` prefix since 3.4, Debian bookworm ships 3.4.23) and needs nothing on
our side; `etcd3` (python-etcd3) has had no release since 2020 and its generated code fails to
import with protobuf >= 4 (which grpcio-tools here needs); `etcd3gw` adds requests, futurist and
pbr for the same gateway calls; stubs generated from etcd's own protos need gogoproto and the
googleapis annotations vendored into proto/. A membership change is one small request per change
and a heartbeat none, so JSON over HTTP costs nothing that matters.

Keys and values are bytes on the wire as base64 (the gateway's encoding of protobuf `bytes`);
int64 fields come back as JSON strings. Every failure (no server, an HTTP error, a gateway error
body, a refused TLS handshake) is a `MembershipStoreError` naming the endpoint and the call.

Mutual TLS: `https://` endpoints are dialled with the CA in TINYDIST_ETCD_CA (the lab's DIR/ca.pem,
which signed etcd's certificate from `tinydist certs etcd`) and, where etcd runs with
--client-cert-auth, the client certificate TINYDIST_ETCD_CERT / TINYDIST_ETCD_KEY (`tinydist certs
issue`); docs/cluster.md has the etcd flags.
"""

from __future__ import annotations

import base64
import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinydist.scheduler.errors import MembershipStoreError


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def prefix_end(prefix: bytes) -> bytes:
    """The range end that selects every key starting with `prefix` (etcd's clientv3.GetPrefixRangeEnd)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"                                   # every key


def _tls_hint(exc: ssl.SSLError, tls: EtcdTLS | None) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return ("etcd's certificate is not one TINYDIST_ETCD_CA vouches for, or not for the name dialled: issue it "
                "with `tinydist certs etcd DIR --server-san HOST` and set TINYDIST_ETCD_CA=DIR/ca.pem")
    if tls is None or tls.client_cert is None:
        # etcd with --client-cert-auth answers a client that sent none with a "bad certificate" alert or
        # closes the connection (an EOF), never TLS 1.3's "certificate required"
        return ("etcd asks for a client certificate (--client-cert-auth) and none was given: set TINYDIST_ETCD_CERT and "
                "TINYDIST_ETCD_KEY to one from `tinydist certs issue DIR --name NAME`, signed by the CA etcd's "
                "--trusted-ca-file names")
    return (f"etcd refused this client's certificate {tls.client_cert}: it must be signed by the CA etcd's "
            "--trusted-ca-file names (`tinydist certs issue DIR --name NAME` with etcd's --trusted-ca-file DIR/ca.pem)")


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


def _kv(doc: dict[str, Any]) -> KeyValue:
    return KeyValue(_unb64(doc["key"]), _unb64(doc.get("value", "")), int(doc.get("create_revision", 0)),
                    int(doc.get("mod_revision", 0)), int(doc.get("lease", 0)))


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int                                  # the store's revision after the transaction
    ranges: list[list[KeyValue]]                   # the kvs of each range operation of the branch taken


@dataclass(frozen=True)
class EtcdTLS:
    """The client side of mutual TLS to etcd: a context that verifies etcd's certificate, and the
    client certificate it presents (None: none, for an etcd without --client-cert-auth)."""
    context: ssl.SSLContext
    client_cert: Path | None


def tls_context(ca: Path | None, cert: Path | None, key: Path | None) -> EtcdTLS:
    """Verify etcd's certificate against `ca`, present `cert` and `key` (both or neither)."""
    if ca is None:
        raise MembershipStoreError("an https:// etcd endpoint needs the CA its certificate is checked against: set "
                                   "TINYDIST_ETCD_CA (the lab's DIR/ca.pem when etcd serves a `tinydist certs etcd DIR` "
                                   "certificate)")
    if (cert is None) != (key is None):
        raise MembershipStoreError(f"etcd client certificate: TINYDIST_ETCD_CERT={cert} and TINYDIST_ETCD_KEY={key}: give "
                                   "both (a certificate and its key from `tinydist certs issue DIR --name NAME`) or neither")
    try:
        context = ssl.create_default_context(cafile=str(ca))
        if cert is not None and key is not None:
            context.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as exc:
        raise MembershipStoreError(f"etcd TLS material unusable (TINYDIST_ETCD_CA={ca}, TINYDIST_ETCD_CERT={cert}, "
                                   f"TINYDIST_ETCD_KEY={key}): {exc}") from exc
    return EtcdTLS(context, cert)


def _tls_failure(exc: BaseException) -> ssl.SSLError | None:
    """The TLS error behind a failed request (urllib wraps one raised while connecting in URLError,
    and lets one raised reading the reply through: TLS 1.3 refuses a client certificate there)."""
    if isinstance(exc, ssl.SSLError):
        return exc
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else None
    return reason if isinstance(reason, ssl.SSLError) else None


class EtcdClient:
    """One or more client URLs (`http://127.0.0.1:2379`, or `https://` for mutual TLS: `tls`, else
    a context from TINYDIST_ETCD_CA / _CERT / _KEY); a call tries them in turn until one answers."""

    def __init__(self, endpoints: Sequence[str] | str, timeout: float = 5.0, tls: EtcdTLS | None = None) -> None:
        urls = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        urls = [u.strip().rstrip("/") for part in urls for u in part.split(",") if u.strip()]
        if not urls:
            raise MembershipStoreError("no etcd endpoint given: pass --etcd http://HOST:PORT[,http://HOST:PORT...]")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise MembershipStoreError(f"etcd endpoint {url!r}: expected http://HOST:PORT or https://HOST:PORT "
                                           f"(the client URL etcd listens on, for etcd's v3 gateway)")
        if tls is None and any(url.startswith("https://") for url in urls):
            from tinydist.base.config import settings
            tls = tls_context(settings.ETCD_CA, settings.ETCD_CERT, settings.ETCD_KEY)
        self.endpoints = urls
        self.timeout = timeout
        self.tls = tls

    def call(self, path: str, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        data = json.dumps(body).encode()
        errors = []
        for url in self.endpoints:
            request = urllib.request.Request(f"{url}/v3/{path}", data=data, method="POST",
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=timeout or self.timeout,
                                            context=self.tls.context if self.tls and url.startswith("https://") else None) as reply:
                    doc = json.loads(reply.read() or b"{}")
            except urllib.error.HTTPError as exc:   # the gateway answered with an error body: do not try another
                detail = exc.read().decode(errors="replace")
                raise MembershipStoreError(f"etcd {url}: /v3/{path} refused (HTTP {exc.code}): {detail}") from exc
            except (OSError, ValueError) as exc:     # URLError, refused, timed out, not JSON
                tls = _tls_failure(exc)
                if tls is not None:                  # this etcd will refuse us every time: say why, try no other
                    raise MembershipStoreError(f"etcd {url}: /v3/{path}: the TLS handshake failed ({tls}); "
                                               + _tls_hint(tls, self.tls)) from exc
                errors.append(f"{url}: {exc}")
                continue
            if "error" in doc:                       # a streaming call reports its error in the body
                raise MembershipStoreError(f"etcd {url}: /v3/{path} refused: {doc.get('message') or doc['error']}")
            return doc
        raise MembershipStoreError(f"etcd unreachable for /v3/{path}: {'; '.join(errors)}; is etcd running "
                                   f"(etcd --listen-client-urls ...) and are these its client URLs?")

    # ---- KV --------------------------------------------------------------------------------------

    def get(self, key: bytes) -> KeyValue | None:
        kvs = self.call("kv/range", {"key": _b64(key)}).get("kvs", [])
        return _kv(kvs[0]) if kvs else None

    def get_prefix(self, prefix: bytes) -> list[KeyValue]:
        doc = self.call("kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                     "sort_order": "ASCEND", "sort_target": "KEY"})
        return [_kv(x) for x in doc.get("kvs", [])]

    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return int(self.call("kv/put", body)["header"]["revision"])

    def txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
            failure: list[dict[str, Any]] = ()) -> TxnResult:  # type: ignore[assignment]
        doc = self.call("kv/txn", {"compare": compare, "success": success, "failure": list(failure)})
        ranges = [[_kv(x) for x in r["response_range"].get("kvs", [])]
                  for r in doc.get("responses", []) if "response_range" in r]
        return TxnResult(bool(doc.get("succeeded", False)), int(doc["header"]["revision"]), ranges)

    # ---- leases ----------------------------------------------------------------------------------

    def grant(self, ttl: int) -> int:
        return int(self.call("lease/grant", {"TTL": str(ttl)})["ID"])

    def keepalive(self, lease: int) -> int:
        """Renew `lease` once; returns its TTL (0: the lease is gone, it expired or was revoked)."""
        doc = self.call("lease/keepalive", {"ID": str(lease)})
        return int(doc.get("result", {}).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        self.call("lease/revoke", {"ID": str(lease)})


# ---- the pieces of a transaction ------------------------------------------------------------------

def create_revision_is(key: bytes, revision: int) -> dict[str, Any]:
    """Compare: `key` was created at `revision` (0: it does not exist)."""
    return {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": str(revision)}


def put_op(key: bytes, value: bytes, lease: int = 0) -> dict[str, Any]:
    op: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        op["lease"] = str(lease)
    return {"request_put": op}


def range_op(key: bytes) -> dict[str, Any]:
    return {"request_range": {"key": _b64(key)}}


def delete_range_op(start: bytes, end: bytes) -> dict[str, Any]:
    return {"request_delete_range": {"key": _b64(start), "range_end": _b64(end)}}
