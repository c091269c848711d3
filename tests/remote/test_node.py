"""The node daemon's start-up refusals, the CLI, health checking, proto freshness, layering rules."""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tinydist.nodes.daemon import NodeOptions, prepare
from .conftest import uri
from tinydist.security.bind import bind_address

ROOT = Path(__file__).resolve().parents[2]
WILDCARD_V4 = ".".join(["0"] * 4)


def test_refuses_to_start_without_pki_or_policy(tmp_path, lab) -> None:
    with pytest.raises(FileNotFoundError, match="ca.pem, server.pem, server.key"):
        prepare(NodeOptions(listen="127.0.0.1:0", pki=tmp_path))
    with pytest.raises(FileNotFoundError, match="no policy file"):
        prepare(NodeOptions(listen="127.0.0.1:0", pki=lab.root, policy=tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text('trust_domain = "tinydist.lab"\n')
    from tinydist.security.policy import PolicyError, PolicyStore
    with pytest.raises(PolicyError, match=r"\[methods\]"):
        PolicyStore(bad)


def test_wildcard_bind_is_refused_unless_explicit() -> None:
    for listen in (f"{WILDCARD_V4}:7070", "[::]:7070"):
        with pytest.raises(ValueError, match="wildcard"):
            bind_address(listen)
        assert bind_address(listen, allow_wildcard=True)
    assert bind_address("127.0.0.1:0") == "127.0.0.1:0"
    assert bind_address("[::1]:0") == "[::1]:0"
    with pytest.raises(ValueError, match="IP address"):
        bind_address("example.com:7070")
    with pytest.raises(ValueError, match="port 70000 .* out of range"):
        bind_address("127.0.0.1:70000")
    with pytest.raises(ValueError, match="HOST:PORT"):
        bind_address("127.0.0.1")
    with pytest.raises(ValueError, match="loopback"):
        bind_address("10.1.2.3:7071", loopback_only=True)
    with pytest.raises(ValueError, match="wildcard"):
        prepare(NodeOptions(listen=f"{WILDCARD_V4}:7070", pki=Path("/nonexistent")))


def _cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tinydist.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_cli_certs_and_refusals(tmp_path) -> None:
    d = tmp_path / "pki"
    assert _cli("certs", "init", str(d)).returncode == 0
    assert _cli("certs", "init", str(d)).returncode == 2  # will not clobber a CA
    issued = _cli("certs", "issue", str(d), "--name", "alice", "--days", "2")
    assert issued.returncode == 0 and "spiffe://tinydist.lab/user/alice" in issued.stdout
    assert _cli("certs", "issue", str(d), "--name", "../evil").returncode == 2
    assert oct((d / "ca" / "ca.key").stat().st_mode & 0o777) == "0o600" and not (d / "ca.key").exists()
    assert oct((d / "ca").stat().st_mode & 0o777) == "0o700"
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = _cli("node", "serve", "--listen", "127.0.0.1:0", "--pki", str(empty))
    assert refused.returncode == 2 and "refusing to start" in refused.stderr
    wild = _cli("node", "serve", "--listen", f"{WILDCARD_V4}:0", "--pki", str(d))
    assert wild.returncode == 2 and "wildcard" in wild.stderr
    insecure = _cli("node", "serve", "--listen", "127.0.0.1:0", "--pki", str(d), "--insecure-loopback-only",
                    "--insecure-listen", "192.0.2.1:0")
    assert insecure.returncode == 2 and "loopback" in insecure.stderr


@contextlib.contextmanager
def serving_node(lab, tmp_path: Path, *extra: str, env_extra: dict[str, str] | None = None
                 ) -> Iterator[tuple[subprocess.Popen, int]]:
    """`tinydist node serve` in its own process on a free loopback port: (process, port); SIGTERM at exit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TINYDIST_")} | (env_extra or {})
    proc = subprocess.Popen([sys.executable, "-m", "tinydist.cli", "node", "serve", "--listen", "127.0.0.1:0", "--pki",
                             str(lab.root), "--audit", str(tmp_path / "audit.jsonl"), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        line = proc.stdout.readline()
        match = re.search(r"serving 127\.0\.0\.1:(\d+)", line)
        assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
        yield proc, int(match.group(1))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=15)
        finally:
            proc.kill()
            proc.stdout.close()
            proc.stderr.close()


def test_node_process_serves_health_over_mtls(lab, tmp_path) -> None:
    with serving_node(lab, tmp_path) as (proc, port):
        creds = lab.creds["carol"]
        with grpc.secure_channel(f"127.0.0.1:{port}", creds.channel_credentials()) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="tinydist.v1.DeviceService"), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert proc.returncode == 0


def test_generated_code_is_fresh(tmp_path) -> None:
    subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), "--only", "device", "--out", str(tmp_path)], check=True,
                   capture_output=True, timeout=60)
    committed = ROOT / "transports" / "pci_remote" / "_generated"
    names = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    assert names == sorted(p.name for p in committed.iterdir() if p.is_file() and p.suffix in (".py", ".pyi"))
    for name in names:
        assert (tmp_path / name).read_text() == (committed / name).read_text(), f"{name} is stale: run python proto/generate.py"


def _sources() -> list[Path]:
    files = [*ROOT.joinpath("nodes").rglob("*.py"), *ROOT.joinpath("transports", "pci_remote").rglob("*.py"),
             *ROOT.joinpath("tinydist", "runtime", "remote").rglob("*.py"),
             *ROOT.joinpath("tinydist", "security").rglob("*.py"), ROOT / "tinydist" / "cli" / "remote.py",
             ROOT / "proto" / "generate.py"]
    return [f for f in files if "_generated" not in f.parts]


def test_no_wildcard_literal_and_no_assert_in_remote_code() -> None:
    for path in _sources():
        text = path.read_text()
        assert WILDCARD_V4 not in text, path
        tree = ast.parse(text)
        asserts = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert)]
        assert not asserts, f"{path}: assert at lines {asserts} (runtime checks must hold under python -O)"


def test_runtime_never_imports_grpc() -> None:
    code = "import sys, tinydist, tinydist.runtime; assert 'grpc' not in sys.modules, 'grpc imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)
    remote = ROOT / "tinydist" / "runtime" / "remote"  # the remote back end, loaded by name when opened
    for path in ROOT.joinpath("tinydist", "runtime").rglob("*.py"):
        assert remote in path.parents or "grpc" not in path.read_text(), path


def test_node_serves_prometheus_metrics_that_count_rpcs_and_denials(lab, tmp_path) -> None:
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    from tinydist.transports.pci_remote._generated import device_pb2 as pb

    with socket.socket() as probe:  # a free loopback port for the metrics endpoint
        probe.bind(("127.0.0.1", 0))
        metrics_port = probe.getsockname()[1]
    trace = tmp_path / "node.json"
    with serving_node(lab, tmp_path, "--metrics", f"127.0.0.1:{metrics_port}",
                      env_extra={"TINYDIST_TRACE": str(trace)}) as (_, port):
        with grpc.secure_channel(f"127.0.0.1:{port}", lab.creds["mallory"].channel_credentials()) as channel:
            ping = channel.unary_unary("/tinydist.v1.DeviceService/Ping", request_serializer=pb.PingRequest.SerializeToString,
                                       response_deserializer=pb.PingReply.FromString)
            with pytest.raises(grpc.RpcError) as refused:
                ping(pb.PingRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        text = urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for family in text_string_to_metric_families(text) for s in family.samples}
        assert samples[("grpc_server_handled_total", (("grpc_code", "PERMISSION_DENIED"), ("grpc_method", "Ping"),
                         ("grpc_service", "tinydist.v1.DeviceService"), ("grpc_type", "unary")))] >= 1
        info = [labels for (name, labels), v in samples.items() if name == "tinydist_build_info" and v == 1]
        assert [dict(labels)["component"] for labels in info] == ["node"]
        assert samples[("grpc_server_started_total", (("grpc_method", "Ping"), ("grpc_service", "tinydist.v1.DeviceService"),
                         ("grpc_type", "unary")))] >= 1
        assert any(name == "process_resident_memory_bytes" and v > 0 for (name, _), v in samples.items())
        assert sum(v for (name, _), v in samples.items() if name == "tinydist_auth_denials_total") >= 1
    # the node's trace (written when SIGTERM ended it): the refused call as a span on its rpc lane
    spans = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "rpc"]
    assert [(e["name"], e["args"]["status"], e["args"]["identity"]) for e in spans] == \
        [("rpc Ping", "PERMISSION_DENIED", uri("mallory"))]


def test_client_credentials_name_what_is_missing_or_unreadable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tinydist.security.pki import ClientCredentials, PKIError
    monkeypatch.delenv("TINYDIST_KEY", raising=False)
    cert = tmp_path / "c.pem"
    cert.write_bytes(b"cert")
    with pytest.raises(PKIError, match="client key: pass it, or set TINYDIST_KEY"):
        ClientCredentials.load(cert, None, cert)
    with pytest.raises(PKIError, match=f"cannot read the client CA {tmp_path / 'missing.pem'}"):
        ClientCredentials.load(cert, cert, tmp_path / "missing.pem")
    monkeypatch.setenv("TINYDIST_KEY", str(cert))
    assert ClientCredentials.load(cert, None, cert) == ClientCredentials(b"cert", b"cert", b"cert")
