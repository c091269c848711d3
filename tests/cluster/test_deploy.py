"""Deployment recipes: Kubernetes manifests, the Slurm batch script, systemd units (structure only)."""

from __future__ import annotations

import configparser
import json
import re
from pathlib import Path
from typing import Any

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _scalar(text: str) -> Any:
    text = text.strip()
    if text.startswith("[") or text.startswith("{"):
        return json.loads(text)
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    if re.fullmatch(r"-?\d+", text):
        return int(text[1:], 8) if text.startswith("0") and len(text) > 1 else int(text)
    return {"true": True, "false": False, "null": None, "": None}.get(text, text)


def load_yaml(text: str) -> list[Any]:
    """A tiny YAML subset loader (block mappings/sequences, flow lists in JSON style, scalars, comments,
    multiple documents) — PyYAML is not a dependency. Uses PyYAML when it is installed."""
    try:
        import yaml
        return [d for d in yaml.safe_load_all(text) if d is not None]
    except ImportError:
        pass
    docs = []
    for chunk in re.split(r"^---\s*$", text, flags=re.M):
        lines = [(len(s) - len(s.lstrip()), s.strip()) for s in chunk.splitlines()
                 if s.strip() and not s.strip().startswith("#")]
        if lines:
            value, _ = _block(lines, 0, lines[0][0])
            docs.append(value)
    return docs


def _block(lines: list[tuple[int, str]], i: int, indent: int) -> tuple[Any, int]:
    if lines[i][1].startswith("- "):
        out: list[Any] = []
        while i < len(lines) and lines[i][0] == indent and lines[i][1].startswith("- "):
            item = lines[i][1][2:]
            if re.match(r"^[\w.-]+:( |$)", item):      # a mapping inside the sequence
                sub = [(indent + 2, item)]
                j = i + 1
                while j < len(lines) and lines[j][0] > indent:
                    sub.append(lines[j])
                    j += 1
                value, _ = _block(sub, 0, indent + 2)
                out.append(value)
                i = j
            else:
                out.append(_scalar(item))
                i += 1
        return out, i
    mapping: dict[str, Any] = {}
    while i < len(lines) and lines[i][0] == indent:
        key, _, rest = lines[i][1].partition(":")
        if rest.strip():
            mapping[key] = _scalar(rest)
            i += 1
        elif i + 1 < len(lines) and lines[i + 1][0] > indent:
            mapping[key], i = _block(lines, i + 1, lines[i + 1][0])
        elif i + 1 < len(lines) and lines[i + 1][0] == indent and lines[i + 1][1].startswith("- "):
            mapping[key], i = _block(lines, i + 1, indent)
        else:
            mapping[key] = None
            i += 1
    return mapping, i


def test_tiny_yaml_loader():
    docs = load_yaml("a: 1\nb:\n  - x\n  - name: y\n    v: \"2\"\nc: [\"p\", \"q\"]\n---\nd: true\n")
    assert docs == [{"a": 1, "b": ["x", {"name": "y", "v": "2"}], "c": ["p", "q"]}, {"d": True}]


def _kinds() -> dict[str, list[dict[str, Any]]]:
    docs = load_yaml((DEPLOY / "kubernetes" / "tinydist-job.yaml").read_text())
    out: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        assert {"apiVersion", "kind", "metadata", "spec"} <= set(d), d
        out.setdefault(d["kind"], []).append(d)
    return out


def test_kubernetes_indexed_job_headless_service_env_ports_and_secrets():
    kinds = _kinds()
    headless = next(s for s in kinds["Service"] if s["spec"].get("clusterIP") == "None" or s["spec"].get("clusterIP") is None
                    and s["metadata"]["name"] == "train")
    assert headless["spec"]["clusterIP"] in ("None", None)
    ports = {p["name"]: p["port"] for p in headless["spec"]["ports"]}
    assert ports == {"rendezvous": 29400, "scheduler": 29500}
    job = kinds["Job"][0]
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == headless["metadata"]["name"]                  # pods resolve as <job>-<i>.<service>
    assert spec["template"]["metadata"]["labels"] == headless["spec"]["selector"]
    container = pod["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["TINYDIST_WORLD_SIZE"]["value"] == str(spec["completions"])
    assert env["TINYDIST_K8S_SERVICE"]["value"] == headless["metadata"]["name"]
    assert env["TINYDIST_PORT"]["value"] == "29400"
    assert {"TINYDIST_CERT", "TINYDIST_KEY", "TINYDIST_CA"} <= set(env)
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["pki"]["readOnly"] is True and volumes["pki"]["secret"]["secretName"] == "tinydist-node-pki"
    for name in ("TINYDIST_CERT", "TINYDIST_KEY", "TINYDIST_CA"):
        assert env[name]["value"].startswith(mounts["pki"]["mountPath"] + "/")
    assert {p["containerPort"] for p in container["ports"]} == {29400}
    # the scheduler: mTLS from a Secret, binds the pod IP (never the wildcard)
    sched = kinds["Deployment"][0]["spec"]["template"]["spec"]
    command = sched["containers"][0]["command"]
    assert command[:3] == ["tinydist", "scheduler", "serve"] and "--pki" in command
    listen = command[command.index("--listen") + 1]
    assert listen.startswith("$(POD_IP):") and "0.0.0.0" not in listen
    assert sched["volumes"][0]["secret"]["secretName"] == "tinydist-scheduler-pki"
    # JOB_COMPLETION_INDEX + those variables give every pod its rank and the coordinator
    from tinydist.dist.environment import detect
    found = detect({"KUBERNETES_SERVICE_HOST": "x", "JOB_COMPLETION_INDEX": "3", "HOSTNAME": f"{job['metadata']['name']}-3",
                    **{k: v["value"] for k, v in env.items() if "value" in v}})
    assert (found.rank, found.world_size, found.coordinator) == (3, 4, "train-0.train:29400")


def test_slurm_batch_script():
    text = (DEPLOY / "slurm" / "train.sbatch").read_text()
    assert text.startswith("#!/bin/bash")
    assert re.search(r"^#SBATCH --nodes=\d+", text, re.M) and re.search(r"^#SBATCH --ntasks-per-node=1", text, re.M)
    assert "srun" in text and "tinydist scheduler serve" in text and "--pki" in text
    assert "0.0.0.0" not in text and "SLURM_JOB_NODELIST" in text


def test_systemd_units():
    for name, command in (("tinydist-node.service", "node serve"), ("tinydist-scheduler.service", "scheduler serve")):
        unit = configparser.ConfigParser(interpolation=None, strict=True)
        unit.optionxform = str
        unit.read_string((DEPLOY / "systemd" / name).read_text())
        assert {"Unit", "Service", "Install"} <= set(unit.sections())
        start = unit["Service"]["ExecStart"]
        assert start.startswith("/") and command in start and "--pki" in start and "0.0.0.0" not in start
        assert unit["Service"]["Restart"] == "on-failure" and unit["Service"]["User"] != "root"
        assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_ci_package_list_and_its_installer_outside_root():
    """deploy/ci/apt-packages.txt: Debian package names, one per line, each once (`make integration`
    installs the missing ones as root). Not root, the installer installs nothing, says why and
    succeeds, so the integration tests then skip with their own reasons instead of make failing."""
    import os
    import shutil
    import subprocess

    import pytest
    lines = (DEPLOY / "ci" / "apt-packages.txt").read_text().splitlines()
    names = [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]
    assert all(re.fullmatch(r"[a-z0-9][a-z0-9+.-]+", name) for name in names), names
    assert len(set(names)) == len(names) and {"slurm-wlm", "munge"} <= set(names)
    script = ["sh", str(DEPLOY / "ci" / "install-packages.sh")]
    if os.geteuid() == 0:          # drop to nobody: never install anything from `make test`
        if shutil.which("setpriv") is None:
            pytest.skip("root without util-linux's setpriv: cannot run the installer as a non-root user")
        script = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *script]
    done = subprocess.run(script, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    uid = 65534 if os.geteuid() == 0 else os.geteuid()
    assert done.stdout.startswith(f"install-packages: not root (uid {uid}): not installing {' '.join(names)} "), done.stdout
