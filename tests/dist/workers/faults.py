"""A rank dies (SIGKILL) or hangs in the middle of a loop of collectives; the others must raise, naming it.

    faults.py kill|leave|hang VICTIM [ALGORITHM,ALGORITHM...]
"""

import os
import signal
import sys
import threading
import time

import numpy as np

from tinydist import dist

mode, victim = sys.argv[1], int(sys.argv[2])
algorithms = sys.argv[3].split(",") if len(sys.argv) > 3 else ["ring", "all2all", "naive"]
dist.init()
r = dist.rank()
x = np.ones(1 << 20, np.float32)
dist.barrier()
if r == victim:
    if mode == "kill":
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    elif mode == "leave":                   # a clean exit from the group while the others go on
        dist.destroy()
        sys.exit(0)
    else:
        time.sleep(30)                      # "hang": never joins the next collective
start = time.monotonic()
for i in range(100_000):
    call = time.monotonic()
    try:
        dist.all_reduce(x, algorithm=algorithms[i % len(algorithms)])
    except dist.RankFailed as exc:
        print(f"RANKFAILED rank={exc.rank} after={time.monotonic() - call:.2f} msg={exc}", flush=True)
        break
    except dist.CollectiveTimeout as exc:
        print(f"TIMEOUT ranks={exc.ranks} after={time.monotonic() - call:.2f} msg={exc}", flush=True)
        break
    if time.monotonic() - start > 30:
        print("NO FAILURE SEEN", flush=True)
        break
# a second call fails at once with the same error
try:
    dist.barrier()
except dist.CollectiveError as exc:
    print(f"AGAIN {type(exc).__name__}", flush=True)
dist.destroy()
