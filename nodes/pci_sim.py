"""A simulated PCI function: a config space and BAR windows, so the raw-access path is real here.

It stands where a real function's sysfs `config` / `resourceN` files would be, behind the same
checks: config reads only of allowlisted registers (identification, command/status, class,
header type, subsystem ids, BAR registers), never writes; BAR access only inside each BAR's
declared window, writes only to windows marked writable. Reset restores power-on state and counts.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BarWindow:
    size: int          # bytes of the BAR
    window: tuple[int, int]  # [start, end) clients may touch
    writable: bool


# (offset, size) of config registers a client may read; anything else is refused.
READABLE_CONFIG = frozenset({
    (0x00, 2), (0x02, 2), (0x00, 4),             # vendor id, device id
    (0x04, 2), (0x06, 2), (0x04, 4),             # command, status
    (0x08, 1), (0x09, 1), (0x0A, 1), (0x0B, 1), (0x08, 4),  # revision, class code
    (0x0E, 1),                                   # header type
    (0x10, 4), (0x14, 4), (0x18, 4), (0x1C, 4), (0x20, 4), (0x24, 4),  # BARs
    (0x2C, 2), (0x2E, 2), (0x2C, 4),             # subsystem vendor / id
})
CONFIG_SIZE = 4096
BAR_ACCESS = 4  # bytes: the width and alignment of every BAR access


@dataclass
class SimulatedPciFunction:
    address: str = "0000:01:00.0"
    vendor_id: int = 0x1D0F
    device_id: int = 0x7064
    class_code: int = 0x120000   # processing accelerator
    bars: dict[int, BarWindow] = field(default_factory=lambda: {
        0: BarWindow(64 << 10, (0, 4096), writable=False),     # read-only registers
        2: BarWindow(1 << 20, (0, 1 << 20), writable=True),    # a scratch/mailbox window
    })
    resets: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._power_on()

    def _power_on(self) -> None:
        config = bytearray(CONFIG_SIZE)
        struct.pack_into("<HH", config, 0, self.vendor_id, self.device_id)
        struct.pack_into("<HH", config, 4, 0x0006, 0x0010)
        struct.pack_into("<I", config, 8, (self.class_code << 8) | 0x01)
        config[0x0E] = 0x00
        for bar in self.bars:
            struct.pack_into("<I", config, 0x10 + 4 * bar, (0xF000_0000 + (bar << 24)) & 0xFFFF_FFF0)
        struct.pack_into("<HH", config, 0x2C, self.vendor_id, 0x0001)
        config[0x40] = 0xAA  # a register that exists but is not on the allowlist
        self.config = config
        self.memory = {bar: bytearray(spec.size) for bar, spec in self.bars.items()}
        struct.pack_into("<II", self.memory[0], 0, 0x7D15_7000, 1)  # magic, version

    def config_read(self, offset: int, size: int) -> int:
        """Raises KeyError (not readable), IndexError (outside config space), ValueError (size)."""
        if size not in (1, 2, 4):
            raise ValueError("config reads are 1, 2 or 4 bytes")
        if offset > CONFIG_SIZE or size > CONFIG_SIZE - offset:
            raise IndexError("outside config space")
        if (offset, size) not in READABLE_CONFIG:
            raise KeyError("register is not on the readable allowlist")
        with self._lock:
            return int.from_bytes(self.config[offset:offset + size], "little")

    def _window(self, bar: int, offset: int, length: int, write: bool) -> BarWindow:
        """Raises LookupError (no such BAR), ValueError (not whole aligned dwords), IndexError
        (outside the window), PermissionError (a write to a read-only window)."""
        spec = self.bars.get(bar)
        if spec is None:
            raise LookupError("no such BAR")
        if offset % BAR_ACCESS or length % BAR_ACCESS or not length:
            # device registers are read and written as whole aligned dwords: a split or partial
            # access may have side effects the register's owner never saw (a read-to-clear half)
            raise ValueError(f"BAR accesses are whole {BAR_ACCESS}-byte words at {BAR_ACCESS}-byte aligned offsets; "
                             f"got offset {offset}, length {length}")
        start, end = spec.window
        span = end - start
        if offset > span or length > span - offset:
            raise IndexError("outside the BAR window")
        if write and not spec.writable:
            raise PermissionError("BAR window is read-only")
        return spec

    def bar_read(self, bar: int, offset: int, length: int) -> bytes:
        spec = self._window(bar, offset, length, write=False)
        base = spec.window[0] + offset
        with self._lock:
            return bytes(self.memory[bar][base:base + length])

    def bar_write(self, bar: int, offset: int, data: bytes) -> None:
        spec = self._window(bar, offset, len(data), write=True)
        base = spec.window[0] + offset
        with self._lock:
            self.memory[bar][base:base + len(data)] = data

    def reset(self) -> int:
        with self._lock:
            self._power_on()
            self.resets += 1
            return self.resets
