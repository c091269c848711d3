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
        [40:48)    uint64 sleeping: 1 while r is in (or entering) a FUTEX_WAIT on a peer's step word
        [64:...)   two header slots (round parity): uint32 length, then a JSON blob
        [-8:)      uint64 1 + the CPU r's last native call ran on (`CPU_WORD`)

Signalling: a rank fills its data (and header), then moves its `step` on by a compare-and-swap,
then FUTEX_WAKEs the word. x86-64 keeps stores in program order (glibc's non-temporal memcpy ends with an sfence), so a
peer that sees the new step sees the data; `ShmGroup.supported()` is False elsewhere and the group
then uses its links. A waiter spins up to `SPIN_SECONDS` (only when neither the ranks nor the
runnable threads outnumber the CPUs: spinning on an oversubscribed CPU holds the very CPU its queued
peer could run on), then sleeps in FUTEX_WAIT
in short slices, between which it checks the caller's failure test and deadline, so every wait is
bounded and notices a dead peer (the group's links see its EOF and call `wake_all`).

Giving up is agreed, not local: a rank that stops waiting for a peer's step (its deadline passed, or
the caller's test says the peer died or left) first swaps a poison value into that peer's step word,
by the same compare-and-swap the peer posts with. Exactly one of the two wins. If the poison wins,
the peer can never post that step: its own `post` fails and raises `Abandoned`, and every rank
waiting for the step sees the poison and raises too, so the collective fails on every rank, a late
one included, with the reason and the rank to blame the poison carries. If the post won, the step is
in and the waiter goes on, so the collective completes on every rank. The poison is sticky: the
group is dead from then on. (Before, a rank that arrived after its peers' deadline found their
steps posted and returned a correct result for a call its peers had already failed.)

The segment's name is unlinked as soon as every rank has mapped it (`tinydist launch` sweeps
`/dev/shm/tinydist-<job>-*` for a rank killed inside the set-up), so nothing outlives the job.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import platform
import secrets
import sys
import time
from collections.abc import Callable, Sequence

import anyio
import numpy as np

from tinydist.codegen.compile_cache import compile_glue
from tinydist.codegen.stream_sync import futex_syscall
from tinydist.runtime.cpu.futex import SYSCALL_ADDRESS
from tinydist.runtime.cpu.loader import native_loader
from tinydist.runtime.program import Program
from tinydist.transports import cma
from tinydist.transports.base import Link, LinkClosed, TransportError
from tinydist.transports.shm import PREFIX, _attach, _create, _unlink

CONTROL_BYTES = 16384
# The control word a rank sets around each of its futex sleeps. A poster that finds it clear on every
# peer, after its compare-and-swap, can skip FUTEX_WAKE (`tinydist.dist.shm_fast`: a shared-futex wake
# costs ~750 ns here even with no waiter, a sixth of a 4 KiB allreduce): the sleeper stores the flag
# before the syscall, the poster swaps its step before reading the flags, both sequentially
# consistent (and the kernel reads the futex word after a full barrier), so one of the two sees the
# other's write. The group's own posts (`post`, `give_up`) and `wake_all` always wake.
SLEEPING_WORD = 5
# The control page's last word: 1 + the CPU a rank's native call last ran on (0: not known), so a
# waiter can tell that its peer last ran on the waiter's own CPU and hand it the CPU instead of
# spinning (`tinydist.dist.shm_fast`).
CPU_WORD = CONTROL_BYTES // 8 - 1
HEADER_OFFSET = 64
HEADER_BYTES = (CONTROL_BYTES - HEADER_OFFSET - 8) // 2
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
    """A wait reached its deadline; `.ranks` are the peers that had not reached the step (now poisoned)."""

    def __init__(self, ranks: list[int], step: int) -> None:
        self.ranks, self.step = ranks, step
        super().__init__(f"ranks {ranks} did not reach step {step}")


class Abandoned(TransportError):
    """A rank gave up on this group's step (see the module docstring): `.reason` its code (`TIMED_OUT`,
    or the caller's code from its wait's test), `.blamed` the rank it blamed, `.ranks` every rank
    whose step word holds a poison now (the ranks given up on)."""

    def __init__(self, reason: int, blamed: int, ranks: list[int]) -> None:
        self.reason, self.blamed, self.ranks = reason, blamed, ranks
        super().__init__(f"the group gave up on ranks {ranks} (reason {reason}, blaming rank {blamed})")


# A poisoned step word: the top bit, the reason in bits 32..62, the blamed rank in bits 0..31.
_POISON = 1 << 63
TIMED_OUT = 1     # the reason a wait poisons with when its deadline passes


def _poison(reason: int, blamed: int) -> int:
    return _POISON | reason << 32 | blamed


FUTEX_WAKE = 1  # shared, not FUTEX_WAKE_PRIVATE: the waiters are other processes mapping the segment
_CAS_NAME = "td_shm_group_cas_wake"


@functools.cache
def _compare_and_swap() -> tuple[Program, Callable[[int, int, int], int]] | None:
    """`cas(address, expected, desired) -> old`: a sequentially consistent compare-and-swap on a
    uint64 (LLVM's `cmpxchg`, C11's atomic_compare_exchange_strong; `lock cmpxchg` on x86-64) and,
    when it swapped, FUTEX_WAKE of every waiter on the word; the old value returned. Compiled from
    IR on first use, like the runtime's other glue; None where the signalling's other assumption,
    x86-64's store order for the slots' plain stores, or a futex, is missing. One native call for
    both halves of a post: measured under load (load average 8 on 2 vCPUs, min of 5 x 1e5 posts,
    three runs), the old post (a numpy store, then syscall(2) through ctypes) took 3.7-5.6 us, one
    call 3.0-4.4 us; a separate compare-and-swap call before that syscall had made it 6.3-8.1 us."""
    futex = futex_syscall()
    if futex is None or platform.machine() not in ("x86_64", "AMD64"):
        return None
    ir = "\n".join([
        f"define i64 @{_CAS_NAME}(ptr %word, i64 %expected, i64 %desired) {{", "entry:",
        "  %r = cmpxchg ptr %word, i64 %expected, i64 %desired seq_cst seq_cst",
        "  %old = extractvalue { i64, i1 } %r, 0",
        "  %swapped = extractvalue { i64, i1 } %r, 1",
        "  br i1 %swapped, label %wake, label %done", "wake:",
        f"  %syscall = inttoptr i64 {SYSCALL_ADDRESS} to ptr",
        f"  %woken = call i64 (i64, ...) %syscall(i64 {futex}, ptr %word, i64 {FUTEX_WAKE}, i64 2147483647)",
        "  br label %done", "done:", "  ret i64 %old", "}", ""])
    program = native_loader.load(compile_glue(ir), _CAS_NAME, ["i64", "i64", "i64"])
    # the loader's callable returns nothing; this one returns the old value (the program keeps the code mapped)
    cas = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64)(program.address)
    return program, cas


_PROBE = 0x7464_7072_6F62_6500   # a rank's probe word is this | its rank: a read of the wrong address shows
_FAILED = "failed: "   # rank 0's message instead of a segment name when it could not create one


def segment_name(job: str) -> str:
    return f"/{PREFIX}{job}-group-{secrets.token_hex(4)}"


class ShmGroup:
    """The mapped segment of one group, seen from `rank`. Create with `create` (one rank) / `attach` (the rest)."""

    def __init__(self, mapping: mmap.mmap, rank: int, world: int, slot_bytes: int) -> None:
        self.map, self.rank, self.world, self.slot_bytes = mapping, rank, world, slot_bytes
        compiled = _compare_and_swap()
        if compiled is None:
            raise TransportError("a shared-memory group needs x86-64 Linux (futexes, its store order and a "
                                 "compare-and-swap); check ShmGroup.supported() and use the links instead")
        self._cas = compiled[1]   # bound once: a post is one native call, no lookup
        self.raw: np.ndarray | None = np.frombuffer(mapping, np.uint8)
        base = self.raw.ctypes.data
        self._words = [base + r * CONTROL_BYTES for r in range(world)]
        # peers' step words, read in the wait loop; a strided view: one element per control page
        self.steps: np.ndarray | None = np.ndarray((world,), np.uint64, buffer=mapping, offset=0, strides=(CONTROL_BYTES,))
        # our sleeping flag (`SLEEPING_WORD`)
        self._sleeping: np.ndarray | None = np.ndarray((1,), np.uint64, buffer=mapping, offset=rank * CONTROL_BYTES + 8 * SLEEPING_WORD)
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
        """Futexes via syscall(2), x86-64's store order and its compare-and-swap: what the signalling relies on."""
        return _compare_and_swap() is not None

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

    def negotiate_single_copy(self, deadline: float, check: Callable[[int], tuple[int, int] | None],
                              min_bytes: int | None) -> int | None:
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
        """Complete one step: publish it to the peers and wake those sleeping on it. Raises Abandoned
        when a peer gave up on this rank first (its poison is in our word: the step never happens)."""
        self._open_steps()
        old = self._cas(self._words[self.rank], self.step, self.step + 1)  # and wakes
        if old != self.step:
            raise self.abandoned(old)
        self.step += 1
        return self.step

    def _open_steps(self) -> np.ndarray:
        """Every rank's step word; LinkClosed once this view of the segment is closed."""
        steps = self.steps
        if steps is None:
            raise LinkClosed(f"the group's shared memory is closed (rank {self.rank})")
        return steps

    def abandoned(self, poison: int) -> Abandoned:
        """The Abandoned that `poison` (a step word's value with the poison bit) stands for, naming
        every rank poisoned now; LinkClosed when this view is closed (the words are gone)."""
        steps = self._open_steps()
        return Abandoned((poison & ~_POISON) >> 32, poison & 0xFFFFFFFF, [r for r in range(self.world) if int(steps[r]) & _POISON])

    def give_up(self, ranks: Sequence[int], step: int, reason: int, blamed: int) -> list[int]:
        """Poison the step word of each of `ranks` still short of `step` (wake its waiters); return
        the ranks whose words now hold a poison, ours or an earlier one. A rank that posted `step`
        meanwhile is left alone: it is not behind after all."""
        steps = self._open_steps()
        poisoned = []
        for r in ranks:
            while True:
                seen = int(steps[r])
                if seen & _POISON:
                    poisoned.append(r)
                    break
                if seen >= step:
                    break
                if self._cas(self._words[r], seen, _poison(reason, blamed)) == seen:  # and wakes
                    poisoned.append(r)
                    break
        return poisoned

    def wait(self, step: int, deadline: float, check: Callable[[int], tuple[int, int] | None],
             ranks: Sequence[int] | None = None) -> None:
        """Return once every rank in `ranks` (default: all peers) completed `step`.

        `check(peer)` runs between sleeps on `peer`: (reason, blamed rank) to give up on it (the
        caller's codes, above `TIMED_OUT`), or None to keep waiting. Giving up poisons the peer's
        word (`give_up`) and raises Abandoned; past `deadline` (time.monotonic) the ranks behind are
        poisoned with `TIMED_OUT` and WaitTimeout names them. A peer that posted meanwhile is
        waited for no more. A poison already in a peer's word raises Abandoned.
        """
        steps, sleeping = self.steps, self._sleeping
        if steps is None or sleeping is None:
            raise LinkClosed(f"the group's shared memory is closed (rank {self.rank})")
        targets = self.peers if ranks is None else ranks
        for peer in targets:
            seen = int(steps[peer])
            if seen < step and self.spin and not self._crowded():
                spin_until = time.perf_counter() + self.spin
                while steps[peer] < step and time.perf_counter() < spin_until:
                    pass
            while True:
                seen = int(steps[peer])
                if seen >= step:
                    if seen & _POISON:
                        raise self.abandoned(seen)
                    break
                why = check(peer)
                if why is not None and self.give_up([peer], step, *why):
                    raise self.abandoned(int(steps[peer]))
                left = deadline - time.monotonic()
                if left <= 0:
                    behind = self.give_up([r for r in targets if int(steps[r]) < step or int(steps[r]) & _POISON],
                                          step, TIMED_OUT, self.rank)
                    if behind:
                        raise WaitTimeout(behind, step)
                    continue      # every one of them posted in the meantime
                sleeping[0] = 1        # a native post wakes us only when it sees this (`SLEEPING_WORD`)
                self._futex(self._words[peer], _FUTEX_WAIT, seen & 0xFFFFFFFF, min(left, SLEEP_SLICE))
                sleeping[0] = 0

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
        self.raw = self.steps = self._sleeping = None
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
