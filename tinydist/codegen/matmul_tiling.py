"""The matmul's blocking: tile and cache-block sizes per dtype, and the memory they imply.

The kernel (`tinydist.codegen.matmul`) computes an MR×NR tile of C per micro-kernel call, inside
NC columns of B, KC of the reduction and MC rows of A (the five loops in its docstring). This
module holds those sizes (`Tiling`, `DEFAULT_TILINGS`, with the measurements that chose them), the
operand a kernel may read through a view (`StridedOperand`), and the sizes the caller allocates:
the workspace (`workspace_bytes`) and a prepacked B or A (`packed_b_elements`, `packed_a_elements`). Plain Python, no LLVM:
the scheduler and the frontend size buffers with it without importing the code generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

VECTOR_BYTES = 64   # one zmm register: AVX-512 is the target (znver4 has 32 of them)
ALIGN = 64          # workspace regions start on cache lines, so packed-B vector loads are aligned


@dataclass(frozen=True)
class Tiling:
    """Micro-tile MR×NR (NR a multiple of the vector width) and the cache blocks KC, MC, NC; a
    small-M product reading B in place sweeps it at most direct_kc rows at a time (see small_loops)."""

    mr: int
    nr: int
    kc: int
    mc: int
    nc: int
    direct_kc: int = 64

    def __post_init__(self) -> None:
        if self.mc % self.mr or self.nc % self.nr:
            raise ValueError(f"MC must be a multiple of MR and NC of NR: {self}")


Axes = tuple[tuple[int, int], ...]   # (size, stride) per axis, outermost first

# A strided kernel takes its view's row and column axes as arguments, each list padded to this
# many (a view with more has as many): a convolution's columns have 3 row axes (channel, kernel
# row, kernel column) and 2-3 column axes (batch, output rows, output columns).
VIEW_AXES = 4


@dataclass(frozen=True)
class StridedForm:
    """What a kernel reading a `StridedOperand` is compiled for: the operand, how many consecutive
    columns A's packing reads as one vector (`chunk`: a divisor of the view's run and of KC; 0 for
    B, whose kernel packs with a piece for each power of two up to NR and picks one from the view's
    run at run time) and how many row and column axes its view argument has. The view itself (run,
    offset, sizes, strides) comes as the kernel's trailing arguments (`StridedOperand.arguments`),
    so every view of one form shares one kernel: resnet18's eleven im2col views (all B) are one
    kernel, not eleven (~0.5 s of LLVM each)."""

    operand: str
    chunk: int
    rows: int
    cols: int
    tiling: Tiling | None = None   # the blocking it is compiled with (None: the dtype's default)

    @property
    def arguments(self) -> int:
        """How many i64 arguments the view takes: its run and offset, then a size and a stride per axis."""
        return 2 + 2 * (self.rows + self.cols)


@dataclass(frozen=True)
class StridedOperand:
    """Operand `operand` ("a" or "b") of a batch-of-one matmul read through a strided view: its
    element (r, c) is at `offset + Σ r_i·stride_i + Σ c_j·stride_j` elements of the buffer passed
    for it, r decomposed over the `rows` axes and c over the `cols` axes. Offsets must fit in int32."""

    operand: str
    rows: Axes
    cols: Axes
    offset: int

    def __post_init__(self) -> None:
        if self.operand not in ("a", "b"):
            raise ValueError(f"operand must be 'a' or 'b', got {self.operand!r}")

    @property
    def run(self) -> int:
        """How many consecutive columns are consecutive in memory (from column 0 of every row)."""
        run = 1
        for size, stride in reversed(self.cols):
            if stride != run:
                break
            run *= size
        return run

    def form(self, tiling: Tiling) -> StridedForm:
        """The kernel this view is read by under `tiling` (A's pieces divide KC; B's are chosen at run time)."""
        chunk = math.gcd(self.run, tiling.kc) if self.operand == "a" else 0
        return StridedForm(self.operand, chunk, max(VIEW_AXES, len(self.rows)), max(VIEW_AXES, len(self.cols)),
                           tiling)

    def arguments(self) -> tuple[int, ...]:
        """The view as its kernel's trailing arguments: the run and the offset, then (size, stride) of
        each row axis and of each column axis, each list padded in front to VIEW_AXES with (1, 0)."""
        def padded(axes: Axes) -> Axes:
            return ((1, 0),) * (VIEW_AXES - len(axes)) + axes
        return (self.run, self.offset, *(value for axis in padded(self.rows) + padded(self.cols) for value in axis))

    @property
    def table_entries(self) -> int:
        return math.prod(size for size, _ in self.rows) + math.prod(size for size, _ in self.cols)




ITEMSIZES: dict[str, int] = {"float32": 4, "float64": 8}

# broadcasts. At 1024³ 6×32 and 8×32 run alike (~110 GFLOP/s; 12×32 no faster), but 8 divides the
# channel counts convolutions have (16, 32, 3·3·16 = 144) where 6 leaves a partial edge tile (computed
# whole into a buffer, then copied) every sixth row: the CNN's 32-channel conv forward (M=32,
# N=16384, K=144) took 1.9-2.0 ms with MR=6, 1.7-1.8 ms with MR=8. The MR×KC micro-panel of A
# (32 KiB) is re-read from L1/L2 for the whole call while the KC×NR micro-panel of B (128 KiB) and
# the MC×KC block of A (256 KiB) share the L2; a long KC also means the C tile is loaded and stored
# only once per K/KC. The KC×NC panel of B (8 MiB at most) lives in L3, and is streamed once per MC
# block: MC=64 makes a transformer's 64-row products one block (M=64, K=N=4096, B prepacked:
# 96-131 GFLOP/s median with MC=48, 121-165 with 64; 1024³ and M=512 alike either way).
# KC chosen by measurement on znver4 at 1024³ float32: KC=128..256 gave 87-94 GFLOP/s, KC=1024
# 105-110 (with MR=8 on the CNN's conv matmuls KC=768 measured the same as 1024).
DEFAULT_TILINGS: dict[str, Tiling] = {
    "float32": Tiling(mr=8, nr=32, kc=1024, mc=64, nc=2048),
    "float64": Tiling(mr=6, nr=16, kc=512, mc=48, nc=2048),
}

# A gathered B (a convolution's im2col columns, packed from its padded input) in smaller blocks:
# the packed KC×NC block of B (512 KiB) then stays in the L2 and each KC×NR micro-panel (32 KiB)
# in the L1, where the default's 4.7 MiB block of a 64-channel 3x3 convolution's columns went out
# to the L3 between packing and use. resnet18's convolutions, the kernel alone on one core, best
# of 15 at batch 1 (4 at batch 8), GFLOP/s default -> this: 64 channels 56x56 121 -> 146 (batch 8:
# 110 -> 136), 128 channels 28x28 99 -> 147 (106 -> 142), 256 channels 14x14 123 -> 132, 512
# channels 7x7 101 -> 105; the 7x7 stem (K = 147) alike (111 -> 115). KC 512 or NC 256 each took
# part of it, KC 256 with NC 512 the most.
GATHERED_B_TILINGS: dict[str, Tiling] = {
    "float32": Tiling(mr=8, nr=32, kc=256, mc=64, nc=512),
}


_L2_BYTES = 2 << 20   # the L2 of one core (Sapphire Rapids, Zen 4: 1-2 MiB)


def tiling_for(dtype: str, strided: StridedOperand | None = None) -> Tiling:
    """The blocking of the kernel for `dtype` reading `strided` (None: both operands plain): a B
    gathered over more than one row and one column axis (a convolution's columns, not a
    transposed matrix) whose default KC×NC block would not fit the L2 is blocked by
    GATHERED_B_TILINGS. Where it fits there is nothing to gain (resnet18's 512-channel 7x7
    convolution, a 256 KiB block: 101 and 105 GFLOP/s), so the default, with its fewer reloads of
    the C tile and longer rows of A (the weights, read from L3 or memory at every call), stays."""
    t = DEFAULT_TILINGS[dtype]
    if (strided is None or strided.operand != "b" or len(strided.rows) + len(strided.cols) <= 2
            or dtype not in GATHERED_B_TILINGS):
        return t
    k, n = math.prod(size for size, _ in strided.rows), math.prod(size for size, _ in strided.cols)
    block = min(k, t.kc) * min(round_up(n, t.nr), t.nc) * ITEMSIZES[dtype]
    return GATHERED_B_TILINGS[dtype] if block > _L2_BYTES else t



def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype the matmul supports; ValueError naming the supported ones otherwise."""
    try:
        return ITEMSIZES[dtype]
    except KeyError:
        raise ValueError(f"matmul supports {', '.join(ITEMSIZES)}, got {dtype!r}") from None


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def workspace_bytes(M: int, N: int, K: int, dtype: str = "float32", tiling: Tiling | None = None,
                    strided: StridedOperand | None = None, prepacked: str | None = None) -> int:
    """Bytes of workspace the kernel for (M, N, K) needs.

    Layout (mirrored in the generated driver): the packed KC×NC block of B at offset 0 (none for
    a prepacked B), the packed MC×KC block of A (none for a prepacked A), then a strided operand's offset tables (int32,
    rows then columns); each region starts on a 64-byte boundary. Blocks shrink to the problem,
    so small problems need little.
    """
    tables = 4 * strided.table_entries if strided is not None else 0
    size = itemsize(dtype)
    t = tiling or tiling_for(dtype, strided)
    kc, nc, mc = min(K, t.kc), min(round_up(N, t.nr), t.nc), min(round_up(M, t.mr), t.mc)
    regions = (0 if prepacked == "b" else kc * nc * size, 0 if prepacked == "a" else mc * kc * size)
    return sum(round_up(size, ALIGN) for size in regions) + tables


def packed_a_elements(M: int, K: int, dtype: str = "float32", tiling: Tiling | None = None) -> int:
    """Elements of a prepacked M×K operand A (`pack_a_array`): its rows rounded up to MR."""
    itemsize(dtype)
    return round_up(M, (tiling or DEFAULT_TILINGS[dtype]).mr) * K


def packed_b_elements(K: int, N: int, dtype: str = "float32", tiling: Tiling | None = None) -> int:
    """Elements of a prepacked K×N operand B (`pack_b_ir`): its columns rounded up to NR."""
    itemsize(dtype)
    return K * round_up(N, (tiling or DEFAULT_TILINGS[dtype]).nr)

