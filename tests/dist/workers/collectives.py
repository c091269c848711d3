"""Every collective, op, algorithm and dtype against numpy; run by tests/dist/test_collectives.py under `tinydist launch`."""

import sys

import numpy as np

import tinydist as td
from tinydist import dist

OPS = {"sum": lambda s: s.sum(0), "mean": lambda s: s.mean(0), "prod": lambda s: s.prod(0),
       "max": lambda s: s.max(0), "min": lambda s: s.min(0)}


def data(rank: int, case: int, size, dtype) -> np.ndarray:
    rng = np.random.default_rng(1000 * case + rank)
    if np.dtype(dtype).kind == "i":
        return rng.integers(1, 4, size).astype(dtype)
    return rng.uniform(0.5, 1.5, size).astype(dtype)


def check(got, want, what) -> None:
    got = got.numpy() if isinstance(got, td.Tensor) else got
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {got.shape} != {want.shape}")
    if want.dtype.kind == "f":
        rtol = 1e-5 if want.dtype == np.float32 or got.dtype == np.float32 else 1e-12
        if not np.allclose(got, want, rtol=rtol, atol=0):
            raise AssertionError(f"{what}: values differ (max abs err {np.abs(got - want).max()})")
    elif not np.array_equal(got, want):
        raise AssertionError(f"{what}: values differ")


def main() -> None:
    dist.init()
    r, n = dist.rank(), dist.world_size()
    count, case = 0, 0
    sizes = [0, 1, 7, 1001, (3, 5)]
    for dtype in (np.float32, np.float64, np.int64):
        for op, ref in OPS.items():
            for algorithm in ("naive", "ring", "all2all", "auto"):
                for size in sizes:
                    case += 1
                    x = data(r, case, size, dtype)
                    want = ref(np.stack([data(q, case, size, dtype) for q in range(n)]))
                    got = dist.all_reduce(td.Tensor(x) if case % 2 else x, op=op, algorithm=algorithm)
                    if not isinstance(got, td.Tensor):
                        raise AssertionError("all_reduce must return a td.Tensor")
                    check(got, want, f"all_reduce {op} {algorithm} {np.dtype(dtype)} {size}")
                    count += 1
    # in place (out=x) and into a separate out=: exactly the out-of-place result; sizes up to 1 MiB + 12 B of
    # float32, which takes many rounds on the group segment. Integer mean is float64, so it needs a separate out.
    for dtype in (np.float32, np.float64, np.int64):
        for op, ref in OPS.items():
            for algorithm in ("naive", "ring", "all2all", "auto"):
                for size in [*sizes, (1 << 18) + 3]:
                    case += 1
                    x = data(r, case, size, dtype)
                    plain = dist.all_reduce(x, op=op, algorithm=algorithm).numpy()
                    into = x if plain.dtype == x.dtype else np.empty_like(plain)
                    got = dist.all_reduce(x, op=op, algorithm=algorithm, out=into)
                    what = f"all_reduce out= {op} {algorithm} {np.dtype(dtype)} {size}"
                    if got is not into:
                        raise AssertionError(f"{what}: returned {type(got).__name__}, not its out= array")
                    # all2all over links adds float contributions in arrival order: equal only within rounding
                    exact = algorithm != "all2all" or op in ("max", "min") or np.dtype(dtype).kind == "i"
                    if exact and not np.array_equal(into, plain):
                        raise AssertionError(f"{what}: differs from the out-of-place result")
                    check(into, ref(np.stack([data(q, case, size, dtype) for q in range(n)])), what)
                    count += 1
    # into a separate out= of the input's dtype (naive and ring over links reduce straight into it): float64
    # against numpy, the input untouched; 0 / 1 / prime / 1 MiB + 24 B, past the links' spare-buffer size
    for algorithm in ("naive", "ring", "all2all", "auto"):
        for size in (0, 1, 7919, (1 << 17) + 3):
            case += 1
            x = data(r, case, size, np.float64)
            before = x.copy()
            into = np.full_like(x, np.nan)
            got = dist.all_reduce(x, op="sum", algorithm=algorithm, out=into)
            what = f"all_reduce into a separate out= {algorithm} float64 {size}"
            if got is not into:
                raise AssertionError(f"{what}: returned {type(got).__name__}, not its out= array")
            if not np.array_equal(x, before):
                raise AssertionError(f"{what}: the input changed")
            check(into, np.stack([data(q, case, size, np.float64) for q in range(n)]).sum(0), what)
            count += 1
    # long enough for several pipelined chunks per ring segment, odd length
    for algorithm in ("naive", "ring", "all2all"):
        for dtype in (np.float32, np.int64):
            case += 1
            size = 400_003
            x = data(r, case, size, dtype)
            want = np.stack([data(q, case, size, dtype) for q in range(n)]).sum(0)
            check(dist.all_reduce(x, "sum", algorithm), want, f"big all_reduce {algorithm} {np.dtype(dtype)}")
            count += 1
    # all_gather: uneven pieces (one rank may bring none), along axis 0 and 1
    for axis in (0, 1):
        for dtype in (np.float32, np.int64):
            case += 1
            def piece(q):
                length = (q * 3 + 1) % 4        # 1, 0, 3, 2 ...
                shape = (length, 3) if axis == 0 else (2, length)
                return data(q, case, shape, dtype)
            want = np.concatenate([piece(q) for q in range(n)], axis=axis)
            check(dist.all_gather(td.Tensor(piece(r)), axis=axis), want, f"all_gather axis {axis}")
            count += 1
    case += 1
    big = lambda q: data(q, case, (70_001 + q * 1000,), np.float64)
    check(dist.all_gather(big(r)), np.concatenate([big(q) for q in range(n)]), "big all_gather")
    count += 1
    # reduce_scatter: lengths not divisible by world size, both axes, every op
    for algorithm in ("auto", "ring", "all2all", "naive"):
        for op, ref in OPS.items():
            for axis, shape in ((0, (2 * n + 1, 3)), (1, (2, 3 * n + 2)), (0, (300_001,))):
                case += 1
                x = data(r, case, shape, np.float64)
                full = ref(np.stack([data(q, case, shape, np.float64) for q in range(n)]))
                want = np.array_split(full, n, axis=axis)[r]
                check(dist.reduce_scatter(x, op=op, axis=axis, algorithm=algorithm), want, f"reduce_scatter {op} {algorithm} axis {axis}")
                count += 1
    # broadcast from every root; non-roots pass None or a template
    for src in range(n):
        case += 1
        x = data(src, case, (4, 5), np.int64)
        got = dist.broadcast(x if r == src else (None if r % 2 else np.zeros((4, 5), np.int64)), src=src)
        check(got, x, f"broadcast from {src}")
        count += 1
    case += 1
    x = data(0, case, 300_000, np.float32)
    check(dist.broadcast(x if r == 0 else None), x, "big broadcast")
    for _ in range(3):
        dist.barrier()
    shm = dist.get_group().shm
    single_copy = shm is not None and shm.single_copy_bytes is not None
    dist.destroy()
    print(f"OK {count} checks on rank {r} of {n}; single copy: {single_copy}")


if __name__ == "__main__":
    main()
    sys.exit(0)
