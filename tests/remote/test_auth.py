"""Identity, roles, elevation tokens, revocation and audit — against a real TLS server."""

from __future__ import annotations

import time

import grpc
import pytest

from tinydist.security.policy import DEFAULT_METHODS, ELEVATED, RANK
from tinydist.transports.pci_remote._generated import device_pb2 as pb

from .conftest import ROLES, code_of, lease_of, uri

SERVICE = pb.DESCRIPTOR.services_by_name["DeviceService"]


def calls(server) -> int:
    return sum(server.service.handler_calls.values())


@pytest.mark.parametrize("name", ["foreign", "expired", "server_eku"])
def test_bad_certificates_fail_the_handshake(server, connect, name) -> None:
    before = calls(server)
    client = connect(server, name)
    assert code_of(client.WhoAmI, pb.WhoAmIRequest(), timeout=5) == grpc.StatusCode.UNAVAILABLE
    assert calls(server) == before


def test_no_client_certificate_fails_the_handshake(server, lab) -> None:
    before = calls(server)
    channel = grpc.secure_channel(server.target, grpc.ssl_channel_credentials(root_certificates=lab.creds["alice"].ca))
    stub = __import__("tinydist.transports.pci_remote._generated.device_pb2_grpc", fromlist=["x"]).DeviceServiceStub(channel)
    assert code_of(stub.WhoAmI, pb.WhoAmIRequest(), timeout=5) == grpc.StatusCode.UNAVAILABLE
    channel.close()
    assert calls(server) == before


def test_plaintext_is_refused(server) -> None:
    channel = grpc.insecure_channel(server.target)
    stub = __import__("tinydist.transports.pci_remote._generated.device_pb2_grpc", fromlist=["x"]).DeviceServiceStub(channel)
    assert code_of(stub.WhoAmI, pb.WhoAmIRequest(), timeout=5) == grpc.StatusCode.UNAVAILABLE
    channel.close()


@pytest.mark.parametrize("name,reason", [("two_uris", "exactly one URI SAN, it has 2"),
                                         ("no_uri", "exactly one URI SAN, it has 0"),
                                         ("other_domain", "not of the form")])
def test_ambiguous_or_foreign_identity_is_unauthenticated(server, connect, name, reason) -> None:
    before = calls(server)
    client = connect(server, name)
    with pytest.raises(grpc.RpcError) as info:
        client.WhoAmI(pb.WhoAmIRequest())
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert reason in info.value.details()
    assert calls(server) == before
    record = server.audit_records()[-1]
    assert record["status"] == "UNAUTHENTICATED" and record["method"] == "WhoAmI" and record["identity"] is None


def test_unenrolled_identity_is_denied(server, connect) -> None:
    before = calls(server)
    assert code_of(connect(server, "mallory").Ping, pb.PingRequest()) == grpc.StatusCode.PERMISSION_DENIED
    assert calls(server) == before
    assert server.audit_records()[-1]["identity"] == uri("mallory")


def test_identity_is_the_uri_san(server, connect, lab) -> None:
    reply = connect(server, "bob").WhoAmI(pb.WhoAmIRequest())
    assert (reply.identity, reply.role, reply.fingerprint) == (uri("bob"), "operator", lab.fingerprints["bob"])


def _request(method: str, lease: bytes, handle: bytes):
    m = SERVICE.methods_by_name[method]
    req = getattr(pb, m.input_type.name)
    fields = {f.name for f in req.DESCRIPTOR.fields}
    kw = {}
    if "lease" in fields:
        kw["lease"] = lease
    if "handle" in fields:
        kw["handle"] = handle
    if "device" in fields:
        kw["device"] = "CPU:0"
    if method == "Allocate":
        kw["nbytes"] = 64
    if method in ("Read", "ReadStream"):
        kw["length"] = 8
    if method in ("PciConfigRead",):
        kw.update(address="0000:01:00.0", size=2)
    if method in ("BarRead", "BarWrite", "ResetDevice"):
        kw["address"] = "0000:01:00.0"
    if method == "BarWrite":
        kw.update(bar=2, data=b"xxxx")
    if method == "BarRead":
        kw["length"] = 4
    message = req(**kw)
    return iter([message]) if m.client_streaming else message


@pytest.mark.parametrize("role_name", ["carol", "bob", "alice"])
def test_each_role_against_each_method(make_server, connect, role_name) -> None:
    server = make_server()
    client = connect(server, role_name)
    role = ROLES[role_name]
    admin = connect(server, "alice")
    token = admin.MintElevationToken(pb.MintElevationTokenRequest()).token
    lease = lease_of(admin) if role == "viewer" else lease_of(client)
    handle = connect(server, "alice" if role == "viewer" else role_name).Allocate(
        pb.AllocateRequest(lease=lease, device="CPU:0", nbytes=64)).handle
    for method in SERVICE.methods_by_name:
        need = DEFAULT_METHODS[method]
        allowed = RANK[role] >= RANK[need]
        for with_token in ([False, True] if method in ELEVATED else [False]):
            before = server.service.handler_calls[method]
            rpc = getattr(client, method)
            code = code_of(rpc, _request(method, lease if method != "CloseLease" else b"", handle),
                           token=token if with_token and role_name == "alice" else None)
            ran = server.service.handler_calls[method] - before
            expect_run = allowed and (method not in ELEVATED or (with_token and role_name == "alice"))
            if expect_run:
                assert ran == 1 and code != grpc.StatusCode.PERMISSION_DENIED, (method, role, code)
            else:
                assert ran == 0 and code == grpc.StatusCode.PERMISSION_DENIED, (method, role, code)


def test_method_missing_from_policy_is_refused(make_server, lab, connect) -> None:
    server = make_server(policy_text=lab.policy_text(drop_methods=("Ping",)))
    client = connect(server, "alice")
    assert code_of(client.Ping, pb.PingRequest()) == grpc.StatusCode.PERMISSION_DENIED
    assert server.service.handler_calls["Ping"] == 0
    assert server.audit_records()[-1]["reason"] == "method not in policy (deny by default)"
    assert code_of(client.WhoAmI, pb.WhoAmIRequest()) == grpc.StatusCode.OK


def test_policy_cannot_lower_admin_floors(make_server, lab, connect) -> None:
    text = lab.policy_text().replace('ResetDevice = "admin"', 'ResetDevice = "viewer"')
    server = make_server(policy_text=text)
    assert code_of(connect(server, "carol").ResetDevice, pb.ResetDeviceRequest(address="0000:01:00.0")) == grpc.StatusCode.PERMISSION_DENIED
    assert server.service.handler_calls["ResetDevice"] == 0


def test_elevation_token_missing_expired_and_replayed(make_server, lab, connect) -> None:
    text = lab.policy_text(identities={"alice": "admin", "dave": "admin"}).replace("token_ttl_seconds = 30", "token_ttl_seconds = 0.4")
    server = make_server(policy_text=text)
    alice, dave = connect(server, "alice"), connect(server, "dave")
    request = pb.ResetDeviceRequest(address="0000:01:00.0")
    pci = server.service.pci["0000:01:00.0"]

    def denied(client, token, reason):
        with pytest.raises(grpc.RpcError) as info:
            client.ResetDevice(request, token=token)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert reason in info.value.details()

    denied(alice, None, "elevation token required")
    token = alice.MintElevationToken(pb.MintElevationTokenRequest())
    assert 0 < token.ttl_seconds <= 60
    denied(dave, token.token, "invalid for this certificate")  # replayed with another (admin) certificate
    denied(alice, token.token[:-2] + "xx", "invalid for this certificate")
    assert pci.resets == 0 and server.service.handler_calls["ResetDevice"] == 0
    assert alice.ResetDevice(request, token=token.token).resets == 1
    time.sleep(0.5)
    denied(alice, token.token, "expired")
    assert pci.resets == 1
    log = server.audit_path.read_text()
    assert token.token not in log  # never logged


def test_revocation_is_checked_on_every_call_and_reloaded(make_server, lab, connect) -> None:
    server = make_server()
    client = connect(server, "bob")
    assert code_of(client.Ping, pb.PingRequest()) == grpc.StatusCode.OK
    deny = server.dir / "revoked.txt"
    original = deny.read_text()
    deny.write_text(original + lab.fingerprints["bob"] + "\n")
    before = server.service.handler_calls["Ping"]
    with pytest.raises(grpc.RpcError) as info:
        client.Ping(pb.PingRequest())  # same connection, no restart
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in info.value.details()
    assert server.service.handler_calls["Ping"] == before
    assert code_of(connect(server, "dave").Ping, pb.PingRequest()) == grpc.StatusCode.OK
    deny.write_text(original + "\n")
    assert code_of(client.Ping, pb.PingRequest()) == grpc.StatusCode.OK


def test_enrolment_reloads_and_broken_policy_keeps_the_last_good_one(make_server, lab, connect) -> None:
    server = make_server()
    mallory = connect(server, "mallory")
    assert code_of(mallory.Ping, pb.PingRequest()) == grpc.StatusCode.PERMISSION_DENIED
    server.policy_path.write_text(lab.policy_text(identities={**ROLES, "mallory": "viewer"}))
    assert code_of(mallory.Ping, pb.PingRequest()) == grpc.StatusCode.OK
    server.policy_path.write_text("this is [not toml")
    assert code_of(mallory.Ping, pb.PingRequest()) == grpc.StatusCode.OK


def test_audit_has_one_decision_per_call_and_no_secrets(make_server, connect) -> None:
    server = make_server()
    alice, carol, bad = connect(server, "alice"), connect(server, "carol"), connect(server, "two_uris")
    lease = lease_of(alice)
    handle = alice.Allocate(pb.AllocateRequest(lease=lease, device="CPU:0", nbytes=32)).handle
    alice.Write(pb.WriteRequest(lease=lease, handle=handle, data=b"secret-payload-123"))
    token = alice.MintElevationToken(pb.MintElevationTokenRequest()).token
    outcomes = [
        code_of(alice.Read, pb.ReadRequest(lease=lease, handle=handle, length=32)),
        code_of(alice.Read, pb.ReadRequest(lease=lease, handle=b"\0" * 16, length=1)),
        code_of(carol.Allocate, pb.AllocateRequest(lease=lease, device="CPU:0", nbytes=1)),
        code_of(bad.Ping, pb.PingRequest()),
        code_of(alice.BarWrite, pb.BarWriteRequest(address="0000:01:00.0", bar=2, data=b"qqqq"), token=token),
        code_of(alice.Free, pb.FreeRequest(lease=lease, handle=handle)),
    ]
    records = server.audit_records()
    decisions = [r for r in records if r["event"] == "decision"]
    assert len(decisions) == 4 + len(outcomes)  # OpenLease, Allocate, Write, Mint + the six above
    assert [d["status"] for d in decisions[-6:]] == [c.name for c in outcomes]
    assert [d["method"] for d in decisions[-6:]] == ["Read", "Read", "Allocate", "Ping", "BarWrite", "Free"]
    for d in decisions:
        assert {"identity", "method", "status", "reason"} <= d.keys()
    effects = [r["action"] for r in records if r["event"] == "effect"]
    assert effects == ["lease_opened", "alloc", "write", "elevation_token_minted", "bar_write", "free"]
    text = server.audit_path.read_text()
    assert token not in text and "secret-payload-123" not in text and handle.hex() not in text
