"""Host memory as the NIC model sees it: page frames with fake physical addresses.

`alloc(size)` hands out page-aligned numpy memory and one fake paddr per 4 KiB page (from
0x1_0000_0000, with a gap page between allocations; `shuffle=True` also permutes the pages of an
allocation, so a PBL bug reads the wrong page). A DMA to a frame that is not mapped (never
allocated, or freed) raises `DmaFault`: the NIC model turns that into an IOMMU fault.
"""

from __future__ import annotations

import bisect
import random

import numpy as np

from tinydist.base.errors import TinydistError

PAGE = 4096
BASE_FRAME = 0x1_0000_0000 // PAGE


class DmaFault(TinydistError):
    """The device touched memory that is not mapped for it."""


class PhysMem:
    def __init__(self, shuffle: bool = False, seed: int = 0) -> None:
        self.frames: dict[int, tuple[np.ndarray, int]] = {}   # frame -> (allocation, byte offset)
        self.shuffle = shuffle
        self.rng = random.Random(seed)
        self.next_frame = BASE_FRAME
        self.allocs = 0
        self.spans: dict[int, tuple[int, np.ndarray]] = {}   # first frame -> (pages, allocation), unshuffled ones
        self.starts: list[int] = []

    @property
    def live_pages(self) -> int:
        return len(self.frames)

    def alloc(self, size: int) -> tuple[np.ndarray, list[int]]:
        if size <= 0:
            raise ValueError(f"alloc of {size} bytes")
        npages = -(-size // PAGE)
        arr = np.zeros(npages * PAGE, np.uint8)
        frames = list(range(self.next_frame, self.next_frame + npages))
        self.next_frame += npages + 1
        if self.shuffle and npages > 1:
            self.rng.shuffle(frames)
        else:
            self.spans[frames[0]] = (npages, arr)
            bisect.insort(self.starts, frames[0])
        for i, f in enumerate(frames):
            self.frames[f] = (arr, i * PAGE)
        self.allocs += 1
        return arr, [f * PAGE for f in frames]

    def free(self, paddrs: list[int]) -> None:
        missing = [pa for pa in paddrs if pa // PAGE not in self.frames]
        if missing:
            raise DmaFault(f"free of unmapped pages {[hex(p) for p in missing[:4]]}")
        for pa in paddrs:
            del self.frames[pa // PAGE]
        first = paddrs[0] // PAGE
        if first in self.spans:
            del self.spans[first]
            self.starts.pop(bisect.bisect_left(self.starts, first))

    def _runs(self, pa: int, n: int):
        """(array, offset, length) pieces covering [pa, pa+n), merging physically and virtually contiguous pages."""
        while n > 0:
            frame, off = divmod(pa, PAGE)
            k = bisect.bisect_right(self.starts, frame) - 1
            if k >= 0:                      # inside an unshuffled allocation: one piece up to its end
                start = self.starts[k]
                npages, arr = self.spans[start]
                if frame < start + npages:
                    take = min(n, (start + npages) * PAGE - pa)
                    yield arr, pa - start * PAGE, take
                    pa += take
                    n -= take
                    continue
            got = self.frames.get(frame)
            if got is None:
                raise DmaFault(f"DMA to unmapped address 0x{pa:x}")
            arr, base = got
            take = min(n, PAGE - off)
            while take < n:                 # extend over following frames of the same allocation
                nxt = self.frames.get((pa + take) // PAGE)
                if nxt is None or nxt[0] is not arr or nxt[1] != base + off + take:
                    break
                take = min(n, take + PAGE)
            yield arr, base + off, take
            pa += take
            n -= take

    def read(self, pa: int, n: int) -> np.ndarray:
        pieces = [arr[o:o + k] for arr, o, k in self._runs(pa, n)]
        if len(pieces) == 1:
            return pieces[0].copy()
        return np.concatenate(pieces) if pieces else np.empty(0, np.uint8)

    def view(self, pa: int, n: int) -> np.ndarray | None:
        """A live view when [pa, pa+n) is one contiguous piece of one allocation, else None."""
        pieces = list(self._runs(pa, n)) if n else []
        if len(pieces) == 1:
            arr, o, k = pieces[0]
            return arr[o:o + k]
        return None

    def write(self, pa: int, data) -> None:
        src = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
        pos = 0
        for arr, o, k in self._runs(pa, len(src)):
            arr[o:o + k] = src[pos:pos + k]
            pos += k

    def read_u64(self, pa: int) -> int:
        return int(self.read(pa, 8).view("<u8")[0])
