"""Native cross-stream waits and signals: ordering, per-replay argument rows, timeout and abort.

The waits time their deadline on a `MockClock` (its native reading, `now_address`): a test knows a
wait has looked at the clock from the clock's count of native readings, moves time by hand, and
asserts both sides of a deadline; nothing here depends on how fast the machine is.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from tinydist.codegen.compiler import HostCompiler
from tinydist.codegen.stream_sync import ABORTED, OK, TIMED_OUT, Part, Slot, Wait, step_function_ir
from tinydist.runtime.cpu.loader import native_loader
from tinydist.runtime.cpu.stream_control import ControlBlock, native_address
from tinydist.testing import MockClock

RING = 4
_compiler = HostCompiler(opt_level=1)


TIMEOUT_NS = 60 * 10**9  # on the mock clock: a minute, in no real time at all
# readings per call of stream 1: the chain's start, then its wait's start and first deadline check
FIRST_CHECK = 3


def _two_streams(name: str, timeout_ns: int, kernel_words: list[int] | None = None, clock: MockClock | None = None
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
                              timeout_ns, 10**9, kernel_words, None if clock is None else clock.native_now_address)
        steps.append(native_loader.load(_compiler.compile(ir), entry, []).cfunc)
    return block, rows, out, steps


def test_a_stream_sleeps_until_the_part_it_needs_and_each_replay_reads_its_own_row() -> None:
    clock = MockClock()
    block, rows, out, (first, second) = _two_streams("sync_order", TIMEOUT_NS, clock=clock)
    sources = np.arange(100, 110, dtype=np.int64)
    for replay in range(2 * RING + 1):  # the ring of rows wraps around twice
        rows[replay % RING, 0] = sources[replay:].ctypes.data
        readings = clock.native_readings
        waiter = threading.Thread(target=second)
        waiter.start()
        clock.wait_for_native_readings(readings + FIRST_CHECK)  # it is waiting: its first deadline check is over
        before = 0 if replay == 0 else 100 + replay - 1
        assert waiter.is_alive() and out.tolist() == [before, before], "stream 1's part ran before stream 0's"
        first()
        waiter.join(10)
        assert not waiter.is_alive()
        assert out.tolist() == [100 + replay, 100 + replay]
        assert [block.word(s, block.PROGRESS) for s in (0, 1)] == [replay + 1, replay + 1]
        assert [block.word(s, block.STATUS) for s in (0, 1)] == [OK, OK]
    assert block.word(0, block.SLEEPERS) == 0 and not block.aborted
    assert clock.now() == 0


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


def _after_a_check_on_the_time_now(clock: MockClock) -> None:
    """Once a waiting stream has checked its deadline on the time as it is now and waited on: the
    reading after the next one was taken after this call began, and one more means it was not its
    last (a wait that gives up reads the clock no more)."""
    clock.wait_for_native_readings(clock.native_readings + 3)


def test_a_wait_on_a_stream_that_stands_still_gives_up_after_the_timeout_and_says_where() -> None:
    clock = MockClock()
    block, rows, out, (_, second) = _two_streams("sync_timeout", TIMEOUT_NS, clock=clock)
    waiter = threading.Thread(target=second)  # stream 0 never runs its part
    waiter.start()
    try:
        clock.wait_for_native_readings(FIRST_CHECK)
        clock.advance(TIMEOUT_NS / 1e9)  # exactly the timeout: not over it yet
        _after_a_check_on_the_time_now(clock)
        assert waiter.is_alive() and block.word(1, block.STATUS) == OK and not block.aborted
        clock.advance(1e-6)
        waiter.join(10)
        assert not waiter.is_alive(), "the wait outlived its timeout"
    finally:
        block.abort()  # a failed assertion must not leave the wait running
        waiter.join(10)
    assert block.word(1, block.STATUS) == TIMED_OUT
    assert (block.word(1, block.UNIT), block.word(1, block.PEER)) == (0, 0)
    assert (block.word(1, block.TARGET), block.word(1, block.SEEN)) == (1, 0)
    assert block.aborted, "a stream that gives up stops the others too"
    assert out.tolist() == [0, 0], "nothing after the failed wait ran"
    assert block.word(1, block.PROGRESS) == 0


def test_abort_wakes_a_sleeping_stream_which_runs_nothing_more() -> None:
    clock = MockClock()
    block, rows, out, (_, second) = _two_streams("sync_abort", TIMEOUT_NS, clock=clock)
    waiter = threading.Thread(target=second)
    waiter.start()
    clock.wait_for_native_readings(FIRST_CHECK)
    block.device_failed(RuntimeError("stream 0's device failed"))
    waiter.join(10)
    assert not waiter.is_alive()
    assert block.word(1, block.STATUS) == ABORTED and out.tolist() == [0, 0]
    assert block.word(1, block.PROGRESS) == 0 and block.word(0, block.SLEEPERS) == 0
    assert clock.now() == 0


def test_a_wait_on_a_stream_whose_kernel_publishes_progress_outlasts_the_timeout() -> None:
    """Stream 0 is busy in one long kernel for four of stream 1's timeouts before its part runs:
    stream 1 counts the kernel's progress word (here moved by the test, as the kernel's loop would
    move it, once per timeout) and waits; counting only stream 0's counter it would give up at the
    second."""
    progress = np.zeros(1, np.int64)
    table = np.array([1, progress.ctypes.data], np.int64)  # stream 0 runs that kernel
    silent = np.array([0], np.int64)
    clock = MockClock()
    block, rows, out, (first, second) = _two_streams("sync_long", TIMEOUT_NS, [table.ctypes.data, silent.ctypes.data], clock)
    sources = np.array([42], np.int64)
    rows[0, 0] = sources.ctypes.data
    waiter = threading.Thread(target=second)
    waiter.start()
    try:
        clock.wait_for_native_readings(FIRST_CHECK)
        for _ in range(4):
            progress[0] += 1
            _after_a_check_on_the_time_now(clock)  # it has seen the kernel move: its timeout starts again
            clock.advance(TIMEOUT_NS / 1e9)
        _after_a_check_on_the_time_now(clock)
        assert waiter.is_alive() and block.word(1, block.STATUS) == OK and not block.aborted
        first()  # the kernel is over: stream 0's part runs
        waiter.join(10)
        assert not waiter.is_alive()
    finally:
        block.abort()
        waiter.join(10)
    assert block.word(1, block.STATUS) == OK and out.tolist() == [42, 42]
    assert clock.now() == 4 * TIMEOUT_NS / 1e9
