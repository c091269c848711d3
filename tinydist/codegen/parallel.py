"""IR for intra-op parallelism: a pool of native workers, and a capture's entry point whose phases
any of the pool's threads may take pieces of.

A pool of T threads (the caller's and T - 1 workers) shares a control block of host memory
(owned by `tinydist.runtime.cpu.workers`). A worker runs `worker_ir`'s loop for the life of the
pool: it waits for the block's generation word to move, then calls the frame's work function
(the block's TABLE word) with the frame's number, and waits again. A parallel entry point
(`entry_ir`) tags its phase counters with the next frame's number, stores its work function,
moves the generation (waking the workers that sleep) and works itself.

A frame is a list of phases, a phase a list of pieces (a piece: calls one thread runs in order).
Every thread claims the current phase's pieces one at a time from a counter (compare-and-swap)
and runs them; when none is left it waits until all are done, then goes on to the next phase.
Nothing waits for a thread that has not arrived: on a machine whose cores are shared, a
descheduled worker only means the others take its pieces (a barrier of all T threads measured
up to 8x slower than one thread here when a peer lost its core: convnext at batch 8, load 11). A
counter holds the frame's number in its high half, so a worker still in an earlier frame finds
the tag changed and skips to the end; a frame's entry point returns only when every piece of
its last phase is done, so every piece of the frame has finished then.

Waits spin first (the next phase is usually microseconds away; a futex round trip costs a few
microseconds each side), then sleep on the futex, counting themselves in a sleepers word so that
whoever moves a word makes the wake-up system call only when someone sleeps. The counts are
sequentially consistent on both sides (a sleeper increments, then rereads the word; a waker moves
the word, then reads the count): one of them always sees the other, and a futex wait on a word
that already moved returns at once, so no wake-up is lost.

No timeout: a pool's threads run only the kernels of captures made for it, which the hang rule
already watches through their progress words; a thread waiting on a phase waits on a peer that
runs a kernel.
"""

from __future__ import annotations

import platform
from collections.abc import Sequence

from tinydist.codegen.stream_sync import _FUTEX_WAIT_PRIVATE, _FUTEX_WAKE_PRIVATE, _libc_addresses, futex_syscall

# word indices (int64) of the control block: the frame's number, its sleepers, the stop word, and
# the frame's work function
GENERATION, GENERATION_SLEEPERS, STOP, TABLE = 0, 1, 2, 3
CONTROL_WORDS = 8

# pause iterations a wait spins before it sleeps: ~25-50 µs on a 3-4 GHz core (a pause is tens of
# cycles on current x86), longer than the gap between two phases of a frame, shorter than a
# scheduler tick a sleeping peer would cost
SPINS = 2000


def _pause() -> tuple[str, str]:
    """The spin-wait hint of this machine: (declaration, call)."""
    machine = platform.machine()
    if machine in ("x86_64", "AMD64"):
        return "declare void @llvm.x86.sse2.pause()", "call void @llvm.x86.sse2.pause()"
    if machine in ("aarch64", "arm64"):
        return "declare void @llvm.aarch64.hint(i32)", "call void @llvm.aarch64.hint(i32 1)"
    return "", ""


def _word(control: int, index: int) -> str:
    return f"ptr inttoptr (i64 {control + 8 * index} to ptr)"


def _wait_ir(name: str, control: int, word: int, sleepers: int) -> list[str]:
    """`void @name(i64 seen)`: return once the word moved from `seen` (spin, then sleep)."""
    syscall, _ = _libc_addresses()
    futex = futex_syscall()
    _, pause = _pause()
    return [
        f"define internal void @{name}(i64 %seen) {{",
        "entry:",
        "  br label %spin",
        "spin:",
        "  %i = phi i64 [ 0, %entry ], [ %i1, %again ]",
        f"  %v = load atomic i64, {_word(control, word)} acquire, align 8",
        "  %moved = icmp ne i64 %v, %seen",
        "  br i1 %moved, label %done, label %again",
        "again:",
        f"  {pause}",
        "  %i1 = add i64 %i, 1",
        f"  %more = icmp ult i64 %i1, {SPINS}",
        "  br i1 %more, label %spin, label %sleep",
        "sleep:",
        f"  %s0 = atomicrmw add {_word(control, sleepers)}, i64 1 seq_cst",
        f"  %v2 = load atomic i64, {_word(control, word)} seq_cst, align 8",
        "  %moved2 = icmp ne i64 %v2, %seen",
        "  br i1 %moved2, label %awake, label %futex",
        "futex:",
        "  %low = and i64 %seen, 4294967295",  # the futex word is the counter's low half (little-endian)
        f"  %f = call i64 (i64, ...) inttoptr (i64 {syscall} to ptr)(i64 {futex}, {_word(control, word)}, "
        f"i64 {_FUTEX_WAIT_PRIVATE}, i64 %low, ptr null)",
        "  br label %awake",
        "awake:",
        f"  %s1 = atomicrmw sub {_word(control, sleepers)}, i64 1 seq_cst",
        f"  %v3 = load atomic i64, {_word(control, word)} acquire, align 8",
        "  %moved3 = icmp ne i64 %v3, %seen",
        "  br i1 %moved3, label %done, label %sleep",
        "done:",
        "  ret void",
        "}",
    ]


def _move_ir(name: str, control: int, word: int, sleepers: int, internal: bool = True) -> list[str]:
    """`void @name()`: move the word on by one; wake its sleepers if there are any."""
    syscall, _ = _libc_addresses()
    futex = futex_syscall()
    return [
        f"define {'internal ' if internal else ''}void @{name}() {{",
        "entry:",
        f"  %old = atomicrmw add {_word(control, word)}, i64 1 seq_cst",
        f"  %n = load atomic i64, {_word(control, sleepers)} seq_cst, align 8",
        "  %any = icmp ne i64 %n, 0",
        "  br i1 %any, label %wake, label %done",
        "wake:",
        f"  %f = call i64 (i64, ...) inttoptr (i64 {syscall} to ptr)(i64 {futex}, {_word(control, word)}, "
        f"i64 {_FUTEX_WAKE_PRIVATE}, i64 2147483647)",
        "  br label %done",
        "done:",
        "  ret void",
        "}",
    ]


def worker_ir(name: str, control: int) -> str:
    """`void @name(i64 slot)`: a worker's loop — wait for a frame, call the frame's work function
    with the frame's number, repeat — until the block's stop word is set; also `@name_post()`,
    which starts a frame (or the stop). `slot` names the worker (all run the same loop)."""
    if futex_syscall() is None:
        raise RuntimeError("intra-op workers need a futex (Linux on x86_64 or aarch64)")
    declare, _ = _pause()
    lines = [declare, *_wait_ir("wait_frame", control, GENERATION, GENERATION_SLEEPERS),
             *_move_ir(f"{name}_post", control, GENERATION, GENERATION_SLEEPERS, internal=False)]
    lines += [
        f"define void @{name}(i64 %slot) {{",
        "entry:",
        "  br label %loop",
        "loop:",
        "  %seen = phi i64 [ 0, %entry ], [ %now, %run ]",
        "  call void @wait_frame(i64 %seen)",
        f"  %now = load atomic i64, {_word(control, GENERATION)} acquire, align 8",
        f"  %stop = load atomic i64, {_word(control, STOP)} acquire, align 8",
        "  %stopped = icmp ne i64 %stop, 0",
        "  br i1 %stopped, label %out, label %run",
        "run:",
        f"  %fn = load atomic ptr, {_word(control, TABLE)} acquire, align 8",
        "  call void %fn(i64 %now)",
        "  br label %loop",
        "out:",
        "  ret void",
        "}",
    ]
    return "\n".join(lines) + "\n"


def _phase_ir(control: int) -> list[str]:
    """`void @phase(ptr claimed, ptr done, i64 pieces, i64 frame, ptr run)`: claim pieces of the
    phase and `run(index)` them until none is left, then wait until all are done. A counter word
    holds the frame's number in its high half and the count in its low half, so a thread still in
    an earlier frame (late to wake) finds the tag changed and does nothing."""
    syscall, _ = _libc_addresses()
    futex = futex_syscall()
    _, pause = _pause()
    sleepers = "ptr @sleepers"
    return [
        "@sleepers = internal global i64 0, align 64",
        "define internal void @phase(ptr %claimed, ptr %done, i64 %pieces, i64 %frame, ptr %run) {",
        "entry:",
        "  %tag = and i64 %frame, 4294967295",
        "  br label %claim",
        "claim:",
        "  %v = load atomic i64, ptr %claimed acquire, align 8",
        "  %vtag = lshr i64 %v, 32",
        "  %current = icmp eq i64 %vtag, %tag",
        "  br i1 %current, label %count, label %out",
        "count:",
        "  %c = and i64 %v, 4294967295",
        "  %left = icmp ult i64 %c, %pieces",
        "  br i1 %left, label %take, label %spin",
        "take:",
        "  %v1 = add i64 %v, 1",
        "  %x = cmpxchg ptr %claimed, i64 %v, i64 %v1 acq_rel acquire",
        "  %ok = extractvalue { i64, i1 } %x, 1",
        "  br i1 %ok, label %runit, label %claim",
        "runit:",
        "  call void %run(i64 %c)",
        "  %d0 = atomicrmw add ptr %done, i64 1 seq_cst",
        f"  %n = load atomic i64, {sleepers} seq_cst, align 8",
        "  %any = icmp ne i64 %n, 0",
        "  br i1 %any, label %wake, label %claim",
        "wake:",
        f"  %w = call i64 (i64, ...) inttoptr (i64 {syscall} to ptr)(i64 {futex}, ptr %done, "
        f"i64 {_FUTEX_WAKE_PRIVATE}, i64 2147483647)",
        "  br label %claim",
        "spin:",  # every piece is taken: wait until every piece is done
        "  %i = phi i64 [ 0, %count ], [ %i1, %again ], [ 0, %awake ]",
        "  %d = load atomic i64, ptr %done acquire, align 8",
        "  %dtag = lshr i64 %d, 32",
        "  %dcount = and i64 %d, 4294967295",
        "  %dcur = icmp eq i64 %dtag, %tag",
        "  %dmore = icmp ult i64 %dcount, %pieces",
        "  %busy = and i1 %dcur, %dmore",
        "  br i1 %busy, label %again, label %out",
        "again:",
        f"  {pause}",
        "  %i1 = add i64 %i, 1",
        f"  %more = icmp ult i64 %i1, {SPINS}",
        "  br i1 %more, label %spin, label %sleep",
        "sleep:",
        f"  %s0 = atomicrmw add {sleepers}, i64 1 seq_cst",
        "  %e = load atomic i64, ptr %done seq_cst, align 8",
        "  %etag = lshr i64 %e, 32",
        "  %ecount = and i64 %e, 4294967295",
        "  %ecur = icmp eq i64 %etag, %tag",
        "  %emore = icmp ult i64 %ecount, %pieces",
        "  %ebusy = and i1 %ecur, %emore",
        "  br i1 %ebusy, label %futex, label %awake",
        "futex:",
        "  %low = and i64 %e, 4294967295",  # the futex word is the counter's low half (little-endian)
        f"  %f = call i64 (i64, ...) inttoptr (i64 {syscall} to ptr)(i64 {futex}, ptr %done, "
        f"i64 {_FUTEX_WAIT_PRIVATE}, i64 %low, ptr null)",
        "  br label %awake",
        "awake:",
        f"  %s1 = atomicrmw sub {sleepers}, i64 1 seq_cst",
        "  br label %spin",
        "out:",
        "  ret void",
        "}",
    ]


def entry_ir(name: str, control: int, post: int, phases: Sequence[Sequence[Sequence[str]]]) -> str:
    """`void @name()`: one frame over the pool of `control` (`post`: its start function). Each
    phase is a list of pieces, each piece call instructions (`call void ...(...)` lines) run in
    order by one thread; any thread may take any piece of the current phase, and a phase starts
    when every piece of the one before is done. The calling thread takes pieces too, so a frame
    finishes even while every worker is descheduled (this machine's cores are shared)."""
    declare, _ = _pause()
    count = len(phases)
    lines = [declare, f"@claimed = internal global [{count} x i64] zeroinitializer, align 64",
             f"@done = internal global [{count} x i64] zeroinitializer, align 64", *_phase_ir(control)]
    for p, pieces in enumerate(phases):
        lines += [f"define internal void @run{p}(i64 %i) {{", "entry:",
                  "  switch i64 %i, label %end [" + " ".join(f"i64 {k}, label %piece{k}" for k in range(len(pieces))) + "]"]
        for k, piece in enumerate(pieces):
            lines += [f"piece{k}:", *(f"  {call}" for call in piece), "  br label %end"]
        lines += ["end:", "  ret void", "}"]
    lines += ["define internal void @work(i64 %frame) {", "entry:"]
    for p, pieces in enumerate(phases):
        lines += [f"  %c{p} = getelementptr [{count} x i64], ptr @claimed, i64 0, i64 {p}",
                  f"  %d{p} = getelementptr [{count} x i64], ptr @done, i64 0, i64 {p}",
                  f"  call void @phase(ptr %c{p}, ptr %d{p}, i64 {len(pieces)}, i64 %frame, ptr @run{p})"]
    lines += ["  ret void", "}"]
    lines += [
        f"define void @{name}() {{",
        "entry:",
        f"  %g = load atomic i64, {_word(control, GENERATION)} monotonic, align 8",  # only this thread moves it
        "  %frame = add i64 %g, 1",
        "  %tag = shl i64 %frame, 32",
    ]
    for p in range(count):
        lines += [f"  %c{p} = getelementptr [{count} x i64], ptr @claimed, i64 0, i64 {p}",
                  f"  store atomic i64 %tag, ptr %c{p} monotonic, align 8",
                  f"  %d{p} = getelementptr [{count} x i64], ptr @done, i64 0, i64 {p}",
                  f"  store atomic i64 %tag, ptr %d{p} monotonic, align 8"]
    lines += [
        f"  store atomic ptr @work, {_word(control, TABLE)} release, align 8",
        f"  call void inttoptr (i64 {post} to ptr)()",  # a seq_cst move: the stores above are seen first
        "  call void @work(i64 %frame)",
        "  ret void",
        "}",
    ]
    return "\n".join(lines) + "\n"
