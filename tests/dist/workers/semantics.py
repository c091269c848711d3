"""Collective semantics at the edges: a late rank, a peer that crashes / leaves / exits, a rank gone at init.

    semantics.py late VICTIM DIR COLLECTIVE      the victim calls only once its peers' call ended (DIR/gaveup<r>)
    semantics.py gone VICTIM DIR COLLECTIVE      ... only once its peers have left the group and exited (DIR/exited<r>)
    semantics.py crash|kill|destroy|exit|raise VICTIM DIR    the victim stops one of these ways; the others call
    semantics.py init                            join the group and leave (a rank may be missing)
    semantics.py register_and_die                register with the coordinator, then die before the mesh connects

Every outcome is a line the test reads: RESULT <value> when a call returned, ERROR <class> ranks=<.ranks>
rank=<.rank> msg=<message> when it raised, AGAIN <class> for the next call after a failure.
"""

import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

from tinydist import dist


def report(exc: BaseException) -> None:
    print(f"ERROR {type(exc).__name__} ranks={getattr(exc, 'ranks', None)} rank={getattr(exc, 'rank', None)} "
          f"msg={exc}", flush=True)


def call(collective: str) -> None:
    x = np.full(1000, dist.rank() + 1.0)
    result = dist.barrier() if collective == "barrier" else dist.all_reduce(x).numpy()
    print(f"RESULT {None if result is None else float(result[0])}", flush=True)


def wait_for(paths: list[Path], seconds: float = 30) -> None:
    """The test's own bound: the peers' marker files (each written after a step that itself is bounded)."""
    deadline = time.monotonic() + seconds
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            print(f"MARKERS MISSING {[str(p) for p in paths if not p.exists()]}", flush=True)
            os._exit(4)
        time.sleep(0.02)


mode = sys.argv[1]
if mode == "register_and_die":         # join the rendezvous, then die before the mesh connects
    import anyio

    from tinydist.base.config import settings
    from tinydist.dist.rendezvous import parse_coordinator, register
    anyio.run(register, parse_coordinator(os.environ["TINYDIST_COORDINATOR"]), int(os.environ["TINYDIST_RANK"]),
              int(os.environ["TINYDIST_WORLD_SIZE"]), settings.COLLECTIVE_TIMEOUT)
    os._exit(0)
if mode == "init":
    try:
        dist.init()
    except Exception as exc:  # noqa: BLE001 - the test reads the class and message
        report(exc)
        sys.exit(0)
    print("INIT OK", flush=True)
    dist.destroy()
    sys.exit(0)

victim, where = int(sys.argv[2]), Path(sys.argv[3])
dist.init()
r, world = dist.rank(), dist.world_size()
dist.barrier()
peers = [p for p in range(world) if p != victim]

if mode in ("late", "gone"):
    collective = sys.argv[4]
    if r == victim:
        wait_for([where / f"{'gaveup' if mode == 'late' else 'exited'}{p}" for p in peers])
    try:
        call(collective)
    except dist.CollectiveError as exc:
        report(exc)
    (where / f"gaveup{r}").touch()
    try:
        dist.barrier()
        print("AGAIN none", flush=True)
    except dist.CollectiveError as exc:
        print(f"AGAIN {type(exc).__name__}", flush=True)
    if r != victim and mode == "late":
        wait_for([where / f"gaveup{victim}"])    # stay in the group until the late rank's call ended
    dist.destroy()
    (where / f"exited{r}").touch()
    sys.exit(0)

# a peer stops: killed / crashed mid-collective, or it leaves / exits / dies of an exception before the call
if r == victim:
    if mode == "kill":
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    elif mode == "crash":
        threading.Timer(0.3, lambda: os._exit(7)).start()
    elif mode == "destroy":
        dist.destroy()
        wait_for([where / f"exited{p}" for p in peers])     # alive, but out of the group, until the peers are done
        sys.exit(0)
    elif mode == "exit":
        sys.exit(0)         # the script ends; atexit leaves the group
    elif mode == "raise":
        raise RuntimeError("the victim's script failed")
x = np.ones(1 << 16, np.float32)
start = time.monotonic()
try:
    while time.monotonic() - start < 60:
        dist.all_reduce(x)
    print("NO FAILURE SEEN", flush=True)
except dist.CollectiveError as exc:
    report(exc)
try:
    dist.barrier()
    print("AGAIN none", flush=True)
except dist.CollectiveError as exc:
    print(f"AGAIN {type(exc).__name__}", flush=True)
dist.destroy()
(where / f"exited{r}").touch()
