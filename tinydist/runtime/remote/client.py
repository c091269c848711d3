"""Client side of the remote device service: a mutually-authenticated channel, and a lease kept
alive in the background.

Credentials are `tinydist.security.pki.ClientCredentials`: explicit paths or TINYDIST_CERT / TINYDIST_KEY /
TINYDIST_CA (PEM files: the client certificate, its key, and the lab CA that signed the server's
certificate).
"""

from __future__ import annotations

import threading
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
