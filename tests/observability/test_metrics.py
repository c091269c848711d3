"""Prometheus metrics: the loopback endpoint serves text format that prometheus_client parses, and
its counters move when work is done."""

from __future__ import annotations

import urllib.request

import anyio
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import tinydist as td
from tinydist.base.errors import DeviceHang
from tinydist.observability import metrics
from tinydist.runtime.registry import open_device


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
    with metrics.time_rpc("Launch"):
        pass
    with pytest.raises(ValueError), metrics.time_rpc("Copy"):
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
    assert _get(after, "tinydist_rpcs_total", method="Launch", status="OK") >= 1
    assert _get(after, "tinydist_rpcs_total", method="Copy", status="ValueError") >= 1
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
    assert {"tinydist_queue_depth", "tinydist_inflight_submissions", "tinydist_transport_bytes", "tinydist_rpcs",
            "tinydist_collective_seconds", "tinydist_auth_denials"} <= names
