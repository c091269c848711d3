"""A captured schedule split across threads: the parts of a parallel entry point.

Each call big enough to pay for a phase of its own is cut into pieces (one per thread; two for a
matmul over a batch or a packed weight), every piece an ordinary program over a slice of the
call's output:

- a matmul over its batch (attention heads: each piece a run of whole products) or, in a batch of
  one, over M in multiples of the micro-tile's MR rows (each piece a contiguous block of rows of
  A and C; B, a packed weight or a convolution's strided columns, shared — an unpacked B is
  packed by every piece, so such a product gets one piece per thread); a convolution turned
  around (its windows a strided A) over its outermost row axis, each piece a view of its own.
  Every element of C is
  the same FMA chain whichever tile computes it (`tinydist.codegen.matmul`), so the results are
  bitwise those of one thread. Each piece past the first gets a workspace of its own.
- a kernel (elementwise, or a reduce over inner axes) over its outermost axis longer than 1:
  a piece is the same kernel AST with every load's view shrunk to its rows and the output's
  contiguous block of them; each element is computed by the same expression, so again bitwise.

Calls too small to split run in a row as one piece of a phase of their own (whichever thread
takes it; the others wait for it). Whether a call splits, and whether a frame runs on several
threads at all, is one cost rule on each call's estimated one-thread time (`estimated_us`): a call
splits from `SPLIT_MIN_US` (a matmul from `MATMUL_SPLIT_FLOPS`, the same time), and a frame whose
splits save less than `FRAME_MIN_SAVING` of its time once every phase's wait is paid
(`PHASE_WAIT_US`, `FRAME_WAKE_US`) runs on one thread (see their comments for the measurement).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from tinydist.codegen.kernel import KNode, KernelAST
from tinydist.codegen.matmul_tiling import DEFAULT_TILINGS
from tinydist.engine.commands import Launch, lower_call
from tinydist.runtime.buffer import Buffer
from tinydist.runtime.device import Device
from tinydist.schedule.items import Call, KernelCall, MatmulCall

# (program, its arguments: addresses and integers), what `DeviceCompiler.link_parallel` takes
Piece = tuple[Any, tuple[int, ...]]

# A phase ends in a wait: ~1-3 µs when the peer spins, ~10 µs when it must be woken; a piece must run
# several times that. 2 MFLOP is ~10-20 µs of one core's GEMM (100-200 GFLOP/s): it takes in
# bert6_384's 12-head attention products (3.1 MFLOP, 23 µs, left to one thread at 4 MFLOP).
MATMUL_SPLIT_FLOPS = 2_000_000
# one core's GEMM at model shapes, for the time estimate: bert6_384's 3.1 MFLOP attention product
# in 23 µs, its 64x384x1536 product (75 MFLOP) in 610 µs, 120-160 GFLOP/s (bench/gemm.py)
MATMUL_FLOPS_PER_US = 150_000
# ... plus its B's packing when B is not a weight packed at load: a piece of rows packs all of it
# again, so splitting over M saves only the FLOPs' share. densenet's stem at batch 8 (M 16, K 147,
# N 2048, im2col columns) took 145.5 µs, of which its 64 µs of FLOPs: the rest, 0.27 ns per element
# of B, is the gather; its two pieces of 8 rows took 112.1 µs each (32 + 80), summing 1.52x
MATMUL_NS_PER_PACKED_B = 0.25
# a call splits from this many µs of one thread (2 MFLOP of GEMM): it saves half of that on two
# threads, several times the one or two waits its phase adds
SPLIT_MIN_US = MATMUL_SPLIT_FLOPS / MATMUL_FLOPS_PER_US
# A kernel's time per element of its iteration space: a base, and per load, per cheap op, per
# division (or square root) and per transcendental (tens of instructions a vector). Fitted to the
# kernels of densenet (batch 8) and bert6_384 (batch 1) timed alone at load 9 (µs, the estimate in
# brackets): a 34,656-element padding copy 5.7 (3.5), add+max over 32,768 4.0 (5.6), max-pool
# windows over 73,728 14.2 (8.1), bert6_384's x·c over 98,304 9.8 (10.8), mul+add+div 20.9 (53),
# its softmax's exp+sum over 49,152 20.8 (23.6) and exp+div 23.6 (30). Elements alone (the old
# rule: from 32K) split the cheap ones into 2-3 µs pieces, less than their waits: densenet at
# batch 8 ran 0.47x of its own one thread on two.
KERNEL_NS_PER_ELEMENT = 0.05
KERNEL_NS_PER_LOAD = 0.05
KERNEL_NS_PER_OP = 0.01
KERNEL_NS_PER_DIVISION = 0.1
KERNEL_NS_PER_TRANSCENDENTAL = 0.3
_DIVISIONS = frozenset({"div", "idiv", "mod", "sqrt"})
_TRANSCENDENTALS = frozenset({"pow", "exp", "exp2", "log", "log2", "sin", "cos", "tanh", "sigmoid", "erf"})
# What a frame on several threads pays beyond its pieces: a wait at the end of every phase but the
# last (the peer spins: 1-3 µs, plus the next phase's inputs crossing to its core) and the workers'
# wake-up at its start (a futex wake, ~10 µs before a sleeping worker runs)
PHASE_WAIT_US = 3.0
FRAME_WAKE_US = 10.0
# ... and a frame runs on one thread unless its splits save at least this share of its estimated
# time after those costs: the estimate is good to ~2x a kernel, and a split also moves data between
# the cores' caches that it does not count (quiet, at 7c1e3ce, the coverage-set frames that split
# ran 0.42-0.90x of their own one thread on two, bar efficientnet b8 at 1.03x)
FRAME_MIN_SAVING = 0.1
# a matmul whose pieces share no work is cut finer than one piece per thread: a thread that lost
# its core for a while leaves less for the others to wait on (pieces of one program cost nothing
# to compile; a kernel's pieces are programs of their own, so a kernel gets one per thread)
MATMUL_PIECES_PER_THREAD = 2
# ... but not into pieces of fewer rows than this (or one per thread): each piece of rows streams
# all of the packed weight, so at bert6_384's M = 64 four pieces of 16 rows summed 1.18x the
# unsplit product's time (K, N = 384, 1536: the weight is 2.4 MB), two pieces of 32 rows 1.05x
MATMUL_PIECE_ROWS = 32
_ALIGN = 64


def _bounds(size: int, parts: int, multiple: int = 1) -> list[tuple[int, int]]:
    """`size` cut into `parts` ranges, each a multiple of `multiple` long but the last (fewer
    ranges, all non-empty, when there is not enough to go round)."""
    step = -(-size // parts)
    step = -(-step // multiple) * multiple
    return [(lo, min(lo + step, size)) for lo in range(0, size, step)]


def estimated_us(call: Call) -> float:
    """One thread's time of `call`, estimated (µs) from its work: a matmul's FLOPs and its B's
    packing, a kernel's elements by the loads and ops of its expression (`KERNEL_NS_PER_ELEMENT`);
    0 for the rest (copies and the like: never split)."""
    if isinstance(call, MatmulCall):
        return _matmul_flops_us(call) + _matmul_packing_us(call)
    if isinstance(call, KernelCall):
        ns = KERNEL_NS_PER_ELEMENT
        # equal nodes once (a fused chain repeats loads and subexpressions that LLVM computes once)
        for node in set(call.ast.root.walk()):
            op = node.arg if node.op == "reduce" else node.op
            if op == "load":
                ns += KERNEL_NS_PER_LOAD
            elif op in _TRANSCENDENTALS:
                ns += KERNEL_NS_PER_TRANSCENDENTAL
            elif op in _DIVISIONS:
                ns += KERNEL_NS_PER_DIVISION
            elif op != "const":
                ns += KERNEL_NS_PER_OP
        return math.prod(call.ast.shape) * ns / 1000
    return 0.0


def _matmul_flops_us(call: MatmulCall) -> float:
    return 2 * call.batch * call.m * call.n * call.k / MATMUL_FLOPS_PER_US


def _matmul_packing_us(call: MatmulCall) -> float:
    return 0.0 if call.prepacked == "b" else call.batch * call.k * call.n * MATMUL_NS_PER_PACKED_B / 1000


def saved_us(call: Call, threads: int) -> float:
    """What splitting `call` over `threads` threads saves, estimated (µs): all but 1/threads of its
    time, but of a product split over M (a batch of one) only of its FLOPs, as every piece of rows
    packs all of an unpacked B itself (`MATMUL_NS_PER_PACKED_B`)."""
    share = 1 - 1 / threads
    if isinstance(call, MatmulCall) and call.batch == 1:
        return _matmul_flops_us(call) * share
    return estimated_us(call) * share


def _shrunk(ast: KernelAST, axis: int, lo: int, hi: int) -> KernelAST:
    """`ast` over rows [lo, hi) of `axis`: every load's view shrunk to them (iteratively: a
    fused chain may be a very deep tree)."""
    def bounds(shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        return tuple((lo, hi) if a == axis else (0, n) for a, n in enumerate(shape))
    new: dict[int, KNode] = {}
    for node in ast.root.walk():
        if node.op == "load":
            slot, tracker = node.arg
            new[id(node)] = KNode("load", (), (slot, tracker.shrink(bounds(tracker.shape))), node.dtype)
        elif node.srcs:
            new[id(node)] = KNode(node.op, tuple(new[id(s)] for s in node.srcs), node.arg, node.dtype)
        else:
            new[id(node)] = node
    shape = tuple(hi - lo if a == axis else n for a, n in enumerate(ast.shape))
    return dataclasses.replace(ast, shape=shape, root=new[id(ast.root)])


def _kernel_pieces(call: KernelCall, b: Sequence[Any], threads: int) -> list[tuple[KernelAST, tuple[int, ...]]] | None:
    """The kernels (each over a range of rows) and arguments of `call` split `threads` ways; None: not split."""
    ast = call.ast
    if ast.outputs != 1 or estimated_us(call) < SPLIT_MIN_US:
        return None
    axis = next((a for a, n in enumerate(ast.shape) if n > 1), None)
    if axis is None or axis in ast.reduce_axes or ast.shape[axis] < threads:
        return None
    if any(len(node.arg[1].shape) != len(ast.shape) for node in ast.root.walk() if node.op == "load"):
        return None
    row_bytes = math.prod(ast.out_shape[axis + 1:]) * ast.out_dtype.itemsize
    # each piece's output 64-byte aligned, as the lowering's vector stores assume of an output
    ranges = _bounds(ast.shape[axis], threads, _ALIGN // math.gcd(_ALIGN, row_bytes))
    if len(ranges) < 2:
        return None
    out, inputs = b[call.out].address, tuple(b[i].address for i in call.inputs)
    return [(_shrunk(ast, axis, lo, hi), (out + lo * row_bytes, *inputs)) for lo, hi in ranges]


def _split_matmul(call: MatmulCall, b: Sequence[Any], device: Device, pieces: int,
                  workspaces: list[np.ndarray]) -> list[Piece] | None:
    if 2 * call.batch * call.m * call.n * call.k < MATMUL_SPLIT_FLOPS:
        return None
    size = call.dtype.itemsize
    program = device.compiler.matmul(call.dtype, call.strided, call.prepacked)
    c, a, bb, w = (b[n].address for n in (call.out, call.a, call.b, call.workspace))
    view = call.strided.arguments() if call.strided is not None else ()
    if call.batch >= 2 and call.strided is None:
        ranges = _bounds(call.batch, pieces)

        def args(lo: int, hi: int, work: int) -> tuple[int, ...]:
            return (c + lo * call.m * call.n * size, a + lo * call.a_batch_stride * size,
                    bb + lo * call.b_batch_stride * size, work, hi - lo, call.m, call.n, call.k,
                    call.a_batch_stride, call.b_batch_stride, call.m * call.n, *view)
    elif call.batch == 1 and (call.strided is None or call.strided.operand == "b"):
        mr = DEFAULT_TILINGS[call.dtype.name].mr
        ranges = _bounds(call.m, pieces, mr)
        if len(ranges) < 2:
            return None

        # rows lo… of A start at lo·K elements, plain or prepacked (lo a multiple of MR: panel lo/MR, MR·K long)
        def args(lo: int, hi: int, work: int) -> tuple[int, ...]:
            return (c + lo * call.n * size, a + lo * call.k * size, bb, work, 1, hi - lo, call.n, call.k,
                    call.a_batch_stride, call.b_batch_stride, (hi - lo) * call.n, *view)
    elif call.batch == 1 and call.strided is not None and call.strided.operand == "a":
        # a convolution turned around (pixels × weight): pieces of its outermost row axis (images
        # or output rows), each a view of its own of the same form, so the same program
        (outer, outer_stride), *inner_axes = call.strided.rows
        inner = math.prod(size for size, _ in inner_axes)
        ranges = _bounds(outer, pieces)
        if len(ranges) < 2:
            return None

        def args(lo: int, hi: int, work: int) -> tuple[int, ...]:
            assert call.strided is not None
            rows = dataclasses.replace(call.strided, rows=((hi - lo, outer_stride), *inner_axes),
                                       offset=call.strided.offset + lo * outer_stride)
            return (c + lo * inner * call.n * size, a, bb, work, 1, (hi - lo) * inner, call.n, call.k,
                    call.a_batch_stride, call.b_batch_stride, (hi - lo) * inner * call.n, *rows.arguments())
    else:
        return None
    out = []
    for t, (lo, hi) in enumerate(ranges):
        work = w
        if t:  # a workspace of its own (the first piece's suffices for any smaller piece of the same product)
            raw = np.empty(b[call.workspace].nbytes + _ALIGN, np.uint8)
            workspaces.append(raw)
            work = raw.ctypes.data + (-raw.ctypes.data % _ALIGN)
        out.append((program, args(lo, hi, work)))
    return out


def frame_saving_us(calls: Sequence[Call], splits: Sequence[bool], threads: int) -> tuple[float, float]:
    """(µs a frame of `calls` saves on `threads` threads when the calls marked in `splits` split,
    after the waits it adds; its one-thread time), both estimated (`estimated_us`, `saved_us`):
    every phase but the last ends in a wait (a run of unsplit calls is one phase), and the workers
    must be woken."""
    total = saved = 0.0
    phases = 0
    in_serial = False
    for call, is_split in zip(calls, splits, strict=True):
        us = estimated_us(call)
        total += us
        if is_split:
            saved += saved_us(call, threads)
            phases += 1
        elif not in_serial:
            phases += 1
        in_serial = not is_split
    return saved - PHASE_WAIT_US * max(phases - 1, 0) - FRAME_WAKE_US, total


def split(calls: Sequence[Call], buffers: Sequence[Buffer | None], device: Device, threads: int,
          workspaces: list[np.ndarray]) -> list[list[list[Piece]]] | None:
    """The phases (each a list of pieces, each piece the launches one thread runs in order) of
    `calls` on `threads` threads (see the module docstring); None when no call is big enough to
    split, or the splits save less than `FRAME_MIN_SAVING` of the frame (one thread's entry
    point then)."""
    kernel_pieces: dict[int, list[tuple[KernelAST, tuple[int, ...]]] | None] = {}
    matmul_pieces: dict[int, list[Piece] | None] = {}
    extra: list[np.ndarray] = []  # the split matmuls' workspaces, kept only if the frame splits
    for index, call in enumerate(calls):
        if isinstance(call, KernelCall):
            kernel_pieces[index] = _kernel_pieces(call, buffers, threads)
        elif isinstance(call, MatmulCall):
            # a piece of rows packs all of an unpacked B itself (a convolution's columns): one per thread then
            finer = call.prepacked == "b" or call.batch >= 2
            count = threads * (MATMUL_PIECES_PER_THREAD if finer else 1)
            if call.batch == 1:  # pieces of rows: see MATMUL_PIECE_ROWS
                count = max(threads, min(count, call.m // MATMUL_PIECE_ROWS))
            matmul_pieces[index] = _split_matmul(call, buffers, device, count, extra)
    splits = [kernel_pieces.get(index) is not None or matmul_pieces.get(index) is not None
              for index in range(len(calls))]
    saving, total = frame_saving_us(calls, splits, threads)
    if not any(splits) or saving < FRAME_MIN_SAVING * total:
        return None
    workspaces.extend(extra)
    # the pieces' kernels built at once, as the lowering builds the calls' (`DeviceCompiler.compile_ahead`)
    device.compiler.compile_ahead([ast for found in kernel_pieces.values() for ast, _ in found or ()], [])
    phases: list[list[list[Piece]]] = []
    serial: list[Piece] = []
    for index, call in enumerate(calls):
        pieces: list[Piece] | None = matmul_pieces.get(index)
        found = kernel_pieces.get(index)
        if found is not None:
            pieces = [(device.compiler.kernel(ast), args) for ast, args in found]
        if pieces is None:
            for command in lower_call(call, buffers, device, []):
                assert isinstance(command, Launch), command
                serial.append((command.program, command.bound(device)[1]))
            continue
        if serial:
            phases.append([list(serial)])
            serial.clear()
        phases.append([[piece] for piece in pieces])
    if serial:
        phases.append([serial])
    return phases
