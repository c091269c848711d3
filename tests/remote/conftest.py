"""Fixtures for the remote-access suite: a real lab PKI, a real grpc.aio server with TLS on
loopback (port 0) in its own event-loop thread, and clients holding real certificates."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography.x509.oid import ExtendedKeyUsageOID

from tinydist.nodes.audit import AuditLog
from tinydist.nodes.server import RemoteServer
from tinydist.nodes.service import ServerConfig
from tinydist.runtime.remote.client import ClientCredentials, channel_options
from tinydist.security import pki
from tinydist.security.pki import ServerCredentials
from tinydist.transports.pci_remote._generated import device_pb2 as pb
from tinydist.transports.pci_remote._generated import device_pb2_grpc as pb_grpc

TD = "tinydist.lab"
ROLES = {"alice": "admin", "bob": "operator", "carol": "viewer", "dave": "operator"}


def uri(name: str) -> str:
    return pki.identity_uri(TD, name)


@dataclass
class Lab:
    root: Path
    creds: dict[str, ClientCredentials]
    fingerprints: dict[str, str]

    def policy_text(self, identities: dict[str, str] | None = None, drop_methods: tuple[str, ...] = (),
                    extra: str = "") -> str:
        from tinydist.security.policy import starter_policy
        text = starter_policy(TD)
        lines = []
        for line in text.splitlines():
            if any(line.startswith(f"{m} = ") for m in drop_methods):
                continue
            lines.append(line)
            if line == "[identities]":
                for name, role in (identities if identities is not None else ROLES).items():
                    lines.append(f'"{uri(name)}" = "{role}"')
        return "\n".join(lines) + "\n" + extra


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Lab:
    root = tmp_path_factory.mktemp("pki")
    pki.init(root, TD)
    ca_pem = (root / "ca.pem").read_bytes()
    ca_cert, ca_key = pki.load_ca(root)
    creds: dict[str, ClientCredentials] = {}
    fps: dict[str, str] = {}

    def add(name: str, cert: bytes, key: bytes, ca: bytes = ca_pem) -> None:
        creds[name] = ClientCredentials(cert, key, ca)
        fps[name] = pki.fingerprint(cert)

    for name in (*ROLES, "mallory"):
        issued = pki.issue(root, name, days=1)
        add(name, issued.cert_path.read_bytes(), issued.key_path.read_bytes())
    add("two_uris", *pki.make_certificate(ca_cert, ca_key, "x", uris=[uri("alice"), uri("bob")]))
    add("no_uri", *pki.make_certificate(ca_cert, ca_key, "alice", dns=["alice.example"]))
    add("server_eku", *pki.make_certificate(ca_cert, ca_key, "alice", uris=[uri("alice")], eku=(ExtendedKeyUsageOID.SERVER_AUTH,)))
    now = dt.datetime.now(dt.timezone.utc)
    add("expired", *pki.make_certificate(ca_cert, ca_key, "alice", uris=[uri("alice")],
                                         not_before=now - dt.timedelta(days=10), not_after=now - dt.timedelta(days=1)))
    add("other_domain", *pki.make_certificate(ca_cert, ca_key, "alice", uris=["spiffe://evil.lab/user/alice"]))
    foreign_ca, foreign_key = pki.make_ca("foreign CA")
    add("foreign", *pki.make_certificate(foreign_ca, foreign_key, "alice", uris=[uri("alice")]))
    return Lab(root, creds, fps)


class ServerThread:
    """A RemoteServer on its own event loop in a daemon thread."""

    def __init__(self, lab: Lab, tmp: Path, config: ServerConfig | None = None, policy_text: str | None = None) -> None:
        self.dir = tmp
        self.policy_path = tmp / "policy.toml"
        self.policy_path.write_text(policy_text if policy_text is not None else lab.policy_text())
        shutil.copy(lab.root / "revoked.txt", tmp / "revoked.txt")
        self.audit_path = tmp / "audit.jsonl"
        self.config = config or ServerConfig(listen="127.0.0.1:0")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-remote-server", daemon=True)
        self.thread.start()
        self.audit = AuditLog(self.audit_path)
        self.server: RemoteServer = self.run(RemoteServer.start(self.config, ServerCredentials.load(lab.root), self.policy_path, self.audit))
        self.port = self.server.port
        self.target = f"127.0.0.1:{self.port}"

    @property
    def service(self) -> Any:
        return self.server.service

    def run(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Any, *args: Any) -> Any:
        async def go() -> Any:
            return fn(*args)
        return self.run(go())

    def audit_records(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.audit_path.read_text().splitlines() if line.strip()]

    def stop(self) -> None:
        if self.loop.is_closed():  # stopped already (a test that restarts its node)
            return
        try:
            self.run(self.server.stop(0.2))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()
            self.audit.close()


@pytest.fixture
def make_server(lab: Lab, tmp_path: Path) -> Iterator[Any]:
    made: list[ServerThread] = []

    def make(config: ServerConfig | None = None, policy_text: str | None = None, **overrides: Any) -> ServerThread:
        cfg = replace(config or ServerConfig(listen="127.0.0.1:0"), **overrides)
        d = tmp_path / f"server{len(made)}"
        d.mkdir()
        server = ServerThread(lab, d, cfg, policy_text)
        made.append(server)
        return server

    yield make
    for server in made:
        server.stop()


@pytest.fixture(scope="module")
def server(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    s = ServerThread(lab, tmp_path_factory.mktemp("server"))
    yield s
    s.stop()


class Client:
    def __init__(self, target: str, creds: ClientCredentials, options: list[tuple[str, Any]] | None = None) -> None:
        self.channel = grpc.secure_channel(target, creds.channel_credentials(), options=options or channel_options())
        self.stub = pb_grpc.DeviceServiceStub(self.channel)

    def __getattr__(self, method: str) -> Any:
        rpc = getattr(self.stub, method)

        def call(request: Any = None, token: str | None = None, timeout: float = 10.0, **kw: Any) -> Any:
            metadata = [("tinydist-elevation", token)] if token else None
            return rpc(request, timeout=timeout, metadata=metadata, **kw)
        return call

    def close(self) -> None:
        self.channel.close()


@pytest.fixture
def connect(lab: Lab) -> Iterator[Any]:
    clients: list[Client] = []

    def make(server: ServerThread | str, name: str, **kw: Any) -> Client:
        target = server if isinstance(server, str) else server.target
        client = Client(target, lab.creds[name], **kw)
        clients.append(client)
        return client

    yield make
    for c in clients:
        c.close()


@pytest.fixture
def credentials_env(lab: Lab, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """bob's certificate, key and CA in the environment, where the engine's remote device finds them."""
    for part in ("cert", "key", "ca"):
        path = tmp_path / f"bob.{part}"
        path.write_bytes(getattr(lab.creds["bob"], part))
        monkeypatch.setenv(f"TINYDIST_{part.upper()}", str(path))


def code_of(fn: Any, *args: Any, **kw: Any) -> grpc.StatusCode:
    try:
        result = fn(*args, **kw)
        if hasattr(result, "__iter__") and not hasattr(result, "SerializeToString"):
            list(result)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def lease_of(client: Client) -> bytes:
    return client.OpenLease(pb.OpenLeaseRequest()).lease
