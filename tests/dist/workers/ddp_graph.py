"""A 2-process DistributedDataParallel step, eager and captured by td.jit, from the same start:
the parameters must agree step by step; run by tests/dist/test_graph_collectives.py."""

import numpy as np

import tinydist as td
from tinydist import dist


def model() -> td.nn.Module:
    td.manual_seed(0)
    nn = td.nn
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 5))


def main() -> None:
    dist.init()
    r, n = dist.rank(), dist.world_size()
    g = np.random.default_rng(7)
    data = [(g.random((8 * n, 12), dtype=np.float32), g.integers(0, 5, 8 * n).astype(np.int64)) for _ in range(6)]
    local = [(x[r * 8:(r + 1) * 8], y[r * 8:(r + 1) * 8]) for x, y in data]
    # small buckets: several all-reduces per step, each a graph node
    eager = td.dist.DistributedDataParallel(model(), bucket_cap_mb=0.002)
    captured = td.dist.DistributedDataParallel(model(), bucket_cap_mb=0.002)
    assert eager.mode == "processes" and len(eager.buckets) > 2, (eager.mode, eager.buckets)
    opt_e = td.optim.Adam(eager.parameters(), lr=1e-2)
    opt_c = td.optim.Adam(captured.parameters(), lr=1e-2)

    @td.jit
    def train_step(x: td.Tensor, y: td.Tensor) -> td.Tensor:
        loss = td.nn.functional.cross_entropy(captured(x), y)
        opt_c.zero_grad()
        loss.backward()
        opt_c.step()
        return loss

    worst = 0.0
    for step, (x, y) in enumerate(local):
        loss = td.nn.functional.cross_entropy(eager(td.Tensor(x)), td.Tensor(y))
        opt_e.zero_grad()
        loss.backward()
        opt_e.step()
        loss_c = train_step(td.Tensor(x), td.Tensor(y))
        for pe, pc in zip(eager.parameters(), captured.parameters()):
            a, b = pe.numpy(), pc.numpy()
            if not np.allclose(a, b, rtol=1e-5, atol=1e-6):
                raise AssertionError(f"step {step}: captured parameters differ from eager (max {np.abs(a - b).max()})")
            worst = max(worst, float(np.abs(a - b).max()))
        if not np.isclose(loss.item(), loss_c.item(), rtol=1e-5):
            raise AssertionError(f"step {step}: loss {loss_c.item()} (captured) != {loss.item()} (eager)")
    # the ranks hold the same parameters: the all-reduced gradients were the same on every rank
    params = np.concatenate([p.numpy().reshape(-1) for p in captured.parameters()])
    everyone = dist.all_gather(params[None, :]).numpy()
    if not np.array_equal(everyone[0], everyone[-1]):
        raise AssertionError("the ranks' captured parameters differ")
    print(f"[rank {r}] OK {len(local)} steps, {len(captured.buckets)} buckets, captured == eager "
          f"(max abs difference {worst:.3g})", flush=True)
    dist.destroy()


if __name__ == "__main__":
    main()
