"""Live progress through `tinydist launch`: a rank's progress lines, and a tqdm bar's `\\r`
redraws, reach the launcher's output while the rank still runs (the ranks wait until the test has
seen them all, so nothing here can pass by arriving at exit)."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
from pathlib import Path

from tinydist.dist.launcher import _Lines

from .helpers import WORKERS


def test_progress_lines_arrive_while_the_ranks_run(tmp_path: Path) -> None:
    release = tmp_path / "release"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TINYDIST_")} | {"TINYDIST_CPU_DEVICES": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "tinydist.cli", "launch", "--nproc-per-node", "2",
                             str(WORKERS / "launch_progress.py"), str(release)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    wanted = {f"[rank {r}] {what}{r}" for r in (0, 1) for what in ("work", "raw")}
    seen: list[str] = []
    try:
        while not all(any(line.startswith(w) and ("8/8" in line or "3/3" in line) for line in seen) for w in wanted):
            line = lines.get(timeout=90)   # a bound on a hang, not a measurement
            assert line is not None, f"the launcher's output ended before the progress came: {seen}"
            seen.append(line)
        assert proc.poll() is None   # every rank still waits for the release: the lines came live
    finally:
        release.touch()
        proc.wait(timeout=90)
    reader.join(timeout=30)
    assert proc.stderr is not None
    stderr = proc.stderr.read()
    assert proc.stdout is not None
    proc.stdout.close()
    proc.stderr.close()
    while (line := lines.get()) is not None:
        seen.append(line)
    assert proc.returncode == 0, stderr
    for r in (0, 1):
        mine = [line for line in seen if line.startswith(f"[rank {r}] ")]
        plain = [line for line in mine if f"work{r}" in line]
        assert [re.findall(r"work\d (\d+)/8", line) for line in plain] == [["2"], ["4"], ["6"], ["8"]]
        raw = [line for line in mine if f"raw{r}" in line]
        assert [re.findall(r"(\d)/3", line) for line in raw][:4] == [["0"], ["1"], ["2"], ["3"]]
        assert mine[-1] == f"[rank {r}] done{r}"
    assert not any("\r" in line for line in seen)


def split(*reads: bytes) -> list[bytes]:
    splitter = _Lines()
    return [line for data in reads for line in splitter.feed(data)] + splitter.end()


def test_line_ends_split_as_a_terminal_shows_them() -> None:
    assert split(b"a\nb\r\nc\n") == [b"a\n", b"b\n", b"c\n"]
    assert split(b"a", b"b\n", b"c") == [b"ab\n", b"c\n"]                  # a line written in two parts is one
    assert split(b"\n\n") == [b"\n", b"\n"]                                # blank lines stay
    assert split(b"x\r", b"\ny\n") == [b"x\n", b"y\n"]                     # \r\n across two reads: one line end
    # tqdm into a pipe: "\r" + the bar per redraw, "\n" at close; each redraw once, as it comes
    assert split(b"\rbar 0", b"\rbar 1", b"\rbar 2\n") == [b"bar 0\n", b"bar 1\n", b"bar 2\n"]
    splitter = _Lines()
    assert splitter.feed(b"\rbar 0") == [b"bar 0\n"]                          # forwarded before the next redraw
    assert splitter.feed(b"\rbar 1\r") == [b"bar 1\n"]
    assert splitter.feed(b"\n") == [] and splitter.end() == []
    assert split(b"text\rover") == [b"text\n", b"over\n"]
    assert split(b"") == []
