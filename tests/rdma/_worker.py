"""One rank of the two-process RDMA tests (run by test_link.py and bench/rdma.py)."""

from __future__ import annotations

import asyncio
import os
import socket
import sys

import anyio
import numpy as np


async def connect(rank: int, port: int, fd: int | None) -> socket.socket:
    loop = asyncio.get_running_loop()
    if rank == 0:
        listener = socket.socket(fileno=fd)
        listener.setblocking(False)
        with anyio.fail_after(20):
            sock, _ = await loop.sock_accept(listener)
        listener.close()
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        with anyio.fail_after(20):
            await loop.sock_connect(sock, ("127.0.0.1", port))
    sock.setblocking(False)
    return sock


async def allreduce(rank: int, port: int, fd: int | None, out: str) -> None:
    from tinydist.dist.group import ProcessGroup
    from tinydist.transports.rdma_bnxt.transport import close_process_nic, open_link
    sock = await connect(rank, port, fd)
    link = await open_link(sock, rank, 1 - rank, timeout=20)
    group = ProcessGroup(rank, 2)
    group.links = {1 - rank: link}
    group.same_host = False
    results = {"kind": np.array(link.kind)}
    async with anyio.create_task_group() as tg:
        group._tg = tg
        tg.start_soon(link.serve)
        for name, x in (("f32", np.random.default_rng(rank).standard_normal(1_000_003).astype(np.float32)),
                        ("i64", np.arange(300_001, dtype=np.int64) * (rank + 1))):
            for algorithm in ("naive", "ring"):
                results[f"{name}_{algorithm}"] = await group.all_reduce(x, "sum", algorithm)
        results["gather"] = await group.all_gather(np.full(5 + rank, rank, np.int32))
        await link.close()
        tg.cancel_scope.cancel()
    await close_process_nic()
    np.savez(out, **results)


if __name__ == "__main__":
    rank, port = int(sys.argv[2]), int(sys.argv[3])
    fd = int(sys.argv[4]) if sys.argv[4] != "-" else None
    if sys.argv[1] == "allreduce":
        asyncio.run(asyncio.wait_for(allreduce(rank, port, fd, sys.argv[5]), 60))
    os._exit(0)
