"""`make soak`: a long run of mixed work in one process, its resources sampled, flat after warm-up.

For `--minutes` (default 30) the loop takes turns at:

    train      an eager training step of the digits MLP (forward, cross_entropy, backward, Adam)
    replay     a captured 64-64-10 MLP replayed through `step(td.Tensor(frame)).numpy()` and
               `call_numpy`, a new random frame each time, checked against numpy
    shapes     a small elementwise graph at one of 64 rotating shapes (kernels met again and again)
    allreduce  a tensor sharded over two CPU devices of this process, reduced over the sharded axis
    remote     a graph on a node daemon in its own process (`tinydist node serve`, mutual TLS on
               loopback, certificates made by `tinydist certs`), read back and checked

and samples, every `--interval` seconds, the process's RSS, open file descriptors, threads and
memory mappings (from /proc). After the warm-up (the first fifth of the run) each resource must be
flat: its largest sample in the last third at most its largest in the first third of the
measured window plus a margin (RSS 5 % or 16 MiB, whichever is more; fds, threads and mappings
2 % or 8). A miss names the resource and its samples; the exit status is 1.

    .venv/bin/python bench/soak.py [--minutes 30] [--interval 10] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import tinydist as td
from tinydist.runtime.engine import get_engine
from tinydist.testing import process_resources
from tinydist.train.nn import functional as F

TRUST_DOMAIN = "tinydist.lab"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Node:
    """A node daemon in its own process, with a lab PKI and one enrolled operator made for it."""

    def __init__(self, root: Path) -> None:
        cli = [sys.executable, "-m", "tinydist.cli"]
        lab = root / "lab"
        subprocess.run([*cli, "certs", "init", str(lab)], check=True, capture_output=True)
        subprocess.run([*cli, "certs", "issue", str(lab), "--name", "soak"], check=True, capture_output=True)
        policy = lab / "policy.toml"
        text = policy.read_text().replace("[identities]\n", f'[identities]\n"spiffe://{TRUST_DOMAIN}/user/soak" = "operator"\n', 1)
        policy.write_text(text)
        self.port = free_port()
        self.log = root / "node.log"  # a file, not a pipe: a pipe nobody drains stops the daemon when it fills
        with self.log.open("wb") as log:
            self.process = subprocess.Popen([*cli, "node", "serve", "--listen", f"127.0.0.1:{self.port}", "--pki", str(lab)],
                                            stdout=log, stderr=subprocess.STDOUT)
        os.environ.update(TINYDIST_CERT=str(lab / "clients" / "soak.pem"), TINYDIST_KEY=str(lab / "clients" / "soak.key"),
                          TINYDIST_CA=str(lab / "ca.pem"))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the node daemon exited ({self.process.returncode}): {self.log.read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.2)
        else:
            raise RuntimeError("the node daemon did not listen within 30 s")
        self.device = f"remote://127.0.0.1:{self.port}/CPU:0"

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def workload(rng: np.random.Generator, remote: str | None) -> dict[str, Any]:
    """One closure per kind of work, each checking its own result."""
    td.manual_seed(0)
    model = td.nn.Sequential(td.nn.Linear(64, 128), td.nn.ReLU(), td.nn.Linear(128, 10))
    optimizer = td.optim.Adam(model.parameters(), lr=1e-3)
    x = td.Tensor(rng.random((256, 64), dtype=np.float32))
    labels = td.Tensor(rng.integers(0, 10, 256).astype(np.int64))

    def train() -> None:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), labels)
        loss.backward()
        optimizer.step()
        if not np.isfinite(loss.numpy()):
            raise AssertionError("the training loss is not finite")

    w1_h, w2_h = rng.standard_normal((64, 64)).astype(np.float32) / 8, rng.standard_normal((64, 10)).astype(np.float32) / 8
    w1, w2 = td.Tensor(w1_h), td.Tensor(w2_h)

    @td.jit
    def step(frame: td.Tensor) -> td.Tensor:
        return (frame @ w1).relu() @ w2

    def replay() -> None:
        for _ in range(20):
            frame = rng.standard_normal((1, 64)).astype(np.float32)
            expected = np.maximum(frame @ w1_h, 0) @ w2_h
            np.testing.assert_allclose(step(td.Tensor(frame)).numpy(), expected, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(step.call_numpy(frame), expected, rtol=1e-4, atol=1e-5)

    turn = [0]

    def shapes() -> None:
        n = 16 + turn[0] % 64
        turn[0] += 1
        a = rng.standard_normal((n, 33)).astype(np.float32)
        np.testing.assert_allclose((td.Tensor(a).exp() * 0.5 + 1).sum(axis=1).numpy(), (np.exp(a) * 0.5 + 1).sum(1), rtol=1e-4)

    devices = ["CPU:1", "CPU:2"]

    def allreduce() -> None:
        a = rng.standard_normal((2 * 64, 256)).astype(np.float32)
        got = td.Tensor(a).shard(devices, axis=0).sum(axis=0).numpy()
        np.testing.assert_allclose(got, a.sum(0), rtol=1e-4, atol=1e-4)

    work: dict[str, Any] = {"train": train, "replay": replay, "shapes": shapes, "allreduce": allreduce}
    if remote is not None:
        def remote_work() -> None:
            a = rng.standard_normal(4096).astype(np.float32)
            got = (td.Tensor(a, device=remote) * 2 + 1).sum().numpy()
            np.testing.assert_allclose(got, (a * 2 + 1).sum(), rtol=1e-4)
        work["remote"] = remote_work
    return work


def judge(samples: list[dict[str, float]]) -> list[str]:
    """The resources that grew after warm-up (module docstring), each with its samples."""
    measured = samples[len(samples) // 5:]
    third = max(1, len(measured) // 3)
    first, last = measured[:third], measured[-third:]
    misses = []
    for key in ("rss_mib", "fds", "threads", "mappings"):
        early, late = max(s[key] for s in first), max(s[key] for s in last)
        margin = max(0.05 * early, 16.0) if key == "rss_mib" else max(0.02 * early, 8.0)
        if late > early + margin:
            misses.append(f"{key} grew from {early:g} to {late:g} (margin {margin:g}): {[s[key] for s in measured]}")
    return misses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--interval", type=float, default=10.0)
    parser.add_argument("--no-remote", action="store_true", help="leave out the node daemon")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="tinydist-soak-") as root:
        node = None if args.no_remote else Node(Path(root))
        try:
            work = workload(rng, node.device if node else None)
            counts = dict.fromkeys(work, 0)
            samples: list[dict[str, float]] = []
            start = time.monotonic()
            end, next_sample = start + args.minutes * 60, start
            while time.monotonic() < end:
                for name, fn in work.items():
                    fn()
                    counts[name] += 1
                now = time.monotonic()
                if now >= next_sample:
                    samples.append({"t_s": round(now - start, 1), **process_resources()})
                    next_sample = now + args.interval
                    print(json.dumps(samples[-1]), flush=True)
        finally:
            get_engine().close()  # the remote device closes its lease while the daemon is still there
            if node is not None:
                node.close()
    misses = judge(samples)
    print(f"soak: {args.minutes:g} min, {len(samples)} samples, rounds {counts}")
    for miss in misses:
        print(f"soak: MISS {miss}")
    print("soak: flat after warm-up: " + ("MISS" if misses else "PASS"))
    if args.json:
        args.json.write_text(json.dumps({"samples": samples, "counts": counts, "misses": misses}, indent=1))
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
