"""The streaming copy realize uses for copies bigger than the last-level cache."""

from __future__ import annotations

import numpy as np
import pytest

from tinydist.codegen.compile_cache import CompileCache
from tinydist.codegen.compiler import HostCompiler
from tinydist.codegen.copy import SIGNATURE, stream_copy_ir
from tinydist.runtime.cpu.loader import native_loader


@pytest.fixture(scope="module")
def stream_copy():
    name = "test_stream_copy"
    return native_loader.load(CompileCache(HostCompiler()).compile(stream_copy_ir(name)), name, SIGNATURE).cfunc


@pytest.mark.parametrize("nbytes", [0, 1, 63, 64, 65, 127, 200, 4099, (1 << 20) + 5])
@pytest.mark.parametrize("dst_offset", [0, 1, 7, 63])
def test_copies_exactly_the_bytes_at_any_alignment(stream_copy, nbytes: int, dst_offset: int) -> None:
    rng = np.random.default_rng(nbytes + dst_offset)
    src = rng.integers(0, 256, nbytes + 128, dtype=np.uint8)
    dst = np.zeros(nbytes + 128, np.uint8)
    stream_copy(dst.ctypes.data + dst_offset, src.ctypes.data + 3, nbytes)  # a misaligned source too
    np.testing.assert_array_equal(dst[dst_offset:dst_offset + nbytes], src[3:3 + nbytes])
    assert not dst[:dst_offset].any() and not dst[dst_offset + nbytes:].any()  # nothing outside
