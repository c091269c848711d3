"""Prometheus metrics: the loopback endpoint serves text format that prometheus_client parses, and
its counters move when work is done."""

from __future__ import annotations

import importlib.metadata
import sys
import urllib.request

import anyio
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.parser import text_string_to_metric_families

import tinydist as td
from tinydist.base.errors import DeviceHang
from tinydist.observability import metrics
from tinydist.runtime.registry import open_device


SERVICE = "tinydist.v1.DeviceService"


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def _get(samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def server():
    with metrics.serve_metrics("127.0.0.1", 0) as handle:
        yield handle


def test_endpoint_parses_and_counters_move_with_work(server) -> None:
    assert server.host == "127.0.0.1" and server.port > 0
    td.Tensor(np.ones(4, np.float32), device="CPU:1").numpy()  # the device exists before the first scrape
    before = _scrape(server.url)
    x = td.Tensor(np.arange(256, dtype=np.float32), device="CPU:1")
    ((x * 2) + 1).numpy()
    metrics.add_transport_bytes("tcp", "send", 4096)
    with metrics.time_collective("allreduce", "ring"):
        pass
    with metrics.time_rpc("Launch", SERVICE):
        pass
    with pytest.raises(ValueError), metrics.time_rpc("Copy", SERVICE):
        raise ValueError("bad request")
    metrics.count_auth_denial("bad certificate")
    after = _scrape(server.url)

    labels = {"device": "CPU:1", "queue": "compute"}
    assert _get(after, "tinydist_submissions_total", **labels) > _get(before, "tinydist_submissions_total", **labels)
    assert _get(after, "tinydist_completed_submissions_total", **labels) == _get(after, "tinydist_submissions_total", **labels)
    assert _get(after, "tinydist_inflight_submissions", **labels) == 0
    assert _get(after, "tinydist_queue_depth", **labels) == 0
    copy = {"device": "CPU:1", "queue": "copy"}
    assert _get(after, "tinydist_bytes_copied_total", **copy) >= _get(before, "tinydist_bytes_copied_total", **copy) + 2 * 1024
    moved = _get(after, "tinydist_transport_bytes_total", transport="tcp", direction="send") - \
        _get(before, "tinydist_transport_bytes_total", transport="tcp", direction="send")
    assert moved == 4096
    assert _get(after, "tinydist_collective_seconds_count", collective="allreduce", algorithm="ring") >= 1
    rpc = {"grpc_service": SERVICE, "grpc_type": "unary"}
    assert _get(after, "grpc_server_handled_total", grpc_method="Launch", grpc_code="OK", **rpc) >= 1
    # an exception that is no gRPC error: what a gRPC server answers for it, UNKNOWN
    assert _get(after, "grpc_server_handled_total", grpc_method="Copy", grpc_code="UNKNOWN", **rpc) >= 1
    assert _get(after, "grpc_server_started_total", grpc_method="Copy", **rpc) >= 1
    assert _get(after, "grpc_server_handling_seconds_count", grpc_method="Launch", **rpc) >= 1
    assert _get(after, "tinydist_auth_denials_total", reason="bad certificate") >= 1


async def _hang_one() -> None:
    async with open_device("CPU:3") as dev:
        dev.mark_failed(DeviceHang("injected hang"))


def test_device_hangs_are_counted(server) -> None:
    before = _scrape(server.url)
    anyio.run(_hang_one)
    after = _scrape(server.url)
    assert _get(after, "tinydist_device_hangs_total", device="CPU:3") == _get(before, "tinydist_device_hangs_total", device="CPU:3") + 1
    assert _get(after, "tinydist_device_failures_total", device="CPU:3", reason="DeviceHang") >= 1


def test_endpoint_binds_loopback_unless_told_otherwise() -> None:
    with pytest.raises(ValueError, match="non-loopback"):
        metrics.serve_metrics("0.0.0.0", 0)
    assert metrics.parse_address("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert metrics.parse_address("[::1]:9000") == ("::1", 9000)
    assert metrics.parse_address(":9464") == ("127.0.0.1", 9464)
    assert metrics.parse_address("9464") == ("127.0.0.1", 9464)
    with pytest.raises(ValueError):
        metrics.parse_address("nonsense")


def test_render_is_prometheus_text() -> None:
    names = {f.name for f in text_string_to_metric_families(metrics.render())}
    assert {"tinydist_queue_depth", "tinydist_inflight_submissions", "tinydist_transport_bytes", "grpc_server_handled",
            "grpc_server_started", "grpc_server_handling_seconds", "tinydist_collective_seconds",
            "tinydist_auth_denials", "tinydist_build_info"} <= names


def test_standard_collectors_and_build_info(server) -> None:
    """The process and platform collectors prometheus_client's default registry has, against what
    the OS and the interpreter say; and one tinydist_build_info sample naming this Python."""
    import os
    import platform
    import resource

    samples = _scrape(server.url)
    rss = _get(samples, "process_resident_memory_bytes")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    assert 0 < rss <= peak * 1.05
    assert _get(samples, "process_open_fds") == pytest.approx(len(os.listdir("/proc/self/fd")), abs=3)
    assert _get(samples, "python_info", implementation=platform.python_implementation(), major=str(sys.version_info.major),
                minor=str(sys.version_info.minor), patchlevel=str(sys.version_info.micro),
                version=platform.python_version()) == 1
    info = [dict(labels) for (name, labels), v in samples.items() if name == "tinydist_build_info" and v == 1]
    assert len(info) == 1 and info[0]["python"] == platform.python_version() and info[0]["component"] == "library"
    assert info[0]["version"] in (importlib.metadata.version("tinydist"), "unknown")


def test_grpc_type_names_are_go_grpc_prometheus_ones() -> None:
    assert [metrics.grpc_type(c, s) for c, s in ((False, False), (True, False), (False, True), (True, True))] == \
        ["unary", "client_stream", "server_stream", "bidi_stream"]


def test_rpc_histogram_buckets_count_a_duration_at_their_bound() -> None:
    """grpc_server_handling_seconds as prometheus_client's Histogram had it: `le` includes the bound."""
    for seconds in (0.001, 0.0010001, 99.0):
        metrics.record_rpc("BucketProbe", "OK", seconds, "test.Buckets", "unary")
    samples = {(s.name, s.labels.get("le")): s.value for f in text_string_to_metric_families(metrics.render())
               for s in f.samples if s.labels.get("grpc_method") == "BucketProbe"}
    bucket = "grpc_server_handling_seconds_bucket"
    assert samples[(bucket, "0.0005")] == 0 and samples[(bucket, "0.001")] == 1 and samples[(bucket, "0.005")] == 2
    assert samples[(bucket, "5.0")] == 2 and samples[(bucket, "+Inf")] == 3
    assert samples[("grpc_server_handling_seconds_count", None)] == 3
    assert abs(samples[("grpc_server_handling_seconds_sum", None)] - 99.0020001) < 1e-9
    assert samples[("grpc_server_started_total", None)] == 3 and samples[("grpc_server_handled_total", None)] == 3


def test_collective_seconds_exposes_what_a_prometheus_histogram_does() -> None:
    """The plain-list histogram td.dist observes into scrapes as prometheus_client's own Histogram
    fed the same values (bucket edges included: `le` is `<=`)."""
    values = [5e-6, 1e-5, 3e-5, 1e-4, 0.002, 0.7, 40.0]
    theirs_registry, ours_registry = CollectorRegistry(), CollectorRegistry()
    theirs = Histogram("tinydist_collective_seconds", "doc", ["collective", "algorithm"], registry=theirs_registry,
                       buckets=metrics.COLLECTIVE_BUCKETS)
    ours = metrics.CollectiveSeconds()
    ours_registry.register(ours)
    for v in values:
        theirs.labels("all_reduce", "naive").observe(v)
        ours.observe("all_reduce", "naive", v)
    labels = {"collective": "all_reduce", "algorithm": "naive"}
    for le in [*(str(b) for b in metrics.COLLECTIVE_BUCKETS), "+Inf"]:
        want = theirs_registry.get_sample_value("tinydist_collective_seconds_bucket", {**labels, "le": le})
        assert want is not None
        assert ours_registry.get_sample_value("tinydist_collective_seconds_bucket", {**labels, "le": le}) == want, le
    for suffix in ("_count", "_sum"):
        assert ours_registry.get_sample_value(f"tinydist_collective_seconds{suffix}", labels) == \
            theirs_registry.get_sample_value(f"tinydist_collective_seconds{suffix}", labels)
