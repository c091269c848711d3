"""`tinydist launch --nproc-per-node N script.py [args]`: N local ranks of one job, their output prefixed.

The flags are torchrun's: `--nproc-per-node` (alias `--nproc`, default 1), `--nnodes`, `--node-rank`,
`--master-addr` / `--master-port` or `--rdzv-endpoint HOST:PORT`, `--log-dir` and `--tee`. A job on
several hosts is one launcher per host with the same flags but its own `--node-rank`; node 0's
launcher binds the rendezvous at the master address.

Each rank gets TINYDIST_RANK, TINYDIST_LOCAL_RANK, TINYDIST_WORLD_SIZE, TINYDIST_COORDINATOR and
TINYDIST_JOB_ID, and torchrun's RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK (the
node rank), MASTER_ADDR and MASTER_PORT. Node 0's launcher binds the coordinator's socket itself
(a free port on 127.0.0.1 for a one-node job) and hands it to rank 0 (TINYDIST_COORDINATOR_FD), so
there is no race for the port. Every line a rank prints comes out as `[rank N] line` (stdout to
stdout, stderr to stderr), as soon as it is whole; a progress bar's `\r` redraw counts as a line,
forwarded as it is drawn (tinydist.base.progress writes plain lines into the pipe anyway); a line that is a JSON object (`--log-format json`) gets `"rank": N` as
its first field instead, so the output stays JSON lines. `--log-dir DIR` also writes each rank's
output, unprefixed, to DIR/<rank>/stdout.log and stderr.log; `--tee` says which streams still go
to the console then (0 none, 1 stdout, 2 stderr, 3 both: the default).

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
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

from tinydist.base import logs
from tinydist.base.arguments import endpoint, integer, port, seconds
from tinydist.base.logs import get_logger
from tinydist.dist.launch_reaper import sweep_shm
from tinydist.dist.rendezvous import coordinator_listener

_REAPER = Path(__file__).with_name("launch_reaper.py")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc-per-node", "--nproc", dest="nproc", type=integer(1), default=1, metavar="N",
                        help="ranks (processes) to start on this node (default 1)")
    parser.add_argument("--nnodes", type=integer(1), default=1, help="nodes (launchers) in the job (default 1)")
    parser.add_argument("--node-rank", type=integer(0), default=0, help="this node's index, 0 … nnodes-1 (default 0)")
    parser.add_argument("--master-addr", default=None, metavar="HOST",
                        help="address of node 0, where the rendezvous listens (default 127.0.0.1)")
    parser.add_argument("--master-port", type=port, default=None, metavar="PORT",
                        help="port of the rendezvous on node 0 (default: a free one; needed with --nnodes > 1)")
    parser.add_argument("--rdzv-endpoint", type=endpoint, default=None, metavar="HOST:PORT",
                        help="--master-addr and --master-port in one")
    parser.add_argument("--log-dir", type=Path, default=None, metavar="DIR",
                        help="also write each rank's output to DIR/<rank>/stdout.log and stderr.log")
    parser.add_argument("--tee", type=int, choices=range(4), default=3,
                        help="with --log-dir, the streams still shown here: 0 none, 1 stdout, 2 stderr, 3 both (default)")
    parser.add_argument("--grace", type=seconds, default=5.0,
                        help="seconds between SIGTERM and SIGKILL when one rank fails (default 5)")
    parser.add_argument("--timeout", type=seconds, default=None, help="kill the whole job after this many seconds")
    parser.add_argument("-m", dest="module", action="store_true", help="run the target as a module (python -m)")
    parser.add_argument("script", help="the Python script (or module with -m) every rank runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def _with_rank(line: bytes, rank: int, prefix: bytes) -> bytes:
    """`[rank N] line`, or for a JSON object line the object with "rank": N first (still JSON)."""
    if line.startswith(b"{"):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict):
            return (json.dumps({"rank": rank, **record}) + "\n").encode()
    return prefix + line


_LINE_END = re.compile(rb"\r\n|\r|\n")


class _Lines:
    """A rank's byte stream cut into the lines a terminal would show, each as soon as it is whole.

    A line ends at `\n`, `\r\n` or a lone `\r`. A progress bar redraws itself as `\r` + text with
    no newline (tqdm into a pipe): the text after a `\r` is forwarded at the end of the read that
    brought it, not when the next redraw comes, so the latest state shows while the rank runs, and
    a redraw is not forwarded twice when a `\r` or `\n` then ends it. Empty `\r` segments are
    dropped; blank lines stay. A `\r` at the end of a read waits for the next, which may start
    with its `\n`."""

    def __init__(self) -> None:
        self.pending = b""    # the unfinished line so far
        self.redraw = False   # it began after a lone \r
        self.shown = False    # it was forwarded already, as it stands
        self.carry = b""

    def feed(self, data: bytes) -> list[bytes]:
        data, self.carry = self.carry + data, b""
        if data.endswith(b"\r"):
            data, self.carry = data[:-1], b"\r"
        lines, start = [], 0
        for match in _LINE_END.finditer(data):
            piece = data[start:match.start()]
            line = self.pending + piece
            if not (self.shown and not piece) and (line or match.group() != b"\r"):
                lines.append(line + b"\n")
            self.pending, self.shown, self.redraw = b"", False, match.group() == b"\r"
            start = match.end()
        if start < len(data):
            self.pending += data[start:]
            self.shown = False
        if self.redraw and self.pending and not self.shown:
            lines.append(self.pending + b"\n")
            self.shown = True
        return lines

    def end(self) -> list[bytes]:
        """The last line, newline or not."""
        last = [self.pending + b"\n"] if self.pending and not self.shown else []
        self.pending, self.carry = b"", b""
        return last


async def _pump(stream: asyncio.StreamReader, rank: int, out: Any, log: BinaryIO | None = None) -> None:
    """Forward each line of one rank's stream to `out` (None: not to the console) and `log` (its
    bytes as written). Read in chunks, not by `readline`: a `\r`-redrawn bar is forwarded as it
    is drawn (`_Lines`), and no line is too long to forward (readline stops at 64 KiB)."""
    prefix = f"[rank {rank}] ".encode()
    buffer = out.buffer if hasattr(out, "buffer") else None
    splitter = _Lines()
    while True:
        chunk = await stream.read(1 << 16)
        if log is not None and chunk:
            log.write(chunk)
            log.flush()
        lines = splitter.feed(chunk) if chunk else splitter.end()
        if out is not None and lines:
            text = b"".join(_with_rank(line, rank, prefix) for line in lines)
            if buffer is not None:
                buffer.write(text)
                buffer.flush()
            else:
                out.write(text.decode(errors="replace"))
        if not chunk:
            return


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


def _announce(message: str) -> None:
    """The launcher's own line on stderr, `[launch] message`; not with JSON logs, whose stream must stay JSON
    lines (the record the launcher logs beside it says the same)."""
    if logs.rendering() != "json":
        print(f"[launch] {message}", file=sys.stderr, flush=True)


def check_topology(nproc: int, nnodes: int, node_rank: int, master_port: int) -> None:
    """Raises ValueError naming the flag, for a job shape no launcher could start."""
    if nproc < 1 or nnodes < 1:
        raise ValueError(f"--nproc-per-node and --nnodes must be at least 1, got {nproc} and {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank {node_rank} is outside 0 … {nnodes - 1} (--nnodes {nnodes})")
    if nnodes > 1 and master_port == 0:
        raise ValueError("--nnodes > 1 needs --master-port (or --rdzv-endpoint HOST:PORT): every node's launcher "
                         "must name the same rendezvous")


async def launch(nproc: int, target: Sequence[str], module: bool = False, grace: float = 5.0,
                 timeout: float | None = None, env: dict[str, str] | None = None, *, nnodes: int = 1,
                 node_rank: int = 0, master_addr: str = "127.0.0.1", master_port: int = 0,
                 log_dir: Path | None = None, tee: int = 3) -> int:
    """Run this node's `nproc` ranks of a job of `nnodes` × `nproc`; returns the job's exit code."""
    check_topology(nproc, nnodes, node_rank, master_port)
    log = get_logger(component="launch")
    job = secrets.token_hex(4)
    listener: socket.socket | None = None
    if node_rank == 0:    # node 0 holds the rendezvous: bound here, so there is no race for the port
        try:
            listener = coordinator_listener((master_addr, master_port))
        except OSError as exc:
            raise OSError(exc.errno, f"cannot bind the rendezvous at {master_addr}:{master_port}: {exc.strerror}") from exc
        listener.set_inheritable(True)
        master_port = listener.getsockname()[1]
    world = nnodes * nproc
    coordinator = f"[{master_addr}]:{master_port}" if ":" in master_addr else f"{master_addr}:{master_port}"
    base = dict(os.environ if env is None else env)
    base.update(TINYDIST_WORLD_SIZE=str(world), TINYDIST_COORDINATOR=coordinator, TINYDIST_JOB_ID=job,
                WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK=str(node_rank),
                MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), PYTHONUNBUFFERED="1")
    command = [sys.executable, *(["-m"] if module else []), *target]
    procs: list[asyncio.subprocess.Process] = []
    pumps: list[asyncio.Task[None]] = []
    log_files = contextlib.ExitStack()
    reaper = _Reaper(job, grace)
    try:
        for local_rank in range(nproc):
            rank = node_rank * nproc + local_rank
            env_r = dict(base, TINYDIST_RANK=str(rank), TINYDIST_LOCAL_RANK=str(local_rank), RANK=str(rank),
                         LOCAL_RANK=str(local_rank))
            pass_fds: tuple[int, ...] = ()
            if rank == 0 and listener is not None:
                env_r["TINYDIST_COORDINATOR_FD"] = str(listener.fileno())
                pass_fds = (listener.fileno(),)
            proc = await asyncio.create_subprocess_exec(*command, env=env_r, stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.PIPE, pass_fds=pass_fds,
                                                        start_new_session=True)
            procs.append(proc)
            reaper.watch(proc.pid)   # its own session: the process group id is its pid
            assert proc.stdout is not None and proc.stderr is not None
            files: list[BinaryIO | None] = [None, None]
            if log_dir is not None:
                (log_dir / str(rank)).mkdir(parents=True, exist_ok=True)
                files = [log_files.enter_context(open(log_dir / str(rank) / f"{name}.log", "wb")) for name in ("stdout", "stderr")]
            show_out = log_dir is None or tee & 1
            show_err = log_dir is None or tee & 2
            pumps.append(asyncio.ensure_future(_pump(proc.stdout, rank, sys.stdout if show_out else None, files[0])))
            pumps.append(asyncio.ensure_future(_pump(proc.stderr, rank, sys.stderr if show_err else None, files[1])))
        if listener is not None:
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

        waits = {asyncio.ensure_future(p.wait()): node_rank * nproc + i for i, p in enumerate(procs)}
        failed: tuple[int, int] | None = None
        pending = set(waits)
        deadline = None if timeout is None else loop.time() + timeout
        while pending and failed is None:
            left = None if deadline is None else max(0.0, deadline - loop.time())
            done, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                _announce(f"job exceeded --timeout {timeout:g} s; stopping all ranks")
                log.warning("launch.timeout", timeout_s=timeout)
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
                _announce(f"rank {rank} exited with {how}; stopping the other ranks")
            log.warning("launch.rank_failed", rank=rank, returncode=rc)
            await _stop(procs, pending, grace)
        # collect everything that is left (bounded: every process has exited or been killed)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*pumps, return_exceptions=True), timeout=5)
        if failed is not None:
            return _exit_code(failed[1])
        return 0
    finally:
        if listener is not None:
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
        log_files.close()


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


def run(args: argparse.Namespace, env: dict[str, str] | None = None) -> int:
    target = [args.script, *args.args]
    if args.args[:1] == ["--"]:
        target = [args.script, *args.args[1:]]
    if args.rdzv_endpoint is not None and (args.master_addr, args.master_port) != (None, None):
        args.parser.error("give --rdzv-endpoint or --master-addr/--master-port, not both")
    master_addr, master_port = args.rdzv_endpoint or (args.master_addr or "127.0.0.1", args.master_port or 0)
    try:
        check_topology(args.nproc, args.nnodes, args.node_rank, master_port)
    except ValueError as exc:
        args.parser.error(str(exc))
    try:
        return asyncio.run(launch(args.nproc, target, module=args.module, grace=args.grace, timeout=args.timeout,
                                  env=env, nnodes=args.nnodes, node_rank=args.node_rank, master_addr=master_addr,
                                  master_port=master_port, log_dir=args.log_dir, tee=args.tee))
    except KeyboardInterrupt:
        return 130
