"""Elastic rendezvous rounds (Membership.rendezvous, on a virtual clock) and sharded checkpoints
resharded to another world size (checkpoint.load_resharded, against numpy.array_split of the
global array)."""

from __future__ import annotations

import numpy as np
import pytest

from tinydist.scheduler import checkpoint as ck
from tinydist.scheduler.errors import MembershipError
from tinydist.scheduler.membership import Membership


def _cluster(n: int, now: list[float]) -> Membership:
    m = Membership(0.1, 3, clock=lambda: now[0])
    for i in range(n):
        m.join(f"node-{i}", f"host-{i}", ["CPU:0"], rank=i)
    return m


def _inc(m: Membership, node: str) -> int:
    return m.members[node].incarnation


def _ask(m: Membership, node: str, lo: int = 2, hi: int = 3, last_call: float = 1.0):
    return m.rendezvous(node, _inc(m, node), lo, hi, last_call)


def test_a_round_closes_at_max_size_with_ranks_in_join_rank_order():
    now = [0.0]
    m = _cluster(3, now)
    for node in ("node-2", "node-0"):
        assert not _ask(m, node).closed
    r = _ask(m, "node-1")
    assert r.closed and r.number == 1 and r.ranks == {"node-0": 0, "node-1": 1, "node-2": 2}
    assert [x.node_id for x in m.round_members(r.ranks)] == ["node-0", "node-1", "node-2"]
    assert _ask(m, "node-2") is r                         # asking again: the same closed round


def test_at_min_size_a_round_waits_for_last_call_after_the_last_arrival():
    now = [0.0]
    m = _cluster(3, now)
    _ask(m, "node-0")
    now[0] = 5.0
    r = _ask(m, "node-2")                                   # min 2 in: last call runs from here
    now[0] = 5.9
    assert not m.close_round()
    now[0] = 6.0
    assert m.close_round() and r.ranks == {"node-0": 0, "node-2": 1}


def test_a_round_counts_only_incarnations_that_joined_since_it_opened():
    """The crashed job's incarnations are still alive in the membership (their heartbeats not yet
    missed): the restarted job's round names none of them."""
    now = [0.0]
    m = _cluster(3, now)
    for node in ("node-0", "node-1", "node-2"):
        first = _ask(m, node)
    assert first.closed and first.number == 1
    old = {node: _inc(m, node) for node in m.members}
    # node-2 dies (its record stays alive until swept); node-0 and node-1 restart as new processes
    for node in ("node-0", "node-1"):
        m.join(node, node.replace("node", "host"), ["CPU:0"], rank=int(node[-1]))
        assert _inc(m, node) != old[node]
    second = _ask(m, "node-0")
    assert second.number == 2 and not second.closed
    with pytest.raises(MembershipError, match="incarnation .* cannot enter a rendezvous round"):
        m.rendezvous("node-1", old["node-1"], 2, 3, 1.0)    # the superseded process
    _ask(m, "node-1")
    assert m.members["node-2"].state == "alive"             # not declared dead yet: it must not count anyway
    now[0] += 1.0
    assert m.close_round() and second.ranks == {"node-0": 0, "node-1": 1}


def test_a_participant_that_dies_or_is_superseded_while_the_round_is_open_drops_out():
    now = [0.0]
    m = _cluster(3, now)
    _ask(m, "node-0")
    _ask(m, "node-1", last_call=10.0)
    m.join("node-1", "host-1", ["CPU:0"], rank=1)           # restarted before the round closed
    now[0] = 0.35                                           # node-0 and node-2 silent past 3 x 0.1 s ...
    m.heartbeat("node-1", _inc(m, "node-1"))
    m.sweep()
    assert m.members["node-0"].state == "dead"
    now[0] = 20.0
    assert not m.close_round() and m.round is not None and m.round.participants == {}


def test_rounds_refuse_bad_sizes_and_disagreement():
    now = [0.0]
    m = _cluster(2, now)
    with pytest.raises(MembershipError, match="need 1 <= min <= max"):
        _ask(m, "node-0", 3, 2)
    _ask(m, "node-0", 1, 2)
    with pytest.raises(MembershipError, match="every member must ask for the same"):
        _ask(m, "node-1", 2, 2)
    with pytest.raises(MembershipError, match="not a member"):
        m.rendezvous("node-9", 1, 1, 2, 1.0)


def _write(directory, step: int, world: int, full: dict[str, np.ndarray], rows: bool) -> None:
    for r in range(world):
        ck.save_shard(directory, step, r, {k: np.array_split(v, world)[r] for k, v in full.items()} | {"lr": np.float64(0.1)})
    meta = {"rows": {k: [len(p) for p in np.array_split(v, world)] for k, v in full.items()}} if rows else None
    ck.commit(directory, step, world, meta)


@pytest.mark.parametrize("old,new", [(3, 2), (2, 3), (3, 1), (1, 3), (4, 4), (5, 3)])
@pytest.mark.parametrize("rows", [True, False])
def test_load_resharded_equals_array_split_of_the_global_arrays(tmp_path, old, new, rows):
    rng = np.random.default_rng(old * 10 + new)
    full = {"w": rng.standard_normal((17, 3)), "m": rng.standard_normal(17), "tiny": np.arange(2.0)}
    _write(tmp_path, 4, old, full, rows)
    assert ck.latest(tmp_path) == 4 and ck.latest(tmp_path, old) == 4 and ck.latest(tmp_path, old + 1) is None
    for r in range(new):
        got = ck.load_resharded(tmp_path, 4, r, new, replicated=("lr",))
        for k, v in full.items():
            want = np.array_split(v, new)[r]
            assert got[k].dtype == want.dtype and np.array_equal(got[k], want), (k, r)
        assert got["lr"] == 0.1


def test_load_resharded_reads_only_the_old_files_its_rows_overlap(tmp_path):
    full = {"w": np.arange(12.0)}
    _write(tmp_path, 0, 3, full, rows=True)                 # old pieces: rows 0-3, 4-7, 8-11
    (tmp_path / "step-00000000" / "rank-00002.tdz").unlink()
    got = ck.load_resharded(tmp_path, 0, 0, 2, replicated=("lr",))   # new rank 0: rows 0-5 (old ranks 0, 1)
    assert np.array_equal(got["w"], np.arange(6.0))
    with pytest.raises(FileNotFoundError):
        ck.load_resharded(tmp_path, 0, 1, 2, replicated=("lr",))     # rows 6-11 need the missing file
    with pytest.raises(ValueError, match="'lr' is a scalar"):
        ck.load_resharded(tmp_path, 0, 0, 2)


async def _rpc_rounds() -> tuple[list, str]:
    import asyncio

    import grpc

    from tinydist.scheduler._generated import cluster_pb2 as pb
    from tinydist.scheduler._generated import cluster_pb2_grpc as pb_grpc
    from tinydist.scheduler.coordinator import Coordinator
    c = await Coordinator.start("127.0.0.1:0", insecure_loopback_only=True, heartbeat_interval=0.1, miss_limit=50)
    try:
        async with grpc.aio.insecure_channel(c.address) as channel:
            stub = pb_grpc.ClusterStub(channel)
            inc = {}
            for i in (1, 0, 2):
                reply = await stub.Join(pb.JoinRequest(node=pb.NodeInfo(node_id=f"n{i}", rank=i)), timeout=10)
                inc[f"n{i}"] = reply.epoch

            def ask(node: str, timeout: float = 10.0, lo: int = 2, hi: int = 3) -> object:
                return stub.Rendezvous(pb.RendezvousRequest(node_id=node, incarnation=inc[node], min_size=lo,
                                                            max_size=hi, last_call_s=0.3, timeout_s=timeout,
                                                            rendezvous=f"127.0.0.1:{1000 + int(node[1])}"), timeout=20)
            # n2 and n1 make a round of 2 (last call), n0 arrives after it closed and waits alone in the next
            replies = await asyncio.gather(ask("n2"), ask("n1"))
            try:
                await ask("n0", timeout=0.5)
            except grpc.aio.AioRpcError as exc:
                refused = f"{exc.code().name}: {exc.details()}"
            else:
                refused = "OK"
        return [(r.round, r.rank, r.world_size, [(m.node.node_id, m.node.rank, m.node.rendezvous) for m in r.members])
                for r in replies], refused
    finally:
        await c.stop()


def test_the_rendezvous_rpc_hands_every_member_the_same_closed_round():
    import asyncio
    replies, refused = asyncio.run(_rpc_rounds())
    table = [("n1", 0, "127.0.0.1:1001"), ("n2", 1, "127.0.0.1:1002")]
    assert replies == [(1, 1, 2, table), (1, 0, 2, table)]
    assert refused.startswith("DEADLINE_EXCEEDED: round 2 did not close within 0.5 s: 1 of min 2 members in (['n0'])"), refused
