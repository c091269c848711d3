"""Kernel IR → NVPTX LLVM IR → PTX text, with llvmlite's NVPTX back end.

The elementwise part is the CPU lowering's: `_PTXLowerer` subclasses `lowering._Lowerer`, so
loads (ShapeTracker indexing, masks, padding), constants, `alu.ALU_RULES` and the polynomial
transcendentals (`transcendental.py`: plain arithmetic, no libm, no libdevice) are the same code
on both targets. What differs is the loop structure around them:

- **elementwise** (no reduce): a grid-stride loop over the flattened output; each thread
  computes elements `gid, gid + grid_threads, …`, consecutive threads consecutive outputs
  (coalesced stores).
- **block reduce** (the innermost collapsed axis is reduced: full reduce, row reduce): one thread
  block per output element (blocks stride over the outputs). Each thread accumulates a strided
  slice of the reduced elements in a register, then the block combines the partials in shared
  memory (addrspace 3) with a barrier (`llvm.nvvm.barrier0`) after every halving step; thread 0
  applies the ops above the reduce and stores. A full reduce is one block of 1024 threads.
- **thread reduce** (only outer axes reduced: column reduce): one thread per output, looping
  over the reduced axes in sequence; neighbouring threads read neighbouring columns.
- **matmul**: a 64×64 output tile per block of 256 threads, each thread 4×4 outputs; K is walked
  in steps of 8 through shared-memory tiles of A (stored transposed) and B. Each output is the FMA
  chain over k = 0, 1, … K-1 in order — the same order, hence bitwise the same result, as the
  CPU matmul (`matmul.py`). Same argument list as the CPU kernel (the workspace is unused).

Kernel entries use the `ptx_kernel` calling convention and take `ptr addrspace(1)` (global)
buffer arguments. `compile_ptx` runs the O3 pipeline with the NVPTX target machine (so allocas
become registers and the per-thread tile stays in registers) and prints PTX.
"""

from __future__ import annotations

import hashlib
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable

import llvmlite.binding as llvm
from llvmlite import ir

from tinydist.base.errors import CompileError
from tinydist.codegen.kernel import KernelAST
from tinydist.codegen.alu import combine
from tinydist.codegen.llvm_types import F32, F64, I32, I64, from_memory, identity, llvm_type, to_memory
from tinydist.codegen.lowering import _entry_alloca, _Lowerer
from tinydist.graph.shape import prod

TRIPLE = "nvptx64-nvidia-cuda"
GLOBAL_PTR = ir.PointerType(addrspace=1)
SHARED_PTR = ir.PointerType(addrspace=3)
THREADS = 256               # block size for elementwise, thread-reduce and row-reduce kernels
FULL_REDUCE_THREADS = 1024  # a reduce to one value runs in one block: make it as wide as allowed
BLOCKS_PER_SM = 32          # grid-stride kernels: at most this many blocks per multiprocessor
MATMUL_TILE, MATMUL_BK, MATMUL_THREADS = 64, 8, 256
# Targets this LLVM's NVPTX back end knows; a GPU gets the highest one not above its capability
# (the driver JIT-compiles PTX for an older target on a newer GPU).
KNOWN_ARCHES = ((6, 0), (6, 1), (7, 0), (7, 5), (8, 0), (8, 6), (8, 7), (8, 9), (9, 0), (10, 0), (12, 0))


@dataclass(frozen=True)
class PTXKernel:
    """A kernel as NVPTX LLVM IR plus how to launch it."""

    name: str
    ir: str
    signature: tuple[str, ...]
    kind: str          # "thread" (one work item per thread), "block" (one per block) or "matmul"
    threads: int       # threads per block (x only)
    work: int          # work items the grid strides over (0 for matmul: sized from the arguments)

    def launch_dims(self, args: tuple[Any, ...], sm_count: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """(grid, block) for a launch with `args`; a grid with a zero dimension means: nothing to do."""
        block = (self.threads, 1, 1)
        if self.kind == "matmul":
            batch, m, n = int(args[4]), int(args[5]), int(args[6])
            return (math.ceil(n / MATMUL_TILE), math.ceil(m / MATMUL_TILE), batch), block
        items = math.ceil(self.work / self.threads) if self.kind == "thread" else self.work
        return (min(items, max(1, sm_count) * BLOCKS_PER_SM), 1, 1), block


def arch_for(capability: tuple[int, int]) -> str:
    """`sm_XY` for a device's compute capability: the highest known target not above it."""
    usable = [cc for cc in KNOWN_ARCHES if cc <= tuple(capability)]
    if not usable:
        raise CompileError(f"compute capability {capability[0]}.{capability[1]} is older than the oldest supported target sm_60")
    major, minor = usable[-1]
    return f"sm_{major}{minor}"


# ---- shared helpers ---------------------------------------------------------------------------

def _sreg(lw: Any, name: str) -> ir.Value:
    fn = lw.module.globals.get(f"llvm.nvvm.read.ptx.sreg.{name}")
    if fn is None:
        fn = ir.Function(lw.module, ir.FunctionType(I32, []), name=f"llvm.nvvm.read.ptx.sreg.{name}")
    return lw.b.zext(lw.b.call(fn, []), I64)


def _barrier(lw: Any) -> None:
    fn = lw.module.globals.get("llvm.nvvm.barrier0")
    if fn is None:
        fn = ir.Function(lw.module, ir.FunctionType(ir.VoidType(), []), name="llvm.nvvm.barrier0")
    lw.b.call(fn, [])


def _shared_array(module: ir.Module, name: str, element: ir.Type, count: int) -> ir.GlobalVariable:
    array = ir.GlobalVariable(module, ir.ArrayType(element, count), name, addrspace=3)
    array.linkage = "internal"
    array.initializer = ir.Constant(array.value_type, ir.Undefined)
    array.align = 16
    array.type = SHARED_PTR  # referenced as an opaque `ptr addrspace(3)`, like every other pointer
    return array


def _strided(lw: Any, start: ir.Value, end: ir.Value, step: ir.Value, body: Callable[[ir.Value], None], name: str) -> None:
    """for (i = start; i < end; i += step) body(i) — unsigned, guarded, rotated."""
    b = lw.b
    pre = b.block
    header = lw.fn.append_basic_block(f"{name}.body")
    after = lw.fn.append_basic_block(f"{name}.end")
    b.cbranch(b.icmp_unsigned("<", start, end), header, after)
    b.position_at_end(header)
    index = b.phi(I64, name=name)
    index.add_incoming(start, pre)
    body(index)
    nxt = b.add(index, step, name=f"{name}.next", flags=("nuw",))
    index.add_incoming(nxt, b.block)
    b.cbranch(b.icmp_unsigned("<", nxt, end), header, after)
    b.position_at_end(after)


def _when(lw: Any, cond: ir.Value, body: Callable[[], None], name: str) -> None:
    then = lw.fn.append_basic_block(f"{name}.then")
    after = lw.fn.append_basic_block(f"{name}.end")
    lw.b.cbranch(cond, then, after)
    lw.b.position_at_end(then)
    body()
    lw.b.branch(after)
    lw.b.position_at_end(after)


def _c(value: int) -> ir.Constant:
    return ir.Constant(I64, value)


# ---- kernel AST → NVPTX IR --------------------------------------------------------------------

class _PTXLowerer(_Lowerer):
    publishes_progress = False  # its globals are device memory; the CUDA back end's hang rule is its own

    def __init__(self, ast: KernelAST) -> None:  # noqa: D107 - the CPU constructor, with global pointers
        super().__init__(ast, "tinydist_ptx", GLOBAL_PTR)
        self.module.triple = TRIPLE
        self.fn.calling_convention = "ptx_kernel"
        # self.width stays None: never vector code, the parallelism is in the threads
        self.kind, self.threads, self.work = "thread", THREADS, 0

    def unflatten(self, flat: ir.Value, axes: list[int]) -> dict[int, ir.Value]:
        """Row-major index of `flat` over `axes` (flat < the product of their sizes)."""
        index: dict[int, ir.Value] = {}
        for position in range(len(axes) - 1, -1, -1):
            axis, size = axes[position], self.shape[axes[position]]
            if size == 1:
                index[axis] = _c(0)
            elif position == 0:
                index[axis] = flat
            else:
                index[axis] = self.b.urem(flat, _c(size))
                flat = self.b.udiv(flat, _c(size))
        return index

    def full_index(self, idx: dict[int, ir.Value]) -> list[ir.Value]:
        return [idx.get(a, _c(0)) for a in range(len(self.shape))]

    def store_out(self, value: ir.Value, flat: ir.Value) -> None:
        value = to_memory(self.b, value, self.ast.out_dtype)
        out_type = llvm_type(self.ast.out_dtype, in_memory=True)
        self.b.store(value, self.b.gep(self.out, [flat], inbounds=True, source_etype=out_type))

    def build(self) -> str:
        reduce_node = next((n for n in self.ast.root.walk() if n.op == "reduce"), None)
        outer = [a for a in range(len(self.shape)) if a not in self.reduce_axes]
        n_out = prod([self.shape[a] for a in outer])
        self.work = n_out
        if reduce_node is None:
            self.kind, self.threads = "thread", THREADS
            gid = self.b.add(self.b.mul(_sreg(self, "ctaid.x"), _c(THREADS)), _sreg(self, "tid.x"))
            step = self.b.mul(_sreg(self, "nctaid.x"), _c(THREADS))
            _strided(self, gid, _c(n_out), step, lambda i: self.store_out(
                self.evaluate(self.ast.root, self.full_index(self.unflatten(i, outer)), {}), i), "i")
        elif len(self.shape) - 1 in self.reduce_axes:
            self.block_reduce(reduce_node, outer, n_out)
        else:
            self.thread_reduce(reduce_node, outer, n_out)
        self.b.ret_void()
        return str(self.module)

    def thread_reduce(self, reduce_node: Any, outer: list[int], n_out: int) -> None:
        self.kind, self.threads = "thread", THREADS
        acc = _entry_alloca(self, llvm_type(reduce_node.dtype))
        gid = self.b.add(self.b.mul(_sreg(self, "ctaid.x"), _c(THREADS)), _sreg(self, "tid.x"))
        step = self.b.mul(_sreg(self, "nctaid.x"), _c(THREADS))

        def per_output(o: ir.Value) -> None:
            idx = self.unflatten(o, outer)
            self.b.store(identity(reduce_node.arg, reduce_node.dtype), acc)

            def step_(ridx: dict[int, ir.Value]) -> None:
                value = self.evaluate(reduce_node.srcs[0], self.full_index({**idx, **ridx}), {})
                self.b.store(combine(self, reduce_node.arg, reduce_node.dtype, self.b.load(acc), value), acc)
            self.loops(list(self.reduce_axes), step_, "r")
            self.store_out(self.evaluate(self.ast.root, self.full_index(idx), {}, reduced=self.b.load(acc)), o)
        _strided(self, gid, _c(n_out), step, per_output, "o")

    def block_reduce(self, reduce_node: Any, outer: list[int], n_out: int) -> None:
        threads = FULL_REDUCE_THREADS if n_out == 1 else THREADS
        self.kind, self.threads = "block", threads
        dtype = reduce_node.dtype
        reg_type, mem_type = llvm_type(dtype), llvm_type(dtype, in_memory=True)
        shared = _shared_array(self.module, "partials", mem_type, threads)
        acc = _entry_alloca(self, reg_type)
        tid = _sreg(self, "tid.x")
        reduced_axes = list(self.reduce_axes)
        n_reduced = prod([self.shape[a] for a in reduced_axes])

        def to_mem(v: ir.Value) -> ir.Value:
            return to_memory(self.b, v, dtype)

        def from_mem(v: ir.Value) -> ir.Value:
            return from_memory(self.b, v, dtype)

        def slot(i: ir.Value) -> ir.Value:
            return self.b.gep(shared, [i], inbounds=True, source_etype=mem_type)

        def per_output(o: ir.Value) -> None:
            idx = self.unflatten(o, outer)
            self.b.store(identity(reduce_node.arg, dtype), acc)

            def step(r: ir.Value) -> None:
                where = {**idx, **self.unflatten(r, reduced_axes)}
                value = self.evaluate(reduce_node.srcs[0], self.full_index(where), {})
                self.b.store(combine(self, reduce_node.arg, dtype, self.b.load(acc), value), acc)
            _strided(self, tid, _c(n_reduced), _c(threads), step, "r")
            mine = slot(tid)
            self.b.store(to_mem(self.b.load(acc)), mine)
            _barrier(self)
            half = threads // 2
            while half >= 1:  # tree: after the step with `half`, slots [0, half) hold the partials
                def fold(half: int = half) -> None:
                    other = from_mem(self.b.load(slot(self.b.add(tid, _c(half))), typ=mem_type))
                    here = from_mem(self.b.load(mine, typ=mem_type))
                    self.b.store(to_mem(combine(self, reduce_node.arg, dtype, here, other)), mine)
                _when(self, self.b.icmp_unsigned("<", tid, _c(half)), fold, f"fold{half}")
                _barrier(self)
                half //= 2

            def finish() -> None:
                total = from_mem(self.b.load(slot(_c(0)), typ=mem_type))
                self.store_out(self.evaluate(self.ast.root, self.full_index(idx), {}, reduced=total), o)
            _when(self, self.b.icmp_unsigned("==", tid, _c(0)), finish, "finish")
            _barrier(self)  # slot 0 is read before the next output's partials overwrite it
        _strided(self, _sreg(self, "ctaid.x"), _c(n_out), _sreg(self, "nctaid.x"), per_output, "o")


def _named(text: str) -> tuple[str, str]:
    name = "k_" + hashlib.sha256(text.encode()).hexdigest()[:20]
    return name, text.replace('@"KERNEL"', f'@"{name}"').replace("@KERNEL", f"@{name}")


def lower_kernel(ast: KernelAST) -> PTXKernel:
    """A scheduled kernel as NVPTX IR; arguments (out, *inputs) as on the CPU."""
    lowerer = _PTXLowerer(ast)
    name, text = _named(lowerer.build())
    return PTXKernel(name, text, ("w",) + ("r",) * len(ast.slot_dtypes), lowerer.kind, lowerer.threads, lowerer.work)


# ---- matmul -----------------------------------------------------------------------------------

MATMUL_SIGNATURE = ("w", "r", "r", "w", "i64", "i64", "i64", "i64", "i64", "i64", "i64")


class _Builder:
    """Just enough of a lowerer for the helpers above (module, function, builder)."""

    def __init__(self, module: ir.Module, fn: ir.Function) -> None:
        self.module, self.fn = module, fn
        self.entry = fn.append_basic_block("entry")
        self.b = ir.IRBuilder(self.entry)


def matmul_kernel(dtype_name: str) -> PTXKernel:
    """C_b = A_b @ B_b (row-major), arguments as `codegen.matmul.SIGNATURE`; W is not used."""
    try:
        t = {"float32": F32, "float64": F64}[dtype_name]
    except KeyError:
        raise CompileError(f"the CUDA matmul supports float32 and float64, not {dtype_name}") from None
    tile, bk, per = MATMUL_TILE, MATMUL_BK, MATMUL_TILE // 16  # 16×16 threads, 4×4 outputs each
    module = ir.Module(name="tinydist_ptx_matmul")
    module.triple = TRIPLE
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [GLOBAL_PTR] * 4 + [I64] * 7), name="KERNEL")
    fn.calling_convention = "ptx_kernel"
    c_ptr, a_ptr, b_ptr, _workspace, _batch, m, n, k, stride_a, stride_b, stride_c = fn.args
    for arg in (c_ptr, a_ptr, b_ptr):
        arg.add_attribute("noalias")
    lw = _Builder(module, fn)
    b = lw.b
    zero = ir.Constant(t, 0.0)
    fma = ir.Function(module, ir.FunctionType(t, [t, t, t]), name=f"llvm.fma.{'f32' if t is F32 else 'f64'}")
    a_tile = _shared_array(module, "a_tile", t, bk * tile)  # transposed: [k][row]
    b_tile = _shared_array(module, "b_tile", t, bk * tile)  # [k][column]
    accs = [[_entry_alloca(lw, t) for _ in range(per)] for _ in range(per)]
    for row in accs:
        for acc in row:
            b.store(zero, acc)
    tid = _sreg(lw, "tid.x")
    tx, ty = b.and_(tid, _c(15)), b.lshr(tid, _c(4))
    col0 = b.mul(_sreg(lw, "ctaid.x"), _c(tile))
    row0 = b.mul(_sreg(lw, "ctaid.y"), _c(tile))
    z = _sreg(lw, "ctaid.z")
    a_base = b.gep(a_ptr, [b.mul(z, stride_a)], source_etype=t)
    b_base = b.gep(b_ptr, [b.mul(z, stride_b)], source_etype=t)
    c_base = b.gep(c_ptr, [b.mul(z, stride_c)], source_etype=t)

    def guarded_load(base: ir.Value, ok: ir.Value, offset: ir.Value) -> ir.Value:
        value = b.load(b.gep(base, [b.select(ok, offset, _c(0))], source_etype=t), typ=t)
        return b.select(ok, value, zero)

    def k_step(k0: ir.Value) -> None:
        for j in range(tile * bk // MATMUL_THREADS):
            e = b.add(tid, _c(MATMUL_THREADS * j))
            r, kk = b.add(row0, b.lshr(e, _c(3))), b.add(k0, b.and_(e, _c(bk - 1)))
            ok = b.and_(b.icmp_unsigned("<", r, m), b.icmp_unsigned("<", kk, k))
            value = guarded_load(a_base, ok, b.add(b.mul(r, k), kk))
            b.store(value, b.gep(a_tile, [b.add(b.mul(b.and_(e, _c(bk - 1)), _c(tile)), b.lshr(e, _c(3)))], source_etype=t))
            kk, cc = b.add(k0, b.lshr(e, _c(6))), b.add(col0, b.and_(e, _c(tile - 1)))
            ok = b.and_(b.icmp_unsigned("<", kk, k), b.icmp_unsigned("<", cc, n))
            value = guarded_load(b_base, ok, b.add(b.mul(kk, n), cc))
            b.store(value, b.gep(b_tile, [e], source_etype=t))
        _barrier(lw)
        current = [[b.load(acc, typ=t) for acc in row] for row in accs]
        for kk in range(bk):
            av = [b.load(b.gep(a_tile, [b.add(ty, _c(kk * tile + 16 * i))], source_etype=t), typ=t) for i in range(per)]
            bv = [b.load(b.gep(b_tile, [b.add(tx, _c(kk * tile + 16 * j))], source_etype=t), typ=t) for j in range(per)]
            current = [[b.call(fma, [av[i], bv[j], current[i][j]]) for j in range(per)] for i in range(per)]
        for i in range(per):
            for j in range(per):
                b.store(current[i][j], accs[i][j])
        _barrier(lw)

    _strided(lw, _c(0), k, _c(bk), k_step, "k")
    for i in range(per):
        for j in range(per):
            r = b.add(row0, b.add(ty, _c(16 * i)))
            cc = b.add(col0, b.add(tx, _c(16 * j)))

            def put(i: int = i, j: int = j, r: ir.Value = r, cc: ir.Value = cc) -> None:
                b.store(b.load(accs[i][j], typ=t), b.gep(c_base, [b.add(b.mul(r, n), cc)], source_etype=t))
            _when(lw, b.and_(b.icmp_unsigned("<", r, m), b.icmp_unsigned("<", cc, n)), put, f"c{i}{j}")
    b.ret_void()
    text = str(module)
    name = f"tinydist_matmul_{dtype_name}"
    return PTXKernel(name, text.replace('@"KERNEL"', f'@"{name}"'), MATMUL_SIGNATURE, "matmul", MATMUL_THREADS, 0)


# ---- NVPTX IR → PTX ---------------------------------------------------------------------------

_lock = threading.Lock()
_machines: dict[str, Any] = {}


def _machine(arch: str) -> Any:
    machine = _machines.get(arch)
    if machine is None:
        llvm.initialize_all_targets()
        llvm.initialize_all_asmprinters()
        machine = llvm.Target.from_triple(TRIPLE).create_target_machine(cpu=arch, opt=3)
        _machines[arch] = machine
    return machine


def compile_ptx(ir_text: str, arch: str = "sm_80") -> str:
    """NVPTX IR → PTX assembly for `arch` ("sm_80", "sm_90", …), after the O3 pipeline."""
    with _lock:
        machine = _machine(arch)
        try:
            module = llvm.parse_assembly(ir_text)
            module.verify()
        except RuntimeError as exc:
            raise CompileError(f"LLVM rejected the NVPTX kernel IR: {exc}") from exc
        module.triple = TRIPLE
        module.data_layout = str(machine.target_data)
        tuning = llvm.PipelineTuningOptions(speed_level=3)
        builder = llvm.create_pass_builder(machine, tuning)
        builder.getModulePassManager().run(module, builder)
        try:
            return machine.emit_assembly(module)
        except RuntimeError as exc:
            raise CompileError(f"the NVPTX back end failed for {arch}: {exc}") from exc
