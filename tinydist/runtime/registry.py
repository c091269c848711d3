"""Device names, back ends and discovery.

A name is `KIND[:INDEX]` ("CPU" is "CPU:0"). Each back end says which of its devices are usable
here and, for those that are not, why — a back end that exists is not a device that opens.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass

from tinydist.base.config import settings
from tinydist.base.errors import DeviceNotFound, DeviceUnavailable
from tinydist.runtime.clock import SYSTEM_CLOCK, Clock, require_clock
from tinydist.runtime.device import Device

_NAME = re.compile(r"^([A-Za-z][A-Za-z0-9_]*)(?::(\d+))?$")
_SCHEME_NAME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://([^/\s]+)/([^/\s]+)$")
_SCHEMES: dict[str, str] = {}  # scheme -> "module:Class" of its Device subclass, imported on first use


def register_scheme(scheme: str, target: str) -> None:
    """Open `scheme://authority/KIND:N` names with the Device subclass at `target` ("module:Class"),
    imported lazily (so the runtime never imports a transport): `Class(canonical_name)`."""
    _SCHEMES[scheme.lower()] = target


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    usable: bool
    detail: str


def canonical_name(name: str) -> str:
    """"cpu" / "CPU" / "CPU:0" → "CPU:0"; anything malformed is a ValueError naming the format."""
    if not isinstance(name, str):
        raise TypeError(f"device name must be a string like 'CPU:1', got {type(name).__name__}")
    return _canonical(name)


@functools.lru_cache(maxsize=1024)  # every graph node names its device: parse each name once
def _canonical(name: str) -> str:
    scheme = _SCHEME_NAME.match(name.strip())
    if scheme:  # "scheme://authority/KIND:N": the scheme's back end owns the authority part
        return f"{scheme.group(1).lower()}://{scheme.group(2)}/{_canonical(scheme.group(3))}"
    match = _NAME.match(name.strip())
    if not match:
        raise ValueError(f"malformed device name {name!r}; expected KIND or KIND:INDEX, e.g. 'CPU:1'")
    return f"{match.group(1).upper()}:{int(match.group(2) or 0)}"


def _discover_cpu() -> list[DeviceInfo]:
    count = settings.CPU_DEVICES
    return [DeviceInfo(f"CPU:{i}", True, "host memory, LLVM native code, own worker threads") for i in range(count)]


def _discover_cuda() -> list[DeviceInfo]:
    from tinydist.runtime.cuda.device import discover  # loads libcuda (once) only when asked
    return [DeviceInfo(name, usable, detail) for name, usable, detail in discover()]


def _open_cpu(name: str) -> Device:
    from tinydist.runtime.cpu.device import CPUDevice
    return CPUDevice(name)


def _open_cuda(name: str) -> Device:
    from tinydist.runtime.cuda.device import CUDADevice
    return CUDADevice(name)


@dataclass(frozen=True)
class Backend:
    kind: str
    discover: Callable[[], list[DeviceInfo]]
    make: Callable[[str], Device] | None
    # Devices of one peer group are views of one memory: a kernel on one may read and write the
    # others' buffers directly (CPU devices of this process all address the host's memory).
    peer_group: str | None = None


BACKENDS: dict[str, Backend] = {
    "CPU": Backend("CPU", _discover_cpu, _open_cpu, peer_group="host"),
    "CUDA": Backend("CUDA", _discover_cuda, _open_cuda),
}


def peer_group(name: str) -> str | None:
    """The peer group of the device called `name` (see `Backend.peer_group`); None: it reads only
    its own memory. Remote devices (`scheme://…` names) never share memory with this process."""
    canonical = canonical_name(name)
    if "://" in canonical:
        return None
    backend = BACKENDS.get(canonical.split(":")[0])
    return backend.peer_group if backend is not None else None


def discover() -> list[DeviceInfo]:
    return [info for backend in BACKENDS.values() for info in backend.discover()]


def open_device(name: str, *, clock: Clock = SYSTEM_CLOCK) -> Device:
    """The device called `name`, not yet opened: use `async with open_device(name) as dev`.

    `clock` (default real time) is what its timelines time their waits and hang detection on:
    tests pass a `tinydist.testing.MockClock` and advance it by hand."""
    require_clock(clock)
    device = _make_device(name)
    device.clock = clock
    return device


def _make_device(name: str) -> Device:
    canonical = canonical_name(name)
    scheme = canonical.split("://", 1)[0] if "://" in canonical else None
    if scheme is not None:
        target = _SCHEMES.get(scheme)
        if target is None:
            raise DeviceNotFound(f"no device scheme {scheme!r} (from {name!r}); registered: {', '.join(sorted(_SCHEMES)) or 'none'}")
        module, _, attr = target.partition(":")
        return getattr(importlib.import_module(module), attr)(canonical)
    kind = canonical.split(":")[0]
    backend = BACKENDS.get(kind)

    def usable() -> str:
        # every back end probed only for the message: discovering CUDA runs ldconfig (~15 ms of a first call)
        return ", ".join(info.name for info in discover() if info.usable)
    if backend is None:
        raise DeviceNotFound(f"no device back end {kind!r} (from {name!r}); available devices: {usable()}")
    infos = backend.discover()
    match = [info for info in infos if info.name == canonical]
    if not match or backend.make is None:
        reasons = "; ".join(f"{info.name}: {info.detail}" for info in infos if not info.usable)
        if reasons:
            raise DeviceUnavailable(f"{canonical} cannot open here ({reasons}); available devices: {usable()}")
        raise DeviceNotFound(f"no device {canonical}; available devices: {usable()}")
    device = backend.make(canonical)
    device.peer_group = backend.peer_group
    return device
