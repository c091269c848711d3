"""One td.dist rank for tests/cluster/test_two_hosts.py: allreduce / all_gather / broadcast of seeded
float64 data, saved for the test to compare with numpy; or (--until-failure) allreduces in a loop
until the group fails, printing the error's class and how long the failing collective took.

Prints `LINKS {peer: [kind, local address]}` after init, so the test sees which transport each pair
got and which address this rank's sockets are bound to."""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def data(rank: int, size: int) -> np.ndarray:
    return np.random.default_rng(1000 + rank).standard_normal(size)


def piece(rank: int) -> np.ndarray:
    """Rank r contributes r + 1 rows: pieces of different lengths, as all_gather allows."""
    return np.random.default_rng(2000 + rank).standard_normal((rank + 1, 3))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--coordinator", required=True)
    p.add_argument("--size", type=int, default=100_003)
    p.add_argument("--out")
    p.add_argument("--until-failure", action="store_true")
    args = p.parse_args()

    import tinydist as td
    from tinydist.dist import CollectiveError

    # the rendezvous waits for processes started one by one on a loaded machine; collectives use
    # TINYDIST_COLLECTIVE_TIMEOUT (the failure test sets it short)
    td.dist.init(rank=args.rank, world_size=args.world, coordinator=args.coordinator, timeout=60)
    group = td.dist.get_group()
    links = {peer: [link.kind, link.sock.getsockname()[0]] for peer, link in group.links.items()}
    print("LINKS " + json.dumps(links), flush=True)
    x = data(args.rank, args.size)
    if args.until_failure:
        t0 = time.monotonic()
        try:
            for i in range(1_000_000):
                t0 = time.monotonic()
                td.dist.all_reduce(x)
                if i == 0:
                    print("LOOPING", flush=True)
        except CollectiveError as exc:
            print(f"FAILED {type(exc).__name__} after {time.monotonic() - t0:.2f} s: {exc}", flush=True)
            return 3
        return 0
    results = {
        "all_reduce": td.dist.all_reduce(x).numpy(),
        "all_reduce_ring": td.dist.all_reduce(x, algorithm="ring").numpy(),
        "all_reduce_max": td.dist.all_reduce(x, op="max").numpy(),
        "all_gather": td.dist.all_gather(piece(args.rank), axis=0).numpy(),
        "broadcast": td.dist.broadcast(x if args.rank == args.world - 1 else None, src=args.world - 1).numpy(),
    }
    td.dist.barrier()
    np.savez(f"{args.out}.rank{args.rank}.npz", **results)
    td.dist.destroy()
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
