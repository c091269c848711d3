"""Fixtures for the runtime suite: the anyio backend, a mock clock, compiled test kernels, open devices."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator

import pytest

from tinydist.codegen.compile_cache import CompileCache
from tinydist.codegen.compiler import HostCompiler
from tinydist.runtime.device import Device
from tinydist.runtime.registry import open_device
from tinydist.testing import MockClock

from .helpers import SCALE_IR, SPIN_IR, TIMED_SPIN_IR, Gate, Kernels


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def clock() -> MockClock:
    """Virtual time at 0 that moves only when the test advances it."""
    return MockClock()


@pytest.fixture(scope="session")
def kernels() -> Kernels:
    cache = CompileCache(HostCompiler())
    return Kernels(scale=cache.compile(SCALE_IR), spin=cache.compile(SPIN_IR), timed_spin=cache.compile(TIMED_SPIN_IR))


@pytest.fixture
def gates() -> Iterator[list[Gate]]:
    """Every gate a test made; opened at teardown so no worker stays blocked."""
    made: list[Gate] = []
    yield made
    for g in made:
        g.open()


@pytest.fixture
def gate(gates: list[Gate]) -> Callable[[], Gate]:
    """A factory of gates: `g = gate(); queue.submit([g.command])` blocks that queue until `g.open()`."""

    def make() -> Gate:
        g = Gate()
        gates.append(g)
        return g

    return make


@contextlib.asynccontextmanager
async def _open_checked(name: str, gates: list[Gate], clock: MockClock) -> AsyncIterator[Device]:
    dev = open_device(name, clock=clock)
    await dev.open()
    try:
        yield dev
    finally:
        for g in gates:  # a test that failed half way must not leave the worker blocked
            g.open()
        await dev.aclose()


@pytest.fixture
async def cpu(gates: list[Gate], clock: MockClock) -> AsyncIterator[Device]:
    """An open CPU:0 on the test's `clock`, closed after the test (after opening any gate the test left shut)."""
    async with _open_checked("CPU:0", gates, clock) as dev:
        yield dev


@pytest.fixture
async def cpu1(gates: list[Gate], clock: MockClock) -> AsyncIterator[Device]:
    """An open CPU:1 on the test's `clock`, closed after the test."""
    async with _open_checked("CPU:1", gates, clock) as dev:
        yield dev
