"""The cost of publishing progress (`tinydist.codegen.progress`) in the hot kernels, measured A/B.

Each case compiles the kernel the code generator emits and the kernel as it was before progress
(generated with publishing off: no strip-mining, no stores), loads both into this process, and times them on the same data, alternating A and B
every repeat (pinned to one core), so drifting load hits both alike. Reported: the medians and
B/A - 1, the cost of the stores, and the same ratio of the best times (on this shared VM a
neighbour's burst can double a sample for either side; the best of each is the code's own speed). The cases are the hot kernels and the worst case for a store per
outermost iteration: a 2-D elementwise kernel whose rows are three elements long.

    .venv/bin/python bench/progress.py [--repeats 21] [--cpu N] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import Report, clock, median  # noqa: E402

from tinydist.codegen.compile_cache import compile_kernel  # noqa: E402
from tinydist.codegen.kernel import KernelAST, KNode, load  # noqa: E402
from tinydist.codegen.lowering import lower  # noqa: E402
from tinydist.codegen.matmul import SIGNATURE, matmul_ir  # noqa: E402
from tinydist.codegen.matmul_tiling import workspace_bytes  # noqa: E402
from tinydist.graph import dtypes  # noqa: E402
from tinydist.graph.shape import ShapeTracker, View  # noqa: E402
from tinydist.runtime.cpu.loader import native_loader  # noqa: E402

_KEEP: list[np.ndarray] = []  # the arrays the cases' arguments point into, alive for the run


def _matmul_pair(m: int) -> tuple[Callable[..., None], Callable[..., None]]:
    """The matmul kernel with and without its progress stores (its loops are the same either way)."""
    name = f"bench_progress_matmul_{m}"
    with_stores = native_loader.load(compile_kernel(matmul_ir(name)), name, list(SIGNATURE)).cfunc
    plain = name + "_plain"
    without = native_loader.load(compile_kernel(matmul_ir(plain, publish_progress=False)), plain, list(SIGNATURE)).cfunc
    return with_stores, without


def _lowered_pair(ast: KernelAST, signature: list[str]) -> tuple[Callable[..., None], Callable[..., None]]:
    """The kernel as lowered now, and as lowered with publishing off: the loops as they were
    before progress (no strip-mining, no global), so the difference is the whole change's cost."""
    name, ir_text = lower(ast)
    plain, plain_ir = lower(ast, publish_progress=False)
    assert "_progress" not in plain_ir and plain != name
    return (native_loader.load(compile_kernel(ir_text), name, signature).cfunc,
            native_loader.load(compile_kernel(plain_ir), plain, signature).cfunc)


def _contiguous(shape: tuple[int, ...]) -> ShapeTracker:
    return ShapeTracker.contiguous(shape)


def _elementwise(shape: tuple[int, ...], trackers: list[ShapeTracker]) -> KernelAST:
    a, b, c = (load(i, t, dtypes.float32) for i, t in enumerate(trackers))
    root = KNode("add", (KNode("mul", (a, b), None, dtypes.float32), c), None, dtypes.float32)
    return KernelAST(shape, (), root, (dtypes.float32,) * 3, dtypes.float32)


def cases() -> dict[str, tuple[Callable[..., None], Callable[..., None], tuple[int, ...]]]:
    """name -> (the kernel with its progress stores, without them, its arguments)."""
    out = {}
    rng = np.random.default_rng(0)
    keep = []  # arrays the arguments point into

    def arrays(*shapes: tuple[int, ...]) -> list[int]:
        """Addresses of random float32 arrays, 64-byte aligned as the allocator's buffers are
        (the vector loops' aligned and streaming stores rely on it)."""
        addresses = []
        for shape in shapes:
            count = int(np.prod(shape))
            raw = np.empty(count + 16, np.float32)
            skip = (-raw.ctypes.data % 64) // 4
            raw[skip:skip + count] = rng.standard_normal(count, dtype=np.float32)
            keep.append(raw)
            addresses.append(raw.ctypes.data + 4 * skip)
        return addresses

    n = 1 << 24
    pair = _lowered_pair(_elementwise((n,), [_contiguous((n,))] * 3), ["w", "r", "r", "r"])
    out["fused a*b+c 16M f32 (1-D vector loop)"] = (*pair, tuple(arrays((n,), (n,), (n,), (n,))))

    rows = 1 << 20
    row = ShapeTracker((View.create((rows, 3), (0, 1)),))
    pair = _lowered_pair(_elementwise((rows, 3), [_contiguous((rows, 3)), row, _contiguous((rows, 3))]), ["w", "r", "r", "r"])
    out["a*row+c (1M, 3) f32 (worst case: 3-element rows)"] = (*pair, tuple(arrays((rows, 3), (rows, 3), (1, 3), (rows, 3))))

    tracker = _contiguous((n,))
    root = KNode("reduce", (load(0, tracker, dtypes.float32),), "sum", dtypes.float32)
    pair = _lowered_pair(KernelAST((n,), (0,), root, (dtypes.float32,), dtypes.float32), ["w", "r"])
    out["sum 16M f32"] = (*pair, tuple(arrays((1,), (n,))))

    small = _contiguous((8, 8))
    root = KNode("sub", (load(0, small, dtypes.float32), load(1, small, dtypes.float32)), None, dtypes.float32)
    pair = _lowered_pair(KernelAST((8, 8), (), root, (dtypes.float32,) * 2, dtypes.float32), ["w", "r", "r"])
    out["tiny 8x8 f32 (an eager graph's kernel)"] = (*pair, tuple(arrays((8, 8), (8, 8), (8, 8))))

    m = 1024
    pair = _matmul_pair(m)
    c, a, b = arrays((m, m), (m, m), (m, m))
    (workspace,) = arrays((workspace_bytes(m, m, m) // 4 + 1,))
    out["matmul 1024^3 f32"] = (*pair, (c, a, b, workspace, 1, m, m, m, 0, 0, 0))
    _KEEP.extend(keep)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--cpu", type=int, default=min(os.sched_getaffinity(0)), help="the core it runs on")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results as a JSON list to PATH")
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.cpu})
    report = Report("progress", args.json)
    for label, (with_stores, without, arguments) in cases().items():
        inner = max(1, int(2e-3 / _once(without, arguments)))  # each sample at least ~2 ms
        with_times, without_times = [], []
        for repeat in range(args.repeats):
            first, second = (with_stores, without) if repeat % 2 else (without, with_stores)
            for fn in (first, second):
                (with_times if fn is with_stores else without_times).append(_timed(fn, arguments, inner))
        a, b = median(without_times), median(with_times)
        best_a, best_b = min(without_times), min(with_times)
        report.add(label, 100 * (b / a - 1), "% cost", value_label="progress stores",
                   detail=(f"without {a * 1e6:.2f} us, with {b * 1e6:.2f} us per call, alternating; "
                           f"best of each {best_a * 1e6:.2f} / {best_b * 1e6:.2f} us = {100 * (best_b / best_a - 1):+.1f} %"),
                   repeats=args.repeats)
    report.finish()


def _once(fn: Callable[..., None], arguments: tuple[int, ...]) -> float:
    fn(*arguments)
    start = clock()
    fn(*arguments)
    return max(clock() - start, 1e-7)


def _timed(fn: Callable[..., None], arguments: tuple[int, ...], inner: int) -> float:
    start = clock()
    for _ in range(inner):
        fn(*arguments)
    return (clock() - start) / inner


if __name__ == "__main__":
    main()
