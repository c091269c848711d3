"""A one-host allreduce driven from native code: one ctypes call per collective, no header round trip.

The segment path (`tinydist.dist.shm_algorithms`) costs 40-50 us for a 4 KiB allreduce that Open MPI's
shared-memory BTL does in 2-5 us: a JSON header built, written and compared on every call, a
`Session` object, numpy slicing per round, a Python wait loop and a reduction through numpy's ufunc
machinery. Here one function compiled per group from LLVM IR (the group's addresses, rank and world
baked in, like the runtime's other glue) does the whole of naive's one round:

    copy x into my slot (parity of the round) · store my call digest · compare-and-swap my step word
    on (and FUTEX_WAKE it if a peer's sleeping word says it sleeps) · wait for every peer's step
    (spin, yield, then futex sleeps) · compare every peer's digest with mine · reduce every slot, in rank order, into `out` (`tinydist.codegen.reduce`'s
    kernel, called by address)

The mismatch check stays, as a digest instead of the header: a 64-bit hash of what `_verdict` compares
(call number, collective, op, dtype, shape, resolved algorithm) in the control page's words 6-7 (one
per round parity). The segment path stores 0 there, the fast path always has `FAST_BIT` set, so every
rank can tell, from the same words, that a peer took the other path. Where the digests differ every
rank takes one more step (`explain`): it writes its full header into the header slot and every rank
raises the same `CollectiveMismatch` from the headers, as before; the ranks stay in step, so the group
stays usable. The segment path does that same extra step when it sees a fast digest
(`Session.sync`).

Failures keep the group's semantics: the native wait (either of all2all's) gives up after `NATIVE_WAIT_SECONDS` (or on a
futex wake that brought no step: `ShmGroup.wake_all` after a link saw a peer die), and the group's
own `ShmGroup.wait` takes over, with its deadline, failure checks and poison. A post that finds a
poison in our step word raises `Abandoned` as `ShmGroup.post` does.

All2all (what the chooser picks from `SHM_SMALL_BYTES` on) is two steps in the same call, the
segment path's data move: copy in only the peers' parts (`shard_bounds`) · post · wait · check the
digests · reduce my part from x and the peers' slots into `out` and my slot at once (the kernel's two
destinations) · post the second step · wait · copy every peer's reduced part out of its slot. Each
rank reduces 1/N of the data instead of all of it: measured (2 ranks, 2 vCPUs, 1 MiB float32) 0.131
ms against naive's 0.174 in the same run; at 64 KiB the second step costs more than it saves (0.0224
vs 0.0154 ms), so the chooser keeps naive there.

What runs here: all_reduce of a C-contiguous numpy array, in place (`out=x`) or into a fresh array,
op sum / prod (every compiled dtype) and max / min (integers), of at most `FAST_MAX_BYTES` (and one
slot), any algorithm the chooser resolves to naive or all2all (the digest carries the resolved
algorithm, so ranks that ask for different ones disagree), while no tracer is recording (the segment
path draws the spans). The rest, and any array the native checks refuse (not contiguous, `out`
read-only), goes the segment path.

Python calls it as a builtin function (`builtin`: METH_FASTCALL, CPython's own convention), not
through ctypes, whose argument conversion cost ~0.6 us of a ~5 us call; the builtin releases the GIL
around the native call, as ctypes does.

The compiled function reads an array's data pointer and flags from the numpy object itself (the
`PyArrayObject` fields, numpy's stable ABI: `data` at 16, `flags` at 64), because `x.ctypes.data`
alone costs 1-3 us here; `FastAllreduce.create` checks those offsets against numpy on a probe array
and returns None where they differ.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import json
import threading
import time
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from tinydist.base.config import settings
from tinydist.codegen.compile_cache import compile_glue
from tinydist.codegen.reduce import supported
from tinydist.codegen.stream_sync import futex_syscall
from tinydist.dist.errors import CollectiveError, CollectiveMismatch
from tinydist.graph.collectives import Algorithm, resolve, shard_bounds
from tinydist.observability import tracing
from tinydist.runtime.compiler import host_reduce
from tinydist.runtime.cpu.loader import native_loader
from tinydist.runtime.program import Program
from tinydist.transports.shm_group import CONTROL_BYTES, CPU_WORD, SLEEPING_WORD, Abandoned, ShmGroup, WaitTimeout

if TYPE_CHECKING:
    from tinydist.dist.group import ProcessGroup

# A fast call's digest always has this bit; the segment path stores 0 (`DIGEST_WORD`).
FAST_BIT = 1 << 62
DIGEST_WORD = 6          # control page words 6 and 7: the digest of the round of parity 0 / 1
# Up to here the native call (one slot per rank and parity) beats the segment path (2 ranks, 2 vCPUs).
FAST_MAX_BYTES = 4 << 20
# The native wait spins SPIN_BASE_SECONDS plus the time to move the message at SPIN_BYTES_PER_SECOND,
# at most the group's spin (none when the ranks outnumber the CPUs), then sleeps on the futex in
# slices; a peer due within a few microseconds is caught spinning, while a peer that shares our CPU
# (a loaded machine) costs at most the spin. Measured, 2 ranks 4 KiB on 2 loaded vCPUs: spinning
# the group's full 1 ms made the median call 220 us in phases where both ranks shared a CPU.
SPIN_BASE_SECONDS = 30e-6
SPIN_BYTES_PER_SECOND = 2e9
# A waiter does not spin at all while its peer's `CPU_WORD` says the peer's last call ran on the
# waiter's own CPU (the two share it: the peer runs only once we give the CPU up). Measured, 2 ranks
# on 2 vCPUs at load 4-6: without that check all2all's two waits at 1 MiB cost 1.12-1.34 ms a call
# in three runs (the spin budget at 1 MiB is 0.55 ms a wait); with it 0.205-0.325 ms.
# The native wait
# slices, and after NATIVE_WAIT_SECONDS hands over to ShmGroup.wait, which checks for failures.
NATIVE_WAIT_SECONDS = 0.02
# After its spin (none where the ranks outnumber the CPUs) the native wait calls sched_yield between
# looks for this long before it sleeps on the futex: a peer queued for our CPU gets it at once, and a
# futex sleep costs ~0.1 ms to wake from on this VM (an idle vCPU). Measured, 4 ranks on 2 vCPUs:
# sleeping at once made a 4 KiB allreduce 1.46x and 8 KiB 1.26x Open MPI's (whose oversubscribed
# ranks yield while they poll); with the yields 0.36x and 0.23x.
YIELD_SECONDS = 200e-6
SYS_SCHED_YIELD = 24     # x86-64
SLEEP_SLICE_NS = 2_000_000
_OPS = ("sum", "prod", "max", "min")
_MIX = 0x9E37_79B9_7F4A_7C15   # the call number's multiplier in the digest (Fibonacci hashing)
_MASK = (1 << 62) - 1

# return codes of the native function
OK, MISMATCH, NOT_YET, POST_FAILED, POISONED, WAIT2, REFUSED = 0, 1, 2, 3, 4, 5, 100
_PY_DATA, _PY_FLAGS = 16, 64                 # PyArrayObject_fields: data, flags
_C_CONTIGUOUS, _WRITEABLE = 0x1, 0x400       # NPY_ARRAY_C_CONTIGUOUS, NPY_ARRAY_WRITEABLE
_NAME = "td_fast_allreduce"
_names = itertools.count()     # loaded symbols are process-wide: one name per group


def _libc_address(name: str) -> int:
    return ctypes.cast(getattr(ctypes.CDLL(None), name), ctypes.c_void_p).value or 0


def _api(name: str) -> str:
    """A C API function of this interpreter, as an LLVM constant pointer to call."""
    address = ctypes.cast(getattr(ctypes.pythonapi, name), ctypes.c_void_p).value or 0
    return f"inttoptr (i64 {address} to ptr)"


class _MethodDef(ctypes.Structure):
    """CPython's PyMethodDef: what a builtin function object points at for its C function."""

    _fields_ = [("ml_name", ctypes.c_char_p), ("ml_meth", ctypes.c_void_p), ("ml_flags", ctypes.c_int),
                ("ml_doc", ctypes.c_char_p)]


_METH_FASTCALL = 0x80
_new_builtin = ctypes.pythonapi.PyCFunction_NewEx
_new_builtin.restype, _new_builtin.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.py_object, ctypes.py_object]


def builtin(address: int, name: str) -> tuple[Any, _MethodDef]:
    """A Python builtin function calling the METH_FASTCALL C function at `address` (CPython's own
    calling convention: no argument conversion objects, unlike a ctypes call), and the method
    definition it points at, which must live as long as the function does. Measured here: 77-103 ns
    a call against 625-720 ns for the same four arguments through a ctypes CFUNCTYPE."""
    definition = _MethodDef(name.encode(), address, _METH_FASTCALL, None)
    return _new_builtin(ctypes.addressof(definition), None, None), definition


def allreduce_ir(name: str, grp: ShmGroup, detail: int, futex: int) -> str:
    """The group's native allreduce, and `<name>_data(ptr x) -> i64`, the data pointer of a numpy object:

        i64 <name>(ptr entry, ptr x, ptr out, i64 call)

    `entry`: `_Entry.words`; `x`, `out`: numpy objects; `call`: the
    call number << 3 | phase two << 2 | resume << 1 | the round's parity, one argument because each costs
    ctypes ~60 ns; resume 1: the post and the wait are done (ShmGroup.wait waited), only check the digests
    and reduce (all2all: and take its second step); phase two 1: all2all's second step is done too, only
    copy the peers' parts out (WAIT2: its wait handed over).
    The step posted is the one after what this rank's step word holds (only this rank moves it on).
    Returns one of the codes above; POST_FAILED leaves the step word it found at `detail`."""
    base = grp.raw.ctypes.data if grp.raw is not None else 0
    world, rank, slot = grp.world, grp.rank, grp.slot_bytes
    syscall, clock, memcpy = _libc_address("syscall"), _libc_address("clock_gettime"), _libc_address("memcpy")
    getcpu = _libc_address("sched_getcpu")
    data0 = base + world * CONTROL_BYTES
    budget = int(NATIVE_WAIT_SECONDS * 1e9)

    def word(r: int, index: int) -> str:
        return f"inttoptr (i64 {base + r * CONTROL_BYTES + 8 * index} to ptr)"

    peers = [r for r in range(world) if r != rank]

    def part(r: int, tag: str) -> list[str]:
        """%<tag>o<r>, %<tag>n<r>: rank r's part of the call (`_Entry`: words 8 + 2r, 9 + 2r), in bytes."""
        return [f"  %{tag}op{r} = getelementptr inbounds i64, ptr %entry, i64 {8 + 2 * r}", f"  %{tag}o{r} = load i64, ptr %{tag}op{r}",
                f"  %{tag}np{r} = getelementptr inbounds i64, ptr %entry, i64 {9 + 2 * r}", f"  %{tag}n{r} = load i64, ptr %{tag}np{r}"]

    # all2all's copy in: only the parts the peers reduce (this rank reads its own part from x)
    copy_parts = []
    for r in peers:
        copy_parts += [*part(r, "ci"), f"  %cid{r} = getelementptr inbounds i8, ptr %minep, i64 %cio{r}",
                       f"  %cis{r} = getelementptr inbounds i8, ptr %xd, i64 %cio{r}",
                       f"  %cic{r} = call ptr %cpy(ptr %cid{r}, ptr %cis{r}, i64 %cin{r})"]
    lines = [
        "define internal i64 @now(ptr %ts) {",
        f"  %f = inttoptr i64 {clock} to ptr",
        "  %r = call i32 %f(i32 1, ptr %ts)",
        "  %sp = getelementptr inbounds i64, ptr %ts, i64 0", "  %s = load i64, ptr %sp",
        "  %np = getelementptr inbounds i64, ptr %ts, i64 1", "  %n = load i64, ptr %np",
        "  %ns = mul i64 %s, 1000000000", "  %t = add i64 %ns, %n", "  ret i64 %t", "}",
        # 0: the peer reached `target` (or went past it); POISONED: its word holds a poison; NOT_YET:
        # the budget ran out, or a futex wake brought no step (someone saw the group fail)
        # %peer_cpu: the peer's CPU_WORD; %cpu: 1 + this rank's CPU. A peer that last ran on our CPU
        # is not running (or we are not): spinning holds the CPU it needs, so yield at once
        "define internal i64 @wait_peer(ptr %word, i64 %target, i64 %spin_ns, ptr %peer_cpu, i64 %cpu) {", "entry:",
        "  %ts = alloca [2 x i64], align 8", "  %sl = alloca [2 x i64], align 8",
        "  %t0 = call i64 @now(ptr %ts)",
        "  %nospin = icmp eq i64 %spin_ns, 0", "  %pc0 = load atomic i64, ptr %peer_cpu monotonic, align 8",
        "  %mine0 = icmp eq i64 %pc0, %cpu", "  %skip = or i1 %nospin, %mine0",
        "  br i1 %skip, label %yielding, label %spin",   # oversubscribed, or sharing our CPU
        "spin:", "  %i = phi i64 [0, %entry], [%i1, %more], [%i1, %clock]",
        "  %v = load atomic i64, ptr %word acquire, align 8",
        "  %got = icmp uge i64 %v, %target", "  br i1 %got, label %done, label %pause",
        "pause:", "  call void @llvm.x86.sse2.pause()", "  %i1 = add i64 %i, 1",
        "  %k = and i64 %i1, 127", "  %tick = icmp eq i64 %k, 0", "  br i1 %tick, label %clock, label %more",
        "more:", "  br label %spin",
        "clock:", "  %t1 = call i64 @now(ptr %ts)", "  %e1 = sub i64 %t1, %t0",
        "  %spun0 = icmp uge i64 %e1, %spin_ns", "  %pc1 = load atomic i64, ptr %peer_cpu monotonic, align 8",
        "  %mine1 = icmp eq i64 %pc1, %cpu", "  %spun = or i1 %spun0, %mine1",
        "  br i1 %spun, label %yielding, label %spin",
        # then sched_yield between looks (YIELD_SECONDS): a peer queued for this very CPU gets it
        "yielding:", "  %v5 = load atomic i64, ptr %word acquire, align 8",
        "  %got5 = icmp uge i64 %v5, %target", "  br i1 %got5, label %done, label %yieldmore",
        "yieldmore:", "  %t5 = call i64 @now(ptr %ts)", "  %e5 = sub i64 %t5, %t0",
        f"  %ylimit = add i64 %spin_ns, {int(YIELD_SECONDS * 1e9)}",
        "  %yielded = icmp uge i64 %e5, %ylimit", "  br i1 %yielded, label %sleep, label %doyield",
        "doyield:", f"  %yr = call i64 (i64, ...) inttoptr (i64 {syscall} to ptr)(i64 {SYS_SCHED_YIELD})",
        "  br label %yielding",
        "sleep:", "  %v2 = load atomic i64, ptr %word acquire, align 8",
        "  %got2 = icmp uge i64 %v2, %target", "  br i1 %got2, label %done, label %late",
        "late:", "  %t2 = call i64 @now(ptr %ts)", "  %e2 = sub i64 %t2, %t0",
        f"  %over = icmp uge i64 %e2, {budget}", "  br i1 %over, label %notyet, label %futex",
        "futex:",
        f"  store atomic i64 1, ptr {word(rank, SLEEPING_WORD)} seq_cst, align 8",   # wake me (`SLEEPING_WORD`)
        "  %slp = getelementptr inbounds i64, ptr %sl, i64 0", "  store i64 0, ptr %slp",
        "  %sln = getelementptr inbounds i64, ptr %sl, i64 1", f"  store i64 {SLEEP_SLICE_NS}, ptr %sln",
        "  %lo = and i64 %v2, 4294967295",
        f"  %sys = inttoptr i64 {syscall} to ptr",
        f"  %w = call i64 (i64, ...) %sys(i64 {futex}, ptr %word, i64 0, i64 %lo, ptr %sl, ptr null, i64 0)",
        f"  store atomic i64 0, ptr {word(rank, SLEEPING_WORD)} release, align 8",
        "  %woken = icmp eq i64 %w, 0", "  br i1 %woken, label %recheck, label %sleep",
        "recheck:", "  %v3 = load atomic i64, ptr %word acquire, align 8",
        "  %got3 = icmp uge i64 %v3, %target", "  br i1 %got3, label %done, label %notyet",
        "done:", "  %vd = load atomic i64, ptr %word acquire, align 8",
        "  %bad = icmp slt i64 %vd, 0", f"  %code = select i1 %bad, i64 {POISONED}, i64 0", "  ret i64 %code",
        "notyet:", f"  ret i64 {NOT_YET}", "}",
        "declare void @llvm.x86.sse2.pause()",
        f"define i64 @{name}(ptr %entry, ptr %x, ptr %out, i64 %call) {{",
        "start:", "  %parity = and i64 %call, 1", "  %seq = lshr i64 %call, 3",
        "  %rbit = and i64 %call, 2", "  %resume = lshr i64 %rbit, 1", "  %phase2 = and i64 %call, 4",
        f"  %xdp = getelementptr inbounds i8, ptr %x, i64 {_PY_DATA}", "  %xd = load ptr, ptr %xdp",
        f"  %xfp = getelementptr inbounds i8, ptr %x, i64 {_PY_FLAGS}", "  %xf = load i32, ptr %xfp",
        f"  %odp = getelementptr inbounds i8, ptr %out, i64 {_PY_DATA}", "  %od = load ptr, ptr %odp",
        f"  %ofp = getelementptr inbounds i8, ptr %out, i64 {_PY_FLAGS}", "  %of = load i32, ptr %ofp",
        f"  %xc = and i32 %xf, {_C_CONTIGUOUS}", f"  %oc = and i32 %of, {_C_CONTIGUOUS | _WRITEABLE}",
        f"  %xok = icmp eq i32 %xc, {_C_CONTIGUOUS}", f"  %ook = icmp eq i32 %oc, {_C_CONTIGUOUS | _WRITEABLE}",
        "  %ok = and i1 %xok, %ook", "  br i1 %ok, label %go, label %refused",
        "refused:", f"  ret i64 {REFUSED}",
        "go:",
        "  %fnp = getelementptr inbounds i64, ptr %entry, i64 0", "  %fn = load i64, ptr %fnp",
        "  %nbp = getelementptr inbounds i64, ptr %entry, i64 1", "  %nbytes = load i64, ptr %nbp",
        "  %cnp = getelementptr inbounds i64, ptr %entry, i64 2", "  %count = load i64, ptr %cnp",
        "  %dgp = getelementptr inbounds i64, ptr %entry, i64 3", "  %dbase = load i64, ptr %dgp",
        "  %snp = getelementptr inbounds i64, ptr %entry, i64 4", "  %spin = load i64, ptr %snp",
        "  %mdp5 = getelementptr inbounds i64, ptr %entry, i64 5", "  %mode = load i64, ptr %mdp5",
        "  %split = icmp ne i64 %mode, 0",
        f"  %mixed = mul i64 %seq, {_MIX - (1 << 64)}", "  %d0 = xor i64 %dbase, %mixed",
        f"  %d1 = and i64 %d0, {_MASK}", f"  %digest = or i64 %d1, {FAST_BIT}",
        "  %dword = mul i64 %parity, 8",
        f"  %cpu32 = call i32 inttoptr (i64 {getcpu} to ptr)()", "  %cpu64 = sext i32 %cpu32 to i64",
        "  %cpu = add i64 %cpu64, 1",      # sched_getcpu's -1 (unknown) stores 0
        f"  store atomic i64 %cpu, ptr {word(rank, CPU_WORD)} monotonic, align 8",
        f"  %step = load atomic i64, ptr {word(rank, 0)} acquire, align 8",
        "  %target = add i64 %step, 1",
        "  %late2 = icmp ne i64 %phase2, 0", "  br i1 %late2, label %gather, label %phase1",
        "phase1:", "  %again = icmp ne i64 %resume, 0", "  br i1 %again, label %check, label %post",
        "post:",
        f"  %sbase = mul i64 %parity, {slot}", f"  %mine = add i64 %sbase, {data0 + 2 * rank * slot}",
        "  %minep = inttoptr i64 %mine to ptr",
        f"  %cpy = inttoptr i64 {memcpy} to ptr", "  br i1 %split, label %copyparts, label %copyall",
        "copyall:", "  %c = call ptr %cpy(ptr %minep, ptr %xd, i64 %nbytes)", "  br label %posted",
        "copyparts:", *copy_parts, "  br label %posted",
        "posted:",
        f"  %mdw = add i64 %dword, {base + rank * CONTROL_BYTES + 8 * DIGEST_WORD}",
        "  %mdp = inttoptr i64 %mdw to ptr", "  store i64 %digest, ptr %mdp, align 8",
        "  %poisoned = icmp slt i64 %step, 0", "  br i1 %poisoned, label %lost, label %swap",
        "swap:",
        f"  %cas = cmpxchg ptr {word(rank, 0)}, i64 %step, i64 %target seq_cst seq_cst",
        "  %swapped = extractvalue { i64, i1 } %cas, 1", "  br i1 %swapped, label %wake, label %lost",
        "lost:", f"  %old = load atomic i64, ptr {word(rank, 0)} acquire, align 8",
        f"  store i64 %old, ptr inttoptr (i64 {detail} to ptr), align 8", f"  ret i64 {POST_FAILED}",
        # FUTEX_WAKE only when a peer sleeps (`SLEEPING_WORD`): the syscall costs ~750 ns with nobody to wake
        "wake:",
    ]
    for k, r in enumerate(peers):
        lines += [f"  %sf{k} = load atomic i64, ptr {word(r, SLEEPING_WORD)} seq_cst, align 8",
                  f"  %sleepers{k + 1} = or i64 {'%sleepers' + str(k) if k else 0}, %sf{k}"]
    lines += [
        f"  %anyone = icmp ne i64 %sleepers{len(peers)}, 0", "  br i1 %anyone, label %wakeup, label %wait0",
        "wakeup:",
        f"  %sys = inttoptr i64 {syscall} to ptr",
        f"  %woke = call i64 (i64, ...) %sys(i64 {futex}, ptr {word(rank, 0)}, i64 1, i64 2147483647)",
        "  br label %wait0",
    ]
    for k, r in enumerate(peers):
        after = f"wait{k + 1}" if k + 1 < len(peers) else "check"
        lines += [f"wait{k}:", f"  %w{k} = call i64 @wait_peer(ptr {word(r, 0)}, i64 %target, i64 %spin, ptr {word(r, CPU_WORD)}, i64 %cpu)",
                  f"  %wok{k} = icmp eq i64 %w{k}, 0", f"  br i1 %wok{k}, label %{after}, label %waitfail{k}",
                  f"waitfail{k}:", f"  ret i64 %w{k}"]
    lines.append("check:")
    for k, r in enumerate(peers):
        nxt = f"check{k + 1}" if k + 1 < len(peers) else "reduce"
        lines += [f"  %pdw{k} = add i64 %dword, {base + r * CONTROL_BYTES + 8 * DIGEST_WORD}",
                  f"  %pdp{k} = inttoptr i64 %pdw{k} to ptr", f"  %pd{k} = load i64, ptr %pdp{k}, align 8",
                  f"  %same{k} = icmp eq i64 %pd{k}, %digest", f"  br i1 %same{k}, label %{nxt}, label %mismatch",
                  f"{nxt}:"]
    lines.append(f"  %psl = mul i64 %parity, {slot}")
    sources = []
    for r in range(world):
        lines += [f"  %sa{r} = add i64 %psl, {data0 + 2 * r * slot}", f"  %s{r} = inttoptr i64 %sa{r} to ptr"]
        sources.append(f"ptr %s{r}")
    lines += ["  br i1 %split, label %part, label %whole",
              "whole:", "  %kernel = inttoptr i64 %fn to ptr",
              f"  call void %kernel(ptr %od, {', '.join(sources)}, i64 %count)", f"  ret i64 {OK}",
              # all2all: reduce my part from x and the peers' slots into out and my slot, post the second
              # step, wait for every peer's, copy their parts out of their slots
              "part:", *part(rank, "me"),
              "  %k2p = getelementptr inbounds i64, ptr %entry, i64 6", "  %k2a = load i64, ptr %k2p",
              "  %mcp = getelementptr inbounds i64, ptr %entry, i64 7", "  %mcount = load i64, ptr %mcp",
              f"  %mx = getelementptr inbounds i8, ptr %xd, i64 %meo{rank}"]
    parts = []
    for r in range(world):
        if r == rank:
            parts.append("ptr %mx")
        else:
            lines.append(f"  %ms{r} = getelementptr inbounds i8, ptr %s{r}, i64 %meo{rank}")
            parts.append(f"ptr %ms{r}")
    lines += [f"  %md0 = getelementptr inbounds i8, ptr %od, i64 %meo{rank}",
              f"  %md1 = getelementptr inbounds i8, ptr %s{rank}, i64 %meo{rank}",
              "  %kernel2 = inttoptr i64 %k2a to ptr",
              f"  call void %kernel2(ptr %md0, ptr %md1, {', '.join(parts)}, i64 %mcount)",
              f"  %step2 = load atomic i64, ptr {word(rank, 0)} acquire, align 8",
              "  %target2 = add i64 %step2, 1",
              "  %poisoned2 = icmp slt i64 %step2, 0", "  br i1 %poisoned2, label %lost, label %swap2",
              "swap2:",
              f"  %cas2 = cmpxchg ptr {word(rank, 0)}, i64 %step2, i64 %target2 seq_cst seq_cst",
              "  %swapped2 = extractvalue { i64, i1 } %cas2, 1", "  br i1 %swapped2, label %wake2, label %lost",
              "wake2:"]
    for k, r in enumerate(peers):
        lines += [f"  %tf{k} = load atomic i64, ptr {word(r, SLEEPING_WORD)} seq_cst, align 8",
                  f"  %tsleepers{k + 1} = or i64 {'%tsleepers' + str(k) if k else 0}, %tf{k}"]
    lines += [f"  %tanyone = icmp ne i64 %tsleepers{len(peers)}, 0", "  br i1 %tanyone, label %twakeup, label %twait0",
              "twakeup:",
              f"  %tsys = inttoptr i64 {syscall} to ptr",
              f"  %twoke = call i64 (i64, ...) %tsys(i64 {futex}, ptr {word(rank, 0)}, i64 1, i64 2147483647)",
              "  br label %twait0"]
    for k, r in enumerate(peers):
        after = f"twait{k + 1}" if k + 1 < len(peers) else "gather"
        lines += [f"twait{k}:", f"  %tw{k} = call i64 @wait_peer(ptr {word(r, 0)}, i64 %target2, i64 %spin, ptr {word(r, CPU_WORD)}, i64 %cpu)",
                  f"  %twok{k} = icmp eq i64 %tw{k}, 0", f"  br i1 %twok{k}, label %{after}, label %twaitfail{k}",
                  f"twaitfail{k}:", f"  ret i64 {WAIT2}"]
    lines += ["gather:", f"  %gsl = mul i64 %parity, {slot}", f"  %gcpy = inttoptr i64 {memcpy} to ptr"]
    for r in peers:
        lines += [*part(r, "g"), f"  %gsa{r} = add i64 %gsl, {data0 + 2 * r * slot}", f"  %gs{r} = inttoptr i64 %gsa{r} to ptr",
                  f"  %gsrc{r} = getelementptr inbounds i8, ptr %gs{r}, i64 %go{r}",
                  f"  %gdst{r} = getelementptr inbounds i8, ptr %od, i64 %go{r}",
                  f"  %gc{r} = call ptr %gcpy(ptr %gdst{r}, ptr %gsrc{r}, i64 %gn{r})"]
    lines += [f"  ret i64 {OK}",
              "mismatch:", f"  ret i64 {MISMATCH}", "}",
              # the builtin Python calls (METH_FASTCALL): (entry, x, out, call) -> the code, as a Python int;
              # the GIL is released around the call, as ctypes would
              f"define ptr @{name}_py(ptr %self, ptr %args, i64 %nargs) {{",
              "  %four = icmp eq i64 %nargs, 4", "  br i1 %four, label %unpack, label %arity",
              "arity:", f"  %bad = call ptr {_api('PyLong_FromLongLong')}(i64 {REFUSED})", "  ret ptr %bad",
              "unpack:",
              "  %a0 = load ptr, ptr %args", "  %a1p = getelementptr inbounds ptr, ptr %args, i64 1",
              "  %a1 = load ptr, ptr %a1p", "  %a2p = getelementptr inbounds ptr, ptr %args, i64 2",
              "  %a2 = load ptr, ptr %a2p", "  %a3p = getelementptr inbounds ptr, ptr %args, i64 3",
              "  %a3 = load ptr, ptr %a3p",
              f"  %ea = call i64 {_api('PyLong_AsLongLong')}(ptr %a0)",
              f"  %ca = call i64 {_api('PyLong_AsLongLong')}(ptr %a3)",
              "  %eok = icmp ne i64 %ea, -1", "  %cok = icmp ne i64 %ca, -1", "  %iok = and i1 %eok, %cok",
              "  br i1 %iok, label %run, label %typeerror",
              "typeerror:", "  ret ptr null",       # PyLong_AsLongLong set the exception
              "run:", "  %ep = inttoptr i64 %ea to ptr",
              f"  %ts = call ptr {_api('PyEval_SaveThread')}()",
              f"  %rc = call i64 @{name}(ptr %ep, ptr %a1, ptr %a2, i64 %ca)",
              f"  call void {_api('PyEval_RestoreThread')}(ptr %ts)",
              f"  %res = call ptr {_api('PyLong_FromLongLong')}(i64 %rc)", "  ret ptr %res", "}",
              f"define i64 @{name}_data(ptr %x) {{",
              f"  %p = getelementptr inbounds i8, ptr %x, i64 {_PY_DATA}", "  %d = load i64, ptr %p", "  ret i64 %d", "}", ""]
    return "\n".join(lines)


def _digest(header: dict[str, Any]) -> int:
    """62 bits of a hash of what `_verdict` compares, less the call number (mixed in natively)."""
    blob = json.dumps(header, sort_keys=True).encode()
    return int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "little") & _MASK


class _Entry:
    """One (shape, dtype, op, algorithm): the native call's words and the reduction it calls."""

    __slots__ = ("kernel", "parts", "steps", "words", "address", "header")

    def __init__(self, kernel: Program, nbytes: int, count: int, header: dict[str, Any], spin: float,
                 world: int, rank: int, parts: Program | None = None) -> None:
        """`parts`: all2all's two-destination kernel (then the call splits the data by `shard_bounds`
        and takes two steps); words: [kernel, nbytes, count, digest base, spin ns, all2all, parts'
        kernel, my part's count, then every rank's part as (byte offset, bytes)]."""
        self.kernel, self.parts, self.header = kernel, parts, header
        self.steps = 1 if parts is None else 2
        bounds = shard_bounds(count, world)
        item = nbytes // count if count else 0
        lo, hi = bounds[rank]
        self.words = np.array([kernel.address, nbytes, count, _digest(header), int(spin * 1e9), int(parts is not None),
                               0 if parts is None else parts.address, hi - lo,
                               *(v for a, b in bounds for v in (a * item, (b - a) * item))], np.uint64)
        self.address = self.words.ctypes.data


class FastAllreduce:
    """The native allreduce of one `ProcessGroup` on its group segment. `all_reduce` returns None for
    a call it does not take (the caller then runs the segment path); see the module docstring."""

    def __init__(self, group: ProcessGroup, grp: ShmGroup, program: Program, detail: np.ndarray) -> None:
        # `program` (the `<name>_py` entry) keeps the code mapped while `call`, its builtin, exists
        self.group, self.grp, self.program, self.detail = group, grp, program, detail
        self.call, self._definition = builtin(program.address, program.name)
        self.entries: dict[tuple[Any, ...], _Entry | None] = {}
        self.completed = 0      # allreduces this path completed (tests and bench/allreduce.py read it; ~40 ns)
        self.barriers = 0       # barriers this path completed
        self._nothing = np.empty(0, np.float32)      # the barrier's data: none
        self._barrier = self._barrier_entry()
        self.lock: threading.Lock = group._thread_lock

    @classmethod
    def create(cls, group: ProcessGroup, grp: ShmGroup) -> FastAllreduce | None:
        """The group's fast path, or None where it cannot run (no futex, or numpy's object layout is
        not the one the native code reads)."""
        futex = futex_syscall()
        if futex is None or grp.raw is None or settings.SHM_FAST == "off":
            return None
        detail = np.zeros(1, np.uint64)
        name = f"{_NAME}_{next(_names)}"
        code = compile_glue(allreduce_ir(name, grp, detail.ctypes.data, futex))
        program = native_loader.load(code, f"{name}_py", ["i64"] * 3)
        probe_data = native_loader.load(code, f"{name}_data", ["i64"])
        data = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.py_object)(probe_data.address)
        probe = np.arange(3, dtype=np.float32)
        if data(probe) != probe.ctypes.data:
            return None
        return cls(group, grp, program, detail)

    def _barrier_entry(self) -> _Entry | None:
        """A barrier's call: no bytes, the sum kernel over none, `{"coll": "barrier"}` (the segment path's header)."""
        grp = self.grp
        if self.group.world < 2 or not supported("sum", self._nothing.dtype):
            return None
        spin = min(grp.spin, SPIN_BASE_SECONDS) if grp.spin else 0.0
        return _Entry(host_reduce("sum", self._nothing.dtype, self.group.world, 1), 0, 0, {"coll": "barrier"}, spin,
                      self.group.world, self.group.rank)

    def _entry(self, x: np.ndarray, op: str, algorithm: str) -> _Entry | None:
        """The prepared call for x's shape and dtype, op and algorithm; None: the segment path takes it."""
        group, grp = self.group, self.grp
        if op not in _OPS or x.dtype.byteorder == ">" or not supported(op, x.dtype) or group.world < 2:
            return None
        if x.nbytes > min(FAST_MAX_BYTES, grp.slot_bytes):
            return None
        try:
            chosen, _ = resolve(algorithm, group.medium, group.world, x.nbytes)
        except ValueError:
            return None
        if chosen not in (Algorithm.NAIVE, Algorithm.ALL2ALL):
            return None
        threshold = grp.single_copy_bytes
        if chosen is Algorithm.ALL2ALL and threshold is not None and x.nbytes >= threshold:
            return None
        header = {"coll": "all_reduce", "op": op, "dtype": x.dtype.str, "shape": list(x.shape), "algorithm": chosen.value}
        kernel = host_reduce(op, x.dtype, group.world, 1)
        parts = host_reduce(op, x.dtype, group.world, 2) if chosen is Algorithm.ALL2ALL else None
        spin = min(grp.spin, SPIN_BASE_SECONDS + x.nbytes / SPIN_BYTES_PER_SECOND) if grp.spin else 0.0
        return _Entry(kernel, x.nbytes, x.size, header, spin, group.world, group.rank, parts)

    def all_reduce(self, x: Any, op: str = "sum", algorithm: str = "auto", out: Any = None) -> np.ndarray | None:
        if type(x) is not np.ndarray or (out is not None and out is not x):
            return None
        key = (x.shape, x.dtype, op, algorithm)
        try:
            entry = self.entries[key]
        except KeyError:
            if len(self.entries) > 256:
                self.entries.clear()
            entry = self.entries[key] = self._entry(x, op, algorithm)
        if entry is None or tracing.active_tracer() is not None:
            return None
        result = x if out is not None else np.empty(x.shape, x.dtype)
        # `_run`, inlined: its call and argument tuple were 1 Python call and 15 of 158 bytecodes a call
        group, grp = self.group, self.grp
        with self.lock:
            if grp.raw is None or group._failure is not None:
                return None
            seq = group._seq + 1
            code = self.call(entry.address, x, result, seq << 3 | (grp.rounds + 1) & 1)
            if code == REFUSED:        # nothing happened: the segment path refuses or runs it
                return None
            group._seq = seq
            grp.rounds += 1
            if code == OK:
                grp.step += entry.steps
            else:
                self._finish(code, entry, x, result, seq, (x, op, algorithm, out))
            self.completed += 1
            return result

    def barrier(self) -> bool:
        """The barrier as one native call that moves no data (its digest is the barrier's), so a rank
        waiting in it spins as an allreduce does instead of sleeping in `ShmGroup.wait` whenever the
        host looks crowded; False: the segment path runs it. Why it matters: bench/allreduce.py times
        each allreduce after a barrier, and a rank woken late from the barrier's futex sleep (0.1-0.2 ms)
        made its partner's next allreduce wait as long."""
        entry = self._barrier
        if entry is None or tracing.active_tracer() is not None:
            return False
        if not self._run(entry, self._nothing, self._nothing, ()):
            return False
        self.barriers += 1
        return True

    def _run(self, entry: _Entry, x: np.ndarray, result: np.ndarray, args: tuple[Any, ...]) -> bool:
        """One native call of `entry` under the group's lock; False where nothing ran (the segment path
        runs the call). `args`: the collective's arguments, for the header should the ranks disagree."""
        group, grp = self.group, self.grp
        with self.lock:
            if grp.raw is None or group._failure is not None:
                return False
            seq = group._seq + 1
            code = self.call(entry.address, x, result, seq << 3 | (grp.rounds + 1) & 1)
            if code == REFUSED:        # nothing happened: the segment path refuses or runs it
                return False
            group._seq = seq
            grp.rounds += 1
            if code == OK:
                grp.step += entry.steps
            else:
                self._finish(code, entry, x, result, seq, args)
            return True

    def _finish(self, code: int, entry: _Entry, x: np.ndarray, result: np.ndarray, seq: int,
                args: tuple[Any, ...]) -> None:
        """A call the native function did not complete: a lost post, a wait handed over (returns once
        the call completed), a mismatch (raises it)."""
        group, grp = self.group, self.grp
        collective = entry.header["coll"]
        name = f"{collective} (call #{seq})"
        deadline = time.monotonic() + settings.COLLECTIVE_TIMEOUT
        if code == POST_FAILED:
            raise group._abandoned(name, grp.abandoned(int(self.detail[0])), True) from None
        grp.step += 1
        if code in (NOT_YET, POISONED):
            self._wait(name, grp.step, deadline)
            code = self.call(entry.address, x, result, seq << 3 | 2 | grp.rounds & 1)
            if code == POST_FAILED:      # all2all's second post
                raise group._abandoned(name, grp.abandoned(int(self.detail[0])), True) from None
            if code == OK:
                grp.step += entry.steps - 1
                return
        if code == WAIT2:      # all2all's second step posted, a peer's not seen: wait, then copy out
            grp.step += 1
            self._wait(name, grp.step, deadline)
            code = self.call(entry.address, x, result, seq << 3 | 4 | grp.rounds & 1)
            if code == OK:
                return
        if code != MISMATCH:   # pragma: no cover - the native function returns no other code once posted
            raise CollectiveError(f"{name}: the native allreduce returned {code}")
        # deferred: calls -> shm_algorithms -> this module, so a top-level import would be a cycle
        from tinydist.dist import calls
        header = {"seq": seq, **calls.PREPARE[collective](group, *args).header}
        explain(group, name, header, deadline)

    def _wait(self, name: str, step: int, deadline: float) -> None:
        group = self.group
        try:
            self.grp.wait(step, deadline, group._check_waiting)
        except WaitTimeout as exc:
            raise group._timed_out(name, exc.ranks, True) from None
        except Abandoned as exc:
            raise group._abandoned(name, exc, True) from None


def explain(group: ProcessGroup, name: str, header: dict[str, Any], deadline: float) -> NoReturn:
    """The step every rank takes when the round's digests disagree and one of them is a fast call's:
    each writes its full header, and each raises the same CollectiveMismatch from all of them."""
    grp = group.shm
    assert grp is not None
    blob = json.dumps(header).encode()
    parity = grp.next_round()
    grp.write_header(parity, blob)
    try:
        grp.wait(grp.post(), deadline, group._check_waiting)
    except WaitTimeout as exc:
        raise group._timed_out(name, exc.ranks, False) from None
    except Abandoned as exc:
        raise group._abandoned(name, exc, False) from None
    blobs = {r: blob if r == grp.rank else grp.read_header(r, parity) for r in range(grp.world)}
    group._agree(name, header, blob, blobs)
    raise CollectiveMismatch(f"{name}: the ranks' calls differ (their digests do), though their headers agree: "
                             + "; ".join(f"rank {r} {b.decode(errors='replace')}" for r, b in sorted(blobs.items())))


def _digests(grp: ShmGroup, parity: int) -> np.ndarray | None:
    raw = grp.raw
    if raw is None:
        return None
    return np.ndarray((grp.world,), np.uint64, buffer=raw, offset=8 * (DIGEST_WORD + parity), strides=(CONTROL_BYTES,))


def clear_digest(grp: ShmGroup, parity: int) -> None:
    """The segment path's digest: 0, which no fast call's is (`FAST_BIT`)."""
    words = _digests(grp, parity)
    if words is not None:
        words[grp.rank] = 0


def fast_peer(grp: ShmGroup, parity: int) -> bool:
    """Whether a peer's digest of this round says it took the fast path (then its header is not written)."""
    words = _digests(grp, parity)
    return words is not None and any(int(words[r]) & FAST_BIT for r in grp.peers)

