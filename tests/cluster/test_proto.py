"""The generated cluster service matches proto/tinydist/v1/cluster.proto and coexists with device.proto."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), "--only", "cluster", "--out", str(tmp_path)],
                   check=True, capture_output=True, timeout=60)
    committed = ROOT / "scheduler" / "_generated"
    names = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    assert names == sorted(p.name for p in committed.iterdir() if p.is_file() and p.suffix in (".py", ".pyi"))
    for name in names:
        assert (tmp_path / name).read_text() == (committed / name).read_text(), f"{name} is stale: run python proto/generate.py"


def test_both_protos_load_in_one_process():
    from tinydist.scheduler._generated import cluster_pb2
    from tinydist.transports.pci_remote._generated import device_pb2
    assert cluster_pb2.DESCRIPTOR.package == device_pb2.DESCRIPTOR.package == "tinydist.v1"
    assert "Cluster" in cluster_pb2.DESCRIPTOR.services_by_name
    assert Path(cluster_pb2.__file__).parent.name == "_generated"
