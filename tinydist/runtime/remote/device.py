"""`remote://HOST:PORT/KIND:N`: a device of the same engine whose memory and kernels live on a node.

    td.Tensor(x, device="remote://127.0.0.1:7070/CPU:0")      # credentials from TINYDIST_CERT/KEY/CA

The runtime drives it like any device: its queues' worker threads run the commands a Batch built,
and here those commands are blocking gRPC calls. Buffers get addresses in an opaque local address
space (from 2**60 up, above any host pointer on 64-bit Linux) that never leaves this process: a
command resolves an address to (handle, offset) before it speaks to the server. Kernels go to the
server as LLVM IR (`load_ir`); the server verifies and compiles them itself.
"""

from __future__ import annotations

import bisect
import ctypes
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from tinydist.base.errors import DeviceError, DeviceFailed, DeviceNotFound, DeviceUnavailable, TinydistError
from tinydist.runtime.allocator import Allocator
from tinydist.runtime.device import Device
from tinydist.runtime.program import Program, check_signature
from tinydist.runtime.remote.client import CHUNK_BYTES, ClientCredentials, RemoteSession, credentials_for
from tinydist.runtime.remote.errors import from_rpc, open_error
from tinydist.security.pki import PKIError
from tinydist.transports.pci_remote import wire
from tinydist.transports.pci_remote._generated import device_pb2 as pb

REMOTE_BASE = 1 << 60
PAGE = 4096
_NAME = re.compile(r"^remote://([^/]+)/(.+)$")


class RemoteAllocator(Allocator):
    """Server allocations behind opaque local addresses (a guard page apart)."""

    def __init__(self, device: RemoteDevice) -> None:
        super().__init__(device, limit_bytes=1 << 50, cache_bytes=0)  # the server enforces quotas
        self.remote = device
        self._map_lock = threading.Lock()
        self._next = REMOTE_BASE
        self._starts: list[int] = []
        self._blocks: dict[int, tuple[bytes, int]] = {}  # start address -> (handle, nbytes)

    def _map(self, nbytes: int) -> int:
        session = self.remote.session
        if session is None:
            raise DeviceError(f"{self.remote.name} is not connected")
        reply = self.remote.rpc("Allocate", pb.AllocateRequest(lease=session.lease, device=self.remote.remote_name, nbytes=nbytes))
        with self._map_lock:
            address = self._next
            self._next += (nbytes + PAGE - 1) // PAGE * PAGE + PAGE
            bisect.insort(self._starts, address)
            self._blocks[address] = (reply.handle, nbytes)
        return address

    def _unmap(self, address: int, nbytes: int) -> None:
        with self._map_lock:
            handle, _ = self._blocks.pop(address)
            self._starts.pop(bisect.bisect_left(self._starts, address))
        if self.remote.session is not None and self.remote.session.lease:
            try:
                self.remote.rpc("Free", pb.FreeRequest(lease=self.remote.session.lease, handle=handle))
            except DeviceError as exc:
                self.remote.log.warning("remote free failed; the lease releases it", error=str(exc))

    def resolve(self, address: int) -> tuple[bytes, int, int] | None:
        """(handle, offset, nbytes of the block) for an address inside a live block, else None."""
        with self._map_lock:
            i = bisect.bisect_right(self._starts, address) - 1
            if i < 0:
                return None
            start = self._starts[i]
            handle, nbytes = self._blocks[start]
        offset = address - start
        if offset > nbytes:
            return None
        return handle, offset, nbytes


class RemoteDevice(Device):
    reconnects_after_failure = True  # a failure is the node's (restart, lost lease): a new session can serve
    def __init__(self, name: str, credentials: ClientCredentials | None = None) -> None:
        super().__init__(name)
        match = _NAME.match(name)
        if match is None:
            raise ValueError(f"remote device name {name!r} must be remote://HOST:PORT/KIND:N")
        self.target, self.remote_name = match.group(1), match.group(2)
        self._credentials = credentials
        self.session: RemoteSession | None = None
        self._allocator: RemoteAllocator | None = None
        self._boot = b""  # the node instance the session's lease lives on

    @property
    def allocator(self) -> RemoteAllocator:
        if self._allocator is None:
            self.check_usable()
            raise DeviceError(f"{self.name} has no allocator")
        return self._allocator

    def rpc(self, method: str, request: Any, metadata: Sequence[tuple[str, str]] | None = None,
            call: Callable[..., Any] | None = None) -> Any:
        """`method` through the session's stub, or through `call` (a multicallable for it)."""
        if self.session is None:
            raise DeviceError(f"{self.name} is not connected")
        try:
            return (call or getattr(self.session.stub, method))(request, timeout=self.session.timeout, metadata=metadata)
        except grpc.RpcError as exc:
            raise self._error(method, exc) from exc

    def _error(self, method: str, exc: grpc.RpcError) -> TinydistError:
        """A failed call as one of our errors (`tinydist.runtime.remote.errors`). The node no longer
        knowing this client's lease means every buffer of it is gone: the device is marked failed
        with what happened (a restart, told by the node's boot id, or an expired lease) and the
        engine opens a fresh session at its next use (`reconnects_after_failure`); so it is when the
        node is unreachable (UNAVAILABLE: a DeviceFailed)."""
        if exc.code() is not grpc.StatusCode.NOT_FOUND or exc.details() != "no such lease" or self.session is None:
            error = from_rpc(exc, method, self.target, self.name)
            return self.mark_failed(error) if isinstance(error, DeviceFailed) else error
        try:
            boot = self.session.stub.ListDevices(pb.ListDevicesRequest(), timeout=self.session.timeout).node_boot
        except grpc.RpcError:
            boot = None
        if boot == self._boot:
            what = "lease expired (the node heard nothing from this client for longer than its lease time): buffers are gone"
        else:
            what = "node restarted: buffers are gone"
        return self.mark_failed(DeviceFailed(f"{self.name}: {what}; the next use reconnects"))


    def _open_backend(self) -> None:
        try:
            credentials = self._credentials or credentials_for(self.target) or ClientCredentials.load()
        except PKIError as exc:
            raise DeviceUnavailable(f"remote device {self.name}: {exc}") from exc
        session = RemoteSession(self.target, credentials)
        try:
            try:
                devices = session.stub.ListDevices(pb.ListDevicesRequest(), timeout=session.timeout)
                session.open_lease()
            except grpc.RpcError as exc:
                raise open_error(self.name, self.target, credentials, "ListDevices" if not session.lease else "OpenLease",
                                 exc) from exc
            names = [d.name for d in devices.devices]
            if self.remote_name not in names:
                raise DeviceNotFound(f"{self.name}: node {self.target} exports no {self.remote_name}; it has {', '.join(names)}")
        except BaseException:
            session.close()
            raise
        self.session = session
        self._boot = devices.node_boot
        self._allocator = RemoteAllocator(self)

    def _close_backend(self) -> None:
        session, self.session = self.session, None  # _unmap sees no session: no Free per buffer
        try:
            if self._allocator is not None:
                self._allocator.release_all()
        finally:
            if session is not None:
                session.close()  # CloseLease releases every handle on the node at once

    def load_program(self, object_code: bytes, entry: str, signature: Sequence[str], calls: Sequence[Any] = ()) -> Program:
        raise DeviceError(f"{self.name} does not take object code (the node runs no client binaries); "
                          "pass LLVM IR with load_ir(), which the node verifies and compiles itself")

    def load_ir(self, ir_text: str, entry: str, signature: Sequence[str], compile: Callable[[str], bytes] | None = None) -> Program:
        self.check_usable()
        signature = check_signature(entry, signature)
        lease = self.session.lease if self.session is not None else b""
        reply = self.rpc("LoadProgram", pb.LoadProgramRequest(device=self.remote_name, kind=pb.PROGRAM_KIND_ENGINE_KERNEL, lease=lease,
                                                              llvm_ir=ir_text, entry=entry, signature=list(signature)))
        return Program(entry, signature, _Launcher(self, reply.program_id, signature), 0)

    def load_generated(self, source: str, render: Callable[[], str], entry: str, signature: Sequence[str],
                       compile: Callable[[str, Callable[[], str]], bytes] | None = None) -> Program:
        return self.load_ir(render(), entry, signature)

    def host_copy(self) -> Callable[[int, int, int], None]:
        return self._copy

    # ---- commands (run on the queue worker threads) ------------------------------------------

    def _resolve(self, address: int) -> tuple[bytes, int, int] | None:
        if address < REMOTE_BASE or self._allocator is None:
            return None
        found = self._allocator.resolve(address)
        if found is None:
            raise DeviceError(f"{self.name}: address {address:#x} is in no live remote buffer")
        return found

    def _copy(self, dst: int, src: int, nbytes: int) -> None:
        session = self.session
        if session is None:
            raise DeviceError(f"{self.name} is closed")
        d, s = self._resolve(dst), self._resolve(src)
        lease = session.lease
        if d is not None and s is not None:
            self.rpc("Copy", pb.CopyRequest(lease=lease, dst=d[0], dst_offset=d[1], src=s[0], src_offset=s[1], length=nbytes))
        elif d is not None:
            if nbytes <= CHUNK_BYTES:
                self.rpc("Write", pb.WriteRequest(lease=lease, handle=d[0], offset=d[1], data=ctypes.string_at(src, nbytes)))
            else:
                chunks = SourceChunks(lease, d[0], d[1], src, nbytes)
                try:
                    self.rpc("WriteStream", chunks, call=session.write_stream)
                finally:
                    chunks.close()
        elif s is not None:
            if nbytes <= CHUNK_BYTES:
                data = self.rpc("Read", pb.ReadRequest(lease=lease, handle=s[0], offset=s[1], length=nbytes), call=session.read)
                _check_len(self.name, data, nbytes)
                wire.copy_into(dst, data)
            else:
                replies = self.rpc("ReadStream", pb.ReadRequest(lease=lease, handle=s[0], offset=s[1], length=nbytes, chunk_bytes=CHUNK_BYTES),
                                   call=session.read_stream)
                position = 0
                try:
                    for data in replies:
                        size = len(data)
                        if position + size > nbytes:
                            raise DeviceError(f"{self.name}: the node sent more than the {nbytes} bytes asked for")
                        wire.copy_into(dst + position, data)
                        position += size
                except grpc.RpcError as exc:
                    raise self._error("ReadStream", exc) from exc
                if position != nbytes:
                    raise DeviceError(f"{self.name}: the node sent {position} of {nbytes} bytes")
        else:
            ctypes.memmove(dst, src, nbytes)


def _check_len(name: str, data: memoryview, nbytes: int) -> None:
    if len(data) != nbytes:
        raise DeviceError(f"{name}: the node sent {len(data)} bytes, {nbytes} were asked for")


class SourceChunks(Iterator[bytes]):
    """An encoded WriteStream of `nbytes` at host address `src`: the first message names the
    destination, each later one holds only data, encoded straight from the source memory.

    gRPC pulls it on a thread of its own that can still be inside `next()` when the call has already
    ended with an error; `close()` waits for that chunk and ends the stream, so nothing reads `src`
    after the copy command returns and its caller may free the source."""

    def __init__(self, lease: bytes, handle: bytes, offset: int, src: int, nbytes: int) -> None:
        self._header: bytes | None = pb.WriteRequest(lease=lease, handle=handle, offset=offset).SerializeToString()
        self._src = src
        self._nbytes = nbytes
        self._position = 0
        self._lock = threading.Lock()
        self._closed = False

    def __next__(self) -> bytes:
        with self._lock:
            if self._closed:
                raise StopIteration
            if self._header is not None:
                header, self._header = self._header, None
                return header
            if self._position >= self._nbytes:
                raise StopIteration
            size = min(CHUNK_BYTES, self._nbytes - self._position)
            chunk = wire.encode_write_data(wire.memory(self._src + self._position, size))
            self._position += size
            return chunk

    def close(self) -> None:
        with self._lock:
            self._closed = True


class _Launcher:
    """A Program's `cfunc` for a remote kernel: buffer addresses → (handle, offset, length).
    The node holds the program for the lease it was loaded under (the session's), within the
    identity's program quota, and unloads it with the lease."""

    def __init__(self, device: RemoteDevice, program_id: str, signature: tuple[str, ...]) -> None:
        self.device = device
        self.program_id = program_id
        self.signature = signature

    def __call__(self, *values: Any) -> None:
        args = []
        for value, kind in zip(values, self.signature):
            if kind in ("r", "w", "rw"):
                found = self.device._resolve(value)
                if found is None:
                    raise DeviceError(f"{self.device.name}: kernel argument is not a remote buffer")
                handle, offset, nbytes = found
                args.append(pb.LaunchArg(buffer=pb.BufferArg(handle=handle, offset=offset, length=nbytes - offset)))
            else:
                args.append(pb.LaunchArg(**{kind: value}))
        session = self.device.session
        if session is None:
            raise DeviceError(f"{self.device.name} is closed")
        request = pb.LaunchRequest(lease=session.lease, device=self.device.remote_name, program_id=self.program_id, args=args)
        self.device.rpc("Launch", request)
