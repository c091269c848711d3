"""CPU devices and their code path: LLVM IR → vectorised native code → cached → loaded → run in parallel."""

from __future__ import annotations

import dataclasses
import gc
import os
import re
import subprocess
import sys
import textwrap

import anyio
import numpy as np
import pytest

from tinydist.base.errors import CompileError
from tinydist.codegen.compile_cache import CompileCache, decode_entry
from tinydist.codegen.compiler import HostCompiler, host_target
from tinydist.runtime.cpu.loader import OBJECTS_PER_ENGINE, NativeLoader, defined_symbols
from tinydist.runtime.device import Device
from tinydist.runtime.program import Program

from .helpers import SCALE_IR, SPIN_IR, Kernels, clock_gettime_address, spin_reference

SCALE_SIG = ["w", "r", "f32", "i64"]
SPIN_SIG = ["rw", "i64", "i64"]
TIMED_SIG = ["rw", "w", "i64", "i64"]

# ---- kernels on devices ------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("n", [0, 1, 7, 16, 1000, 4099])
async def test_kernel_matches_numpy(cpu: Device, kernels: Kernels, n: int) -> None:
    scale = cpu.load_program(kernels.scale, "rt_scale_f32", SCALE_SIG)
    rng = np.random.default_rng(n)
    data = rng.standard_normal(n + 1).astype(np.float32)
    sentinel = np.float32(123.5)
    x, y = cpu.allocator.alloc(4 * (n + 1)), cpu.allocator.alloc(4 * (n + 1))
    cpu.copyin(x, data)
    cpu.copyin(y, np.full(n + 1, sentinel, np.float32))
    with cpu.batch() as batch:
        batch.launch(scale, y, x, -1.75, n)
    with anyio.fail_after(20):
        out = (await cpu.copyout(y, timeout=20)).view(np.float32)
    np.testing.assert_array_equal(out[:n], np.float32(-1.75) * data[:n])
    assert out[n] == sentinel   # nothing written past n


@pytest.mark.anyio
async def test_spin_kernel_matches_reference(cpu: Device, kernels: Kernels) -> None:
    spin = cpu.load_program(kernels.spin, "rt_spin_f64", SPIN_SIG)
    start = np.array([0.0, -3.0, 10.0, 0.125, 1e6], np.float64)
    buf = cpu.allocator.alloc(start.nbytes)
    cpu.copyin(buf, start)
    with cpu.batch() as batch:
        batch.launch(spin, buf, len(start), 7)
    with anyio.fail_after(20):
        out = (await cpu.copyout(buf, timeout=20)).view(np.float64)
    assert out.tolist() == [spin_reference(v, 7) for v in start.tolist()]


@pytest.mark.anyio
async def test_two_devices_run_kernels_at_the_same_time(cpu: Device, cpu1: Device, kernels: Kernels) -> None:
    fixed_point = spin_reference(0.0, 1000)   # x -> 0.75 x + 1 settles (in float64) within 1000 steps
    assert spin_reference(fixed_point, 1) == fixed_point
    clock = clock_gettime_address()
    devices = (cpu, cpu1)
    programs = {dev: dev.load_program(kernels.timed_spin, "rt_spin_timed", TIMED_SIG) for dev in devices}
    xs = {dev: dev.allocator.alloc(8) for dev in devices}
    times = {dev: dev.allocator.alloc(16) for dev in devices}
    for dev in devices:
        dev.copyin(xs[dev], np.zeros(1, np.float64))
    with anyio.fail_after(60):
        for dev in devices:
            await dev.synchronize(60)

        # size the kernel to ~100 ms on this machine (a tuning step; nothing asserts on durations)
        probe_iters = 1_000_000
        with cpu.batch() as probe:
            probe.launch(programs[cpu], xs[cpu], times[cpu], probe_iters, clock)
        t = (await cpu.copyout(times[cpu], timeout=60)).view(np.int64)
        per_iter_ns = max(int(t[1] - t[0]), 1) / probe_iters
        iters = int(min(max(100e6 / per_iter_ns, 1e6), 5e8))

        completions = []
        for dev in devices:   # both submitted before either is awaited
            with dev.batch() as batch:
                batch.launch(programs[dev], xs[dev], times[dev], iters, clock)
                batch.launch(programs[dev], xs[dev], dev.allocator.alloc(16), 1, clock)
                batch.launch(programs[dev], xs[dev], dev.allocator.alloc(16), 1, clock)
            completions.append(batch.completion)
        native = []
        for dev, completion in zip(devices, completions):
            await completion.wait(60)
            assert (await dev.copyout(xs[dev], timeout=60)).view(np.float64)[0] == fixed_point
            native.append((await dev.copyout(times[dev], timeout=60)).view(np.int64).tolist())
    timings = [dev.queues["compute"].timings[-1] for dev in devices]
    for completion, timing in zip(completions, timings):
        assert timing.value == completion.value
        assert timing.commands == 3
        assert timing.start_ns < timing.end_ns
    # the batches overlap on the worker threads' clocks...
    assert max(t.start_ns for t in timings) < min(t.end_ns for t in timings), timings
    # ...and the native kernels themselves ran at the same time (the GIL was released)
    assert all(start < end for start, end in native), native
    assert max(start for start, _ in native) < min(end for _, end in native), native


@pytest.mark.anyio
async def test_queue_statistics_and_timings(cpu: Device) -> None:
    copy = cpu.queues["copy"]
    buf = cpu.allocator.alloc(32)
    with cpu.batch("copy") as batch:
        for i in range(5):
            batch.write_from_host(buf, np.full(32, i, np.uint8))
    with anyio.fail_after(20):
        await batch.completion.wait(20)
    timing = copy.timings[-1]
    assert (timing.value, timing.commands) == (1, 5)
    stats = copy.statistics()
    assert (stats.submitted, stats.completed, stats.in_flight) == (1, 1, 0)
    with anyio.fail_after(20):
        out = await cpu.copyout(buf, timeout=20)
    np.testing.assert_array_equal(out, np.full(32, 4, np.uint8))   # FIFO within the batch


# ---- compiler ----------------------------------------------------------------------------------


def test_o3_output_is_vectorised() -> None:
    if "+avx2" not in host_target().features and "+avx512f" not in host_target().features:
        pytest.skip("host CPU has no 256/512-bit vectors")
    vector = re.compile(r"%[yz]mm\d+")
    assert vector.search(HostCompiler().assembly(SCALE_IR))
    assert not vector.search(HostCompiler(opt_level=0).assembly(SCALE_IR))


def test_malformed_ir_is_a_compile_error_with_llvms_message() -> None:
    with pytest.raises(CompileError, match="LLVM rejected the kernel IR") as info:
        HostCompiler().compile("define void @broken( {\n")
    assert "error" in str(info.value).lower() and len(str(info.value)) > len("LLVM rejected the kernel IR: ")


def test_invalid_ir_fails_verification() -> None:
    bad = "define i32 @rt_bad() {\nentry:\n  ret void\n}\n"
    with pytest.raises(CompileError, match="LLVM rejected the kernel IR"):
        HostCompiler().compile(bad)


def test_opt_level_is_checked() -> None:
    with pytest.raises(ValueError, match="opt_level must be 0..3"):
        HostCompiler(opt_level=4)


# ---- compile cache -----------------------------------------------------------------------------


def test_cache_miss_then_hit(tmp_path, monkeypatch) -> None:
    compiler = HostCompiler()
    cache = CompileCache(compiler, directory=tmp_path, enabled=True)
    first = cache.compile(SCALE_IR)
    assert (cache.statistics.hits, cache.statistics.misses) == (0, 1)
    assert decode_entry(cache.path(SCALE_IR).read_bytes()) == (first, "")
    assert first.startswith(b"\x7fELF")

    def must_not_compile(ir: str) -> bytes:
        raise AssertionError("a cache hit must not compile")

    monkeypatch.setattr(compiler, "compile", must_not_compile)
    assert cache.compile(SCALE_IR) == first
    assert (cache.statistics.hits, cache.statistics.misses) == (1, 1)
    # a second cache over the same directory (a new process) uses the file too
    other = CompileCache(compiler, directory=tmp_path, enabled=True)
    assert other.compile(SCALE_IR) == first
    assert (other.statistics.hits, other.statistics.misses) == (1, 0)


def test_cache_key_covers_ir_opt_level_and_target(tmp_path, monkeypatch) -> None:
    compiler = HostCompiler()
    cache = CompileCache(compiler, directory=tmp_path, enabled=True)
    key = cache.key(SCALE_IR)
    assert cache.key(SCALE_IR) == key
    assert cache.key(SCALE_IR + "\n") != key
    assert cache.key(SPIN_IR) != key
    assert CompileCache(HostCompiler(opt_level=2), directory=tmp_path).key(SCALE_IR) != key
    for field in ("cpu", "features", "triple", "llvm_version", "llvmlite_version"):
        other = HostCompiler()
        monkeypatch.setattr(other, "target", dataclasses.replace(other.target, **{field: "other"}))
        assert CompileCache(other, directory=tmp_path).key(SCALE_IR) != key, field
    # a different target does not pick up this target's cached object
    cache.compile(SCALE_IR)
    other = HostCompiler()
    monkeypatch.setattr(other, "target", dataclasses.replace(other.target, cpu="other"))
    elsewhere = CompileCache(other, directory=tmp_path, enabled=True)
    elsewhere.compile(SCALE_IR)
    assert (elsewhere.statistics.hits, elsewhere.statistics.misses) == (0, 1)


def test_generated_kernel_hit_renders_no_ir(tmp_path, monkeypatch) -> None:
    """A generated kernel is found by its request before any IR is rendered; a changed generator
    (its code's fingerprint) or a changed request compiles again."""
    compiler = HostCompiler()
    cache = CompileCache(compiler, directory=tmp_path, enabled=True)
    renders: list[str] = []

    def render() -> str:
        renders.append(SCALE_IR)
        return SCALE_IR

    first = cache.compile_generated("scale v1", render)
    assert first.startswith(b"\x7fELF") and len(renders) == 1
    fresh = CompileCache(compiler, directory=tmp_path, enabled=True)   # a new process over the same directory
    assert fresh.compile_generated("scale v1", render) == first
    assert len(renders) == 1 and (fresh.statistics.hits, fresh.statistics.misses) == (1, 0)
    fresh.compile_generated("scale v2", render)
    assert len(renders) == 2
    monkeypatch.setattr("tinydist.codegen.compile_cache.generator_fingerprint", lambda: "another generator")
    CompileCache(compiler, directory=tmp_path, enabled=True).compile_generated("scale v1", render)
    assert len(renders) == 3


def test_kernel_found_by_its_ast_lowers_nothing(tmp_path, monkeypatch) -> None:
    """A kernel whose object code is on disk is loaded by its AST: a fresh process's compiler
    (a new DeviceCompiler over the same cache) lowers no IR, and the kernel computes as numpy."""
    import tinydist as td
    import tinydist.runtime.compiler as device_compiler
    from tinydist.runtime import get_engine
    from tinydist.runtime.compiler import DeviceCompiler
    from tinydist.schedule import create_schedule

    x = np.arange(37, dtype=np.float32)
    schedule, _ = create_schedule([(td.Tensor(x) * 3.0 - 1.25).node])
    (call,) = schedule.linear
    assert call.ast.source() is not None
    monkeypatch.setattr(device_compiler, "compile_generated_kernel", CompileCache(HostCompiler(), tmp_path, True).compile_generated)
    device = get_engine().device("CPU:0")
    first = DeviceCompiler(device).kernel(call.ast)

    def no_lowering(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("a cached kernel must not be lowered")

    monkeypatch.setattr(device_compiler, "lower", no_lowering)
    again = DeviceCompiler(device).kernel(call.ast)
    assert again.name == first.name
    out = np.zeros(64, np.float32)
    src = np.zeros(64, np.float32)
    o, s = out[(-out.ctypes.data % 64) // 4:][:37], src[(-src.ctypes.data % 64) // 4:][:37]
    s[:] = x
    again.cfunc(o.ctypes.data, s.ctypes.data)
    np.testing.assert_array_equal(o, x * np.float32(3.0) - np.float32(1.25))


def test_kernel_source_is_exact() -> None:
    """The AST's key text tells kernels apart and declines an argument it cannot vouch for (any type
    but plain values, dtypes and shape trackers: its repr might not determine it)."""
    import tinydist as td
    from tinydist.codegen.kernel import KNode, KernelAST, const
    from tinydist.schedule import create_schedule

    def ast(scale: float):  # type: ignore[no-untyped-def]
        schedule, _ = create_schedule([(td.Tensor(np.arange(8, dtype=np.float32)) * scale).node])
        return schedule.linear[0].ast

    assert ast(2.0).source() == ast(2.0).source() != ast(3.0).source()
    base = ast(2.0)
    opaque = KernelAST(base.shape, base.reduce_axes, KNode("add", (base.root, const(object(), base.out_dtype)),
                                                           None, base.out_dtype), base.slot_dtypes, base.out_dtype)
    assert opaque.source() is None


def test_disabled_cache_always_compiles(tmp_path, monkeypatch) -> None:
    compiler = HostCompiler()
    calls: list[str] = []
    real = compiler.compile
    monkeypatch.setattr(compiler, "compile", lambda ir: (calls.append(ir), real(ir))[1])
    cache = CompileCache(compiler, directory=tmp_path, enabled=False)
    a, b = cache.compile(SCALE_IR), cache.compile(SCALE_IR)
    assert a == b and len(calls) == 2
    assert (cache.statistics.hits, cache.statistics.misses) == (0, 2)
    assert not (tmp_path / "kernels-v2").exists()


def test_cache_setting_disables_it(tmp_path) -> None:
    from tinydist.base.config import settings
    with settings.override(COMPILE_CACHE="0"):
        assert not CompileCache(HostCompiler(), directory=tmp_path).enabled
    with settings.override(COMPILE_CACHE="1"):
        assert CompileCache(HostCompiler(), directory=tmp_path).enabled


def _truncated(entry: bytes) -> bytes:
    return entry[: len(entry) // 2]


def _flipped(entry: bytes) -> bytes:
    middle = len(entry) // 2
    return entry[:middle] + bytes(b ^ 0xFF for b in entry[middle:middle + 16]) + entry[middle + 16:]


_CORRUPTIONS = {
    "empty": lambda entry: b"",
    "truncated": _truncated,
    "garbage": lambda entry: os.urandom(len(entry)),
    "flipped bytes": _flipped,
    "bare object (no header)": lambda entry: decode_entry(entry)[0],
}


@pytest.mark.parametrize("corruption", sorted(_CORRUPTIONS))
def test_bad_cache_entry_is_deleted_and_compiled_again(tmp_path, corruption, monkeypatch) -> None:
    compiler = HostCompiler()
    good = CompileCache(compiler, directory=tmp_path, enabled=True).compile(SCALE_IR)
    cache = CompileCache(compiler, directory=tmp_path, enabled=True)
    path = cache.path(SCALE_IR)
    path.write_bytes(_CORRUPTIONS[corruption](path.read_bytes()))
    warnings: list[dict] = []
    monkeypatch.setattr("tinydist.codegen.compile_cache.log.warning", lambda event, **kw: warnings.append(kw))
    assert cache.compile(SCALE_IR) == good
    assert (cache.statistics.hits, cache.statistics.misses, cache.statistics.corrupt) == (0, 1, 1)
    assert len(warnings) == 1 and warnings[0]["path"] == str(path)
    assert decode_entry(path.read_bytes()) == (good, "")   # rewritten whole
    assert cache.compile(SCALE_IR) == good and cache.statistics.hits == 1


def test_a_process_loading_a_corrupted_entry_still_runs_its_kernel(tmp_path) -> None:
    """Before checksums, flipped bytes aborted the interpreter inside LLVM's loader (rc 134) and a
    truncated object segfaulted it (rc 139): a separate process shows the whole path survives."""
    script = textwrap.dedent("""
        import numpy as np, tinydist as td
        x = td.Tensor(np.arange(64, dtype=np.float32))
        print(float(((x * 0.03 + 1.0).exp().sum()).numpy()))
    """)
    env = {**os.environ, "TINYDIST_CACHE_DIR": str(tmp_path), "TINYDIST_COMPILE_CACHE": "1"}
    first = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    entries = sorted((tmp_path / "kernels-v2").glob("*/*.o"))
    assert entries
    for index, entry in enumerate(entries):
        entry.write_bytes((_flipped if index % 2 else _truncated)(entry.read_bytes()))
    second = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout
    assert "compile cache entry is bad" in second.stdout + second.stderr


def test_a_hit_renews_an_old_entry_for_the_eviction_order(tmp_path) -> None:
    from tinydist.codegen.compile_cache import RENEW_AFTER_SECONDS
    cache = CompileCache(HostCompiler(), directory=tmp_path, enabled=True)
    old, fresh = (SCALE_IR.replace("rt_scale", f"rt_scale_{name}") for name in ("old", "fresh"))
    code = cache.compile(old)
    cache.compile(fresh)
    os.utime(cache.path(old), (1, 1))
    written = cache.path(fresh).stat().st_mtime
    assert cache.compile(old) == code and cache.compile(fresh)
    assert cache.statistics.hits == 2
    assert cache.path(old).stat().st_mtime > RENEW_AFTER_SECONDS
    assert cache.path(fresh).stat().st_mtime == written  # used within the window: no write


def test_cache_stays_under_its_cap_evicting_the_least_recently_used(tmp_path) -> None:
    from tinydist.base.config import settings
    compiler = HostCompiler()
    sources = [SCALE_IR.replace("rt_scale", f"rt_scale_{i}") for i in range(6)]
    with settings.override(COMPILE_CACHE_MAX_MB=1):
        cache = CompileCache(compiler, directory=tmp_path, enabled=True)
        cache.compile(sources[0])
        # fill the directory to the cap with entries older than any: the next write must evict them
        filler = tmp_path / "kernels-v2" / "00"
        filler.mkdir(parents=True, exist_ok=True)
        for i in range(1024 * 1024 // 65536):
            old = filler / f"{i:064x}.o"
            old.write_bytes(bytes(65536))
            os.utime(old, (1, 1))
        fresh = CompileCache(compiler, directory=tmp_path, enabled=True)
        for source in sources[1:]:
            fresh.compile(source)
        sizes = [p.stat().st_size for p in (tmp_path / "kernels-v2").glob("*/*")]
        assert sum(sizes) <= 1024 * 1024
        assert fresh.statistics.evicted > 0
        assert all(fresh.path(source).exists() for source in sources)   # the recently used survive


# ---- loader ------------------------------------------------------------------------------------

_DUP_IR = """
define void @rt_dup(ptr %out) {{
entry:
  store i32 {value}, ptr %out
  ret void
}}
"""


def test_loader_refuses_a_second_definition_of_a_symbol() -> None:
    loader = NativeLoader()
    compiler = HostCompiler()
    one, two = compiler.compile(_DUP_IR.format(value=1)), compiler.compile(_DUP_IR.format(value=2))
    assert one != two
    first = loader.load(one, "rt_dup", ["w"])
    again = loader.load(one, "rt_dup", ["w"])   # the same object loads once and is shared
    assert again.address == first.address
    with pytest.raises(CompileError, match="'rt_dup' is already defined by another loaded object"):
        loader.load(two, "rt_dup", ["w"])
    out = np.zeros(1, np.int32)
    first.cfunc(out.ctypes.data)
    assert out[0] == 1   # still the first definition


_WEAK_IR = """
define weak i32 @rt_weak_helper() {{
entry:
  ret i32 {value}
}}

define void @{entry}(ptr %out) {{
entry:
  %v = call i32 @rt_weak_helper()
  store i32 %v, ptr %out
  ret void
}}
"""


def _run_i32(program: Program) -> int:
    out = np.zeros(1, np.int32)
    program.cfunc(out.ctypes.data)
    return int(out[0])


def test_loaded_objects_share_engines() -> None:
    loader = NativeLoader()
    compiler = HostCompiler()
    objects = [compiler.compile(_DUP_IR.format(value=n).replace("rt_dup", f"rt_share_{n}")) for n in range(OBJECTS_PER_ENGINE + 1)]
    programs = [loader.load(code, f"rt_share_{n}", ["w"]) for n, code in enumerate(objects)]
    assert (loader.loaded, loader.engines) == (OBJECTS_PER_ENGINE + 1, 2)
    assert [_run_i32(p) for p in programs] == list(range(OBJECTS_PER_ENGINE + 1))
    del programs
    gc.collect()
    assert (loader.loaded, loader.engines) == (0, 0)


def test_a_reloaded_symbol_runs_its_new_definition() -> None:
    # the engine an unloaded object was linked into keeps its definitions until it goes: a new
    # object defining the same name must not be linked there, or the name resolves to the old code
    loader = NativeLoader()
    compiler = HostCompiler()
    first = loader.load(compiler.compile(_DUP_IR.format(value=1)), "rt_dup", ["w"])
    assert _run_i32(first) == 1
    del first
    gc.collect()
    assert _run_i32(loader.load(compiler.compile(_DUP_IR.format(value=2)), "rt_dup", ["w"])) == 2


def test_a_weak_helper_resolves_within_its_own_object() -> None:
    loader = NativeLoader()
    compiler = HostCompiler()
    one = loader.load(compiler.compile(_WEAK_IR.format(value=1, entry="rt_weak_one")), "rt_weak_one", ["w"])
    two = loader.load(compiler.compile(_WEAK_IR.format(value=2, entry="rt_weak_two")), "rt_weak_two", ["w"])
    assert (_run_i32(one), _run_i32(two)) == (1, 2)
    assert loader.engines == 2


def test_defined_symbols_reads_the_elf_symbol_table() -> None:
    code = HostCompiler().compile(_WEAK_IR.format(value=1, entry="rt_weak_read"))
    assert defined_symbols(code) == {"rt_weak_helper", "rt_weak_read"}
    assert defined_symbols(b"\xcf\xfa\xed\xfe" + code[4:]) is None  # not ELF (here: a Mach-O magic)


def test_loader_errors() -> None:
    loader = NativeLoader()
    code = HostCompiler().compile(_DUP_IR.format(value=3).replace("rt_dup", "rt_present"))
    with pytest.raises(CompileError, match="defines no function 'rt_absent'"):
        loader.load(code, "rt_absent", ["w"])
    with pytest.raises(ValueError, match="unknown argument kind"):
        loader.load(code, "rt_present", ["ptr"])


def test_kernel_calls_into_libm_take_a_64_bit_address() -> None:
    # A float `%` lowers to a call of fmodf. As `call fmodf@PLT` (a 32-bit PC-relative reference)
    # the in-process loader aborted the whole process once JIT memory landed over 2 GiB from libm
    # (it did, with torch's libraries mapped): every symbol must be reached by its full address.
    import tinydist as td
    from tinydist.codegen.lowering import lower
    from tinydist.schedule import create_schedule

    a = td.Tensor(np.arange(1, 9, dtype=np.float32))
    schedule, _ = create_schedule([(a % 3.0).node])
    assembly = HostCompiler().assembly(lower(schedule.linear[0].ast)[1])
    assert "fmodf" in assembly
    assert not re.search(r"\w+@PLT", assembly)
    np.testing.assert_array_equal((a % 3.0).numpy(), np.arange(1, 9) % 3.0)
