"""What a security reviewer of a shared rig checks first (issue 23): TLS 1.3 only, files nobody
else can rewrite, and streams that obey the policy between their messages."""

from __future__ import annotations

import hashlib
import os
import socket
import ssl
import subprocess
import sys
import threading
import time

import grpc
import pytest

from tinydist.nodes.service import ServerConfig
from tinydist.security import pki
from tinydist.security.identity import IdentityError, PeerCache, peer_from_auth_context
from tinydist.security.pki import PKIError, ServerCredentials
from tinydist.security.policy import PolicyStore
from tinydist.transports.pci_remote._generated import device_pb2 as pb

from .conftest import TD, code_of, lease_of


def test_a_call_over_tls_1_2_is_not_admitted(lab) -> None:
    pem = (lab.root / "clients" / "alice.pem").read_bytes()
    auth = {"transport_security_type": [b"ssl"], "x509_pem_cert": [pem], "ssl_tls_version": [b"TLSv1.2"]}
    with pytest.raises(IdentityError, match="TLS 1.3 is required and the connection negotiated TLSv1.2"):
        peer_from_auth_context(auth, TD, PeerCache())
    assert peer_from_auth_context({**auth, "ssl_tls_version": [b"TLSv1.3"]}, TD, PeerCache()).identity.endswith("/alice")


def _grpc_status_over(version: ssl.TLSVersion, lab, port: int) -> tuple[str, str]:
    """A Ping over a hand-made HTTP/2 connection held to one TLS version: (grpc-status, message)."""
    h2 = pytest.importorskip("h2.connection")
    events = pytest.importorskip("h2.events")
    config = pytest.importorskip("h2.config")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = context.maximum_version = version
    context.load_verify_locations(str(lab.root / "ca.pem"))
    context.load_cert_chain(str(lab.root / "clients" / "alice.pem"), str(lab.root / "clients" / "alice.key"))
    context.check_hostname = False
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, context.wrap_socket(raw) as tls:
        assert tls.version() == {ssl.TLSVersion.TLSv1_2: "TLSv1.2", ssl.TLSVersion.TLSv1_3: "TLSv1.3"}[version]
        conn = h2.H2Connection(config=config.H2Configuration(client_side=True))
        conn.initiate_connection()
        stream = conn.get_next_available_stream_id()
        conn.send_headers(stream, [(":method", "POST"), (":scheme", "https"), (":path", "/tinydist.v1.DeviceService/Ping"),
                                   (":authority", "localhost"), ("content-type", "application/grpc"), ("te", "trailers")])
        body = pb.PingRequest().SerializeToString()
        conn.send_data(stream, b"\0" + len(body).to_bytes(4, "big") + body, end_stream=True)
        tls.sendall(conn.data_to_send())
        headers: dict[str, str] = {}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            data = tls.recv(65536)
            if not data:
                break
            for event in conn.receive_data(data):
                if isinstance(event, (events.ResponseReceived, events.TrailersReceived)):
                    headers.update({k.decode() if isinstance(k, bytes) else k: v.decode() if isinstance(v, bytes) else v
                                    for k, v in event.headers})
                if isinstance(event, events.StreamEnded) or "grpc-status" in headers:
                    return headers.get("grpc-status", ""), headers.get("grpc-message", "")
            tls.sendall(conn.data_to_send())
    raise AssertionError(f"no gRPC status over {version}: {headers}")


def test_a_tls_1_2_client_is_refused_and_a_tls_1_3_one_served(server, lab) -> None:
    status, message = _grpc_status_over(ssl.TLSVersion.TLSv1_2, lab, server.port)
    assert status == str(grpc.StatusCode.UNAUTHENTICATED.value[0]), message
    assert "TLS 1.3 is required" in message.replace("%20", " ")
    status, _ = _grpc_status_over(ssl.TLSVersion.TLSv1_3, lab, server.port)
    assert status == "0"


@pytest.mark.parametrize("target,mode,named", [
    ("policy.toml", 0o666, "the policy .* writable by group and others"),
    ("policy.toml", 0o620, "the policy .* writable by group"),
    ("revoked.txt", 0o602, "the deny-list .* writable by others"),
    (".", 0o777, "the policy's folder .* writable by group and others"),
])
def test_a_policy_others_could_rewrite_is_refused(lab, tmp_path, target, mode, named) -> None:
    folder = tmp_path / "node"
    folder.mkdir(mode=0o700)
    (folder / "policy.toml").write_text(lab.policy_text())
    (folder / "revoked.txt").write_text("")
    path = folder / target if target != "." else folder
    os.chmod(path, mode)
    with pytest.raises(PKIError, match=rf"refusing {named}.*fix: chmod go-w"):
        PolicyStore(folder / "policy.toml")


def test_the_node_refuses_to_start_on_a_0666_policy(lab, tmp_path) -> None:
    """From the command line: exit 1 (a refusal to run, as for any other start-up failure), one line naming
    the file and the fix, no traceback."""
    policy = tmp_path / "policy.toml"
    policy.write_text(lab.policy_text())
    os.chmod(policy, 0o666)
    result = subprocess.run([sys.executable, "-m", "tinydist.cli", "node", "serve", "--listen", "127.0.0.1:0",
                             "--pki", str(lab.root), "--policy", str(policy)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert f"refusing the policy {policy}" in result.stderr and "chmod go-w" in result.stderr


def test_the_pki_refuses_a_readable_key_and_a_foreign_owner(tmp_path) -> None:
    root = tmp_path / "lab"
    pki.init(root, TD)
    ServerCredentials.load(root)  # as `certs init` wrote it: accepted
    os.chmod(root / "server.key", 0o644)
    with pytest.raises(PKIError, match=r"the server key .*readable by group or others.*chmod 600"):
        ServerCredentials.load(root)
    os.chmod(root / "server.key", 0o600)
    os.chmod(root, 0o775)
    with pytest.raises(PKIError, match=r"the PKI directory .*writable by group"):
        ServerCredentials.load(root)
    os.chmod(root, 0o700)
    if os.geteuid() == 0:  # only root can give a file away
        os.chown(root / "ca.pem", 12345, -1)
        with pytest.raises(PKIError, match=r"the CA certificate .*owned by uid 12345.*chown 0"):
            ServerCredentials.load(root)


def test_the_policy_hash_is_logged_at_load_and_reload(lab, tmp_path, monkeypatch) -> None:
    notes: list[dict] = []
    monkeypatch.setattr(PolicyStore, "_note", lambda self, level, event, **fields: notes.append({"event": event, **fields}))
    policy = tmp_path / "policy.toml"
    policy.write_text(lab.policy_text())
    store = PolicyStore(policy)
    policy.write_text(lab.policy_text() + "\n# edited\n")
    store.current()
    hashes = [n["sha256"] for n in notes if n["event"] == "policy loaded"]
    assert hashes == [hashlib.sha256(lab.policy_text().encode()).hexdigest(),
                      hashlib.sha256((lab.policy_text() + "\n# edited\n").encode()).hexdigest()]


def test_a_revoked_certificate_ends_its_open_stream_at_the_next_message(make_server, connect, lab) -> None:
    server = make_server()
    bob = connect(server, "bob")
    lease = lease_of(bob)
    handle = bob.Allocate(pb.AllocateRequest(lease=lease, device="CPU:0", nbytes=1 << 16)).handle
    revoke, sent = threading.Event(), []

    def chunks():
        yield pb.WriteRequest(lease=lease, handle=handle, offset=0, data=b"\1" * 4096)
        sent.append(1)
        revoke.set()
        time.sleep(0.5)  # the deny-list is rewritten meanwhile (below)
        for _ in range(8):
            yield pb.WriteRequest(data=b"\2" * 4096)

    def rewrite() -> None:
        revoke.wait(10)
        with open(server.dir / "revoked.txt", "a") as f:
            f.write(lab.fingerprints["bob"] + "\n")

    thread = threading.Thread(target=rewrite)
    thread.start()
    code = code_of(bob.WriteStream, chunks())
    thread.join()
    assert sent and code is grpc.StatusCode.UNAUTHENTICATED
    record = [r for r in server.audit_records() if r.get("method") == "WriteStream"][-1]
    assert record["status"] == "UNAUTHENTICATED" and record["reason"] == "certificate revoked"


def test_connections_have_an_age_and_an_idle_limit() -> None:
    from tinydist.nodes.server import server_options
    options = dict(server_options(ServerConfig(max_connection_age_s=120, max_connection_idle_s=30)))
    assert options["grpc.max_connection_age_ms"] == 120_000 and options["grpc.max_connection_idle_ms"] == 30_000


def test_certs_init_keeps_the_ca_key_apart_and_the_node_refuses_to_serve_next_to_it(lab, tmp_path) -> None:
    root = tmp_path / "lab"
    pki.init(root, TD)
    assert (root / "ca" / "ca.key").is_file() and not (root / "ca.key").exists()
    assert oct((root / "ca").stat().st_mode & 0o777) == "0o700"
    node = tmp_path / "node"  # what a node gets: the lab directory without ca/
    node.mkdir(mode=0o700)
    for name in ("ca.pem", "server.pem", "server.key", "policy.toml", "revoked.txt"):
        (node / name).write_bytes((root / name).read_bytes())
        os.chmod(node / name, (root / name).stat().st_mode & 0o777)
    ServerCredentials.load(node)
    assert pki.issue(root, "erin").identity.endswith("/user/erin")  # the CA still signs from its own folder
    (node / "ca.key").write_bytes((root / "ca" / "ca.key").read_bytes())  # the old layout, or a careless copy
    os.chmod(node / "ca.key", 0o600)
    with pytest.raises(PKIError, match=rf"refusing to serve from {node}: it holds the CA key .*mv {node / 'ca.key'}"):
        ServerCredentials.load(node)
    result = subprocess.run([sys.executable, "-m", "tinydist.cli", "node", "serve", "--listen", "127.0.0.1:0",
                             "--pki", str(node)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "it holds the CA key" in result.stderr


def test_a_lab_in_the_old_layout_is_told_where_to_move_the_ca_key(tmp_path) -> None:
    root = tmp_path / "lab"
    pki.init(root, TD)
    (root / "ca" / "ca.key").rename(root / "ca.key")
    with pytest.raises(PKIError, match=r"old layout.*mkdir -m 700 .*/ca && mv .*/ca.key .*/ca/ca.key"):
        pki.issue(root, "erin")
