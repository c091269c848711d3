"""`tinydist launch --nproc N script.py [args]`: N local ranks of one job, their output prefixed.

Each rank gets TINYDIST_RANK, TINYDIST_LOCAL_RANK, TINYDIST_WORLD_SIZE, TINYDIST_COORDINATOR and
TINYDIST_JOB_ID. The launcher binds the coordinator's socket itself (127.0.0.1, a free port) and
hands it to rank 0 (TINYDIST_COORDINATOR_FD), so there is no race for the port. Every line a rank
prints comes out as `[rank N] line` (stdout to stdout, stderr to stderr).

When a rank exits non-zero (or dies by a signal), the others get SIGTERM, then SIGKILL after
`--grace` seconds; the launcher exits with the first failing rank's code (128+signal for a signal).
`--timeout` bounds the whole job. Afterwards any /dev/shm/tinydist-* segment of this job is removed.
If the launcher itself is killed (even by SIGKILL), its reaper (`launch_reaper.py`) stops the ranks
and removes those segments.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from tinydist.dist.rendezvous import coordinator_listener
from tinydist.launch_reaper import sweep_shm
from tinydist.logs import get_logger

_REAPER = Path(__file__).with_name("launch_reaper.py")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, required=True, help="number of ranks (processes) to start")
    parser.add_argument("--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL when one rank fails")
    parser.add_argument("--timeout", type=float, default=None, help="kill the whole job after this many seconds")
    parser.add_argument("-m", dest="module", action="store_true", help="run the target as a module (python -m)")
    parser.add_argument("script", help="the Python script (or module with -m) every rank runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


async def _pump(stream: asyncio.StreamReader, rank: int, out: object) -> None:
    prefix = f"[rank {rank}] ".encode()
    buffer = out.buffer if hasattr(out, "buffer") else None
    while True:
        line = await stream.readline()
        if not line:
            return
        if not line.endswith(b"\n"):
            line += b"\n"
        if buffer is not None:
            buffer.write(prefix + line)
            buffer.flush()
        else:
            out.write((prefix + line).decode(errors="replace"))  # type: ignore[attr-defined]


class _Reaper:
    """The reaper process of one job (see launch_reaper.py): told each rank's process group, and
    told `done` once the launcher has cleaned up, so it exits without touching anything."""

    def __init__(self, job: str, grace: float) -> None:
        self._process = subprocess.Popen([sys.executable, str(_REAPER), job, str(grace)], stdin=subprocess.PIPE,
                                         start_new_session=True, text=True)

    def _say(self, line: str) -> None:
        assert self._process.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self._process.stdin.write(line + "\n")
            self._process.stdin.flush()

    def watch(self, group: int) -> None:
        self._say(f"group {group}")

    def close(self) -> None:
        self._say("done")
        assert self._process.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self._process.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(timeout=5)


async def launch(nproc: int, target: Sequence[str], module: bool = False, grace: float = 5.0,
                 timeout: float | None = None, env: dict[str, str] | None = None) -> int:
    if nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {nproc}")
    log = get_logger(component="launch")
    job = secrets.token_hex(4)
    listener = coordinator_listener(("127.0.0.1", 0))
    listener.set_inheritable(True)
    host, port = listener.getsockname()[:2]
    base = dict(os.environ if env is None else env)
    base.update(TINYDIST_WORLD_SIZE=str(nproc), TINYDIST_COORDINATOR=f"{host}:{port}", TINYDIST_JOB_ID=job,
                PYTHONUNBUFFERED="1")
    command = [sys.executable, *(["-m"] if module else []), *target]
    procs: list[asyncio.subprocess.Process] = []
    pumps: list[asyncio.Task[None]] = []
    reaper = _Reaper(job, grace)
    try:
        for rank in range(nproc):
            env_r = dict(base, TINYDIST_RANK=str(rank), TINYDIST_LOCAL_RANK=str(rank))
            pass_fds: tuple[int, ...] = ()
            if rank == 0:
                env_r["TINYDIST_COORDINATOR_FD"] = str(listener.fileno())
                pass_fds = (listener.fileno(),)
            proc = await asyncio.create_subprocess_exec(*command, env=env_r, stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.PIPE, pass_fds=pass_fds,
                                                        start_new_session=True)
            procs.append(proc)
            reaper.watch(proc.pid)   # its own session: the process group id is its pid
            assert proc.stdout is not None and proc.stderr is not None
            pumps.append(asyncio.ensure_future(_pump(proc.stdout, rank, sys.stdout)))
            pumps.append(asyncio.ensure_future(_pump(proc.stderr, rank, sys.stderr)))
        listener.close()
        loop = asyncio.get_running_loop()

        def forward(signum: int) -> None:     # stop the ranks; their exit codes then end the job
            for p in procs:
                if p.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signum)
        for signum in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(signum, forward, signum)

        waits = {asyncio.ensure_future(p.wait()): rank for rank, p in enumerate(procs)}
        failed: tuple[int, int] | None = None
        pending = set(waits)
        deadline = None if timeout is None else loop.time() + timeout
        while pending and failed is None:
            left = None if deadline is None else max(0.0, deadline - loop.time())
            done, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                print(f"[launch] job exceeded --timeout {timeout:g} s; stopping all ranks", file=sys.stderr, flush=True)
                failed = (-1, 124)
                break
            for fut in sorted(done, key=lambda f: waits[f]):
                rc = fut.result()
                if rc != 0 and failed is None:
                    failed = (waits[fut], rc)
        if failed is not None and pending:
            rank, rc = failed
            if rank >= 0:
                how = f"signal {-rc}" if rc < 0 else f"code {rc}"
                print(f"[launch] rank {rank} exited with {how}; stopping the other ranks", file=sys.stderr, flush=True)
            log.warning("launch.rank_failed", rank=rank, returncode=rc)
            await _stop(procs, pending, grace)
        # collect everything that is left (bounded: every process has exited or been killed)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*pumps, return_exceptions=True), timeout=5)
        if failed is not None:
            return _exit_code(failed[1])
        return 0
    finally:
        listener.close()
        for p in procs:
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(p.wait(), timeout=5)
        for t in pumps:
            t.cancel()
        sweep_shm(job)
        reaper.close()


async def _stop(procs: list[asyncio.subprocess.Process], pending: set[asyncio.Task[int]], grace: float) -> None:
    for p in procs:
        if p.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    if pending:
        _, still = await asyncio.wait(pending, timeout=grace)
        if still:
            for p in procs:
                if p.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
            await asyncio.wait(still, timeout=5)


def run(args: argparse.Namespace) -> int:
    target = [args.script, *args.args]
    if args.args[:1] == ["--"]:
        target = [args.script, *args.args[1:]]
    try:
        return asyncio.run(launch(args.nproc, target, module=args.module, grace=args.grace, timeout=args.timeout))
    except KeyboardInterrupt:
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tinydist launch", description="start N local ranks of a tinydist.dist job")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
