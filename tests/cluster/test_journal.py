"""The coordinator's write-ahead journal (scheduler.journal) and membership recovery from it:
a torn last record is dropped, a bad checksum before the end is refused naming the file and record,
compaction round-trips, a rejoin keeps rank and incarnation; and the node's backoff / give-up rule
(scheduler.node.CoordinatorWatch) on a virtual clock."""

from __future__ import annotations

import os
import struct
import zlib

import pytest

from tinydist.scheduler.errors import CoordinatorLost, JournalError, MembershipError
from tinydist.scheduler.journal import JOURNAL, SNAPSHOT, Journal
from tinydist.scheduler.membership import LinkRecord, Membership
from tinydist.scheduler.node import CoordinatorWatch


def _cluster(state_dir, now, compact_every=1000) -> Membership:
    m = Membership(0.1, 3, clock=lambda: now[0], store=Journal(state_dir, compact_every=compact_every))
    m.recover()
    return m


def _reopen(state_dir, now, compact_every=1000) -> Membership:
    return _cluster(state_dir, now, compact_every)


def _populate(m: Membership, now) -> None:
    for i in range(3):
        m.join(f"node-{i}", f"host-{i}", ["CPU:0", "CPU:1"], rank=i, world_size=3, info={"pid": 100 + i})
    m.heartbeat("node-0", m.members["node-0"].incarnation, [LinkRecord("node-0", "node-1", "tcp", 5e-5, 1e9)])
    m.leave("node-1")
    now[0] += 0.1
    m.heartbeat("node-0", m.members["node-0"].incarnation)
    now[0] += 0.25                                     # node-2 silent past 3 x 0.1 s
    assert [r.node_id for r in m.sweep()] == ["node-2"]


def _view(m: Membership):
    return (m.epoch, m.world_size, [(r.node_id, r.rank, r.incarnation, r.state, r.reason, r.devices, r.info)
                                    for r in m.ordered()], sorted((k, vars(v)) for k, v in m.links.items()))


def test_recover_restores_members_ranks_epoch_and_links(tmp_path):
    now = [0.0]
    m = _cluster(tmp_path, now)
    _populate(m, now)
    before = _view(m)
    m.store.close()
    # the records as written, before the restart compacts them
    assert (tmp_path / JOURNAL).stat().st_size > 0
    r = _reopen(tmp_path, now)
    assert _view(r) == before
    assert before[0] == 5 and [x[3] for x in before[2]] == ["alive", "left", "dead"]
    # recovery compacted: everything is in the snapshot, the journal is empty
    assert (tmp_path / JOURNAL).stat().st_size == 0 and (tmp_path / SNAPSHOT).exists()
    r.store.close()
    again = _reopen(tmp_path, now)
    assert _view(again) == before
    # a rejoin under the held incarnation is accepted with no epoch bump; a stale one is refused
    inc = again.members["node-0"].incarnation
    assert again.join("node-0", "host-0", ["CPU:0", "CPU:1"], rank=0, world_size=3, incarnation=inc).rank == 0
    assert again.epoch == before[0]
    with pytest.raises(MembershipError, match=f"incarnation {inc + 100} was superseded by {inc}"):
        again.join("node-0", "host-0", ["CPU:0"], rank=0, world_size=3, incarnation=inc + 100)
    with pytest.raises(MembershipError, match="node-2 was declared dead"):
        again.join("node-2", "host-2", ["CPU:0"], rank=2, world_size=3, incarnation=again.members["node-2"].incarnation)
    again.store.close()


def test_rejoin_into_empty_membership_keeps_rank_and_incarnation():
    m = Membership(0.1, 3, clock=lambda: 0.0)
    record = m.join("node-1", "host-1", ["CPU:0"], rank=1, world_size=2, incarnation=7)
    assert (record.rank, record.incarnation) == (1, 7)
    assert m.join("node-0", "host-0", ["CPU:0"], world_size=2).incarnation > 7     # later ones stay unique


def test_torn_last_record_is_dropped_and_truncated(tmp_path):
    now = [0.0]
    m = _cluster(tmp_path, now)
    m.join("node-0", "host-0", ["CPU:0"], rank=0, world_size=2)
    size_one = (tmp_path / JOURNAL).stat().st_size
    m.join("node-1", "host-1", ["CPU:0"], rank=1, world_size=2)
    m.store.close()
    path = tmp_path / JOURNAL
    data = path.read_bytes()
    cases = [data[:size_one + 3], data[:-5],            # inside the header, inside the payload
             data[:size_one] + bytes(len(data) - size_one),  # extended with zeros, never written
             data + bytes(4096)]                        # whole records, then zeros
    for torn in cases:
        path.write_bytes(torn)
        r = _reopen(tmp_path, now)
        want = ["node-0", "node-1"] if torn.startswith(data) else ["node-0"]
        assert [x.node_id for x in r.ordered()] == want and r.epoch == len(want)
        r.store.close()
        (tmp_path / SNAPSHOT).unlink()                  # start the next case from the journal alone
    # a full-length last record with stale bytes: its checksum fails and nothing follows: torn too
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    r = _reopen(tmp_path, now)
    assert [x.node_id for x in r.ordered()] == ["node-0"]
    r.store.close()
    # the journal itself: the torn record is cut off the file, so the next append follows a whole one
    (tmp_path / SNAPSHOT).unlink()
    path.write_bytes(data[:-5])
    j = Journal(tmp_path)
    _, records = j.load()
    assert [x["seq"] for x in records] == [1] and path.stat().st_size == size_one
    j.close()


def test_bad_checksum_before_the_last_record_is_refused_naming_file_and_record(tmp_path):
    now = [0.0]
    m = _cluster(tmp_path, now)
    for i in range(3):
        m.join(f"node-{i}", f"host-{i}", ["CPU:0"], rank=i, world_size=3)
    m.store.close()
    path = tmp_path / JOURNAL
    data = bytearray(path.read_bytes())
    first_len = struct.unpack_from(">I", data, 0)[0]
    second = 12 + first_len
    bad = bytearray(data)
    bad[second + 12 + 3] ^= 0x01                        # one bit of record 1's payload
    path.write_bytes(bytes(bad))
    with pytest.raises(JournalError, match=rf"{path}: record 1 at byte {second}: checksum 0x[0-9a-f]{{8}} does "
                                           r"not match the stored .*move .* aside"):
        _reopen(tmp_path, now)
    assert path.read_bytes() == bytes(bad)              # refused, not repaired
    # a flipped bit in record 1's length: not read as a torn tail that drops record 2 in silence
    bad = bytearray(data)
    bad[second + 1] ^= 0x10
    path.write_bytes(bytes(bad))
    with pytest.raises(JournalError, match=rf"{path}: record 1 at byte {second}: its header's checksum"):
        _reopen(tmp_path, now)


def test_corrupt_snapshot_is_refused(tmp_path):
    now = [0.0]
    m = _cluster(tmp_path, now)
    m.join("node-0", "host-0", ["CPU:0"], rank=0, world_size=1)
    m.store.close()
    _reopen(tmp_path, now).store.close()              # compacts into the snapshot
    snap = tmp_path / SNAPSHOT
    snap.write_text(snap.read_text().replace('"node-0"', '"node-9"'))
    with pytest.raises(JournalError, match=f"{snap}: checksum .* does not match"):
        _reopen(tmp_path, now)


def test_compaction_round_trip_and_crash_between_snapshot_and_truncate(tmp_path):
    now = [0.0]
    m = _cluster(tmp_path, now, compact_every=4)
    for step in range(5):
        for i in range(2):
            m.join(f"node-{i}", f"host-{i}", ["CPU:0"], rank=i, world_size=2)   # a restart: new incarnation
        m.heartbeat("node-0", m.members["node-0"].incarnation, [LinkRecord("node-0", "node-1", "tcp", 1e-5 * step, 1e9)])
    before = _view(m)
    # compacted along the way: fewer records on disk than changes made (10 joins + 5 link reports)
    records_on_disk = _count_records(tmp_path / JOURNAL)
    assert records_on_disk < 4 and (tmp_path / SNAPSHOT).exists()
    journal_bytes = (tmp_path / JOURNAL).read_bytes()
    m.store.close()
    r = _reopen(tmp_path, now)
    assert _view(r) == before
    # a crash after the snapshot's rename but before the journal's truncation: the old records are
    # still there, with sequence numbers the snapshot covers; replay skips them
    r.store.close()
    (tmp_path / JOURNAL).write_bytes(journal_bytes)
    r2 = _reopen(tmp_path, now)
    assert _view(r2) == before
    r2.store.close()


def _count_records(path) -> int:
    data, offset, n = path.read_bytes(), 0, 0
    while offset < len(data):
        length, crc, _ = struct.unpack_from(">III", data, offset)
        assert zlib.crc32(data[offset + 12:offset + 12 + length]) == crc
        offset, n = offset + 12 + length, n + 1
    return n


def test_serve_refuses_a_corrupt_state_dir_naming_file_and_record(tmp_path):
    import subprocess
    import sys

    from tests.cluster.helpers import ROOT, env
    now = [0.0]
    m = _cluster(tmp_path, now)
    for i in range(2):
        m.join(f"node-{i}", f"host-{i}", ["CPU:0"], rank=i, world_size=2)
    m.store.close()
    path = tmp_path / JOURNAL
    data = bytearray(path.read_bytes())
    data[12 + 2] ^= 0x01                                # record 0's payload
    path.write_bytes(bytes(data))
    run = subprocess.run([sys.executable, "-m", "tinydist.cli", "scheduler", "serve", "--listen", "127.0.0.1:0",
                          "--insecure-loopback-only", "--state-dir", str(tmp_path)],
                         capture_output=True, text=True, env=env(), cwd=ROOT, timeout=60)
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"error: {path}: record 0 at byte 0: checksum" in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_a_second_coordinator_on_the_same_state_dir_is_refused(tmp_path):
    first = Journal(tmp_path)
    try:
        with pytest.raises(JournalError, match="in use by another coordinator"):
            Journal(tmp_path)
    finally:
        first.close()
    Journal(tmp_path).close()                           # free again once the first is closed


def test_unwritable_state_dir_is_a_journal_error(tmp_path):
    if os.geteuid() == 0:
        blocker = tmp_path / "file"
        blocker.write_text("x")
        target = blocker / "state"                      # a path under a regular file: no mkdir even as root
    else:
        tmp_path.chmod(0o500)
        target = tmp_path / "state"
    with pytest.raises(JournalError, match="cannot open it"):
        Journal(target)


def test_coordinator_watch_backs_off_then_gives_up_after_the_bound():
    now = [100.0]
    watch = CoordinatorWatch("127.0.0.1:1", interval=0.1, cap=0.5, lost_after=3.0, clock=lambda: now[0])
    delays = []
    while True:
        try:
            d = watch.failed("UNAVAILABLE")
        except CoordinatorLost as exc:
            message = str(exc)
            break
        delays.append(d)
        if len(delays) == 1:
            assert watch.outage and not watch.near_bound()
        now[0] += d
    assert delays[:4] == pytest.approx([0.1, 0.2, 0.4, 0.5]) and max(delays) == pytest.approx(0.5)
    assert 3.0 < now[0] - 100.0 <= 3.5                  # gave up at the first try past the bound, not before
    assert watch.near_bound()
    assert "127.0.0.1:1 unreachable for 3.1 s (UNAVAILABLE)" in message and "SCHEDULER_LOST_AFTER=3 s" in message
    assert watch.answered() is True and watch.answered() is False   # an outage ends once
    assert not watch.near_bound()
    assert watch.failed("UNAVAILABLE") == pytest.approx(0.1)        # and backoff starts over
