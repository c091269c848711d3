"""The PCI seam: the driver talks to a `PciDevice`, which is real hardware or the software NIC.

    reset(); map_bar(0) -> Bar (read32/write); map_bar(2) -> Bar (write64 doorbells)
    alloc_sysmem(size) -> (numpy view, [paddr per 4 KiB page]); free_sysmem(paddrs)
    await wait_irq(timeout) -> bool        # the interrupt (MSI-X on hardware, an event on the model)

`find_pci_nic()` looks for a BCM57608 (14e4:1760) bound for user-space access (vfio-pci). No such
device exists on these machines; the driver code above this seam is the same either way.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

import numpy as np

from tinydist.transports.rdma_bnxt.errors import NicUnavailable
from tinydist.transports.rdma_bnxt.softbnxt.nic import SoftNic

BNXT_VENDOR, BNXT_DEVICE = 0x14E4, 0x1760


class Bar(Protocol):
    def read32(self, off: int) -> int: ...
    def write(self, off: int, data: bytes) -> None: ...
    def write64(self, off: int, value: int) -> None: ...


class PciDevice(Protocol):
    name: str
    def reset(self) -> None: ...
    def map_bar(self, bar: int) -> Bar: ...
    def alloc_sysmem(self, size: int) -> tuple[np.ndarray, list[int]]: ...
    def free_sysmem(self, paddrs: list[int]) -> None: ...
    async def wait_irq(self, timeout: float) -> bool: ...
    # optional: add_irq_handler(fn) / remove_irq_handler(fn), fn() called on the loop after each interrupt


class _SoftBar:
    def __init__(self, nic: SoftNic, bar: int) -> None:
        self.nic, self.bar = nic, bar

    def read32(self, off: int) -> int:
        return self.nic.bar0_read32(off) if self.bar == 0 else 0xffffffff

    def write(self, off: int, data: bytes) -> None:
        if self.bar == 0:
            self.nic.bar0_write(off, bytes(data))

    def write64(self, off: int, value: int) -> None:
        if self.bar == 2:
            self.nic.doorbell(off, value)


class SoftPciDevice:
    """The software NIC behind the PciDevice interface."""

    def __init__(self, nic: SoftNic) -> None:
        self.nic = nic
        self.name = nic.name

    def reset(self) -> None:
        self.nic.pci_reset()

    def map_bar(self, bar: int) -> _SoftBar:
        if bar not in (0, 2):
            raise ValueError(f"BAR{bar} is not implemented by the BNXT personality")
        return _SoftBar(self.nic, bar)

    def alloc_sysmem(self, size: int) -> tuple[np.ndarray, list[int]]:
        return self.nic.mem.alloc(size)

    def free_sysmem(self, paddrs: list[int]) -> None:
        self.nic.mem.free(paddrs)

    async def wait_irq(self, timeout: float) -> bool:
        return await self.nic.wait_irq(timeout)

    def add_irq_handler(self, fn) -> None:
        """Call fn() on the event loop after each interrupt (MSI-X via an eventfd reader on hardware)."""
        self.nic.irq_handlers.append(fn)

    def remove_irq_handler(self, fn) -> None:
        if fn in self.nic.irq_handlers:
            self.nic.irq_handlers.remove(fn)


def find_pci_nic(sysfs: str = "/sys/bus/pci/devices") -> str:
    """The BDF of a BNXT Thor2 bound to vfio-pci, or raise NicUnavailable naming why none is usable."""
    root = Path(sysfs)
    found = []
    if root.is_dir():
        for dev in sorted(root.iterdir()):
            try:
                vendor = int((dev / "vendor").read_text(), 16)
                device = int((dev / "device").read_text(), 16)
            except (OSError, ValueError):
                continue
            if (vendor, device) == (BNXT_VENDOR, BNXT_DEVICE):
                driver = os.path.basename(os.readlink(dev / "driver")) if (dev / "driver").exists() else "none"
                found.append((dev.name, driver))
    if not found:
        raise NicUnavailable("no BNXT NIC (PCI 14e4:1760) on this machine")
    usable = [bdf for bdf, drv in found if drv == "vfio-pci"]
    if not usable:
        raise NicUnavailable(f"BNXT NIC(s) {', '.join(f'{b} ({d})' for b, d in found)} not bound to vfio-pci")
    # The VFIO back end (BAR mmap, IOMMU DMA mapping, MSI-X eventfd) is not part of this build.
    raise NicUnavailable(f"BNXT NIC {usable[0]} found, but the VFIO PciDevice back end is not built in")
