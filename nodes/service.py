"""The remote device service (grpc.aio): the node's devices, leases, handles and programs, and
the handler of each RPC. Every call passes the gate (`tinydist.nodes.gate`: identity, revocation, role,
rate, elevation) before its handler runs and ends in one audit `decision` record. Memory is named by opaque random 128-bit handles
owned by (identity, lease); offsets and lengths are checked as `offset <= size and length <= size -
offset` in Python integers (no overflow) before anything reaches a device. The runtime runs the
work: allocations, copies and kernels go through the same Device/Batch API local code uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from tinydist.nodes.audit import AuditLog, handle_tag
from tinydist.nodes.gate import Call, Code, Gate, RpcError
from tinydist.nodes.leases import Allocation, Lease, LeaseTable
from tinydist.nodes.pci_sim import SimulatedPciFunction
from tinydist.nodes.tenants import Segment, TenantPool
from tinydist.nodes.verifier import ENGINE, RAW, VerificationError, program_id, verify
from tinydist.base.errors import AllocationError, CompileError, TenantWorkerFailed
from tinydist.runtime.buffer import Buffer
from tinydist.runtime.device import Device
from tinydist.runtime.program import Program
from tinydist.security.policy import PolicyStore
from tinydist.transports.pci_remote import wire
from tinydist.transports.pci_remote._generated import device_pb2 as pb


@dataclass
class ServerConfig:
    listen: str = "127.0.0.1:7070"
    devices: tuple[str, ...] = ("CPU:0",)
    allow_wildcard: bool = False
    max_message_bytes: int = 8 << 20
    max_concurrent_streams: int = 64
    max_connections: int = 64
    max_concurrent_rpcs: int = 256
    max_health_watchers: int = 16  # health Watch streams at once, all callers (health is not gated)
    handshake_timeout_s: float = 5.0
    keepalive_time_s: float = 60.0
    keepalive_timeout_s: float = 20.0
    min_ping_interval_s: float = 10.0
    max_metadata_bytes: int = 16 << 10
    lease_ttl_s: float = 30.0
    reap_interval_s: float = 1.0
    stream_chunk_bytes: int = 4 << 20
    max_allocation_bytes: int = 1 << 34
    op_timeout_s: float = 60.0
    max_connection_age_s: float = 3600.0
    max_connection_age_grace_s: float = 60.0
    max_connection_idle_s: float = 300.0
    # kernels on host-memory devices run in a worker process per tenant (nodes.tenants)
    isolate_tenants: bool = True
    worker_heap_bytes: int = 2 << 30  # the worker's RLIMIT_AS beyond the tenant's byte quota
    worker_cpu_seconds: int = 3600    # the worker's RLIMIT_CPU (a backstop; deadlines end runaway kernels)
    # a tenant whose worker died this many times in a row waits worker_backoff_s (doubling, at most
    # worker_backoff_max_s) before its next worker starts (nodes.tenants.TenantPool)
    worker_backoff_after: int = 3
    worker_backoff_s: float = 1.0
    worker_backoff_max_s: float = 60.0


@dataclass(frozen=True)
class IsolatedProgram:
    """A program for a tenant worker: compiled here, loaded only in the workers that launch it."""
    signature: tuple[str, ...]
    code: bytes
    symbol: str


def tenant_metadata(exc: TenantWorkerFailed) -> tuple[tuple[str, str], ...]:
    """The trailing metadata that tells a client its tenant worker failed (`TenantWorkerFailed` on its
    side, whatever the status); ASCII only, as gRPC requires of text metadata."""
    def ascii_(text: str) -> str:
        return text.encode("ascii", "replace").decode()[:400]
    return ((wire.ERROR_METADATA, "TenantWorkerFailed"), (wire.TENANT_METADATA, ascii_(exc.identity)),
            (wire.CAUSE_METADATA, ascii_(exc.cause)), (wire.FATAL_METADATA, "1" if exc.fatal else "0"))


def _check_range(nbytes: int, offset: int, length: int) -> None:
    if not (offset <= nbytes and length <= nbytes - offset):
        raise RpcError(Code.OUT_OF_RANGE, f"range offset={offset} length={length} is outside the {nbytes}-byte buffer")


class DeviceService:
    """The node's state and its RPC handlers (`rpc_<Method>(request, call)`, each given the
    admitted `Call`); `handlers()` puts them behind the gate (`tinydist.nodes.gate`)."""

    def __init__(self, config: ServerConfig, policy: PolicyStore, audit: AuditLog, devices: dict[str, Device],
                 pci: dict[str, SimulatedPciFunction] | None = None, compile_ir: Callable[[str], bytes] | None = None) -> None:
        self.config = config
        self.policy = policy
        self.audit = audit
        self.devices = devices
        self.pci = pci if pci is not None else {}
        self.gate = Gate(config.op_timeout_s, policy, audit)
        self.table = LeaseTable(audit, config.lease_ttl_s)
        self._programs: dict[tuple[str, str], Program | IsolatedProgram] = {}  # content-addressed, shared by the leases holding them
        self._program_bytes: dict[tuple[str, str], int] = {}  # IR + object code of each
        self.table.on_release = self._unload
        self._resets: dict[str, list[float]] = {}
        self.boot = secrets.token_bytes(16)  # tells clients this node instance from the one before a restart  # when each identity's resets of the last minute happened
        self._compile_ir = compile_ir
        self._compile_lock = asyncio.Lock()
        self.tenants = TenantPool(config.worker_heap_bytes, config.worker_cpu_seconds, config.worker_backoff_after,
                                  config.worker_backoff_s, config.worker_backoff_max_s)
        self._stopping: set[asyncio.Task[None]] = set()

    def handlers(self) -> grpc.GenericRpcHandler:
        return self.gate.handlers(self)

    @property
    def handler_calls(self) -> Counter[str]:
        """How often each handler body ran (tests prove refusals ran none)."""
        return self.gate.handler_calls

    # ---- helpers -------------------------------------------------------------------------------

    def _effect(self, call: Call, action: str, **details: Any) -> None:
        self.audit.effect(identity=call.identity, method=call.method, action=action, **details)

    def _device(self, name: str) -> Device:
        device = self.devices.get(name)
        if device is None:
            raise RpcError(Code.NOT_FOUND, "no such device")
        return device

    def _lease(self, call: Call, lease_id: bytes) -> Lease:
        lease = self.table.lease(call.identity, lease_id)
        if lease is None:
            raise RpcError(Code.NOT_FOUND, "no such lease")
        return lease

    def _allocation(self, call: Call, lease: Lease, handle: bytes) -> Allocation:
        alloc = self.table.allocation(call.identity, lease, handle)
        if alloc is None:
            raise RpcError(Code.NOT_FOUND, "no such handle")  # the same answer for foreign and missing
        return alloc

    def _isolated(self, device: Device) -> bool:
        return self.config.isolate_tenants and device.host_visible

    async def _settled(self, alloc: Allocation) -> Segment:
        """`alloc`'s segment once its tenant's queued kernels are done with it (they run in order)."""
        worker = self.tenants.current(alloc.identity)
        if worker is not None:
            await worker.drain()
        if not isinstance(alloc.buffer, Segment):
            raise RpcError(Code.INTERNAL, "not a tenant segment")
        return alloc.buffer

    async def _wait(self, call: Call, completion: Any) -> None:
        remaining = call.deadline - time.monotonic()
        if remaining <= 0:
            raise RpcError(Code.DEADLINE_EXCEEDED, "deadline exceeded")
        try:
            await asyncio.wait_for(completion.wait(), remaining)
        except (asyncio.TimeoutError, TimeoutError):
            raise RpcError(Code.DEADLINE_EXCEEDED, "deadline exceeded before the device finished") from None

    # ---- viewer ----------------------------------------------------------------------------------

    async def rpc_Ping(self, request: pb.PingRequest, call: Call) -> pb.PingReply:
        return pb.PingReply(payload=request.payload)

    async def rpc_WhoAmI(self, request: Any, call: Call) -> pb.WhoAmIReply:
        return pb.WhoAmIReply(identity=call.identity, role=call.role, fingerprint=call.fingerprint)

    async def rpc_ListDevices(self, request: Any, call: Call) -> pb.ListDevicesReply:
        return pb.ListDevicesReply(devices=[pb.DeviceInfo(name=n, detail=type(d).__name__) for n, d in self.devices.items()],
                                   node_boot=self.boot)

    async def rpc_ListPciFunctions(self, request: Any, call: Call) -> pb.ListPciFunctionsReply:
        return pb.ListPciFunctionsReply(functions=[
            pb.PciFunctionInfo(address=a, vendor_id=f.vendor_id, device_id=f.device_id, bars=sorted(f.bars))
            for a, f in self.pci.items()])

    # ---- leases and memory -------------------------------------------------------------------

    async def rpc_OpenLease(self, request: Any, call: Call) -> pb.LeaseReply:
        quota = call.policy.quota_of(call.identity)
        if self.table.count(call.identity) >= quota.max_leases:
            raise RpcError(Code.RESOURCE_EXHAUSTED, "lease quota exceeded")
        lease = self.table.open(call.identity)
        self._effect(call, "lease_opened")
        return pb.LeaseReply(lease=lease.id, ttl_seconds=self.config.lease_ttl_s)

    async def rpc_RenewLease(self, request: pb.RenewLeaseRequest, call: Call) -> pb.LeaseReply:
        lease = self._lease(call, request.lease)
        return pb.LeaseReply(lease=lease.id, ttl_seconds=self.config.lease_ttl_s)

    async def rpc_CloseLease(self, request: pb.CloseLeaseRequest, call: Call) -> pb.CloseLeaseReply:
        lease = self._lease(call, request.lease)
        return pb.CloseLeaseReply(released=self.table.release_lease(lease, "lease closed"))

    async def rpc_Allocate(self, request: pb.AllocateRequest, call: Call) -> pb.AllocateReply:
        lease = self._lease(call, request.lease)
        device = self._device(request.device)
        nbytes = request.nbytes
        if nbytes == 0:
            raise RpcError(Code.INVALID_ARGUMENT, "allocation size must be positive")
        quota = call.policy.quota_of(call.identity)
        if nbytes > self.config.max_allocation_bytes or self.table.bytes_by_identity[call.identity] + nbytes > quota.max_bytes:
            raise RpcError(Code.RESOURCE_EXHAUSTED, "allocation quota exceeded")
        if self.table.handles_by_identity[call.identity] >= quota.max_handles:
            raise RpcError(Code.RESOURCE_EXHAUSTED, "handle quota exceeded")
        buffer: Buffer | Segment
        if self._isolated(device):
            try:
                buffer = Segment(nbytes)  # a fresh memfd reads as zeros
            except OSError as exc:
                raise RpcError(Code.RESOURCE_EXHAUSTED, f"the node cannot create more shared memory ({exc.strerror})") from None
        else:
            try:
                buffer = device.allocator.alloc(nbytes)
            except AllocationError:
                raise RpcError(Code.RESOURCE_EXHAUSTED, "device out of memory") from None
            try:
                await self._wait(call, device.copyin(buffer, np.zeros(nbytes, np.uint8)))  # fresh memory reads as zeros
            except BaseException:
                buffer.free()
                raise
        handle = self.table.add(call.identity, lease, device, buffer, nbytes).handle
        self._effect(call, "alloc", handle=handle_tag(handle), nbytes=nbytes, device=request.device)
        return pb.AllocateReply(handle=handle, nbytes=nbytes)

    async def rpc_Free(self, request: pb.FreeRequest, call: Call) -> pb.FreeReply:
        alloc = self._allocation(call, self._lease(call, request.lease), request.handle)
        if alloc.busy:
            raise RpcError(Code.FAILED_PRECONDITION, "buffer is in use by an in-flight operation")
        self.table.release(alloc, call.method, "freed by owner")
        return pb.FreeReply()

    async def _write(self, call: Call, alloc: Allocation, offset: int, data: bytes | memoryview) -> Any:
        _check_range(alloc.nbytes, offset, len(data))
        if not data:
            return None
        if isinstance(alloc.buffer, Segment):
            wire.copy_into((await self._settled(alloc)).address + offset, data)
            return None
        view = alloc.buffer.view(offset, len(data))
        try:
            if _direct(alloc.device, view, write=True):
                wire.copy_into(view.address, data)
                return None
            return alloc.device.copyin(view, data)
        finally:
            view.release()

    async def rpc_Write(self, request: pb.WriteRequest, call: Call) -> pb.WriteReply:
        alloc = self._allocation(call, self._lease(call, request.lease), request.handle)
        _check_range(alloc.nbytes, request.offset, len(request.data))
        with self.table.in_use(alloc):
            completion = await self._write(call, alloc, request.offset, request.data)
            if completion is not None:
                await self._wait(call, completion)
        self._effect(call, "write", handle=handle_tag(alloc.handle), nbytes=len(request.data))
        return pb.WriteReply(written=len(request.data))

    async def rpc_WriteStream(self, requests: AsyncIterator[pb.WriteRequest | wire.DataChunk], call: Call) -> pb.WriteReply:
        alloc: Allocation | None = None
        position = written = 0
        last = None
        with contextlib.ExitStack() as held:
            async for request in self.gate.messages(call, requests):
                if alloc is None:
                    lease = request.lease
                    alloc = self._allocation(call, self._lease(call, lease), request.handle)
                    held.enter_context(self.table.in_use(alloc))
                    position = request.offset
                elif (request.lease and request.lease != lease) or (request.handle and request.handle != alloc.handle) or request.offset:
                    raise RpcError(Code.INVALID_ARGUMENT, "only the first message of a stream names lease, handle and offset")
                _check_range(alloc.nbytes, position, len(request.data))
                completion = await self._write(call, alloc, position, request.data)
                last = completion or last
                position += len(request.data)
                written += len(request.data)
            if alloc is None:
                raise RpcError(Code.INVALID_ARGUMENT, "empty stream")
            if last is not None:
                await self._wait(call, last)  # the copy queue is FIFO: the last write proves them all
        self._effect(call, "write", handle=handle_tag(alloc.handle), nbytes=written)
        return pb.WriteReply(written=written)

    async def _read(self, call: Call, alloc: Allocation, offset: int, length: int) -> bytes:
        """An encoded ReadReply holding the range."""
        if not length:
            return wire.encode_read_reply(b"")
        if isinstance(alloc.buffer, Segment):
            return wire.encode_read_reply(wire.memory((await self._settled(alloc)).address + offset, length))
        view = alloc.buffer.view(offset, length)
        if _direct(alloc.device, view, write=False):
            try:
                return wire.encode_read_reply(wire.memory(view.address, length))  # one copy, straight into the message
            finally:
                view.release()
        try:
            host = np.empty(length, np.uint8)
            with alloc.device.batch("copy") as batch:
                batch.read_to_host(host, view)
        finally:
            view.release()
        await self._wait(call, batch.completion)
        return wire.encode_read_reply(host.data)

    async def rpc_Read(self, request: pb.ReadRequest, call: Call) -> bytes:
        alloc = self._allocation(call, self._lease(call, request.lease), request.handle)
        _check_range(alloc.nbytes, request.offset, request.length)
        if request.length > self.config.max_message_bytes - 1024:
            raise RpcError(Code.RESOURCE_EXHAUSTED, "read larger than the message limit; use ReadStream")
        with self.table.in_use(alloc):
            return await self._read(call, alloc, request.offset, request.length)

    async def rpc_ReadStream(self, request: pb.ReadRequest, call: Call) -> AsyncIterator[bytes]:
        alloc = self._allocation(call, self._lease(call, request.lease), request.handle)
        _check_range(alloc.nbytes, request.offset, request.length)
        limit = self.config.max_message_bytes - 1024
        chunk = min(request.chunk_bytes or self.config.stream_chunk_bytes, limit)
        pending = None
        with self.table.in_use(alloc):
            try:
                position, end = request.offset, request.offset + request.length
                while position < end or pending is not None:
                    nxt = None
                    if position < end:  # read the next chunk while the previous one is being sent
                        size = min(chunk, end - position)
                        nxt = asyncio.ensure_future(self._read(call, alloc, position, size))
                        position += size
                    if pending is not None:
                        reply = await pending
                        self.gate.recheck(call)  # revoked or past its deadline since the last chunk: no more
                        yield reply
                    pending = nxt
            finally:
                if pending is not None and not pending.done():
                    pending.cancel()

    async def rpc_Copy(self, request: pb.CopyRequest, call: Call) -> pb.CopyReply:
        lease = self._lease(call, request.lease)
        dst = self._allocation(call, lease, request.dst)
        src = self._allocation(call, lease, request.src)
        _check_range(dst.nbytes, request.dst_offset, request.length)
        _check_range(src.nbytes, request.src_offset, request.length)
        if dst.device is not src.device:
            raise RpcError(Code.INVALID_ARGUMENT, "source and destination are on different devices")
        if not request.length:
            return pb.CopyReply()
        with self.table.in_use(dst, src):
            if isinstance(dst.buffer, Segment) and isinstance(src.buffer, Segment):
                target, source = (await self._settled(dst)).address, (await self._settled(src)).address
                args = (target + request.dst_offset, source + request.src_offset, request.length)
                if request.length >= 1 << 20:  # a big copy off the event loop
                    await asyncio.to_thread(ctypes.memmove, *args)
                else:
                    ctypes.memmove(*args)
                self._effect(call, "copy", dst=handle_tag(dst.handle), src=handle_tag(src.handle), nbytes=request.length)
                return pb.CopyReply()
            if isinstance(dst.buffer, Segment) or isinstance(src.buffer, Segment):
                raise RpcError(Code.INVALID_ARGUMENT, "source and destination are on different devices")
            dview = dst.buffer.view(request.dst_offset, request.length)
            sview = src.buffer.view(request.src_offset, request.length)
            try:
                with dst.device.batch("copy") as batch:
                    batch.copy(dview, sview)
            finally:
                dview.release()
                sview.release()
            await self._wait(call, batch.completion)
        self._effect(call, "copy", dst=handle_tag(dst.handle), src=handle_tag(src.handle), nbytes=request.length)
        return pb.CopyReply()

    # ---- programs --------------------------------------------------------------------------------

    def _unload(self, lease: Lease) -> None:
        """A lease ended: its programs go with it, and a program no other lease holds leaves the node."""
        keys = list(lease.programs)
        lease.programs.clear()
        for key in keys:
            self._unload_unheld(key)
        remaining = self.table.identity_leases(lease.identity)
        worker = self.tenants.current(lease.identity)
        if worker is not None:
            for key in keys:
                if not any(key in held.programs for held in remaining):
                    worker.unload(key)
        if not remaining and lease.identity in self.tenants.workers:
            # the tenant holds nothing any more: its worker (and the LLVM heap it grew) goes
            task = asyncio.get_running_loop().create_task(self.tenants.stop(lease.identity))
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)

    def _check_program_quota(self, call: Call, lease: Lease, key: tuple[str, str], nbytes: int) -> None:
        """The caller's programs, over all its leases, within its count and bytes quota (a program
        its lease already holds costs nothing again)."""
        if key in lease.programs:
            return
        quota = call.policy.quota_of(call.identity)
        leases = self.table.identity_leases(call.identity)
        count = sum(len(held.programs) for held in leases)
        total = sum(sum(held.programs.values()) for held in leases)
        if count >= quota.max_programs:
            raise RpcError(Code.RESOURCE_EXHAUSTED, f"program quota exceeded ({quota.max_programs} programs loaded for "
                                                    "this identity; close a lease to unload its programs)")
        if total + nbytes > quota.max_program_bytes:
            raise RpcError(Code.RESOURCE_EXHAUSTED, f"program bytes quota exceeded ({total} of {quota.max_program_bytes} "
                                                    "bytes held by this identity's programs; close a lease to unload them)")

    async def _load(self, request: pb.LoadProgramRequest, call: Call, kind: str) -> pb.LoadProgramReply:
        lease = self._lease(call, request.lease)
        device = self._device(request.device)
        ir_bytes = len(request.llvm_ir.encode())
        # before any verifying or compiling (the content address is a hash: cheap)
        address = program_id(kind, request.llvm_ir, request.entry, list(request.signature))
        self._check_program_quota(call, lease, (request.device, address), ir_bytes)
        try:
            verified = await asyncio.to_thread(verify, request.llvm_ir, request.entry, list(request.signature), kind)
        except VerificationError as exc:
            raise RpcError(Code.INVALID_ARGUMENT, f"program refused: {exc}") from None
        key = (request.device, verified.program_id)
        if key not in self._programs:
            async with self._compile_lock:
                if key not in self._programs:
                    compile_ir = self._compile_ir or _default_compiler()
                    try:
                        code = await asyncio.to_thread(compile_ir, verified.ir_text)
                        if self._isolated(device):  # never linked into the node: loaded in tenant workers
                            self._programs[key] = IsolatedProgram(verified.signature, code, verified.symbol)
                        else:
                            self._programs[key] = device.load_program(code, verified.symbol, verified.signature)
                        self._program_bytes[key] = ir_bytes + len(code)
                    except CompileError as exc:
                        raise RpcError(Code.INVALID_ARGUMENT, f"program does not compile: {str(exc)[:300]}") from None
        if key not in lease.programs:
            try:
                self._check_program_quota(call, lease, key, self._program_bytes[key])
            except RpcError:
                self._unload_unheld(key)
                raise
            lease.programs[key] = self._program_bytes[key]
        self._effect(call, "program_loaded", program_id=verified.program_id, kind=kind, device=request.device,
                     nbytes=self._program_bytes[key])
        return pb.LoadProgramReply(program_id=verified.program_id)

    def _unload_unheld(self, key: tuple[str, str]) -> None:
        if not any(key in lease.programs for lease in self.table.leases.values()):
            self._programs.pop(key, None)
            self._program_bytes.pop(key, None)

    async def rpc_LoadProgram(self, request: pb.LoadProgramRequest, call: Call) -> pb.LoadProgramReply:
        if request.kind != pb.PROGRAM_KIND_ENGINE_KERNEL:
            raise RpcError(Code.INVALID_ARGUMENT, "LoadProgram takes engine kernels; raw programs go through LoadRawProgram")
        return await self._load(request, call, ENGINE)

    async def rpc_LoadRawProgram(self, request: pb.LoadProgramRequest, call: Call) -> pb.LoadProgramReply:
        if request.kind not in (pb.PROGRAM_KIND_RAW_LLVM, pb.PROGRAM_KIND_ENGINE_KERNEL):
            raise RpcError(Code.INVALID_ARGUMENT, "unknown program kind")
        return await self._load(request, call, RAW)

    async def rpc_Launch(self, request: pb.LaunchRequest, call: Call) -> pb.LaunchReply:
        lease = self._lease(call, request.lease)
        key = (request.device, request.program_id)
        device = self._device(request.device)
        program = self._programs.get(key)
        if program is None or key not in lease.programs:
            raise RpcError(Code.NOT_FOUND, "no such program")  # loaded under another lease, or unloaded with it
        if len(request.args) != len(program.signature):
            raise RpcError(Code.INVALID_ARGUMENT, f"program takes {len(program.signature)} arguments, got {len(request.args)}")
        if isinstance(program, IsolatedProgram):
            return await self._launch_isolated(request, call, lease, device, program)
        values: list[Any] = []
        used: list[Allocation] = []
        views: list[Buffer] = []
        try:
            for i, (arg, kind) in enumerate(zip(request.args, program.signature)):
                which = arg.WhichOneof("value")
                if kind in ("r", "w", "rw"):
                    alloc = self._buffer_argument(call, lease, device, i, arg)
                    if isinstance(alloc.buffer, Segment):  # a tenant segment: its kernels run in the worker
                        raise RpcError(Code.INVALID_ARGUMENT, f"argument {i} lives on another device")
                    view = alloc.buffer.view(arg.buffer.offset, arg.buffer.length)
                    views.append(view)
                    values.append(view)
                    if alloc not in used:
                        used.append(alloc)
                elif which != kind:
                    raise RpcError(Code.INVALID_ARGUMENT, f"argument {i} must be {kind}")
                else:
                    values.append(getattr(arg, kind))
            start = time.perf_counter()
            with self.table.in_use(*used):
                with device.batch() as batch:
                    batch.launch(program, *values)
                for view in views:
                    view.release()
                views = []
                await self._wait(call, batch.completion)
        finally:
            for view in views:
                view.release()
        seconds = time.perf_counter() - start
        self.tenants.succeeded(call.identity)
        self._effect(call, "launch", program_id=request.program_id, buffers=[handle_tag(a.handle) for a in used])
        return pb.LaunchReply(seconds=seconds)

    def _buffer_argument(self, call: Call, lease: Lease, device: Device, i: int, arg: Any) -> Allocation:
        """Launch argument `i`'s allocation, checked: a buffer of the caller's lease on `device` and a
        non-empty range inside it (the caller checks it is held where the kernel runs)."""
        if arg.WhichOneof("value") != "buffer":
            raise RpcError(Code.INVALID_ARGUMENT, f"argument {i} must be a buffer")
        alloc = self._allocation(call, lease, arg.buffer.handle)
        _check_range(alloc.nbytes, arg.buffer.offset, arg.buffer.length)
        if alloc.device is not device:
            raise RpcError(Code.INVALID_ARGUMENT, f"argument {i} lives on another device")
        if arg.buffer.length == 0:  # inside the buffer (checked above), so a non-empty range starts in it
            raise RpcError(Code.INVALID_ARGUMENT, f"argument {i} is an empty range")
        return alloc

    async def _launch_isolated(self, request: pb.LaunchRequest, call: Call, lease: Lease, device: Device,
                               program: IsolatedProgram) -> pb.LaunchReply:
        """Launch in the caller's worker: only the caller's segments are mapped there; a crash or
        a kernel past the call's deadline ends that worker and fails this call with the cause."""
        args: list[tuple[str, Any, Any]] = []
        used: list[Allocation] = []
        segments: list[Segment] = []
        for i, (arg, kind) in enumerate(zip(request.args, program.signature)):
            which = arg.WhichOneof("value")
            if kind in ("r", "w", "rw"):
                alloc = self._buffer_argument(call, lease, device, i, arg)
                if not isinstance(alloc.buffer, Segment):
                    raise RpcError(Code.INVALID_ARGUMENT, f"argument {i} lives on another device")
                args.append(("b", alloc.buffer.id, arg.buffer.offset))
                if alloc not in used:
                    used.append(alloc)
                    segments.append(alloc.buffer)
            elif which != kind:
                raise RpcError(Code.INVALID_ARGUMENT, f"argument {i} must be {kind}")
            else:
                args.append(("s", getattr(arg, kind), None))
        quota = call.policy.quota_of(call.identity)
        try:
            with self.table.in_use(*used):
                worker = await self.tenants.worker(call.identity, quota.max_bytes)
                for segment in segments:
                    worker.map(segment)
                key = (request.device, request.program_id)
                worker.load(key, program.code, program.symbol, program.signature)
                seconds = await worker.launch(key, args, call.deadline, f"program {request.program_id[:16]}")
        except asyncio.CancelledError:
            ended = self.tenants.workers.get(call.identity)
            if ended is not None and ended.failure is not None:
                self._effect(call, "tenant_worker_failed", cause=ended.failure.cause, program_id=request.program_id)
            raise
        except TenantWorkerFailed as exc:
            self._effect(call, "tenant_worker_failed" if exc.fatal else "tenant_request_failed", cause=exc.cause,
                         program_id=request.program_id)
            code = Code.DEADLINE_EXCEEDED if time.monotonic() >= call.deadline else Code.ABORTED
            raise RpcError(code, str(exc), metadata=tenant_metadata(exc)) from None
        self.tenants.succeeded(call.identity)
        self._effect(call, "launch", program_id=request.program_id, buffers=[handle_tag(a.handle) for a in used])
        return pb.LaunchReply(seconds=seconds)

    # ---- admin -------------------------------------------------------------------------------------

    async def rpc_MintElevationToken(self, request: Any, call: Call) -> pb.MintElevationTokenReply:
        token, ttl = self.gate.mint_token(call)
        self._effect(call, "elevation_token_minted", ttl_seconds=ttl)
        return pb.MintElevationTokenReply(token=token, ttl_seconds=ttl)

    def _function(self, address: str) -> SimulatedPciFunction:
        function = self.pci.get(address)
        if function is None:
            raise RpcError(Code.NOT_FOUND, "no such PCI function")
        return function

    async def rpc_ResetDevice(self, request: pb.ResetDeviceRequest, call: Call) -> pb.ResetDeviceReply:
        function = self._function(request.address)
        quota = call.policy.quota_of(call.identity)
        now = time.monotonic()
        recent = [t for t in self._resets.get(call.identity, ()) if t > now - 60.0]
        if len(recent) >= quota.resets_per_minute:
            raise RpcError(Code.RESOURCE_EXHAUSTED, f"reset rate quota exceeded ({quota.resets_per_minute} resets a minute "
                                                    "for this identity); a device mid-reset serves nobody")
        self._resets[call.identity] = [*recent, now]
        resets = function.reset()
        self._effect(call, "reset", address=request.address)
        return pb.ResetDeviceReply(resets=resets)

    async def rpc_PciConfigRead(self, request: pb.PciConfigReadRequest, call: Call) -> pb.PciConfigReadReply:
        function = self._function(request.address)
        try:
            value = function.config_read(request.offset, request.size)
        except KeyError:
            raise RpcError(Code.PERMISSION_DENIED, "config register is not readable") from None
        except IndexError:
            raise RpcError(Code.OUT_OF_RANGE, "outside config space") from None
        except ValueError as exc:
            raise RpcError(Code.INVALID_ARGUMENT, str(exc)) from None
        return pb.PciConfigReadReply(value=value)

    def _bar(self, function: SimulatedPciFunction, op: Callable[[], Any]) -> Any:
        try:
            return op()
        except IndexError:
            raise RpcError(Code.OUT_OF_RANGE, "outside the BAR window") from None
        except PermissionError:
            raise RpcError(Code.PERMISSION_DENIED, "BAR window is read-only") from None
        except LookupError:
            raise RpcError(Code.NOT_FOUND, "no such BAR") from None
        except ValueError as exc:
            raise RpcError(Code.INVALID_ARGUMENT, str(exc)) from None

    async def rpc_BarRead(self, request: pb.BarReadRequest, call: Call) -> pb.BarReadReply:
        function = self._function(request.address)
        if request.length > self.config.max_message_bytes - 1024:
            raise RpcError(Code.OUT_OF_RANGE, "read larger than the message limit")
        data = self._bar(function, lambda: function.bar_read(request.bar, request.offset, request.length))
        return pb.BarReadReply(data=data)

    async def rpc_BarWrite(self, request: pb.BarWriteRequest, call: Call) -> pb.BarWriteReply:
        function = self._function(request.address)
        self._bar(function, lambda: function.bar_write(request.bar, request.offset, request.data))
        self._effect(call, "bar_write", address=request.address, bar=request.bar, nbytes=len(request.data))
        return pb.BarWriteReply()


def _default_compiler() -> Callable[[str], bytes]:
    from tinydist.codegen.compile_cache import compile_kernel
    return compile_kernel


def _direct(device: Device, view: Buffer, write: bool) -> bool:
    """Whether bytes can move between a message and `view` right here: host memory, and no
    unfinished work that conflicts. Every submission on this node comes from its event loop, so
    the access log cannot change between this check and the copy."""
    return device.host_visible and not view.accesses.conflicts(view.offset, view.offset + view.nbytes, write)
