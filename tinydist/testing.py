"""Small hand-written kernels shared by tests and benchmarks (not used by the engine itself).

Symbol names must be unique per process (the loader refuses a second object defining the same
one), so every kernel takes its name as an argument.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir

from tinydist.codegen import transcendental

SCALE_SIGNATURE = ("w", "r", "f32", "i64")
SAXPY_SIGNATURE = ("rw", "r", "f32", "i64")


def scale_ir(name: str) -> str:
    """`void name(float* out, const float* in, float a, i64 n)`: out[i] = a * in[i]."""
    return f"""
define void @{name}(ptr noalias %out, ptr noalias readonly %in, float %a, i64 %n) {{
entry:
  %empty = icmp eq i64 %n, 0
  br i1 %empty, label %exit, label %loop
loop:
  %i = phi i64 [0, %entry], [%next, %loop]
  %pin = getelementptr inbounds float, ptr %in, i64 %i
  %pout = getelementptr inbounds float, ptr %out, i64 %i
  %v = load float, ptr %pin
  %r = fmul float %a, %v
  store float %r, ptr %pout
  %next = add nuw i64 %i, 1
  %done = icmp eq i64 %next, %n
  br i1 %done, label %exit, label %loop
exit:
  ret void
}}
"""


def saxpy_ir(name: str) -> str:
    """`void name(float* y, const float* x, float a, i64 n)`: y[i] = a * x[i] + y[i]."""
    return f"""
define void @{name}(ptr noalias %y, ptr noalias readonly %x, float %a, i64 %n) {{
entry:
  %empty = icmp eq i64 %n, 0
  br i1 %empty, label %exit, label %loop
loop:
  %i = phi i64 [0, %entry], [%next, %loop]
  %px = getelementptr inbounds float, ptr %x, i64 %i
  %py = getelementptr inbounds float, ptr %y, i64 %i
  %vx = load float, ptr %px
  %vy = load float, ptr %py
  %ax = fmul contract float %a, %vx
  %r = fadd contract float %ax, %vy
  store float %r, ptr %py
  %next = add nuw i64 %i, 1
  %done = icmp eq i64 %next, %n
  br i1 %done, label %exit, label %loop
exit:
  ret void
}}
"""


def spin_ir(name: str) -> str:
    """`void name(double* x, i64 n, i64 iters)`: x[i] <- x[i] * 0.75 + 1.0, `iters` times per element
    (one dependent chain each, so the time scales with iters; the fixed point is 4.0)."""
    return f"""
define void @{name}(ptr noalias %x, i64 %n, i64 %iters) {{
entry:
  %empty = icmp eq i64 %n, 0
  br i1 %empty, label %exit, label %outer
outer:
  %i = phi i64 [0, %entry], [%inext, %outer_end]
  %p = getelementptr inbounds double, ptr %x, i64 %i
  %x0 = load double, ptr %p
  %noiter = icmp eq i64 %iters, 0
  br i1 %noiter, label %outer_end, label %inner
inner:
  %k = phi i64 [0, %outer], [%knext, %inner]
  %acc = phi double [%x0, %outer], [%acc2, %inner]
  %m = fmul double %acc, 7.500000e-01
  %acc2 = fadd double %m, 1.000000e+00
  %knext = add nuw i64 %k, 1
  %kdone = icmp eq i64 %knext, %iters
  br i1 %kdone, label %outer_end, label %inner
outer_end:
  %res = phi double [%x0, %outer], [%acc2, %inner]
  store double %res, ptr %p
  %inext = add nuw i64 %i, 1
  %idone = icmp eq i64 %inext, %n
  br i1 %idone, label %exit, label %outer
exit:
  ret void
}}
"""


def transcendental_ir(function: str, dtype: type, name: str) -> tuple[str, int]:
    """`void name(T* out, const T* in[, const T* in2], i64 n)` applying transcendental.<function>
    elementwise; returns (IR text, number of inputs)."""
    fty = ir.FloatType() if dtype == np.float32 else ir.DoubleType()
    arity = 2 if function == "pow" else 1
    module = ir.Module()
    ptr, i64 = ir.PointerType(), ir.IntType(64)
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [ptr] * (1 + arity) + [i64]), name)
    out, *ins, n = fn.args
    for a in (out, *ins):
        a.add_attribute("noalias")
    entry_bb, loop_bb, exit_bb = (fn.append_basic_block(s) for s in ("entry", "loop", "exit"))
    b = ir.IRBuilder(entry_bb)
    b.cbranch(b.icmp_signed(">", n, i64(0)), loop_bb, exit_bb)
    b.position_at_end(loop_bb)
    i = b.phi(i64)
    i.add_incoming(i64(0), entry_bb)
    args = [b.load(b.gep(p, [i], source_etype=fty), typ=fty) for p in ins]
    b.store(getattr(transcendental, function)(b, *args), b.gep(out, [i], source_etype=fty))
    nxt = b.add(i, i64(1))
    i.add_incoming(nxt, loop_bb)
    b.cbranch(b.icmp_signed("<", nxt, n), loop_bb, exit_bb)
    b.position_at_end(exit_bb)
    b.ret_void()
    return str(module), arity
