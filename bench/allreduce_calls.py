"""Per-call Python work of a small 2-process allreduce, counted: the load-proof companion of bench/allreduce.py.

    .venv/bin/python bench/allreduce_calls.py [--calls 200] [--json PATH]
    PYTHONPATH=/path/to/other/checkout .venv/bin/python bench/allreduce_calls.py --json base.json
    .venv/bin/python bench/allreduce_calls.py --diff base.json head.json [--case 4096/naive]

On this shared 2-vCPU machine two timings of a 30 us allreduce an hour apart differ by more than
the regressions worth finding, so this counts instead of timing. Rank 0 of a `tinydist launch`
job of 2 processes calls `group.blocking("all_reduce", x, "sum", algorithm, x)` (the call
bench/allreduce.py times) for 4 KiB and 64 KiB float32 and the naive, all2all and auto
algorithms, and counts, per call: Python function calls and C function calls (sys.setprofile)
and executed bytecode instructions (sys.settrace with f_trace_opcodes), each by function. The
loops that wait for the peer (`ShmGroup.wait`, its futex sleeps and `_crowded`) run as often as
the peer's timing makes them, so their bytecodes are counted apart and left out of the totals;
everything else is deterministic (two runs agree to a tenth of a call).

The tinydist that runs is the one on PYTHONPATH, so one copy of this script counts any revision
(it reads the group's event-loop entry both as today's `dist._state["run"]` and as the older
`dist._state["portal"].call`). `--diff` prints two runs' totals and, with `--case`, the functions
whose counts differ.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SIZES = (4 << 10, 64 << 10)
ALGORITHMS = ("naive", "all2all", "auto")
# the waits on the peer: how often they loop depends on its timing, not on this rank's code
WAITS = {"transports/shm_group.py:wait", "transports/shm_group.py:_futex", "transports/shm_group.py:_crowded"}
WAITING = "C:(inside the waits)"


def _key(code: Any) -> str:
    """`folder/module.py:function`, the same for every checkout (and the symlinked folders)."""
    name = re.sub(r"^.*?/(tinydist|transports|nodes|scheduler)/", r"\1/", code.co_filename)
    name = re.sub(r"^tinydist/(transports|nodes|scheduler)/", r"\1/", name)
    name = re.sub(r"^.*/lib/python3\.\d+/", "stdlib/", name)
    return f"{name}:{code.co_name}"


def worker(calls: int, out: str) -> None:
    import numpy as np

    from tinydist import dist
    dist.init()
    group = dist.get_group()
    state: dict[str, Any] = dist._state        # noqa: SLF001 - the loop entry, spelled per revision
    run = state.get("run") or state["portal"].call
    results: dict[str, dict[str, dict[str, float]]] = {}
    for nbytes in SIZES:
        x = np.ones(nbytes // 4, np.float32)
        for algorithm in ALGORITHMS:
            for _ in range(20):   # warm: first-call caches, the choice memo, the kernels
                group.blocking("all_reduce", x, "sum", algorithm, x, run_async=run)
                x.fill(1.0)
            counted: collections.Counter[str] = collections.Counter()
            opcodes: collections.Counter[str] = collections.Counter()

            def profile(frame: Any, event: str, arg: Any) -> None:
                if event == "call":
                    counted[_key(frame.f_code)] += 1
                elif event == "c_call":
                    counted[WAITING if _key(frame.f_code) in WAITS else f"C:{getattr(arg, '__qualname__', arg)}"] += 1

            def trace(frame: Any, event: str, arg: Any) -> Any:
                frame.f_trace_opcodes = True
                key = _key(frame.f_code)

                def local(frame: Any, event: str, arg: Any) -> Any:
                    if event == "opcode":
                        opcodes[key] += 1
                    return local
                return local

            for i in range(2 * calls):   # the first half profiled (calls), the second traced (bytecodes)
                if i < calls:
                    sys.setprofile(profile)
                else:
                    sys.settrace(trace)
                group.blocking("all_reduce", x, "sum", algorithm, x, run_async=run)
                sys.setprofile(None)
                sys.settrace(None)
                if x[0] != dist.world_size():
                    raise AssertionError(f"all_reduce {algorithm} of {nbytes} B gave {x[0]}, not {dist.world_size()}")
                x.fill(1.0)
            results[f"{nbytes}/{algorithm}"] = {"calls": {k: v / calls for k, v in counted.most_common()},
                                                "opcodes": {k: v / calls for k, v in opcodes.most_common()}}
    if dist.rank() == 0:
        Path(out).write_text(json.dumps(results, indent=1))
    dist.destroy()


def totals(case: dict[str, dict[str, float]]) -> tuple[float, float, float, float]:
    """(Python calls, C calls, bytecodes, bytecodes in the waits) per allreduce."""
    calls, opcodes = case["calls"], case["opcodes"]
    return (sum(v for k, v in calls.items() if not k.startswith("C:") and k not in WAITS),
            sum(v for k, v in calls.items() if k.startswith("C:") and k != WAITING),
            sum(v for k, v in opcodes.items() if k not in WAITS),
            sum(v for k, v in opcodes.items() if k in WAITS))


def label(case: str) -> str:
    nbytes, algorithm = case.split("/")
    return f"{int(nbytes) >> 10} KiB/{algorithm}"


def print_counts(results: dict[str, Any]) -> None:
    for case, counts in results.items():
        py, c, ops, waits = totals(counts)
        print(f"allreduce_calls/2proc/{label(case)}: {py:.1f} Python calls per allreduce "
              f"(C calls {c:.1f}; bytecodes {ops:.0f}, and {waits:.0f} in the waits on the peer)")


def print_diff(base: dict[str, Any], head: dict[str, Any], only: str | None) -> None:
    for case in base:
        if only and case != only:
            continue
        (bp, bc, bo, bw), (hp, hc, ho, hw) = totals(base[case]), totals(head[case])
        print(f"{label(case):14s} Python calls {bp:5.1f} -> {hp:5.1f}   C calls {bc:5.1f} -> {hc:5.1f}   "
              f"bytecodes {bo:6.0f} -> {ho:6.0f}   (in the waits: {bw:4.0f} -> {hw:4.0f})")
        if not only:
            continue
        for kind in ("calls", "opcodes"):
            a, b = base[case][kind], head[case][kind]
            for key in sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, 0) - a.get(k, 0))):
                moved = b.get(key, 0) - a.get(key, 0)
                if abs(moved) >= 0.5 and key not in WAITS and key != WAITING:
                    print(f"    {kind:7s} {a.get(key, 0):7.2f} -> {b.get(key, 0):7.2f}  {moved:+7.2f}  {key}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="counted allreduces per case (default 200)")
    parser.add_argument("--json", type=Path, help="write the counts by function here")
    parser.add_argument("--diff", nargs=2, type=Path, metavar=("BASE", "HEAD"), help="compare two --json files")
    parser.add_argument("--case", help="with --diff: one case (4096/naive, ...), by function")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.calls, args.out)
    if args.diff:
        return print_diff(*(json.loads(p.read_text()) for p in args.diff), args.case)
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "counts.json"
        cmd = [sys.executable, "-m", "tinydist.cli", "launch", "--nproc", "2", __file__,
               "--worker", "--calls", str(args.calls), "--out", str(out)]
        # the log level bench/allreduce.py runs at (a debug record per call would be counted too)
        env = dict(os.environ, TINYDIST_LOG_LEVEL="warning")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"the counting job failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        results = json.loads(out.read_text())
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print_counts(results)


if __name__ == "__main__":
    main()
