"""Multi-host Slurm jobs (issue 27, build item 3): a scheduler certificate that names this host
(`tinydist certs init|server --this-host`), a node that dials a scheduler whose certificate does not
name the address dialled gets a SchedulerNameMismatch saying which names it carries and how to
re-issue it (gRPC says only "Hostname Verification Check failed"), each node's rendezvous on its own
address (`environment.node_host`) and ports chosen per job (`environment.job_ports`).

The schedulers here are real `tinydist scheduler serve` processes with real certificates, served on
local addresses other than 127.0.0.1: the one this host's name resolves to, dialled by that name, and
127.0.1.1 (where Debian puts the hostname; the issue's reproduction)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509

from tests.cluster.helpers import ROOT, Coordinator, env
from tinydist.base.errors import BindRefused
from tinydist.dist import environment
from tinydist.scheduler.errors import SchedulerNameMismatch
from tinydist.scheduler.node import Credentials, NodeAgent, status
from tinydist.security import pki

OLD_NAMES = "DNS:localhost, IP:127.0.0.1, IP:::1"     # what `certs init` names without --this-host


def tinydist(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tinydist.cli", *argv], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=env())


def sans(path: Path) -> tuple[list[str], list[str]]:
    san = x509.load_pem_x509_certificate(path.read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    return san.get_values_for_type(x509.DNSName), [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]


def lab(tmp_path: Path, *init_flags: str) -> Path:
    directory = tmp_path / "lab"
    done = tinydist("certs", "init", str(directory), *init_flags)
    assert done.returncode == 0, done.stderr
    pki.issue(directory, "node-0")
    return directory


def credentials(directory: Path) -> Credentials:
    return Credentials.load(directory / "clients/node-0.pem", directory / "clients/node-0.key", directory / "ca.pem")


def this_host_address() -> str:
    return str(socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])


def test_this_host_certificate_names_the_hosts_names_and_addresses(tmp_path):
    directory = lab(tmp_path, "--this-host")
    dns, ips = sans(directory / "server.pem")
    hostname, fqdn = socket.gethostname(), socket.getfqdn()
    resolved = {str(info[4][0]).partition("%")[0] for name in (hostname, fqdn)
                for info in socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)}
    assert {"localhost", hostname.lower(), fqdn.lower()} <= set(dns)
    assert {"127.0.0.1", "::1"} | resolved <= set(ips)
    assert len(dns) == len(set(dns)) and len(ips) == len(set(ips))
    # `certs server --this-host` re-issues the same names with the lab's CA
    assert tinydist("certs", "server", str(directory), "--this-host").returncode == 0
    assert sans(directory / "server.pem") == (dns, ips)


def test_scheduler_dialled_by_this_hosts_name_refused_clearly_with_the_old_cert_accepted_with_the_new(tmp_path):
    """The recipe dials the scheduler at the first node's name: a certificate for localhost alone fails."""
    directory, hostname = lab(tmp_path), socket.gethostname()
    old = Coordinator(tmp_path, "--pki", str(directory), listen=f"{this_host_address()}:0")
    try:
        target = f"{hostname}:{old.address.rpartition(':')[2]}"
        with pytest.raises(SchedulerNameMismatch) as refused:
            NodeAgent(target, "node-0", ["CPU:0"], credentials=credentials(directory)).join(timeout=20)
    finally:
        old.stop()
    message = str(refused.value)
    assert f"the scheduler at {target} presents a certificate for {OLD_NAMES}, not {hostname}" in message, message
    assert "tinydist certs server DIR --this-host" in message and "Hostname Verification" in message, message

    assert tinydist("certs", "server", str(directory), "--this-host").returncode == 0
    new = Coordinator(tmp_path, "--pki", str(directory), listen=f"{this_host_address()}:0")
    try:
        target = f"{hostname}:{new.address.rpartition(':')[2]}"
        with NodeAgent(target, "node-0", ["CPU:0"], credentials=credentials(directory)) as agent:
            assert agent.join(timeout=20) == 0
    finally:
        new.stop()


def test_scheduler_on_127_0_1_1_refused_with_the_names_and_the_fix_then_accepted(tmp_path):
    directory = lab(tmp_path)
    old = Coordinator(tmp_path, "--pki", str(directory), listen="127.0.1.1:0")
    try:
        with pytest.raises(SchedulerNameMismatch, match=rf"presents a certificate for {OLD_NAMES}, not 127\.0\.1\.1.*"
                                                        r"--server-san 127\.0\.1\.1"):
            NodeAgent(old.address, "node-0", ["CPU:0"], credentials=credentials(directory)).join(timeout=20)
        with pytest.raises(SchedulerNameMismatch, match="cluster status: the scheduler at 127.0.1.1"):
            status(old.address, credentials(directory))
        shown = tinydist("cluster", "status", "--coordinator", old.address, "--cert", str(directory / "clients/node-0.pem"),
                         "--key", str(directory / "clients/node-0.key"), "--ca", str(directory / "ca.pem"))
        assert shown.returncode == 1 and "Traceback" not in shown.stderr, shown.stderr
        assert "not 127.0.1.1, the address dialled" in shown.stderr and "--this-host" in shown.stderr, shown.stderr
    finally:
        old.stop()
    assert tinydist("certs", "server", str(directory), "--server-san", "127.0.1.1").returncode == 0
    new = Coordinator(tmp_path, "--pki", str(directory), listen="127.0.1.1:0")
    try:
        with NodeAgent(new.address, "node-0", ["CPU:0"], credentials=credentials(directory)) as agent:
            assert agent.join(timeout=20) == 0
    finally:
        new.stop()


def test_node_rendezvous_bound_and_advertised_on_the_node_host(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYDIST_NODE_HOST", "127.0.1.1")
    c = Coordinator(tmp_path, "--insecure-loopback-only")
    try:
        with NodeAgent(c.address, "node-0", ["CPU:0"]) as agent:
            agent.join(timeout=20)
            member = status(c.address, None).members[0].node
            assert member.address == "127.0.1.1" and member.rendezvous.startswith("127.0.1.1:"), member
    finally:
        c.stop()


def test_node_host_from_the_setting_then_slurm_then_loopback():
    hostname = socket.gethostname()
    resolved = str(socket.getaddrinfo(hostname, 0, type=socket.SOCK_STREAM)[0][4][0])
    assert environment.node_host({}) == "127.0.0.1"
    assert environment.node_host({"SLURMD_NODENAME": hostname}) == resolved
    assert environment.node_host({"SLURMD_NODENAME": hostname, "TINYDIST_NODE_HOST": "127.0.1.1"}) == "127.0.1.1"
    assert environment.node_host({"TINYDIST_NODE_HOST": "[::1]"}) == "::1"
    with pytest.raises(BindRefused, match="wildcard.*TINYDIST_NODE_HOST"):
        environment.node_host({"TINYDIST_NODE_HOST": "0.0.0.0"})


def test_job_ports_per_slurm_job_and_explicit_settings_win():
    assert environment.job_ports({}) == (29400, 29500)
    assert environment.job_ports({"SLURM_JOB_ID": "7"}) == (29414, 29415)
    first, second = environment.job_ports({"SLURM_JOB_ID": "1041"}), environment.job_ports({"SLURM_JOB_ID": "1042"})
    assert not set(first) & set(second), (first, second)           # two jobs on one node: four distinct ports
    assert all(29400 <= p < 30000 for p in (*first, *second))
    assert environment.job_ports({"SLURM_JOB_ID": "7", "TINYDIST_PORT": "31000"}) == (31000, 29415)
    assert environment.job_ports({"SLURM_JOB_ID": "7", "TINYDIST_SCHEDULER_PORT": "31001"}) == (29414, 31001)
    # td.dist's rendezvous and the scheduler address of an srun task use the job's pair
    task = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2",
            "SLURM_STEP_NODELIST": "gpu[01-02]", "SLURMD_NODENAME": "gpu02", "SLURM_LOCALID": "0"}
    found = environment.detect(task)
    assert found is not None and (found.coordinator, found.scheduler) == ("gpu01:29414", "gpu01:29415")


def test_heartbeat_moved_to_a_coordinator_whose_certificate_lacks_the_dialled_name_fails_with_the_mismatch(
        tmp_path, monkeypatch):
    """A list of two coordinators: the first (127.0.0.1, named by the certificate) dies, the heartbeat
    moves to the second (127.0.1.1, not named): that is the name mismatch join reports, at once, not an
    outage that ends in CoordinatorLost once TINYDIST_SCHEDULER_LOST_AFTER passes."""
    import threading
    monkeypatch.setenv("TINYDIST_SCHEDULER_LOST_AFTER", "3")
    directory = lab(tmp_path)
    first = Coordinator(tmp_path, "--pki", str(directory))
    second = Coordinator(tmp_path, "--pki", str(directory), listen="127.0.1.1:0")
    failed = threading.Event()
    try:
        with NodeAgent(f"{first.address},{second.address}", "node-0", ["CPU:0"],
                       credentials=credentials(directory)) as agent:
            assert agent.join(timeout=20) == 0
            agent.on_failure(lambda failure: failed.set())
            first.kill()
            assert failed.wait(30), "the agent never failed"
            failure = agent.failure
    finally:
        first.stop()
        second.stop()
    assert isinstance(failure, SchedulerNameMismatch), repr(failure)
    assert (f"node node-0: the scheduler at {second.address} presents a certificate for {OLD_NAMES}, not 127.0.1.1"
            in str(failure)), failure


def test_rendezvous_moved_to_a_coordinator_whose_certificate_lacks_the_dialled_name_fails_with_the_mismatch(tmp_path):
    """As the heartbeat above: the rendezvous, moving along the list once the first coordinator died,
    reports the second's certificate not naming 127.0.1.1 at once (it retried that as UNAVAILABLE until
    its deadline and ended in a MembershipError blaming the rendezvous)."""
    directory = lab(tmp_path)
    first = Coordinator(tmp_path, "--pki", str(directory))
    second = Coordinator(tmp_path, "--pki", str(directory), listen="127.0.1.1:0")
    try:
        with NodeAgent(f"{first.address},{second.address}", "node-0", ["CPU:0"],
                       credentials=credentials(directory)) as agent:
            assert agent.join(timeout=20) == 0
            first.kill()
            with pytest.raises(SchedulerNameMismatch, match=f"the scheduler at {second.address} presents a "
                                                            f"certificate for .*, not 127.0.1.1"):
                agent.rendezvous(1, 1, timeout=15)
    finally:
        first.stop()
        second.stop()
