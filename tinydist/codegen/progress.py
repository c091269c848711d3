"""The progress word a native kernel publishes, so the hang rule can tell a long kernel from a stuck one.

Every generated kernel of at least PUBLISH_ELEMENTS elements (and every matmul) owns one exported
i64 global, `<entry>_progress`; a smaller one is unchanged. Its outermost loop is strip-mined into blocks of about PUBLISH_ELEMENTS of work and stores the block index before each
(matmul: a running count of its outer MC x KC x NC blocks), with a monotonic atomic store: a plain
`mov` on x86-64 and aarch64, which LLVM may not hoist out of the loop or drop. The cost, measured
A/B on the hot kernels, is in `bench/progress.py`. A device sums the words of
the programs it loaded (`tinydist.runtime.cpu.device`) and the timeline watchdog counts a change in
that sum as progress (`tinydist.runtime.timeline`). The words are per program, not per launch: two
devices running the same kernel at once share its word (a store races another, and either value
is progress), so one of them stuck while the other runs that same kernel is seen only when that
other finishes.
"""

from __future__ import annotations

from llvmlite import ir

I64 = ir.IntType(64)
SUFFIX = "_progress"
# Elements of a kernel's iteration space between two publications of its outermost loop: ~0.1-1 ms
# of work, so hundreds of publications a second at any size; a smaller kernel publishes nothing.
PUBLISH_ELEMENTS = 1 << 20


def symbol(entry: str) -> str:
    """The name of the progress word of the kernel whose entry point is `entry`."""
    return entry + SUFFIX


def word(module: ir.Module, entry: str) -> ir.GlobalVariable:
    """`entry`'s progress word in `module` (defined on first use, zero-initialised, exported)."""
    name = symbol(entry)
    existing = module.globals.get(name)
    if isinstance(existing, ir.GlobalVariable):
        return existing
    variable = ir.GlobalVariable(module, I64, name)
    variable.initializer = ir.Constant(I64, 0)
    variable.align = 64  # its own cache line: the kernel's stores do not evict the data it works on
    return variable


def publish(builder: ir.IRBuilder, variable: ir.GlobalVariable, value: ir.Value) -> None:
    """Store `value` into the progress word: one relaxed store, kept in the loop."""
    builder.store_atomic(value, variable, "monotonic", 8)


def bump(builder: ir.IRBuilder, variable: ir.GlobalVariable) -> None:
    """Add one to the progress word (a relaxed load and store, not a locked read-modify-write:
    a lost increment between threads is still a change)."""
    current = builder.load_atomic(variable, "monotonic", 8)
    publish(builder, variable, builder.add(current, ir.Constant(I64, 1)))
