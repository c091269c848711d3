"""Remote access that explains itself (issue 22, item 8): every gRPC status a node can answer is one
of our errors, raised `from` the original; a refusal carries the policy line to add; a TLS failure
names the file and the fix. Real certificates on loopback, a real gRPC server for each status."""

from __future__ import annotations

import shutil
from concurrent import futures

import grpc
import numpy as np
import pytest

import tinydist as td
from tests.remote.conftest import TD, uri
from tinydist.base.errors import (CompileError, DeviceClosed, DeviceFailed, DeviceUnavailable, OutOfBounds, TenantWorkerFailed,
                                  TinydistError)
from tinydist.runtime.remote.device import RemoteDevice
from tinydist.runtime.remote.errors import STATUS_ERRORS, AccessDenied, NotOnNode, RemoteCallFailed, from_rpc
from tinydist.security import pki
from tinydist.security.pki import ClientCredentials
from tinydist.transports.pci_remote._generated import device_pb2 as pb

NULL_STORE_IR = "define void @boom(ptr %p) {\n  store volatile i64 1, ptr null\n  ret void\n}\n"


@pytest.fixture(scope="module")
def aborting() -> object:
    """A plain gRPC server whose one method ends each call with the status its request names."""
    def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
        context.abort(grpc.StatusCode[request.decode()], f"the node said {request.decode()}")
        return b""

    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "test.Abort", {"Call": grpc.unary_unary_rpc_method_handler(handle)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield channel.unary_unary("/test.Abort/Call")
    channel.close()
    server.stop(0)


def test_every_grpc_status_is_mapped_to_one_of_our_errors(aborting) -> None:
    assert set(STATUS_ERRORS) == set(grpc.StatusCode)
    for code in grpc.StatusCode:
        cls, fix = STATUS_ERRORS[code]
        assert issubclass(cls, TinydistError) and fix, code
        if code is grpc.StatusCode.OK:
            continue  # a server cannot end a call with OK and no reply: only the table can say it
        with pytest.raises(grpc.RpcError) as info:
            aborting(code.name.encode(), timeout=10)
        assert info.value.code() is code
        with pytest.raises(cls) as mapped:
            raise from_rpc(info.value, "Call", "127.0.0.1:1") from info.value
        assert mapped.value.__cause__ is info.value
        if code is not grpc.StatusCode.ABORTED:   # TenantWorkerFailed words the cause itself
            assert code.name in str(mapped.value) and f"the node said {code.name}" in str(mapped.value)
        if isinstance(mapped.value, RemoteCallFailed):
            assert (mapped.value.status, mapped.value.method, mapped.value.node) == (code.name, "Call", "127.0.0.1:1")


@pytest.mark.parametrize("code, expected, builtin", [
    ("OUT_OF_RANGE", OutOfBounds, IndexError), ("UNAVAILABLE", DeviceFailed, None), ("CANCELLED", DeviceClosed, None),
    ("PERMISSION_DENIED", AccessDenied, PermissionError), ("UNAUTHENTICATED", AccessDenied, PermissionError),
    ("NOT_FOUND", NotOnNode, LookupError), ("DEADLINE_EXCEEDED", RemoteCallFailed, TimeoutError),
    ("INVALID_ARGUMENT", RemoteCallFailed, ValueError), ("ABORTED", TenantWorkerFailed, None)])
def test_the_classes_are_the_ones_a_caller_expects(aborting, code, expected, builtin) -> None:
    with pytest.raises(grpc.RpcError) as info:
        aborting(code.encode(), timeout=10)
    error = from_rpc(info.value, "Read", "n:1")
    assert isinstance(error, expected) and (builtin is None or isinstance(error, builtin))


def _device(server, creds: ClientCredentials) -> RemoteDevice:
    device = RemoteDevice(f"remote://{server.target}/CPU:0", creds)
    td.get_engine().run(device.open)
    return device


def test_a_node_answers_with_our_errors_from_the_original(make_server, lab) -> None:
    server = make_server()
    device = _device(server, lab.creds["bob"])
    try:
        lease = device.session.lease
        handle = device.rpc("Allocate", pb.AllocateRequest(lease=lease, device="CPU:0", nbytes=64)).handle
        with pytest.raises(OutOfBounds, match="outside the 64-byte buffer") as out:
            device.rpc("Read", pb.ReadRequest(lease=lease, handle=handle, offset=60, length=8))
        assert out.value.__cause__.code() is grpc.StatusCode.OUT_OF_RANGE
        with pytest.raises(NotOnNode, match="no such handle"):
            device.rpc("Read", pb.ReadRequest(lease=lease, handle=b"x" * 16, offset=0, length=8))
        with pytest.raises(CompileError, match="refused the program"):
            device.load_ir("define void @f(ptr %p) {\n  call void @exit(i32 0)\n  ret void\n}\ndeclare void @exit(i32)\n",
                           "f", ["rw"])
        server.stop()  # the node goes away: the next call is a DeviceFailed, and the device is marked failed
        with pytest.raises(DeviceFailed, match="UNAVAILABLE") as gone:
            device.rpc("Ping", pb.PingRequest())
        assert device.failure is gone.value and gone.value.__cause__.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        td.get_engine().run(device.aclose)


def test_a_tenant_workers_death_is_tenant_worker_failed_on_the_client(make_server, lab) -> None:
    server = make_server()
    device = _device(server, lab.creds["bob"])
    try:
        buffer = device.allocator.alloc(8)
        program = device.load_ir(NULL_STORE_IR, "boom", ["rw"])
        with pytest.raises(TenantWorkerFailed) as died:
            program.cfunc(buffer.address)   # the launch as the queue worker issues it
        assert died.value.identity == uri("bob") and died.value.fatal and "SIGSEGV" in died.value.cause
        assert died.value.__cause__.code() is grpc.StatusCode.ABORTED
        assert device.failure is None   # the node kept bob's buffers: the device is still usable
        device.rpc("Write", pb.WriteRequest(lease=device.session.lease, handle=device.allocator.resolve(buffer.address)[0],
                                            data=b"12345678"))
        buffer.free()
    finally:
        td.get_engine().run(device.aclose)


def test_a_refusal_says_which_policy_line_to_add(make_server, lab) -> None:
    server = make_server()
    with pytest.raises(AccessDenied) as unenrolled:
        td.remote.connect(server.target, credentials=lab.creds["mallory"])
    text = str(unenrolled.value)
    assert f'"{uri("mallory")}" = "viewer"' in text and "[identities]" in text, text
    assert "tinydist certs enrol" in text and text.count("\n") == 0
    node = td.remote.connect(server.target, credentials=lab.creds["carol"])   # a viewer
    try:
        device = _device(server, lab.creds["carol"])
    except AccessDenied as exc:   # OpenLease needs operator
        assert f'"{uri("carol")}" = "operator"' in str(exc) and "has role viewer" in str(exc), str(exc)
    else:
        td.get_engine().run(device.aclose)
        pytest.fail("a viewer opened a lease")
    node.close()
    records = [r for r in server.audit_records() if r.get("event") == "decision" and r["status"] == "PERMISSION_DENIED"]
    assert {r["reason"] for r in records} == {"identity not enrolled", "role viewer below required operator"}


def test_connect_with_explicit_credentials_and_use_its_device(make_server, lab, tmp_path) -> None:
    server = make_server()
    paths = {}
    for part in ("cert", "key", "ca"):
        paths[part] = tmp_path / f"bob.{part}"
        paths[part].write_bytes(getattr(lab.creds["bob"], part))
    with td.remote.connect(server.target, cert=paths["cert"], key=paths["key"], ca=paths["ca"]) as node:
        status = node.status()
        assert (status.identity, status.role, status.devices) == (uri("bob"), "operator", ("CPU:0",))
        assert status.fingerprint == lab.fingerprints["bob"] and status.round_trip_s > 0
        x = np.arange(16, dtype=np.float32)
        t = td.Tensor(x, device=node.device("CPU:0"))   # no TINYDIST_CERT: the device opens with connect's credentials
        np.testing.assert_array_equal((t * 2).numpy(), x * 2)
        engine = td.get_engine()
        del t
        engine.synchronize(10)
        engine.run(engine._devices.pop(f"remote://{server.target}/CPU:0").aclose)


def _replace(creds: ClientCredentials, **parts: bytes) -> ClientCredentials:
    return ClientCredentials(parts.get("cert", creds.cert), parts.get("key", creds.key), parts.get("ca", creds.ca),
                             ("bob.pem", "bob.key", "ca.pem"))


def test_tls_failures_name_the_file_and_the_fix(make_server, lab, tmp_path) -> None:
    server = make_server()
    bob, alice = lab.creds["bob"], lab.creds["alice"]
    other = tmp_path / "other"
    pki.init(other, TD)
    cases = {
        "mismatched key": (_replace(bob, key=alice.key), "the key bob.key does not belong to the certificate bob.pem"),
        "another lab's CA": (_replace(bob, ca=(other / "ca.pem").read_bytes()), "not by the CA in ca.pem"),
        "not a certificate": (_replace(bob, cert=b"junk"), "bob.pem is not a PEM certificate"),
        "expired": (_replace(lab.creds["expired"]), "expired on"),
        "foreign certificate": (_replace(lab.creds["foreign"]), "was issued by 'CN=foreign CA', not by the CA in ca.pem"),
    }
    for name, (creds, expected) in cases.items():
        with pytest.raises(DeviceUnavailable) as failed:
            td.remote.connect(server.target, credentials=creds)
        assert expected in str(failed.value), (name, str(failed.value))
        assert "Failed to create security handshaker" not in str(failed.value)
    port = server.port
    server.stop()
    with pytest.raises(DeviceUnavailable, match=f"nothing listens at 127.0.0.1:{port}"):
        td.remote.connect(f"127.0.0.1:{port}", credentials=bob)


def test_a_node_on_another_address_needs_it_in_its_certificate(lab, tmp_path, make_server) -> None:
    """A node on a LAN address: 127.0.0.2 stands in for it (any 127/8 address is this machine)."""
    served = make_server(listen="127.0.0.2:0")
    with pytest.raises(DeviceUnavailable) as wrong:
        td.remote.connect(f"127.0.0.2:{served.port}", credentials=lab.creds["bob"])
    assert "names DNS:localhost, IP:127.0.0.1, IP:::1, not 127.0.0.2" in str(wrong.value), str(wrong.value)
    assert "--server-san 127.0.0.2" in str(wrong.value)
    # the same lab, its server certificate reissued with the LAN address: now it verifies
    lan = tmp_path / "lan"
    shutil.copytree(lab.root, lan)
    pki.issue_server(lan, dns=["localhost", "node1.lab"], ips=["127.0.0.1", "127.0.0.2"])
    from tests.remote.conftest import ServerThread
    from tinydist.nodes.service import ServerConfig
    folder = tmp_path / "node-pki"   # what a node gets: no ca/ folder
    folder.mkdir()
    for name in ("ca.pem", "server.pem", "server.key", "revoked.txt"):
        shutil.copy(lan / name, folder / name)
    (tmp_path / "node").mkdir()
    node_server = ServerThread(type(lab)(folder, lab.creds, lab.fingerprints), tmp_path / "node", ServerConfig(listen="127.0.0.2:0"))
    try:
        with td.remote.connect(f"127.0.0.2:{node_server.port}", credentials=lab.creds["bob"]) as node:
            assert node.whoami()[0] == uri("bob")
    finally:
        node_server.stop()
