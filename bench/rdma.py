"""RDMA WRITE through the software NIC model between two processes, next to the plain TCP transport.

    .venv/bin/python bench/rdma.py [--quick] [--json PATH]

Two processes on loopback. Each holds a softbnxt NIC (driver + model; the model's wire is a loopback
TCP connection between the two NICs) and, for the baseline, a `tinydist.transports.tcp.TcpLink` over its own
socket. Measured in the same run, medians of repeats, timed on rank 0:

- latency:  an 8-byte RDMA WRITE posted and completed (its ACK is back: a round trip) vs a TCP
            8-byte ping-pong round trip; and the RdmaLink ping-pong (inline SEND) vs the TcpLink one.
- throughput: RDMA WRITEs of 4 MiB (4 in flight) until all completed vs TcpLink messages of 4 MiB until
            the receiver's 1-byte ack; and RdmaLink vs TcpLink streaming 512 KiB (the chunk size the
            collectives use), 4 MiB and 16 MiB messages (larger than the 8 MiB ring: chunked, copied out).
The ratio printed is the model's overhead: model time / TCP time (1.00x = as fast as plain TCP).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))


async def _connect(rank: int, port: int, fd: int | None, count: int) -> list[socket.socket]:
    loop = asyncio.get_running_loop()
    socks = []
    if rank == 0:
        listener = socket.socket(fileno=fd)
        listener.setblocking(False)
        for _ in range(count):
            s, _ = await asyncio.wait_for(loop.sock_accept(listener), 20)
            socks.append(s)
        listener.close()
    else:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            await asyncio.wait_for(loop.sock_connect(s, ("127.0.0.1", port)), 20)
            await loop.sock_sendall(s, b"x")
            socks.append(s)
    if rank == 0:   # order the accepted sockets by the byte each connect sent (they arrive in order anyway)
        for s in socks:
            await loop.sock_recv(s, 1)
    for s in socks:
        s.setblocking(False)
    return socks


async def worker(rank: int, port: int, fd: int | None, quick: bool) -> dict:
    import numpy as np

    from tinydist.transports.base import serving
    from tinydist.transports.rdma_bnxt.transport import RdmaLink, close_process_nic, open_link
    from tinydist.transports.tcp import TcpLink

    tcp_sock, rdma_sock = await _connect(rank, port, fd, 2)
    tcp = TcpLink(tcp_sock, 1 - rank)
    rdma = await open_link(rdma_sock, rank, 1 - rank, timeout=20)
    if not isinstance(rdma, RdmaLink):
        raise SystemExit(f"expected an RDMA link, got {rdma.kind}: {getattr(rdma, 'fallback_reason', '')}")
    reps = 3 if quick else 7
    pings = 100 if quick else 300
    out: dict = {}

    async def pingpong(link) -> float:
        msg = np.zeros(8, np.uint8)
        t0 = time.perf_counter()
        for _ in range(pings):
            if rank == 0:
                await link.send(msg)
                async with link.recv():
                    pass
            else:
                async with link.recv():
                    pass
                await link.send(msg)
        return (time.perf_counter() - t0) / pings

    async def stream(link, size: int, count: int) -> float:
        data = np.ones(size, np.uint8)
        t0 = time.perf_counter()
        if rank == 0:
            for _ in range(count):
                await link.send(data)
            async with link.recv():
                pass
        else:
            for _ in range(count):
                async with link.recv():
                    pass
            await link.send(b"k")
        return (time.perf_counter() - t0) / (size * count)

    async with serving(tcp, rdma):
        # ---- links: ping-pong and streams; TCP and RDMA repeats alternate so drift hits both alike
        pairs = (("tcp", tcp), ("rdma", rdma))
        cases = [("lat", lambda link: pingpong(link))] + [
            (key, lambda link, size=size, count=count: stream(link, size, count // 2 if quick else count))
            for key, size, count in (("bw512k", 512 << 10, 64), ("bw4", 4 << 20, 16), ("bw16", 16 << 20, 8))]
        for key, fn in cases:
            samples: dict[str, list[float]] = {"tcp": [], "rdma": []}
            for _, link in pairs:
                await fn(link)                                   # warm-up
            for _ in range(reps):
                for tag, link in pairs:
                    samples[tag].append(await fn(link))
            for tag in samples:
                out[f"{key}_{tag}"] = statistics.median(samples[tag])
        # ---- raw RDMA WRITE (driver level) into the peer's registered slots, while the link is idle
        if rank == 0:
            qp, mr = rdma.qp, rdma.data_out
            va, rkey = rdma.peer_in
            mr.buf[:] = 7

            async def write_lat() -> float:
                t0 = time.perf_counter()
                for _ in range(pings):
                    await qp.wait_send(qp.post_write(mr, 0, 8, va, rkey), 5)
                return (time.perf_counter() - t0) / pings

            async def write_bw(size: int, count: int, window: int = 4) -> float:
                t0 = time.perf_counter()
                posted = []
                for _ in range(count):
                    if len(posted) >= window:
                        await qp.wait_send(posted.pop(0), 10)
                    posted.append(qp.post_write(mr, 0, size, va, rkey))
                for i in posted:
                    await qp.wait_send(i, 10)
                return (time.perf_counter() - t0) / (size * count)

            await write_lat()
            await write_bw(4 << 20, 4)
            lat_w, bw_w, lat_t, bw_t = [], [], [], []
            for _ in range(reps):                       # raw WRITE repeats alternate with TCP ones (rank 1 serves those)
                lat_w.append(await write_lat())
                lat_t.append(await pingpong(tcp))
                bw_w.append(await write_bw(4 << 20, 16 if quick else 32))
                bw_t.append(await stream(tcp, 4 << 20, 16 if quick else 32))
            out["lat_write"], out["bw4_write"] = statistics.median(lat_w), statistics.median(bw_w)
            out["lat_tcp_w"], out["bw4_tcp_w"] = statistics.median(lat_t), statistics.median(bw_t)
            await rdma.send(b"done")
        else:
            for _ in range(reps):
                await pingpong(tcp)
                await stream(tcp, 4 << 20, 16 if quick else 32)
            async with rdma.recv():
                pass
    await close_process_nic()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", nargs=3, metavar=("RANK", "PORT", "FD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import json
        rank, port, fd = int(args.worker[0]), int(args.worker[1]), args.worker[2]
        result = asyncio.run(asyncio.wait_for(worker(rank, port, None if fd == "-" else int(fd), args.quick), 300))
        if rank == 0:
            print("RESULT " + json.dumps(result), flush=True)
        os._exit(0)

    from _common import Report
    report = Report("rdma", args.json)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    env = {**os.environ, "TINYDIST_RDMA_NIC": "soft", "PYTHONPATH": str(ROOT)}
    extra = ["--quick"] if args.quick else []
    procs = [subprocess.Popen([sys.executable, __file__, *extra, "--worker", str(r), str(port), str(listener.fileno()) if r == 0 else "-"],
                              env=env, pass_fds=(listener.fileno(),) if r == 0 else (), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in (0, 1)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    listener.close()
    if any(p.returncode for p in procs):
        raise SystemExit("worker failed:\n" + "\n".join(o[-3000:] for o in outs))
    import json
    r = json.loads(next(line for line in outs[0].splitlines() if line.startswith("RESULT "))[7:])
    report.note("RDMA over softbnxt (2 processes, loopback) vs transports.tcp.TcpLink; overhead = model time / TCP time")

    def lat(name: str, key: str, base: str, label: str) -> None:
        report.add(name, r[key] * 1e6, "us", baseline=r[base] * 1e6, baseline_label=label, ratio=r[key] / r[base],
                   ratio_label="overhead", repeats=3 if args.quick else 7)

    def bw(name: str, key: str, base: str, label: str) -> None:
        report.add(name, 1 / r[key] / 1e9, "GB/s", baseline=1 / r[base] / 1e9, baseline_label=label,
                   ratio=r[key] / r[base], ratio_label="overhead", repeats=3 if args.quick else 7)

    lat("latency/rdma_write_8B_completion", "lat_write", "lat_tcp_w", "tcp link ping-pong RTT")
    lat("latency/rdma_link_pingpong_8B", "lat_rdma", "lat_tcp", "tcp link ping-pong")
    bw("throughput/rdma_write_4MiB", "bw4_write", "bw4_tcp_w", "tcp link 4 MiB")
    bw("throughput/rdma_link_512KiB", "bw512k_rdma", "bw512k_tcp", "tcp link 512 KiB")
    bw("throughput/rdma_link_4MiB", "bw4_rdma", "bw4_tcp", "tcp link 4 MiB")
    bw("throughput/rdma_link_16MiB", "bw16_rdma", "bw16_tcp", "tcp link 16 MiB")
    report.finish()


if __name__ == "__main__":
    main()
