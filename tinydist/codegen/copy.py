"""LLVM IR for a streaming memory copy: `void @<name>(ptr noalias dst, ptr noalias src, i64 nbytes)`.

Bytes are copied one at a time up to the first 64-byte boundary of `dst`, then in 64-byte vectors
(unaligned loads, aligned non-temporal stores), then the remaining tail bytes. Non-temporal stores
write whole lines without first reading them into the cache, so a copy much larger than the
last-level cache moves each byte across the memory bus twice (read, write) instead of three times
(read, read-for-ownership, write) and does not evict what other devices' kernels are using. They
are weakly ordered: the copy ends with a fence, before its queue signals completion.
"""

from __future__ import annotations

SIGNATURE = ("w", "r", "i64")


def _byte_loop(label: str, first: str, end: str, exit: str, entry: str) -> str:
    """Bytes [first, end) one at a time (first < end), entered from block `entry`, then `exit`."""
    return f"""{label}:
  %{label}_i = phi i64 [{first}, %{entry}], [%{label}_next, %{label}]
  %{label}_s = getelementptr inbounds i8, ptr %src, i64 %{label}_i
  %{label}_d = getelementptr inbounds i8, ptr %dst, i64 %{label}_i
  %{label}_v = load i8, ptr %{label}_s, align 1
  store i8 %{label}_v, ptr %{label}_d, align 1
  %{label}_next = add nuw i64 %{label}_i, 1
  %{label}_done = icmp eq i64 %{label}_next, {end}
  br i1 %{label}_done, label %{exit}, label %{label}
"""


def stream_copy_ir(name: str) -> str:
    return f"""
define void @{name}(ptr noalias %dst, ptr noalias readonly %src, i64 %n) {{
entry:
  %address = ptrtoint ptr %dst to i64
  %misaligned = and i64 %address, 63
  %to_boundary = sub i64 64, %misaligned
  %head_wanted = and i64 %to_boundary, 63
  %short = icmp ult i64 %n, %head_wanted
  %head = select i1 %short, i64 %n, i64 %head_wanted
  %rest = sub i64 %n, %head
  %blocks = lshr i64 %rest, 6
  %body_bytes = shl i64 %blocks, 6
  %tail_start = add i64 %head, %body_bytes
  %any_head = icmp ne i64 %head, 0
  br i1 %any_head, label %head_loop, label %body_check
{_byte_loop("head_loop", "0", "%head", "body_check", "entry")}
body_check:
  %any_body = icmp ne i64 %blocks, 0
  br i1 %any_body, label %body_loop, label %tail_check
body_loop:
  %b = phi i64 [0, %body_check], [%b_next, %body_loop]
  %b_offset = shl i64 %b, 6
  %at = add i64 %head, %b_offset
  %bs = getelementptr inbounds i8, ptr %src, i64 %at
  %bd = getelementptr inbounds i8, ptr %dst, i64 %at
  %bv = load <16 x i32>, ptr %bs, align 1
  store <16 x i32> %bv, ptr %bd, align 64, !nontemporal !0
  %b_next = add nuw i64 %b, 1
  %b_done = icmp eq i64 %b_next, %blocks
  br i1 %b_done, label %tail_check, label %body_loop
tail_check:
  %any_tail = icmp ult i64 %tail_start, %n
  br i1 %any_tail, label %tail_loop, label %exit
{_byte_loop("tail_loop", "%tail_start", "%n", "exit", "tail_check")}
exit:
  fence seq_cst
  ret void
}}

!0 = !{{i32 1}}
"""
