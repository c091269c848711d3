"""Training throughput (samples/s): the digits MLP and a small CNN, batch 256.

    .venv/bin/python bench/train.py [--seconds 3] [--json PATH]
    .venv/bin/python bench/train.py --overlap [--bucket-cap-mb 0.02] [--steps 5]   # all-reduce vs backward, from traces

Per model: tinydist on 1 device (eager, and with the whole step captured by td.jit), on 2 devices of one process (DistributedDataParallel), on 2
processes (`tinydist launch --nproc 2`, each rank half the batch), and PyTorch CPU with
torch.set_num_threads(1) as the comparison (skipped when torch is not installed). Each row is the
median over repeats of timed windows after warm-up steps; a step is forward + backward + Adam.
The configs the targets compare (eager and td.jit on 1 device, td.jit on 2 devices, PyTorch) run
interleaved: five rounds of one window each, so a ratio compares the same minutes of a shared
machine whose speed drifts, and each target is the median of its five per-round ratios. The
eager targets (issue 26: the digits MLP >= 0.5x PyTorch's single-thread samples/s, the small CNN
>= 0.8x) compare the eager step (no td.jit) with PyTorch's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

BATCH = 256
EAGER_TARGETS = {"mlp": 0.5, "cnn": 0.8}  # issue 26: the eager step against PyTorch's single thread


def batches(model: str, count: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    g = np.random.default_rng(seed)
    shape = (BATCH, 64) if model == "mlp" else (BATCH, 1, 8, 8)
    return [(g.random(shape, dtype=np.float32), g.integers(0, 10, BATCH).astype(np.int64)) for _ in range(count)]


def td_model(name: str):
    import tinydist as td
    td.manual_seed(0)
    nn = td.nn
    if name == "mlp":
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 4 * 4, 10))


def run_tinydist(name: str, devices: int, seconds: float, rank: int = 0, world: int = 1) -> list[float]:
    step, sync = eager_stepper(name, devices, rank, world)
    if world > 1:  # ranks must run the same number of steps: their collectives pair up
        return _measure_agreed(step, seconds, sync)
    return _measure(step, seconds, sync)


def eager_stepper(name: str, devices: int = 1, rank: int = 0, world: int = 1) -> tuple[Callable[[int], None], Callable[[], None]]:
    """The eager step (no td.jit): forward, backward and Adam as a user writes them; returns (step, sync)."""
    import tinydist as td
    model = td_model(name)
    ddp = td.parallel.DistributedDataParallel(model, devices=devices if world == 1 else None)
    opt = td.optim.Adam(ddp.parameters(), lr=1e-3)
    data = batches(name, 8)
    local = BATCH // world

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        loss = td.nn.functional.cross_entropy(ddp(td.Tensor(x)), td.Tensor(y))
        opt.zero_grad()
        loss.backward()
        opt.step()

    return step, td.synchronize


def eager_breakdown(name: str, steps: int = 200) -> str:
    """Where an eager step's time goes, on the caller's thread: the median over `steps` of the
    step's wall and thread CPU time (on a loaded machine the wall time has the other processes'
    time slices in it, the CPU time not), of each part's wall time, and the kernels the step runs
    (the schedules its realizes ran). The parts
    are the forward (with the batch's upload), the loss, backward (building the gradient graph),
    the realize of loss and gradients (walk, cached schedule, its kernels: a short batch runs on
    this thread) and the Adam update (its kept schedule over the current buffers)."""
    import tinydist as td
    import tinydist.engine.realize as realize_module
    import tinydist.train.optim as optim_module
    model = td_model(name)
    ddp = td.parallel.DistributedDataParallel(model, devices=1)
    opt = td.optim.Adam(ddp.parameters(), lr=1e-3)
    data = batches(name, 8)
    kernels: list[int] = []
    run_schedule = realize_module.run_schedule

    def counting(schedule, inputs):  # type: ignore[no-untyped-def]
        kernels.append(len(schedule.linear))
        return run_schedule(schedule, inputs)

    parts: dict[str, list[float]] = {p: [] for p in ("forward", "loss", "backward", "realize", "update", "step", "cpu")}
    realize_module.run_schedule = optim_module.run_schedule = counting
    try:
        for i in range(steps + 10):
            x, y = data[i % len(data)]
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            out = ddp(td.Tensor(x))
            t1 = time.perf_counter_ns()
            loss = td.nn.functional.cross_entropy(out, td.Tensor(y))
            del out  # as in a step written inline: no forward value alive at the update
            t2 = time.perf_counter_ns()
            opt.zero_grad()
            loss.backward()
            t3 = time.perf_counter_ns()
            opt.realize()
            t4 = time.perf_counter_ns()
            opt.step()
            t5, c5 = time.perf_counter_ns(), time.thread_time_ns()
            if i >= 10:
                for part, ns in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0, c5 - c0)):
                    parts[part].append(ns / 1e3)
            if i == 9:
                kernels.clear()
        td.synchronize()
    finally:
        realize_module.run_schedule = run_schedule
        optim_module.run_schedule = run_schedule
    us = {part: statistics.median(values) for part, values in parts.items()}
    return (f"{name:4s} eager step on the caller's thread {us['step']:.0f} us (its thread CPU time {us['cpu']:.0f} us; "
            f"the parts' medians: forward {us['forward']:.0f}, loss {us['loss']:.0f}, backward {us['backward']:.0f}, "
            f"realize {us['realize']:.0f}, Adam update {us['update']:.0f}); {sum(kernels) / steps:.0f} kernels in "
            f"{len(kernels) / steps:.0f} schedules per step (median of {steps})")


def _measure_agreed(step, seconds: float, sync) -> list[float]:
    """Like _measure, for ranks of one job (see _interleaved_agreed)."""
    return _interleaved_agreed({"": (step, sync)}, seconds)[""]


def _interleaved_agreed(configs: dict[str, tuple[Callable[[int], None], Callable[[], None]]],
                        seconds: float) -> dict[str, list[float]]:
    """_interleaved for ranks of one job: rank 0 times each config's warm-up and every rank then
    runs the same number of steps per window (a time budget per rank would leave one in a
    collective); five rounds of one window per config."""
    import numpy as np

    import tinydist as td
    counts: dict[str, int] = {}
    for label, (step, sync) in configs.items():
        for i in range(2):      # warm-up: compiles, captures
            step(i)
        sync()
        start = time.perf_counter()
        for i in range(2, 7):
            step(i)
        sync()
        per_step = (time.perf_counter() - start) / 5
        agreed = td.dist.broadcast(np.array([max(1, int(seconds / 5 / per_step))], np.int64), src=0)
        counts[label] = int(agreed.numpy()[0])
    rates: dict[str, list[float]] = {label: [] for label in configs}
    i = 7
    for _ in range(5):
        for label, (step, sync) in configs.items():
            start = time.perf_counter()
            for _ in range(counts[label]):
                step(i)
                i += 1
            sync()
            rates[label].append(counts[label] * BATCH / (time.perf_counter() - start))
    return rates


def jit_stepper(name: str, devices: int = 1, rank: int = 0, world: int = 1) -> tuple[Callable[[int], None], Callable[[], None]]:
    """The whole step (forward, backward, Adam; with 2 devices or processes the gradient allreduce
    too: across processes each bucket's is a graph node, tinydist.dist.lazy) captured with td.jit
    and replayed; returns (step, sync)."""
    import tinydist as td
    model = td_model(name)
    if devices > 1 or world > 1:
        model = td.parallel.DistributedDataParallel(model, devices=devices if world == 1 else None)
    opt = td.optim.Adam(model.parameters(), lr=1e-3)
    local = BATCH // world
    data = [(x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]) for x, y in batches(name, 8)]

    @td.jit
    def train_step(x: td.Tensor, y: td.Tensor) -> td.Tensor:
        loss = td.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        train_step(td.Tensor(x), td.Tensor(y))

    return step, td.synchronize


def torch_stepper(name: str) -> tuple[Callable[[int], None], Callable[[], None]]:
    import torch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    nn = torch.nn
    if name == "mlp":
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    else:
        model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                              nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 4 * 4, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in batches(name, 8)]

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    return step, lambda: None


def _measure(step, seconds: float, sync) -> list[float]:
    """samples/s of each of 5 windows of seconds/5, after warm-up (compiles, captures)."""
    return _interleaved({"": (step, sync)}, seconds)[""]


def _interleaved(configs: dict[str, tuple[Callable[[int], None], Callable[[], None]]], seconds: float) -> dict[str, list[float]]:
    """samples/s of each config in each of 5 rounds; a round runs one window of seconds/5 per config,
    so configs compared in a ratio see the same minutes of this shared VM's drifting speed."""
    for step, sync in configs.values():   # warm-up: compiles, captures
        for i in range(5):
            step(i)
        sync()
    rates: dict[str, list[float]] = {label: [] for label in configs}
    steps_done = dict.fromkeys(configs, 0)
    for _ in range(5):
        for label, (step, sync) in configs.items():
            start, done = time.perf_counter(), 0
            while time.perf_counter() - start < seconds / 5:
                step(steps_done[label] + done)
                done += 1
            sync()
            rates[label].append(done * BATCH / (time.perf_counter() - start))
            steps_done[label] += done
    return rates


def _ratio(rates: dict[str, list[float]], over: str, under: str) -> float:
    """The median over rounds of the per-round ratio of two interleaved configs."""
    return statistics.median(a / b for a, b in zip(rates[over], rates[under]))


def _print_processes(name: str, found: dict[str, list[float]]) -> None:
    eager, jit = statistics.median(found["RATES"]), statistics.median(found["JIT_RATES"])
    ratio = found["JIT_RATIO"][0]
    print(f"{name:4s} tinydist 2 processes              {eager:10,.0f} samples/s")
    print(f"{name:4s} tinydist 2 processes, td.jit step {jit:10,.0f} samples/s")
    print(f"{name:4s} target: 2-process td.jit step vs eager {ratio:.2f}x {'>=1.3x: PASS' if ratio >= 1.3 else '>=1.3x: MISS'} "
          f"(median of 5 interleaved rounds)")


def run_processes(name: str, seconds: float) -> dict[str, list[float]] | None:
    """Rank 0's samples/s of the eager and the captured 2-process step (RATES, JIT_RATES) and the
    median per-round ratio (JIT_RATIO)."""
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "tinydist.cli", "launch", "--nproc", "2", "--timeout", str(60 + 10 * seconds),
           str(Path(__file__).resolve()), "--worker", name, "--seconds", str(seconds)]
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root)
    found: dict[str, list[float]] = {}
    for line in proc.stdout.splitlines():
        for key in ("JIT_RATIO", "JIT_RATES", "RATES"):
            if f"] {key} " in line:
                found[key] = [float(v) for v in line.split(f"] {key} ", 1)[1].split()]
                break
    if len(found) == 3:
        return found
    print(f"2-process run failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}", file=sys.stderr)
    return None


def overlap_worker(name: str, bucket_cap_mb: float, steps: int, path: str) -> None:
    """One rank of --overlap: `steps` eager and `steps` captured DDP steps, each traced with its
    device work waited for inside a `step` span, the trace written to `path` (one file per rank).
    The jit is captured while tracing, so its replay runs one command per kernel ('runs')."""
    import tinydist as td
    from tinydist.observability import span
    td.dist.init()
    rank, world = td.dist.rank(), td.dist.world_size()
    local = BATCH // world
    data = [(x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]) for x, y in batches(name, 8)]
    steppers = {}
    for mode in ("eager", "captured"):
        ddp = td.dist.DistributedDataParallel(td_model(name), bucket_cap_mb=bucket_cap_mb)
        opt = td.optim.Adam(ddp.parameters(), lr=1e-3)

        def train_step(x: td.Tensor, y: td.Tensor, ddp=ddp, opt=opt) -> td.Tensor:
            loss = td.nn.functional.cross_entropy(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss
        steppers[mode] = td.jit(train_step) if mode == "captured" else train_step
    for i in range(2):
        x, y = data[i]
        steppers["eager"](td.Tensor(x), td.Tensor(y))
    td.synchronize()
    plan = [("eager", steppers["eager"])] * steps + [("warm-up", steppers["captured"])] * 2 + [("captured", steppers["captured"])] * steps
    with td.trace() as tracer:
        for i, (mode, train_step) in enumerate(plan):
            x, y = data[i % len(data)]
            td.dist.barrier()  # the ranks start each step together: a collective's wait is then its own
            with span("step", process=f"rank{rank}", lane="steps", mode=mode):
                train_step(td.Tensor(x), td.Tensor(y))
                td.synchronize()
    tracer.write(path, rank=rank)
    if rank == 0:
        print(f"BUCKETS {len(ddp.buckets)}", flush=True)
    td.dist.barrier()


def run_overlap(name: str, bucket_cap_mb: float, steps: int, png: str | None = None) -> None:
    """--overlap: per traced step of the 2-process DDP run (eager and td.jit), how much of the
    bucket all-reduces' time ran while backward kernels ran, read from each rank's trace
    (`tinydist.observability.report.collective_overlap`)."""
    import tempfile

    from tinydist.observability.chrome import load
    from tinydist.observability.report import collective_overlap
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        cmd = [sys.executable, "-m", "tinydist.cli", "launch", "--nproc", "2", "--timeout", "180", str(Path(__file__).resolve()),
               "--overlap-worker", name, "--bucket-cap-mb", str(bucket_cap_mb), "--steps", str(steps), "--trace", str(path)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(root)), cwd=root)
        if proc.returncode != 0:
            print(f"{name}: 2-process overlap run failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}",
                  file=sys.stderr)
            return
        buckets = next((line.split("BUCKETS ", 1)[1] for line in proc.stdout.splitlines() if "] BUCKETS " in line), "?")
        for rank in range(2):
            trace = load(Path(tmp) / f"trace.rank{rank}.json")
            found = [s for s in collective_overlap(trace) if s["args"].get("mode") != "warm-up"]
            if png and rank == 0:  # the eager step with the most overlap, zoomed
                from tinydist.observability.report import plot_gantt
                best = max((s for s in found if s["args"].get("mode") == "eager"), key=lambda s: s["overlap_us"])
                t0 = min(e["ts"] for e in trace["traceEvents"] if e.get("ph") == "X")
                plot_gantt(trace, png, title=f"{name}, 2-process DDP, rank 0: bucket all-reduces (copy queue) beside backward "
                           f"(compute queue); lower panel: one eager step, {best['overlap_us'] / 1000:.2f} ms overlapped",
                           zoom=(best["window"][0] - t0, best["window"][1] - t0))
                print(f"{name:4s} wrote {png}")
            for mode in ("eager", "captured"):
                ours = [s for s in found if s["args"].get("mode") == mode]
                for k, s in enumerate(ours):
                    print(f"{name:4s} rank {rank} {mode:8s} step {k}: overlap: {s['overlap_us'] / 1000:.2f} ms of "
                          f"{s['collective_us'] / 1000:.2f} ms allreduce ran while backward kernels ran "
                          f"({s['started_before_backward_end']} of {len(s['collectives'])} bucket all-reduces started before backward ended; "
                          f"queues let the first run beside the last backward matmul: {'yes' if s['ahead'] else 'NO'})")
                share = [s["overlap_us"] / s["collective_us"] for s in ours if s["collective_us"]]
                print(f"{name:4s} rank {rank} {mode:8s} median share of allreduce time overlapped with backward: "
                      f"{statistics.median(share) if share else 0:.0%} over {len(ours)} steps, {buckets} buckets "
                      f"of <= {bucket_cap_mb} MB")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--worker", default=None)
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--json", default=None)
    parser.add_argument("--processes-only", action="store_true", help="only the 2-process rows: eager and td.jit step")
    parser.add_argument("--overlap", action="store_true",
                        help="only the traced 2-process DDP steps: how much of the bucket all-reduces ran while backward kernels ran")
    parser.add_argument("--bucket-cap-mb", type=float, default=0.02, help="--overlap's DDP bucket size (default 0.02: 2 buckets)")
    parser.add_argument("--steps", type=int, default=5, help="--overlap's traced steps per mode (default 5)")
    parser.add_argument("--png", default=None, help="--overlap: draw rank 0's trace here (the last model's), zoomed on an eager step")
    parser.add_argument("--overlap-worker", default=None)
    parser.add_argument("--trace", default=None)
    args, _ = parser.parse_known_args()
    if args.overlap_worker:
        overlap_worker(args.overlap_worker, args.bucket_cap_mb, args.steps, args.trace)
        return
    if args.overlap:
        print(f"batch {BATCH} over 2 processes, Adam, DDP buckets of <= {args.bucket_cap_mb} MB; {args.steps} traced steps "
              f"per mode, each waited for; overlap read from each rank's trace; {os.cpu_count()} CPUs")
        for name in args.models.split(","):
            run_overlap(name, args.bucket_cap_mb, args.steps, args.png)
        return
    if args.worker:  # one rank of the 2-process run: the eager and the captured step, interleaved
        import tinydist as td
        td.dist.init()
        rank, world = td.dist.rank(), td.dist.world_size()
        both = _interleaved_agreed({"RATES": eager_stepper(args.worker, 1, rank, world),
                                    "JIT_RATES": jit_stepper(args.worker, 1, rank, world)}, args.seconds)
        if rank == 0:
            for label, rates in both.items():
                print(f"{label} " + " ".join(f"{r:.1f}" for r in rates), flush=True)
            print(f"JIT_RATIO {_ratio(both, 'JIT_RATES', 'RATES'):.3f}", flush=True)
        td.dist.barrier()
        return
    if args.processes_only:
        print(f"batch {BATCH} over 2 processes, Adam, median samples/s over 5 interleaved windows "
              f"({args.seconds:.0f} s per config); {os.cpu_count()} CPUs")
        for name in args.models.split(","):
            found = run_processes(name, args.seconds)
            if found:
                _print_processes(name, found)
        return
    results: list[dict[str, object]] = []
    try:
        import torch  # noqa: F401
        have_torch = True
    except ImportError:
        have_torch = False
    print(f"batch {BATCH}, Adam, median samples/s over 5 windows ({args.seconds:.0f} s per config); {os.cpu_count()} CPUs")
    for name in args.models.split(","):
        rows: dict[str, float] = {}
        # the targets' configs run interleaved, window by window: each ratio compares the same minutes
        timed = {"tinydist 1 device": eager_stepper(name), "tinydist 1 device, td.jit step": jit_stepper(name),
                 "tinydist 2 devices, td.jit step": jit_stepper(name, 2)}
        if have_torch:
            timed["torch 1 thread"] = torch_stepper(name)
        interleaved = _interleaved(timed, args.seconds)
        rows["tinydist 1 device"] = statistics.median(interleaved["tinydist 1 device"])
        rows["tinydist 1 device, td.jit step"] = statistics.median(interleaved["tinydist 1 device, td.jit step"])
        rows["tinydist 2 devices"] = statistics.median(run_tinydist(name, 2, args.seconds))
        rows["tinydist 2 devices, td.jit step"] = statistics.median(interleaved["tinydist 2 devices, td.jit step"])
        found = run_processes(name, args.seconds)
        if found:
            rows["tinydist 2 processes"] = statistics.median(found["RATES"])
            rows["tinydist 2 processes, td.jit step"] = statistics.median(found["JIT_RATES"])
        if have_torch:
            rows["torch 1 thread"] = statistics.median(interleaved["torch 1 thread"])
        base = rows["tinydist 1 device"]
        for label, rate in rows.items():
            extra = f"  ({rate / base:.2f}x of 1 device)"
            if have_torch and label != "torch 1 thread":
                extra += f"  ({rate / rows['torch 1 thread']:.2f}x torch)"
            print(f"{name:4s} {label:22s} {rate:10,.0f} samples/s{extra}")
            results.append({"name": f"{name}/{label.replace(' ', '_')}", "value": rate, "unit": "samples/s"})
        # the targets, each against its own baseline: captured step against captured step,
        # the median of the per-round ratios of the interleaved windows
        scaling = _ratio(interleaved, "tinydist 2 devices, td.jit step", "tinydist 1 device, td.jit step")
        if name == "cnn":  # the scaling target is the CNN's; the MLP's ~0.3 ms step is decided by fixed costs
            print(f"{name:4s} target: 2-device scaling (td.jit steps) {scaling:.2f}x "
                  f"{'>=1.7x: PASS' if scaling >= 1.7 else '>=1.7x: MISS'} (median of 5 interleaved rounds)")
        else:
            print(f"{name:4s} 2-device scaling (td.jit steps) {scaling:.2f}x, no target (median of 5 interleaved rounds)")
        if found:
            _print_processes(name, found)
        if have_torch:
            versus = _ratio(interleaved, "tinydist 1 device, td.jit step", "torch 1 thread")
            print(f"{name:4s} target: one core, td.jit step vs torch 1 thread {versus:.2f}x "
                  f"{'>=1x: PASS' if versus >= 1 else '>=1x: MISS'} (median of 5 interleaved rounds)")
            eager = _ratio(interleaved, "tinydist 1 device", "torch 1 thread")
            want = EAGER_TARGETS[name]
            print(f"{name:4s} target: eager step vs torch 1 thread {eager:.2f}x "
                  f"{f'>={want}x: PASS' if eager >= want else f'>={want}x: MISS'} (median of 5 interleaved rounds)")
        print(eager_breakdown(name))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
