"""`import tinydist` loads the engine, not the subsystems: process collectives and their
transports, ONNX, the remote back end and gRPC are imported when first used."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

NOT_AT_IMPORT = ("grpc", "google.protobuf", "tinydist.transports", "tinydist.dist", "tinydist.onnx", "onnx", "onnxruntime",
                 "tinydist.runtime.remote", "tinydist.cli", "tinydist.nodes", "tinydist.scheduler", "prometheus_client")


def loaded_after(code: str) -> set[str]:
    script = f"import sys\n{code}\nprint('\\n'.join(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return set(done.stdout.split())


def test_import_tinydist_stays_light() -> None:
    loaded = loaded_after("import tinydist")
    heavy = sorted(m for m in loaded if any(m == n or m.startswith(n + ".") for n in NOT_AT_IMPORT))
    assert not heavy, f"`import tinydist` imported {heavy}"


def test_subsystems_load_on_first_use_under_their_public_names() -> None:
    loaded = loaded_after("import tinydist as td\n"
                          "assert td.dist.DistributedDataParallel is td.parallel.DistributedDataParallel\n"
                          "assert td.onnx.load and td.multi.MultiTensor and td.nn.Linear and td.optim.Adam\n"
                          "import tinydist.dist.launcher  # a submodule named like a td.dist function would replace it\n"
                          "assert callable(td.dist.launch), td.dist.launch")
    assert {"tinydist.dist", "tinydist.dist.parallel", "tinydist.onnx", "tinydist.transports.base"} <= loaded
