"""Ordering between queues inside native code: the step functions of a capture linked per queue.

A captured step over several queues ("streams") can run as one native call per stream and replay
(`tinydist.engine.streams`). Its streams order themselves through a control block of host memory:
each stream owns a progress counter that its step function advances after each of its parts, and
a part that needs another stream's part first waits until that stream's counter has passed it.

A wait never spins: it sleeps on the counter's futex in slices of at most 1 ms, and gives up when
the block's abort word is set (a device of the capture failed) or when the other stream's counter
has stood still, and no kernel it runs published progress, for the timeout (it is stuck: the
runtime's hang rule). It then records why in its stream's status words, sets the abort word so
every other stream of the capture stops too, and the step function returns at once; the caller
reads the status and turns it into an error. A signal wakes sleepers only when there are any.

The timeout is on the device's clock (`tinydist.runtime.clock`): on the system clock the wait reads
CLOCK_MONOTONIC with `clock_gettime` itself (the clock `time.monotonic` reads); on any other clock
it calls that clock's native reading (`now_address`, a `tinydist.testing.MockClock`'s in tests), so
a test moves a native wait's deadline by hand as it moves a timeline's. The choice is made when the
function is generated: on the system clock the code is the very code it was before the clock could
be chosen (the same IR text), so production pays nothing for it.

A call of a step function stands for one replay; when the next replay is already queued and
marked ready (`publish`), the function runs it straight on, so a queue's worker returns to
Python — and takes the GIL — once per chain of replays.
"""

from __future__ import annotations

import ctypes
import functools
import platform
import sys
from collections.abc import Sequence
from dataclasses import dataclass


_FUTEX_SYSCALLS = {"x86_64": 202, "aarch64": 98}  # SYS_futex per Linux architecture
_FUTEX_WAIT_PRIVATE, _FUTEX_WAKE_PRIVATE = 128, 129
_CLOCK_MONOTONIC = 1
_SLEEP_SLICE_NS = 1_000_000          # how often a sleeping wait looks at the abort word and the clock

# status codes a step function leaves in its stream's status word
OK, ABORTED, TIMED_OUT = 0, 1, 2


@functools.cache
def futex_syscall() -> int | None:
    """This machine's futex system call number; None where there is none (not Linux, or an
    architecture not listed): captured steps there replay in runs instead."""
    if not sys.platform.startswith("linux"):
        return None
    return _FUTEX_SYSCALLS.get(platform.machine())


@functools.cache
def _libc_addresses() -> tuple[int, int]:
    libc = ctypes.CDLL(None, use_errno=True)
    return (ctypes.cast(libc.syscall, ctypes.c_void_p).value or 0,
            ctypes.cast(libc.clock_gettime, ctypes.c_void_p).value or 0)


class ControlLayout:
    """Where the int64 words a capture's streams share are: per stream two cache lines [progress,
    sleepers, replays run, status, unit, peer, target, seen, calls made], then the abort word.
    The memory itself is the runtime's (`tinydist.runtime.cpu.stream_control.ControlBlock`)."""

    LINE = 16
    PROGRESS, SLEEPERS, REPLAYS, STATUS, UNIT, PEER, TARGET, SEEN, CALLS = range(9)

    def __init__(self, base: int, streams: int) -> None:
        self._base, self.streams = base, streams

    @classmethod
    def words_for(cls, streams: int) -> int:
        return cls.LINE * (streams + 1)

    def address(self, stream: int, field: int) -> int:
        return self._base + 8 * (self.LINE * stream + field)

    @property
    def abort_address(self) -> int:
        return self._base + 8 * self.LINE * self.streams


@dataclass(frozen=True)
class Wait:
    """Before a part: wait until stream `peer` has finished its part `index` of replay r - lag."""
    peer: int
    lag: int      # 0: this replay; 1: the replay before
    index: int    # the part's position among the peer's parts


@dataclass(frozen=True)
class Slot:
    """A command argument that changes per replay: word `k` of the replay's row of addresses."""
    k: int


@dataclass(frozen=True)
class Part:
    waits: tuple[Wait, ...]
    commands: tuple[tuple[int, tuple[int | Slot, ...]], ...]   # (native entry address, arguments)


def step_function_ir(name: str, block: ControlLayout, stream: int, parts: Sequence[Part], parts_per_stream: Sequence[int],
                     slots: int, ring: int, row_words: int, ready: int, timeout_ns: int, chain_ns: int,
                     kernel_words: Sequence[int] | None = None, now_address: int | None = None) -> str:
    """LLVM IR of `void name()`: stream `stream`'s parts of a replay, in order, each after its waits
    and followed by a signal. `slots` is the address of the ring of per-replay argument rows
    (`ring` rows of `row_words` int64 words; replay r reads row r % ring).

    Each call stands for the next replay. When a replay is done and the next one is already
    queued (`ready`, a ring of int64 words: word r % ring holds r + 1 once replay r may run
    straight on), the function runs it too, for up to `chain_ns`, without going back to its
    caller; the calls that stand for replays it ran that way return at once. A queue's worker so
    takes the GIL once per chain rather than once per replay.

    `kernel_words`, per stream, is the address of a table of the progress words
    (`tinydist.codegen.progress`) of the kernels that stream runs: int64 [count, address, ...].
    A wait counts a change in their sum as progress of that stream, so a part running one long
    kernel is waited for while the kernel publishes; without tables only counters count.

    `now_address` is the address of a native `i64 now()` giving the device's clock in nanoseconds
    (`tinydist.runtime.clock.native_now`); None reads CLOCK_MONOTONIC, the system clock."""
    if ring & (ring - 1):
        raise ValueError(f"ring must be a power of two, got {ring}")
    futex = futex_syscall()
    if futex is None:
        raise RuntimeError(f"no futex system call on {sys.platform}/{platform.machine()}; check futex_syscall() first")
    syscall, clock = _libc_addresses()
    wait_fn, signal_fn, now_fn, kernels_fn = f"{name}.wait", f"{name}.signal", f"{name}.now", f"{name}.kernels"

    def kernels_of(peer: int) -> str:
        return "ptr null" if kernel_words is None else f"ptr inttoptr (i64 {kernel_words[peer]} to ptr)"

    def word(s: int, field: int) -> str:
        return f"ptr inttoptr (i64 {block.address(s, field)} to ptr)"

    if now_address is None:
        now = [f"  %r = call i32 inttoptr (i64 {clock} to ptr)(i32 {_CLOCK_MONOTONIC}, ptr %ts)",
               "  %s = load i64, ptr %ts, align 8",
               "  %pn = getelementptr i64, ptr %ts, i64 1",
               "  %n = load i64, ptr %pn, align 8",
               "  %m = mul i64 %s, 1000000000",
               "  %t = add i64 %m, %n"]
    else:
        now = [f"  %t = call i64 inttoptr (i64 {now_address} to ptr)()"]
    out = [
        f"define internal i64 @\"{now_fn}\"() {{",
        "entry:",
        "  %ts = alloca [2 x i64], align 8",
        *now,
        "  ret i64 %t",
        "}",
        "",
        f"define internal i64 @\"{kernels_fn}\"(ptr %table) {{",  # the sum of a stream's kernels' progress words
        "entry:",
        "  %none = icmp eq ptr %table, null",
        "  br i1 %none, label %zero, label %head",
        "head:",
        "  %count = load i64, ptr %table, align 8",
        "  %empty = icmp eq i64 %count, 0",
        "  br i1 %empty, label %zero, label %each",
        "each:",
        "  %i = phi i64 [ 0, %head ], [ %inext, %each ]",
        "  %acc = phi i64 [ 0, %head ], [ %acc1, %each ]",
        "  %slot = getelementptr i64, ptr %table, i64 %i",
        "  %entry1 = getelementptr i64, ptr %slot, i64 1",
        "  %address = load i64, ptr %entry1, align 8",
        "  %wordp = inttoptr i64 %address to ptr",
        "  %w = load atomic i64, ptr %wordp monotonic, align 8",
        "  %acc1 = add i64 %acc, %w",
        "  %inext = add i64 %i, 1",
        "  %all = icmp eq i64 %inext, %count",
        "  br i1 %all, label %sum, label %each",
        "sum:",
        "  ret i64 %acc1",
        "zero:",
        "  ret i64 0",
        "}",
        "",
        f"define internal i1 @\"{wait_fn}\"(ptr %counter, ptr %sleepers, i64 %target, i64 %unit, i64 %peer, ptr %kernels) {{",
        "entry:",
        "  %ts = alloca [2 x i64], align 8",
        "  %startp = alloca i64, align 8",
        "  %lastp = alloca i64, align 8",
        "  %klastp = alloca i64, align 8",
        "  %v0 = load atomic i64, ptr %counter acquire, align 8",
        "  %ok0 = icmp sge i64 %v0, %target",
        "  br i1 %ok0, label %reached, label %slow",
        "slow:",
        f"  %start0 = call i64 @\"{now_fn}\"()",
        "  store i64 %start0, ptr %startp, align 8",
        "  store i64 %v0, ptr %lastp, align 8",
        f"  %k0 = call i64 @\"{kernels_fn}\"(ptr %kernels)",
        "  store i64 %k0, ptr %klastp, align 8",
        "  br label %loop",
        "loop:",
        "  %v = load atomic i64, ptr %counter acquire, align 8",
        "  %ok = icmp sge i64 %v, %target",
        "  br i1 %ok, label %reached, label %progresscheck",
        "progresscheck:",  # as the runtime's hang rule: the clock runs while the other stream stands still
        "  %last = load i64, ptr %lastp, align 8",
        "  %counted = icmp ne i64 %v, %last",
        f"  %k = call i64 @\"{kernels_fn}\"(ptr %kernels)",  # or a kernel it runs published progress
        "  %klast = load i64, ptr %klastp, align 8",
        "  %published = icmp ne i64 %k, %klast",
        "  %moved = or i1 %counted, %published",
        "  br i1 %moved, label %progressed, label %abortcheck",
        "progressed:",
        "  store i64 %v, ptr %lastp, align 8",
        "  store i64 %k, ptr %klastp, align 8",
        f"  %start1 = call i64 @\"{now_fn}\"()",
        "  store i64 %start1, ptr %startp, align 8",
        "  br label %abortcheck",
        "abortcheck:",
        f"  %a = load atomic i64, ptr inttoptr (i64 {block.abort_address} to ptr) acquire, align 8",
        "  %isab = icmp ne i64 %a, 0",
        "  br i1 %isab, label %aborted, label %timecheck",
        "timecheck:",
        f"  %now = call i64 @\"{now_fn}\"()",
        "  %start = load i64, ptr %startp, align 8",
        "  %elapsed = sub i64 %now, %start",
        f"  %late = icmp sgt i64 %elapsed, {timeout_ns}",
        "  br i1 %late, label %timedout, label %sleep",
        "sleep:",
        "  %s0 = atomicrmw add ptr %sleepers, i64 1 seq_cst",
        "  %v2 = load atomic i64, ptr %counter seq_cst, align 8",
        "  %ok2 = icmp sge i64 %v2, %target",
        "  br i1 %ok2, label %awake, label %futex",
        "futex:",
        "  store i64 0, ptr %ts, align 8",
        "  %tsn = getelementptr i64, ptr %ts, i64 1",
        f"  store i64 {_SLEEP_SLICE_NS}, ptr %tsn, align 8",
        "  %low = and i64 %v2, 4294967295",  # the futex word is the counter's low half (little-endian)
        f"  %f = call i64 (i64, ...) inttoptr (i64 {syscall} to ptr)(i64 {futex}, ptr %counter, "
        f"i64 {_FUTEX_WAIT_PRIVATE}, i64 %low, ptr %ts)",
        "  br label %awake",
        "awake:",
        "  %s1 = atomicrmw sub ptr %sleepers, i64 1 seq_cst",
        "  br label %loop",
        "aborted:",
        "  br label %failed",
        "timedout:",
        "  br label %failed",
        "failed:",
        f"  %code = phi i64 [ {ABORTED}, %aborted ], [ {TIMED_OUT}, %timedout ]",
        f"  store i64 %code, {word(stream, block.STATUS)}, align 8",
        f"  store i64 %unit, {word(stream, block.UNIT)}, align 8",
        f"  store i64 %peer, {word(stream, block.PEER)}, align 8",
        f"  store i64 %target, {word(stream, block.TARGET)}, align 8",
        f"  store i64 %v, {word(stream, block.SEEN)}, align 8",
        f"  store atomic i64 1, ptr inttoptr (i64 {block.abort_address} to ptr) seq_cst, align 8",
        "  ret i1 false",
        "reached:",
        "  ret i1 true",
        "}",
        "",
        f"define internal void @\"{signal_fn}\"() {{",
        "entry:",
        f"  %old = atomicrmw add {word(stream, block.PROGRESS)}, i64 1 seq_cst",
        f"  %n = load atomic i64, {word(stream, block.SLEEPERS)} seq_cst, align 8",
        "  %any = icmp ne i64 %n, 0",
        "  br i1 %any, label %wake, label %done",
        "wake:",
        f"  %f = call i64 (i64, ...) inttoptr (i64 {syscall} to ptr)(i64 {futex}, {word(stream, block.PROGRESS)}, "
        f"i64 {_FUTEX_WAKE_PRIVATE}, i64 2147483647)",
        "  br label %done",
        "done:",
        "  ret void",
        "}",
        "",
        f"define void @\"{name}\"() {{",
        "entry:",
        f"  %calls0 = load i64, {word(stream, block.CALLS)}, align 8",
        "  %calls = add i64 %calls0, 1",
        f"  store i64 %calls, {word(stream, block.CALLS)}, align 8",
        f"  %done = load i64, {word(stream, block.REPLAYS)}, align 8",
        "  %ran = icmp sge i64 %done, %calls",  # an earlier call ran this call's replay in its chain
        "  br i1 %ran, label %stop, label %begin",
        "begin:",
        f"  %chain0 = call i64 @\"{now_fn}\"()",
        "  br label %replay",
        "replay:",
        "  %r = phi i64 [ %done, %begin ], [ %r1, %chain ]",
        f"  %row = and i64 %r, {ring - 1}",
        f"  %rowoff = mul i64 %row, {8 * row_words}",
        f"  %rowaddr = add i64 %rowoff, {slots}",
    ]
    values = 0
    for u, part in enumerate(parts):
        for w in part.waits:
            values += 1
            v = values
            out += [f"  %b{v} = sub i64 %r, {w.lag}",
                    f"  %m{v} = mul i64 %b{v}, {parts_per_stream[w.peer]}",
                    f"  %t{v} = add i64 %m{v}, {w.index + 1}",
                    f"  %ok{v} = call i1 @\"{wait_fn}\"({word(w.peer, block.PROGRESS)}, {word(w.peer, block.SLEEPERS)}, "
                    f"i64 %t{v}, i64 {u}, i64 {w.peer}, {kernels_of(w.peer)})",
                    f"  br i1 %ok{v}, label %go{v}, label %stop",
                    f"go{v}:"]
        for address, args in part.commands:
            operands = []
            for arg in args:
                if isinstance(arg, Slot):
                    values += 1
                    out += [f"  %sa{values} = add i64 %rowaddr, {8 * arg.k}",
                            f"  %sp{values} = inttoptr i64 %sa{values} to ptr",
                            f"  %sv{values} = load i64, ptr %sp{values}, align 8"]
                    operands.append(f"i64 %sv{values}")
                else:
                    operands.append(f"i64 {int(arg)}")
            out.append(f"  call void inttoptr (i64 {address} to ptr)({', '.join(operands)})")
        out.append(f"  call void @\"{signal_fn}\"()")
    out += [
        "  %r1 = add i64 %r, 1",
        f"  store i64 %r1, {word(stream, block.REPLAYS)}, align 8",
        f"  %nrow = and i64 %r1, {ring - 1}",
        "  %nroff = mul i64 %nrow, 8",
        f"  %naddr = add i64 %nroff, {ready}",
        "  %nptr = inttoptr i64 %naddr to ptr",
        "  %flag = load atomic i64, ptr %nptr acquire, align 8",
        "  %want = add i64 %r1, 1",
        "  %queued = icmp eq i64 %flag, %want",
        "  br i1 %queued, label %abortcheck, label %stop",
        "abortcheck:",
        f"  %a = load atomic i64, ptr inttoptr (i64 {block.abort_address} to ptr) acquire, align 8",
        "  %isab = icmp ne i64 %a, 0",
        "  br i1 %isab, label %stop, label %timecheck",
        "timecheck:",
        f"  %now = call i64 @\"{now_fn}\"()",
        "  %spent = sub i64 %now, %chain0",
        f"  %over = icmp sgt i64 %spent, {chain_ns}",
        "  br i1 %over, label %stop, label %chain",
        "chain:",
        "  br label %replay",
        "stop:",
        "  ret void",
        "}",
        "",
    ]
    return "\n".join(out)
