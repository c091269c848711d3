"""What every part of the matmul kernel emits into: one LLVM module per kernel, its element and
vector types, the intrinsics it calls, and a builder with the loop and addressing helpers.

The kernel's pieces (`matmul_microkernel`, `matmul_packing`, the driver in `matmul`) each add
functions to one `MatmulModule`; the order they are added in is the order of the IR text, which
the process-replay goldens compare (tests/schedule/test_process_replay.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import llvmlite.ir as ir

from tinydist.codegen.matmul_tiling import VECTOR_BYTES, StridedForm, Tiling, itemsize

I32, I64 = ir.IntType(32), ir.IntType(64)
PTR = ir.PointerType()
ELEMENT_TYPES: dict[int, ir.Type] = {4: ir.FloatType(), 8: ir.DoubleType()}   # by itemsize


def i64(value: int) -> ir.Constant:
    return ir.Constant(I64, value)


class Builder(ir.IRBuilder):
    """IRBuilder plus the few structured helpers the generator needs."""

    @contextmanager
    def loop(self, start: ir.Value, stop: ir.Value, step: int | ir.Value, name: str) -> Iterator[ir.Value]:
        """``for i in range(start, stop, step)`` (step > 0); the body is emitted inside the block."""
        preheader = self.block
        header = self.append_basic_block(f"{name}.header")
        body = self.append_basic_block(f"{name}.body")
        exit_ = self.append_basic_block(f"{name}.exit")
        self.branch(header)
        self.position_at_end(header)
        index = self.phi(I64, name=name)
        index.add_incoming(start, preheader)
        self.cbranch(self.icmp_signed("<", index, stop), body, exit_)
        self.position_at_end(body)
        yield index
        index.add_incoming(self.add(index, i64(step) if isinstance(step, int) else step, name=f"{name}.next"), self.block)
        self.branch(header)
        self.position_at_end(exit_)

    def min(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.select(self.icmp_signed("<", a, b), a, b)

    def at(self, base: ir.Value, offset: ir.Value, elem: ir.Type) -> ir.Value:
        """Address of base[offset] for elements of type elem."""
        return self.gep(base, [offset], inbounds=True, source_etype=elem)


def define(module: ir.Module, name: str, args: list[tuple[str, ir.Type]], internal: bool = True
            ) -> tuple[ir.Function, Builder]:
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [ty for _, ty in args]), name)
    if internal:
        fn.linkage = "internal"
    for arg, (arg_name, ty) in zip(fn.args, args):
        arg.name = arg_name
        if ty == PTR:
            arg.add_attribute("noalias")
    fn.attributes.add("nounwind")
    return fn, Builder(fn.append_basic_block("entry"))


class MatmulModule:
    """One kernel's LLVM module, named `name`, for `dtype` under `tiling` (and a strided operand's
    form, if any): the element type, its vector (one zmm register) and the intrinsics, declared once."""

    def __init__(self, name: str, dtype: str, tiling: Tiling, strided: StridedForm | None) -> None:
        self.itemsize = itemsize(dtype)
        self.elem = ELEMENT_TYPES[self.itemsize]
        self.t = tiling
        self.strided = strided
        self.lanes = VECTOR_BYTES // self.itemsize
        if tiling.nr % self.lanes:
            raise ValueError(f"NR={tiling.nr} must be a multiple of the vector width {self.lanes}")
        self.vec = ir.VectorType(self.elem, self.lanes)
        self.name = name
        self.module = ir.Module(name=name)
        # llvmlite cannot mangle vector or opaque-pointer intrinsic names, so they are spelled out.
        self.fma = ir.Function(self.module, ir.FunctionType(self.vec, [self.vec] * 3),
                               f"llvm.fma.v{self.lanes}{'f32' if self.itemsize == 4 else 'f64'}")
        self.memset = ir.Function(self.module, ir.FunctionType(ir.VoidType(), [PTR, ir.IntType(8), I64, ir.IntType(1)]),
                                  "llvm.memset.p0.i64")
        suffix = f"v{self.lanes}{'f32' if self.itemsize == 4 else 'f64'}.p0"
        mask = ir.VectorType(ir.IntType(1), self.lanes)
        self.masked_load_fn = ir.Function(self.module, ir.FunctionType(self.vec, [PTR, I32, mask, self.vec]),
                                          f"llvm.masked.load.{suffix}")
        self.masked_store = ir.Function(self.module, ir.FunctionType(ir.VoidType(), [self.vec, PTR, I32, mask]),
                                        f"llvm.masked.store.{suffix}")
        self._prefetch: ir.Function | None = None

    def prefetch(self, b: Builder, address: ir.Value, locality: int, write: bool = False) -> None:
        """A read prefetch of the line at `address` (a hint: never faults, any address will do);
        locality 3 is prefetcht0 (into L1), 2 prefetcht1 (into L2)."""
        if self._prefetch is None:
            self._prefetch = ir.Function(self.module, ir.FunctionType(ir.VoidType(), [PTR, I32, I32, I32]), "llvm.prefetch.p0")
        b.call(self._prefetch, [address, ir.Constant(I32, int(write)), ir.Constant(I32, locality), ir.Constant(I32, 1)])

    def zero_fill(self, b: Builder, dst: ir.Value, elements: ir.Value) -> None:
        nbytes = b.mul(elements, i64(self.itemsize))
        b.call(self.memset, [dst, ir.Constant(ir.IntType(8), 0), nbytes, ir.Constant(ir.IntType(1), 0)])

    def masked_load(self, b: Builder, address: ir.Value, mask: ir.Value) -> ir.Value:
        return b.call(self.masked_load_fn, [address, ir.Constant(I32, self.itemsize), mask, ir.Constant(self.vec, None)])
