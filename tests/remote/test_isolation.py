"""Tenant kernels cannot leave their tenant (issue 23, item 1): each identity's kernels run in a
worker process of its own (`tinydist.nodes.tenants`) that maps only that identity's buffers and is confined
by rlimits and a seccomp filter; a crash or a kernel past its deadline ends that worker only, the
node and every other tenant carry on. Real certificates on loopback; the crash tests run against a
`tinydist node serve` process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from tests.remote.conftest import code_of, lease_of
from tests.remote.test_node import serving_node
from tinydist.transports.pci_remote._generated import device_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
BOB, DAVE = "spiffe://tinydist.lab/user/bob", "spiffe://tinydist.lab/user/dave"

PEEK_IR = """
define void @peek(ptr %out, ptr %in, i64 %delta, i64 %n) {
entry:
  br label %loop
loop:
  %i = phi i64 [0, %entry], [%j, %loop]
  %k = add i64 %delta, %i
  %src = getelementptr i8, ptr %in, i64 %k
  %v = load volatile i8, ptr %src
  %dst = getelementptr i8, ptr %out, i64 %i
  store i8 %v, ptr %dst
  %j = add i64 %i, 1
  %c = icmp ult i64 %j, %n
  br i1 %c, label %loop, label %done
done:
  ret void
}
"""
NULL_STORE_IR = "define void @boom(ptr %p) {\n  store volatile i64 1, ptr null\n  ret void\n}\n"
UNREACHABLE_IR = "define void @never(ptr %p) {\n  unreachable\n}\n"
SPIN_IR = """
define void @spin(ptr %p, i64 %n) {
entry:
  br label %loop
loop:
  %i = phi i64 [0, %entry], [%j, %loop]
  store volatile i64 %i, ptr %p
  %j = add i64 %i, 1
  %c = icmp ult i64 %j, %n
  br i1 %c, label %loop, label %done
done:
  ret void
}
"""


def load(client, lease: bytes, ir: str, entry: str, signature: list[str]) -> str:
    return client.LoadProgram(pb.LoadProgramRequest(lease=lease, device="CPU:0", kind=pb.PROGRAM_KIND_ENGINE_KERNEL,
                                                    llvm_ir=ir, entry=entry, signature=signature), timeout=60).program_id


def alloc(client, lease: bytes, nbytes: int) -> bytes:
    return client.Allocate(pb.AllocateRequest(lease=lease, device="CPU:0", nbytes=nbytes)).handle


def buf(handle: bytes, length: int) -> pb.LaunchArg:
    return pb.LaunchArg(buffer=pb.BufferArg(handle=handle, length=length))


def launch(client, lease: bytes, program: str, args: list[pb.LaunchArg], timeout: float = 30.0) -> pb.LaunchReply:
    return client.Launch(pb.LaunchRequest(lease=lease, device="CPU:0", program_id=program, args=args), timeout=timeout)


def memfd_inodes(pid: int) -> set[int]:
    """The inodes of the memfd segments mapped in process `pid`."""
    inodes = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and "memfd:tinydist-tenant" in fields[5]:
            inodes.add(int(fields[4]))
    return inodes


def test_a_kernel_walking_to_another_tenants_buffer_finds_only_its_own_memory(make_server, connect) -> None:
    server = make_server()
    bob, dave = connect(server, "bob"), connect(server, "dave")
    blease, dlease = lease_of(bob), lease_of(dave)
    secret = np.random.default_rng(23).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    dh = alloc(dave, dlease, 4096)
    dave.Write(pb.WriteRequest(lease=dlease, handle=dh, data=secret))
    out, mine = alloc(bob, blease, 4096), alloc(bob, blease, 4096)
    own = bytes(range(256)) * 16
    bob.Write(pb.WriteRequest(lease=blease, handle=mine, data=own))
    peek = load(bob, blease, PEEK_IR, "peek", ["w", "r", "i64", "i64"])
    launch(bob, blease, peek, [buf(out, 4096), buf(mine, 4096), pb.LaunchArg(i64=0), pb.LaunchArg(i64=4096)])
    assert bob.Read(pb.ReadRequest(lease=blease, handle=out, length=4096)).data == own  # the kernel works

    segments = {a.handle: a.buffer for a in server.service.table.allocations.values()}
    worker = server.service.tenants.workers[BOB]
    assert worker.sandbox == "seccomp"
    mapped = memfd_inodes(worker.process.pid)
    assert {os.fstat(segments[h].fd).st_ino for h in (out, mine)} <= mapped
    assert os.fstat(segments[dh].fd).st_ino not in mapped  # dave's bytes are not in bob's worker at all
    with pytest.raises(PermissionError):  # sealed: no holder can shrink a segment under the node's mapping
        os.ftruncate(segments[mine].fd, 0)

    # the attack that worked while kernels ran in the node: the distance between the two buffers there
    delta = segments[dh].address - segments[mine].address
    code = code_of(launch, bob, blease, peek, [buf(out, 4096), buf(mine, 4096), pb.LaunchArg(i64=delta), pb.LaunchArg(i64=4096)])
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.ABORTED)
    print("the walk to dave's buffer:", code.name)
    if code is grpc.StatusCode.OK:
        assert bob.Read(pb.ReadRequest(lease=blease, handle=out, length=4096)).data != secret
    assert dave.Read(pb.ReadRequest(lease=dlease, handle=dh, length=4096)).data == secret
    # whatever became of bob's worker, his next launch runs and his buffers kept their bytes
    launch(bob, blease, peek, [buf(out, 4096), buf(mine, 4096), pb.LaunchArg(i64=0), pb.LaunchArg(i64=4096)])
    assert bob.Read(pb.ReadRequest(lease=blease, handle=out, length=4096)).data == own
    # the worker goes with the tenant's last lease
    pid = server.service.tenants.workers[BOB].process.pid
    bob.CloseLease(pb.CloseLeaseRequest(lease=blease))
    deadline = time.monotonic() + 10
    while (BOB in server.service.tenants.workers or Path(f"/proc/{pid}").exists()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert BOB not in server.service.tenants.workers and not Path(f"/proc/{pid}").exists()


def test_the_worker_is_confined(tmp_path: Path) -> None:
    """What a kernel that took over its worker could still do: no files, sockets, processes or signals."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os, socket, sys\n"
        "from nodes.tenant_worker import confine\n"
        "print(confine(3 << 30, 77), flush=True)\n"
        "for name, fn in [('open', lambda: os.open('/etc/hostname', os.O_RDONLY)), ('socket', socket.socket),\n"
        "                 ('fork', os.fork), ('kill', lambda: os.kill(os.getppid(), 0))]:\n"
        "    try:\n"
        "        fn()\n"
        "        print(name, 'allowed', flush=True)\n"
        "    except PermissionError:\n"
        "        print(name, 'refused', flush=True)\n"
        "sys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, str(probe)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        lines = [proc.stdout.readline().strip() for _ in range(5)]
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
        status = Path(f"/proc/{proc.pid}/status").read_text()
    finally:
        proc.communicate("", timeout=10)
    assert lines == ["True", "open refused", "socket refused", "fork refused", "kill refused"]
    assert any(line.startswith("Max address space") and str(3 << 30) in line for line in limits.splitlines())
    assert any(line.startswith("Max cpu time") and " 77 " in line for line in limits.splitlines())
    assert "Seccomp:\t2" in status and "NoNewPrivs:\t1" in status


def _cpu_ticks(pid: int) -> dict[int, int]:
    """User-mode CPU ticks of each child process of `pid`."""
    ticks = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                stat = Path(f"/proc/{child}/stat").read_text()
            except FileNotFoundError:
                continue
            ticks[int(child)] = int(stat.rsplit(")", 1)[1].split()[11])
    return ticks


def wait_for_a_spinning_child(pid: int, seconds: float = 0.3) -> None:
    """Until one child of `pid` has used `seconds` more CPU than when this was called."""
    hz = os.sysconf("SC_CLK_TCK")
    before = _cpu_ticks(pid)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if any(t - before.get(child, t) >= seconds * hz for child, t in _cpu_ticks(pid).items()):
            return
        time.sleep(0.02)
    raise AssertionError("no worker of the node started spinning")


def _audit(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_null_store_and_a_runaway_kernel_end_only_their_tenants_worker(lab, tmp_path, connect) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text(lab.policy_text())
    (tmp_path / "revoked.txt").write_text((lab.root / "revoked.txt").read_text())
    with serving_node(lab, tmp_path, "--policy", str(policy)) as (proc, port):
        target = f"127.0.0.1:{port}"
        bob, dave = connect(target, "bob"), connect(target, "dave")
        blease, dlease = lease_of(bob), lease_of(dave)
        bh, dh = alloc(bob, blease, 8), alloc(dave, dlease, 8)
        bob.Write(pb.WriteRequest(lease=blease, handle=bh, data=b"bob-data"))
        boom = load(bob, blease, NULL_STORE_IR, "boom", ["rw"])
        bspin, dspin = (load(c, lease, SPIN_IR, "spin", ["rw", "i64"]) for c, lease in ((bob, blease), (dave, dlease)))
        launch(dave, dlease, dspin, [buf(dh, 8), pb.LaunchArg(i64=10)])  # dave's worker is up
        launch(bob, blease, bspin, [buf(bh, 8), pb.LaunchArg(i64=3)])  # so is bob's

        with pytest.raises(grpc.RpcError) as crashed:
            launch(bob, blease, boom, [buf(bh, 8)])
        assert crashed.value.code() is grpc.StatusCode.ABORTED
        assert BOB in crashed.value.details() and "SIGSEGV" in crashed.value.details(), crashed.value.details()
        launch(dave, dlease, dspin, [buf(dh, 8), pb.LaunchArg(i64=1000)], timeout=1.0)  # within 1 s, on the same node
        never = load(bob, blease, UNREACHABLE_IR, "never", ["rw"])
        with pytest.raises(grpc.RpcError) as trapped:
            launch(bob, blease, never, [buf(bh, 8)])
        # LLVM emits nothing for it: the kernel runs off its end into whatever follows (here: SIGSEGV)
        assert trapped.value.code() is grpc.StatusCode.ABORTED and "died of SIG" in trapped.value.details(), trapped.value.details()
        launch(dave, dlease, dspin, [buf(dh, 8), pb.LaunchArg(i64=1000)], timeout=1.0)

        launch(bob, blease, bspin, [buf(bh, 8), pb.LaunchArg(i64=3)])  # bob's fresh worker is up
        runaway: list[grpc.RpcError] = []
        queued: list[grpc.RpcError] = []

        def run(n: int, timeout: float, into: list[grpc.RpcError]) -> None:
            try:
                launch(bob, blease, bspin, [buf(bh, 8), pb.LaunchArg(i64=n)], timeout=timeout)
            except grpc.RpcError as exc:
                into.append(exc)
        threads = [threading.Thread(target=run, args=(1 << 62, 2.0, runaway))]
        threads[0].start()
        wait_for_a_spinning_child(proc.pid)  # bob's kernel is running; his next launch queues behind it
        threads.append(threading.Thread(target=run, args=(1, 20.0, queued)))
        threads[1].start()
        launch(dave, dlease, dspin, [buf(dh, 8), pb.LaunchArg(i64=1000)], timeout=1.0)
        assert dave.Read(pb.ReadRequest(lease=dlease, handle=dh, length=8)).data == (999).to_bytes(8, "little")
        for thread in threads:
            thread.join(30)
        assert [e.code() for e in runaway] == [grpc.StatusCode.DEADLINE_EXCEEDED]
        # the pending launch behind it failed with the cause, not at its own 20 s deadline
        assert [e.code() for e in queued] == [grpc.StatusCode.ABORTED]
        assert BOB in queued[0].details() and "was killed" in queued[0].details(), queued[0].details()

        # bob's next call gets a fresh worker; his buffer holds what the killed kernel last stored
        launch(bob, blease, bspin, [buf(bh, 8), pb.LaunchArg(i64=5)])
        assert bob.Read(pb.ReadRequest(lease=blease, handle=bh, length=8)).data == (4).to_bytes(8, "little")
        assert code_of(dave.Ping, pb.PingRequest()) == grpc.StatusCode.OK
        # SIGTERM while a kernel spins: the node stops (its workers with it)
        last: list[grpc.RpcError] = []
        threads = [threading.Thread(target=run, args=(1 << 62, 30.0, last))]
        threads[0].start()
        wait_for_a_spinning_child(proc.pid)
        workers = list(_cpu_ticks(proc.pid))
    threads[0].join(30)
    assert proc.returncode == 0  # the node stopped on SIGTERM, as it should
    assert [e.code() for e in last] != [] and not any(Path(f"/proc/{pid}").exists() for pid in workers)
    failures = [r for r in _audit(tmp_path / "audit.jsonl") if r.get("action") == "tenant_worker_failed"]
    # the crash, the trap, the runaway, the launch behind it, the kernel spinning when the node stopped
    assert [r["identity"] for r in failures] == [BOB] * 5, [r["cause"] for r in failures]
    assert "SIGSEGV" in failures[0]["cause"] and "died of SIG" in failures[1]["cause"]
    assert all("deadline" in r["cause"] for r in failures[2:4]) and "when its call ended" in failures[4]["cause"]


def test_a_tenant_whose_worker_keeps_dying_is_held_off_and_told_for_how_long(make_server, connect) -> None:
    from tinydist.base.errors import TenantWorkerFailed
    from tinydist.runtime.remote.errors import from_rpc
    from tinydist.testing import MockClock

    server = make_server()
    clock = MockClock(100.0)
    server.service.tenants.clock = clock  # virtual time: the hold-off is read, never slept
    bob, dave = connect(server, "bob"), connect(server, "dave")
    blease, dlease = lease_of(bob), lease_of(dave)
    bh, dh = alloc(bob, blease, 8), alloc(dave, dlease, 8)
    boom, fine = load(bob, blease, NULL_STORE_IR, "boom", ["rw"]), load(bob, blease, SPIN_IR, "spin", ["rw", "i64"])
    dspin = load(dave, dlease, SPIN_IR, "spin", ["rw", "i64"])
    for _ in range(3):   # three deaths in a row: each launch starts a fresh worker, which dies
        assert code_of(launch, bob, blease, boom, [buf(bh, 8)]) is grpc.StatusCode.ABORTED
    started = server.audit_records()
    with pytest.raises(grpc.RpcError) as held:
        launch(bob, blease, fine, [buf(bh, 8), pb.LaunchArg(i64=3)])
    assert held.value.code() is grpc.StatusCode.ABORTED
    assert "died 3 times in a row (last: died of SIGSEGV)" in held.value.details() and "1.0 s more" in held.value.details()
    mapped = from_rpc(held.value, "Launch", server.target)
    assert isinstance(mapped, TenantWorkerFailed) and mapped.identity == BOB and not mapped.fatal
    assert len(started) < len(server.audit_records())
    assert server.audit_records()[-2]["action"] == "tenant_request_failed"   # then the decision record
    launch(dave, dlease, dspin, [buf(dh, 8), pb.LaunchArg(i64=10)], timeout=5.0)   # another tenant is not held off
    clock.advance(1.0)
    assert code_of(launch, bob, blease, boom, [buf(bh, 8)]) is grpc.StatusCode.ABORTED   # a fourth death: 2 s now
    clock.advance(1.5)
    assert "0.5 s more" in (pytest.raises(grpc.RpcError, launch, bob, blease, fine, [buf(bh, 8), pb.LaunchArg(i64=3)])
                            .value.details())
    clock.advance(0.5)
    launch(bob, blease, fine, [buf(bh, 8), pb.LaunchArg(i64=3)])   # a launch that completes forgives the deaths
    assert server.service.tenants.hold_off(BOB) == 0.0 and BOB not in server.service.tenants.deaths
