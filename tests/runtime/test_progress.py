"""The hang rule counts kernel progress: a kernel longer than the timeout finishes, a stuck one is caught.

Time is a `MockClock`: "longer than the timeout" is ten 60 s deadlines passed while the kernel
runs, in milliseconds of real time. A test moves the clock only once it has seen the kernel's
progress word change after the watchdog last read it, so no outcome depends on machine speed.
Nothing sleeps: a test waits for a kernel's iterations and for a worker's parking on futexes the
kernel and the parking handler wake (`tinydist.testing.wait_for_spins`, `containment.wait_for_parked`);
one child process keeps a real deadline, since what it proves is the exit in real time.
"""

from __future__ import annotations

import ctypes
import threading
import time

import anyio
import numpy as np
import pytest

from tinydist.base.errors import DeviceHang
from tinydist.codegen.compile_cache import compile_kernel
from tinydist.codegen.matmul_tiling import DEFAULT_TILINGS, workspace_bytes
from tinydist.graph import dtypes
from tinydist.runtime.cpu import containment
from tinydist.runtime.device import DeviceState
from tinydist.runtime.registry import open_device
from tinydist.testing import SPIN_WORDS, MockClock, prepare_spins, spin_count, spin_until_ir, wait_for_spins

from .helpers import armed

pytestmark = pytest.mark.anyio

TIMEOUT = 60.0


def _word(address: int) -> int:
    return ctypes.c_int64.from_address(address).value


def _paused(thread: threading.Thread) -> bool:
    """Whether `thread` is blocked in `pause()` (x86-64 system call 34, /proc/<tid>/syscall), where
    the parking handler leaves it. Read until it is, bounded: a thread the handler counted as
    parked is a few instructions short of that call, and no event marks its arrival."""
    guard = time.monotonic() + 20
    while time.monotonic() < guard:
        with open(f"/proc/self/task/{thread.native_id}/syscall") as file:
            if file.read().split()[0] == "34":
                return True
    return False


def _spins(dev) -> tuple:
    """A spin kernel's stop flag (down) and its `spins` words, on `dev`."""
    flag, spins = dev.allocator.alloc(8), dev.allocator.alloc(8 * SPIN_WORDS)
    ctypes.c_int64.from_address(flag.address).value = 0
    prepare_spins(spins.address)
    return flag, spins


def _spin_kernel(dev, name: str, publishes: bool):
    return dev.load_program(compile_kernel(spin_until_ir(name, publishes)), name, ["r", "w"])


async def test_a_kernel_longer_than_the_timeout_completes_while_it_publishes_progress(clock: MockClock) -> None:
    async with open_device("CPU:2", clock=clock) as dev:
        kernel = _spin_kernel(dev, "hang_test_spin_publishing", publishes=True)
        assert kernel.progress, "the kernel's progress word was not found"
        flag, spins = _spins(dev)
        with dev.batch() as batch:
            batch.launch(kernel, flag, spins)
        outcome: list[BaseException | None] = []

        async def waiter() -> None:
            try:
                await batch.completion.wait(timeout=TIMEOUT)
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 - asserted below
                outcome.append(exc)

        try:
            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(waiter)
                    for _ in range(10):
                        await armed(clock, 1)  # re-armed: the watchdog has read the words for the last deadline
                        seen = _word(kernel.progress)
                        # it stores the count, then its progress word: a count two past `seen` means the word moved
                        await anyio.to_thread.run_sync(wait_for_spins, spins.address, seen + 2)
                        assert _word(kernel.progress) > seen
                        clock.advance(TIMEOUT)
                    await armed(clock, 1)
                    assert outcome == [] and dev.state is DeviceState.OPEN
                    assert clock.now() == 10 * TIMEOUT  # ten timeouts long, still running, not declared hung
                    ctypes.c_int64.from_address(flag.address).value = 1
        finally:
            ctypes.c_int64.from_address(flag.address).value = 1  # a failed assertion must not leave it spinning
        assert outcome == [None]
        assert dev.state is DeviceState.OPEN and dev.failure is None
        assert spin_count(spins.address) > 10


async def test_a_stuck_kernel_is_declared_hung_within_two_timeouts(clock: MockClock) -> None:
    """A kernel that publishes nothing is stuck to the hang rule; the device had run a generated
    kernel before, whose progress the first deadline's reading is the first to see."""
    async with open_device("CPU:3", clock=clock) as dev:
        matmul = dev.compiler.matmul(dtypes.float32)
        M, K, N = 100, 8, 8  # 100 rows: two or more MC-row outer blocks
        blocks = -(-M // DEFAULT_TILINGS["float32"].mc)
        a = np.arange(M * K, dtype=np.float32).reshape(M, K) / 100
        b = np.arange(K * N, dtype=np.float32).reshape(K, N) / 10
        A, B, C = dev.allocator.alloc(a.nbytes), dev.allocator.alloc(b.nbytes), dev.allocator.alloc(M * N * 4)
        W = dev.allocator.alloc(workspace_bytes(M, N, K))
        await dev.copyin(A, a).wait()
        await dev.copyin(B, b).wait()
        before = _word(matmul.progress)
        with dev.batch() as batch:
            batch.launch(matmul, C, A, B, W, 1, M, N, K, 0, 0, 0)
        await batch.completion.wait(timeout=TIMEOUT)
        assert _word(matmul.progress) == before + blocks  # one publication per outer block
        c = (await dev.copyout(C)).view(np.float32).reshape(M, N)
        np.testing.assert_allclose(c, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5)

        stuck = _spin_kernel(dev, "hang_test_spin_silent", publishes=False)
        assert stuck.progress == 0
        flag, spins = _spins(dev)
        parked = containment.parked()
        with dev.batch() as batch:
            batch.launch(stuck, flag, spins)
        try:
            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    async def advance_twice() -> None:
                        await armed(clock, 1)
                        await anyio.to_thread.run_sync(wait_for_spins, spins.address, 1)  # it runs
                        clock.advance(TIMEOUT)  # first deadline: credits the matmul's earlier progress
                        await armed(clock, 1)
                        assert dev.state is DeviceState.OPEN
                        clock.advance(TIMEOUT)  # second: nothing moved in a whole timeout
                    tg.start_soon(advance_twice)
                    with pytest.raises(DeviceHang, match=r"no kernel of its device published progress") as info:
                        await batch.completion.wait(timeout=TIMEOUT)
            assert dev.state is DeviceState.FAILED and dev.failure is info.value
            assert clock.now() == 2 * TIMEOUT
            assert "Engine.reopen" in str(info.value)
            # contained: the stuck worker parked in its signal handler (which never returns into the
            # loop) and asleep there
            worker = dev.queues["compute"].worker
            await anyio.to_thread.run_sync(containment.wait_for_parked, parked + 1)
            assert containment.parked() == parked + 1 and _paused(worker)
        finally:
            ctypes.c_int64.from_address(flag.address).value = 1  # let the stuck worker go


async def test_a_big_kernel_publishes_once_per_block_and_a_small_one_not_at_all() -> None:
    """The elementwise lowering strip-mines its outermost loop into blocks of about 2**20
    elements and stores each block's index: the word ends at the last block's."""
    from tinydist.codegen.kernel import KernelAST, KNode, load
    from tinydist.codegen.lowering import lower
    from tinydist.graph.shape import ShapeTracker, View

    def kernel(rows: int) -> KernelAST:
        x = load(0, ShapeTracker.contiguous((rows, 3)), dtypes.float32)
        row = load(1, ShapeTracker((View.create((rows, 3), (0, 1)),)), dtypes.float32)  # not collapsible
        return KernelAST((rows, 3), (), KNode("add", (x, row), None, dtypes.float32), (dtypes.float32,) * 2, dtypes.float32)

    assert "store atomic" not in lower(kernel(1000))[1]  # 3,000 elements: done before anyone could look
    rows = (1 << 20) + 3  # 3 elements a row: blocks of 2**18 rows, five of them, the last 3 rows long
    async with open_device("CPU:2") as dev:
        program = dev.compiler.kernel(kernel(rows))
        assert program.progress
        x = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
        row = np.array([[1, 2, 3]], np.float32)
        X, R, out = dev.allocator.alloc(x.nbytes), dev.allocator.alloc(row.nbytes), dev.allocator.alloc(x.nbytes)
        await dev.copyin(X, x).wait()
        await dev.copyin(R, row).wait()
        with dev.batch() as batch:
            batch.launch(program, out, X, R)
        await batch.completion.wait()
        np.testing.assert_array_equal((await dev.copyout(out)).view(np.float32).reshape(rows, 3), x + row)
        assert _word(program.progress) == 4


_AFTER_A_HANG = """
import ctypes
import numpy as np
import tinydist as td
from tinydist.runtime.cpu import containment
from tinydist.base.errors import DeviceHang
from tinydist.codegen.compile_cache import compile_kernel
from tinydist.runtime.device import KEPT_FOR_STUCK_WORKERS
from tinydist.runtime.engine import get_engine
from tinydist.testing import SPIN_WORDS, prepare_spins, spin_count, spin_until_ir, wait_for_spins

engine = get_engine()
dev = engine.device("CPU:1")
kernel = dev.load_program(compile_kernel(spin_until_ir("exit_test_spin", False)), "exit_test_spin", ["r", "w"])
flag, spins = dev.allocator.alloc(8), dev.allocator.alloc(8 * SPIN_WORDS)
ctypes.c_int64.from_address(flag.address).value = 0
prepare_spins(spins.address)
with dev.batch() as batch:
    batch.launch(kernel, flag, spins)
try:
    batch.completion.wait_blocking(timeout=0.5)  # this wait's own deadline; the setting stays at an hour
except DeviceHang as hang:
    print("hang:", hang)
worker = dev.queues["compute"].worker
if containment.SUPPORTED:
    containment.wait_for_parked(1)  # woken by the parking itself
    print("stuck worker parked:", containment.parked())
else:  # left running: it keeps counting
    print("stuck worker running:", wait_for_spins(spins.address, spin_count(spins.address) + 1) > 0)
fresh = engine.reopen("CPU:1")
print("reopened:", fresh is not dev, fresh.state.value, "kept:", KEPT_FOR_STUCK_WORKERS["CPU:1"] > 0)
print("later work:", td.Tensor(np.arange(6, dtype=np.float32), device="CPU:1").sum().item())
"""


def test_after_a_real_hang_the_device_reopens_and_the_process_exits_without_another_timeout() -> None:
    """Real time in a child process: its hang deadline is 0.5 s, TINYDIST_TIMELINE_TIMEOUT an
    hour — closing the hung device at reopen and at exit waiting that timeout would outlast the
    two-minute bound below by far. The stuck kernel never returns; the process exits regardless."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TINYDIST_TIMELINE_TIMEOUT": "3600"}
    done = subprocess.run([sys.executable, "-c", _AFTER_A_HANG], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("hang: timeline CPU:1/compute stayed at 0") and "no kernel" in lines[0], done.stdout
    assert lines[1] == ("stuck worker parked: 1" if containment.SUPPORTED else "stuck worker running: True"), done.stdout
    assert lines[2] == "reopened: True open kept: True", done.stdout
    assert lines[3] == "later work: 15.0", done.stdout


@pytest.mark.skipif(not containment.SUPPORTED, reason="parking reads the interrupted address on x86-64 Linux only")
def test_the_park_signal_parks_jit_code_and_never_python_or_libc() -> None:
    """The handler's own rule, signalled by hand: a thread interrupted in the interpreter or libc
    (it may hold the GIL or a lock) returns from it, however often; one in a JIT kernel sleeps."""
    release, ran = threading.Event(), threading.Event()
    parked = containment.parked()
    rounds, after = [0], [1 << 62]  # `ran` is set by the first round past `after`

    def python_and_libc() -> None:
        while not release.is_set():
            ctypes.memmove(bytes(64), b"x" * 64, 64)  # libc, the GIL released around it
            rounds[0] += 1
            if rounds[0] > after[0]:
                ran.set()

    thread = threading.Thread(target=python_and_libc, daemon=True)
    thread.start()
    try:
        for _ in range(200):
            containment.signal_to_park(thread)
        after[0] = rounds[0]
        # a round begun after the signals: it returned to user space, so it took every one of them
        assert ran.wait(20), "a thread running Python was parked"
        assert containment.parked() == parked
    finally:
        release.set()
    thread.join(20)
    assert not thread.is_alive()

    kernel = _native_spin("park_test_spin")
    flag, spins = ctypes.c_int64(0), (ctypes.c_int64 * SPIN_WORDS)()
    prepare_spins(ctypes.addressof(spins))
    spinner = threading.Thread(target=kernel.cfunc, args=(ctypes.addressof(flag), ctypes.addressof(spins)), daemon=True)
    spinner.start()
    wait_for_spins(ctypes.addressof(spins), 1)
    for _ in range(100):  # a signal landing in the ctypes call around the kernel, not in it, is returned from
        containment.signal_to_park(spinner)
        try:
            containment.wait_for_parked(parked + 1, timeout=1)
            break
        except TimeoutError:
            continue
    assert containment.parked() == parked + 1 and _paused(spinner) and spinner.is_alive()
    # asleep for good in the handler's parking branch: it never reads `flag` again


def _native_spin(name: str):
    from tinydist.runtime.cpu.loader import native_loader
    return native_loader.load(compile_kernel(spin_until_ir(name, False)), name, ["r", "w"])


@pytest.mark.parametrize("shape, other", [(((1 << 24) + 17,), ((1 << 24) + 17,)), (((1 << 20) + 3, 3), (1, 3))])
def test_strip_mined_outer_loops_compute_every_element(shape: tuple[int, ...], other: tuple[int, ...]) -> None:
    """Big kernels run their outermost loop in blocks (the last one short here): every element
    is computed once, as numpy computes it."""
    import tinydist as td

    rng = np.random.default_rng(7)
    a = rng.standard_normal(shape, dtype=np.float32)
    b = rng.standard_normal(other, dtype=np.float32)
    got = (td.Tensor(a) * td.Tensor(b)).numpy()
    np.testing.assert_array_equal(got, a * b)  # one rounding each side: bit-equal
    total = td.Tensor(a).sum().numpy()
    np.testing.assert_allclose(total, a.astype(np.float64).sum(), rtol=1e-5)
