"""What a schedule is made of: buffers by number, and the calls that read and write them.

Buffers are numbered so one schedule can be replayed over different memory (the schedule cache
and the JIT rely on it): numbers below `n_inputs` are already-realized inputs, in the order the
graph walk met them; the rest are made by this schedule (its targets and its intermediates).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tinydist.codegen.kernel import KernelAST
from tinydist.codegen.matmul_tiling import StridedOperand
from tinydist.graph.dtypes import DType
from tinydist.graph.shape import Shape

if TYPE_CHECKING:  # a routine hands the engine a loaded program; the schedule only carries the routine
    from tinydist.runtime.program import Program


class _HasInputs(Protocol):
    @property
    def inputs(self) -> tuple[int, ...]: ...  # a dataclass field in some calls, a property in others


class _ReadsItsInputs:
    """Every call reads exactly the buffers it takes as inputs (`reads` pairs with each call's `writes`)."""

    @property
    def reads(self: _HasInputs) -> tuple[int, ...]:
        return self.inputs


@dataclass(frozen=True)
class BufferSpec:
    nbytes: int
    dtype: DType
    shape: Shape
    device: str
    lane: str = "compute"  # copy outputs live in the copy lane's arena


@dataclass(frozen=True)
class KernelCall(_ReadsItsInputs):
    ast: KernelAST
    out: int
    inputs: tuple[int, ...]
    device: str
    queue: str = "compute"

    @property
    def writes(self) -> tuple[int, ...]:
        return (self.out,)

    def describe(self) -> str:
        return f"kernel {self.ast.describe()}"


@dataclass(frozen=True)
class MatmulCall(_ReadsItsInputs):
    out: int
    a: int
    b: int
    workspace: int
    batch: int
    m: int
    n: int
    k: int
    a_batch_stride: int
    b_batch_stride: int
    dtype: DType
    device: str
    queue: str = "compute"
    strided: StridedOperand | None = None   # a or b is read through this view of its buffer
    prepacked: str | None = None            # "b" ("a"): that operand is a weight packed at load (pack_b_array, pack_a_array)

    @property
    def inputs(self) -> tuple[int, ...]:
        return (self.a, self.b)

    @property
    def writes(self) -> tuple[int, ...]:
        return (self.out, self.workspace)

    def describe(self) -> str:
        gathered = f" ({self.strided.operand.upper()} strided)" if self.strided is not None else ""
        gathered += f" ({self.prepacked.upper()} prepacked)" if self.prepacked else ""
        return f"matmul {self.dtype.name} {self.batch}x[{self.m}x{self.k}]@[{self.k}x{self.n}]{gathered}"


@dataclass(frozen=True)
class CopyCall(_ReadsItsInputs):
    out: int
    src: int
    nbytes: int
    device: str  # the destination: the copy runs on its copy queue
    queue: str = "copy"

    @property
    def inputs(self) -> tuple[int, ...]:
        return (self.src,)

    @property
    def writes(self) -> tuple[int, ...]:
        return (self.out,)

    def describe(self) -> str:
        return f"copy {self.nbytes} bytes -> {self.device}"


@dataclass(frozen=True)
class GatherCall(_ReadsItsInputs):
    """Whole buffers copied into consecutive byte ranges of `out` (a `cat` of buffers): plain
    memory copies, which stream at memory bandwidth where a kernel would test every piece's mask
    at every element."""
    out: int
    srcs: tuple[int, ...]
    offsets: tuple[int, ...]  # byte offset in `out` where each source's bytes go
    nbytes: int
    device: str  # the destination: the copies run on its copy queue
    queue: str = "copy"

    @property
    def inputs(self) -> tuple[int, ...]:
        return self.srcs

    @property
    def writes(self) -> tuple[int, ...]:
        return (self.out,)

    def describe(self) -> str:
        return f"gather {len(self.srcs)} buffers, {self.nbytes} bytes -> {self.device}"


@dataclass(frozen=True)
class SliceCall(_ReadsItsInputs):
    """Kernel `ast` (elementwise, one-dimensional) run over the byte range [start, start + nbytes)
    of whole buffers: it reads that range of every input and writes it into every output (the
    kernel's `outputs`). One device's part of a direct allreduce: the devices of a peer group
    each take a disjoint range of the same buffers, so they run side by side."""
    ast: KernelAST
    outs: tuple[int, ...]
    inputs: tuple[int, ...]
    start: int
    nbytes: int
    device: str
    queue: str = "compute"

    @property
    def writes(self) -> tuple[int, ...]:
        return self.outs

    def describe(self) -> str:
        return f"slice kernel [{self.start}, {self.start + self.nbytes}) of {len(self.outs)} outputs: {self.ast.describe()}"


class HostRoutine(Protocol):
    """Host code a schedule item runs on its device's queue (a process collective, tinydist.dist.lazy):
    hashable and comparable, so the schedule cache tells two apart; its program takes (out, in)."""

    def program(self) -> Program: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class CollectiveCall(_ReadsItsInputs):
    """A process collective of buffer `src` into buffer `out`, run by `routine`'s program (two
    pointers: out, in) on the device's copy queue: inside a realize or a captured replay, so a
    step's collectives need no Python of the step's own. Off the compute queue, a collective that
    waits for its peers holds up only the calls that read its result: the kernels after it (the
    rest of a backward) run meanwhile (`linear` starts it as soon as its input is made)."""
    out: int
    src: int
    routine: HostRoutine
    device: str
    queue: str = "copy"

    @property
    def inputs(self) -> tuple[int, ...]:
        return (self.src,)

    @property
    def writes(self) -> tuple[int, ...]:
        return (self.out,)

    def describe(self) -> str:
        return self.routine.describe()


Call = KernelCall | MatmulCall | CopyCall | GatherCall | SliceCall | CollectiveCall
