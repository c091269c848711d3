"""Containing a worker thread the hang rule found stuck: it stops burning a core, for good.

A thread cannot be killed in-process, and a native loop that publishes no progress never returns
on its own. So the hung queue's worker, if it is running (state R in /proc/self/task/<tid>/stat),
is sent one real-time signal whose handler — native code, installed once with `sigaction` — parks
it in `pause()` forever, but only where the signal interrupted code that is in no file the
process mapped: JIT-loaded kernels and glue. Interrupted in the interpreter, libc or any other
library (a memmove, a lock, Python bytecode), the handler returns at once: a thread parked there
could hold the GIL or a lock every other thread needs. A thread blocked in a wait (state S)
already burns nothing and is not signalled. The parked thread never touches memory again; its
device keeps that memory mapped until exit (`Device.aclose`), and the process exits past it (the
workers are daemon threads). x86-64 Linux only (where the interrupted address is read from the
signal's context); elsewhere a stuck worker is left running, as before. The handler counts the
threads it parks and wakes whoever waits for that count (`wait_for_parked`): tests, instead of
watching a thread's state until it changes.
"""

from __future__ import annotations

import ctypes
import functools
import platform
import signal
import threading

import numpy as np

from tinydist.codegen.compile_cache import compile_glue
from tinydist.runtime.cpu import futex
from tinydist.runtime.cpu.loader import native_loader
from tinydist.runtime.program import Program

# glibc keeps the first two real-time signals; one well above them, unused by Python
PARK_SIGNAL = signal.SIGRTMIN + 9
SUPPORTED = platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")

_HANDLER = "td_park_stuck_worker"
_RIP_OFFSET = 168          # offsetof(ucontext_t, uc_mcontext.gregs[REG_RIP]), x86-64 glibc
_SA_SIGINFO, _SA_RESTART = 4, 0x10000000
_MAX_RANGES = 4096
# [count, lo0, hi0, lo1, hi1, ...]: the executable mappings backed by a file (or the kernel's
# [vdso]); refreshed before each signal, read by the handler
_mapped_code = np.zeros(1 + 2 * _MAX_RANGES, np.uint64)
# how many threads the handler has parked: raised, and its futex woken, as a thread commits to
# parking (once per hang, so the wake costs nothing anywhere else), for `wait_for_parked`
_parked = np.zeros(1, np.int64)


class _SigAction(ctypes.Structure):
    _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_ulong * 16), ("flags", ctypes.c_int),
                ("restorer", ctypes.c_void_p)]


def _handler_ir(holds_gil: int, pause: int, table: int, parked: int) -> str:
    wake = "\n".join(futex.wake_ir(f"inttoptr (i64 {parked} to ptr)", None, str(futex.SYSCALL_ADDRESS), "parked"))
    return f"""
define void @{_HANDLER}(i32 %signal, ptr %info, ptr %context) {{
entry:
  %pc_at = getelementptr i8, ptr %context, i64 {_RIP_OFFSET}
  %pc = load i64, ptr %pc_at
  %table = inttoptr i64 {table} to ptr
  %count = load atomic i64, ptr %table acquire, align 8
  %none = icmp eq i64 %count, 0
  br i1 %none, label %python, label %scan
scan:
  %i = phi i64 [0, %entry], [%next, %outside]
  %lo_at = getelementptr i64, ptr %table, i64 %i
  %lo_slot = getelementptr i64, ptr %lo_at, i64 1
  %hi_slot = getelementptr i64, ptr %lo_at, i64 2
  %lo = load i64, ptr %lo_slot
  %hi = load i64, ptr %hi_slot
  %above = icmp uge i64 %pc, %lo
  %below = icmp ult i64 %pc, %hi
  %inside = and i1 %above, %below
  br i1 %inside, label %back, label %outside
outside:
  %next = add i64 %i, 2
  %end = shl i64 %count, 1
  %done = icmp uge i64 %next, %end
  br i1 %done, label %python, label %scan
python:
  %held = call i32 inttoptr (i64 {holds_gil} to ptr)()
  %holding = icmp ne i32 %held, 0
  br i1 %holding, label %back, label %park
park:
  %parked_before = atomicrmw add ptr inttoptr (i64 {parked} to ptr), i64 1 seq_cst
{wake}
  br label %asleep
asleep:
  %woken = call i32 inttoptr (i64 {pause} to ptr)()
  br label %asleep
back:
  ret void
}}
"""


@functools.cache
def _install() -> Program:
    """Install the parking handler for PARK_SIGNAL (once). Returns its program, which the cache
    keeps for the life of the process: the kernel holds only the handler's address, and code whose
    last holder goes is unloaded (the next signal would jump into unmapped memory)."""
    libc = ctypes.CDLL(None, use_errno=True)  # the process's own symbols, libc's among them (find_library runs ldconfig: ~12 ms)
    pause = ctypes.cast(libc.pause, ctypes.c_void_p).value
    holds_gil = ctypes.cast(ctypes.pythonapi.PyGILState_Check, ctypes.c_void_p).value
    assert pause and holds_gil
    ir = _handler_ir(holds_gil, pause, _mapped_code.ctypes.data, _parked.ctypes.data)
    program = native_loader.load(compile_glue(ir), _HANDLER, ["i64", "i64", "i64"])
    action = _SigAction(program.address, (ctypes.c_ulong * 16)(), _SA_SIGINFO | _SA_RESTART, None)
    sigaction = libc.sigaction
    sigaction.argtypes = [ctypes.c_int, ctypes.POINTER(_SigAction), ctypes.c_void_p]
    if sigaction(int(PARK_SIGNAL), ctypes.byref(action), None) != 0:
        raise OSError(ctypes.get_errno(), f"installing the handler for signal {int(PARK_SIGNAL)} failed")
    return program


def _refresh_mapped_code() -> None:
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and "x" in fields[1] and fields[5].strip():
                lo, hi = fields[0].split("-")
                ranges += [int(lo, 16), int(hi, 16)]
    count = min(len(ranges) // 2, _MAX_RANGES)
    _mapped_code[1:1 + 2 * count] = ranges[:2 * count]
    _mapped_code[0] = count


def thread_state(thread: threading.Thread) -> str | None:
    """The kernel's one-letter state of `thread` (R running, S sleeping, ...); None once it is gone."""
    try:
        with open(f"/proc/self/task/{thread.native_id}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def parked() -> int:
    """How many threads the parking handler has parked in this process."""
    return int(_parked[0])


def wait_for_parked(count: int, timeout: float = 10.0) -> None:
    """Block until the handler has parked `count` threads in all, woken by the parking itself.
    A thread counted is in the handler's parking branch, which never returns into the code it
    interrupted; it enters `pause()` right after. `timeout` is a guard in real time (TimeoutError)."""
    futex.wait_for_count(_parked.ctypes.data, count, timeout)


def park_if_running(thread: threading.Thread) -> bool:
    """Signal `thread` to park if it is running (see the module docstring); whether it was signalled."""
    if not SUPPORTED or thread.ident is None or not thread.is_alive() or thread_state(thread) != "R":
        return False
    signal_to_park(thread)
    return True


def signal_to_park(thread: threading.Thread) -> None:
    """Send `thread` the parking signal, whatever it is doing: its handler decides (x86-64 Linux)."""
    assert SUPPORTED and thread.ident is not None
    _install()
    _refresh_mapped_code()
    signal.pthread_kill(thread.ident, PARK_SIGNAL)
