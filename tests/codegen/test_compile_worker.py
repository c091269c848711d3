"""The compile worker: the O3 pipeline in a child process, so the memory LLVM keeps of every module
it optimises (~74 KiB at O3, never freed) is not this process's (tinydist.codegen.compile_worker)."""

from __future__ import annotations

import gc
import os
import signal
import sys

import pytest

from tinydist.base.errors import CompileError
from tinydist.codegen.compile_worker import CompileWorker
from tinydist.codegen.compiler import HostCompiler
from tinydist.testing import process_resources


def kernel_ir(n: int) -> str:
    """A distinct one-loop kernel per `n`: out[i] = a[i] * 2 + n for i < n."""
    return f"""define void @k{n}(ptr noalias %o, ptr noalias %a) {{
entry:
  br label %loop
loop:
  %i = phi i64 [0, %entry], [%j, %loop]
  %p = getelementptr float, ptr %a, i64 %i
  %v = load float, ptr %p
  %w = fmul float %v, 2.0
  %x = fadd float %w, {float(n):e}
  %q = getelementptr float, ptr %o, i64 %i
  store float %x, ptr %q
  %j = add i64 %i, 1
  %c = icmp ult i64 %j, {n}
  br i1 %c, label %loop, label %done
done:
  ret void
}}
"""


@pytest.fixture
def worker():
    w = CompileWorker(recycle=3)
    yield w
    w.close()


def test_the_worker_emits_what_this_process_would(worker: CompileWorker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINYDIST_COMPILE_WORKER_AFTER", "0")     # the reference compiles here
    here = HostCompiler(opt_level=3)
    for n in (5, 1000):
        assert worker.compile(kernel_ir(n), 3) == here.compile(kernel_ir(n))


def test_the_child_is_replaced_after_recycle_compiles(worker: CompileWorker) -> None:
    pids = []
    for n in range(1, 8):
        worker.compile(kernel_ir(n), 3)
        pids.append(worker._proc.pid if worker._proc is not None else None)
    assert worker.started == 3          # 7 compiles, 3 per child
    assert pids[2] is None and pids[5] is None     # stopped right after its third
    assert len({p for p in pids if p is not None}) == 3


def test_bad_ir_is_llvms_compile_error_from_the_child(worker: CompileWorker) -> None:
    with pytest.raises(CompileError, match="LLVM rejected the kernel IR"):
        worker.compile("define void @f() { ret i32 0 }", 3)
    assert worker.compile(kernel_ir(3), 3)      # the child lives on


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals a child process")
def test_a_child_that_dies_is_a_compile_error_and_the_next_compile_starts_another(worker: CompileWorker) -> None:
    worker.compile(kernel_ir(1), 3)
    assert worker._proc is not None
    os.kill(worker._proc.pid, signal.SIGKILL)
    worker._proc.wait()
    with pytest.raises(CompileError, match="compile worker .* died"):
        worker.compile(kernel_ir(2), 3)
    assert worker.compile(kernel_ir(2), 3) and worker.started == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
def test_compiles_in_the_worker_leave_this_process_flat(monkeypatch: pytest.MonkeyPatch) -> None:
    """200 distinct O3 modules: in this process LLVM would keep ~14 MiB of them (74 KiB each, measured
    in tinydist.codegen.compile_worker's docstring); through the worker this process keeps none."""
    w = CompileWorker()
    try:
        for n in range(1, 21):                  # warm-up: pipes, buffers, the first child
            w.compile(kernel_ir(n), 3)
        gc.collect()
        before = process_resources()["rss_mib"]
        for n in range(21, 221):
            w.compile(kernel_ir(n), 3)
        gc.collect()
        assert process_resources()["rss_mib"] - before < 2.0
    finally:
        w.close()
