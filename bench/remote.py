"""Remote device access against a plain grpc.aio baseline, same process, same mutual TLS.

    python bench/remote.py [--repeats 5] [--calls 1000] [--mib 64]

- latency: a small unary RPC through the full gate (identity, policy, quota, audit record) —
  `Ping` — next to the same Ping (PingRequest in, PingReply out, the client's work identical) served
  by a bare unary handler on a plain grpc.aio server with the same certificates;
- throughput: 64 MiB copy-in / copy-out through the engine's remote device (`dev.copyin`,
  `dev.copyout`: handle checks, bounds, device queue) next to a plain client-stream sink and
  server-stream source moving the same chunks (the buffer is a tenant segment: memfd memory mapped
  by the node and, for kernels, by the caller's worker process);
- launch: a one-store kernel's Launch round trip with the kernel in the caller's tenant worker
  (`tinydist.nodes.tenants`, the default) next to a node that runs it in its own process
  (`isolate_tenants=False`, the design before issue 23): the latency the worker adds.
Medians over repeats; ratios printed. Targets: latency ≤ 1.3× echo; throughput ≥ 70 % of plain.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tinydist.nodes.audit import AuditLog  # noqa: E402
from tinydist.nodes.server import RemoteServer, server_options  # noqa: E402
from tinydist.nodes.service import ServerConfig  # noqa: E402
from tinydist.runtime.remote.client import CHUNK_BYTES, ClientCredentials, secure_channel  # noqa: E402
from tinydist.runtime.remote.device import RemoteDevice  # noqa: E402
from tinydist.security import pki  # noqa: E402
from tinydist.security.pki import ServerCredentials  # noqa: E402
from tinydist.transports.pci_remote._generated import device_pb2 as pb  # noqa: E402


def _identity(x: bytes) -> bytes:
    return x


class Loop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro):  # noqa: ANN001, ANN201
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def bench_node_pki(root: Path) -> tuple[ClientCredentials, ServerCredentials, ServerConfig, AuditLog]:
    """A CA and one operator client in `root`, the policy's rate limits lifted so that the bench measures
    the path, not the limiter; the server's credentials, a loopback config and the audit log."""
    pki.init(root)
    issued = pki.issue(root, "bench")
    policy = (root / "policy.toml").read_text().replace(
        "[identities]\n", f'[identities]\n"{issued.identity}" = "operator"\n').replace(
        "rpc_per_second = 2000", "rpc_per_second = 1000000").replace("rpc_burst = 4000", "rpc_burst = 1000000")
    (root / "policy.toml").write_text(policy)
    creds = ClientCredentials(issued.cert_path.read_bytes(), issued.key_path.read_bytes(), (root / "ca.pem").read_bytes())
    return creds, ServerCredentials.load(root), ServerConfig(listen="127.0.0.1:0"), AuditLog(root / "audit.jsonl")


async def start_plain(pki_: ServerCredentials, config: ServerConfig, chunks: list[bytes]) -> tuple[grpc.aio.Server, int]:
    async def unary(request: pb.PingRequest, context) -> pb.PingReply:  # noqa: ANN001
        return pb.PingReply(payload=request.payload)

    async def sink(requests, context) -> bytes:  # noqa: ANN001
        total = 0
        async for chunk in requests:
            total += len(chunk)
        return total.to_bytes(8, "little")

    async def source(request: bytes, context):  # noqa: ANN001, ANN201
        for chunk in chunks:
            yield chunk

    handler = grpc.method_handlers_generic_handler("bench.Echo", {
        # the node's Ping without the node: the same messages parsed and built, a unary handler
        "Unary": grpc.unary_unary_rpc_method_handler(unary, pb.PingRequest.FromString, pb.PingReply.SerializeToString),
        "Sink": grpc.stream_unary_rpc_method_handler(sink, _identity, _identity),
        "Source": grpc.unary_stream_rpc_method_handler(source, _identity, _identity),
    })
    server = grpc.aio.server(options=server_options(config))
    server.add_generic_rpc_handlers((handler,))
    creds = grpc.ssl_server_credentials([(pki_.key, pki_.cert)], root_certificates=pki_.ca, require_client_auth=True)
    port = server.add_secure_port("127.0.0.1:0", creds)
    await server.start()
    return server, port


TINY_IR = "define void @one(ptr %p) {\n  store i64 1, ptr %p\n  ret void\n}\n"


def launch_latency(stub, calls: int, repeats: int) -> float:  # noqa: ANN001
    """Median seconds of a Launch round trip of a one-store kernel."""
    lease = stub.OpenLease(pb.OpenLeaseRequest(), timeout=10).lease
    handle = stub.Allocate(pb.AllocateRequest(lease=lease, device="CPU:0", nbytes=8), timeout=10).handle
    program = stub.LoadProgram(pb.LoadProgramRequest(lease=lease, device="CPU:0", kind=pb.PROGRAM_KIND_ENGINE_KERNEL,
                                                     llvm_ir=TINY_IR, entry="one", signature=["w"]), timeout=60).program_id
    request = pb.LaunchRequest(lease=lease, device="CPU:0", program_id=program,
                               args=[pb.LaunchArg(buffer=pb.BufferArg(handle=handle, length=8))])

    def once() -> None:
        stub.Launch(request, timeout=10)
    timed(once, 100)  # warm up (the first launch starts the worker)
    result = statistics.median(timed(once, calls) for _ in range(repeats))
    stub.CloseLease(pb.CloseLeaseRequest(lease=lease), timeout=10)
    return result


def timed(fn, n: int) -> float:  # noqa: ANN001
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--mib", type=int, default=64)
    args = parser.parse_args()
    nbytes = args.mib << 20

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        creds, server_pki, config, audit = bench_node_pki(root)
        data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
        chunks = [data[i:i + CHUNK_BYTES].tobytes() for i in range(0, nbytes, CHUNK_BYTES)]

        loop = Loop()
        remote = loop.run(RemoteServer.start(config, server_pki, root / "policy.toml", audit))
        in_node = None
        plain, plain_port = loop.run(start_plain(server_pki, config, chunks))
        try:
            plain_channel = secure_channel(f"127.0.0.1:{plain_port}", creds)
            echo = plain_channel.unary_unary("/bench.Echo/Unary", pb.PingRequest.SerializeToString, pb.PingReply.FromString)
            sink = plain_channel.stream_unary("/bench.Echo/Sink", _identity, _identity)
            source = plain_channel.unary_stream("/bench.Echo/Source", _identity, _identity)
            device = RemoteDevice(f"remote://127.0.0.1:{remote.port}/CPU:0", creds)
            asyncio.run(device.open())
            stub = device.session.stub
            def do_echo() -> None:  # the client's work exactly as do_ping's: a message built, sent, its reply parsed
                echo(pb.PingRequest(payload=b"x" * 16), timeout=10)

            def do_ping() -> None:
                stub.Ping(pb.PingRequest(payload=b"x" * 16), timeout=10)

            for fn in (do_echo, do_ping):
                timed(fn, 200)  # warm up
            lat_plain, lat_remote = [], []
            for _ in range(args.repeats):
                lat_plain.append(timed(do_echo, args.calls))
                lat_remote.append(timed(do_ping, args.calls))

            buffer = device.allocator.alloc(nbytes)
            out = np.empty(nbytes, np.uint8)
            t_in_plain, t_in, t_out_plain, t_out = [], [], [], []
            for r in range(args.repeats + 1):
                start = time.perf_counter()
                sink(iter(chunks), timeout=60)
                a = time.perf_counter() - start
                start = time.perf_counter()
                device.copyin(buffer, data).wait_blocking(60)
                b = time.perf_counter() - start
                start = time.perf_counter()
                received = sum(len(c) for c in source(b"", timeout=60))
                c = time.perf_counter() - start
                start = time.perf_counter()
                asyncio.run(device.copyout(buffer, out, timeout=60))
                d = time.perf_counter() - start
                if received != nbytes or not np.array_equal(out, data):
                    raise SystemExit("data mismatch")
                if r:  # the first round warms up
                    t_in_plain.append(a)
                    t_in.append(b)
                    t_out_plain.append(c)
                    t_out.append(d)
            buffer.free()
            launch_worker = launch_latency(stub, args.calls, args.repeats)
            # started only now: a second server on the loop would slow the figures above
            in_node = loop.run(RemoteServer.start(replace(config, isolate_tenants=False), server_pki, root / "policy.toml", audit))
            in_node_device = RemoteDevice(f"remote://127.0.0.1:{in_node.port}/CPU:0", creds)
            asyncio.run(in_node_device.open())
            launch_in_node = launch_latency(in_node_device.session.stub, args.calls, args.repeats)
            asyncio.run(in_node_device.aclose())
            asyncio.run(device.aclose())
            plain_channel.close()
        finally:
            loop.run(plain.stop(0))
            loop.run(remote.stop(0))
            if in_node is not None:
                loop.run(in_node.stop(0))
            loop.close()
            audit.close()

    med = statistics.median
    gb = nbytes / 1e9
    print(f"remote device access vs plain grpc.aio, same mutual TLS, loopback; medians of {args.repeats} repeats")
    print(f"unary round trip      plain Ping {med(lat_plain) * 1e6:8.1f} us   remote Ping (gate+audit) {med(lat_remote) * 1e6:8.1f} us"
          f"   ratio {med(lat_remote) / med(lat_plain):.2f}x  (target <= 1.30x)  added {(med(lat_remote) - med(lat_plain)) * 1e6:+.1f} us")
    print(f"copy-in  {args.mib} MiB      plain stream {gb / med(t_in_plain):6.2f} GB/s   remote copyin  {gb / med(t_in):6.2f} GB/s"
          f"   ratio {med(t_in_plain) / med(t_in) * 100:5.1f}%  (target >= 70%)")
    print(f"copy-out {args.mib} MiB      plain stream {gb / med(t_out_plain):6.2f} GB/s   remote copyout {gb / med(t_out):6.2f} GB/s"
          f"   ratio {med(t_out_plain) / med(t_out) * 100:5.1f}%  (target >= 70%)")
    print(f"launch round trip     kernel in the node {launch_in_node * 1e6:8.1f} us   in the tenant worker {launch_worker * 1e6:8.1f} us"
          f"   added {(launch_worker - launch_in_node) * 1e6:+.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
