"""Test support (not used by the engine itself): small hand-written kernels shared by tests and
benchmarks, `MockClock`, virtual time for the runtime's waits, and `process_resources`, what this
process holds (the soak, the kernel-memory benchmark and its test sample it).

Kernel symbol names must be unique per process (the loader refuses a second object defining the
same one), so every kernel takes its name as an argument.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from llvmlite import ir

from tinydist.codegen import transcendental
from tinydist.codegen.compile_cache import compile_glue
from tinydist.runtime.clock import Wakeup
from tinydist.runtime.cpu import futex
from tinydist.runtime.cpu.loader import native_loader
from tinydist.runtime.program import Program

SCALE_SIGNATURE = ("w", "r", "f32", "i64")
SAXPY_SIGNATURE = ("rw", "r", "f32", "i64")


def scale_ir(name: str) -> str:
    """`void name(float* out, const float* in, float a, i64 n)`: out[i] = a * in[i]."""
    return f"""
define void @{name}(ptr noalias %out, ptr noalias readonly %in, float %a, i64 %n) {{
entry:
  %empty = icmp eq i64 %n, 0
  br i1 %empty, label %exit, label %loop
loop:
  %i = phi i64 [0, %entry], [%next, %loop]
  %pin = getelementptr inbounds float, ptr %in, i64 %i
  %pout = getelementptr inbounds float, ptr %out, i64 %i
  %v = load float, ptr %pin
  %r = fmul float %a, %v
  store float %r, ptr %pout
  %next = add nuw i64 %i, 1
  %done = icmp eq i64 %next, %n
  br i1 %done, label %exit, label %loop
exit:
  ret void
}}
"""


def saxpy_ir(name: str) -> str:
    """`void name(float* y, const float* x, float a, i64 n)`: y[i] = a * x[i] + y[i]."""
    return f"""
define void @{name}(ptr noalias %y, ptr noalias readonly %x, float %a, i64 %n) {{
entry:
  %empty = icmp eq i64 %n, 0
  br i1 %empty, label %exit, label %loop
loop:
  %i = phi i64 [0, %entry], [%next, %loop]
  %px = getelementptr inbounds float, ptr %x, i64 %i
  %py = getelementptr inbounds float, ptr %y, i64 %i
  %vx = load float, ptr %px
  %vy = load float, ptr %py
  %ax = fmul contract float %a, %vx
  %r = fadd contract float %ax, %vy
  store float %r, ptr %py
  %next = add nuw i64 %i, 1
  %done = icmp eq i64 %next, %n
  br i1 %done, label %exit, label %loop
exit:
  ret void
}}
"""


def spin_ir(name: str) -> str:
    """`void name(double* x, i64 n, i64 iters)`: x[i] <- x[i] * 0.75 + 1.0, `iters` times per element
    (one dependent chain each, so the time scales with iters; the fixed point is 4.0)."""
    return f"""
define void @{name}(ptr noalias %x, i64 %n, i64 %iters) {{
entry:
  %empty = icmp eq i64 %n, 0
  br i1 %empty, label %exit, label %outer
outer:
  %i = phi i64 [0, %entry], [%inext, %outer_end]
  %p = getelementptr inbounds double, ptr %x, i64 %i
  %x0 = load double, ptr %p
  %noiter = icmp eq i64 %iters, 0
  br i1 %noiter, label %outer_end, label %inner
inner:
  %k = phi i64 [0, %outer], [%knext, %inner]
  %acc = phi double [%x0, %outer], [%acc2, %inner]
  %m = fmul double %acc, 7.500000e-01
  %acc2 = fadd double %m, 1.000000e+00
  %knext = add nuw i64 %k, 1
  %kdone = icmp eq i64 %knext, %iters
  br i1 %kdone, label %outer_end, label %inner
outer_end:
  %res = phi double [%x0, %outer], [%acc2, %inner]
  store double %res, ptr %p
  %inext = add nuw i64 %i, 1
  %idone = icmp eq i64 %inext, %n
  br i1 %idone, label %exit, label %outer
exit:
  ret void
}}
"""


def transcendental_ir(function: str, dtype: type, name: str) -> tuple[str, int]:
    """`void name(T* out, const T* in[, const T* in2], i64 n)` applying transcendental.<function>
    elementwise; returns (IR text, number of inputs)."""
    fty = ir.FloatType() if dtype == np.float32 else ir.DoubleType()
    arity = 2 if function == "pow" else 1
    module = ir.Module()
    ptr, i64 = ir.PointerType(), ir.IntType(64)
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [ptr] * (1 + arity) + [i64]), name)
    out, *ins, n = fn.args
    for a in (out, *ins):
        a.add_attribute("noalias")
    entry_bb, loop_bb, exit_bb = (fn.append_basic_block(s) for s in ("entry", "loop", "exit"))
    b = ir.IRBuilder(entry_bb)
    b.cbranch(b.icmp_signed(">", n, i64(0)), loop_bb, exit_bb)
    b.position_at_end(loop_bb)
    i = b.phi(i64)
    i.add_incoming(i64(0), entry_bb)
    args = [b.load(b.gep(p, [i], source_etype=fty), typ=fty) for p in ins]
    b.store(getattr(transcendental, function)(b, *args), b.gep(out, [i], source_etype=fty))
    nxt = b.add(i, i64(1))
    i.add_incoming(nxt, loop_bb)
    b.cbranch(b.icmp_signed("<", nxt, n), loop_bb, exit_bb)
    b.position_at_end(exit_bb)
    b.ret_void()
    return str(module), arity


class MockClock:
    """Virtual time for timelines and devices (`open_device(name, clock=MockClock())`): it stands
    still until `advance` moves it, and a wait wakes for its deadline then — and only then.

    A hang test declares a 60 s hang in microseconds of real time, and proves a wait did *not*
    time out by advancing to just short of its deadline; nothing it asserts depends on how loaded
    the machine is. Like trio's `MockClock`, but without autojump: trio jumps when its run loop
    sees every task blocked, and the runtime's waiters (event-loop tasks, worker threads) have no
    one loop that could see that, so a test says how far time moves, and `wait_for_waiters` tells
    it when the waits it means to time out are armed.

    Native code reads it too (`native_now_address`: a captured step's cross-stream waits time their
    deadline on it, `tinydist.runtime.clock.native_now`). Those waits are no Python objects to
    count, so the clock counts its native readings instead, and `wait_for_native_readings` blocks
    until there are so many (woken by the reading itself, a futex): a test knows a native wait has
    looked at the clock since it last moved.
    """

    _names = itertools.count()

    def __init__(self, start: float = 0.0) -> None:
        self._time = start
        self._changed = threading.Condition()  # guards the lists below; notified on every change
        self._alarms: list[_MockAlarm] = []  # async deadlines not yet due, in arming order
        self._blocked: list[_MockWakeup] = []  # threads in `wait`, neither released nor due
        # what native readings see: [now in ns, readings so far, threads waiting for a reading]
        self._native = np.zeros(3, np.int64)
        self._native[0] = round(start * 1e9)
        self._native_reading: Program | None = None

    def __repr__(self) -> str:
        return f"MockClock(now={self._time:g}, waiters={self.waiters})"

    def now(self) -> float:
        return self._time

    @property
    def waiters(self) -> int:
        """How many waits are armed and not yet woken: async deadlines plus blocked threads."""
        with self._changed:
            return len(self._alarms) + len(self._blocked)

    @property
    def deadlines(self) -> list[float]:
        """The deadlines of those waits, earliest first."""
        with self._changed:
            return sorted([alarm.deadline for alarm in self._alarms] + [wake.deadline for wake in self._blocked])

    def advance(self, seconds: float) -> None:
        """Move time forward by `seconds`, waking every wait whose deadline that reaches: blocked
        threads at once, async callbacks on their event loop (soon, as their timers would)."""
        if not seconds >= 0:
            raise ValueError(f"MockClock.advance({seconds!r}): time only moves forward; pass seconds >= 0")
        with self._changed:
            self._time += seconds
            self._native[0] = round(self._time * 1e9)
            due = [alarm for alarm in self._alarms if alarm.deadline <= self._time]
            self._alarms = [alarm for alarm in self._alarms if alarm.deadline > self._time]
            self._blocked = [wake for wake in self._blocked if wake.deadline > self._time]
            self._changed.notify_all()
        for alarm in sorted(due, key=lambda alarm: alarm.deadline):  # stable: arming order within one deadline
            alarm.fire()

    def wait_for_waiters(self, count: int, timeout: float = 10.0) -> None:
        """Block until exactly `count` waits are armed (see `waiters`) — from a thread, never the
        event loop whose tasks are to arm them (async tests: `anyio.to_thread.run_sync`).
        `timeout` is real time, a guard so a test whose picture is wrong fails instead of hanging."""
        with self._changed:
            if not self._changed.wait_for(lambda: len(self._alarms) + len(self._blocked) == count, timeout):
                raise AssertionError(f"{self!r}: expected {count} armed waits, still {self.waiters} after {timeout:g}s")

    # ---- native readings ---------------------------------------------------------------------

    @property
    def native_now_address(self) -> int:
        """The address of a native `i64 now()`: this clock in nanoseconds, counted in `native_readings`
        (compiled on first use)."""
        if self._native_reading is None:
            now, readings, waiting = (f"inttoptr (i64 {self._native.ctypes.data + 8 * k} to ptr)" for k in range(3))
            name = f"td_mock_clock_now_{next(self._names)}"
            # the time is loaded before the reading is counted: a count of n means n readings are over
            lines = [f"define i64 @{name}() {{", "entry:",
                     f"  %t = load atomic i64, ptr {now} acquire, align 8",
                     f"  %r = atomicrmw add ptr {readings}, i64 1 seq_cst",
                     *futex.wake_ir(readings, waiting, str(futex.SYSCALL_ADDRESS), "reading"),
                     "  ret i64 %t", "}", ""]
            self._native_reading = native_loader.load(compile_glue("\n".join(lines)), name, [])
        return self._native_reading.address

    @property
    def native_readings(self) -> int:
        """How many times native code has read this clock."""
        return int(self._native[1])

    def wait_for_native_readings(self, count: int, timeout: float = 10.0) -> None:
        """Block until native code has read this clock `count` times in all (woken by the reading).
        `timeout` is real time, a guard as in `wait_for_waiters`."""
        try:
            futex.wait_for_count(self._native.ctypes.data + 8, count, timeout, self._native.ctypes.data + 16)
        except TimeoutError as e:
            raise AssertionError(f"{self!r}: expected {count} native readings, still {self.native_readings} "
                                 f"after {timeout:g}s") from e

    # ---- the Clock protocol (tinydist.runtime.clock) ------------------------------------------

    def call_at(self, deadline: float, callback: Callable[..., None], *args: Any) -> _MockAlarm:
        alarm = _MockAlarm(self, deadline, asyncio.get_running_loop(), callback, args)
        with self._changed:
            if deadline > self._time:
                self._alarms.append(alarm)
                self._changed.notify_all()
                return alarm
        alarm.fire()  # already due: called soon, as a timer of no delay would be
        return alarm

    def wakeup(self) -> _MockWakeup:
        return _MockWakeup(self)

    def wait(self, wakeup: Wakeup, deadline: float) -> bool:
        assert isinstance(wakeup, _MockWakeup) and wakeup.clock is self, "a wake-up from another clock"
        with self._changed:
            if deadline <= self._time:
                return False
            if wakeup.released:
                return True
            wakeup.deadline = deadline
            self._blocked.append(wakeup)
            self._changed.notify_all()
            try:
                while wakeup in self._blocked:  # a release or `advance` past the deadline takes it off
                    self._changed.wait()
            finally:
                if wakeup in self._blocked:  # interrupted
                    self._blocked.remove(wakeup)
                    self._changed.notify_all()
            return wakeup.released


class _MockAlarm:
    """An async deadline armed on a `MockClock`: its callback goes to the loop that armed it."""

    __slots__ = ("args", "callback", "clock", "deadline", "loop")

    def __init__(self, clock: MockClock, deadline: float, loop: asyncio.AbstractEventLoop,
                 callback: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.clock = clock
        self.deadline = deadline
        self.loop = loop
        self.callback = callback
        self.args = args

    def cancel(self) -> None:
        with self.clock._changed:
            if self in self.clock._alarms:
                self.clock._alarms.remove(self)
                self.clock._changed.notify_all()

    def fire(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.callback, *self.args)
        except RuntimeError:
            pass  # that event loop is closed: nobody is left to wake


class _MockWakeup:
    """A blocked thread's wake-up on a `MockClock`."""

    __slots__ = ("clock", "deadline", "released")

    def __init__(self, clock: MockClock) -> None:
        self.clock = clock
        self.deadline = 0.0
        self.released = False

    def release(self) -> None:
        with self.clock._changed:
            self.released = True
            if self in self.clock._blocked:
                self.clock._blocked.remove(self)
            self.clock._changed.notify_all()


SPIN_WORDS = 3  # a spin kernel's `spins`: [iterations, threads waiting on them, libc's syscall address]


def spin_until_ir(name: str, publishes_progress: bool) -> str:
    """`void name(i64* flag, i64* spins)`: count iterations into `spins[0]` until `flag[0]` is
    non-zero — a kernel that runs exactly as long as a test wants. With `publishes_progress` it
    stores each iteration into its progress word (`tinydist.codegen.progress`) as a generated
    kernel does; without, it is a stuck kernel to the hang rule. `spins` is SPIN_WORDS long, set
    up by `prepare_spins`; while a thread waits in `wait_for_spins`, each iteration wakes it."""
    publish = (f"  store atomic i64 %next, ptr @{name}_progress monotonic, align 8\n" if publishes_progress else "")
    word = f"@{name}_progress = global i64 0, align 64\n" if publishes_progress else ""
    wake = "\n".join(futex.wake_ir("%spins", "%waitingp", "%syscall", "watched"))
    return f"""{word}
define void @{name}(ptr noalias %flag, ptr noalias %spins) {{
entry:
  %waitingp = getelementptr i64, ptr %spins, i64 1
  %syscallp = getelementptr i64, ptr %spins, i64 2
  %syscall = load i64, ptr %syscallp, align 8
  br label %loop
loop:
  %i = phi i64 [0, %entry], [%next, %watched_done]
  %next = add i64 %i, 1
  store atomic i64 %next, ptr %spins seq_cst, align 8
{publish}{wake}
  %stop = load atomic i64, ptr %flag monotonic, align 8
  %done = icmp ne i64 %stop, 0
  br i1 %done, label %exit, label %loop
exit:
  ret void
}}
"""


def prepare_spins(address: int) -> None:
    """Set up the SPIN_WORDS int64 words at `address` as a spin kernel's `spins` (none counted yet)."""
    words = (ctypes.c_int64 * SPIN_WORDS).from_address(address)
    words[0], words[1], words[2] = 0, 0, futex.SYSCALL_ADDRESS


def spin_count(address: int) -> int:
    """The iterations a spin kernel counted into the `spins` at `address`."""
    return ctypes.c_int64.from_address(address).value


def wait_for_spins(address: int, count: int, timeout: float = 20.0) -> int:
    """Block until the spin kernel on the `spins` at `address` has counted `count` iterations (it
    wakes this thread; no polling); returns the count. `timeout` is a real-time guard."""
    return futex.wait_for_count(address, count, timeout, address + 8)


def process_resources() -> dict[str, float]:
    """This process's RSS (MiB), open file descriptors, threads and memory mappings, from /proc."""
    with open("/proc/self/status") as file:
        status = dict(line.split(":", 1) for line in file if ":" in line)
    with open("/proc/self/maps") as maps:
        mappings = sum(1 for _ in maps)
    return {"rss_mib": int(status["VmRSS"].split()[0]) / 1024, "fds": len(os.listdir("/proc/self/fd")),
            "threads": int(status["Threads"]), "mappings": mappings}
