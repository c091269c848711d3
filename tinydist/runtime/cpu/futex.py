"""Waiting in Python, without polling, for a count that native code raises: a futex on the count.

Native code that others may wait on (a parked worker, a MockClock's native reading, a test kernel)
raises a 64-bit count and then wakes the count's futex — always, where that happens once (parking),
or only while a waiter has said it waits (a `waiting` word it reads, where it happens in a loop).
The waiter sleeps in the kernel while the count still holds the value it last saw (the futex word
is the count's low half, little-endian) and is woken by the raise, so it returns as soon as the
count is reached and burns nothing meanwhile. The native side's order is the usual one: raise the
count, then read `waiting` (both sequentially consistent); the waiter's is the reverse, so a raise
is never missed.
"""

from __future__ import annotations

import ctypes
import threading
import time

from tinydist.codegen.stream_sync import futex_syscall

FUTEX_WAIT_PRIVATE, FUTEX_WAKE_PRIVATE = 128, 129
_libc = ctypes.CDLL(None, use_errno=True)
SYSCALL_ADDRESS = ctypes.cast(_libc.syscall, ctypes.c_void_p).value or 0
_waiting_lock = threading.Lock()  # Python's read-modify-writes of `waiting` words (native code only reads them)


def _count_at(address: int) -> int:
    return ctypes.c_int64.from_address(address).value


def _add(address: int, delta: int) -> None:
    with _waiting_lock:
        ctypes.c_int64.from_address(address).value += delta


def wait_for_count(count_address: int, count: int, timeout: float, waiting_address: int | None = None) -> int:
    """Block until the int64 at `count_address` is at least `count`; returns it. `waiting_address`
    is the int64 the raising side reads to decide whether to wake (raised here while this waits).
    `timeout` is a guard in real time: past it, TimeoutError with the value seen."""
    futex = futex_syscall()
    if futex is None:
        raise RuntimeError("wait_for_count sleeps on a futex: Linux on x86-64 or aarch64 only")
    guard = time.monotonic() + timeout
    if waiting_address is not None:
        _add(waiting_address, 1)
    try:
        while (seen := _count_at(count_address)) < count:
            left = guard - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the count at {count_address:#x} stayed at {seen} for {timeout:g}s, short of {count}")
            span = (ctypes.c_long * 2)(int(left), int(left % 1 * 1e9))
            # returns at once if the count moved since `seen` was read, else when woken (or the guard passes)
            _libc.syscall(ctypes.c_long(futex), ctypes.c_void_p(count_address), ctypes.c_long(FUTEX_WAIT_PRIVATE),
                          ctypes.c_long(seen & 0xFFFFFFFF), span)
        return seen
    finally:
        if waiting_address is not None:
            _add(waiting_address, -1)


def wake_ir(count: str, waiting: str | None, syscall: str, label: str) -> list[str]:
    """LLVM IR lines (inside a function, after the count at pointer `count` was raised by a
    sequentially consistent store or add) that wake its waiters: always without `waiting`, else
    only while the int64 at pointer `waiting` is non-zero. `syscall` is an i64 operand holding
    libc's `syscall` address; `label` prefixes the names this adds (unique per function)."""
    futex = futex_syscall()
    if futex is None:
        raise RuntimeError("wake_ir wakes a futex: Linux on x86-64 or aarch64 only")
    wake = [f"  %{label}_fn = inttoptr i64 {syscall} to ptr",
            f"  %{label}_f = call i64 (i64, ...) %{label}_fn(i64 {futex}, ptr {count}, i64 {FUTEX_WAKE_PRIVATE}, i64 2147483647)"]
    if waiting is None:
        return wake
    return [f"  %{label}_w = load atomic i64, ptr {waiting} seq_cst, align 8",
            f"  %{label}_any = icmp ne i64 %{label}_w, 0",
            f"  br i1 %{label}_any, label %{label}_wake, label %{label}_done",
            f"{label}_wake:", *wake, f"  br label %{label}_done", f"{label}_done:"]
