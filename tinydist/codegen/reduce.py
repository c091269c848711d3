"""LLVM IR for an elementwise reduction of k sources into one or two destinations, in one pass:

    void @<name>(ptr d0[, ptr d1], ptr s0, ..., ptr s{k-1}, i64 n)
    d0[i] (= d1[i]) = ((s0[i] op s1[i]) op s2[i]) ... op s{k-1}[i]     for i < n

The sources are combined in argument order, one element at a time, as numpy's binary ufuncs do
(`np.add(s0, s1)`, then `np.add(acc, s2)`, ...): no reassociation, so a float sum is bitwise the
one numpy computes. The body works on 64-byte vectors (one cache line, an AVX-512 register) stored
at 64-byte boundaries of d0, between a scalar head and tail. No pointer is `noalias`: the collectives reduce in place (d0 is s0), and every
vector is loaded before it is stored, so an exact alias is well defined.

Compiled: sum and prod for float32/float64 and every integer width (wrapping, as numpy's), max and
min for integers. Float max/min stay with numpy: its NaN and signed-zero rules differ between its
own scalar and SIMD loops, and matching them buys nothing a collective needs.
"""

from __future__ import annotations

import numpy as np

from tinydist.graph.reduce_ops import REDUCE_OPS, ReduceOp

VECTOR_BYTES = 64
_FLOATS = {"f4": "float", "f8": "double"}
_INTS = {1: "i8", 2: "i16", 4: "i32", 8: "i64"}


def llvm_type(dtype: np.dtype) -> str | None:
    """The LLVM element type for `dtype`, or None when it is not compiled."""
    if dtype.kind == "f":
        return _FLOATS.get(dtype.str[1:])
    if dtype.kind in "iu":
        return _INTS[dtype.itemsize]
    return None


def supported(op: str, dtype: np.dtype) -> bool:
    """Whether `reduce_ir` compiles `op` over `dtype` (otherwise the caller uses numpy)."""
    if llvm_type(dtype) is None or dtype.byteorder == ">":
        return False
    return op in REDUCE_OPS and ReduceOp(op).llvm(dtype.kind) is not None


def _combine(op: str, dtype: np.dtype, ty: str, mask: str, a: str, b: str, out: str) -> str:
    """IR lines setting %out to `a op b` (operands of type `ty`, scalar or vector; `mask`: i1 of that shape)."""
    instruction = ReduceOp(op).llvm(dtype.kind)
    if op in (ReduceOp.SUM, ReduceOp.PROD):
        return f"  %{out} = {instruction} {ty} {a}, {b}\n"
    return f"  %{out}_c = icmp {instruction} {ty} {a}, {b}\n  %{out} = select {mask} %{out}_c, {ty} {a}, {ty} {b}\n"


def _body(op: str, dtype: np.dtype, ty: str, mask: str, sources: int, outputs: int, index: str, prefix: str) -> str:
    """Load every source at element `index`, combine in order, store to every destination."""
    scalar = llvm_type(dtype)
    lines = []
    for j in range(sources):
        lines.append(f"  %{prefix}p{j} = getelementptr inbounds {scalar}, ptr %s{j}, i64 {index}\n")
        lines.append(f"  %{prefix}v{j} = load {ty}, ptr %{prefix}p{j}, align {dtype.itemsize}\n")
    acc = f"%{prefix}v0"
    for j in range(1, sources):
        lines.append(_combine(op, dtype, ty, mask, acc, f"%{prefix}v{j}", f"{prefix}a{j}"))
        acc = f"%{prefix}a{j}"
    for d in range(outputs):
        lines.append(f"  %{prefix}q{d} = getelementptr inbounds {scalar}, ptr %d{d}, i64 {index}\n")
        lines.append(f"  store {ty} {acc}, ptr %{prefix}q{d}, align {dtype.itemsize}\n")
    return "".join(lines)


def signature(sources: int, outputs: int) -> tuple[str, ...]:
    """The loader's argument kinds: the destinations, the sources, the element count."""
    return ("w",) * outputs + ("r",) * sources + ("i64",)


def reduce_ir(name: str, op: str, dtype: np.dtype, sources: int, outputs: int) -> str:
    """The IR of the kernel above; `supported(op, dtype)` must hold, 2 <= sources, outputs in (1, 2)."""
    scalar = llvm_type(dtype)
    if scalar is None or not supported(op, dtype):
        raise ValueError(f"reduce_ir: {op} over {dtype} is not compiled (see tinydist.codegen.reduce)")
    if sources < 2 or outputs not in (1, 2):
        raise ValueError(f"reduce_ir: needs >= 2 sources and 1 or 2 outputs, got {sources} and {outputs}")
    lanes = VECTOR_BYTES // dtype.itemsize
    vector = f"<{lanes} x {scalar}>"
    params = ", ".join([f"ptr %d{d}" for d in range(outputs)] + [f"ptr %s{j}" for j in range(sources)] + ["i64 %n"])
    return f"""
define void @{name}({params}) {{
entry:
  ; scalar head up to the first 64-byte boundary of d0 (none when d0 is not element-aligned), so
  ; the stream to the result never splits a vector store across two cache lines
  %address = ptrtoint ptr %d0 to i64
  %misaligned = and i64 %address, 63
  %to_boundary = sub i64 64, %misaligned
  %boundary_bytes = and i64 %to_boundary, 63
  %element_rest = and i64 %address, {dtype.itemsize - 1}
  %element_aligned = icmp eq i64 %element_rest, 0
  %head_elements = udiv i64 %boundary_bytes, {dtype.itemsize}
  %head_wanted = select i1 %element_aligned, i64 %head_elements, i64 0
  %short = icmp ult i64 %n, %head_wanted
  %head = select i1 %short, i64 %n, i64 %head_wanted
  %rest = sub i64 %n, %head
  %blocks = udiv i64 %rest, {lanes}
  %body_elements = mul i64 %blocks, {lanes}
  %tail_start = add i64 %head, %body_elements
  %any_head = icmp ne i64 %head, 0
  br i1 %any_head, label %head_loop, label %body_check
head_loop:
  %h = phi i64 [0, %entry], [%h_next, %head_loop]
{_body(op, dtype, scalar, "i1", sources, outputs, "%h", "h")}  %h_next = add nuw i64 %h, 1
  %h_done = icmp eq i64 %h_next, %head
  br i1 %h_done, label %body_check, label %head_loop
body_check:
  %any_body = icmp ne i64 %blocks, 0
  br i1 %any_body, label %body, label %tail_check
body:
  %b = phi i64 [0, %body_check], [%b_next, %body]
  %b_offset = mul i64 %b, {lanes}
  %at = add i64 %head, %b_offset
{_body(op, dtype, vector, f"<{lanes} x i1>", sources, outputs, "%at", "b")}  %b_next = add nuw i64 %b, 1
  %b_done = icmp eq i64 %b_next, %blocks
  br i1 %b_done, label %tail_check, label %body
tail_check:
  %any_tail = icmp ult i64 %tail_start, %n
  br i1 %any_tail, label %tail, label %exit
tail:
  %i = phi i64 [%tail_start, %tail_check], [%i_next, %tail]
{_body(op, dtype, scalar, "i1", sources, outputs, "%i", "t")}  %i_next = add nuw i64 %i, 1
  %i_done = icmp eq i64 %i_next, %n
  br i1 %i_done, label %exit, label %tail
exit:
  ret void
}}
"""
