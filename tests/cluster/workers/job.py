"""A training-like job on the cluster scheduler: hierarchical allreduce of per-device gradients,
sharded checkpoints every step, resume after a restart. Used by tests/cluster and bench/cluster.py."""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np


def grads(step: int, device: int, size: int) -> np.ndarray:
    return (np.arange(size) % 7 + device + step).astype(np.float64)


def expected(steps: int, devices: int, size: int) -> np.ndarray:
    w = np.zeros(size)
    for s in range(steps):
        w -= 0.5 * sum(grads(s, d, size) for d in range(devices))
    return w


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--coordinator", required=True)
    p.add_argument("--node-id", required=True)
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--devices", default="CPU:0,CPU:1")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--size", type=int, default=1000)
    p.add_argument("--ckpt")
    p.add_argument("--out")
    p.add_argument("--stall-at", type=int, default=-1, help="sleep before this step's allreduce (a kill target)")
    p.add_argument("--host-key")
    p.add_argument("--address", default="127.0.0.1", help="the interface other nodes reach this one on")
    p.add_argument("--pki", help="certificate dir: use DIR/clients/<node-id>.pem (mTLS)")
    p.add_argument("--status", action="store_true", help="rank 0 prints the plan")
    p.add_argument("--hold", type=float, default=0.0, help="stay joined this long after the last step")
    p.add_argument("--step-sleep", type=float, default=0.0, help="sleep this long after each step (a slow job)")
    p.add_argument("--wait-rejoin", type=float, default=0.0,
                   help="after the last step, wait this long for a re-registration with the coordinator")
    args = p.parse_args()

    from tinydist.scheduler.errors import ClusterError, NodeFailed
    from tinydist.scheduler.execute import ClusterJob
    from tinydist.scheduler.node import Credentials
    from tinydist.scheduler import checkpoint as ck

    creds = None
    if args.pki:
        creds = Credentials.load(f"{args.pki}/clients/{args.node_id}.pem", f"{args.pki}/clients/{args.node_id}.key",
                                 f"{args.pki}/ca.pem")
    devices = args.devices.split(",")
    job = ClusterJob.start(args.coordinator, args.node_id, devices, world_size=args.world, rank=args.rank,
                           credentials=creds, host_key=args.host_key, address=args.address)
    rank, world = job.rank, job.world_size
    ndev = len(devices)
    print(f"JOINED rank={rank} world={world}", flush=True)
    if args.status and rank == 0:
        print(job.plan(args.size * 8).explain(), flush=True)
    from tinydist import dist
    w = np.zeros(args.size)
    start = 0
    if args.ckpt:
        last = ck.latest(args.ckpt, world)
        if last is not None:
            piece = ck.load_shard(args.ckpt, last, rank)["w"]
            w = dist.all_gather(piece, axis=0).numpy()
            start = last + 1
            print(f"RESUMED from step {last}", flush=True)
    try:
        for step in range(start, args.steps):
            if step == args.stall_at:
                print(f"STALL step {step}", flush=True)
                time.sleep(60)
            local = [grads(step, rank * ndev + i, args.size) for i in range(ndev)]
            t0 = time.monotonic()
            outs = job.all_reduce(local)
            g = outs[0].numpy()
            if step == start:
                want = sum(grads(step, d, args.size) for d in range(world * ndev))
                ok = all(np.array_equal(o.numpy(), want) for o in outs)
                print(f"ALLREDUCE {'ok' if ok else 'MISMATCH'} step {step} in {time.monotonic() - t0:.3f} s", flush=True)
            w = w - 0.5 * g
            if args.ckpt:
                ck.save_shard(args.ckpt, step, rank, {"w": np.array_split(w, world)[rank]})
                dist.barrier()
                if rank == 0:
                    ck.commit(args.ckpt, step, world)
            print(f"STEP {step} done", flush=True)
            time.sleep(args.step_sleep)
    except NodeFailed as exc:
        print(f"NODEFAILED node={exc.node_id} after {time.monotonic() - t0:.2f} s: {exc}", flush=True)
        os._exit(3)
    except ClusterError as exc:                    # CoordinatorLost: the scheduler stayed away past the bound
        print(f"CLUSTERERROR {type(exc).__name__} at step {step}: {exc}", flush=True)
        os._exit(4)
    if args.out and rank == 0:
        np.save(args.out, w)
    if args.wait_rejoin:
        ok = job.agent.rejoined.wait(args.wait_rejoin)
        print(f"REJOINED {job.agent.rejoins}" if ok else f"NO REJOIN within {args.wait_rejoin} s", flush=True)
    if args.hold:
        print("HOLDING", flush=True)
        time.sleep(args.hold)
    job.close()
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
