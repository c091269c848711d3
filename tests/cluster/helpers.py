"""Helpers for tests/cluster: a coordinator process and node processes on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).parent / "workers" / "job.py"


def env(**extra: str) -> dict[str, str]:
    out = dict(os.environ, PYTHONPATH=str(ROOT))
    for name in ("TINYDIST_RANK", "TINYDIST_WORLD_SIZE", "TINYDIST_COORDINATOR", "TINYDIST_COORDINATOR_FD",
                 "SLURM_PROCID", "KUBERNETES_SERVICE_HOST", "RANK", "MASTER_ADDR"):
        out.pop(name, None)
    out.update(extra)
    return out


class Coordinator:
    # 10 misses of 0.1 s: short enough for fast failure tests, long enough that a node process
    # starved of CPU on a loaded 2-core CI runner is not declared dead while it is alive
    def __init__(self, tmp: Path, *args: str, interval: float = 0.1, misses: int = 10,
                 listen: str = "127.0.0.1:0") -> None:
        self.interval, self.misses = interval, misses
        port_file = tmp / f"coordinator-{time.monotonic_ns()}.addr"
        self.log = tmp / f"coordinator-{time.monotonic_ns()}.log"
        self._log_file = self.log.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "tinydist.cli", "scheduler", "serve", "--listen", listen,
                                      "--heartbeat-interval", str(interval), "--miss-limit", str(misses),
                                      "--port-file", str(port_file), *args],
                                     stdout=self._log_file, stderr=subprocess.STDOUT, env=env(), cwd=ROOT)
        deadline = time.monotonic() + 20
        while not port_file.exists() or not port_file.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"coordinator did not start: {self.log.read_text()}")
            time.sleep(0.05)
        self.address = port_file.read_text()

    def wait_until_not_alive(self, node_ids: list[str], timeout: float = 10.0) -> None:
        """Block until the coordinator no longer counts `node_ids` as alive (dead or left), so a
        restarted job cannot be handed a table naming an old incarnation."""
        from tinydist.scheduler.node import status
        deadline = time.monotonic() + timeout
        while True:
            alive = {m.node.node_id for m in status(self.address, None).members if m.state == "alive"}
            if not alive & set(node_ids):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"coordinator still counts {sorted(alive & set(node_ids))} alive after {timeout} s")
            time.sleep(self.interval)

    def kill(self) -> None:
        """SIGKILL: no shutdown path runs (what the journal must survive)."""
        self.proc.kill()
        self.proc.wait()
        self._log_file.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()


def start_nodes(address: str, world: int, *args: str, extra_env: dict[str, str] | None = None,
                separate_hosts: bool = True, per_rank: dict[int, list[str]] | None = None) -> list[subprocess.Popen]:
    procs = []
    for rank in range(world):
        more = (per_rank or {}).get(rank, [])
        host = ["--host-key", f"host-{rank}"] if separate_hosts else []
        procs.append(subprocess.Popen([sys.executable, str(JOB), "--coordinator", address, "--node-id", f"node-{rank}",
                                       "--rank", str(rank), "--world", str(world), *host, *args, *more],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                      env=env(TINYDIST_TRANSPORT="tcp" if separate_hosts else "auto",
                                              TINYDIST_COLLECTIVE_TIMEOUT="30", **(extra_env or {}))))
    return procs


class Output:
    """Collects a process's output lines on a thread, so waits never block on a pipe."""

    def __init__(self, proc: subprocess.Popen) -> None:
        import threading
        self.proc = proc
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, needle: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if needle in line:
                    return line
            if self.proc.poll() is not None and not self.thread.is_alive():
                break
            time.sleep(0.02)
        raise AssertionError(f"no line with {needle!r} within {timeout} s; output:\n{self.text}")

    def finish(self, timeout: float) -> int:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"process did not exit within {timeout} s; output:\n{self.text}") from None
        self.thread.join(5)
        self.proc.stdout.close()
        return self.proc.returncode

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.thread.join(5)
        self.proc.stdout.close()

    @property
    def text(self) -> str:
        return "".join(self.lines)



ETCD = Path("/usr/bin/etcd")      # Debian's etcd-server (deploy/ci/apt-packages.txt)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Etcd:
    """A one-member etcd on loopback: a fresh data dir under `tmp`, free client and peer ports. With
    `pki` (a `tinydist certs init` directory holding `certs etcd`'s certificate and a client one
    named `client`): clients over mutual TLS only (--client-cert-auth), at an https:// URL."""

    def __init__(self, tmp: Path, pki: Path | None = None, client: str = "") -> None:
        self.tmp = tmp
        self.pki = pki
        self.client = client
        self.url = f"{'https' if pki else 'http'}://127.0.0.1:{_free_port()}"
        self.peer_url = f"http://127.0.0.1:{_free_port()}"
        self.start()

    def start(self) -> None:
        """Start (or start again: same ports, same data dir) and wait until it reports healthy."""
        import ssl
        import urllib.request
        self.log = self.tmp / f"etcd-{time.monotonic_ns()}.log"
        self._log_file = self.log.open("w")
        tls: list[str] = []
        context = None
        if self.pki is not None:
            tls = ["--client-cert-auth", "--trusted-ca-file", str(self.pki / "ca.pem"),
                   "--cert-file", str(self.pki / "etcd" / "server.pem"), "--key-file", str(self.pki / "etcd" / "server.key")]
            context = ssl.create_default_context(cafile=str(self.pki / "ca.pem"))
            context.load_cert_chain(str(self.pki / "clients" / f"{self.client}.pem"),
                                    str(self.pki / "clients" / f"{self.client}.key"))
        self.proc = subprocess.Popen([str(ETCD), "--name", "test", "--data-dir", str(self.tmp / "etcd-data"),
                                      "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                                      "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls",
                                      self.peer_url, "--initial-cluster", f"test={self.peer_url}", *tls],
                                     stdout=self._log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1, context=context) as reply:
                    if b'"true"' in reply.read():
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"etcd did not start: {self.log.read_text()}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()
