"""Data-parallel least squares on a cluster scheduler: each node process joins `tinydist scheduler
serve`, holds a shard of the data per local device, and sums the gradients with the planned
hierarchical allreduce (inside the process over its devices, then across processes).

    tinydist certs init ./lab && tinydist certs issue ./lab --name node-0 && tinydist certs issue ./lab --name node-1
    tinydist scheduler serve --listen 127.0.0.1:29500 --pki ./lab &
    python examples/cluster.py --node-id node-0 --pki ./lab &    # one process per node, any host
    python examples/cluster.py --node-id node-1 --pki ./lab

Every node ends with the same weights; each checks them against numpy's full-batch gradient descent
on the whole data set and exits 1 if they differ. `--insecure` talks to an --insecure-loopback-only
scheduler (tests).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

import tinydist as td
from tinydist.scheduler.execute import ClusterJob
from tinydist.scheduler.node import Credentials


def data(samples: int, features: int) -> tuple[np.ndarray, np.ndarray]:
    """The whole data set, the same on every node (a fixed seed): y = X·w* + noise."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((samples, features))
    return x, x @ np.arange(1.0, features + 1) + 0.01 * rng.standard_normal(samples)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--coordinator", default="127.0.0.1:29500", help="host:port of `tinydist scheduler serve`")
    p.add_argument("--node-id", required=True)
    p.add_argument("--world-size", type=int, default=2, help="node processes in the job")
    p.add_argument("--devices", default="CPU:0,CPU:1", help="this node's devices")
    p.add_argument("--pki", type=Path, help="certificate directory: DIR/clients/<node-id>.pem and DIR/ca.pem")
    p.add_argument("--insecure", action="store_true", help="plaintext to a loopback test scheduler")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--features", type=int, default=8)
    args = p.parse_args()

    credentials = None                 # --insecure: plaintext
    if args.pki is not None:
        clients = args.pki / "clients"
        credentials = Credentials.load(clients / f"{args.node_id}.pem", clients / f"{args.node_id}.key",
                                       args.pki / "ca.pem")
    elif not args.insecure:
        credentials = Credentials.load()   # TINYDIST_CERT / TINYDIST_KEY / TINYDIST_CA
    devices = args.devices.split(",")
    x, y = data(args.samples, args.features)
    lr = 0.5 / args.samples
    with ClusterJob.start(args.coordinator, args.node_id, devices, world_size=args.world_size,
                          credentials=credentials) as job:
        shards = args.world_size * len(devices)
        mine = [job.rank * len(devices) + i for i in range(len(devices))]    # this node's shards, one per device
        xs = [td.Tensor(np.array_split(x, shards)[k], device=d) for k, d in zip(mine, devices)]
        ys = [td.Tensor(np.array_split(y, shards)[k], device=d) for k, d in zip(mine, devices)]
        w = np.zeros(args.features)
        for step in range(args.steps):
            grads = [xk.T @ (xk @ td.Tensor(w, device=d) - yk) for xk, yk, d in zip(xs, ys, devices)]
            total = job.all_reduce(grads)[0].numpy()          # the sum over every device of every node
            w = w - lr * total
            if job.rank == 0 and step % 5 == 0:
                loss = float(np.mean((x @ w - y) ** 2))
                print(f"step {step:3d}  loss {loss:.4f}", flush=True)
        if job.rank == 0:
            print(job.plan(w.nbytes).explain(), flush=True)
    reference = np.zeros(args.features)
    for _ in range(args.steps):
        reference = reference - lr * x.T @ (x @ reference - y)
    ok = np.allclose(w, reference, rtol=1e-9, atol=1e-9)
    print(f"{args.node_id}: weights {np.round(w, 3).tolist()} {'equal' if ok else 'DIFFER from'} numpy's", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
