"""Admission before any work (issue 23, item 2): a call is admitted or refused from its headers
when it starts, before its request is read; per-identity caps on calls and streams keep one caller
from filling the node's global cap; every refusal is audited, malformed messages included."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import grpc
import pytest

from tinydist.transports.pci_remote._generated import device_pb2 as pb

from .conftest import code_of

SERVICE = "/tinydist.v1.DeviceService/"
FLOOD = 330  # more than the node's global cap of 256 calls in progress


async def _never(event: asyncio.Event) -> Any:
    await event.wait()  # a client that opens a call and sends nothing
    return
    yield  # an async generator


async def _flood(lab: Any, target: str, name: str, method: str, ending: int, channels: int = 6) -> tuple[Counter[str], Any]:
    """`FLOOD` calls of `method` from `name` that never send a message, spread over `channels`
    connections (each under the 64 streams an HTTP/2 connection may carry). Waits (60 s at most, a
    bound, not a measurement) until `ending` of them have ended; returns their codes and a coroutine
    function that ends the rest."""
    opened = [grpc.aio.secure_channel(target, lab.creds[name].channel_credentials(),
                                      options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(channels)]
    event = asyncio.Event()
    calls = []
    for i in range(FLOOD):
        rpc = opened[i % channels].stream_unary(SERVICE + method, request_serializer=None, response_deserializer=None)
        calls.append(rpc(_never(event), timeout=120))
    pending = {asyncio.ensure_future(call.code()) for call in calls}
    done: set[Any] = set()
    bound = asyncio.get_running_loop().time() + 60
    while len(done) < ending and asyncio.get_running_loop().time() < bound:
        more, pending = await asyncio.wait(pending, timeout=1, return_when=asyncio.FIRST_COMPLETED)
        done |= more
    codes = Counter(task.result().name for task in done)

    async def end() -> None:
        for call in calls:
            call.cancel()
        for task in pending:
            task.cancel()
        for channel in opened:
            await channel.close()
    return codes, end


def test_330_idle_streams_from_one_identity_do_not_stop_another_identitys_ping(make_server, connect, lab) -> None:
    server = make_server()
    carol = connect(server, "carol")

    async def go() -> tuple[Counter[str], Any]:
        codes, end = await _flood(lab, server.target, "bob", "WriteStream", FLOOD - 16)
        # bob holds his 16 streams; everyone else is served
        reply = await asyncio.to_thread(carol.Ping, pb.PingRequest(payload=b"still here"), timeout=30)
        held = dict(server.call(lambda: dict(server.service.gate.streams_by_identity)))
        await end()
        return codes, (reply, held)

    codes, (reply, held) = asyncio.run(go())
    assert reply.payload == b"still here"
    assert codes == Counter({"RESOURCE_EXHAUSTED": FLOOD - 16}), codes
    assert held == {"spiffe://tinydist.lab/user/bob": 16}
    refused = [r for r in server.audit_records() if r.get("method") == "WriteStream" and r["status"] == "RESOURCE_EXHAUSTED"]
    assert len(refused) == FLOOD - 16
    assert {r["reason"] for r in refused} == {"concurrent stream quota exceeded (16 streams open for this identity)"}
    assert {r["identity"] for r in refused} == {"spiffe://tinydist.lab/user/bob"}
    assert server.service.handler_calls["WriteStream"] == 16


def test_unsent_calls_from_an_unenrolled_certificate_are_refused_before_their_message(make_server, connect, lab) -> None:
    """Refused at the headers: the message was never sent, so the refusal cannot have waited for it."""
    server = make_server()
    carol = connect(server, "carol")

    async def go() -> Counter[str]:
        codes, end = await _flood(lab, server.target, "mallory", "Ping", FLOOD)
        await end()
        return codes

    codes = asyncio.run(go())
    assert codes == Counter({"PERMISSION_DENIED": FLOOD}), codes
    assert carol.Ping(pb.PingRequest(payload=b"x")).payload == b"x"
    refused = [r for r in server.audit_records() if r.get("method") == "Ping" and r["status"] == "PERMISSION_DENIED"]
    assert len(refused) == FLOOD and {r["reason"] for r in refused} == {"identity not enrolled"}
    assert server.service.handler_calls["Ping"] == 1  # carol's only


def test_a_revoked_certificates_unsent_calls_are_refused_and_audited(make_server, connect, lab) -> None:
    server = make_server()
    (server.dir / "revoked.txt").write_text(lab.fingerprints["dave"] + "\n")

    async def go() -> Counter[str]:
        codes, end = await _flood(lab, server.target, "dave", "ReadStream", FLOOD)
        await end()
        return codes

    codes = asyncio.run(go())
    assert codes == Counter({"UNAUTHENTICATED": FLOOD}), codes
    refused = [r for r in server.audit_records() if r.get("method") == "ReadStream"]
    assert len(refused) == FLOOD and {r["reason"] for r in refused} == {"certificate revoked"}


def test_the_call_and_stream_caps_come_from_the_policy(make_server, connect, lab) -> None:
    text = lab.policy_text().replace("max_calls = 64", "max_calls = 3").replace("max_streams = 16", "max_streams = 2")
    server = make_server(policy_text=text)
    bob = connect(server, "bob")
    lease = bob.OpenLease(pb.OpenLeaseRequest()).lease
    handle = bob.Allocate(pb.AllocateRequest(lease=lease, device="CPU:0", nbytes=64)).handle

    async def go() -> list[str]:
        channel = grpc.aio.secure_channel(server.target, lab.creds["bob"].channel_credentials())
        event = asyncio.Event()

        async def wait_then_write() -> Any:
            # admission counts a stream when it opens, before its first message; a message written
            # before the refusal arrives could race it, and grpc.aio's client then reports INTERNAL
            # in place of the server's status (grpc/grpc#36066): so the message goes after the event
            await event.wait()
            yield pb.WriteRequest(lease=lease, handle=handle, data=b"a").SerializeToString()

        write = channel.stream_unary(SERVICE + "WriteStream", request_serializer=None, response_deserializer=None)
        ping = channel.stream_unary(SERVICE + "Ping", request_serializer=None, response_deserializer=None)
        streams = [write(wait_then_write(), timeout=30) for _ in range(3)]
        codes = {asyncio.ensure_future(call.code()) for call in streams}
        first, held = await asyncio.wait(codes, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        results = [task.result().name for task in first]  # one stream of three: over max_streams
        unsent = ping(_never(event), timeout=30)  # a unary call admitted, its message outstanding
        while server.call(lambda: server.service.gate.calls_by_identity["spiffe://tinydist.lab/user/bob"]) < 3:
            await asyncio.sleep(0.05)
        results.append((await ping(_never(event), timeout=30).code()).name)  # a fourth call: over max_calls
        event.set()
        results += [(await task).name for task in held]
        unsent.cancel()
        await channel.close()
        return results

    third, fourth, *held = asyncio.run(go())
    assert (third, fourth) == ("RESOURCE_EXHAUSTED", "RESOURCE_EXHAUSTED")
    assert held == ["OK", "OK"]
    reasons = {r["reason"] for r in server.audit_records() if r.get("status") == "RESOURCE_EXHAUSTED"}
    assert reasons == {"concurrent stream quota exceeded (2 streams open for this identity)",
                       "concurrent call quota exceeded (3 calls in progress for this identity)"}
    assert server.call(lambda: dict(server.service.gate.calls_by_identity)) == {}  # every slot given back


@pytest.mark.parametrize("method", ["Ping", "Allocate", "WriteStream", "ReadStream", "Launch"])
def test_a_malformed_message_is_invalid_argument_and_audited(make_server, connect, method) -> None:
    server = make_server()
    bob = connect(server, "bob")
    raw = b"\xff\xff\xff\xff"  # a field tag with no valid wire type
    if method == "WriteStream":
        rpc = bob.channel.stream_unary(SERVICE + method, request_serializer=None, response_deserializer=None)
        code = code_of(rpc, iter([raw]), timeout=10)
    elif method == "ReadStream":
        rpc = bob.channel.unary_stream(SERVICE + method, request_serializer=None, response_deserializer=None)
        code = code_of(rpc, raw, timeout=10)
    else:
        code = code_of(bob.channel.unary_unary(SERVICE + method, request_serializer=None, response_deserializer=None), raw, timeout=10)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    record = [r for r in server.audit_records() if r.get("method") == method][-1]
    assert record["status"] == "INVALID_ARGUMENT" and record["identity"] == "spiffe://tinydist.lab/user/bob"
    assert record["reason"] == f"malformed {method} request: not a valid protobuf message"
    # a unary request is parsed before its handler runs; a stream's messages as the handler reads them
    assert server.service.handler_calls[method] == (1 if method == "WriteStream" else 0)


def test_330_health_watchers_from_a_revoked_certificate_do_not_stop_a_ping(make_server, connect, lab) -> None:
    """Health is not gated by identity (it is served on the plaintext loopback port too): its Watch
    streams are capped for all callers together, under the node's global cap."""
    from grpc_health.v1 import health_pb2
    server = make_server()
    (server.dir / "revoked.txt").write_text(lab.fingerprints["dave"] + "\n")
    carol = connect(server, "carol")

    async def go() -> tuple[Counter[str], bytes]:
        channels = [grpc.aio.secure_channel(server.target, lab.creds["dave"].channel_credentials(),
                                            options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(6)]
        watch = [c.unary_stream("/grpc.health.v1.Health/Watch", request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                response_deserializer=health_pb2.HealthCheckResponse.FromString) for c in channels]
        calls = [watch[i % 6](health_pb2.HealthCheckRequest(service=""), timeout=120) for i in range(FLOOD)]
        pending = {asyncio.ensure_future(call.code()) for call in calls}
        done: set[Any] = set()
        bound = asyncio.get_running_loop().time() + 60
        while len(done) < FLOOD - 16 and asyncio.get_running_loop().time() < bound:
            more, pending = await asyncio.wait(pending, timeout=1, return_when=asyncio.FIRST_COMPLETED)
            done |= more
        reply = await asyncio.to_thread(carol.Ping, pb.PingRequest(payload=b"up"), timeout=30)
        for call in calls:
            call.cancel()
        for channel in channels:
            await channel.close()
        return Counter(task.result().name for task in done), reply.payload

    codes, payload = asyncio.run(go())
    assert payload == b"up"
    assert codes == Counter({"RESOURCE_EXHAUSTED": FLOOD - 16}), codes


def test_an_admitted_callers_unsent_request_ends_at_the_calls_deadline_and_frees_its_slot(make_server, connect, lab) -> None:
    """The call's deadline (op_timeout_s here; the client set none) ends a read that never comes:
    DEADLINE_EXCEEDED, audited, and the identity's slot is free again (bounded: within the 0.25 s
    sweep of the deadline, checked with a generous margin, not timed)."""
    server = make_server(op_timeout_s=1.0)
    bob = connect(server, "bob")

    async def go() -> tuple[str, str]:
        async with grpc.aio.secure_channel(server.target, lab.creds["bob"].channel_credentials()) as channel:
            event = asyncio.Event()
            call = channel.stream_unary(SERVICE + "Ping", request_serializer=None, response_deserializer=None)(_never(event))
            code = await asyncio.wait_for(call.code(), 15)  # a bound, not a measurement
            details = await call.details()
            event.set()
            return code.name, details or ""

    code, details = asyncio.run(go())
    assert code == "DEADLINE_EXCEEDED" and "did not arrive before the deadline" in details
    record = [r for r in server.audit_records() if r.get("method") == "Ping"][-1]
    assert record["status"] == "DEADLINE_EXCEEDED" and record["identity"].endswith("/bob")
    assert server.service.gate.calls_by_identity == {}
    assert bob.Ping(pb.PingRequest(payload=b"y")).payload == b"y"
    assert server.service.handler_calls["Ping"] == 1  # bob's sent one; the unsent one never ran the handler
