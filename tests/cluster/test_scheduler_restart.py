"""The scheduler as a process that may crash: SIGKILL it mid-job over mutual TLS and the job's
allreduce steps go on (the data plane does not need it) to the numpy result; restart it on the same
port with the same --state-dir and it reports the members, ranks, incarnations and epoch it had,
and the nodes re-register. Without a state dir the nodes re-register into the empty membership."""

from __future__ import annotations

import time

import numpy as np

from tests.cluster.helpers import Coordinator, Output, start_nodes
from tests.cluster.workers.job import expected


def _lab(tmp_path):
    from tinydist.security import pki
    lab = tmp_path / "lab"
    pki.init(lab)
    for name in ("node-0", "node-1"):
        pki.issue(lab, name)
    return lab


def _members(st):
    return [(m.node.node_id, m.node.rank, m.node.pid, m.state) for m in st.members]


def _steps_done(out: Output) -> int:
    return sum(line.startswith("STEP ") for line in list(out.lines))


def _kill_restart(tmp_path, state_args: list[str], misses: int = 20):
    from tinydist.scheduler.node import Credentials, status
    lab = _lab(tmp_path)
    creds = Credentials.load(lab / "clients/node-0.pem", lab / "clients/node-0.key", lab / "ca.pem")
    out, steps, size = tmp_path / "w.npy", 32, 3001
    first = Coordinator(tmp_path, "--pki", str(lab), *state_args, misses=misses)
    outs = [Output(p) for p in start_nodes(first.address, 2, "--steps", str(steps), "--size", str(size), "--out", str(out),
                                           "--pki", str(lab), "--step-sleep", "0.25", "--wait-rejoin", "60",
                                           extra_env={"TINYDIST_SCHEDULER_LOST_AFTER": "60"})]
    second = None
    try:
        for o in outs:
            o.wait_for("STEP 1 done", 90)
        before = status(first.address, creds)
        first.kill()
        killed = time.monotonic()
        done_at_kill = [_steps_done(o) for o in outs]
        # twice the old give-up bound (interval x misses, when CoordinatorLost was fatal) with no coordinator
        time.sleep(2 * first.interval * first.misses)
        for o in outs:
            o.wait_for("node.coordinator_unreachable", 10)
            assert o.proc.poll() is None, o.text
        assert all(_steps_done(o) > n for o, n in zip(outs, done_at_kill)), [o.text for o in outs]
        done_at_restart = [_steps_done(o) for o in outs]
        print(f"without a coordinator for {time.monotonic() - killed:.2f} s: steps done {done_at_kill} -> "
              f"{done_at_restart} of {steps}")
        second = Coordinator(tmp_path, "--pki", str(lab), *state_args, misses=misses, listen=first.address)
        assert second.address == first.address
        recovered = status(second.address, creds)
        for o in outs:
            assert "REJOINED" in o.wait_for("REJOIN", 90), o.text
            assert o.finish(90) == 0, o.text
            assert "coordinator_back" in o.text and "ALLREDUCE ok" in o.text, o.text
        after = status(second.address, creds)           # both nodes have re-registered, finished and left
        print(f"scheduler back with {steps - max(done_at_restart)} of {steps} steps to go; both nodes re-registered")
    finally:
        for o in outs:
            o.close()
        first.stop()
        if second is not None:
            second.stop()
    np.testing.assert_array_equal(np.load(out), expected(steps, 4, size))
    return before, recovered, after, second.log.read_text()


def test_scheduler_sigkill_mid_job_then_restart_recovers_members_and_epoch_from_the_journal(tmp_path):
    before, recovered, after, log = _kill_restart(tmp_path, ["--state-dir", str(tmp_path / "state")])
    assert _members(before) == [("node-0", 0, before.members[0].node.pid, "alive"),
                                ("node-1", 1, before.members[1].node.pid, "alive")]
    # whether or not a node has re-registered yet: a rejoin under the held incarnation changes neither
    assert _members(recovered) == _members(before) and recovered.epoch == before.epoch > 0
    assert [(n, r, p) for n, r, p, _ in _members(after)] == [(n, r, p) for n, r, p, _ in _members(before)]
    assert [m.state for m in after.members] == ["left", "left"] and after.epoch == before.epoch + 2
    assert {(link.src, link.dst) for link in recovered.links} == {(link.src, link.dst) for link in before.links} != set()
    assert f"recovered epoch {before.epoch}, 2 members" in log


def test_scheduler_restart_without_state_dir_nodes_reregister_into_empty_membership(tmp_path):
    before, recovered, after, log = _kill_restart(tmp_path, [])
    assert "state in memory only" in log                              # it started empty
    # a node may already have re-registered by the first Status; nobody else can have joined
    assert {m.node.node_id for m in recovered.members} <= {"node-0", "node-1"}
    # re-registered under the same ids, ranks and processes, into the empty membership
    assert [(n, r, p) for n, r, p, _ in _members(after)] == [(n, r, p) for n, r, p, _ in _members(before)]
    assert [m.state for m in after.members] == ["left", "left"]


def test_scheduler_away_past_the_bound_fails_the_job_with_coordinator_lost(tmp_path):
    c = Coordinator(tmp_path, "--insecure-loopback-only")
    bound = 2.0
    outs = [Output(p) for p in start_nodes(c.address, 2, "--steps", "100000", "--size", "101",
                                           extra_env={"TINYDIST_SCHEDULER_LOST_AFTER": str(bound)})]
    try:
        for o in outs:
            o.wait_for("STEP 1 done", 90)
        t0 = time.monotonic()
        c.kill()
        lines = [o.wait_for("CLUSTERERROR", 60) for o in outs]
        elapsed = time.monotonic() - t0
        print(f"CoordinatorLost on both nodes {elapsed:.2f} s after the SIGKILL (bound {bound:g} s)")
        for o, line in zip(outs, lines):
            # each node names the coordinator and the bound, whether its own watch or its peer's gave up first
            assert "CoordinatorLost" in line and f"{c.address} unreachable for" in line, line
            assert f"TINYDIST_SCHEDULER_LOST_AFTER={bound:g} s" in line, line
            assert o.finish(30) == 4, o.text
        # not before the bound, counted from the node's last answered heartbeat (at most one interval before
        # the SIGKILL: counted from the kill, 1.996 s was seen); after it, within one capped backoff
        # (interval x misses / 2) and slack
        assert bound - c.interval <= elapsed < bound + c.interval * c.misses / 2 + 5.0, elapsed
    finally:
        for o in outs:
            o.close()
        c.stop()
