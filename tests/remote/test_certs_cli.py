"""The lab's command line (issue 22, item 8): `tinydist certs init --server-san`, `certs server`,
`certs enrol / revoke / list`, and `tinydist node status` against a `tinydist node serve` process —
each user error one line, no traceback. Real certificates; the node on loopback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from cryptography import x509

from tests.remote.test_node import serving_node
from tinydist.security import pki

ROOT = Path(__file__).resolve().parents[2]


def tinydist(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("TINYDIST_")} | (env or {})
    return subprocess.run([sys.executable, "-m", "tinydist.cli", *argv], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=full)


def one_line_error(result: subprocess.CompletedProcess[str], code: int, *named: str) -> str:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith(("E1202", "I1202", "W1202"))
             and "ssl_transport_security" not in line and "handshake" not in line.lower()[:40]]
    last = lines[-1]
    for text in named:
        assert text in last, (text, last)
    return last


def sans(path: Path) -> list[str]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return sorted([f"DNS:{d}" for d in names.get_values_for_type(x509.DNSName)] +
                  [f"IP:{i}" for i in names.get_values_for_type(x509.IPAddress)])


def test_init_and_server_put_the_server_sans_in_the_certificate(tmp_path) -> None:
    lab = tmp_path / "lab"
    done = tinydist("certs", "init", str(lab), "--server-san", "192.168.1.20,node1.lab", "--server-san", "fd00::7")
    assert done.returncode == 0, done.stderr
    assert sans(lab / "server.pem") == sorted(["DNS:localhost", "DNS:node1.lab", "IP:127.0.0.1", "IP:::1",
                                               "IP:192.168.1.20", "IP:fd00::7"])
    done = tinydist("certs", "server", str(lab), "--server-san", "10.0.0.9")
    assert done.returncode == 0 and "restart the node" in done.stdout, done.stderr
    assert sans(lab / "server.pem") == ["DNS:localhost", "IP:10.0.0.9", "IP:127.0.0.1", "IP:::1"]
    one_line_error(tinydist("certs", "server", str(lab), "--server-san", "bad name!"), 2, "'bad name!'", "IP address")
    one_line_error(tinydist("certs", "server", str(tmp_path / "none")), 1, "tinydist certs init")


def test_enrol_revoke_and_list(tmp_path) -> None:
    lab = tmp_path / "lab"
    assert tinydist("certs", "init", str(lab)).returncode == 0
    for name in ("alice", "bob"):
        assert tinydist("certs", "issue", str(lab), "--name", name).returncode == 0
    done = tinydist("certs", "enrol", str(lab), "--name", "alice", "--role", "admin")
    assert done.returncode == 0 and "spiffe://tinydist.lab/user/alice: admin" in done.stdout, done.stdout + done.stderr
    assert tinydist("certs", "enrol", str(lab), "--name", "bob").returncode == 0
    done = tinydist("certs", "enrol", str(lab), "--name", "bob", "--role", "viewer")
    assert "operator -> viewer" in done.stdout, done.stdout
    policy = tomllib.loads((lab / "policy.toml").read_text())
    assert policy["identities"] == {"spiffe://tinydist.lab/user/alice": "admin", "spiffe://tinydist.lab/user/bob": "viewer"}
    assert "# tinydist node policy" in (lab / "policy.toml").read_text()   # the file's comments stay
    assert (lab / "policy.toml").stat().st_mode & 0o022 == 0
    done = tinydist("certs", "revoke", str(lab), "--name", "bob")
    assert done.returncode == 0 and "revoked" in done.stdout, done.stderr
    bob_fp = pki.fingerprint((lab / "clients" / "bob.pem").read_bytes())
    assert bob_fp in (lab / "revoked.txt").read_text()
    assert "already revoked" in tinydist("certs", "revoke", str(lab), "--cert", str(lab / "clients" / "bob.pem")).stdout
    listed = json.loads(tinydist("certs", "list", str(lab), "--json").stdout)
    by_name = {row["name"]: row for row in listed}
    assert by_name["alice"]["role"] == "admin" and by_name["alice"]["revoked"] is False
    assert by_name["bob"]["revoked"] is True and by_name["bob"]["fingerprint"] == bob_fp
    table = tinydist("certs", "list", str(lab)).stdout.splitlines()
    assert table[0].split() == ["NAME", "ROLE", "STATE", "EXPIRES", "IDENTITY"]
    assert any(line.split()[:3] == ["bob", "viewer", "revoked"] for line in table), table
    one_line_error(tinydist("certs", "enrol", str(lab), "--name", "Bad Name"), 2, "--name 'Bad Name'")
    one_line_error(tinydist("certs", "enrol", str(tmp_path / "nolab"), "--name", "x"), 1, "no policy file", "certs init")
    one_line_error(tinydist("certs", "revoke", str(lab), "--fingerprint", "abc"), 2, "'abc'", "64 hex digits")
    os.chmod(lab / "policy.toml", 0o666)
    one_line_error(tinydist("certs", "enrol", str(lab), "--name", "alice"), 1, "writable by", "chmod go-w")


def test_node_status_explains_itself(tmp_path) -> None:
    lab = tmp_path / "lab"
    assert tinydist("certs", "init", str(lab)).returncode == 0
    for name in ("alice", "eve"):
        assert tinydist("certs", "issue", str(lab), "--name", name).returncode == 0
    assert tinydist("certs", "enrol", str(lab), "--name", "alice", "--role", "operator").returncode == 0
    node_pki = tmp_path / "node"
    node_pki.mkdir(mode=0o700)
    for name in ("ca.pem", "server.pem", "server.key", "policy.toml", "revoked.txt"):
        shutil.copy2(lab / name, node_pki / name)
    clients = lab / "clients"

    def creds(name: str, key: str | None = None) -> list[str]:
        return ["--cert", str(clients / f"{name}.pem"), "--key", str(clients / f"{key or name}.key"), "--ca", str(lab / "ca.pem")]

    view = type("LabView", (), {"root": node_pki})()
    with serving_node(view, tmp_path) as (proc, port):
        target = f"127.0.0.1:{port}"
        done = tinydist("node", "status", target, *creds("alice"), "--json")
        assert done.returncode == 0, done.stderr
        status = json.loads(done.stdout)
        assert status["identity"] == "spiffe://tinydist.lab/user/alice" and status["role"] == "operator"
        assert status["devices"] == ["CPU:0"] and status["target"] == target
        assert "alice (operator)" in tinydist("node", "status", target, *creds("alice")).stdout
        denied = one_line_error(tinydist("node", "status", target, *creds("eve")), 1, "identity not enrolled",
                                '"spiffe://tinydist.lab/user/eve" = "viewer"', "[identities]")
        assert "AccessDenied" not in denied and "Traceback" not in denied
        one_line_error(tinydist("node", "status", target, *creds("alice", key="eve")), 1,
                       f"the key {clients / 'eve.key'} does not belong to the certificate {clients / 'alice.pem'}")
        one_line_error(tinydist("node", "status", target, "--cert", str(clients / "alice.pem")), 1,
                       "needs a client key", "TINYDIST_KEY")
    one_line_error(tinydist("node", "status", target, *creds("alice")), 1, f"nothing listens at {target}")
