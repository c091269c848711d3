"""Helpers shared by the runtime tests: test kernels, a queue gate, mock-clock steps."""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

from tinydist.testing import MockClock, scale_ir, spin_ir

# out[i] = a * in[i]  (float32)
SCALE_IR = scale_ir("rt_scale_f32")

# x[i] <- iterate `iters` times: x = x * 0.75 + 1.0  (float64, one dependent chain per element)
SPIN_IR = spin_ir("rt_spin_f64")


# The same chain on x[0], bracketed by two readings of CLOCK_MONOTONIC taken *inside* the native
# code (through a clock_gettime pointer passed in): times[0] = start, times[1] = end, in ns.
# Queue timings are taken in Python around a batch, so they overlap even when kernels serialise on
# the GIL; these prove the kernels themselves ran at the same time.
TIMED_SPIN_IR = """
define internal i64 @rt_now_ns(ptr %clock, ptr %ts) {
entry:
  %c = call i32 %clock(i32 1, ptr %ts)
  %sec = load i64, ptr %ts
  %pn = getelementptr inbounds i64, ptr %ts, i64 1
  %nsec = load i64, ptr %pn
  %sns = mul i64 %sec, 1000000000
  %t = add i64 %sns, %nsec
  ret i64 %t
}

define void @rt_spin_timed(ptr %x, ptr noalias %times, i64 %iters, i64 %clock_address) {
entry:
  %clock = inttoptr i64 %clock_address to ptr
  %ts = alloca [2 x i64], align 8
  %start = call i64 @rt_now_ns(ptr %clock, ptr %ts)
  store i64 %start, ptr %times
  %x0 = load double, ptr %x
  %noiter = icmp eq i64 %iters, 0
  br i1 %noiter, label %done, label %loop
loop:
  %k = phi i64 [0, %entry], [%knext, %loop]
  %acc = phi double [%x0, %entry], [%acc2, %loop]
  %m = fmul double %acc, 7.500000e-01
  %acc2 = fadd double %m, 1.000000e+00
  %knext = add nuw i64 %k, 1
  %kdone = icmp eq i64 %knext, %iters
  br i1 %kdone, label %done, label %loop
done:
  %res = phi double [%x0, %entry], [%acc2, %loop]
  store double %res, ptr %x
  %end = call i64 @rt_now_ns(ptr %clock, ptr %ts)
  %pend = getelementptr inbounds i64, ptr %times, i64 1
  store i64 %end, ptr %pend
  ret void
}
"""


def clock_gettime_address() -> int:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    return ctypes.cast(libc.clock_gettime, ctypes.c_void_p).value


def spin_reference(x: float, iters: int) -> float:
    for _ in range(iters):
        x = x * 0.75 + 1.0
    return x


@dataclass(frozen=True)
class Kernels:
    scale: bytes
    spin: bytes
    timed_spin: bytes


class Gate:
    """A command that blocks a queue's worker until released: `queue.submit([gate.command])`."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.entered = threading.Event()

    def _block(self) -> None:
        self.entered.set()
        if not self.event.wait(60):  # bounded: a forgotten gate must not hang the suite
            raise RuntimeError("gate was never opened")

    @property
    def command(self) -> tuple[Callable[[], None], tuple[()]]:
        return (self._block, ())

    def open(self) -> None:
        self.event.set()


async def armed(clock: MockClock, waiters: int) -> None:
    """Return once exactly `waiters` waits are armed on `clock`; the event loop keeps running
    meanwhile, so its tasks can arm theirs."""
    await anyio.to_thread.run_sync(clock.wait_for_waiters, waiters)


async def advance_once_armed(clock: MockClock, waiters: int, seconds: float) -> None:
    """Once `waiters` waits are armed on `clock`, move it `seconds` forward (a task beside a wait)."""
    await armed(clock, waiters)
    clock.advance(seconds)


class HostMemory:
    """Records every block an allocator maps from and gives back to the host."""

    def __init__(self, allocator: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.mapped: list[tuple[int, int]] = []
        self.unmapped: list[tuple[int, int]] = []
        real_map, real_unmap = allocator._map, allocator._unmap

        def mapping(nbytes: int) -> int:
            address = real_map(nbytes)
            self.mapped.append((address, nbytes))
            return address

        def unmapping(address: int, nbytes: int) -> None:
            self.unmapped.append((address, nbytes))
            real_unmap(address, nbytes)

        monkeypatch.setattr(allocator, "_map", mapping)
        monkeypatch.setattr(allocator, "_unmap", unmapping)

    def all_returned(self) -> bool:
        return sorted(self.mapped) == sorted(self.unmapped)
