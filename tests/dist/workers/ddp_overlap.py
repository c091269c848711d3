"""A 2-process DistributedDataParallel step whose first bucket is all-reduced while backward goes
on: every step's parameters equal (bitwise) those of one bucket all-reduced after the whole
backward, eagerly and captured by td.jit; then a traced run of both, written to argv[1] (one file
per rank) for tests/dist/test_graph_collectives.py to read the overlap from."""

import sys

import numpy as np

import tinydist as td
from tinydist import dist
from tinydist.observability import span


def model() -> td.nn.Module:
    td.manual_seed(0)
    nn = td.nn
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 6 * 6, 10))


def trainer(bucket_cap_mb: float, jit: bool):
    ddp = td.dist.DistributedDataParallel(model(), bucket_cap_mb=bucket_cap_mb)
    opt = td.optim.Adam(ddp.parameters(), lr=1e-2)

    def train_step(x: td.Tensor, y: td.Tensor) -> td.Tensor:
        loss = td.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return ddp, td.jit(train_step) if jit else train_step


def main() -> None:
    dist.init()
    r, n = dist.rank(), dist.world_size()
    g = np.random.default_rng(3)
    local = [(g.random((128, 1, 12, 12), dtype=np.float32), g.integers(0, 10, 128).astype(np.int64)) for _ in range(4)]
    whole, whole_step = trainer(64.0, jit=False)          # one bucket: all-reduced after the whole backward
    eager, eager_step = trainer(0.05, jit=False)          # [[5, 4, 3], [2, 1, 0]]: the first one during backward
    captured, captured_step = trainer(0.05, jit=True)
    assert len(whole.buckets) == 1 and eager.buckets == [[5, 4, 3], [2, 1, 0]], (whole.buckets, eager.buckets)
    for step, (x, y) in enumerate(local):
        for train_step in (whole_step, eager_step, captured_step):
            train_step(td.Tensor(x), td.Tensor(y))
        for name, ddp in (("eager", eager), ("captured", captured)):
            for pw, p in zip(whole.parameters(), ddp.parameters()):
                if not np.array_equal(pw.numpy(), p.numpy()):
                    raise AssertionError(f"step {step}: {name} parameters differ from one bucket's "
                                         f"(max {np.abs(pw.numpy() - p.numpy()).max()})")
    params = np.concatenate([p.numpy().reshape(-1) for p in captured.parameters()])
    everyone = dist.all_gather(params[None, :]).numpy()
    if not np.array_equal(everyone[0], everyone[-1]):
        raise AssertionError("the ranks' parameters differ")
    print(f"[rank {r}] OK {len(local)} steps, 2 buckets == 1 bucket bitwise, eager and captured", flush=True)
    # traced: a fresh capture made while tracing replays one command per kernel (replay 'runs')
    _, traced_step = trainer(0.05, jit=True)
    td.synchronize()
    with td.trace() as tracer:
        for i, (mode, train_step) in enumerate([("eager", eager_step)] * 2 + [("warm-up", traced_step)] * 2 + [("captured", traced_step)] * 2):
            x, y = local[i % len(local)]
            dist.barrier()
            with span("step", process=f"rank{r}", lane="steps", mode=mode):
                train_step(td.Tensor(x), td.Tensor(y))
                td.synchronize()
    tracer.write(sys.argv[1], rank=r)
    print(f"[rank {r}] TRACED", flush=True)
    dist.destroy()


if __name__ == "__main__":
    main()
