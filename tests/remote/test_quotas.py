"""Quotas and limits (issue 23, item 6): programs per identity, counted and unloaded with their
lease; reset storms; BAR access widths are in test_memory.py, malformed messages in test_admission.py."""

from __future__ import annotations

import grpc

from tinydist.testing import spin_ir
from tinydist.transports.pci_remote._generated import device_pb2 as pb

from .conftest import code_of, lease_of

BOB = "spiffe://tinydist.lab/user/bob"


def _load(client, lease: bytes, i: int) -> grpc.StatusCode:
    request = pb.LoadProgramRequest(lease=lease, device="CPU:0", kind=pb.PROGRAM_KIND_ENGINE_KERNEL,
                                    llvm_ir=spin_ir(f"k{i}"), entry=f"k{i}", signature=["rw", "i64", "i64"])
    return code_of(client.LoadProgram, request, timeout=60)


def test_1000_programs_hit_the_quota_and_leave_with_their_lease(make_server, connect) -> None:
    server = make_server()
    bob = connect(server, "bob")
    lease = lease_of(bob)
    codes = [_load(bob, lease, i) for i in range(1000)]
    assert codes[:256] == [grpc.StatusCode.OK] * 256  # max_programs, the policy's default
    assert codes[256:] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 744
    refused = [r for r in server.audit_records() if r.get("method") == "LoadProgram" and r.get("status") == "RESOURCE_EXHAUSTED"]
    assert len(refused) == 744 and refused[0]["reason"].startswith("program quota exceeded (256 programs")
    assert len(server.service._programs) == 256
    # a second lease of the same identity shares the quota; the same program again costs nothing
    other = lease_of(bob)
    assert _load(bob, other, 999) is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _load(bob, lease, 0) is grpc.StatusCode.OK
    bob.CloseLease(pb.CloseLeaseRequest(lease=lease))
    assert server.service._programs == {}  # unloaded with the lease
    assert _load(bob, other, 999) is grpc.StatusCode.OK


def test_a_program_is_launched_only_under_the_lease_that_loaded_it(make_server, connect) -> None:
    server = make_server()
    bob = connect(server, "bob")
    first, second = lease_of(bob), lease_of(bob)
    assert _load(bob, first, 1) is grpc.StatusCode.OK
    program = bob.LoadProgram(pb.LoadProgramRequest(lease=first, device="CPU:0", kind=pb.PROGRAM_KIND_ENGINE_KERNEL,
                                                    llvm_ir=spin_ir("k1"), entry="k1", signature=["rw", "i64", "i64"])).program_id
    handle = bob.Allocate(pb.AllocateRequest(lease=second, device="CPU:0", nbytes=8)).handle
    args = [pb.LaunchArg(buffer=pb.BufferArg(handle=handle, length=8)), pb.LaunchArg(i64=1), pb.LaunchArg(i64=1)]
    launch = pb.LaunchRequest(lease=second, device="CPU:0", program_id=program, args=args)
    assert code_of(bob.Launch, launch) is grpc.StatusCode.NOT_FOUND
    bob.LoadProgram(pb.LoadProgramRequest(lease=second, device="CPU:0", kind=pb.PROGRAM_KIND_ENGINE_KERNEL,
                                          llvm_ir=spin_ir("k1"), entry="k1", signature=["rw", "i64", "i64"]))
    assert code_of(bob.Launch, launch) is grpc.StatusCode.OK
    assert code_of(bob.LoadProgram, pb.LoadProgramRequest(device="CPU:0", kind=pb.PROGRAM_KIND_ENGINE_KERNEL,
                                                          llvm_ir=spin_ir("k1"), entry="k1",
                                                          signature=["rw", "i64", "i64"])) is grpc.StatusCode.NOT_FOUND


def test_program_bytes_are_a_quota_too(make_server, connect, lab) -> None:
    server = make_server(policy_text=lab.policy_text().replace("max_program_bytes = 67108864", "max_program_bytes = 20000"))
    bob = connect(server, "bob")
    lease = lease_of(bob)
    codes = [_load(bob, lease, i) for i in range(40)]
    assert grpc.StatusCode.OK in codes and codes[-1] is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert sum(server.call(lambda: [sum(held.programs.values()) for held in server.service.table.leases.values()])) <= 20000
    reasons = {r["reason"] for r in server.audit_records() if r.get("status") == "RESOURCE_EXHAUSTED"}
    assert all(reason.startswith("program bytes quota exceeded") for reason in reasons) and reasons


def test_a_reset_storm_is_rate_limited(make_server, connect) -> None:
    server = make_server()
    alice = connect(server, "alice")
    token = alice.MintElevationToken(pb.MintElevationTokenRequest()).token
    codes = [code_of(alice.ResetDevice, pb.ResetDeviceRequest(address="0000:01:00.0"), token=token) for _ in range(60)]
    assert codes == [grpc.StatusCode.OK] * 6 + [grpc.StatusCode.RESOURCE_EXHAUSTED] * 54
    assert server.service.pci["0000:01:00.0"].resets == 6
