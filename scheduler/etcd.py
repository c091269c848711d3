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
body) is a `MembershipStoreError` naming the endpoint and the call.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
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


class EtcdClient:
    """One or more client URLs (`http://127.0.0.1:2379`); a call tries them in turn until one answers."""

    def __init__(self, endpoints: Sequence[str] | str, timeout: float = 5.0) -> None:
        urls = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        urls = [u.strip().rstrip("/") for part in urls for u in part.split(",") if u.strip()]
        if not urls:
            raise MembershipStoreError("no etcd endpoint given: pass --etcd http://HOST:PORT[,http://HOST:PORT...]")
        for url in urls:
            if not url.startswith("http://"):
                raise MembershipStoreError(f"etcd endpoint {url!r}: expected http://HOST:PORT (the client URL "
                                           f"etcd listens on; this client speaks plain HTTP to etcd's v3 gateway)")
        self.endpoints = urls
        self.timeout = timeout

    def call(self, path: str, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        data = json.dumps(body).encode()
        errors = []
        for url in self.endpoints:
            request = urllib.request.Request(f"{url}/v3/{path}", data=data, method="POST",
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=timeout or self.timeout) as reply:
                    doc = json.loads(reply.read() or b"{}")
            except urllib.error.HTTPError as exc:   # the gateway answered with an error body: do not try another
                detail = exc.read().decode(errors="replace")
                raise MembershipStoreError(f"etcd {url}: /v3/{path} refused (HTTP {exc.code}): {detail}") from exc
            except (OSError, ValueError) as exc:     # URLError, refused, timed out, not JSON
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
