"""Train an MLP on scikit-learn's bundled handwritten digits (8x8 images, no download).

    .venv/bin/python examples/train_digits.py                 # one device
    .venv/bin/python examples/train_digits.py --devices 2     # data parallel over CPU:0, CPU:1 (one process)
    .venv/bin/tinydist launch --nproc 2 examples/train_digits.py   # data parallel over 2 processes
    torchrun --nproc-per-node 2 examples/train_digits.py          # the same job under torchrun
    sbatch --ntasks=2 deploy/slurm/train.sbatch examples/train_digits.py   # ... as a Slurm job (srun steps)

Needs the `examples` extra (scikit-learn). Shows each epoch's progress (loss, samples/s) as a bar on
a terminal and as a few plain lines into a pipe or under `tinydist launch` (tinydist.base.progress),
then the epoch's test accuracy; exits non-zero if the final test accuracy is below --target.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import tinydist as td
from tinydist.base.progress import progress

F = td.nn.functional


def load(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    split = int(len(x) * 0.8)
    return x[:split], y[:split], x[split:], y[split:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=1, help="in-process data-parallel devices (CPU:0..)")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", type=float, default=0.97, help="fail below this test accuracy")
    parser.add_argument("--checkpoint", default=None, help="save the model and optimizer here at the end")
    args = parser.parse_args(argv)

    rank, world = 0, 1
    job = td.dist.job_environment()        # whichever launcher started us; None when run by hand
    if job is not None and job.world_size > 1:
        td.dist.init()
        rank, world = td.dist.rank(), td.dist.world_size()
        # every rank says where it is, so a job's log shows one group of `world` ranks (not `world` jobs of one)
        print(f"rank {rank} of {world} in one group (launched by {job.source}, rendezvous {job.coordinator})", flush=True)
    out = sys.stdout if rank == 0 else open(os.devnull, "w")

    xtr, ytr, xte, yte = load(args.seed)
    td.manual_seed(args.seed)
    model = td.nn.Sequential(td.nn.Linear(64, args.hidden), td.nn.ReLU(), td.nn.Linear(args.hidden, 10))
    ddp = td.parallel.DistributedDataParallel(model, devices=args.devices if world == 1 else None)
    opt = td.optim.Adam(ddp.parameters(), lr=args.lr)
    where = f"{world} processes" if world > 1 else f"{args.devices} device(s) in one process"
    print(f"digits: {len(xtr)} train / {len(xte)} test, MLP 64-{args.hidden}-10, batch {args.batch_size}, {where}", file=out)

    batch, local = args.batch_size, args.batch_size // world
    steps = len(xtr) // batch                      # the last partial batch is dropped
    rng = np.random.default_rng(args.seed + 1)
    accuracy = 0.0
    for epoch in range(args.epochs):
        order = rng.permutation(len(xtr))
        start, seen, loss_sum = time.perf_counter(), 0, 0.0
        model.train()
        bar = progress(range(steps), desc=f"epoch {epoch + 1:2d}/{args.epochs}", file=out, unit="step", lines=4)
        for step in bar:
            index = order[step * batch:(step + 1) * batch][rank * local:(rank + 1) * local]
            xb, yb = td.Tensor(xtr[index]), td.Tensor(ytr[index])
            loss = F.cross_entropy(ddp(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss_sum += loss.item()
            seen += batch
            bar.set_postfix_str(f"loss {loss_sum / (step + 1):.4f} {seen / (time.perf_counter() - start):,.0f} samples/s")
        model.eval()
        with td.no_grad():
            accuracy = float((model(td.Tensor(xte)).numpy().argmax(1) == yte).mean())
        print(f"epoch {epoch + 1:2d}/{args.epochs} loss {loss_sum / max(steps, 1):.4f} test accuracy {accuracy:.2%}",
              file=out, flush=True)
    print(f"final test accuracy {accuracy:.2%} (target {args.target:.0%})", file=out)
    if args.checkpoint and rank == 0:
        td.save({"model": model.state_dict(), "optim": opt.state_dict()}, args.checkpoint)
    return 0 if accuracy >= args.target else 1


if __name__ == "__main__":
    sys.exit(main())
