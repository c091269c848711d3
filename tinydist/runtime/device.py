"""Device: an async resource owning an allocator, queues (compute, copy) and their timelines.

    async with tinydist.open_device("CPU:1") as dev:
        buf = dev.allocator.alloc(4096)
        with dev.batch() as batch:               # one submission, one worker hand-off
            batch.launch(program, buf, 1024)
        await batch.completion.wait()

Lifecycle is an explicit state machine (UNOPENED → OPEN → CLOSED, with FAILED reachable from
OPEN); `open` and `aclose` are idempotent, a closed device is not reopened (open a new one), and a
failed device refuses new work with the error that failed it until it is closed.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import enum
import math
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

from tinydist.base.config import settings
from tinydist.base.errors import DeviceClosed, DeviceError, DeviceFailed, OutOfBounds, TinydistError
from tinydist.base.logs import get_logger
from tinydist.runtime import command_queue as _hooks
from tinydist.runtime.buffer import Buffer
from tinydist.runtime.clock import SYSTEM_CLOCK, Clock
from tinydist.runtime.command_queue import BUSY, Command, CommandQueue
from tinydist.runtime.compiler import DeviceCompiler
from tinydist.runtime.dependencies import AccessLog
from tinydist.runtime.timeline import Timeline

if TYPE_CHECKING:
    from tinydist.runtime.allocator import Allocator
    from tinydist.runtime.program import Program


# (device name, error type name) -> how often a device failed that way (read by tinydist.observability.metrics).
FAILURES: collections.Counter[tuple[str, str]] = collections.Counter()
# device name -> bytes a closed device left mapped because a worker of it was stuck inside a command
KEPT_FOR_STUCK_WORKERS: collections.Counter[str] = collections.Counter()
# Seconds a failed device's close waits for a worker still inside a command before leaving it
# (and the memory it may touch) behind; a healthy device's close waits its whole timeout.
FAILED_WORKER_GRACE = 1.0


class DeviceState(enum.Enum):
    UNOPENED = "unopened"  # made by open_device(), not yet opened
    OPEN = "open"          # accepts work
    FAILED = "failed"      # a hang or fault: refuses work until closed
    CLOSED = "closed"      # workers stopped, memory given back; cannot reopen


class Completion:
    """A submission's proof of completion: its queue's timeline reaching `value`."""

    __slots__ = ("timeline", "value")

    def __init__(self, timeline: Timeline, value: int) -> None:
        self.timeline = timeline
        self.value = value

    def __repr__(self) -> str:
        return f"Completion({self.timeline.name}@{self.value})"

    def done(self) -> bool:
        return self.timeline.reached(self.value)

    async def wait(self, timeout: float | None = None) -> None:
        tracer = _hooks.TRACER
        if tracer is not None:  # tracing: a host sync event
            return await tracer.host_wait(self.timeline, self.value, timeout)
        await self.timeline.wait(self.value, timeout)

    def wait_blocking(self, timeout: float | None = None) -> None:
        """Block this thread (never an event loop's) until done; same hang rule as `wait`."""
        tracer = _hooks.TRACER
        if tracer is not None:  # tracing: a host sync event
            return tracer.host_wait_blocking(self.timeline, self.value, timeout)
        self.timeline.wait_blocking(self.value, timeout)


class Device(ABC):
    queue_kinds: tuple[str, ...] = ("compute", "copy")
    # Set by the registry from the back end: devices of one group take each other's buffers as
    # kernel arguments (no copy); None reads only its own memory.
    peer_group: str | None = None
    # Whether the device's programs are host object code loaded into this process: a native
    # function may call them (a capture links them into one entry point, a stream's step function
    # calls them between its waits).
    native_code: bool = False
    # Whether the engine replaces this device with a freshly opened one at its next use after its
    # failure refused work once (a remote device whose node restarted), instead of refusing work
    # until `Engine.reopen`.
    reconnects_after_failure: bool = False

    def __init__(self, name: str) -> None:
        self._compiler: DeviceCompiler | None = None
        self.name = name
        self.state = DeviceState.UNOPENED
        self.failure: DeviceFailed | None = None
        self.failure_raised = False  # whether work was refused with `failure` (the caller has been told)
        self.queues: dict[str, CommandQueue] = {}
        # what every queue's timeline measures its waits and the hang rule on; set by
        # `open_device(name, clock=...)` before the device opens (a MockClock in tests)
        self.clock: Clock = SYSTEM_CLOCK
        self._state_lock = threading.Lock()
        # told `device_failed(error)` when this device fails: work ordered outside the runtime's
        # timelines (a captured step's native waits) stops waiting for a device that will not run it
        self.failure_listeners: weakref.WeakSet[Any] = weakref.WeakSet()
        self.log = get_logger(device=name)
        # the hang rule's view of its kernels' progress words: the last sum read, and when (on
        # `clock`) a reading last found it changed
        self._progress_lock = threading.Lock()
        self._progress_reading = 0
        self._progress_seen_at = -math.inf
        self._waiting_elsewhere = 0  # runs of host code waiting on other processes (`waiting_elsewhere`)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.state.value})"

    # ---- back-end hooks ----------------------------------------------------------------------

    @property
    def compiler(self) -> DeviceCompiler:
        """This device's programs, each compiled once (see `tinydist.runtime.compiler`)."""
        if self._compiler is None:
            self._compiler = self._make_compiler()
        return self._compiler

    def _make_compiler(self) -> DeviceCompiler:
        """Kernel IR lowered to LLVM IR and handed to `load_ir`; back ends with a code generator
        of their own override this."""
        return DeviceCompiler(self)

    @property
    @abstractmethod
    def allocator(self) -> Allocator: ...

    @abstractmethod
    def _open_backend(self) -> None:
        """Take the device's resources (memory, program loader); undo them all if it fails."""

    @abstractmethod
    def _close_backend(self) -> None:
        """Give back everything `_open_backend` took."""

    @abstractmethod
    def load_program(self, object_code: bytes, entry: str, signature: Sequence[str], calls: Sequence[Any] = ()) -> Program:
        """Load compiled code; `signature` lists arg kinds: "r"/"w"/"rw" buffers, "i64"/"f64" scalars.
        `calls`: the programs (or their cfuncs) the code calls by address, kept loaded while it is."""

    def load_ir(self, ir_text: str, entry: str, signature: Sequence[str], compile: Callable[[str], bytes]) -> Program:
        """Load a kernel given as LLVM IR. Local back ends compile it here with `compile` (the caller's
        compile cache) and load the object code; a remote back end ships the IR to its node instead."""
        return self.load_program(compile(ir_text), entry, signature)

    def load_generated(self, source: str, render: Callable[[], str], entry: str, signature: Sequence[str],
                       compile: Callable[[str, Callable[[], str]], bytes]) -> Program:
        """`load_ir(render(), ...)` for a generated kernel: local back ends look its object code up
        by the generator's request `source` (`compile`: the caller's cache) and render the IR only
        on a miss; a back end that takes IR (a remote node) renders it and calls load_ir."""
        return self.load_program(compile(source, render), entry, signature)

    def kernel_progress(self) -> int:
        """A number that changes while a kernel of this device runs and publishes progress
        (`tinydist.codegen.progress`); back ends whose kernels publish none leave it at 0, and
        the hang rule counts only their timelines."""
        return 0

    def progress_seen_at(self) -> float:
        """When (on `clock`) a reading of `kernel_progress` last found it changed: read now,
        and only by the hang rule when a deadline passes, never on the launch path."""
        with self._progress_lock:
            if self._waiting_elsewhere:  # progress is the other processes' to make, under their own deadline
                self._progress_seen_at = self.clock.now()
                return self._progress_seen_at
            reading = self.kernel_progress()
            if reading != self._progress_reading:
                self._progress_reading = reading
                self._progress_seen_at = self.clock.now()
            return self._progress_seen_at

    @contextlib.contextmanager
    def waiting_elsewhere(self) -> Iterator[None]:
        """While host code that a run of this device calls waits on other processes under a
        deadline of its own (a process collective waits for its peers up to
        TINYDIST_COLLECTIVE_TIMEOUT, `tinydist.dist.lazy`), the hang rule takes the device as
        making progress: a peer that compiles its step for longer than the hang timeout is not
        this device hanging."""
        with self._progress_lock:
            self._waiting_elsewhere += 1
        try:
            yield
        finally:
            with self._progress_lock:
                self._waiting_elsewhere -= 1

    def reads_directly(self, other: Device) -> bool:
        """Whether kernels on this device may take `other`'s buffers as arguments: the same peer
        group. The access logs order such a kernel after `other`'s writers and before its later
        writers (RAW, WAR) like any other cross-queue access."""
        return other is self or (self.peer_group is not None and other.peer_group == self.peer_group)

    @property
    def host_visible(self) -> bool:
        """Whether the device's memory is the host's (buffers can be read and written with memmove)."""
        return False

    def host_copy(self) -> Any:
        """The callable that copies `nbytes` from a source address to a destination address."""
        raise DeviceError(f"{self.name} has no host-addressable copy; it needs a transfer engine")

    def copy_command(self, direction: str, source: Device | None = None) -> Callable[[int, int, int], None]:
        """The callable for a copy into (`"h2d"`, `"d2d"`) or out of (`"d2h"`) this device's memory,
        `(dst, src, nbytes)`; `source` is the device a "d2d" copy reads. Default: `host_copy()`,
        except that a host-memory device reading a device whose memory is not the host's uses
        that device's "d2h" copy."""
        if source is not None and source is not self and self.host_visible and not source.host_visible:
            return source.copy_command("d2h")
        return self.host_copy()

    # ---- lifecycle ---------------------------------------------------------------------------

    async def open(self) -> Device:
        with self._state_lock:
            if self.state in (DeviceState.OPEN, DeviceState.FAILED):
                return self
            if self.state is DeviceState.CLOSED:
                raise DeviceClosed(f"{self.name} was closed; open a new one with tinydist.open_device({self.name!r})")
            self._open_backend()
            try:
                self.queues = {kind: CommandQueue(self, kind) for kind in self.queue_kinds}
                for q in self.queues.values():
                    q.start()
            except BaseException:
                for q in self.queues.values():
                    q.stop(timeout=1.0)
                self.queues = {}
                self._close_backend()
                raise
            self.state = DeviceState.OPEN
        self.log.debug("device opened", queues=list(self.queues))
        return self

    async def aclose(self, timeout: float | None = None) -> None:
        """Wait (bounded) for submitted work, stop the workers and give back all memory. Idempotent."""
        with self._state_lock:
            if self.state in (DeviceState.CLOSED, DeviceState.UNOPENED):
                self.state = DeviceState.CLOSED
                return
        timeout = settings.TIMELINE_TIMEOUT if timeout is None else timeout
        if self.state is DeviceState.OPEN:
            try:
                await self.synchronize(timeout)
            except DeviceFailed:
                pass  # closing a failed device still gives everything back
        # A failed device's worker still inside a command after a short grace is stuck (the hang
        # rule found it making no progress): waiting the whole timeout again would only delay
        # the caller — Engine.reopen, or the process's exit — by that much.
        join = timeout if self.failure is None else min(timeout, FAILED_WORKER_GRACE)
        stuck = []
        for q in self.queues.values():
            if not await anyio.to_thread.run_sync(q.stop, join):
                stuck.append(q.name)
        with self._state_lock:
            self.state = DeviceState.CLOSED
        if stuck:
            # Its memory stays mapped: the stuck command may still read or write it, and unmapping
            # it underneath would turn a hang into a crash. Logged, so it is accounted for.
            try:
                kept = self.allocator.statistics().reserved_bytes
            except TinydistError:  # a back end that took no memory
                kept = 0
            KEPT_FOR_STUCK_WORKERS[self.name] += kept
            self.log.error("worker threads did not stop; their device's memory stays mapped until exit",
                           queues=stuck, bytes_kept=kept)
        else:
            self._close_backend()
        self.log.debug("device closed")

    async def __aenter__(self) -> Device:
        return await self.open()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def mark_failed(self, error: DeviceFailed) -> DeviceFailed:
        """Mark the device failed and wake every waiter on every timeline with the first error."""
        with self._state_lock:
            if self.failure is None:
                self.failure = error
                if self.state is DeviceState.OPEN:
                    self.state = DeviceState.FAILED
            first = self.failure
        for q in self.queues.values():
            q.timeline.fail(first)
        if first is error:
            for listener in list(self.failure_listeners):
                listener.device_failed(first)
            FAILURES[(self.name, type(error).__name__)] += 1
            self.log.error("device failed", error=str(error))
        return first

    def contain(self, hung: Timeline) -> None:
        """The hang rule found `hung` stuck: stop its queue's worker from burning a core, where
        the back end can (CPU: `tinydist.runtime.cpu.containment`); by default nothing."""
        return None

    def check_usable(self) -> None:
        if self.state is DeviceState.OPEN:
            return
        if self.failure is not None:
            self.failure_raised = True
            raise self.failure
        if self.state is DeviceState.CLOSED:
            raise DeviceClosed(f"{self.name} is closed")
        raise DeviceError(f"{self.name} is not open; use `async with tinydist.open_device({self.name!r}) as dev`")

    # ---- work --------------------------------------------------------------------------------

    def batch(self, queue: str = "compute") -> Batch:
        self.check_usable()
        try:
            return Batch(self, self.queues[queue])
        except KeyError:
            raise ValueError(f"{self.name} has no queue {queue!r}; queues: {', '.join(self.queues)}") from None

    def submit_commands(self, queue: str, commands: list[Command], accesses: Sequence[tuple[Buffer, bool]],
                        inline: bool = False) -> Completion:
        """Submit raw `commands` that touch `accesses` ((buffer, written?) pairs), as a batch
        tracking them would — without the batch when no unfinished work conflicts with any of
        them: nothing to wait for, so the commands go to the queue as they are and the accesses
        are recorded only if they are still running. A captured replay's per-frame path."""
        if any(b.accesses.conflicts(b.offset, b.offset + b.nbytes, write) for b, write in accesses):
            batch = self.batch(queue)
            for buffer, write in accesses:
                batch.track(buffer, write)
            batch.extend(commands)
            return batch.submit(inline=inline)
        self.check_usable()
        target = self.queues[queue]
        timeline = target.timeline
        value = target.submit(commands, inline=inline)
        if not timeline.reached(value):
            for buffer, write in accesses:
                buffer.accesses.record(buffer.offset, buffer.offset + buffer.nbytes, write, timeline, value)
        return Completion(timeline, value)

    def run_now(self, queue: str, accesses: Sequence[tuple[Buffer, bool]], fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """`fn(*args)` on this thread, now, in `queue`'s order (`CommandQueue.run_if_idle`), when
        the device is open, the queue idle and no unfinished work conflicts with `accesses`
        ((buffer, written?) pairs); BUSY, with nothing run, otherwise — submit the work instead.
        For work that is Python around native calls on host memory (a captured frame), where a
        submission would cost more than the work."""
        if self.state is not DeviceState.OPEN:
            return BUSY
        for buffer, write in accesses:
            log = buffer.accesses
            if log.records and log.conflicts(buffer.offset, buffer.offset + buffer.nbytes, write):
                return BUSY
        return self.queues[queue].run_if_idle(fn, args)

    def host_array(self, buffer: Buffer, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A numpy array of `dtype` and `shape` over `buffer`'s memory, no copy, for a device
        whose memory is the host's. Kept on the buffer for the next ask of the same dtype and
        shape: making one costs ~2 us, the copy it serves ~0.3 us. Valid while the buffer lives;
        whoever touches it orders that against the device's work (`run_now`, `read_array`)."""
        address = buffer.address  # checks the buffer is alive
        cached = buffer.host_view
        if cached is not None and cached.dtype is dtype and cached.shape == shape:
            return cached
        if not self.host_visible:
            raise DeviceError(f"{self.name}'s memory is not the host's: read {buffer!r} through a batch")
        if math.prod(shape) * dtype.itemsize != buffer.nbytes:
            raise OutOfBounds(f"a {dtype.name}{list(shape)} array does not fit {buffer!r}: it has {buffer.nbytes} bytes")
        memory = (ctypes.c_ubyte * buffer.nbytes).from_address(address)
        array = np.frombuffer(memory, np.uint8).view(dtype).reshape(shape)  # type: ignore[call-overload]
        buffer.host_view = array
        return array

    def read_array(self, src: Buffer, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray | None:
        """A new array of `src`'s bytes as `dtype` and `shape`, copied on this thread when this
        device's memory is the host's and no unfinished work writes `src`; None, with nothing
        done, otherwise (read it through a batch). `Tensor.numpy()` of a computed value: one
        numpy copy out of `host_array`, not an array's address taken and a memmove (~1.5 us more)."""
        log = src.accesses
        if not self.host_visible or log.records and log.conflicts(src.offset, src.offset + src.nbytes, False):
            return None
        if self.state is not DeviceState.OPEN:
            self.check_usable()
        view = src.host_view  # (host_array's own first look, without the call: every frame's .numpy())
        if view is None or view.dtype is not dtype or view.shape != shape or src._freed or src._parent is not None:
            view = self.host_array(src, dtype, shape)
        out = view.copy()
        self.queues["copy"].count_copied(src.nbytes)
        return out

    async def synchronize(self, timeout: float | None = None) -> None:
        """Wait until everything submitted so far on every queue has completed."""
        for q in self.queues.values():
            await q.timeline.wait(q.last_submitted, timeout)

    def copyin(self, buffer: Buffer, data: Any) -> Completion:
        """Copy host data (numpy array or bytes-like) into `buffer` on the copy queue."""
        batch = self.batch("copy")
        batch.write_from_host(buffer, data)
        return batch.submit()

    def read_now(self, out: np.ndarray, src: Buffer) -> bool:
        """Copy `src` into the host array `out` on this thread when this device's memory is the
        host's and no unfinished work writes `src`; False, with nothing done, otherwise (read it
        through a batch). A frame loop's read then costs a memcpy, not a submission and a wait."""
        if not self.host_visible or src.accesses.conflicts(src.offset, src.offset + src.nbytes, False):
            return False
        self.check_usable()
        host = _host_view(out, writable=True)
        if host.nbytes != src.nbytes:
            raise OutOfBounds(f"copyout size mismatch: host array has {host.nbytes} bytes, {src!r} has {src.nbytes}")
        copy_now(host_address(host), src.address, src.nbytes)
        self.queues["copy"].count_copied(src.nbytes)
        return True

    def write_now(self, dst: Buffer, data: np.ndarray) -> bool:
        """Copy host `data` into `dst` on this thread when this device's memory is the host's and
        no unfinished work touches `dst`; False, with nothing done, otherwise (see `read_now`)."""
        log = dst.accesses
        if not self.host_visible or log.records and log.conflicts(dst.offset, dst.offset + dst.nbytes, True):
            return False
        if self.state is not DeviceState.OPEN:
            self.check_usable()
        host = data if type(data) is np.ndarray and data.flags.c_contiguous else _host_view(data, writable=False)
        if host.nbytes != dst.nbytes:
            raise OutOfBounds(f"copyin size mismatch: host data has {host.nbytes} bytes, {dst!r} has {dst.nbytes}")
        if host is data and dst.nbytes <= HOLD_GIL_BYTES:
            # numpy's copy into the buffer's view (kept on it: a recycled frame buffer's next upload
            # finds it, as .numpy() does): 0.3 us where an address, a memmove call and its
            # argument conversions cost 1.6 us; a short copy keeps the GIL, as copy_now does
            dst.check_alive()  # (a cached view does not check it)
            view = dst.host_view
            if view is None or view.dtype is not data.dtype or view.shape != data.shape:
                view = self.host_array(dst, data.dtype, data.shape)
            view[...] = data
        else:
            copy_now(dst.address, host_address(host), dst.nbytes)
        self.queues["copy"].count_copied(dst.nbytes)
        return True

    async def copyout(self, buffer: Buffer, out: np.ndarray | None = None, timeout: float | None = None) -> np.ndarray:
        """Read `buffer` back to host memory (a synchronisation point); returns uint8 bytes or `out`."""
        host = np.empty(buffer.nbytes, np.uint8) if out is None else out
        batch = self.batch("copy")
        batch.read_to_host(host, buffer)
        await batch.submit().wait(timeout)
        return host


# A copy on the calling thread keeps the GIL while it is short. ctypes.memmove releases it, which
# hands it to a queue worker waiting to take it back after a kernel, and this thread then waits
# for the worker to let go: a thread switch each way, milliseconds on a loaded machine (an eager
# MLP step's two 64 KB uploads waited 155 us each on average for 15 us of work). A copy beyond
# HOLD_GIL_BYTES is long enough to be worth sharing the interpreter for.
HOLD_GIL_BYTES = 1 << 20
_memmove_holding_gil = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    ctypes._memmove_addr)  # type: ignore[attr-defined]


def copy_now(dst: int, src: int, nbytes: int) -> None:
    """memmove on the calling thread, keeping the GIL for a short copy (see HOLD_GIL_BYTES)."""
    (_memmove_holding_gil if nbytes <= HOLD_GIL_BYTES else ctypes.memmove)(dst, src, nbytes)


def host_address(array: np.ndarray) -> int:
    """The address of a C-contiguous array's first byte. Through the buffer protocol where the
    array is writable (~0.2 us); `ndarray.ctypes` builds an object per call (~1 us)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(array))  # type: ignore[arg-type]
    except (TypeError, ValueError):  # read-only, or no bytes at all
        return array.ctypes.data


def _host_view(data: Any, writable: bool) -> np.ndarray:
    array = data if isinstance(data, np.ndarray) else np.frombuffer(memoryview(data), np.uint8)
    if not array.flags.c_contiguous:
        raise ValueError(f"host array must be C-contiguous (got strides {array.strides}); pass np.ascontiguousarray(x)")
    if writable and not array.flags.writeable:
        raise ValueError("host destination is read-only")
    return array


class Batch:
    """Commands for one queue, submitted together. Use as `with device.batch(queue) as batch:`.

    Each buffer access is checked (alive, in bounds, on the right device) and ordered against
    earlier work on other queues through its base's access log, before it joins the batch.
    """

    __slots__ = ("device", "queue", "completion", "_commands", "_accesses", "_keepalive", "_waited", "_timeout", "_copied",
                 "_ordered_elsewhere")

    def __init__(self, device: Device, queue: CommandQueue) -> None:
        self.device = device
        self.queue = queue
        self.completion: Completion | None = None
        self._commands: list[Command] = []
        # (access log, start, end) -> writes?; one record per range at submit, however often it is used
        self._accesses: dict[tuple[AccessLog, int, int], bool] = {}
        self._keepalive: list[Any] = []
        self._waited: dict[Timeline, int] = {}
        self._timeout = settings.TIMELINE_TIMEOUT
        self._copied = 0  # bytes in this batch's copies, counted by the queue at submit
        self._ordered_elsewhere: frozenset[Timeline] = frozenset()

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.submit()

    def __len__(self) -> int:
        return len(self._commands)

    @property
    def waits(self) -> bool:
        """Whether the batch waits for work on another queue."""
        return bool(self._waited)

    def track(self, buffer: Buffer, write: bool) -> int:
        """Order the batch after conflicting work on `buffer`, record the access, and return its
        address — for `command`s whose buffers are not passed as Buffer arguments."""
        return self._access(buffer, write)

    def track_range(self, buffer: Buffer, offset: int, nbytes: int, write: bool) -> None:
        """`track` for bytes [offset, offset + nbytes) of `buffer` (the caller keeps them inside
        it), without making a view of them: for a submitter that lays out its own addresses."""
        buffer.check_alive()
        start = buffer.offset + offset
        self._order(buffer.accesses, start, start + nbytes, write)

    def would_wait(self, buffer: Buffer, offset: int, nbytes: int, write: bool) -> bool:
        """Whether `track_range` of these bytes would make the batch wait for another queue now
        (nothing is recorded): a submitter with a faster form for a batch that waits for nothing."""
        buffer.check_alive()
        start = buffer.offset + offset
        waits = buffer.accesses.waits_for(start, start + nbytes, write, self.queue.timeline)
        return any(self._waited.get(timeline, 0) < value and timeline not in self._ordered_elsewhere
                   for timeline, value in waits.items())

    def order_after(self, buffer: Buffer, write: bool) -> None:
        """Order the batch after conflicting work on `buffer` without recording the access: for a
        submitter that records it itself (a `StandingAccess`)."""
        buffer.check_alive()
        waits = buffer.accesses.waits_for(buffer.offset, buffer.offset + buffer.nbytes, write, self.queue.timeline)
        if waits:
            self._wait_for(waits)

    def leave_ordering_to(self, timelines: frozenset[Timeline]) -> None:
        """Wait for no work on `timelines`: the submitter orders this batch's commands against
        it itself (a captured step's streams wait for each other in native code). Accesses are
        still recorded, so other work orders after this batch as usual."""
        self._ordered_elsewhere = timelines

    def keep_alive(self, *objects: Any) -> None:
        """Hold `objects` (host arrays a command reads or writes) until the batch completes."""
        self._keepalive.extend(objects)

    def command(self, fn: Any, args: tuple[Any, ...]) -> None:
        """Append a raw command. The caller must `track` every buffer it touches that other
        queues may also touch (memory private to one queue needs no tracking: FIFO orders it)."""
        self._commands.append((fn, args))

    def extend(self, commands: Sequence[Command], copied: int = 0) -> None:
        """Append raw commands, as `command` does, of which copies move `copied` bytes."""
        self._commands.extend(commands)
        self._copied += copied

    def _access(self, buffer: Buffer, write: bool) -> int:
        """Order this access after conflicting work on other queues; returns the buffer's address."""
        address = buffer.address  # checks the buffer is alive
        start = buffer.offset
        self._order(buffer.accesses, start, start + buffer.nbytes, write)
        return address

    def _order(self, log: AccessLog, start: int, end: int, write: bool) -> None:
        key = (log, start, end)
        seen = self._accesses.get(key)
        if seen is None or (write and not seen):
            # Earlier commands of this batch with the same range already waited for what a read needs.
            waits = log.waits_for(start, end, write, self.queue.timeline)
            if waits:
                self._wait_for(waits)
            self._accesses[key] = write or bool(seen)

    def _wait_for(self, waits: dict[Timeline, int]) -> None:
        """Make the batch's next commands wait until each timeline reaches its value."""
        for timeline, value in waits.items():
            if self._waited.get(timeline, 0) < value and timeline not in self._ordered_elsewhere:
                self._waited[timeline] = value
                self._commands.append((timeline.wait_command, (value, self._timeout)))

    def launch(self, program: Program, *args: Any) -> None:
        """Run `program` with `args` matching its signature (buffers must live on this device)."""
        if len(args) != len(program.signature):
            raise TypeError(f"{program.name} takes {len(program.signature)} arguments {program.signature}, got {len(args)}")
        values = list(args)
        for i, write in program.buffer_args:
            arg = args[i]
            if not isinstance(arg, Buffer):
                raise TypeError(f"{program.name} argument {i} must be a Buffer ({program.signature[i]}), got {type(arg).__name__}")
            if arg.device is not self.device and not self.device.reads_directly(arg.device):
                raise DeviceError(f"{program.name} on {self.device.name} cannot use {arg!r} implicitly; copy it to {self.device.name} first")
            values[i] = self._access(arg, write)
        self._commands.append((program.cfunc, tuple(values)))

    def copy(self, dst: Buffer, src: Buffer) -> None:
        """Device-to-device (or within one device) copy of `src` into `dst` (same size)."""
        if dst.nbytes != src.nbytes:
            raise OutOfBounds(f"copy size mismatch: {src!r} has {src.nbytes} bytes, {dst!r} has {dst.nbytes}")
        source = self._access(src, False)
        self._copied += dst.nbytes
        self._commands.append((self.device.copy_command("d2d", src.device), (self._access(dst, True), source, dst.nbytes)))

    def write_from_host(self, dst: Buffer, data: Any) -> None:
        host = _host_view(data, writable=False)
        if host.nbytes != dst.nbytes:
            raise OutOfBounds(f"copyin size mismatch: host data has {host.nbytes} bytes, {dst!r} has {dst.nbytes}")
        self._keepalive.append(host)
        self._copied += dst.nbytes
        self._commands.append((self.device.copy_command("h2d"), (self._access(dst, True), host_address(host), dst.nbytes)))

    def read_to_host(self, out: np.ndarray, src: Buffer) -> None:
        host = _host_view(out, writable=True)
        if host.nbytes != src.nbytes:
            raise OutOfBounds(f"copyout size mismatch: host array has {host.nbytes} bytes, {src!r} has {src.nbytes}")
        self._keepalive.append(host)
        self._copied += src.nbytes
        self._commands.append((self.device.copy_command("d2h"), (host_address(host), self._access(src, False), src.nbytes)))

    def submit(self, inline: bool = False) -> Completion:
        """Hand the batch to its queue; `inline=True` runs it on this thread when the queue is idle
        (for synchronous callers about to wait; see CommandQueue.submit)."""
        if self.completion is not None:
            raise RuntimeError("this batch was already submitted; start a new one with device.batch()")
        self.device.check_usable()
        value = self.queue.submit(self._commands, inline, self._copied)
        timeline = self.queue.timeline
        if not timeline.reached(value):  # work that already finished (inline) cannot race with anything
            for (log, start, end), write in self._accesses.items():
                log.record(start, end, write, timeline, value)
        if self._keepalive:
            keep = self._keepalive
            timeline.call_when_reached(value, keep.clear)
        self.completion = Completion(timeline, value)
        return self.completion
