"""The container image the Kubernetes manifests run: deploy/container/Dockerfile built with buildah
(tests/cluster/image.py: over a bookworm base made by debootstrap, as no registry is reachable in CI),
then each manifest's command run inside it as the manifest gives it: the Deployment's `tinydist
scheduler serve` with a directory holding the scheduler Secret's files, answering `tinydist cluster
status` from the host over mTLS; the Job's `python /app/train.py`, alone and as a 2-rank `tinydist
launch` group (one group, from its own report). Building takes about 3 minutes here (debootstrap
~80 s, the pip install ~90 s on a shared 2-core machine); the image and base live in one
module-scoped temporary buildah storage, removed at the end.

Marked `integration`: `make integration` runs it (as root; elsewhere it skips with the reason).
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import image
from tests.cluster.helpers import ROOT, env
from tests.cluster.test_deploy import DOCKERFILE, MANIFESTS, load_yaml


def _pods() -> dict[str, dict[str, Any]]:
    """kind -> the pod template's first container, over every manifest."""
    return {d["kind"]: d["spec"]["template"]["spec"]["containers"][0]
            for path in MANIFESTS for d in load_yaml(path.read_text()) if d["kind"] in ("Deployment", "Job")}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[image.Builder, str]]:
    reason = image.unavailable()
    if reason is not None:
        pytest.skip(reason)
    tags = {c["image"] for c in _pods().values()}
    assert len(tags) == 1, tags                              # one image for every manifest: build that name
    with image.Builder(tmp_path_factory.mktemp("image")) as builder:
        base = builder.base()
        yield builder, builder.build(DOCKERFILE, ROOT, tags.pop(), {"BASE": base})


@pytest.mark.integration
@pytest.mark.timeout(1800)      # includes the module's build (~3 min here); pyproject's 120 s is per unit test
def test_the_deployments_scheduler_command_serves_mtls_in_the_image(built, tmp_path):
    builder, tag = built
    command = list(_pods()["Deployment"]["command"])
    assert command[:3] == ["tinydist", "scheduler", "serve"], command
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    listen = command.index("--listen") + 1                   # $(POD_IP):29500 -> loopback, a free port (host network)
    command[listen] = f"127.0.0.1:{port}"
    from tinydist.security import pki
    lab, secret = tmp_path / "lab", tmp_path / "secret"
    pki.init(lab)
    pki.issue(lab, "ops")
    secret.mkdir()
    for name in ("ca.pem", "server.pem", "server.key", "policy.toml"):   # the Secret's files, at its defaultMode
        shutil.copyfile(lab / name, secret / name)
        (secret / name).chmod(0o400)
    mount = command[command.index("--pki") + 1]
    log = (tmp_path / "scheduler.log").open("w")
    server = subprocess.Popen(builder.run_argv(tag, command, volumes={secret: mount}), stdout=log,
                              stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            status = subprocess.run([sys.executable, "-m", "tinydist.cli", "cluster", "status", "--coordinator",
                                     f"127.0.0.1:{port}", "--cert", str(lab / "clients" / "ops.pem"), "--key",
                                     str(lab / "clients" / "ops.key"), "--ca", str(lab / "ca.pem"), "--json",
                                     "--timeout", "2"], capture_output=True, text=True, timeout=60, env=env(), cwd=ROOT)
            if status.returncode == 0 or server.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert status.returncode == 0, status.stdout + status.stderr + (tmp_path / "scheduler.log").read_text()
        assert json.loads(status.stdout)["members"] == []
        assert "(mTLS" in (tmp_path / "scheduler.log").read_text()
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


@pytest.mark.integration
@pytest.mark.timeout(1800)
def test_the_jobs_training_command_runs_in_the_image_alone_and_as_one_two_rank_group(built):
    builder, tag = built
    command = _pods()["Job"]["command"]
    assert command == ["python", "/app/train.py"], command
    alone = builder.run(tag, [*command, "--epochs", "2", "--target", "0.8"])
    assert alone.returncode == 0, alone.stdout + alone.stderr
    assert "1 device(s) in one process" in alone.stdout and "final test accuracy" in alone.stdout, alone.stdout
    group = builder.run(tag, ["tinydist", "launch", "--nproc", "2", command[1], "--epochs", "1", "--target", "0"])
    assert group.returncode == 0, group.stdout + group.stderr
    joined = sorted(re.findall(r"^\[rank \d\] rank (\d) of 2 in one group \(launched by tinydist, rendezvous (\S+)\)$",
                               group.stdout, re.M))
    assert [r for r, _ in joined] == ["0", "1"] and joined[0][1] == joined[1][1], group.stdout
    version = builder.run(tag, ["tinydist", "--version"])
    assert version.returncode == 0 and version.stdout.startswith("tinydist 0.1.0"), version.stdout + version.stderr


def test_not_root_is_a_skip_reason_not_a_failure(monkeypatch):
    """In `make test` (no marker): where the integration run is not root it must skip saying so."""
    monkeypatch.setattr(image.os, "geteuid", lambda: 1000)
    assert image.unavailable() == ("not root (euid 1000): buildah's vfs storage with chroot isolation and "
                                   "debootstrap's base image need root")
    with pytest.raises(RuntimeError, match="not root"):
        image.Builder(Path("/nonexistent"))
