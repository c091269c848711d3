"""Native cross-stream waits and signals: ordering, per-replay argument rows, timeout and abort."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable

import numpy as np

from tinydist.codegen.compiler import HostCompiler
from tinydist.codegen.stream_sync import ABORTED, OK, TIMED_OUT, Part, Slot, Wait, step_function_ir
from tinydist.runtime.cpu.loader import native_loader
from tinydist.runtime.cpu.stream_control import ControlBlock, native_address

RING = 4
_compiler = HostCompiler(opt_level=1)


def _until(predicate: Callable[[], bool], what: str) -> None:
    """Bounded polling for a state with no event (a stream going to sleep on a counter)."""
    deadline = time.monotonic() + 10
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def _two_streams(name: str, timeout_ns: int, kernel_words: list[int] | None = None
                 ) -> tuple[ControlBlock, np.ndarray, np.ndarray, list]:
    """Stream 0 copies the replay's source (a per-replay row slot) into out[0]; stream 1 waits for
    that, then copies out[0] into out[1]. `rows` is the ring of argument rows, then its ready words."""
    block = ControlBlock(2)
    rows = np.zeros((RING + 1, RING), np.int64)
    ready = rows[RING]
    out = np.zeros(2, np.int64)
    memmove = native_address(ctypes.memmove)
    assert memmove is not None
    parts = ([Part((), ((memmove, (out.ctypes.data, Slot(0), 8)),))],
             [Part((Wait(0, 0, 0),), ((memmove, (out.ctypes.data + 8, out.ctypes.data, 8)),))])
    steps = []
    for s, stream_parts in enumerate(parts):
        entry = f"{name}_{s}"
        ir = step_function_ir(entry, block, s, stream_parts, [1, 1], rows.ctypes.data, RING, RING, ready.ctypes.data,
                              timeout_ns, 10**9, kernel_words)
        steps.append(native_loader.load(_compiler.compile(ir), entry, []).cfunc)
    return block, rows, out, steps


def test_a_stream_sleeps_until_the_part_it_needs_and_each_replay_reads_its_own_row() -> None:
    block, rows, out, (first, second) = _two_streams("sync_order", 10**10)
    sources = np.arange(100, 110, dtype=np.int64)
    for replay in range(2 * RING + 1):  # the ring of rows wraps around twice
        rows[replay % RING, 0] = sources[replay:].ctypes.data
        waiter = threading.Thread(target=second)
        waiter.start()
        _until(lambda: block.word(0, block.SLEEPERS) == 1, "stream 1 to sleep on stream 0's counter")
        first()
        waiter.join(10)
        assert not waiter.is_alive()
        assert out.tolist() == [100 + replay, 100 + replay]
        assert [block.word(s, block.PROGRESS) for s in (0, 1)] == [replay + 1, replay + 1]
        assert [block.word(s, block.STATUS) for s in (0, 1)] == [OK, OK]
    assert block.word(0, block.SLEEPERS) == 0 and not block.aborted


def test_a_call_runs_the_queued_replays_after_its_own_and_their_calls_return_at_once() -> None:
    block, rows, out, (first, _) = _two_streams("sync_chain", 10**10)
    sources = np.arange(200, 210, dtype=np.int64)
    for replay in range(3):
        rows[replay, 0] = sources[replay:].ctypes.data
    rows[RING, 1], rows[RING, 2] = 2, 3  # replays 1 and 2 are queued behind replay 0
    first()
    assert out[0] == 202 and block.word(0, block.PROGRESS) == 3 and block.word(0, block.REPLAYS) == 3
    out[0] = 0
    first()
    first()  # the calls standing for replays 1 and 2: already run
    assert out[0] == 0 and block.word(0, block.PROGRESS) == 3 and block.word(0, block.CALLS) == 3
    rows[3, 0] = sources[3:].ctypes.data  # replay 3, not marked ready: its own call runs it
    first()
    assert out[0] == 203 and block.word(0, block.PROGRESS) == 4


def test_a_wait_on_a_stream_that_stands_still_gives_up_and_says_where() -> None:
    block, rows, out, (_, second) = _two_streams("sync_timeout", 50_000_000)
    second()  # stream 0 never runs its part
    assert block.word(1, block.STATUS) == TIMED_OUT
    assert (block.word(1, block.UNIT), block.word(1, block.PEER)) == (0, 0)
    assert (block.word(1, block.TARGET), block.word(1, block.SEEN)) == (1, 0)
    assert block.aborted, "a stream that gives up stops the others too"
    assert out.tolist() == [0, 0], "nothing after the failed wait ran"
    assert block.word(1, block.PROGRESS) == 0


def test_abort_wakes_a_sleeping_stream_which_runs_nothing_more() -> None:
    block, rows, out, (_, second) = _two_streams("sync_abort", 10**12)
    waiter = threading.Thread(target=second)
    waiter.start()
    _until(lambda: block.word(0, block.SLEEPERS) == 1, "stream 1 to sleep")
    block.device_failed(RuntimeError("stream 0's device failed"))
    waiter.join(10)
    assert not waiter.is_alive()
    assert block.word(1, block.STATUS) == ABORTED and out.tolist() == [0, 0]
    assert block.word(1, block.PROGRESS) == 0 and block.word(0, block.SLEEPERS) == 0


def test_a_wait_on_a_stream_whose_kernel_publishes_progress_outlasts_the_timeout() -> None:
    """Stream 0 is busy in one long kernel (a spin that publishes progress) for three of stream
    1's timeouts before its part runs: stream 1 counts the kernel's progress word and waits."""
    from tinydist.codegen.compile_cache import compile_kernel
    from tinydist.testing import spin_until_ir

    spin = native_loader.load(compile_kernel(spin_until_ir("sync_long_kernel", True)), "sync_long_kernel", ["r", "w"])
    table = np.array([1, spin.progress], np.int64)  # stream 0 runs that kernel
    silent = np.array([0], np.int64)
    block, rows, out, (first, second) = _two_streams("sync_long", 1_000_000_000, [table.ctypes.data, silent.ctypes.data])
    sources = np.array([42], np.int64)
    rows[0, 0] = sources.ctypes.data
    flag, spins = ctypes.c_int64(0), ctypes.c_int64(0)
    kernel = threading.Thread(target=spin.cfunc, args=(ctypes.addressof(flag), ctypes.addressof(spins)))
    kernel.start()
    waiter = threading.Thread(target=second)
    waiter.start()
    try:
        _until(lambda: block.word(0, block.SLEEPERS) == 1, "stream 1 to sleep on stream 0's counter")
        time.sleep(3.0)  # three timeouts of stream 1's wait, the kernel publishing all along
        assert waiter.is_alive() and block.word(1, block.STATUS) == OK and not block.aborted
    finally:
        flag.value = 1
        kernel.join(10)
    first()  # the kernel is over: stream 0's part runs
    waiter.join(10)
    assert not waiter.is_alive()
    assert block.word(1, block.STATUS) == OK and out.tolist() == [42, 42]
