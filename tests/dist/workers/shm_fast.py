"""The native small allreduce (tinydist.dist.shm_fast) in real processes; run by tests/dist/test_shm_fast.py.

    shm_fast.py numpy       every compiled op and dtype, sizes 0 / 1 / prime / uneven shapes / 1 MiB + odd, auto and all2all,
                            in place and into a new array, against numpy; prints how many calls went native,
                            then how many of 3 barriers did
    shm_fast.py mismatch    ranks that disagree on the fast path: every rank raises CollectiveMismatch
    shm_fast.py late        rank 1 calls 0.3 s after its peers (past the native wait): the group's wait takes over
                            (naive and all2all)
    shm_fast.py kill        rank 1 is SIGKILLed while its peers wait in a fast call: RankFailed on every survivor
"""

import os
import signal
import sys
import time

import numpy as np

from tinydist import dist

OPS = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}


def data(rank: int, case: int, shape, dtype) -> np.ndarray:
    rng = np.random.default_rng(1000 * case + rank)
    if np.dtype(dtype).kind == "i":
        return rng.integers(-3, 4, shape).astype(dtype)
    return rng.uniform(0.5, 1.5, shape).astype(dtype)


def reference(op: str, xs: list[np.ndarray]) -> np.ndarray:
    """numpy's binary ufunc over the ranks' inputs in rank order (what naive computes, bitwise)."""
    acc = xs[0].copy()
    for x in xs[1:]:
        acc = OPS[op](acc, x)
    return acc


def fast_calls() -> int:
    fast = dist.get_group().fast
    return -1 if fast is None else fast.completed


def numpy_mode(r: int, n: int) -> None:
    checks, case = 0, 0
    before = fast_calls()
    for dtype in (np.float32, np.float64, np.int32, np.int64):
        for op in OPS:
            for i, shape in enumerate([0, 1, 2, 13, 1021, (3, 5), (7, 11, 2), (1 << 18) + 3]):
                # every other shape asks for all2all (parts of 0 elements at 2 elements on 3-4 ranks, uneven
                # parts); auto picks it for the last (1 MiB + 12 B in float32), naive for the rest
                algorithm = "all2all" if i % 2 == 0 else "auto"
                for in_place in (True, False):
                    case += 1
                    x = data(r, case, shape, dtype)
                    want = reference(op, [data(q, case, shape, dtype) for q in range(n)])
                    got = (dist.all_reduce(x, op=op, algorithm=algorithm, out=x) if in_place
                           else dist.all_reduce(x, op=op, algorithm=algorithm).numpy())
                    if got.shape != want.shape or got.dtype != want.dtype or not np.array_equal(got, want):
                        raise AssertionError(f"{op} {np.dtype(dtype)} {shape} in place {in_place}: "
                                             f"{got.ravel()[:4]} != {want.ravel()[:4]}")
                    checks += 1
    print(f"OK {checks} checks; native calls {fast_calls() - before}", flush=True)
    fast = dist.get_group().fast
    before = 0 if fast is None else fast.barriers
    for _ in range(3):
        dist.barrier()
    print(f"BARRIERS native {0 if fast is None else fast.barriers - before}", flush=True)


def mismatch_mode(r: int, n: int) -> None:
    x4 = np.ones(1024, np.float32)
    cases = {
        "shape": lambda: dist.all_reduce(np.ones(4 if r == 0 else 5, np.float32), out=None),
        "op": lambda: dist.all_reduce(np.ones(16, np.float32), op="sum" if r == 0 else "prod"),
        "dtype": lambda: dist.all_reduce(np.ones(16, np.float32 if r == 0 else np.int32)),
        "algorithm": lambda: dist.all_reduce(x4, algorithm="naive" if r == 0 else "all2all", out=x4),
        # float max is not compiled: rank 0 takes the fast path, the others the segment path
        "path": lambda: dist.all_reduce(np.ones(16, np.int64 if r == 0 else np.float64), op="max"),
        "sequence": lambda: dist.barrier() if r == n - 1 else dist.all_reduce(np.ones(16)),
        # both native and neither moves a byte: only the digest tells them apart
        "empty": lambda: dist.barrier() if r == 0 else dist.all_reduce(np.ones(0, np.float32)),
    }
    for name, fn in cases.items():
        before = time.monotonic()
        try:
            fn()
        except dist.CollectiveMismatch as exc:
            print(f"MISMATCH {name}: {exc}", flush=True)
        else:
            print(f"NO ERROR {name}", flush=True)
        print(f"TOOK {name} {time.monotonic() - before:.3f}", flush=True)
    before = fast_calls()
    y = np.full(3, r + 1.0)
    dist.all_reduce(y, out=y)
    print("AFTER", y.tolist(), "native", fast_calls() - before, flush=True)


def main() -> None:
    mode = sys.argv[1]
    dist.init()
    r, n = dist.rank(), dist.world_size()
    print(f"FAST {dist.get_group().fast is not None}", flush=True)
    if mode == "numpy":
        numpy_mode(r, n)
    elif mode == "mismatch":
        mismatch_mode(r, n)
    elif mode == "late":
        x = np.full(100, r + 1.0)
        for algorithm in ("naive", "all2all"):      # all2all: the handed-over wait is its first step's
            for _ in range(3):
                dist.barrier()
                if r == 1:
                    time.sleep(0.3)
                dist.all_reduce(x, algorithm=algorithm, out=x)
                print("RESULT", algorithm, x[0], x[-1], flush=True)
                x.fill(r + 1.0)
    elif mode == "kill":
        x = np.full(100, r + 1.0)
        dist.all_reduce(x, out=x)
        dist.barrier()
        if r == 1:
            time.sleep(0.2)       # the peers are in their native wait by now
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            dist.all_reduce(x, out=x)
        except dist.CollectiveError as exc:
            print(f"ERROR {type(exc).__name__} rank={getattr(exc, 'rank', None)} msg={exc}", flush=True)
        else:
            print("NO ERROR", flush=True)
        return          # the exit hook's goodbye to a dead peer must not hang either
    dist.destroy()


main()
