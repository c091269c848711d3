"""One shared-memory segment per process group on one host, mapped by every rank, signalled by futexes.

Where `tinydist.transports.shm.ShmLink` moves a message through slots of a pairwise ring and rings a socket
doorbell, a `ShmGroup` lets every rank read every other rank's memory directly: a collective copies
its input into its own region once, and peers reduce or gather straight out of it. No socket frame
carries a collective's data or its signals; the links stay for liveness (EOF, BYE, ABORT).

Layout: one control page per rank, then per rank two data slots of `slot_bytes` (alternate rounds
use alternate slots, so a rank may fill round k+1's slot while a slow peer still reads round k's).

    control page of rank r (only r writes it):
        [0:8)      uint64 step: how many steps r has completed; peers wait on it
        [8:40)     uint64 pid, probe address, probe verdict, single-copy threshold (`negotiate_single_copy`)
        [64:...)   two header slots (round parity): uint32 length, then a JSON blob

Signalling: a rank fills its data (and header), then stores its new `step`, then FUTEX_WAKEs the
word. x86-64 keeps stores in program order (glibc's non-temporal memcpy ends with an sfence), so a
peer that sees the new step sees the data; `ShmGroup.supported()` is False elsewhere and the group
then uses its links. A waiter spins up to `SPIN_SECONDS` (only when neither the ranks nor the
runnable threads outnumber the CPUs: spinning on an oversubscribed CPU holds the very CPU its queued
peer could run on), then sleeps in FUTEX_WAIT
in short slices, between which it checks the caller's failure test and deadline, so every wait is
bounded and notices a dead peer (the group's links see its EOF and call `wake_all`).

The segment's name is unlinked as soon as every rank has mapped it (`tinydist launch` sweeps
`/dev/shm/tinydist-<job>-*` for a rank killed inside the set-up), so nothing outlives the job.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
import secrets
import sys
import time
from collections.abc import Callable, Sequence

import anyio
import numpy as np

from tinydist.transports import cma
from tinydist.transports.base import Link, LinkClosed, TransportError
from tinydist.transports.shm import PREFIX, _attach, _create, _unlink

CONTROL_BYTES = 16384
HEADER_OFFSET = 64
HEADER_BYTES = (CONTROL_BYTES - HEADER_OFFSET) // 2
SLOT_BYTES = 4 << 20
# busy-wait this long before sleeping in the kernel, when no thread is queued for a CPU (`_crowded`).
# Measured (2 ranks, 4 KiB..1 MiB, 2-vCPU VM): a peer on the other core usually answers within it,
# while a futex sleep costs ~0.15-0.2 ms to wake from. sched_yield in between was worse: it hands
# the CPU to unrelated processes for a time slice.
SPIN_SECONDS = 1e-3
SLEEP_SLICE = 0.05        # the longest futex sleep between failure/deadline checks

_SYS_FUTEX = 202          # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1   # not the _PRIVATE variants: waiters and wakers are different processes


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


class WaitTimeout(TransportError):
    """A wait reached its deadline; `.ranks` are the peers that had not reached the step."""

    def __init__(self, ranks: list[int], step: int) -> None:
        self.ranks, self.step = ranks, step
        super().__init__(f"ranks {ranks} did not reach step {step}")


_PROBE = 0x7464_7072_6F62_6500   # a rank's probe word is this | its rank: a read of the wrong address shows
_FAILED = "failed: "   # rank 0's message instead of a segment name when it could not create one


def segment_name(job: str) -> str:
    return f"/{PREFIX}{job}-group-{secrets.token_hex(4)}"


class ShmGroup:
    """The mapped segment of one group, seen from `rank`. Create with `create` (one rank) / `attach` (the rest)."""

    def __init__(self, mapping: mmap.mmap, rank: int, world: int, slot_bytes: int) -> None:
        self.map, self.rank, self.world, self.slot_bytes = mapping, rank, world, slot_bytes
        self.raw: np.ndarray | None = np.frombuffer(mapping, np.uint8)
        base = self.raw.ctypes.data
        self._words = [base + r * CONTROL_BYTES for r in range(world)]
        # peers' step words, read in the wait loop; a strided view: one element per control page
        self.steps: np.ndarray | None = np.ndarray((world,), np.uint64, buffer=mapping, offset=0, strides=(CONTROL_BYTES,))
        self.peers = [r for r in range(world) if r != rank]
        self.cpus = len(os.sched_getaffinity(0))           # CPUs this process may use
        self.spin = SPIN_SECONDS if world <= self.cpus else 0.0
        self._loadavg = os.open("/proc/loadavg", os.O_RDONLY) if os.path.exists("/proc/loadavg") else -1
        self.step = int(self.steps[rank])
        self.rounds = 0           # rounds begun; every rank begins the same rounds, so parities agree
        # every rank's pid, and from what size on collectives copy straight between the ranks' memory
        # (`tinydist.transports.cma`; None: never, as when a rank may not read or write a peer's memory)
        self.pids: list[int] = []
        self.single_copy_bytes: int | None = None
        self._scratch = np.empty(0, np.uint8)

    @staticmethod
    def supported() -> bool:
        """Futexes via syscall(2) and x86-64's store order: the two things the signalling relies on."""
        return _libc is not None and platform.machine() in ("x86_64", "AMD64")

    @staticmethod
    def size(world: int, slot_bytes: int) -> int:
        return world * (CONTROL_BYTES + 2 * slot_bytes)

    @classmethod
    def create(cls, job: str, rank: int, world: int, slot_bytes: int = SLOT_BYTES) -> tuple[ShmGroup, str]:
        """Create and map a fresh segment; the caller unlinks `name` once every peer has attached."""
        name, size = segment_name(job), cls.size(world, slot_bytes)
        try:
            mapping = _create(name, size, reserve=True)
        except OSError as exc:
            raise TransportError(f"cannot reserve {size} bytes of shared memory for the group segment of {world} ranks "
                                 f"({exc.strerror or exc}): enlarge /dev/shm (docker --shm-size), lower "
                                 f"TINYDIST_SHM_SLOT_BYTES ({slot_bytes} now), or set TINYDIST_TRANSPORT=tcp") from exc
        return cls(mapping, rank, world, slot_bytes), name

    @classmethod
    def attach(cls, name: str, rank: int, world: int, slot_bytes: int = SLOT_BYTES) -> ShmGroup:
        if not name.startswith("/" + PREFIX):
            raise TransportError(f"unexpected group segment name {name!r}; expected /{PREFIX}<job>-group-…")
        return cls(_attach(name, cls.size(world, slot_bytes)), rank, world, slot_bytes)

    # ---- regions ------------------------------------------------------------------------------

    def next_round(self) -> int:
        """Begin a round; returns the slot parity its data and header use."""
        self.rounds += 1
        return self.rounds % 2

    def region(self, rank: int, parity: int, dtype: np.dtype, count: int) -> np.ndarray:
        """`count` elements of `dtype` at the start of rank `rank`'s data slot `parity`."""
        if count * dtype.itemsize > self.slot_bytes:
            raise TransportError(f"{count} x {dtype} does not fit a {self.slot_bytes}-byte slot")
        offset = self.world * CONTROL_BYTES + (2 * rank + parity) * self.slot_bytes
        return np.ndarray((count,), dtype, buffer=self.map, offset=offset)

    def scratch(self, nbytes: int) -> np.ndarray:
        """A private buffer of at least `nbytes`, kept between collectives (a fresh one would fault its pages in each time)."""
        if self._scratch.nbytes < nbytes:
            self._scratch = np.empty(nbytes, np.uint8)
        return self._scratch[:nbytes]

    def write_header(self, parity: int, blob: bytes) -> None:
        if len(blob) > HEADER_BYTES - 4:
            raise TransportError(f"collective header of {len(blob)} bytes exceeds {HEADER_BYTES - 4}")
        raw = self._raw()
        at = self.rank * CONTROL_BYTES + HEADER_OFFSET + parity * HEADER_BYTES
        raw[at:at + 4] = np.frombuffer(len(blob).to_bytes(4, "little"), np.uint8)
        raw[at + 4:at + 4 + len(blob)] = np.frombuffer(blob, np.uint8)

    def read_header(self, rank: int, parity: int) -> bytes:
        raw = self._raw()
        at = rank * CONTROL_BYTES + HEADER_OFFSET + parity * HEADER_BYTES
        n = int.from_bytes(raw[at:at + 4].tobytes(), "little")
        if n > HEADER_BYTES - 4:
            raise TransportError(f"rank {rank}'s collective header claims {n} bytes (at most {HEADER_BYTES - 4})")
        return raw[at + 4:at + 4 + n].tobytes()

    def _raw(self) -> np.ndarray:
        if self.raw is None:
            raise LinkClosed(f"the group's shared memory is closed (rank {self.rank})")
        return self.raw

    def negotiate_single_copy(self, deadline: float, check: Callable[[int], None], min_bytes: int | None) -> int | None:
        """Learn every rank's pid, and agree from what message size on collectives copy straight
        between the ranks' memory (`tinydist.transports.cma`); None: never. Each rank publishes a probe word,
        reads and rewrites every peer's, then publishes its verdict and its `min_bytes` (None: it
        wants no single copy). Single copy needs every rank's yes; its threshold is the largest asked
        for, the same on every rank. Two steps."""
        control = self._control()
        probe = np.array([_PROBE | self.rank], np.uint64)   # private memory the peers probe
        control[self.rank, 1:3] = (os.getpid(), probe.ctypes.data)
        self.wait(self.post(), deadline, check)
        self.pids = [int(pid) for pid in control[:, 1]]
        verdict = min_bytes is not None and cma.available()
        seen = np.zeros(1, np.uint64)
        for peer in self.peers if verdict else ():
            try:
                cma.read(self.pids[peer], int(control[peer, 2]), seen)
                cma.write(self.pids[peer], int(control[peer, 2]), seen)
            except TransportError:
                seen[0] = 0
            if int(seen[0]) != _PROBE | peer:
                verdict = False
                break
        control[self.rank, 3:5] = (int(verdict), min_bytes or 0)
        self.wait(self.post(), deadline, check)      # every peer is done with `probe`
        self.single_copy_bytes = int(control[:, 4].max()) if control[:, 3].all() else None
        return self.single_copy_bytes

    def _control(self) -> np.ndarray:
        """Every rank's first control words, (world, 5) uint64: step, pid, probe address, probe verdict, single-copy threshold."""
        raw = self._raw()
        return np.ndarray((self.world, 5), np.uint64, buffer=raw, strides=(CONTROL_BYTES, 8))

    # ---- signalling ---------------------------------------------------------------------------

    def post(self) -> int:
        """Complete one step: publish it to the peers and wake those sleeping on it."""
        if self.steps is None:
            raise LinkClosed(f"the group's shared memory is closed (rank {self.rank})")
        self.step += 1
        self.steps[self.rank] = self.step
        self._futex(self._words[self.rank], _FUTEX_WAKE, 0x7FFFFFFF, None)
        return self.step

    def wait(self, step: int, deadline: float, check: Callable[[int], None], ranks: Sequence[int] | None = None) -> None:
        """Return once every rank in `ranks` (default: all peers) completed `step`.

        `check(peer)` runs between sleeps on `peer` and raises when the group has failed or that
        peer has left; past `deadline` (time.monotonic) this raises WaitTimeout naming the ranks behind.
        """
        steps = self.steps
        if steps is None:
            raise LinkClosed(f"the group's shared memory is closed (rank {self.rank})")
        for peer in self.peers if ranks is None else ranks:
            if steps[peer] >= step:
                continue
            if self.spin and not self._crowded():
                spin_until = time.perf_counter() + self.spin
                while steps[peer] < step and time.perf_counter() < spin_until:
                    pass
            while True:
                seen = int(steps[peer])
                if seen >= step:
                    break
                check(peer)
                left = deadline - time.monotonic()
                if left <= 0:
                    behind = [r for r in (self.peers if ranks is None else ranks) if steps[r] < step]
                    raise WaitTimeout(behind, step)
                self._futex(self._words[peer], _FUTEX_WAIT, seen & 0xFFFFFFFF, min(left, SLEEP_SLICE))

    def _crowded(self) -> bool:
        """More runnable threads than CPUs right now (the 4th field of /proc/loadavg: running/total)?
        Then a peer may be queued for a CPU, and spinning would hold one it could run on: sleep instead."""
        if self._loadavg < 0:
            return False
        try:
            running = int(os.pread(self._loadavg, 128, 0).split()[3].split(b"/")[0])
        except (OSError, ValueError, IndexError):
            return False
        return running > self.cpus

    def wake_all(self) -> None:
        """Wake every waiter on every rank's word (another thread saw the group fail). Safe from any thread."""
        if self.steps is not None:
            for word in self._words:
                self._futex(word, _FUTEX_WAKE, 0x7FFFFFFF, None)

    @staticmethod
    def _futex(address: int, op: int, value: int, timeout: float | None) -> None:
        spec = None
        if timeout is not None:
            spec = _Timespec(int(timeout), int((timeout % 1) * 1e9))
        # a wait returns early on EAGAIN (the word already changed), EINTR or a wake: callers re-check
        _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), op, value,  # type: ignore[union-attr]
                      None if spec is None else ctypes.byref(spec), None, 0)

    def close(self) -> None:
        """Unmap (the name is long unlinked). Views still held elsewhere keep the mapping until collected."""
        self.raw = self.steps = None
        with contextlib.suppress(BufferError):
            self.map.close()
        if self._loadavg >= 0:
            os.close(self._loadavg)
            self._loadavg = -1


async def open_group(rank: int, world: int, job: str, links: dict[int, Link], slot_bytes: int, timeout: float) -> ShmGroup:
    """Rank 0 creates the segment and sends its name over each link; every other rank maps it and
    answers `mapped` (or why not); rank 0 then unlinks the name. Every rank calls this, links served."""
    with anyio.fail_after(timeout):
        if rank == 0:
            try:
                grp, name = ShmGroup.create(job, rank, world, slot_bytes)
            except TransportError as exc:
                for link in links.values():      # every rank fails with the same reason, not a lost peer
                    with contextlib.suppress(TransportError):
                        await link.send(f"{_FAILED}{exc}".encode())
                raise
            try:
                for link in links.values():
                    await link.send(name.encode())
                for peer, link in links.items():
                    async with link.recv() as view:
                        answer = bytes(view)
                    if answer != b"mapped":
                        raise TransportError(f"rank {peer} could not map the group segment {name}: {answer.decode(errors='replace')}")
            except BaseException:
                grp.close()
                raise
            finally:
                _unlink(name)
            return grp
        async with links[0].recv() as view:
            name = bytes(view).decode(errors="replace")
        if name.startswith(_FAILED):
            raise TransportError(f"rank 0 could not create the group segment: {name[len(_FAILED):]}")
        try:
            grp = ShmGroup.attach(name, rank, world, slot_bytes)
        except (OSError, TransportError) as exc:
            with contextlib.suppress(TransportError):
                await links[0].send(f"{type(exc).__name__}: {exc}".encode())
            raise
        await links[0].send(b"mapped")
        return grp
