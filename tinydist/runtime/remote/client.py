"""Client side of the remote device service: a mutually-authenticated channel, a lease kept
alive in the background, and the public client (`td.remote.connect`).

Credentials are `tinydist.security.pki.ClientCredentials`: explicit paths or TINYDIST_CERT / TINYDIST_KEY /
TINYDIST_CA (PEM files: the client certificate, its key, and the lab CA that signed the server's
certificate). `connect(target, cert=, key=, ca=)` checks them against the node at once (a TLS failure
is a `DeviceUnavailable` naming the file and the fix, a refusal an `AccessDenied` with the policy line)
and makes them the credentials of every `remote://TARGET/...` device this process opens.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from tinydist.base.logs import get_logger
from tinydist.security.pki import ClientCredentials
from tinydist.transports.pci_remote import wire
from tinydist.transports.pci_remote._generated import device_pb2 as pb
from tinydist.transports.pci_remote._generated import device_pb2_grpc as pb_grpc

MAX_MESSAGE_BYTES = 8 << 20
CHUNK_BYTES = 4 << 20
_SERVICE = pb.DESCRIPTOR.services_by_name["DeviceService"].full_name


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 2),
    ]


def secure_channel(target: str, credentials: ClientCredentials) -> grpc.Channel:
    return grpc.secure_channel(target, credentials.channel_credentials(), options=channel_options())


class RemoteSession:
    """A channel to one node, its stub, and (once `open_lease` ran) a lease renewed every ttl/3."""

    def __init__(self, target: str, credentials: ClientCredentials, timeout: float = 30.0) -> None:
        self.target = target
        self.timeout = timeout
        self.channel = secure_channel(target, credentials)
        self.stub = pb_grpc.DeviceServiceStub(self.channel)
        # Bulk data moves wire-encoded (see wire.py): one copy per message.
        self.write_stream: grpc.StreamUnaryMultiCallable[bytes, pb.WriteReply] = self.channel.stream_unary(f"/{_SERVICE}/WriteStream", request_serializer=None,
                                                      response_deserializer=pb.WriteReply.FromString)
        self.read = self.channel.unary_unary(f"/{_SERVICE}/Read", request_serializer=pb.ReadRequest.SerializeToString,
                                             response_deserializer=wire.decode_read_reply)
        self.read_stream = self.channel.unary_stream(f"/{_SERVICE}/ReadStream", request_serializer=pb.ReadRequest.SerializeToString,
                                                     response_deserializer=wire.decode_read_reply)
        self.lease = b""
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self.log = get_logger(component="remote-client", target=target)

    def open_lease(self, renew: bool = True) -> bytes:
        reply = self.stub.OpenLease(pb.OpenLeaseRequest(), timeout=self.timeout)
        self.lease = reply.lease
        if renew:
            interval = max(reply.ttl_seconds / 3.0, 0.05)
            self._renewer = threading.Thread(target=self._renew, args=(interval,), name=f"tinydist:lease:{self.target}", daemon=True)
            self._renewer.start()
        return self.lease

    def _renew(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.stub.RenewLease(pb.RenewLeaseRequest(lease=self.lease), timeout=self.timeout)
            except grpc.RpcError as exc:
                self.log.warning("lease renewal failed", code=exc.code().name)

    def close(self, release: bool = True) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(self.timeout)
            self._renewer = None
        if release and self.lease:
            try:
                self.stub.CloseLease(pb.CloseLeaseRequest(lease=self.lease), timeout=self.timeout)
            except grpc.RpcError as exc:
                self.log.warning("closing the lease failed; the server releases it when it expires", code=exc.code().name)
        self.lease = b""
        self.channel.close()


_CREDENTIALS: dict[str, ClientCredentials] = {}  # target -> what `connect` was given for it
_CREDENTIALS_LOCK = threading.Lock()


def credentials_for(target: str) -> ClientCredentials | None:
    """The credentials `connect` registered for `target`, if any (a remote device's first choice)."""
    with _CREDENTIALS_LOCK:
        return _CREDENTIALS.get(target)


@dataclass(frozen=True)
class NodeStatus:
    """What a node says about itself and about the caller (`Node.status`, `tinydist node status`)."""

    target: str
    identity: str           # the caller, as the node read it from the certificate
    role: str               # its role in the node's policy
    fingerprint: str        # sha256 of the caller's certificate (what a revocation lists)
    devices: tuple[str, ...]
    boot: str               # the node instance (hex; new at each start)
    round_trip_s: float     # one Ping through the node's gate


class Node:
    """A node reached over mutual TLS with explicit credentials (`td.remote.connect`).

        node = td.remote.connect("10.0.0.5:7070", cert="alice.pem", key="alice.key", ca="ca.pem")
        x = td.Tensor(np.ones(4, np.float32), device=node.device("CPU:0"))
    """

    def __init__(self, target: str, credentials: ClientCredentials, timeout: float = 10.0) -> None:
        self.target = target
        self.credentials = credentials
        self.timeout = timeout
        self._channel = secure_channel(target, credentials)
        self._stub = pb_grpc.DeviceServiceStub(self._channel)

    def _call(self, method: str, request: Any, first: bool = False) -> Any:
        from tinydist.runtime.remote.errors import from_rpc, open_error
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            if first:
                raise open_error(f"node {self.target}", self.target, self.credentials, method, exc) from exc
            raise from_rpc(exc, method, self.target) from exc

    def whoami(self) -> tuple[str, str, str]:
        """(identity, role, fingerprint) of this client as the node sees it."""
        reply = self._call("WhoAmI", pb.WhoAmIRequest())
        return reply.identity, reply.role, reply.fingerprint

    def devices(self) -> list[str]:
        """The devices the node exports ("CPU:0", ...)."""
        return [d.name for d in self._call("ListDevices", pb.ListDevicesRequest()).devices]

    def device(self, name: str = "CPU:0") -> str:
        """The engine's name for the node's device `name` (`remote://TARGET/NAME`), for `td.Tensor(..., device=)`;
        it opens with this node's credentials."""
        from tinydist.base.errors import DeviceNotFound
        names = self.devices()
        if name not in names:
            raise DeviceNotFound(f"node {self.target} exports no {name}; it has {', '.join(names) or 'none'}")
        return f"remote://{self.target}/{name}"

    def status(self) -> NodeStatus:
        started = time.perf_counter()
        self._call("Ping", pb.PingRequest(), first=True)
        round_trip = time.perf_counter() - started
        identity, role, fingerprint = self.whoami()
        listing = self._call("ListDevices", pb.ListDevicesRequest())
        return NodeStatus(self.target, identity, role, fingerprint, tuple(d.name for d in listing.devices),
                          listing.node_boot.hex(), round_trip)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Node:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(target: str, cert: str | Path | None = None, key: str | Path | None = None, ca: str | Path | None = None,
            *, credentials: ClientCredentials | None = None, timeout: float = 10.0) -> Node:
    """A `Node` at `target` (HOST:PORT) with these credentials: PEM paths (each missing one from
    TINYDIST_CERT / TINYDIST_KEY / TINYDIST_CA), or a `ClientCredentials`. One call (WhoAmI) checks
    them now: `DeviceUnavailable` with the cause and fix when TLS fails, `AccessDenied` with the policy
    line when the node refuses the identity. Remote devices on `target` then open with them."""
    creds = credentials or ClientCredentials.load(cert, key, ca)
    node = Node(target, creds, timeout)
    try:
        node._call("WhoAmI", pb.WhoAmIRequest(), first=True)
    except BaseException:
        node.close()
        raise
    with _CREDENTIALS_LOCK:
        _CREDENTIALS[target] = creds
    return node
