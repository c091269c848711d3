"""Rendezvous: ranks find each other through a coordinator, then connect a full mesh of links.

The coordinator is a small TCP/JSON-lines server run by rank 0 (on the socket `tinydist launch`
hands it, or bound at TINYDIST_COORDINATOR; either way under `tinydist.security.bind`'s bind policy:
loopback unless TINYDIST_COORDINATOR_ALLOW_REMOTE=1). Each rank sends one line

    {"rank": r, "world_size": n, "host": host_key, "addr": [ip, port]}

and, once all n arrived and agree, every rank gets the table back (or an error naming the
disagreement). The coordinator then closes: liveness afterwards comes from the mesh itself (every
pair of ranks holds a socket, and a dead process's sockets are closed by the kernel).

Ranks listen on the address they reach the coordinator from (127.0.0.1 for a loopback coordinator),
rank j connects to every rank i < j and introduces itself with `MAGIC, rank, job`. Pairs on one host
(same hostname and boot id) get a shared-memory link unless TINYDIST_TRANSPORT says otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import struct
from pathlib import Path
from typing import Any

import anyio

from tinydist.base.config import settings
from tinydist.base.logs import get_logger
from tinydist.dist.errors import CollectiveMismatch, CollectiveTimeout
from tinydist.security.bind import bind_policy, parse_host_port
from tinydist.transports.base import FailureCallback, Link, PeerFailed, TransportError
from tinydist.transports.shm import ShmLink
from tinydist.transports.tcp import TcpLink, recv_exactly

HELLO = struct.Struct("<4sI16s")
MAGIC = b"TDST"


def host_key() -> str:
    boot = Path("/proc/sys/kernel/random/boot_id")
    return f"{socket.gethostname()}/{boot.read_text().strip() if boot.exists() else '?'}"


def parse_coordinator(text: str) -> tuple[str, int]:
    """(host, port) of a TINYDIST_COORDINATOR value (`host:port`, `[::1]:port`; a missing host is loopback)."""
    return parse_host_port(text, what="TINYDIST_COORDINATOR", default_host="127.0.0.1")


def _bindable(host: str, port: int, what: str) -> tuple[str, int]:
    """`tinydist.security.bind`'s bind policy for the rendezvous and the mesh: loopback unless
    TINYDIST_COORDINATOR_ALLOW_REMOTE=1 (neither authenticates its peers), never the wildcard, a
    host name resolved once (the launch contract names hosts on Slurm and Kubernetes)."""
    return bind_policy(host, port, loopback_only=settings.COORDINATOR_ALLOW_REMOTE != "1", resolve=True, what=what,
                       remote_hint="the rendezvous has no authentication; set TINYDIST_COORDINATOR_ALLOW_REMOTE=1 "
                                   "where the network between the ranks is trusted, or use a loopback coordinator",
                       wildcard_hint="set TINYDIST_COORDINATOR to the address the other ranks reach")


def coordinator_listener(address: tuple[str, int]) -> socket.socket:
    """Rank 0's rendezvous socket, bound at `address` under the bind policy and listening."""
    host, port = _bindable(*address, what="TINYDIST_COORDINATOR host")
    return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET, reuse_port=False)


async def serve_coordinator(listener: socket.socket, world: int, timeout: float) -> None:
    """Collect `world` registrations, check them, send everyone the table, close. Bounded by `timeout`."""
    log = get_logger(component="coordinator")
    arrived: dict[int, tuple[dict[str, Any], asyncio.StreamWriter]] = {}
    errors: list[str] = []
    all_in = anyio.Event()
    writers: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        try:
            hello = json.loads(await reader.readline())
            rank = hello.get("rank")
            if hello.get("world_size") != world:
                errors.append(f"rank {rank} says world_size={hello.get('world_size')}, rank 0 says {world}")
            elif not isinstance(rank, int) or not 0 <= rank < world:
                errors.append(f"rank {rank!r} is outside 0..{world - 1}")
            elif rank in arrived:
                errors.append(f"rank {rank} registered twice")
            arrived[rank] = (hello, writer)
            if len(arrived) >= world or errors:
                all_in.set()
            await all_in.wait()
            await reader.read()          # hold the connection until the coordinator closes it
        except (OSError, ValueError):
            pass

    listener.setblocking(False)
    server = await asyncio.start_server(handle, sock=listener)
    try:
        with anyio.move_on_after(timeout):
            await all_in.wait()
        missing = sorted(set(range(world)) - set(arrived)) if not all_in.is_set() else []
        if missing:
            errors.append(f"ranks {missing} did not register within {timeout:g} s")
        job = secrets.token_hex(4)
        reply: dict[str, Any] = {"error": "; ".join(errors), "missing": missing} if errors else {
            "job": job, "peers": {str(r): hello for r, (hello, _) in arrived.items()}}
        line = (json.dumps(reply) + "\n").encode()
        for _, writer in arrived.values():
            with contextlib.suppress(OSError):
                writer.write(line)
                await writer.drain()
        log.debug("rendezvous", world=world, error=reply.get("error"))
    finally:
        for writer in writers:
            writer.close()
        server.close()
        with anyio.move_on_after(2):
            await server.wait_closed()


async def register(coordinator: tuple[str, int], rank: int, world: int, timeout: float) -> tuple[dict[str, Any], socket.socket]:
    """Open our mesh listener, register with the coordinator (retrying until it is up), return (table, listener)."""
    deadline = anyio.current_time() + timeout
    delay = 0.01
    while True:
        try:
            reader, writer = await asyncio.open_connection(*coordinator)
            break
        except OSError as exc:
            if anyio.current_time() + delay > deadline:
                raise TransportError(f"rank {rank}: no coordinator at {coordinator[0]}:{coordinator[1]} within "
                                     f"{timeout:g} s ({exc}); is rank 0 running, at TINYDIST_COORDINATOR?") from exc
            await anyio.sleep(delay)
            delay = min(delay * 2, 0.25)
    try:
        local_ip, _ = _bindable(writer.get_extra_info("sockname")[0], 0, what="mesh listener host")
        listener = socket.socket(socket.AF_INET6 if ":" in local_ip else socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((local_ip, 0))
        listener.listen(max(world, 8))
        listener.setblocking(False)
        hello = {"rank": rank, "world_size": world, "host": host_key(), "addr": list(listener.getsockname()[:2])}
        writer.write((json.dumps(hello) + "\n").encode())
        await writer.drain()
        with anyio.fail_after(max(0.0, deadline - anyio.current_time()) + 1):
            line = await reader.readline()
        if not line:
            listener.close()
            raise TransportError(f"rank {rank}: the coordinator closed before the rendezvous completed")
        try:
            table = json.loads(line)
        except ValueError as exc:
            listener.close()
            raise TransportError(f"rank {rank}: the coordinator at {coordinator[0]}:{coordinator[1]} answered "
                                 f"{line[:80]!r}, not JSON ({exc}); is it a tinydist coordinator?") from exc
        if "error" in table:
            listener.close()
            if table.get("missing"):
                raise CollectiveTimeout(table["missing"], f"rendezvous failed on rank {rank}: {table['error']} "
                                                          f"(TINYDIST_COLLECTIVE_TIMEOUT); did those ranks start?")
            raise CollectiveMismatch(f"rendezvous failed on rank {rank}: {table['error']}")
        return table, listener
    finally:
        writer.close()


async def connect_mesh(rank: int, world: int, table: dict[str, Any], listener: socket.socket, transport: str,
                       on_failure: FailureCallback, timeout: float) -> dict[int, Link]:
    """Connect to every peer; return a link per peer rank."""
    loop = asyncio.get_running_loop()
    job = table["job"]
    peers = {int(r): info for r, info in table["peers"].items()}
    socks: dict[int, socket.socket] = {}
    token = job.encode()[:16].ljust(16, b"\0")
    try:
        with anyio.move_on_after(timeout) as scope:
            async def accept_all() -> None:
                while len([p for p in socks if p > rank]) < world - 1 - rank:
                    sock, _ = await loop.sock_accept(listener)
                    sock.setblocking(False)
                    head = bytearray(HELLO.size)
                    try:
                        said = await recv_exactly(sock, memoryview(head))
                    except OSError:          # reset before its hello: not a peer we can use
                        said = False
                    if not said:
                        sock.close()
                        continue
                    magic, peer, tok = HELLO.unpack(head)
                    if magic != MAGIC or tok != token or not rank < peer < world or peer in socks:
                        sock.close()
                        continue
                    socks[peer] = sock

            async def connect(peer: int) -> None:
                address = tuple(peers[peer]["addr"])
                sock = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET, socket.SOCK_STREAM)
                sock.setblocking(False)
                try:
                    await loop.sock_connect(sock, address)
                    await loop.sock_sendall(sock, HELLO.pack(MAGIC, rank, token))
                except OSError as exc:
                    sock.close()
                    raise PeerFailed(peer, f"rank {rank} cannot connect to rank {peer} at {address[0]}:{address[1]} "
                                           f"({exc.strerror or exc}); is rank {peer} alive and reachable?") from exc
                socks[peer] = sock

            async with anyio.create_task_group() as tg:
                tg.start_soon(accept_all)
                for peer in range(rank):
                    tg.start_soon(connect, peer)

            links: dict[int, Link] = {}

            async def make(peer: int) -> None:
                try:
                    await make_link(peer)
                except OSError as exc:     # the peer's end reset: it died after the rendezvous
                    raise PeerFailed(peer, f"rank {rank} lost rank {peer} while setting up their link "
                                           f"({type(exc).__name__}: {exc}); is rank {peer} alive?") from exc

            async def make_link(peer: int) -> None:
                same = peers[peer]["host"] == peers[rank]["host"]
                if transport == "shm" and not same:
                    raise ValueError(f"TINYDIST_TRANSPORT=shm, but rank {peer} is on another host")
                if transport == "shm" or (transport == "auto" and same):
                    links[peer] = await ShmLink.handshake(socks[peer], rank, peer, job, on_failure=on_failure, timeout=timeout)
                elif transport in ("rdma", "auto"):
                    # between hosts: BNXT RDMA when both sides have a NIC (real, or the softbnxt
                    # model where TINYDIST_RDMA_NIC=soft), else TCP with the reason logged
                    from tinydist.transports.rdma_bnxt.transport import open_link
                    links[peer] = await open_link(socks[peer], rank, peer, job, on_failure=on_failure, timeout=timeout)
                else:
                    links[peer] = TcpLink(socks[peer], peer, on_failure)

            async with anyio.create_task_group() as tg:
                for peer in socks:
                    tg.start_soon(make, peer)
        if scope.cancelled_caught:
            absent = sorted(set(range(world)) - {rank} - set(socks)) or sorted(set(socks) - set(links))
            raise CollectiveTimeout(absent, f"rank {rank} could not connect to ranks {absent} within {timeout:g} s "
                                            f"after the rendezvous; did they die meanwhile? (TINYDIST_COLLECTIVE_TIMEOUT)")
        return dict(sorted(links.items()))
    except BaseException:
        for sock in socks.values():
            sock.close()
        raise
    finally:
        listener.close()
