"""Rank 1 fails at once; the others would run for a minute unless the launcher stops them."""

import os
import sys
import time

out = sys.argv[1]
rank = int(os.environ["TINYDIST_RANK"])
with open(os.path.join(out, f"pid{rank}"), "w") as f:
    f.write(str(os.getpid()))
print(f"hello from {rank} of {os.environ['TINYDIST_WORLD_SIZE']}", flush=True)
if rank == 1:
    time.sleep(0.5)
    print("rank 1 fails", file=sys.stderr, flush=True)
    sys.exit(3)
time.sleep(60)
