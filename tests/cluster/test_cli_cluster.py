"""`tinydist node join` and `tinydist cluster status` as a user runs them: a real `tinydist scheduler
serve` process on loopback, nodes joined with the CLI alone (no Python), the status read back as
text and as JSON (checked against protobuf's own JSON mapping, which nobody here wrote), errors on
stderr with the documented exit codes, and a clean leave on SIGTERM."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.json_format import MessageToDict

from tests.cluster.helpers import ROOT, Coordinator, Output, env
from tinydist.scheduler.node import status

LONG_HOST = "rack-17.row-c.datacenter-west.example.internal"    # wider than any fixed column


def _tinydist(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tinydist.cli", *args], capture_output=True, text=True, env=env(),
                          cwd=ROOT, timeout=timeout)


def _join(address: str, node_id: str, world: int, *more: str) -> Output:
    proc = subprocess.Popen([sys.executable, "-m", "tinydist.cli", "node", "join", "--insecure", "--coordinator", address,
                             "--node-id", node_id, "--world-size", str(world), *more],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env=env(TINYDIST_TRANSPORT="tcp", TINYDIST_COLLECTIVE_TIMEOUT="30"))
    return Output(proc)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A scheduler and two nodes joined by `tinydist node join` (node-0 with two devices and --json)."""
    tmp = tmp_path_factory.mktemp("cli-cluster")
    coordinator = Coordinator(tmp, "--insecure-loopback-only", interval=0.2, misses=25)
    nodes = [_join(coordinator.address, "node-0", 2, "--devices", "CPU:0,CPU:1", "--rank", "0", "--json"),
             _join(coordinator.address, "node-1", 2, "--rank", "1", "--host-key", LONG_HOST)]
    try:
        joined = [json.loads(nodes[0].wait_for('"node_id"', 90)), nodes[1].wait_for("joined", 90)]
        yield coordinator, nodes, joined
    finally:
        for node in nodes:
            node.close()
        coordinator.stop()


def _same(ours: Any, reference: Any, path: str) -> None:
    """`ours` holds what protobuf's JSON holds, key for key, with 64-bit integers as numbers, not strings."""
    if isinstance(reference, dict):
        assert isinstance(ours, dict) and set(ours) == set(reference), f"{path}: {sorted(ours)} != {sorted(reference)}"
        for key in reference:
            assert re.fullmatch(r"[a-z0-9_]+", key), f"key {path}.{key} is not snake_case"
            _same(ours[key], reference[key], f"{path}.{key}")
    elif isinstance(reference, list):
        assert isinstance(ours, list) and len(ours) == len(reference), path
        for i, (a, b) in enumerate(zip(ours, reference)):
            _same(a, b, f"{path}[{i}]")
    elif path.endswith("last_seen_age_s"):                               # read at another moment
        assert isinstance(ours, float), path
    elif isinstance(reference, str) and not isinstance(ours, str):        # a 64-bit integer: a number here
        assert type(ours) is int and ours == int(reference), f"{path} = {ours!r}, not {reference!r}"
    else:
        assert ours == reference and type(ours) is type(reference), f"{path} = {ours!r}, not {reference!r}"


def test_node_join_prints_what_it_joined(cluster) -> None:
    _, _, (first, second) = cluster
    assert first["node_id"] == "node-0" and first["rank"] == 0 and first["world_size"] == 2
    assert isinstance(first["epoch"], int) and first["devices"] == ["CPU:0", "CPU:1"]
    assert first["members"] == ["node-0", "node-1"] and first["links_measured"] is True
    assert re.search(r"node-1: joined \S+ as rank 1 of 2 \(epoch \d+", second), second


def test_status_json_is_complete_typed_and_snake_case(cluster) -> None:
    coordinator, _, _ = cluster
    result = _tinydist("cluster", "status", "--insecure", "--coordinator", coordinator.address, "--json")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    data = json.loads(result.stdout)
    # protobuf's mapping with every field and proto names is the reference; it writes 64-bit ints as strings
    reference = MessageToDict(status(coordinator.address, None), preserving_proto_field_name=True,
                              always_print_fields_with_no_presence=True)
    _same(data, reference, "")
    assert isinstance(data["epoch"], int) and data["epoch"] >= 2
    assert isinstance(data["miss_limit"], int) and data["miss_limit"] == 25
    assert isinstance(data["heartbeat_interval_s"], float) and data["heartbeat_interval_s"] == 0.2
    members = {m["node"]["node_id"]: m for m in data["members"]}
    assert members["node-0"]["node"]["rank"] == 0 and members["node-1"]["node"]["rank"] == 1   # rank 0 present
    assert members["node-0"]["reason"] == "" and members["node-0"]["state"] == "alive"
    assert all(isinstance(m["node"]["pid"], int) and m["node"]["pid"] > 0 for m in data["members"])
    assert [d["name"] for d in members["node-0"]["node"]["devices"]] == ["CPU:0", "CPU:1"]
    assert all(isinstance(d["memory_bytes"], int) for m in data["members"] for d in m["node"]["devices"])
    assert {(link["src"], link["dst"]) for link in data["links"]} >= {("node-0", "node-1")}   # measured at join
    assert all(isinstance(link["bandwidth_bps"], float) and link["bandwidth_bps"] > 0 for link in data["links"])


def test_status_json_plan_why_agrees_with_its_numbers(cluster) -> None:
    coordinator, _, _ = cluster
    result = _tinydist("cluster", "status", "--insecure", "--coordinator", coordinator.address, "--json",
                       "--plan-bytes", "1048576")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)["plan"]
    assert plan["nbytes"] == 1048576 and plan["strategy"] == "hierarchical" and len(plan["stages"]) == 3
    assert plan["modelled_s"] == pytest.approx(sum(s["modelled_s"] for s in plan["stages"]))
    winner = f"hierarchical/{plan['inter_algorithm']}"
    assert plan["reason"].startswith(winner)
    executable = {k: v for k, v in plan["candidates"].items() if k != "flat-ring"}
    assert executable[winner] == min(executable.values())
    assert ("flat-ring would be cheaper" in plan["reason"]) == (plan["candidates"]["flat-ring"] < executable[winner])


def test_status_text_does_not_cut_the_host(cluster) -> None:
    coordinator, _, _ = cluster
    result = _tinydist("cluster", "status", "--insecure", "--coordinator", coordinator.address, "--plan-bytes", "4096")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    row = next(line for line in result.stdout.splitlines() if "node-1" in line and "alive" in line)
    assert LONG_HOST in row and "CPU:0" in row
    assert "2 alive of 2 nodes" in result.stdout and "why: hierarchical/" in result.stdout


def test_status_json_into_head_has_no_traceback(cluster) -> None:
    coordinator, _, _ = cluster
    cli = f"{sys.executable} -m tinydist.cli cluster status --insecure --coordinator {coordinator.address} --json"
    result = subprocess.run(["bash", "-c", f"set -o pipefail; {cli} | head -c 10"], capture_output=True, text=True,
                            env=env(), cwd=ROOT, timeout=60)
    assert result.stdout == '{\n  "epoch'
    assert result.stderr == "" and result.returncode in (0, 128 + signal.SIGPIPE), result.stderr


def test_status_of_no_scheduler_is_one_line_on_stderr(tmp_path: Path) -> None:
    import socket
    with socket.socket() as s:        # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
        result = _tinydist("cluster", "status", "--insecure", "--coordinator", address, "--json", "--timeout", "2")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith(f"tinydist cluster status: error: {address}: ") and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args,code,needle", [
    (["--world-size", "0"], 2, "--world-size: must be at least 1, got 0"),
    (["--world-size", "2", "--devices", ","], 2, "--devices: expected a comma-separated list"),
    (["--world-size", "2", "--coordinator", "10.1.2.3:29500"], 1, "refusing an insecure channel to 10.1.2.3:29500"),
    (["--world-size", "2", "--coordinator", "nohost"], 2, "--coordinator: expected HOST:PORT, got 'nohost'"),
    (["--world-size", "2", "--coordinator", "127.0.0.1:99999"], 2, "expected a port number 0-65535, got '99999'"),
])
def test_node_join_user_errors(args: list[str], code: int, needle: str) -> None:
    result = _tinydist("node", "join", "--insecure", "--node-id", "node-9", *args)
    assert result.returncode == code and result.stdout == "", result.stdout + result.stderr
    assert needle in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.startswith("tinydist node join: error: ") or result.stderr.startswith("usage:")


def test_a_refused_join_names_the_rank(cluster) -> None:
    """A rank a live node holds is refused by the coordinator: exit 1, its answer on stderr."""
    coordinator, _, _ = cluster
    result = _tinydist("node", "join", "--insecure", "--coordinator", coordinator.address, "--node-id", "node-9",
                       "--world-size", "2", "--rank", "0")
    assert result.returncode == 1 and result.stdout == "", result.stdout + result.stderr
    assert result.stderr.startswith("tinydist node join: error: node node-9: join at ") and "Traceback" not in result.stderr
    assert "rank 0" in result.stderr, result.stderr


def test_sigterm_leaves_cleanly(tmp_path: Path) -> None:
    coordinator = Coordinator(tmp_path, "--insecure-loopback-only", interval=0.2, misses=25)
    node = _join(coordinator.address, "solo", 1, "--no-probe")
    try:
        node.wait_for("joined", 90)
        node.proc.send_signal(signal.SIGTERM)
        assert node.finish(30) == 0, node.text
        states = {m.node.node_id: m.state for m in status(coordinator.address, None).members}
        assert states == {"solo": "left"}
    finally:
        node.close()
        coordinator.stop()


def test_a_peer_s_death_ends_the_join_with_its_name(tmp_path: Path) -> None:
    """A joined node whose peer is SIGKILLed hears of the death from the coordinator (missed
    heartbeats) and exits 1 naming the dead node, without a traceback."""
    coordinator = Coordinator(tmp_path, "--insecure-loopback-only", interval=0.2, misses=5)
    nodes = [_join(coordinator.address, f"node-{i}", 2, "--rank", str(i), "--no-probe") for i in range(2)]
    try:
        for node in nodes:
            node.wait_for("joined", 90)
        nodes[1].proc.kill()
        assert nodes[0].finish(30) == 1, nodes[0].text
        last = nodes[0].text.strip().splitlines()[-1]
        assert last.startswith("tinydist node join: error: ") and "node-1" in last, nodes[0].text
        assert "Traceback" not in nodes[0].text
    finally:
        for node in nodes:
            node.close()
        coordinator.stop()
