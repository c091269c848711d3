"""A dtype's LLVM types, and moving a value between its register and its memory form.

bool is i1 in registers and a byte in memory; float16 is a float in registers and its 16 bits in
memory, converted in hardware where the target has it (x86 F16C, AArch64, NVPTX) and else in
integer ops (the JIT cannot resolve LLVM's __truncsfhf2 libcall); bfloat16 is the top half of a
float32. numpy's float16 loops compute in float32 and round after each op, as `round_narrow`
does. Constants and the reduce identities are written here too: a float16 constant holds a
float16 value, an unsigned one past the signed range its two's complement.

Shared by the CPU lowering (`tinydist.codegen.lowering`), its elementwise rules
(`tinydist.codegen.alu`) and the NVPTX lowering (`tinydist.codegen.ptx`).
"""

from __future__ import annotations

import functools
from typing import Any

from llvmlite import ir

from tinydist.graph import dtypes
from tinydist.graph.dtypes import DType

I1, I8, I16, I32, I64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F16, F32, F64 = ir.HalfType(), ir.FloatType(), ir.DoubleType()


# A dtype's register type, and (where it differs) its memory type: bool is i1 in registers and a
# byte in memory; float16 is a float in registers and its 16 bits in memory (numpy's float16 loops
# compute in float32 and round after each op, as `round_narrow` does here).
_REGISTER: dict[DType, ir.Type] = {dtypes.float16: F32, dtypes.float32: F32, dtypes.float64: F64,
                                   dtypes.int8: I8, dtypes.int16: I16, dtypes.int32: I32, dtypes.int64: I64,
                                   dtypes.uint8: I8, dtypes.uint16: I16, dtypes.uint32: I32, dtypes.uint64: I64,
                                   dtypes.bool_: I1}
_MEMORY: dict[DType, ir.Type] = {**_REGISTER, dtypes.bool_: I8, dtypes.float16: I16}


def llvm_type(dtype: DType, in_memory: bool = False, width: int | None = None) -> ir.Type:
    scalar = (_MEMORY if in_memory else _REGISTER).get(dtype) or (I16 if in_memory else F32)  # (bfloat16: registered late)
    assert dtype.is_narrow_float or dtype in _REGISTER, dtype
    return ir.VectorType(scalar, width) if width else scalar


def shaped(like: ir.Type, scalar: ir.Type) -> ir.Type:
    """`scalar`, as a vector of as many lanes as `like` when `like` is a vector."""
    return ir.VectorType(scalar, like.count) if isinstance(like, ir.VectorType) else scalar


@functools.cache
def _host_converts_half() -> bool:
    """Whether the host CPU converts float <-> half in hardware (x86 F16C, every AArch64). Without
    it LLVM lowers `fptrunc float to half` to a libcall (__truncsfhf2) the JIT cannot resolve."""
    from tinydist.codegen.compiler import host_target
    target = host_target()
    return "+f16c" in target.features.split(",") or target.triple.startswith(("aarch64", "arm64"))


def _native_half(b: ir.IRBuilder) -> bool:
    return b.module.triple.startswith("nvptx") or _host_converts_half()


def from_memory(b: ir.IRBuilder, value: ir.Value, dtype: DType) -> ir.Value:
    """A value loaded from memory in its register type (bool: i8 → i1; float16: its bits → float)."""
    if dtype is dtypes.bool_:
        return b.icmp_unsigned("!=", value, splat(value.type, 0))
    if dtype is dtypes.float16:
        if _native_half(b):
            return b.fpext(b.bitcast(value, shaped(value.type, F16)), shaped(value.type, F32))
        return _half_bits_to_float(b, value)
    if dtype.is_narrow_float:  # bfloat16: the top half of a float32
        return b.bitcast(b.shl(b.zext(value, shaped(value.type, I32)), splat(shaped(value.type, I32), 16)),
                         shaped(value.type, F32))
    return value


def to_memory(b: ir.IRBuilder, value: ir.Value, dtype: DType) -> ir.Value:
    """A register value in its memory type (bool: i1 → i8; float16: float → its bits, rounded to nearest even)."""
    if dtype is dtypes.bool_:
        return b.zext(value, shaped(value.type, I8))
    if dtype is dtypes.float16:
        if _native_half(b):
            return b.bitcast(b.fptrunc(value, shaped(value.type, F16)), shaped(value.type, I16))
        return _float_to_half_bits(b, value)
    if dtype.is_narrow_float:
        return _float_to_bfloat16_bits(b, value)
    return value


def _float_to_bfloat16_bits(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """float32 → bfloat16 bits rounded to nearest even (ml_dtypes' rule): add 0x7fff plus the kept
    part's last bit, keep the top 16 bits; a NaN stays a quiet NaN of its sign."""
    t32 = shaped(x.type, I32)
    bits = b.bitcast(x, t32)
    odd = b.and_(b.lshr(bits, splat(t32, 16)), splat(t32, 1))
    rounded = b.lshr(b.add(b.add(bits, splat(t32, 0x7FFF)), odd), splat(t32, 16))
    quiet = b.or_(b.lshr(bits, splat(t32, 16)), splat(t32, 0x40))
    return b.trunc(b.select(b.fcmp_unordered("uno", x, x), quiet, rounded), shaped(x.type, I16))


def _half_bits_to_float(b: ir.IRBuilder, h: ir.Value) -> ir.Value:
    """float16 bits → float32, exactly, in integer ops (F. Giesen's half_to_float: subnormals
    renormalised by a float subtraction, infinities and NaNs re-biased)."""
    t32 = shaped(h.type, I32)
    wide = b.zext(h, t32)
    o = b.shl(b.and_(wide, splat(t32, 0x7FFF)), splat(t32, 13))
    exp = b.and_(o, splat(t32, 0x7C00 << 13))
    o = b.add(o, splat(t32, (127 - 15) << 23))
    special = b.add(o, splat(t32, (128 - 16) << 23))
    tiny = b.fsub(b.bitcast(b.add(o, splat(t32, 1 << 23)), shaped(h.type, F32)), splat(shaped(h.type, F32), 2.0 ** -14))
    o = b.select(b.icmp_unsigned("==", exp, splat(t32, 0x7C00 << 13)), special, o)
    o = b.select(b.icmp_unsigned("==", exp, splat(t32, 0)), b.bitcast(tiny, t32), o)
    o = b.or_(o, b.shl(b.and_(wide, splat(t32, 0x8000)), splat(t32, 16)))
    return b.bitcast(o, shaped(h.type, F32))


def _float_to_half_bits(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """float32 → float16 bits rounded to nearest even, in integer ops (F. Giesen's
    float_to_half_fast3_rtne: subnormals rounded by adding 0.5 as a float, normals by adding
    0xfff plus the kept mantissa's last bit)."""
    t32, f32 = shaped(x.type, I32), shaped(x.type, F32)
    bits = b.bitcast(x, t32)
    sign = b.and_(bits, splat(t32, -(1 << 31)))
    f = b.xor(bits, sign)
    overflow = b.select(b.icmp_unsigned(">", f, splat(t32, 255 << 23)), splat(t32, 0x7E00), splat(t32, 0x7C00))
    magic = splat(t32, 126 << 23)  # 0.5
    subnormal = b.sub(b.bitcast(b.fadd(b.bitcast(f, f32), b.bitcast(magic, f32)), t32), magic)
    odd = b.and_(b.lshr(f, splat(t32, 13)), splat(t32, 1))
    normal = b.lshr(b.add(b.add(f, splat(t32, ((15 - 127) << 23) + 0xFFF)), odd), splat(t32, 13))
    o = b.select(b.icmp_unsigned("<", f, splat(t32, 113 << 23)), subnormal, normal)
    o = b.select(b.icmp_unsigned(">=", f, splat(t32, (127 + 16) << 23)), overflow, o)
    return b.trunc(b.or_(o, b.lshr(sign, splat(t32, 16))), shaped(x.type, I16))


def round_narrow(b: ir.IRBuilder, value: ir.Value, dtype: DType) -> ir.Value:
    """A float32 register rounded to `dtype`'s precision and range (float16), kept in float32."""
    return from_memory(b, to_memory(b, value, dtype), dtype) if dtype.is_narrow_float else value


def splat(t: ir.Type, value: Any) -> ir.Constant:
    """`value` as a constant of type `t`, repeated in every lane when `t` is a vector."""
    if isinstance(t, ir.VectorType):
        return ir.Constant(t, [value] * t.count)
    return ir.Constant(t, value)


def constant(dtype: DType, value: Any, width: int | None = None) -> ir.Constant:
    t = llvm_type(dtype, width=width)
    if dtype.is_float:  # a float16 constant holds a float16 value (in its float32 register)
        return splat(t, float(dtype.np.type(value)) if dtype.is_narrow_float else float(value))
    if dtype.is_bool:
        return splat(t, int(bool(value)))
    bits = dtype.itemsize * 8  # unsigned values past the signed range are written as their two's complement
    wrapped = int(value) & ((1 << bits) - 1)
    return splat(t, wrapped - (1 << bits) if wrapped >> (bits - 1) else wrapped)


def identity(op: str, dtype: DType) -> ir.Constant:
    if op == "sum":
        return constant(dtype, 0)
    if op == "prod":
        return constant(dtype, 1)
    if dtype.is_float:
        return constant(dtype, float("-inf") if op == "max" else float("inf"))
    if dtype.is_unsigned:
        return constant(dtype, 0 if op == "max" else -1)
    info = (1 << (dtype.itemsize * 8 - 1))
    return constant(dtype, -info if op == "max" else info - 1)
