"""The coordinator's metrics and trace spans: its membership as gauges, every Cluster RPC counted
under go-grpc-prometheus's names and labels with the status the client saw, each RPC and each
sweep round a span. An in-process coordinator on loopback, a real gRPC client."""

from __future__ import annotations

import asyncio

import grpc
from prometheus_client.parser import text_string_to_metric_families

import tinydist as td
from tinydist.scheduler._generated import cluster_pb2 as pb
from tinydist.scheduler._generated import cluster_pb2_grpc as pb_grpc
from tinydist.scheduler.coordinator import SERVICE, Coordinator
from tinydist.observability import metrics


def _samples() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics.render()) for s in family.samples}


def _handled(samples: dict, method: str, code: str) -> float:
    labels = (("grpc_code", code), ("grpc_method", method), ("grpc_service", SERVICE), ("grpc_type", "unary"))
    return samples.get(("grpc_server_handled_total", labels), 0.0)


async def _session() -> tuple[dict, dict, str, td.observability.Tracer]:
    with td.trace() as tracer:
        coordinator = await Coordinator.start("127.0.0.1:0", insecure_loopback_only=True, heartbeat_interval=0.05)
        before = _samples()
        try:
            async with grpc.aio.insecure_channel(coordinator.address) as channel:
                stub = pb_grpc.ClusterStub(channel)
                await stub.Join(pb.JoinRequest(node=pb.NodeInfo(node_id="n0", rank=0), world_size=2), timeout=10)
                await stub.Join(pb.JoinRequest(node=pb.NodeInfo(node_id="n1", rank=1), world_size=2), timeout=10)
                await stub.Leave(pb.LeaveRequest(node_id="n1"), timeout=10)
                try:
                    await stub.Heartbeat(pb.HeartbeatRequest(node_id="n1", epoch=1), timeout=10)
                except grpc.aio.AioRpcError as exc:
                    refused = exc.code().name
                else:
                    refused = "OK"
                await asyncio.sleep(0.2)           # a few sweep rounds
                during = _samples()
        finally:
            await coordinator.stop()
    return before, during, refused, tracer


def test_membership_gauges_grpc_metrics_and_spans() -> None:
    before, during, refused, tracer = asyncio.run(_session())
    assert refused == "FAILED_PRECONDITION"      # a node that left may not heartbeat
    assert during[("tinydist_cluster_members", (("state", "alive"),))] == 1
    assert during[("tinydist_cluster_members", (("state", "left"),))] == 1
    assert during[("tinydist_cluster_world_size", ())] == 2
    assert during[("tinydist_cluster_epoch", ())] >= 3       # two joins and a leave
    assert _handled(during, "Join", "OK") - _handled(before, "Join", "OK") == 2
    assert _handled(during, "Leave", "OK") - _handled(before, "Leave", "OK") == 1
    assert _handled(during, "Heartbeat", refused) - _handled(before, "Heartbeat", refused) == 1
    started = (("grpc_method", "Join"), ("grpc_service", SERVICE), ("grpc_type", "unary"))
    assert during[("grpc_server_started_total", started)] - before.get(("grpc_server_started_total", started), 0) == 2
    assert ("tinydist_cluster_members", (("state", "alive"),)) not in _samples()   # unregistered at stop

    trace = tracer.chrome()
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    rpcs = [(e["name"], e["args"]["status"], e["args"]["node"]) for e in spans if e["cat"] == "rpc"]
    assert rpcs == [("rpc Join", "OK", "n0"), ("rpc Join", "OK", "n1"), ("rpc Leave", "OK", "n1"),
                    ("rpc Heartbeat", "FAILED_PRECONDITION", "n1")]
    sweeps = [e for e in spans if e["cat"] == "scheduler" and e["name"] == "sweep"]
    assert sweeps and all(e["args"]["alive"] in (0, 1, 2) for e in sweeps)
