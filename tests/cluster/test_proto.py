"""The generated cluster service matches proto/tinydist/v1/cluster.proto and coexists with device.proto."""

from __future__ import annotations

from pathlib import Path


def test_generated_code_is_fresh(tmp_path):
    from scheduler.generate import DEFAULT_OUT, generate
    for path in generate(tmp_path):
        assert path.read_text() == (DEFAULT_OUT / path.name).read_text(), f"{path.name} is stale: run python -m scheduler.generate"


def test_both_protos_load_in_one_process():
    from scheduler._generated import cluster_pb2
    from transports.pci_remote._generated import device_pb2
    assert cluster_pb2.DESCRIPTOR.package == device_pb2.DESCRIPTOR.package == "tinydist.v1"
    assert "Cluster" in cluster_pb2.DESCRIPTOR.services_by_name
    assert Path(cluster_pb2.__file__).parent.name == "_generated"
