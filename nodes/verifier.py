"""Verify client-supplied LLVM IR before the server compiles it with tinydist.codegen.

What a program may contain (everything else is refused with the reason):

- exactly one externally visible function, the entry, returning void, whose parameters match the
  declared signature ("r"/"w"/"rw" → ptr, "i64" → i64, "f64" → double, "f32" → float); any other
  function must be defined here with internal or private linkage;
- declarations only of allowlisted `llvm.*` intrinsics (math, min/max, bit ops, saturating casts,
  vector reductions, memset/memcpy/memmove, masked vector loads and stores: the matmul's edge
  tiles; they touch only the selected lanes at the address given, less than a plain vector load
  or store there would; prefetches: the matmul's packed-B stream; a hint that reads nothing into
  the program and cannot fault); no other external function, no external or writable
  global variable, no initializer that points at anything, no aliases or ifuncs;
- no inline or module-level assembly, no indirect calls, no invoke/callbr/landingpad/indirectbr,
  no address-space casts;
- engine kernels (the operator's kind) additionally: no ptrtoint/inttoptr, no atomics; a fence is
  allowed (the codegen's streaming stores end with one; it orders memory, it touches none).

What it cannot prove: that a kernel's loads and stores stay inside the buffers it is given. The
entry receives plain pointers, and a `getelementptr` by a scalar argument reaches any address (an
engine kernel needs no ptrtoint for that). The verifier removes escapes from the instruction set
(no calls out, no syscalls, no asm); the memory bound is the process: on host-memory devices every
kernel runs in its tenant's worker (`tinydist.nodes.tenants`), whose address space maps only that tenant's
buffers and whose seccomp filter leaves it no way to reach anything else (docs/remote.md).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

import llvmlite.binding as llvm

from tinydist.base.errors import TinydistError
from tinydist.codegen.compiler import _initialise_llvm
from tinydist.runtime.program import ARG_KINDS

ENGINE = "engine"
RAW = "raw"
MAX_IR_BYTES = 4 << 20

PARAM_TYPES = {"r": "ptr", "w": "ptr", "rw": "ptr", "i64": "i64", "f64": "double", "f32": "float"}

_INTRINSICS = re.compile(
    r"^llvm\.(fma|fmuladd|sqrt|fabs|floor|ceil|trunc|round|roundeven|rint|nearbyint|minnum|maxnum|minimum|"
    r"maximum|copysign|exp|exp2|exp10|log|log2|log10|sin|cos|pow|powi|ldexp|frexp|smax|smin|umax|umin|abs|"
    r"ctpop|ctlz|cttz|bswap|bitreverse|fshl|fshr|fptosi\.sat|fptoui\.sat|is\.fpclass|"
    r"[su](add|sub|mul)\.with\.overflow|[su](add|sub)\.sat|vector\.reduce\.[a-z]+|memset|memcpy|memmove|"
    r"masked\.(load|store)|prefetch|assume|lifetime\.(start|end)|experimental\.noalias\.scope\.decl)(\.[A-Za-z0-9_.]+)?$")

_BASE_OPCODES = frozenset("""
ret br switch unreachable fneg add fadd sub fsub mul fmul udiv sdiv fdiv urem srem frem shl lshr ashr and
or xor extractelement insertelement shufflevector extractvalue insertvalue alloca load store
getelementptr trunc zext sext fptrunc fpext fptoui fptosi uitofp sitofp bitcast icmp fcmp phi select
call freeze fence
""".split())
_RAW_OPCODES = _BASE_OPCODES | {"ptrtoint", "inttoptr", "atomicrmw", "cmpxchg"}
_LOCAL = {llvm.Linkage.internal, llvm.Linkage.private}
_MODULE_ASM = re.compile(r"^\s*module\s+asm\b", re.M)


class VerificationError(TinydistError, ValueError):
    """The program is refused; the message says which rule it broke."""


@dataclass(frozen=True)
class VerifiedProgram:
    program_id: str        # content address of (kind, IR, entry, signature)
    symbol: str            # the entry's name in the compiled object: derived from program_id
    ir_text: str           # the IR to compile, entry renamed to `symbol`
    signature: tuple[str, ...]


def program_id(kind: str, ir_text: str, entry: str, signature: Sequence[str]) -> str:
    digest = hashlib.sha256()
    for part in (kind, ir_text, entry, *signature):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def verify(ir_text: str, entry: str, signature: Sequence[str], kind: str = ENGINE) -> VerifiedProgram:
    if kind not in (ENGINE, RAW):
        raise VerificationError(f"unknown program kind {kind!r}")
    if not isinstance(ir_text, str) or not ir_text.strip():
        raise VerificationError("the program has no LLVM IR")
    if len(ir_text.encode()) > MAX_IR_BYTES:
        raise VerificationError(f"the program's IR is larger than {MAX_IR_BYTES} bytes")
    signature = tuple(signature)
    bad = [k for k in signature if k not in ARG_KINDS]
    if bad:
        raise VerificationError(f"unknown argument kind(s) {bad}; known: {', '.join(ARG_KINDS)}")
    if len(signature) > 64:
        raise VerificationError("more than 64 arguments")
    if _MODULE_ASM.search(ir_text):
        raise VerificationError("module-level assembly is not allowed")
    _initialise_llvm()
    try:
        module = llvm.parse_assembly(ir_text)
        module.verify()
    except RuntimeError as exc:
        raise VerificationError(f"LLVM rejected the IR: {str(exc).strip()[:500]}") from exc
    opcodes = _RAW_OPCODES if kind == RAW else _BASE_OPCODES

    defined = {}
    for fn in module.functions:
        if fn.is_declaration:
            if not _INTRINSICS.match(fn.name):
                raise VerificationError(f"declaration of external function {fn.name!r} is not allowed; only allowlisted llvm.* intrinsics")
            continue
        defined[fn.name] = fn
        if fn.name != entry and fn.linkage not in _LOCAL:
            raise VerificationError(f"function {fn.name!r} must be internal or private (only the entry {entry!r} is exported)")
    if entry not in defined:
        raise VerificationError(f"the IR defines no function {entry!r}")
    for g in module.global_variables:
        text = str(g)
        if g.is_declaration:
            raise VerificationError(f"external global {g.name!r} is not allowed")
        if not re.search(r"=\s*(?:(?:private|internal)\s+)?(?:unnamed_addr\s+)?constant\b", text):
            raise VerificationError(f"global {g.name!r} must be a private/internal constant")
        initializer = text.split("constant", 1)[1]
        if "@" in initializer or "ptr" in initializer:
            raise VerificationError(f"global {g.name!r} has an initializer that points at something")
    if hasattr(module, "global_aliases") and list(module.global_aliases):
        raise VerificationError("global aliases are not allowed")
    if re.search(r"^\s*@[^=]+=\s*(\w+\s+)*(alias|ifunc)\b", ir_text, re.M):
        raise VerificationError("aliases and ifuncs are not allowed")

    fn = defined[entry]
    params = list(fn.arguments)
    if len(params) != len(signature):
        raise VerificationError(f"entry {entry!r} takes {len(params)} parameters, the signature lists {len(signature)}")
    for i, (param, kind_) in enumerate(zip(params, signature)):
        if str(param.type) != PARAM_TYPES[kind_]:
            raise VerificationError(f"parameter {i} of {entry!r} is {param.type}, signature says {kind_} ({PARAM_TYPES[kind_]})")
    if not re.search(rf'define\s+(?:[\w\s]*\s)?void\s+@"?{re.escape(entry)}"?\s*\(', str(fn)):
        raise VerificationError(f"entry {entry!r} must return void")

    for f in defined.values():
        for block in f.blocks:
            for inst in block.instructions:
                if inst.opcode not in opcodes:
                    raise VerificationError(f"instruction {inst.opcode!r} is not allowed in a {kind} program")
                operands = list(inst.operands)
                for op in operands:
                    vk = op.value_kind
                    if vk == llvm.ValueKind.inline_asm:
                        raise VerificationError("inline assembly is not allowed")
                    if vk in (llvm.ValueKind.global_alias, llvm.ValueKind.global_ifunc, llvm.ValueKind.block_address):
                        raise VerificationError(f"operand kind {vk.name} is not allowed")
                if inst.opcode == "call":
                    callee = operands[-1] if operands else None
                    if callee is None or callee.value_kind != llvm.ValueKind.function:
                        raise VerificationError("indirect calls are not allowed")
                    if callee.name not in defined and not _INTRINSICS.match(callee.name):
                        raise VerificationError(f"call to {callee.name!r} is not allowed")
                if "addrspace" in str(inst):
                    raise VerificationError("address spaces other than 0 are not allowed")

    pid = program_id(kind, ir_text, entry, signature)
    symbol = f"tdp_{pid[:32]}"
    fn.name = symbol
    return VerifiedProgram(pid, symbol, str(module), signature)
