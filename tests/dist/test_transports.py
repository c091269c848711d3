"""Transport conformance: the same suite (transports.base.check_link_pair) against shm and tcp links."""

from __future__ import annotations

import socket

import anyio
import pytest

from tinydist.transports.base import PeerFailed, check_link_pair, check_peer_death, serving
from tinydist.transports.shm import ShmLink
from tinydist.transports.tcp import TcpLink, connected_pair

from .helpers import shm_entries


async def make_pair(kind: str, failures: list) -> tuple:
    s0, s1 = await connected_pair()
    record = lambda peer, reason, blamed: failures.append((peer, blamed))   # noqa: E731
    if kind == "tcp":
        return TcpLink(s0, 1, record), TcpLink(s1, 0, record)
    links: dict[int, ShmLink] = {}

    async def hs(sock, rank, peer):
        links[rank] = await ShmLink.handshake(sock, rank, peer, "conformance", on_failure=record, timeout=10)

    async with anyio.create_task_group() as tg:
        tg.start_soon(hs, s0, 0, 1)
        tg.start_soon(hs, s1, 1, 0)
    return links[0], links[1]


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_conformance(kind, no_shm_leak):
    async def main():
        failures: list = []
        a, b = await make_pair(kind, failures)
        assert a.kind == kind
        if kind == "shm":    # names are unlinked as soon as both sides mapped them
            assert not {n for n in shm_entries() if "conformance" in n}
        async with serving(a, b):
            await check_link_pair(a, b)
        assert failures == []             # a clean close is not a failure
        with pytest.raises(Exception):
            await a.send(b"after close")
    anyio.run(main)


def kill(link) -> None:
    link.sock.shutdown(socket.SHUT_RDWR)
    link.sock.close()


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_peer_death_is_noticed(kind, no_shm_leak):
    async def main():
        failures: list = []
        a, b = await make_pair(kind, failures)
        async with serving(a, b):
            exc = await check_peer_death(a, lambda: kill(b))   # no BYE: like a killed process
            assert isinstance(exc, PeerFailed) and exc.blamed == 1
            assert (1, 1) in failures
    anyio.run(main)


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_abort_frame_names_the_failed_rank(kind, no_shm_leak):
    async def main():
        failures: list = []
        a, b = await make_pair(kind, failures)
        async with serving(a, b):
            await b.abort(7)
            with anyio.fail_after(5):
                with pytest.raises(PeerFailed, match="rank 7 failed"):
                    async with a.recv():
                        pass
            assert (1, 7) in failures
    anyio.run(main)
