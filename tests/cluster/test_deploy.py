"""Deployment recipes: the Kubernetes manifests (against the Kubernetes API schemas, offline, and their
structure), the container image they name, the Slurm batch script, systemd units (structure)."""

from __future__ import annotations

import configparser
import copy
import re
from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
DOCKERFILE = DEPLOY / "container" / "Dockerfile"
# the oldest and the newest Kubernetes whose API schemas kubernetes-validate bundles (the test extra)
KUBERNETES_VERSIONS = ("1.25", "1.37")


def load_yaml(text: str) -> list[Any]:
    return [d for d in yaml.safe_load_all(text) if d is not None]


def _schema_errors(doc: dict[str, Any]) -> list[str]:
    """What the Kubernetes API schemas of each of KUBERNETES_VERSIONS refuse in one resource, strictly
    (an unknown field is an error, as `kubectl apply --validate=strict` makes it); [] when it passes."""
    import kubernetes_validate
    errors = []
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')} (Kubernetes {version}): "
                          f"{'.'.join(map(str, e.path))}: {e.message}")
    return errors


def test_every_manifest_passes_the_kubernetes_api_schemas():
    assert MANIFESTS, "no manifests under deploy/kubernetes/"
    for path in MANIFESTS:
        docs = load_yaml(path.read_text())
        assert docs, path
        for doc in docs:
            errors = _schema_errors(doc)
            assert not errors, f"{path}: {errors}"


def test_schema_validation_refuses_a_broken_manifest():
    """The check above can fail: the Job with a misspelt field, and with a string where a count goes."""
    job = next(d for d in load_yaml((DEPLOY / "kubernetes" / "tinydist-job.yaml").read_text()) if d["kind"] == "Job")
    misspelt = copy.deepcopy(job)
    misspelt["spec"]["template"]["spec"]["restartPolcy"] = misspelt["spec"]["template"]["spec"].pop("restartPolicy")
    errors = _schema_errors(misspelt)
    assert len(errors) == len(KUBERNETES_VERSIONS) and all("'restartPolcy' was unexpected" in e for e in errors), errors
    wrong_type = copy.deepcopy(job)
    wrong_type["spec"]["completions"] = "four"
    errors = _schema_errors(wrong_type)
    assert len(errors) == len(KUBERNETES_VERSIONS) and all(e.startswith("Job/train") and "spec.completions: 'four'" in e
                                                           for e in errors), errors


def _containers() -> list[dict[str, Any]]:
    return [c for path in MANIFESTS for d in load_yaml(path.read_text()) if d["kind"] in ("Deployment", "Job")
            for c in d["spec"]["template"]["spec"]["containers"]]


def test_manifests_run_the_image_the_dockerfile_builds():
    """One image, `tinydist:latest`, in every manifest, in the build command the Dockerfile and
    deploy/README.md give, and the commands the manifests run are what the Dockerfile installs:
    `tinydist` (the package's script, on PATH from the image's venv) and /app/train.py (tests/cluster/
    test_image.py runs both inside the built image)."""
    images = {(c["image"], c["imagePullPolicy"]) for c in _containers()}
    assert images == {("tinydist:latest", "IfNotPresent")}, images       # a loaded image is used, not pulled
    build = "docker build -f deploy/container/Dockerfile -t tinydist:latest ."
    assert build in DOCKERFILE.read_text() and build in (DEPLOY / "README.md").read_text()
    dockerfile = DOCKERFILE.read_text()
    assert "PATH=/opt/tinydist/bin:$PATH" in dockerfile and re.search(r"^COPY examples/train_digits.py /app/train.py$",
                                                                     dockerfile, re.M)
    for container in _containers():
        command = container["command"]
        assert command[0] in ("tinydist", "python"), command
        if command[0] == "python":
            assert command[1] == "/app/train.py", command


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
