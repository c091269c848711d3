"""Handles, bounds, quotas, leases, programs and the simulated PCI function."""

from __future__ import annotations

import struct
import threading
import time

import grpc
import pytest

from tinydist.runtime.remote.client import channel_options
from tinydist.testing import spin_ir
from tinydist.transports.pci_remote import wire
from tinydist.transports.pci_remote._generated import device_pb2 as pb

from .conftest import code_of, lease_of

U64 = 2**64 - 1
NF, OOR = grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE

# Engine-kernel-shaped IR: x[i] <- x[i] iterated `iters` times (x*0.75+1), float64.
SPIN_IR = spin_ir("spin")


def alloc(client, lease, nbytes=64):
    return client.Allocate(pb.AllocateRequest(lease=lease, device="CPU:0", nbytes=nbytes)).handle


def test_foreign_stale_and_missing_handles_look_the_same(server, connect) -> None:
    bob, dave = connect(server, "bob"), connect(server, "dave")
    bob_lease, dave_lease = lease_of(bob), lease_of(dave)
    handle = alloc(bob, bob_lease)
    other_lease = lease_of(bob)
    answers = []
    for client, lease, h in [(dave, dave_lease, handle), (dave, dave_lease, b"\x01" * 16), (dave, dave_lease, b"short"),
                             (bob, other_lease, handle)]:
        with pytest.raises(grpc.RpcError) as info:
            client.Read(pb.ReadRequest(lease=lease, handle=h, length=1))
        answers.append((info.value.code(), info.value.details()))
    bob.Free(pb.FreeRequest(lease=bob_lease, handle=handle))
    with pytest.raises(grpc.RpcError) as info:
        bob.Read(pb.ReadRequest(lease=bob_lease, handle=handle, length=1))  # stale
    answers.append((info.value.code(), info.value.details()))
    assert set(answers) == {(NF, "no such handle")}
    assert code_of(dave.Read, pb.ReadRequest(lease=bob_lease, handle=handle, length=1)) == NF  # another's lease


@pytest.mark.parametrize("offset,length", [(U64, 1), (1, U64), (U64, U64), (65, 0), (64, 1), (2**63, 2**63), (0, 65)])
def test_overflowing_and_outside_ranges_are_out_of_range(server, connect, offset, length) -> None:
    bob = connect(server, "bob")
    lease = lease_of(bob)
    h, h2 = alloc(bob, lease), alloc(bob, lease)
    before = server.service.handler_calls.copy()
    assert code_of(bob.Read, pb.ReadRequest(lease=lease, handle=h, offset=offset, length=length)) == OOR
    assert code_of(bob.ReadStream, pb.ReadRequest(lease=lease, handle=h, offset=offset, length=length)) == OOR
    assert code_of(bob.Copy, pb.CopyRequest(lease=lease, dst=h, dst_offset=offset, src=h2, length=length)) == OOR
    assert code_of(bob.Copy, pb.CopyRequest(lease=lease, dst=h, src=h2, src_offset=offset, length=length)) == OOR
    if length < 1 << 20:
        assert code_of(bob.Write, pb.WriteRequest(lease=lease, handle=h, offset=offset, data=b"x" * length)) in (OOR,)
    # nothing was written anywhere
    assert bob.Read(pb.ReadRequest(lease=lease, handle=h, length=64)).data == bytes(64)
    assert server.service.handler_calls["Read"] == before["Read"] + 2


def test_edges_in_range_work(server, connect) -> None:
    bob = connect(server, "bob")
    lease = lease_of(bob)
    h = alloc(bob, lease)
    assert bob.Read(pb.ReadRequest(lease=lease, handle=h, offset=64, length=0)).data == b""
    bob.Write(pb.WriteRequest(lease=lease, handle=h, offset=60, data=b"abcd"))
    assert bob.Read(pb.ReadRequest(lease=lease, handle=h, offset=60, length=4)).data == b"abcd"


def test_fresh_allocations_read_as_zeros(server, connect) -> None:
    bob = connect(server, "bob")
    lease = lease_of(bob)
    for _ in range(3):
        h = alloc(bob, lease, 4096)
        assert bob.Read(pb.ReadRequest(lease=lease, handle=h, length=4096)).data == bytes(4096)
        bob.Write(pb.WriteRequest(lease=lease, handle=h, data=b"\xff" * 4096))
        bob.Free(pb.FreeRequest(lease=lease, handle=h))


def test_oversize_messages_are_refused(make_server, connect) -> None:
    server = make_server(max_message_bytes=1 << 20)
    bob = connect(server, "bob", options=channel_options(16 << 20))
    lease = lease_of(bob)
    h = alloc(bob, lease, 4 << 20)
    before = server.service.handler_calls["Write"]
    assert code_of(bob.Write, pb.WriteRequest(lease=lease, handle=h, data=bytes(2 << 20))) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert server.service.handler_calls["Write"] == before
    assert code_of(bob.Read, pb.ReadRequest(lease=lease, handle=h, length=2 << 20)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    # big metadata: refused by gRPC before any handler
    before = sum(server.service.handler_calls.values())
    assert code_of(bob.stub.Ping, pb.PingRequest(), metadata=[("x-pad", "a" * (64 << 10))], timeout=5) != grpc.StatusCode.OK
    assert sum(server.service.handler_calls.values()) == before
    # streams move more than one message's worth
    data = bytes(range(256)) * (4 << 12)
    assert bob.WriteStream(iter([pb.WriteRequest(lease=lease, handle=h, data=data[: 1 << 19])] +
                                [pb.WriteRequest(data=data[i:i + (1 << 19)]) for i in range(1 << 19, len(data), 1 << 19)])).written == len(data)
    got = b"".join(r.data for r in bob.ReadStream(pb.ReadRequest(lease=lease, handle=h, length=len(data))))
    assert got == data


def test_data_only_chunks_are_checked_like_any_write(server, connect) -> None:
    bob = connect(server, "bob")
    lease = lease_of(bob)
    h = alloc(bob, lease, 1000)
    raw = bob.channel.stream_unary("/tinydist.v1.DeviceService/WriteStream", request_serializer=None,
                                   response_deserializer=pb.WriteReply.FromString)
    header = pb.WriteRequest(lease=lease, handle=h, offset=100).SerializeToString()
    assert raw(iter([header, wire.encode_write_data(b"a" * 500), wire.encode_write_data(b"b" * 400)]), timeout=10).written == 900
    got = bob.Read(pb.ReadRequest(lease=lease, handle=h, length=1000)).data
    assert got == bytes(100) + b"a" * 500 + b"b" * 400
    before = server.service.handler_calls["WriteStream"]
    assert code_of(raw, iter([wire.encode_write_data(b"c" * 10)]), timeout=10) == NF  # names no lease or handle
    assert code_of(raw, iter([header, wire.encode_write_data(b"c" * 901)]), timeout=10) == OOR
    assert server.service.handler_calls["WriteStream"] == before + 2
    assert [r["status"] for r in server.audit_records()[-2:]] == ["NOT_FOUND", "OUT_OF_RANGE"]
    assert bob.Read(pb.ReadRequest(lease=lease, handle=h, length=1000)).data == got  # nothing written
    # later messages may not redirect the stream: another handle, lease or offset is refused
    other_lease, other = lease_of(bob), alloc(bob, lease, 1000)
    for redirect in (pb.WriteRequest(handle=other, data=b"d"), pb.WriteRequest(lease=other_lease, data=b"d"),
                     pb.WriteRequest(offset=5, data=b"d")):
        stream = iter([header, redirect.SerializeToString()])
        assert code_of(raw, stream, timeout=10) == grpc.StatusCode.INVALID_ARGUMENT
    assert bob.Read(pb.ReadRequest(lease=lease, handle=other, length=1000)).data == bytes(1000)


def test_quotas(make_server, lab, connect) -> None:
    extra = '\n[quotas.identities."spiffe://tinydist.lab/user/dave"]\nmax_bytes = 1000\nrpc_per_second = 1\nrpc_burst = 6\n'
    server = make_server(policy_text=lab.policy_text(extra=extra))
    dave = connect(server, "dave")
    lease = lease_of(dave)
    alloc(dave, lease, 600)
    assert code_of(dave.Allocate, pb.AllocateRequest(lease=lease, device="CPU:0", nbytes=600)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    codes = [code_of(dave.Ping, pb.PingRequest()) for _ in range(6)]
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
    assert code_of(connect(server, "bob").Ping, pb.PingRequest()) == grpc.StatusCode.OK  # per identity


def test_disconnected_clients_allocations_are_released_when_the_lease_expires(make_server, connect) -> None:
    server = make_server(lease_ttl_s=0.4, reap_interval_s=0.05)
    bob = connect(server, "bob")
    lease = lease_of(bob)
    for _ in range(3):
        alloc(bob, lease, 1 << 16)
    assert server.service.table.bytes_by_identity["spiffe://tinydist.lab/user/bob"] == 3 << 16
    segments = [a.buffer for a in server.service.table.allocations.values()]
    bob.close()  # gone without CloseLease
    deadline = time.monotonic() + 5
    while server.service.table.allocations and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.service.table.allocations and not server.service.table.leases
    assert server.service.table.bytes_by_identity["spiffe://tinydist.lab/user/bob"] == 0
    actions = [r.get("action") for r in server.audit_records()]
    assert actions.count("free") == 3 and "lease_released" in actions
    assert len(segments) == 3 and all(s.fd < 0 for s in segments)  # tenant segments: unmapped and closed


def test_programs_in_flight_free_and_visibility(make_server, connect) -> None:
    server = make_server()
    bob, dave = connect(server, "bob"), connect(server, "dave")
    lease = lease_of(bob)
    h = alloc(bob, lease, 8)
    program = bob.LoadProgram(pb.LoadProgramRequest(lease=lease, device="CPU:0", kind=pb.PROGRAM_KIND_ENGINE_KERNEL, llvm_ir=SPIN_IR,
                                                    entry="spin", signature=["rw", "i64", "i64"]), timeout=60).program_id
    args = [pb.LaunchArg(buffer=pb.BufferArg(handle=h, length=8)), pb.LaunchArg(i64=1), pb.LaunchArg(i64=300_000_000)]
    result: list[grpc.StatusCode] = []
    worker = threading.Thread(target=lambda: result.append(code_of(
        bob.Launch, pb.LaunchRequest(lease=lease, device="CPU:0", program_id=program, args=args), timeout=60)))
    worker.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(a.busy for a in list(server.service.table.allocations.values())):
        time.sleep(0.005)
    assert code_of(bob.Free, pb.FreeRequest(lease=lease, handle=h)) == grpc.StatusCode.FAILED_PRECONDITION
    worker.join(60)
    assert result == [grpc.StatusCode.OK]
    value = struct.unpack("<d", bob.Read(pb.ReadRequest(lease=lease, handle=h, length=8)).data)[0]
    assert value == pytest.approx(4.0)  # the fixed point of x*0.75+1
    bob.Free(pb.FreeRequest(lease=lease, handle=h))
    # another identity cannot launch bob's program, nor with bob's handle
    dlease = lease_of(dave)
    dh = alloc(dave, dlease, 8)
    dargs = [pb.LaunchArg(buffer=pb.BufferArg(handle=dh, length=8)), pb.LaunchArg(i64=1), pb.LaunchArg(i64=1)]
    assert code_of(dave.Launch, pb.LaunchRequest(lease=dlease, device="CPU:0", program_id=program, args=dargs)) == NF
    # bounds are checked on launch arguments too
    bad = [pb.LaunchArg(buffer=pb.BufferArg(handle=dh, offset=U64, length=8)), pb.LaunchArg(i64=1), pb.LaunchArg(i64=1)]
    dave.LoadProgram(pb.LoadProgramRequest(lease=dlease, device="CPU:0", kind=pb.PROGRAM_KIND_ENGINE_KERNEL, llvm_ir=SPIN_IR,
                                           entry="spin", signature=["rw", "i64", "i64"]))
    assert code_of(dave.Launch, pb.LaunchRequest(lease=dlease, device="CPU:0", program_id=program, args=bad)) == OOR


BAD_PROGRAMS = {
    "external call": ("declare i32 @system(ptr)\ndefine void @k(ptr %p) {\n  %r = call i32 @system(ptr %p)\n  ret void\n}", "external function"),
    "inline asm": ('define void @k(ptr %p) {\n  call void asm sideeffect "syscall", ""()\n  ret void\n}', "inline assembly"),
    "indirect call": ("define void @k(ptr %p) {\n  call void %p()\n  ret void\n}", "indirect calls"),
    "pointer global": ("@g = internal constant ptr @k\ndefine void @k(ptr %p) {\n  ret void\n}", "points at"),
    "writable global": ("@g = global i64 0\ndefine void @k(ptr %p) {\n  ret void\n}", "constant"),
    "inttoptr": ("define void @k(ptr %p) {\n  %q = inttoptr i64 4096 to ptr\n  store i8 0, ptr %q\n  ret void\n}", "inttoptr"),
    "module asm": ('module asm "nop"\ndefine void @k(ptr %p) {\n  ret void\n}', "module-level assembly"),
    "second export": ("define void @k(ptr %p) {\n  ret void\n}\ndefine void @other() {\n  ret void\n}", "internal or private"),
    "wrong signature": ("define void @k(i64 %p) {\n  ret void\n}", "signature says"),
    "not IR": ("\x7fELF\x02\x01\x01", "LLVM rejected"),
}


@pytest.mark.parametrize("case", sorted(BAD_PROGRAMS))
def test_verifier_refuses(server, connect, case) -> None:
    ir, reason = BAD_PROGRAMS[case]
    bob = connect(server, "bob")
    lease = lease_of(bob)
    with pytest.raises(grpc.RpcError) as info:
        bob.LoadProgram(pb.LoadProgramRequest(lease=lease, device="CPU:0", kind=pb.PROGRAM_KIND_ENGINE_KERNEL,
                                              llvm_ir=ir, entry="k", signature=["rw"]))
    bob.CloseLease(pb.CloseLeaseRequest(lease=lease))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason in info.value.details()


def test_raw_programs_need_admin_and_token(server, connect) -> None:
    ir = "define void @k(ptr %p) {\n  %a = ptrtoint ptr %p to i64\n  ret void\n}"
    bob, alice = connect(server, "bob"), connect(server, "alice")
    request = pb.LoadProgramRequest(lease=lease_of(alice), device="CPU:0", kind=pb.PROGRAM_KIND_RAW_LLVM, llvm_ir=ir,
                                    entry="k", signature=["rw"])
    assert code_of(bob.LoadProgram, request) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(bob.LoadRawProgram, request) == grpc.StatusCode.PERMISSION_DENIED
    assert code_of(alice.LoadRawProgram, request) == grpc.StatusCode.PERMISSION_DENIED
    token = alice.MintElevationToken(pb.MintElevationTokenRequest()).token
    assert alice.LoadRawProgram(request, token=token).program_id


def test_simulated_pci_function(server, connect) -> None:
    alice = connect(server, "alice")
    token = alice.MintElevationToken(pb.MintElevationTokenRequest()).token
    address = connect(server, "carol").ListPciFunctions(pb.ListPciFunctionsRequest()).functions[0].address
    read = lambda offset, size: alice.PciConfigRead(pb.PciConfigReadRequest(address=address, offset=offset, size=size), token=token)  # noqa: E731
    assert read(0, 2).value == 0x1D0F and read(2, 2).value == 0x7064
    assert code_of(read, 0x40, 1) == grpc.StatusCode.PERMISSION_DENIED  # exists, not allowlisted
    assert code_of(read, U64, 4) == OOR
    assert code_of(read, 0, 3) == grpc.StatusCode.INVALID_ARGUMENT
    bar = lambda **kw: alice.BarRead(pb.BarReadRequest(address=address, **kw), token=token)  # noqa: E731
    assert struct.unpack("<I", bar(bar=0, offset=0, length=4).data)[0] == 0x7D157000
    assert code_of(bar, bar=0, offset=4096, length=4) == OOR      # outside the window
    assert code_of(bar, bar=0, offset=U64 - 3, length=U64 - 3) == OOR
    assert code_of(bar, bar=5, offset=0, length=4) == NF
    for offset, length in ((2, 4), (0, 3), (0, 0), (4, 6)):  # whole aligned dwords only
        assert code_of(bar, bar=0, offset=offset, length=length) == grpc.StatusCode.INVALID_ARGUMENT
    write = lambda **kw: alice.BarWrite(pb.BarWriteRequest(address=address, **kw), token=token)  # noqa: E731
    assert code_of(write, bar=0, offset=0, data=b"xxxx") == grpc.StatusCode.PERMISSION_DENIED  # read-only window
    assert code_of(write, bar=2, offset=1, data=b"abcd") == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(write, bar=2, offset=16, data=b"hello") == grpc.StatusCode.INVALID_ARGUMENT
    write(bar=2, offset=16, data=b"hello!!!")
    assert bar(bar=2, offset=16, length=8).data == b"hello!!!"
    resets = alice.ResetDevice(pb.ResetDeviceRequest(address=address), token=token).resets
    assert bar(bar=2, offset=16, length=8).data == bytes(8) and resets >= 1
    assert code_of(alice.ResetDevice, pb.ResetDeviceRequest(address="0000:99:00.0"), token=token) == NF
