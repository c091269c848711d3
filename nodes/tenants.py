"""Tenant isolation on host-memory devices: each identity's buffers are shared-memory segments and
its kernels run in a worker process of its own (`tinydist.nodes.tenant_worker`).

- `Segment`: one allocation, a memfd of its size mapped in the node (the node reads and writes it
  directly for Read/Write/streams/Copy: no extra copy) and, when a kernel needs it, in that tenant's
  worker only. Fresh segments read as zeros (the kernel zero-fills memfd pages).
- `TenantWorker`: the process, its two sockets (control stream; descriptor passing), the queue of
  requests in flight. A launch that outlives its call's deadline kills the worker; a worker that dies
  (SIGSEGV from a null store or from running off the end of an `unreachable`, SIGXCPU, anything) fails every request it had
  pending with `TenantWorkerFailed` naming the tenant and the cause. Segments stay in the node, so
  the tenant's buffers survive; the next call starts a fresh worker, which maps segments and loads
  programs again as launches need them.

Measured on the dev box (2 shared cores): a worker starts in 0.25 s (the interpreter and llvmlite;
VmRSS 88 MiB, VmPeak 311 MiB before any kernel); a Launch round trip through it is within noise of
one in the node process at load ~2 (+4.5 / -46 us on ~0.8-0.9 ms) and +261 / +429 us at load 5-6.6,
where the worker's wake-up waits for a core (`bench/remote.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pickle

from tinydist.nodes.tenant_worker import FRAME, MAX_REPLY_MESSAGE, REPLY
from tinydist.base.errors import TenantWorkerFailed
from tinydist.runtime.clock import SYSTEM_CLOCK, Clock

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 30.0

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class Segment:
    """A tenant buffer: a memfd of `nbytes` mapped read-write at `address` in the node."""

    _next_id = 0

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.fd = os.memfd_create("tinydist-tenant", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, nbytes)
            # nobody holding it (a hijacked worker included) can shrink it under the node's mapping: the
            # node's next touch of a truncated page would be SIGBUS in the node
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            address = _libc.mmap(None, nbytes, 3, 1, self.fd, 0)  # PROT_READ|PROT_WRITE, MAP_SHARED
            if address in (None, _MAP_FAILED):
                raise OSError(ctypes.get_errno(), f"mapping a {nbytes}-byte segment failed")
        except BaseException:
            os.close(self.fd)
            raise
        self.address: int = address
        Segment._next_id += 1
        self.id = Segment._next_id
        self.worker: TenantWorker | None = None  # the worker it is mapped in, if any

    def free(self) -> None:
        if self.fd < 0:
            return
        if self.worker is not None:
            self.worker.unmap(self)
        _libc.munmap(self.address, self.nbytes)
        os.close(self.fd)
        self.fd = -1


class TenantWorker:
    """One identity's worker process. Requests are answered in order (the worker is one thread)."""

    def __init__(self, identity: str, address_space: int, cpu_seconds: int,
                 on_death: Callable[[TenantWorker], None] | None = None) -> None:
        self.identity = identity
        self.on_death = on_death  # told once when it dies (not when the node stops it)
        self._stopping = False
        self.address_space, self.cpu_seconds = address_space, cpu_seconds
        self.process: subprocess.Popen[bytes] | None = None
        self.pending: deque[tuple[int, asyncio.Future[float]]] = deque()  # (sequence number, its answer)
        self.mapped: set[int] = set()
        self.loaded: set[Any] = set()
        self.failure: TenantWorkerFailed | None = None
        self.sandbox = ""
        self._seq = 0
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._fds: socket.socket | None = None
        self._cause: str | None = None  # why the node ended it, when it did

    @property
    def alive(self) -> bool:
        return self.failure is None and self.process is not None

    async def start(self) -> None:
        ctl, ctl_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fds, fds_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-s", "-m", "tinydist.nodes.tenant_worker", str(ctl_child.fileno()), str(fds_child.fileno()),
                 str(self.address_space), str(self.cpu_seconds)],
                pass_fds=(ctl_child.fileno(), fds_child.fileno()), cwd=ROOT, close_fds=True,
                env={"PATH": os.defpath, "LANG": "C.UTF-8", "PYTHONPATH": str(ROOT)},
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        finally:
            ctl_child.close()
            fds_child.close()
        self._fds = fds
        reader, self._writer = await asyncio.open_unix_connection(sock=ctl)
        ready: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        ready.add_done_callback(_retrieved)
        self.pending.append((0, ready))
        self._reader_task = asyncio.get_running_loop().create_task(self._read_replies(reader))
        try:
            await asyncio.wait_for(asyncio.shield(ready), START_TIMEOUT_S)
        except (asyncio.TimeoutError, TimeoutError):
            self.kill(f"did not start within {START_TIMEOUT_S:.0f} s")
            raise self.failure or TenantWorkerFailed(self.identity, "did not start") from None

    async def _read_replies(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                header = await reader.readexactly(REPLY.size)
                seq, ok, seconds, length = REPLY.unpack(header)
                if length > MAX_REPLY_MESSAGE or not self.pending or self.pending[0][0] != seq or ok not in (0, 1):
                    self.kill("sent a malformed reply")
                    break  # to _died: the killed process is reaped there
                message = (await reader.readexactly(length)).decode(errors="replace")
                _, future = self.pending.popleft()
                if seq == 0 and not self.sandbox:
                    self.sandbox = message
                if future.done():
                    continue
                if ok:
                    future.set_result(seconds)
                else:
                    future.set_exception(TenantWorkerFailed(self.identity, f"its request failed: {message}", fatal=False))
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        await self._died()

    async def _died(self) -> None:
        process = self.process
        code = None
        if process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = await asyncio.to_thread(process.wait, 5.0)
        if self._cause is not None:
            cause = self._cause
        elif code is not None and code < 0:
            cause = f"died of {signal.Signals(-code).name}"
        else:
            cause = f"exited with status {code}"
        self._fail(TenantWorkerFailed(self.identity, cause))

    def _fail(self, failure: TenantWorkerFailed) -> None:
        if self.failure is None:
            self.failure = failure
            if self.on_death is not None and not self._stopping:
                self.on_death(self)
        while self.pending:
            _, future = self.pending.popleft()
            if not future.done():
                future.set_exception(self.failure)
        if self._writer is not None:
            self._writer.close()
        if self._fds is not None:
            self._fds.close()

    def kill(self, cause: str) -> None:
        """End the worker now (SIGKILL: a kernel in a loop never returns to look at signals)."""
        self._cause = self._cause or cause
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
        self._fail(TenantWorkerFailed(self.identity, cause))

    def _send(self, op: str, *args: Any) -> asyncio.Future[float]:
        if self.failure is not None or self._writer is None:
            raise self.failure or TenantWorkerFailed(self.identity, "was never started")
        self._seq += 1
        payload = pickle.dumps((self._seq, op, args), protocol=pickle.HIGHEST_PROTOCOL)
        self._writer.write(FRAME.pack(len(payload)) + payload)
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        future.add_done_callback(_retrieved)  # map/unmap/load are not awaited: their failure shows at the launch
        self.pending.append((self._seq, future))
        return future

    def map(self, segment: Segment) -> None:
        if segment.id in self.mapped:
            return
        if self.failure is not None or self._fds is None:
            raise self.failure or TenantWorkerFailed(self.identity, "was never started")
        try:
            socket.send_fds(self._fds, [b"s"], [segment.fd])  # a few bytes into an empty socket buffer: never blocks
        except OSError as exc:
            self.kill(f"stopped taking requests ({exc.strerror})")
            raise self.failure or TenantWorkerFailed(self.identity, "stopped") from exc
        self._send("map", segment.id, segment.nbytes)
        self.mapped.add(segment.id)
        segment.worker = self

    def unmap(self, segment: Segment) -> None:
        segment.worker = None
        if segment.id in self.mapped:
            self.mapped.discard(segment.id)
            if self.failure is None:
                self._send("unmap", segment.id)

    def load(self, key: Any, code: bytes, symbol: str, signature: tuple[str, ...]) -> None:
        if key not in self.loaded:
            self._send("load", key, code, symbol, signature)
            self.loaded.add(key)

    def unload(self, key: Any) -> None:
        if key in self.loaded and self.failure is None:
            self.loaded.discard(key)
            self._send("unload", key)

    async def launch(self, key: Any, args: list[tuple[str, Any, Any]], deadline: float, what: str) -> float:
        """Run a loaded program; past `deadline` (monotonic) the worker is killed."""
        future = self._send("launch", key, args)
        # a timer rather than wait_for: no extra task on the launch path (measured ~20 us a launch)
        timer = asyncio.get_running_loop().call_later(max(deadline - time.monotonic(), 0.0), self._expire, future, what)
        try:
            return await future
        except asyncio.CancelledError:
            # the call ended under it (its deadline seen first by gRPC, or the client left): nothing
            # else stops a kernel, and the tenant's next work would queue behind it
            if future.cancelled():
                self.kill(f"was killed: {what} was still running when its call ended (deadline or client gone)")
            raise
        finally:
            timer.cancel()

    def _expire(self, future: asyncio.Future[float], what: str) -> None:
        if not future.done():
            self.kill(f"was killed: {what} ran past its call's deadline")

    async def drain(self) -> None:
        """Wait until everything sent so far has finished (or failed)."""
        if self.pending:
            await asyncio.gather(*(future for _, future in self.pending), return_exceptions=True)

    async def stop(self) -> None:
        self._stopping = True
        self.kill("stopped: the tenant holds no lease")
        if self._reader_task is not None:
            with contextlib.suppress(BaseException):
                await self._reader_task


def _retrieved(future: asyncio.Future[float]) -> None:
    if not future.cancelled():
        future.exception()


class TenantPool:
    """The live worker of each identity; a dead one is replaced at the identity's next launch.

    A tenant whose workers keep dying is held off: after `backoff_after` deaths in a row (a crash,
    a kill at a deadline, a failed start; the node stopping a worker is none) its next worker starts
    only `backoff_s` after the last death, doubling with each further death up to `backoff_max_s`;
    a launch that completes (`succeeded`) forgives them all. A start held off answers at once with a
    `TenantWorkerFailed` saying for how long, so a tenant crashing its worker in a loop costs the node
    one process start per hold-off, not one per call (~0.25 s of CPU each)."""

    def __init__(self, address_space: int, cpu_seconds: int, backoff_after: int = 3, backoff_s: float = 1.0,
                 backoff_max_s: float = 60.0, clock: Clock = SYSTEM_CLOCK) -> None:
        self.address_space, self.cpu_seconds = address_space, cpu_seconds
        self.backoff_after, self.backoff_s, self.backoff_max_s = backoff_after, backoff_s, backoff_max_s
        self.clock = clock
        self.workers: dict[str, TenantWorker] = {}
        self._starting: dict[str, asyncio.Task[TenantWorker]] = {}
        self.deaths: dict[str, tuple[int, float, str]] = {}  # identity -> (deaths in a row, when the last was, its cause)

    def hold_off(self, identity: str) -> float:
        """Seconds until `identity` may start a worker again (0: now)."""
        count, last, _ = self.deaths.get(identity, (0, 0.0, ""))
        if count < self.backoff_after:
            return 0.0
        wait = min(self.backoff_s * 2.0 ** (count - self.backoff_after), self.backoff_max_s)
        return max(last + wait - self.clock.now(), 0.0)

    def succeeded(self, identity: str) -> None:
        """A launch of `identity` completed: its worker runs, its past deaths are forgiven."""
        if identity in self.deaths:
            del self.deaths[identity]

    def _count_death(self, worker: TenantWorker) -> None:
        count = self.deaths.get(worker.identity, (0, 0.0, ""))[0] + 1
        cause = worker.failure.cause if worker.failure is not None else "died"
        self.deaths[worker.identity] = (count, self.clock.now(), cause)

    async def worker(self, identity: str, quota_bytes: int) -> TenantWorker:
        worker = self.workers.get(identity)
        if worker is not None and worker.alive:
            return worker
        if worker is not None:  # dead since its last use (counted when it died)
            del self.workers[identity]
        wait = self.hold_off(identity)
        if wait > 0:
            count, _, cause = self.deaths[identity]
            raise TenantWorkerFailed(identity, f"its worker died {count} times in a row (last: {cause}); the node holds "
                                               f"off starting another for {wait:.1f} s more (the wait doubles with each "
                                               f"death, up to {self.backoff_max_s:g} s; a launch that completes resets it)",
                                     fatal=False)
        task = self._starting.get(identity)
        if task is None:
            task = self._starting[identity] = asyncio.get_running_loop().create_task(self._start(identity, quota_bytes))
        try:
            return await asyncio.shield(task)
        finally:
            if task.done():
                self._starting.pop(identity, None)

    async def _start(self, identity: str, quota_bytes: int) -> TenantWorker:
        worker = TenantWorker(identity, quota_bytes + self.address_space, self.cpu_seconds, self._count_death)
        await worker.start()  # a start that fails is a death too (counted by the worker's _fail)
        self.workers[identity] = worker
        return worker

    def current(self, identity: str) -> TenantWorker | None:
        worker = self.workers.get(identity)
        return worker if worker is not None and worker.alive else None

    async def stop(self, identity: str) -> None:
        worker = self.workers.pop(identity, None)
        if worker is not None:
            await worker.stop()

    async def stop_all(self) -> None:
        for identity in list(self.workers):
            await self.stop(identity)
