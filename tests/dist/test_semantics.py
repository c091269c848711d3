"""Collective semantics: a call completes on every rank or fails on every rank, with the same error.

The processes are real ranks (`spawn_ranks`); where a rank must come late, it waits for its peers'
marker files, not for a clock, so no assertion depends on timing. Deadlines are small and bounded
(TINYDIST_COLLECTIVE_TIMEOUT=2), and every test's processes are bounded by `finish`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from .helpers import WORKERS, finish, free_port, spawn_ranks

TIMEOUT = {"TINYDIST_COLLECTIVE_TIMEOUT": "2"}


def _outcome(out: str) -> tuple[str, str, str, str]:
    """(kind, class, ranks, message) of a rank's first collective outcome: RESULT or ERROR."""
    # not anchored at a line's start: a log line on stderr (merged) may end without a newline before it
    found = re.search(r"(RESULT) (.*)$|ERROR (\w+) ranks=(.*?) rank=(.*?) msg=(.*)$", out, re.M)
    assert found, out
    if found.group(1):
        return "RESULT", "", "", found.group(2)
    return "ERROR", found.group(3), found.group(4), found.group(6)


@pytest.mark.parametrize("collective", ["all_reduce", "barrier"])
@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize("mode", ["late", "gone"])
def test_a_late_rank_fails_like_its_peers(mode, transport, collective, tmp_path, no_shm_leak):
    """Rank 1 calls only after ranks 0 and 2 gave up on the call (`late`: they stay in the group;
    `gone`: they have left it and exited). No rank returns a value, the late one included: every
    rank raises CollectiveTimeout naming rank 1, and refuses the next call."""
    procs = spawn_ranks(3, "semantics.py", mode, "1", str(tmp_path), collective, env={**TIMEOUT, "TINYDIST_TRANSPORT": transport})
    results = finish(procs, timeout=60)
    for rank, (rc, out) in enumerate(results):
        assert rc == 0, out
        kind, cls, ranks, msg = _outcome(out)
        assert (kind, cls, ranks) == ("ERROR", "CollectiveTimeout", "[1]"), (rank, out)
        assert "rank 1" in msg or "ranks [1]" in msg, out
        assert "AGAIN CollectiveTimeout" in out, out


_SAYS = {
    "kill": ("RankFailed", r"rank 2 died"),
    "crash": ("RankFailed", r"rank 2 died"),
    "destroy": ("RankFailed", r"rank 2 left the group \(td\.dist\.destroy\)"),
    "exit": ("RankFailed", r"rank 2 exited"),
    "raise": ("RankFailed", r"rank 2 exited on an uncaught exception"),
}


@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize("mode", sorted(_SAYS))
def test_survivors_say_how_a_peer_stopped(mode, transport, tmp_path, no_shm_leak):
    """A peer killed (SIGKILL) or crashed (os._exit) mid-collective died; one that called destroy()
    left; one whose script ended (normally, or of an uncaught exception) exited: each survivor's
    RankFailed names rank 2 and says which, and the next call raises it again."""
    procs = spawn_ranks(3, "semantics.py", mode, "2", str(tmp_path), env={**TIMEOUT, "TINYDIST_TRANSPORT": transport,
                                                                          "TINYDIST_COLLECTIVE_TIMEOUT": "20"})
    results = finish(procs, timeout=60)
    cls, says = _SAYS[mode]
    for rank in (0, 1):
        rc, out = results[rank]
        assert rc == 0, out
        kind, got, _, msg = _outcome(out)
        assert (kind, got) == ("ERROR", cls), out
        assert re.search(r"rank=2 ", out), out
        assert re.search(says, msg), out
        for other in ("died", "left the group", "exited"):       # and not one of the other stories
            if not re.search(other, says):
                assert other not in msg, out
        assert f"AGAIN {cls}" in out, out


def _init_ranks(modes: dict[int, str]) -> list[subprocess.Popen]:
    """Rank r of 3 runs `semantics.py modes[r]`; a rank not in `modes` never starts."""
    port = free_port()
    procs = []
    for rank, mode in sorted(modes.items()):
        env = dict(os.environ, TINYDIST_RANK=str(rank), TINYDIST_WORLD_SIZE="3", TINYDIST_COORDINATOR=f"127.0.0.1:{port}", **TIMEOUT)
        env.pop("TINYDIST_COORDINATOR_FD", None)
        procs.append(subprocess.Popen([sys.executable, str(WORKERS / "semantics.py"), mode], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


@pytest.mark.parametrize("missing", [2, 0])
def test_rendezvous_with_a_missing_rank_is_a_collective_error_naming_it(missing, no_shm_leak):
    """A rank that never starts: the others' init raises CollectiveTimeout naming it (rank 0 missing:
    no coordinator answers), not a bare ValueError or ConnectionError."""
    procs = _init_ranks({r: "init" for r in range(3) if r != missing})
    for rc, out in finish(procs, timeout=60):
        assert rc == 0, out
        found = re.search(r"ERROR (\w+) ranks=(.*?) rank=.*? msg=(.*)", out)
        assert found, out
        assert found.group(1) == "CollectiveTimeout" and found.group(2) == f"[{missing}]", out
        assert f"[{missing}]" in found.group(3), out



def test_a_rank_that_dies_after_registering_is_named_by_both_others(no_shm_leak):
    """Rank 1 registers, then dies before the mesh connects: rank 2, refused by it, raises RankFailed
    saying it died; rank 0, which waited for its connection, CollectiveTimeout naming it."""
    results = finish(_init_ranks({0: "init", 1: "register_and_die", 2: "init"}), timeout=60)
    expected = {0: r"ERROR CollectiveTimeout ranks=\[1\] rank=None msg=.*ranks \[1\]",
                2: r"ERROR RankFailed ranks=None rank=1 msg=rendezvous: rank 1 died"}
    for index, rank in ((0, 0), (2, 2)):
        rc, out = results[index]
        assert rc == 0, out
        assert re.search(expected[rank], out), out


@pytest.fixture
def segment():
    """Three ranks' views of one group segment, in this process."""
    from tinydist.transports.shm import _unlink
    from tinydist.transports.shm_group import ShmGroup
    if not ShmGroup.supported():
        pytest.skip("the group segment needs x86-64 Linux")
    first, name = ShmGroup.create("semtest0", 0, 3, 4096)
    views = [first, *(ShmGroup.attach(name, r, 3, 4096) for r in (1, 2))]
    _unlink(name)
    yield views
    for view in views:
        view.close()


def test_giving_up_on_a_step_and_posting_it_exclude_each_other(segment):
    """The segment's agreement, without processes or clocks: whichever of a peer's post and a
    waiter's give-up comes first wins, and the loser learns it (posted: nobody is given up on;
    given up: the post raises Abandoned, and every other waiter sees the poison)."""
    from tinydist.transports.shm_group import TIMED_OUT, Abandoned
    a, b, c = segment
    keep_waiting = lambda peer: None  # noqa: E731
    # the post comes first: rank 0 finds nobody behind, and its wait returns
    step = a.post()
    assert b.post() == step and c.post() == step
    assert a.give_up([1, 2], step, TIMED_OUT, 0) == []
    a.wait(step, deadline=float("inf"), check=keep_waiting)
    # the give-up comes first: rank 1 can never post the step; rank 2 waiting for it raises too
    step = a.post()
    c.post()
    assert a.give_up([1], step, 5, 0) == [1]
    with pytest.raises(Abandoned) as late:
        b.post()
    assert (late.value.reason, late.value.blamed, late.value.ranks) == (5, 0, [1])
    with pytest.raises(Abandoned) as waiting:
        c.wait(step, deadline=float("inf"), check=keep_waiting)
    assert (waiting.value.reason, waiting.value.blamed, waiting.value.ranks) == (5, 0, [1])
    # sticky: a second give-up reports the poison already there, and does not replace it
    assert c.give_up([1], step, TIMED_OUT, 2) == [1]
    with pytest.raises(Abandoned) as again:
        b.post()
    assert again.value.reason == 5


def test_a_wait_whose_test_gives_up_poisons_the_peer(segment):
    """`check(peer)` answering (reason, blamed) ends the wait with Abandoned, and the peer's post fails."""
    from tinydist.transports.shm_group import Abandoned
    a, b, _ = segment
    step = a.post()
    with pytest.raises(Abandoned) as info:
        a.wait(step, deadline=float("inf"), check=lambda peer: (3, peer), ranks=[1])
    assert (info.value.reason, info.value.blamed, info.value.ranks) == (3, 1, [1])
    with pytest.raises(Abandoned):
        b.post()


def test_a_closed_view_reports_a_poison_as_link_closed(segment):
    """Reading a poison (a native post that failed) after this view closed: the step words are gone,
    so it is LinkClosed, naming the rank, as post / give_up / wait say it (an assert before)."""
    from tinydist.transports.base import LinkClosed
    from tinydist.transports.shm_group import TIMED_OUT, Abandoned
    a, b, _ = segment
    step = a.post()
    assert a.give_up([1], step, TIMED_OUT, 0) == [1]
    poison = int(b.steps[1])
    assert isinstance(b.abandoned(poison), Abandoned)
    b.close()
    with pytest.raises(LinkClosed, match=r"closed \(rank 1\)"):
        b.abandoned(poison)
    with pytest.raises(LinkClosed):
        b.post()
