"""Allreduce latency/throughput of tinydist.dist per algorithm, next to torch.distributed gloo, same run.

    .venv/bin/python bench/allreduce.py [--sizes 4K,64K,1M,16M,64M] [--worlds 2,4] [--transport auto|shm|tcp] [--json PATH]

For each world size it runs one `tinydist launch` job that times every algorithm at every size
(float32 sum, median of repeats, rank 0's wall clock per call after a barrier), then a gloo job
(torch.distributed over loopback TCP, the same sizes) if torch is importable. Both reduce in place
(gloo's all_reduce always does; ours with out=x) and refill the input with ones between calls,
untimed. Ratios are gloo time / tinydist time: above 1 means tinydist is faster. nccl-tests
definitions: algbw = message bytes / time, busbw = algbw · 2(N−1)/N. Targets on the `auto` rows:
busbw ≥ 5× gloo's at ≥ 1 MiB, and time ≤ 0.2× gloo's at 4 KiB.

The `memory floor` rows time what no in-place allreduce can avoid: every rank, at once (after a
barrier), reads its tensor once and writes it once (`np.add(x, 0, out=x)`); at 16 MiB and more that
is DRAM traffic. `auto/floor` says how far the auto row is above it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

ALGORITHMS = ("naive", "ring", "all2all", "auto")


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def label(nbytes: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes // size} {unit}"
    return f"{nbytes} B"


def repeats_for(nbytes: int) -> int:
    return 30 if nbytes <= 64 << 10 else 10 if nbytes <= 1 << 20 else 5


# ---- workers (run inside each rank) ----------------------------------------------------------------

def worker_tinydist(sizes: list[int], out: str) -> None:
    import numpy as np

    from tinydist import dist
    from tinydist.graph.collectives import choose
    dist.init()
    group = dist.get_group()
    if dist.rank() == 0:
        threshold = None if group.shm is None else group.shm.single_copy_bytes
        single = "off" if threshold is None else f"from {threshold >> 20} MiB"
        print(f"tinydist from {Path(dist.__file__).parent}; group segment: {group.shm is not None}; "
              f"all2all single copy: {single}", flush=True)
    results = {}
    for nbytes in sizes:
        x = np.ones(nbytes // 4, np.float32)
        for algorithm in ALGORITHMS:
            times = []
            for i in range(repeats_for(nbytes) + 1):
                group.blocking("barrier", run_async=dist.run_on_loop)
                start = time.perf_counter()
                # the group's blocking API, in place: td.dist.all_reduce(x, out=x) adds only argument passing
                group.blocking("all_reduce", x, "sum", algorithm, x, run_async=dist.run_on_loop)
                if i:
                    times.append(time.perf_counter() - start)
                if x[0] != dist.world_size() or x[-1] != dist.world_size():
                    raise AssertionError(f"all_reduce {algorithm} of {nbytes} B: {x[0]}, {x[-1]} != {dist.world_size()}")
                x.fill(1.0)
            results[f"{nbytes}/{algorithm}"] = statistics.median(times)
        times = []
        for i in range(repeats_for(nbytes) + 1):
            group.blocking("barrier", run_async=dist.run_on_loop)
            start = time.perf_counter()
            np.add(x, 0, out=x)
            if i:
                times.append(time.perf_counter() - start)
        results[f"{nbytes}/floor"] = statistics.median(times)
    if dist.rank() == 0:
        Path(out).write_text(json.dumps({"results": results, "auto": {
            str(n): choose(group.medium, dist.world_size(), n)[0].value for n in sizes}}))
    dist.destroy()


def worker_gloo(sizes: list[int], out: str, port: int) -> None:
    import torch
    import torch.distributed as tdist
    rank, world = int(os.environ["TINYDIST_RANK"]), int(os.environ["TINYDIST_WORLD_SIZE"])
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = {}
    for nbytes in sizes:
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        times = []
        for i in range(repeats_for(nbytes) + 1):
            tdist.barrier()
            start = time.perf_counter()
            tdist.all_reduce(t)
            if i:
                times.append(time.perf_counter() - start)
            t.fill_(1.0)
        results[str(nbytes)] = statistics.median(times)
    if rank == 0:
        Path(out).write_text(json.dumps({"results": results}))
    tdist.destroy_process_group()


# ---- driver ------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(world: int, args: list[str], env: dict[str, str], timeout: float) -> str:
    """Run one `tinydist launch` job; returns its standard output."""
    cmd = [sys.executable, "-m", "tinydist.cli", "launch", "--nproc", str(world), __file__, *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark job failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--transport", default="auto", choices=["auto", "shm", "tcp"])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", choices=["tinydist", "gloo"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.worker == "tinydist":
        return worker_tinydist(sizes, args.out)
    if args.worker == "gloo":
        return worker_gloo(sizes, args.out, args.port)

    from _common import Report
    report = Report("allreduce", args.json)
    try:
        import torch
        has_torch = True
        report.note(f"baseline: torch.distributed gloo {torch.__version__} over loopback TCP, measured in this run")
    except ImportError:
        has_torch = False
        report.note("baseline: torch is not importable, gloo comparison skipped (pip install -e '.[bench]')")
    env = dict(os.environ, TINYDIST_TRANSPORT=args.transport, TINYDIST_LOG_LEVEL="warning")
    report.note(f"tinydist transport: {args.transport}; float32 sum; median of repeats; cpus: {os.cpu_count()}")
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    for world in [int(w) for w in args.worlds.split(",")]:
        ours_file, gloo_file = tmp / f"td-bench-{os.getpid()}-{world}.json", tmp / f"gloo-bench-{os.getpid()}-{world}.json"
        stdout = run_job(world, ["--worker", "tinydist", "--sizes", args.sizes, "--out", str(ours_file)], env, 900)
        report.note(f"{world} ranks: " + next((line for line in stdout.splitlines() if "tinydist from" in line), "?"))
        ours = json.loads(ours_file.read_text())
        gloo = None
        if has_torch:
            run_job(world, ["--worker", "gloo", "--sizes", args.sizes, "--out", str(gloo_file), "--port", str(free_port())], env, 900)
            gloo = json.loads(gloo_file.read_text())["results"]
        for f in (ours_file, gloo_file):
            f.unlink(missing_ok=True)
        for nbytes in sizes:
            base = gloo[str(nbytes)] if gloo else None
            for algorithm in ALGORITHMS:
                t = ours["results"][f"{nbytes}/{algorithm}"]
                shown = f"auto={ours['auto'][str(nbytes)]}" if algorithm == "auto" else algorithm
                algbw = nbytes / t / 1e9
                busbw = algbw * 2 * (world - 1) / world
                fields = dict(detail=f"algbw {algbw:.2f} GB/s, busbw {busbw:.2f} GB/s", repeats=repeats_for(nbytes))
                if base is not None:
                    fields.update(baseline=base * 1e3, baseline_label="gloo", ratio=base / t, ratio_label="gloo/ours")
                    if algorithm == "auto" and nbytes >= 1 << 20:  # busbw ratio = time ratio at equal bytes
                        fields.update(target="busbw >=5x gloo", passed=base / t >= 5.0)
                    elif algorithm == "auto" and nbytes <= 4 << 10:
                        fields.update(target="time <=0.2x gloo", passed=t / base <= 0.2)
                report.add(f"allreduce/{world}proc/{label(nbytes)}/{shown}", t * 1e3, "ms", **fields)
            floor = ours["results"][f"{nbytes}/floor"]
            report.add(f"allreduce/{world}proc/{label(nbytes)}/memory floor", floor * 1e3, "ms", repeats=repeats_for(nbytes),
                       ratio=ours["results"][f"{nbytes}/auto"] / floor, ratio_label="auto/floor",
                       detail=f"all {world} ranks at once read and write their {label(nbytes)} once")
    report.finish()
    if report.misses:
        report.note(f"{len(report.misses)} target(s) missed")


if __name__ == "__main__":
    main()
