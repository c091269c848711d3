"""Hosting the device service: bind checks, gRPC server options, and the running server's
life cycle (devices opened, health service, lease reaper, orderly stop).

What a call may do is `service.DeviceService`'s business; this module only puts it on a port.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tinydist.nodes.audit import AuditLog
from tinydist.nodes.pci_sim import SimulatedPciFunction
from tinydist.nodes.gate import SERVICE
from tinydist.nodes.service import DeviceService, ServerConfig
from tinydist.base.logs import get_logger
from tinydist.runtime.device import Device
from tinydist.runtime.registry import open_device
from tinydist.security.bind import add_port, bind_address
from tinydist.security.pki import ServerCredentials
from tinydist.security.policy import PolicyStore


def _log():  # not at import: configuring logs then would bind the importer's stderr
    return get_logger(component="remote-server")


def server_options(config: ServerConfig) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_concurrent_streams", config.max_concurrent_streams),
        ("grpc.max_allowed_incoming_connections", config.max_connections),
        ("grpc.server_handshake_timeout_ms", int(config.handshake_timeout_s * 1000)),
        ("grpc.keepalive_time_ms", int(config.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(config.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", int(config.min_ping_interval_s * 1000)),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.max_metadata_size", config.max_metadata_bytes),
        ("grpc.absolute_max_metadata_size", config.max_metadata_bytes),
        ("grpc.so_reuseport", 0),
        # a connection lives at most max_connection_age (then drains its calls for the grace period) and
        # closes after max_connection_idle without calls: a client holds no connection slot forever
        ("grpc.max_connection_age_ms", int(config.max_connection_age_s * 1000)),
        ("grpc.max_connection_age_grace_ms", int(config.max_connection_age_grace_s * 1000)),
        ("grpc.max_connection_idle_ms", int(config.max_connection_idle_s * 1000)),
    ]


class BoundedHealth(health.aio.HealthServicer):
    """The standard health service with its Watch streams capped, all callers together: health is
    not gated by identity (the plaintext loopback port serves it too), so without a cap 256 idle
    watchers — from a revoked certificate, say — would fill the node's global call cap."""

    def __init__(self, max_watchers: int) -> None:
        super().__init__()
        self.max_watchers = max_watchers
        self.watchers = 0

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        if self.watchers >= self.max_watchers:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.max_watchers} health watchers already; poll with Check instead")
        self.watchers += 1
        try:
            await super().Watch(request, context)
        finally:
            self.watchers -= 1


class RemoteServer:
    """A running node service. Use `await RemoteServer.start(...)`, then `await server.stop()`."""

    def __init__(self) -> None:
        self.server: grpc.aio.Server | None = None
        self.service: DeviceService | None = None
        self.port = 0
        self.insecure_port: int | None = None
        self.health: Any = None
        self._reaper: asyncio.Task[None] | None = None
        self._devices: list[Device] = []

    @classmethod
    async def start(cls, config: ServerConfig, pki: ServerCredentials, policy_path: Path, audit: AuditLog,
                    insecure_listen: str | None = None, pci: dict[str, SimulatedPciFunction] | None = None) -> RemoteServer:
        listen = bind_address(config.listen, allow_wildcard=config.allow_wildcard)
        if insecure_listen is not None:
            insecure_listen = bind_address(insecure_listen, loopback_only=True)
        store = PolicyStore(policy_path)  # refuses a missing or invalid policy
        self = cls()
        devices: dict[str, Device] = {}
        try:
            for name in config.devices:
                device = open_device(name)
                await device.open()
                self._devices.append(device)
                devices[device.name] = device
            if pci is None:
                function = SimulatedPciFunction()
                pci = {function.address: function}
            self.service = DeviceService(config, store, audit, devices, pci)
            self.server = grpc.aio.server(options=server_options(config), maximum_concurrent_rpcs=config.max_concurrent_rpcs)
            self.server.add_generic_rpc_handlers((self.service.handlers(),))
            self.health = BoundedHealth(config.max_health_watchers)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
            credentials = grpc.ssl_server_credentials([(pki.key, pki.cert)], root_certificates=pki.ca, require_client_auth=True)
            self.port = add_port(self.server, listen, credentials)
            if insecure_listen is not None:
                # Health checks only: the device service refuses calls without a TLS identity.
                self.insecure_port = add_port(self.server, insecure_listen)
            await self.server.start()
            await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
            await self.health.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
            self._reaper = asyncio.get_running_loop().create_task(self._reap_loop())
        except BaseException:
            await self.stop()
            raise
        _log().info("node serving", listen=listen, port=self.port, devices=list(devices))
        return self

    async def _reap_loop(self) -> None:
        interval = min(self.service.config.reap_interval_s, self.service.config.lease_ttl_s / 4) if self.service else 1.0
        while True:
            await asyncio.sleep(interval)
            if self.service is not None:
                self.service.table.reap()

    async def stop(self, grace: float = 1.0) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        if self.server is not None:
            await self.server.stop(grace)
            self.server = None
        if self.service is not None:
            for lease in list(self.service.table.leases.values()):
                self.service.table.release_lease(lease, "server stopping")
            await self.service.tenants.stop_all()
        for device in self._devices:
            await device.aclose()
        self._devices = []
