"""What other layers put into a trace: a `tinydist launch` job's collectives (with their algorithm,
bytes and per-step spans) and its transport sends and receives on both ranks; a model run's
compile, host and kernel lanes, kernels named by their ops and shapes. Real processes and
kernels; the expectations come from numpy and from the arguments the test passes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tinydist as td
from tinydist.observability import chrome

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "tests" / "onnx" / "architectures" / "models"

WORKER = """
import json, numpy as np, tinydist as td
td.dist.init()
rank = td.dist.get_rank()
x = np.arange(1000, dtype=np.float32) * (rank + 1)
auto = td.dist.all_reduce(x).numpy()              # on one host: the shared segment
ring = td.dist.all_reduce(x, algorithm="ring").numpy()   # over the links, step by step
print("RESULT", json.dumps({"rank": rank, "auto": auto[:3].tolist(), "ring": ring[:3].tolist()}), flush=True)
td.dist.destroy()
"""


def _spans(trace: dict, cat: str) -> list[dict]:
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == cat]


def test_traced_launch_job_records_collectives_steps_and_transport_on_both_ranks(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TINYDIST_")} | {
        "TINYDIST_CPU_DEVICES": "1", "TINYDIST_TRACE": str(tmp_path / "dist.json"), "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "tinydist.cli", "launch", "--nproc-per-node", "2", str(script)],
                         env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    expected = (np.arange(1000, dtype=np.float64) * 3)[:3].tolist()   # rank 0's x + rank 1's (2x)
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in run.stdout.splitlines() if "RESULT " in line]
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert all(r["auto"] == expected and r["ring"] == expected for r in results)

    nbytes = np.arange(1000, dtype=np.float32).nbytes
    for rank in (0, 1):
        trace = json.loads((tmp_path / f"dist.rank{rank}.json").read_text())
        assert chrome.validate(trace) == []
        names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
        lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
        spans = _spans(trace, "collective")
        reduces = [e for e in spans if e["name"] == "all_reduce"]
        assert len(reduces) == 2, [e["name"] for e in spans]
        for e in reduces:
            assert names[e["pid"]] == f"rank{rank}" and lanes[(e["pid"], e["tid"])] == "collective"
            assert e["args"]["bytes"] == nbytes and e["args"]["world"] == 2 and e["args"]["rank"] == rank
            assert e["args"]["dtype"] == "<f4"
        auto, ring = sorted(reduces, key=lambda e: e["ts"])
        assert auto["args"]["algorithm"] in ("naive", "all2all") and auto["args"]["data"] == "segment"
        assert ring["args"]["algorithm"] == "ring" and ring["args"]["data"] == "links"
        # the steps lie inside their collective: the segment's post-and-wait steps, ring's 2(N-1) steps
        steps = [e for e in spans if lanes[(e["pid"], e["tid"])].startswith("collective steps")]

        def inside(outer: dict) -> list[str]:
            return [e["name"] for e in steps if outer["ts"] <= e["ts"] and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"] + 1e-3]
        assert any(n.startswith("step ") for n in inside(auto)), inside(auto)
        # (on the segment, its header exchange is one post-and-wait step too)
        assert sorted(n for n in inside(ring) if "gather" in n or "scatter" in n) == ["allgather step 0",
                                                                                     "reduce-scatter step 0"]
        # ring moved half the vector each way at each step: transport spans name peer and bytes
        moved = _spans(trace, "transport")
        peer = 1 - rank
        sends = [e for e in moved if e["name"] == "send" and ring["ts"] <= e["ts"] <= ring["ts"] + ring["dur"]]
        recvs = [e for e in moved if e["name"] == "recv" and ring["ts"] <= e["ts"] <= ring["ts"] + ring["dur"]]
        assert sends and recvs and all(e["args"]["peer"] == peer for e in sends + recvs)
        assert lanes[(sends[0]["pid"], sends[0]["tid"])] == f"send to {peer}"
        assert sum(e["args"]["bytes"] for e in sends) >= nbytes   # 2 steps of half: n/N each, plus the header
        assert sum(e["args"]["bytes"] for e in recvs) >= nbytes

    # TINYDIST_TRACE's own path is the whole job: the launcher merges its ranks' files into it (it
    # wrote an empty trace of its own process before), each rank's lane named once ("rank0", not
    # "rank0 rank0")
    merged = json.loads((tmp_path / "dist.json").read_text())
    assert chrome.validate(merged) == []
    processes = [e["args"]["name"] for e in merged["traceEvents"] if e.get("name") == "process_name"]
    assert "rank0" in processes and "rank1" in processes, processes
    assert not any(name.startswith(("rank0 rank0", "rank1 rank1")) for name in processes), processes
    assert len([e for e in _spans(merged, "collective") if e["name"] == "all_reduce"]) == 4
    assert "merged 2 rank trace(s) into" in run.stderr


def test_model_run_has_compile_host_and_kernel_lanes_with_op_names() -> None:
    """An ONNX model (resnet of the architecture suite) traced from its first call: every kernel
    it runs is named by its ops (the model's ops: conv as matmul, relu as max, add) and shapes."""
    onnx = pytest.importorskip("onnx")
    from tinydist.onnx import load

    path = MODELS / "resnet_default.onnx"
    model = load(str(path))
    x = np.random.default_rng(0).uniform(-1, 1, (1, 3, 32, 32)).astype(np.float32)
    with td.trace() as tracer:
        for _ in range(3):      # run, capture, replay
            model({"x": x})
    trace = tracer.chrome()
    assert chrome.validate(trace) == []
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    processes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}

    def lane(e: dict) -> str:
        return f"{processes[e['pid']]}/{lanes[(e['pid'], e['tid'])]}"
    compiles = _spans(trace, "compile")
    host = _spans(trace, "schedule") + _spans(trace, "python")
    kernels = _spans(trace, "kernel")
    # kernels compile in parallel (runtime.compiler.prepare): overlapping compiles take the lanes
    # "compile", "compile 2", ... of the host
    assert compiles and "host/compile" in {lane(e) for e in compiles}
    assert all(re.fullmatch(r"host/compile( \d+)?", lane(e)) for e in compiles), {lane(e) for e in compiles}
    assert {"host/host", "host/jit"} <= {lane(e) for e in host}
    assert {e["name"] for e in host} >= {"schedule", "bind + submit", "jit run outputs", "jit capture outputs",
                                         "jit replay outputs"}
    assert kernels and {lane(e) for e in kernels} == {"CPU:0/compute"}
    # no kernel goes by its hash; the symbol stays in the args
    assert not [e["name"] for e in kernels if e["name"].startswith("k_")]
    assert all(e["args"]["program"].startswith(("k_", "tinydist_matmul_")) for e in kernels)
    graph = onnx.load(str(path)).graph
    conv = next(n for n in graph.node if n.op_type == "Conv")
    weights = {i.name: i for i in graph.initializer}[conv.input[1]]
    out_channels, in_channels, kh, kw = weights.dims
    # the first convolution as a matmul: its output channels by in_channels*kh*kw by the output pixels
    assert any(e["args"].get("op") == "matmul" and e["args"]["m"] == out_channels
               and e["args"]["k"] == in_channels * kh * kw for e in kernels), sorted({e["name"] for e in kernels})
    ops = {op for e in kernels for op in e["args"].get("ops", e["args"].get("op", "")).split("+")}
    assert {"matmul", "max", "add"} <= ops      # conv, relu and the residual add
    for e in kernels:
        if "ops" in e["args"]:
            assert e["name"] == f"{e['args']['ops']} {e['args']['shape']} {e['args']['dtype']}"
    # each of the three calls ran the same kernels (the eager run, the capture and its replay)
    batches = [e for e in trace["traceEvents"] if e.get("cat") == "batch" and e["args"]["queue"] == "compute"]
    assert len(batches) >= 3
