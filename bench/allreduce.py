"""Allreduce latency/throughput of tinydist.dist per algorithm, next to Open MPI and torch.distributed gloo, same run.

    .venv/bin/python bench/allreduce.py [--sizes 4K,64K,1M,16M,64M] [--worlds 2,4] [--transport auto|shm|tcp]
                                        [--rounds 2] [--json PATH]

For each world size it runs, `--rounds` times and in an order that rotates each round (so no side
always runs first, or always after the other's page faults): one `tinydist launch` job that times
every algorithm at every size, an Open MPI job (`mpirun` + mpi4py, when both are present) and a
gloo job (torch.distributed over loopback TCP, when torch is importable). Every side does the same
thing: float32 sum in place (ours with out=x, MPI with MPI.IN_PLACE, gloo's all_reduce always),
rank 0's wall clock per call after a barrier, the input refilled with ones between calls, untimed.
A row's time is the median of every timed call of every round. Open MPI runs with the ob1 PML and
the shared-memory BTL (`--mca btl self,vader`), or with `--mca btl self,tcp` over loopback when
`--transport tcp`; `--oversubscribe` when the ranks outnumber the CPUs (then its ranks yield while
they poll), `--bind-to none` as ours and gloo's ranks are not bound either.

Ratios: `ours/MPI` is tinydist time / Open MPI time (at most 1 is the target on the `auto` rows:
issue 24), `gloo/ours` is gloo time / tinydist time (above 1: tinydist is faster). nccl-tests
definitions: algbw = message bytes / time, busbw = algbw · 2(N−1)/N. The gloo targets on the `auto`
rows: busbw ≥ 5× gloo's at ≥ 1 MiB, and time ≤ 0.2× gloo's at 4 KiB. A row marked `(native)` ran
every call through `tinydist.dist.shm_fast` (one native call, no header exchange).

With `--transport tcp` (every link TCP, the network medium, Open MPI on its tcp BTL) the targets are
issue 24's for TCP instead: `ring` busbw ≥ Open MPI's at 1 MiB and up (ours/MPI ≤ 1 at equal bytes),
and every algorithm the chooser can pick on the network (`choose` asked at every power of two; the
`tcp algorithms` note names them) at least as fast as gloo at every size (gloo/ours ≥ 1).

The `memory floor` rows time what no in-place allreduce can avoid: every rank, at once (after a
barrier), reads its tensor once and writes it once (`np.add(x, 0, out=x)`); at 16 MiB and more that
is DRAM traffic. `auto/floor` says how far the auto row is above it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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
# Each writes, from rank 0, {key: [seconds of every timed call]}; the driver pools the rounds.

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
    results: dict[str, list[float]] = {}
    native: dict[str, bool] = {}
    for nbytes in sizes:
        x = np.ones(nbytes // 4, np.float32)
        for algorithm in ALGORITHMS:
            before = -1 if group.fast is None else group.fast.completed
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
            results[f"{nbytes}/{algorithm}"] = times
            # every call (and the warm-up) went through the native path (tinydist.dist.shm_fast)
            native[f"{nbytes}/{algorithm}"] = group.fast is not None and group.fast.completed - before == len(times) + 1
        times = []
        for i in range(repeats_for(nbytes) + 1):
            group.blocking("barrier", run_async=dist.run_on_loop)
            start = time.perf_counter()
            np.add(x, 0, out=x)
            if i:
                times.append(time.perf_counter() - start)
        results[f"{nbytes}/floor"] = times
    if dist.rank() == 0:
        # what auto can pick on this medium, whatever the size: the chooser asked at 0 B and every power of two
        pickable = sorted({choose(group.medium, dist.world_size(), n)[0].value for n in (0, *(1 << k for k in range(41)))})
        Path(out).write_text(json.dumps({"results": results, "native": native, "pickable": pickable, "auto": {
            str(n): choose(group.medium, dist.world_size(), n)[0].value for n in sizes}}))
    dist.destroy()


def worker_gloo(sizes: list[int], out: str, port: int) -> None:
    import torch
    import torch.distributed as tdist
    rank, world = int(os.environ["TINYDIST_RANK"]), int(os.environ["TINYDIST_WORLD_SIZE"])
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results: dict[str, list[float]] = {}
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
        results[str(nbytes)] = times
    if rank == 0:
        Path(out).write_text(json.dumps({"results": results}))
    tdist.destroy_process_group()


def worker_mpi(sizes: list[int], out: str) -> None:
    """Under mpirun: MPI_Allreduce(MPI_IN_PLACE, x, MPI_FLOAT, MPI_SUM), as the other sides are timed."""
    import numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    results: dict[str, list[float]] = {}
    for nbytes in sizes:
        x = np.ones(nbytes // 4, np.float32)
        times = []
        for i in range(repeats_for(nbytes) + 1):
            comm.Barrier()
            start = time.perf_counter()
            comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
            if i:
                times.append(time.perf_counter() - start)
            if x.size and (x[0] != world or x[-1] != world):
                raise AssertionError(f"MPI_Allreduce of {nbytes} B: {x[0]}, {x[-1]} != {world}")
            x.fill(1.0)
        results[str(nbytes)] = times
    if rank == 0:
        Path(out).write_text(json.dumps({"results": results, "version": MPI.Get_library_version().splitlines()[0]}))


# ---- driver ------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(world: int, args: list[str], env: dict[str, str], timeout: float) -> str:
    """Run one `tinydist launch` job; returns its standard output."""
    cmd = [sys.executable, "-m", "tinydist.cli", "launch", "--nproc", str(world), __file__, *args]
    return _run(cmd, env, timeout)


def mpi_command(world: int, transport: str) -> list[str] | None:
    """The mpirun prefix for `world` ranks over shared memory (vader) or loopback TCP; None when
    mpirun or mpi4py is missing."""
    mpirun = shutil.which("mpirun")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return None
    if mpirun is None:
        return None
    btl = "self,tcp" if transport == "tcp" else "self,vader"
    cmd = [mpirun, "-np", str(world), "--bind-to", "none", "--mca", "pml", "ob1", "--mca", "btl", btl]
    if transport == "tcp":
        cmd += ["--mca", "btl_tcp_if_include", "lo"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")   # CI runs as root
    if world > (os.cpu_count() or 1):
        cmd.append("--oversubscribe")
    return cmd


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> str:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark job failed ({proc.returncode}): {' '.join(cmd[:8])} ...\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--transport", default="auto", choices=["auto", "shm", "tcp"])
    parser.add_argument("--rounds", type=int, default=2, help="jobs per side, in rotating order; the calls are pooled")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", choices=["tinydist", "gloo", "mpi"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.worker == "tinydist":
        return worker_tinydist(sizes, args.out)
    if args.worker == "gloo":
        return worker_gloo(sizes, args.out, args.port)
    if args.worker == "mpi":
        return worker_mpi(sizes, args.out)

    from _common import Report
    report = Report("allreduce", args.json)
    try:
        import torch
        has_torch = True
        report.note(f"baseline: torch.distributed gloo {torch.__version__} over loopback TCP, measured in this run")
    except ImportError:
        has_torch = False
        report.note("baseline: torch is not importable, gloo comparison skipped (pip install -e '.[bench]')")
    if mpi_command(2, args.transport) is None:
        report.note("baseline: mpirun or mpi4py missing, Open MPI comparison skipped "
                    "(apt-get install openmpi-bin libopenmpi-dev; pip install -e '.[bench]')")
    env = dict(os.environ, TINYDIST_TRANSPORT=args.transport, TINYDIST_LOG_LEVEL="warning")
    report.note(f"tinydist transport: {args.transport}; float32 sum in place; median of every call of {args.rounds} "
                f"round(s); cpus: {os.cpu_count()}; load {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}")
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    for world in [int(w) for w in args.worlds.split(",")]:
        mpirun = mpi_command(world, args.transport)
        files = {side: tmp / f"{side}-bench-{os.getpid()}-{world}.json" for side in ("tinydist", "gloo", "mpi")}
        jobs = {"tinydist": lambda: run_job(world, ["--worker", "tinydist", "--sizes", args.sizes, "--out",
                                                    str(files["tinydist"])], env, 900)}
        if has_torch:
            jobs["gloo"] = lambda: run_job(world, ["--worker", "gloo", "--sizes", args.sizes, "--out", str(files["gloo"]),
                                                   "--port", str(free_port())], env, 900)
        if mpirun is not None:
            jobs["mpi"] = lambda: _run([*mpirun, sys.executable, __file__, "--worker", "mpi", "--sizes", args.sizes,
                                        "--out", str(files["mpi"])], env, 900)
        pooled: dict[str, dict[str, list[float]]] = {side: {} for side in jobs}
        facts: dict[str, Any] = {}
        order = list(jobs)
        for r in range(args.rounds):
            for side in order[r % len(order):] + order[:r % len(order)]:
                stdout = jobs[side]()
                if side == "tinydist" and r == 0:
                    report.note(f"{world} ranks: " + next((line for line in stdout.splitlines() if "tinydist from" in line), "?"))
                got = json.loads(files[side].read_text())
                files[side].unlink()
                facts.setdefault(side, got)
                for key, times in got["results"].items():
                    pooled[side].setdefault(key, []).extend(times)
        if "mpi" in facts:
            report.note(f"{world} ranks: {facts['mpi']['version']}; {' '.join(mpirun or [])}")
        tcp = args.transport == "tcp"
        if tcp:
            report.note(f"{world} ranks: tcp algorithms (what the chooser can pick on the network): "
                        f"{', '.join(facts['tinydist']['pickable'])}")
        ours = {key: statistics.median(times) for key, times in pooled["tinydist"].items()}
        gloo = {key: statistics.median(times) for key, times in pooled.get("gloo", {}).items()} or None
        mpi = {key: statistics.median(times) for key, times in pooled.get("mpi", {}).items()} or None
        for nbytes in sizes:
            n = len(pooled["tinydist"][f"{nbytes}/auto"])
            if mpi is not None:
                report.add(f"allreduce/{world}proc/{label(nbytes)}/Open MPI", mpi[str(nbytes)] * 1e3, "ms",
                           repeats=len(pooled["mpi"][str(nbytes)]),
                           detail=f"busbw {nbytes / mpi[str(nbytes)] / 1e9 * 2 * (world - 1) / world:.2f} GB/s")
            if gloo is not None:
                report.add(f"allreduce/{world}proc/{label(nbytes)}/gloo", gloo[str(nbytes)] * 1e3, "ms",
                           repeats=len(pooled["gloo"][str(nbytes)]),
                           detail=f"busbw {nbytes / gloo[str(nbytes)] / 1e9 * 2 * (world - 1) / world:.2f} GB/s")
            for algorithm in ALGORITHMS:
                t = ours[f"{nbytes}/{algorithm}"]
                shown = f"auto={facts['tinydist']['auto'][str(nbytes)]}" if algorithm == "auto" else algorithm
                if facts["tinydist"]["native"][f"{nbytes}/{algorithm}"]:
                    shown += " (native)"
                algbw = nbytes / t / 1e9
                busbw = algbw * 2 * (world - 1) / world
                detail = f"algbw {algbw:.2f} GB/s, busbw {busbw:.2f} GB/s"
                fields: dict[str, Any] = dict(repeats=n)
                if gloo is not None:
                    detail = f"gloo/ours {gloo[str(nbytes)] / t:.3g}x; {detail}"
                if mpi is not None:
                    base = mpi[str(nbytes)]
                    fields.update(baseline=base * 1e3, baseline_label="Open MPI", ratio=t / base, ratio_label="ours/MPI")
                    if algorithm == "auto" and not tcp:
                        fields.update(target="<=1.0x Open MPI", passed=t / base <= 1.0)
                    if algorithm == "ring" and tcp and nbytes >= 1 << 20:   # busbw ratio = time ratio at equal bytes
                        fields.update(target="busbw >=Open MPI tcp", passed=t / base <= 1.0)
                elif gloo is not None:
                    base = gloo[str(nbytes)]
                    fields.update(baseline=base * 1e3, baseline_label="gloo", ratio=base / t, ratio_label="gloo/ours")
                report.add(f"allreduce/{world}proc/{label(nbytes)}/{shown}", t * 1e3, "ms", detail=detail, **fields)
                if gloo is not None and tcp and algorithm in facts["tinydist"]["pickable"]:
                    base = gloo[str(nbytes)]
                    report.add(f"allreduce/{world}proc/{label(nbytes)}/{algorithm} vs gloo", t * 1e3, "ms", repeats=n,
                               baseline=base * 1e3, baseline_label="gloo", ratio=base / t, ratio_label="gloo/ours",
                               target=">=1x gloo", passed=base / t >= 1.0)
                if gloo is not None and not tcp and algorithm == "auto" and (nbytes >= 1 << 20 or nbytes <= 4 << 10):
                    base = gloo[str(nbytes)]
                    big = nbytes >= 1 << 20      # busbw ratio = time ratio at equal bytes
                    report.add(f"allreduce/{world}proc/{label(nbytes)}/auto vs gloo", t * 1e3, "ms", repeats=n,
                               baseline=base * 1e3, baseline_label="gloo", ratio=base / t, ratio_label="gloo/ours",
                               target="busbw >=5x gloo" if big else "time <=0.2x gloo",
                               passed=base / t >= 5.0 if big else t / base <= 0.2)
            floor = ours[f"{nbytes}/floor"]
            report.add(f"allreduce/{world}proc/{label(nbytes)}/memory floor", floor * 1e3, "ms", repeats=n,
                       ratio=ours[f"{nbytes}/auto"] / floor, ratio_label="auto/floor",
                       detail=f"all {world} ranks at once read and write their {label(nbytes)} once")
    report.finish()
    if report.misses:
        report.note(f"{len(report.misses)} target(s) missed")


if __name__ == "__main__":
    main()
