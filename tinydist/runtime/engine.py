"""The sync facade: one background event loop that scripts drive without writing `async` code.

The engine owns an anyio blocking portal (an event loop in a thread, with its own task group) and
the devices it opened for sync callers. `engine.run(async_fn, *args)` runs a coroutine function on
it and returns its result, so the sync path and the async path are the same engine. It is the
process's one portal: tinydist.dist serves its process group's links on the same loop (`portal`).

    engine = get_engine()
    dev = engine.device("CPU:1")                 # opened once, closed at exit or engine.close()
    data = engine.run(dev.copyout, buf)
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

from anyio.from_thread import BlockingPortal, start_blocking_portal

from tinydist.base.errors import DeviceClosed
from tinydist.runtime.clock import SYSTEM_CLOCK, Clock
from tinydist.runtime.device import Device
from tinydist.runtime.registry import canonical_name, open_device

T = TypeVar("T")


class Engine:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._portal_cm: AbstractContextManager[BlockingPortal] | None = start_blocking_portal(backend="asyncio")
        self._portal: BlockingPortal | None = self._portal_cm.__enter__()
        self._devices: dict[str, Device] = {}

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run `await fn(*args)` on the engine's loop; not callable from that loop itself."""
        if self._portal is None:
            raise DeviceClosed("the tinydist engine is closed (Engine.close ran); create a new Engine()")
        return self._portal.call(fn, *args)

    @property
    def portal(self) -> BlockingPortal:
        """The portal itself, for what lives on the loop longer than one call (an async context
        manager entered with `portal.wrap_async_context_manager`, as tinydist.dist's group)."""
        if self._portal is None:
            raise DeviceClosed("the tinydist engine is closed (Engine.close ran); create a new Engine()")
        return self._portal

    def device(self, name: str) -> Device:
        """The engine's open device `name` (opened on first use)."""
        device = self._devices.get(name)  # a canonical name already open: no parse, no lock (every upload asks)
        if device is not None:
            if device.failure_raised and device.reconnects_after_failure:
                # its failure refused work once (the caller was told); this use gets a fresh device.
                # Not sooner: the operation that met the failure must not go on with a new device.
                return self.reopen(name, clock=device.clock)
            return device
        return self._open(canonical_name(name), SYSTEM_CLOCK)

    def _open(self, canonical: str, clock: Clock) -> Device:
        """The open device `canonical`, opened on `clock` unless another thread opened it first."""
        with self._lock:
            device = self._devices.get(canonical)
            if device is None:
                device = open_device(canonical, clock=clock)
                self.run(device.open)
                self._devices[canonical] = device
            return device

    def reopen(self, name: str, *, clock: Clock = SYSTEM_CLOCK) -> Device:
        """Close the engine's device `name` (a failed one, say) and open a fresh one in its place,
        on `clock` (real time unless a test passes a `tinydist.testing.MockClock`; a device opened
        on first use is on real time, one reopened after its failure on the clock it was on). Nothing of the old device carries over: its buffers,
        and steps captured on it, are gone. After a `DeviceHang` the close waits at most a second for
        the stuck worker, never another timeout; the worker stays parked and the old memory mapped
        (docs/hangs.md)."""
        canonical = canonical_name(name)
        with self._lock:
            old = self._devices.pop(canonical, None)
        if old is not None:
            self.run(old.aclose)
        return self._open(canonical, clock)

    def synchronize(self, timeout: float | None = None) -> None:
        """Block until all work submitted so far on the engine's devices has completed."""
        for device in self.open_devices():
            for queue in device.queues.values():
                queue.timeline.wait_blocking(queue.last_submitted, timeout)

    def open_devices(self) -> list[Device]:
        with self._lock:
            return list(self._devices.values())

    def close(self) -> None:
        """Close every device the engine opened, then stop its loop. Idempotent."""
        with self._lock:
            if self._portal is None:
                return
            devices, self._devices = list(self._devices.values()), {}
            for device in devices:
                self._portal.call(device.aclose)
            portal_cm, self._portal_cm, self._portal = self._portal_cm, None, None
        assert portal_cm is not None
        portal_cm.__exit__(None, None, None)


_engine: Engine | None = None
_engine_lock = threading.Lock()


def get_engine() -> Engine:
    """The process's engine, started on first use and closed at interpreter exit."""
    global _engine
    engine = _engine
    if engine is not None:  # started: no lock (every upload and every op's device asks)
        return engine
    with _engine_lock:
        if _engine is None:
            _engine = Engine()
            atexit.register(_engine.close)
        return _engine
