"""An OCI image builder for tests (tests/cluster/test_image.py): Debian's buildah, as root, with its
own storage in a directory the caller gives (vfs driver and chroot isolation: no overlay mounts, user
namespaces, container runtime or daemon), and a base image made here with debootstrap, since CI
reaches no container registry (Docker Hub does not resolve there) but does reach Debian's mirror.

    with Builder(tmp) as builder:
        base = builder.base()                                   # bookworm + python3, ~80 s
        image = builder.build(dockerfile, context, "tinydist:latest", {"BASE": base})
        builder.run(image, ["tinydist", "--version"])           # a fresh container per call

`unavailable()` says what is missing, for the skip reason. Every command is bounded by a timeout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

# the binary -> the Debian package that provides it (deploy/ci/apt-packages.txt lists the packages)
BINARIES = {"buildah": "buildah", "debootstrap": "debootstrap"}
SUITE = "bookworm"          # python3 is 3.11, as in the Dockerfile's default base python:3.11-slim-bookworm
MIRROR = "http://deb.debian.org/debian"
# This machine's TLS trust: its egress goes through a TLS-inspecting proxy whose CA only the host's
# bundle holds (update-ca-certificates adds /usr/local/share/ca-certificates), so pip inside the build
# trusts the same bundle, as a lab behind such a proxy does in its own base image.
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


def unavailable() -> str | None:
    """Why an image cannot be built here (the skip reason), or None when it can."""
    if os.geteuid() != 0:
        return (f"not root (euid {os.geteuid()}): buildah's vfs storage with chroot isolation and "
                f"debootstrap's base image need root")
    missing = sorted({package for binary, package in BINARIES.items() if shutil.which(binary) is None})
    if missing:
        return (f"image builder buildah (with debootstrap for a base image; no registry is reachable) not "
                f"installed (packages {', '.join(missing)}): `make integration` installs them as root "
                f"(deploy/ci/apt-packages.txt)")
    return None


class Builder:
    def __init__(self, root: Path) -> None:
        reason = unavailable()
        if reason is not None:
            raise RuntimeError(reason)
        self.root = root
        self.containers: list[str] = []

    def __enter__(self) -> Builder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.buildah("rm", "--all", timeout=120)
        shutil.rmtree(self.root, ignore_errors=True)

    def buildah(self, *args: str, timeout: float, check: bool = True, **popen: Any) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(["buildah", "--root", str(self.root / "storage"), "--runroot", str(self.root / "run"),
                               "--storage-driver", "vfs", *args], capture_output=True, text=True, timeout=timeout,
                              **popen)
        if check and done.returncode != 0:
            raise RuntimeError(f"buildah {' '.join(args)} failed ({done.returncode}):\n{done.stdout[-4000:]}\n"
                               f"{done.stderr[-4000:]}")
        return done

    def base(self, name: str = f"localhost/tinydist-base:{SUITE}") -> str:
        """A minimal Debian SUITE with python3 and its venv module, from MIRROR, trusting HOST_CA_BUNDLE."""
        rootfs = self.root / "rootfs"
        done = subprocess.run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv", SUITE,
                               str(rootfs), MIRROR], capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"debootstrap {SUITE} {MIRROR} failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                               f"{done.stderr[-3000:]}")
        shutil.copyfile(HOST_CA_BUNDLE, rootfs / "etc/ssl/certs/ca-certificates.crt")
        # pip ignores the system store (it carries certifi's) unless told
        (rootfs / "etc/pip.conf").write_text("[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n")
        container = self.buildah("from", "scratch", timeout=60).stdout.strip()
        mount = self.buildah("mount", container, timeout=60).stdout.strip()
        subprocess.run(["cp", "-a", f"{rootfs}/.", mount], check=True, timeout=300)
        self.buildah("umount", container, timeout=60)
        self.buildah("commit", "--quiet", container, name, timeout=300)
        self.buildah("rm", container, timeout=60)
        shutil.rmtree(rootfs)
        return name

    def build(self, dockerfile: Path, context: Path, tag: str, build_args: dict[str, str]) -> str:
        args = [arg for name, value in build_args.items() for arg in ("--build-arg", f"{name}={value}")]
        self.buildah("bud", "--isolation", "chroot", *args, "-f", str(dockerfile), "-t", tag, str(context), timeout=1200)
        return tag

    def run_argv(self, image: str, argv: list[str], volumes: dict[Path, str] | None = None) -> list[str]:
        """The command line that runs `argv` in a fresh container of `image` (host network; each
        volume read-only); for a server the caller runs in the background."""
        container = self.buildah("from", "--quiet", image, timeout=300).stdout.strip()
        self.containers.append(container)
        mounts = [arg for src, dst in (volumes or {}).items() for arg in ("-v", f"{src}:{dst}:ro")]
        return ["buildah", "--root", str(self.root / "storage"), "--runroot", str(self.root / "run"),
                "--storage-driver", "vfs", "run", "--isolation", "chroot", *mounts, container, "--", *argv]

    def run(self, image: str, argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.run_argv(image, argv), capture_output=True, text=True, timeout=timeout)
