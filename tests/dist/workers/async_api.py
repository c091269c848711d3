"""ProcessGroup from async code (no td.dist facade): every collective, on the group segment where the ranks share a host."""

import os

import anyio
import numpy as np

from tinydist.dist import ProcessGroup
from tinydist.dist.rendezvous import parse_coordinator


async def main() -> None:
    rank, world = int(os.environ["TINYDIST_RANK"]), int(os.environ["TINYDIST_WORLD_SIZE"])
    async with ProcessGroup.open(rank, world, parse_coordinator(os.environ["TINYDIST_COORDINATOR"])) as group:
        if group.shm is None:
            raise AssertionError("ranks on one host should share a group segment")
        want = sum(np.arange(1001.0) * (r + 1) for r in range(world))
        for algorithm in ("naive", "ring", "all2all", "auto"):
            got = await group.all_reduce(np.arange(1001.0) * (rank + 1), "sum", algorithm)
            if not np.allclose(got, want):
                raise AssertionError(f"all_reduce {algorithm}: {got[:4]} != {want[:4]}")
        gathered = await group.all_gather(np.full(rank + 1, rank))
        if gathered.tolist() != [r for r in range(world) for _ in range(r + 1)]:
            raise AssertionError(f"all_gather: {gathered.tolist()}")
        piece = await group.reduce_scatter(np.ones(2 * world + 1), "sum")
        if piece.tolist() != [float(world)] * len(np.array_split(np.ones(2 * world + 1), world)[rank]):
            raise AssertionError(f"reduce_scatter: {piece.tolist()}")
        if (await group.broadcast(np.arange(5) if rank == 1 else None, src=1)).tolist() != list(range(5)):
            raise AssertionError("broadcast")
        await group.barrier()
    print(f"OK async rank {rank}", flush=True)


anyio.run(main)
