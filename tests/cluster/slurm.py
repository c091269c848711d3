"""A one-host Slurm for tests (tests/cluster/test_slurm.py): munged, slurmctld and slurmd from Debian's
`munge` and `slurm-wlm` packages, configured in a temporary directory for this machine.

    with OneHostSlurm() as slurm:
        done = slurm.sbatch(["--ntasks=2", "deploy/slurm/train.sbatch", "script.py"], timeout=300)
        done.returncode, done.output                    # the job's exit code and its output file

Nothing outside its temporary directory (`tempfile.mkdtemp` under /tmp, removed by `close()`) is read
or written: munged gets its own key and socket there
(slurm.conf's AuthInfo=socket=... points Slurm at it), slurmctld and slurmd their state, spool,
pid and log files, and the commands (sbatch, sinfo, ...) find the configuration through SLURM_CONF
in their environment. The node line is `slurmd -C`'s (this machine's CPUs, sockets, cores and
memory, as slurmd will report them, so the node is not drained for a mismatch); the two daemon
ports are free ports picked at start. Process tracking is proctrack/linuxproc and task/none, so no
cgroup setup is needed. `close()` cancels what is still queued or running, stops the three
daemons (SIGTERM, then SIGKILL after a bounded wait) and removes the directory; a failure's message
carries the daemons' logs first. Every wait is bounded. The directory is not pytest's tmp_path:
munged refuses a socket whose every ancestor is not searchable by all, and pytest's are 0700.

Needs root (slurmd starts jobs as the submitting user; munged and slurmd run as root here) and the
binaries; `unavailable()` says what is missing, for the skip reason.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# the binary -> the Debian package that provides it (deploy/ci/apt-packages.txt lists the packages)
BINARIES = {"munged": "munge", "slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client",
            "sinfo": "slurm-client", "scontrol": "slurm-client"}


def unavailable() -> str | None:
    """Why a one-host Slurm cannot be started here (the skip reason), or None when it can."""
    if os.geteuid() != 0:
        return f"not root (euid {os.geteuid()}): slurmd and munged must run as root to start jobs"
    missing = sorted({package for binary, package in BINARIES.items() if shutil.which(binary) is None})
    if missing:
        return (f"Slurm binaries missing (packages {', '.join(missing)}): `make integration` installs "
                f"slurm-wlm and munge as root (deploy/ci/apt-packages.txt)")
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Finished:
    job_id: int
    returncode: int
    output: str         # the job's output file (#SBATCH -o), stdout and stderr of the batch script and its steps


class OneHostSlurm:
    def __init__(self, start_timeout: float = 60.0) -> None:
        reason = unavailable()
        if reason is not None:
            raise RuntimeError(reason)
        self.dir = Path(tempfile.mkdtemp(prefix="td-slurm-"))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.jobs: list[int] = []
        self._closed = False
        munge = self.dir / "munge"          # the key: private to root
        munge.mkdir(mode=0o700)
        sock = self.dir / "munge-socket"    # munged wants its socket's directory searchable by all
        sock.mkdir(mode=0o755)
        self.dir.chmod(0o755)
        key = munge / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        self.munge_socket = sock / "munge.socket"
        for name in ("state", "spool", "log"):
            (self.dir / name).mkdir()
        node_line = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30, check=True).stdout
        node = next(line for line in node_line.splitlines() if line.startswith("NodeName="))
        self.node_name = node.split()[0].split("=", 1)[1]
        self.conf = self.dir / "slurm.conf"
        (self.dir / "plugstack.conf").write_text("")     # not /etc/slurm/plugstack.conf's plugins
        self.conf.write_text("\n".join([
            f"ClusterName=td{os.getpid()}",
            f"SlurmctldHost={self.node_name}",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={self.dir / 'state'}",
            f"SlurmdSpoolDir={self.dir / 'spool'}",
            f"SlurmctldPidFile={self.dir / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.dir / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.dir / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.dir / 'log' / 'slurmd.log'}",
            f"PlugStackConfig={self.dir / 'plugstack.conf'}",
            "ProctrackType=proctrack/linuxproc",      # no cgroup hierarchy needed
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "ReturnToService=2",
            # slurmd -C's line without its UpTime= field: the node as slurmd will register it
            " ".join(field for field in node.split() if not field.startswith("UpTime=")) + " State=UNKNOWN",
            f"PartitionName=td Nodes={self.node_name} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
            ""]))
        try:
            self._start("munged", ["munged", "-F", f"--socket={self.munge_socket}", f"--key-file={key}",
                                   f"--pid-file={munge / 'munged.pid'}", f"--log-file={self.dir / 'log' / 'munged.log'}",
                                   f"--seed-file={munge / 'munged.seed'}"])
            self._wait(lambda: self.munge_socket.exists(), start_timeout, "munged's socket")
            self._start("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
            self._start("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", self.node_name])
            self._wait(self._node_idle, start_timeout, f"node {self.node_name} idle in sinfo")
        except BaseException:
            self.close()
            raise

    def env(self, **extra: str) -> dict[str, str]:
        """The environment for Slurm commands (and, through sbatch's --export=ALL, for the job)."""
        return {**os.environ, "SLURM_CONF": str(self.conf), **extra}

    def _start(self, name: str, argv: list[str]) -> None:
        log = (self.dir / "log" / f"{name}.out").open("wb")
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env())
        log.close()

    def _wait(self, ready: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}) while waiting for {what}:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {timeout} s:\n{self.logs()}")
            time.sleep(0.2)

    def _node_idle(self) -> bool:
        shown = subprocess.run(["sinfo", "--noheader", "--format=%T", "--nodes", self.node_name],
                               capture_output=True, text=True, timeout=30, env=self.env())
        return shown.returncode == 0 and shown.stdout.strip() == "idle"

    def logs(self) -> str:
        parts = []
        for path in sorted((self.dir / "log").iterdir()):
            parts.append(f"--- {path.name} (last 20 lines)\n" + "\n".join(path.read_text(errors="replace").splitlines()[-20:]))
        return "\n".join(parts)

    def sbatch(self, args: list[str], timeout: float, cwd: Path, env: dict[str, str]) -> Finished:
        """Submit and wait for the job to end (`sbatch --wait`, its own time limit a minute past
        `timeout`); the job's exit code and output file."""
        output = self.dir / f"job-{len(self.jobs)}.out"
        minutes = int(timeout // 60) + 2
        argv = ["sbatch", "--parsable", "--wait", f"--time={minutes}", f"--output={output}", *args]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                                env={**self.env(), **env, "SLURM_CONF": str(self.conf)})
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            self._record(out)
            raise TimeoutError(f"sbatch {' '.join(args)} did not finish within {timeout} s; job output:\n"
                               f"{output.read_text() if output.exists() else '(none)'}\n{self.logs()}") from None
        job_id = self._record(out)
        if job_id is None:
            raise RuntimeError(f"sbatch {' '.join(args)} failed ({proc.returncode}): {err}\n{self.logs()}")
        return Finished(job_id, proc.returncode, output.read_text() if output.exists() else "")

    def _record(self, out: str) -> int | None:
        first = out.strip().split(";")[0]
        if not first.isdigit():
            return None
        self.jobs.append(int(first))
        return int(first)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.jobs and self.procs.get("slurmctld") is not None and self.procs["slurmctld"].poll() is None:
            subprocess.run(["scancel", *map(str, self.jobs)], capture_output=True, timeout=30, env=self.env())
        for name in ("slurmd", "slurmctld", "munged"):        # the job side first, the credentials last
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> OneHostSlurm:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
