"""The launcher's reaper: cleans up a job whose launcher died without doing it (SIGKILL, OOM).

Ranks run in process groups of their own (so a rank's children stop with it), which also means
nothing stops them when the launcher is killed outright: a SIGKILLed `tinydist launch` used to
leave every rank running and their /dev/shm segments behind. The launcher starts this reaper in
a session of its own, with a pipe as its standard input, and tells it each rank's process group
as it starts. The pipe's end tells the reaper what happened: `done` first means the launcher
cleaned up itself; end of file without it means the launcher is gone, and the reaper stops the
ranks (SIGTERM, SIGKILL after the grace period) and removes the job's shared-memory files.

Run as a script by path (`python launch_reaper.py JOB GRACE`), so it does not import tinydist:
it starts in milliseconds and depends on nothing the job could have broken.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path


def sweep_shm(job: str) -> list[str]:
    """Remove this job's leftover shared-memory segments; returns their names."""
    removed = []
    shm = Path("/dev/shm")
    if shm.is_dir():
        for path in shm.glob(f"tinydist-{job}-*"):
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(path.name)
    return removed


def _alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def stop_groups(groups: list[int], grace: float) -> None:
    """SIGTERM every group, then SIGKILL what is left after `grace` seconds (polled, bounded)."""
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(_alive(g) for g in groups) and time.monotonic() < deadline:
        time.sleep(0.05)
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)


def main(argv: list[str]) -> int:
    job, grace = argv[0], float(argv[1])
    groups: list[int] = []
    for line in sys.stdin:
        word, _, value = line.strip().partition(" ")
        if word == "done":
            return 0
        if word == "group":
            groups.append(int(value))
    stop_groups(groups, grace)
    sweep_shm(job)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a ^C to the terminal is the launcher's to handle
    sys.exit(main(sys.argv[1:]))
