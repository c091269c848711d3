"""Every process collective as a graph node (an unrealized td.Tensor) against a numpy float64 reference;
run by tests/dist/test_graph_collectives.py under `tinydist launch`. argv[1]: "values" or "mismatch"."""

import sys

import numpy as np

import tinydist as td
from tinydist import dist
from tinydist.graph.collectives import shard_bounds
from tinydist.graph.lazy import Op

REDUCE = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min, "prod": np.prod}
SIZES = [0, 1, 7919, (1 << 18) + 3]          # 0, 1, a prime, 1 MiB + 3 elements of float32


def data(rank: int, size: int, case: int) -> np.ndarray:
    return np.random.default_rng(100 * case + rank).uniform(0.5, 1.5, size).astype(np.float32)


def lazy(x: np.ndarray) -> td.Tensor:
    """`x` as an unrealized tensor (x * 1): the collective of it becomes a graph node."""
    t = td.Tensor(x) * 1.0
    assert not t.node.realized
    return t


def check(got: td.Tensor, want: np.ndarray, what: str) -> None:
    if got.node.op is not Op.COLLECTIVE:
        raise AssertionError(f"{what}: not a graph node ({got.node.op})")
    arr = got.numpy()
    if arr.shape != want.shape or arr.dtype != np.float32:
        raise AssertionError(f"{what}: {arr.dtype}{list(arr.shape)} != float32{list(want.shape)}")
    if not np.allclose(arr, want, rtol=2e-6, atol=0):
        raise AssertionError(f"{what}: values differ (max abs err {np.abs(arr - want).max()})")


def values() -> None:
    r, n = dist.rank(), dist.world_size()
    count, case = 0, 0
    for size in SIZES:
        case += 1
        inputs = [data(q, size, case).astype(np.float64) for q in range(n)]
        stack = np.stack(inputs)
        for op, ref in REDUCE.items():
            for algorithm in ("auto", "ring") if op == "sum" else ("auto",):
                check(dist.all_reduce(lazy(inputs[r].astype(np.float32)), op=op, algorithm=algorithm),
                      ref(stack, axis=0) if size else np.zeros(0), f"all_reduce {op} {algorithm} size {size}")
                count += 1
        lo, hi = shard_bounds(size, n)[r]
        check(dist.reduce_scatter(lazy(inputs[r].astype(np.float32)), op="sum"), stack.sum(0)[lo:hi],
              f"reduce_scatter size {size}")
        check(dist.broadcast(lazy(inputs[r].astype(np.float32)), src=n - 1), inputs[n - 1], f"broadcast size {size}")
        # uneven pieces: rank q holds size + q rows
        pieces = [data(q, size + q, case).astype(np.float64) for q in range(n)]
        check(dist.all_gather(lazy(pieces[r].astype(np.float32)), lengths=[size + q for q in range(n)]),
              np.concatenate(pieces), f"all_gather uneven size {size}")
        # equal pieces: the node's shape from this rank's (an empty one says nothing of its peers': lengths=)
        check(dist.all_gather(lazy(inputs[r].astype(np.float32)), lengths=None if size else [0] * n),
              np.concatenate(inputs), f"all_gather size {size}")
        count += 4
    # a chain in one realize: a collective's result feeds another collective and a kernel
    x = data(r, 1001, 99)
    total = np.stack([data(q, 1001, 99).astype(np.float64) for q in range(n)]).sum(0)
    y = dist.all_reduce(dist.all_reduce(lazy(x)) * 2.0, op="max") + 1.0
    got = y.numpy()
    if not np.allclose(got, total * 2 + 1, rtol=2e-6):
        raise AssertionError("chained collectives differ")
    count += 1
    print(f"[rank {r}] OK {count} graph collectives on rank {r} of {n}", flush=True)


def mismatch() -> None:
    """The ranks' call sequences differ (rank 0 all-reduces 5 elements, the others 4): every rank's
    realize raises, the CollectiveMismatch as the cause."""
    r = dist.rank()
    warm = dist.all_reduce(lazy(np.ones(4, np.float32))).numpy()   # agreed: the fast path's entry is made
    fast = dist.get_group().fast
    print(f"[rank {r}] FAST PATH {'on' if fast is not None and any(e is not None for e in fast.entries.values()) else 'off'} {warm.tolist()}", flush=True)
    t = dist.all_reduce(lazy(np.ones(5 if r == 0 else 4, np.float32)))
    try:
        t.numpy()
    except td.DeviceFailed as exc:
        cause = exc.__cause__
        print(f"[rank {r}] RAISED {type(cause).__name__}: {cause}", flush=True)
    else:
        print(f"[rank {r}] NO ERROR", flush=True)


if __name__ == "__main__":
    dist.init()
    {"values": values, "mismatch": mismatch}[sys.argv[1]]()
    dist.destroy()
