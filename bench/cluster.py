"""Cluster scheduler benchmark: hierarchical vs flat ring allreduce, modelled and measured, plus
the simulated-cluster scaling table.

    python bench/cluster.py [--sizes 1,16] [--repeats 5]

Measured: hierarchical = 2 node processes x 2 devices (tinydist.multi.allreduce inside each process,
tinydist.dist ring/auto across); flat ring = the same 4 devices as 4 processes x 1 device, tinydist.dist
ring. Both on loopback (TCP between processes, as between hosts). Modelled: the α–β model on the links
the job measured at start (scheduler.probe). Median of repeats.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORKER = r'''
import sys, time, json, numpy as np
from tinydist.scheduler.execute import ClusterJob
from tinydist.scheduler.plan import plan_allreduce
coord, node, rank, world, ndev, sizes, reps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6], int(sys.argv[7])
devices = [f"CPU:{i}" for i in range(ndev)]
job = ClusterJob.start(coord, node, devices, world_size=world, rank=rank, host_key=f"host-{rank}")
for mib in map(float, sizes.split(",")):
    n = int(mib * (1 << 20)) // 4
    local = [np.full(n, rank * ndev + i + 1, np.float32) for i in range(ndev)]
    job.all_reduce(local)       # warm-up (kernels compiled, links warm)
    times = []
    for _ in range(reps):
        from tinydist import dist
        dist.barrier()
        t = time.perf_counter(); outs = job.all_reduce(local); outs[-1].numpy(); times.append(time.perf_counter() - t)
    plan = job.plan(n * 4)
    flat = plan.candidates["flat-ring"]
    if rank == 0:
        print("RESULT " + json.dumps({"mib": mib, "measured": sorted(times)[len(times) // 2], "modelled": plan.modelled_s,
              "flat_modelled": flat, "plan": f"{plan.strategy}/{plan.intra_algorithm}+{plan.inter_algorithm}"}), flush=True)
job.close()
'''


def run_job(world: int, ndev: int, sizes: str, reps: int) -> list[dict]:
    import json

    from tests.cluster.helpers import Coordinator, env
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        c = Coordinator(Path(tmp), "--insecure-loopback-only", interval=0.5)
        try:
            procs = [subprocess.Popen([sys.executable, "-c", WORKER, c.address, f"node-{r}", str(r), str(world), str(ndev),
                                       sizes, str(reps)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      text=True, env=env(TINYDIST_TRANSPORT="tcp"))
                     for r in range(world)]
            outs = [p.communicate(timeout=300)[0] for p in procs]
        finally:
            c.stop()
    return [json.loads(line[7:]) for line in outs[0].splitlines() if line.startswith("RESULT ")]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="1,16", help="MiB, comma-separated")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    print(f"cpus: {os.cpu_count()}; float32 sum; loopback TCP between processes; median of {args.repeats}")
    hier = run_job(2, 2, args.sizes, args.repeats)
    flat = run_job(4, 1, args.sizes, args.repeats)
    print("| size | hierarchical 2 proc x 2 dev: plan | modelled | measured | flat ring 4 proc x 1 dev: modelled | measured | measured flat/hier |")
    print("|---|---|---|---|---|---|---|")
    for h, f in zip(hier, flat):
        print(f"| {h['mib']:g} MiB | {h['plan']} | {h['modelled'] * 1e3:.2f} ms | {h['measured'] * 1e3:.2f} ms | "
              f"{h['flat_modelled'] * 1e3:.2f} ms | {f['measured'] * 1e3:.2f} ms | {f['measured'] / h['measured']:.2f}x |")
    print()
    from tinydist.scheduler.sim import format_table, scaling_table
    t = time.perf_counter()
    print(format_table(scaling_table((8, 64, 256, 1024))))
    print(f"(simulation wall time {time.perf_counter() - t:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
