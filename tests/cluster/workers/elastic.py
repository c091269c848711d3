"""An elastic training job on the cluster scheduler: least squares by SGD with momentum, the weights
and the momentum sharded across ranks (numpy.array_split's rule: each rank all-gathers the weights,
computes the gradient of its slice of the batch, reduce-scatters it, updates its shard), a sharded
checkpoint committed every step. The job is a rendezvous round of --min..--max nodes; it resumes
from the newest committed step, resharded to the round's world size. Used by tests/cluster/test_elastic.py."""

from __future__ import annotations

import argparse
import os
import signal
import sys

import numpy as np

ROWS, DIM, BATCH, LR, MOMENTUM = 240, 37, 24, 0.05, 0.9


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((ROWS, DIM))
    return x, x @ rng.standard_normal(DIM) + 0.01 * rng.standard_normal(ROWS)


def batch(step: int) -> np.ndarray:
    return (np.arange(BATCH) + step * BATCH) % ROWS


def reference(steps: int) -> np.ndarray:
    """The same training in one numpy process, float64: what the sharded job computes, up to rounding."""
    x, y = data()
    w, m = np.zeros(DIM), np.zeros(DIM)
    for step in range(steps):
        rows = batch(step)
        m = MOMENTUM * m + x[rows].T @ (x[rows] @ w - y[rows]) / BATCH
        w = w - LR * m
    return w


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--coordinator", required=True)
    p.add_argument("--node-id", required=True)
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--min", type=int, required=True)
    p.add_argument("--max", type=int, required=True)
    p.add_argument("--last-call", type=float, default=1.0)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out")
    p.add_argument("--die-at", type=int, default=-1, help="SIGKILL itself at the start of this step")
    args = p.parse_args()

    from tinydist import dist
    from tinydist.dist.errors import CollectiveError
    from tinydist.graph.collectives import shard_sizes
    from tinydist.scheduler import checkpoint as ck
    from tinydist.scheduler.errors import ClusterError
    from tinydist.scheduler.execute import ClusterJob

    job = ClusterJob.start(args.coordinator, args.node_id, ["CPU:0"], world_size=args.max, rank=args.rank,
                           min_size=args.min, last_call=args.last_call, probe=False)
    rank, world = job.rank, job.world_size
    table = sorted(job.agent.table.values(), key=lambda m: m.node.rank)
    print(f"ROUND {job.agent.round} world={world} rank={rank} members="
          f"{[(m.node.node_id, m.node.pid) for m in table]}", flush=True)
    x, y = data()
    w, mom = np.array_split(np.zeros(DIM), world)[rank], np.array_split(np.zeros(DIM), world)[rank]
    start = 0
    last = ck.latest(args.ckpt)
    if last is not None:
        state = ck.load_resharded(args.ckpt, last, rank, world, replicated=("step",))
        w, mom, start = state["w"], state["m"], int(state["step"]) + 1
        print(f"RESUMED from step {last} ({ck.committed(args.ckpt, last)['world_size']} ranks -> {world})", flush=True)
    step = start
    try:
        for step in range(start, args.steps):
            if step == args.die_at:
                print(f"DYING at step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            full = dist.all_gather(w, axis=0).numpy()
            rows = np.array_split(batch(step), world)[rank]
            g = dist.reduce_scatter(x[rows].T @ (x[rows] @ full - y[rows]), axis=0).numpy() / BATCH
            mom = MOMENTUM * mom + g
            w = w - LR * mom
            ck.save_shard(args.ckpt, step, rank, {"w": w, "m": mom, "step": np.int64(step)})
            dist.barrier()
            if rank == 0:
                sizes = shard_sizes(DIM, world)
                ck.commit(args.ckpt, step, world, {"rows": {"w": sizes, "m": sizes}})
            print(f"STEP {step} done", flush=True)
        full = dist.all_gather(w, axis=0).numpy()
    except (CollectiveError, ClusterError) as exc:     # a rank of the round died: the agent restarts us
        print(f"FAILED {type(exc).__name__} at step {step}: {exc}", flush=True)
        os._exit(3)
    if args.out and rank == 0:
        np.save(args.out, full)
    job.close()
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
