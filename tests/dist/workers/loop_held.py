"""Over TCP, allreduces and barriers run on the calling thread: they complete while the group's event loop is held.

A task on the loop blocks the loop's thread until this thread says it is done (or 30 s pass); each
rank then prints whether its collectives finished while the loop was held, and checks them against numpy.
"""

import threading

import numpy as np

from tinydist import dist
from tinydist.runtime.engine import get_engine

dist.init()
rank, world = dist.rank(), dist.world_size()
dist.barrier()                                # the links' readers pause here (one trip to the loop)
released, held, let_go = threading.Event(), threading.Event(), threading.Event()
by_us: list[bool] = []


async def hold_the_loop() -> None:
    held.set()
    by_us.append(released.wait(30))           # blocks the loop's thread, as a long callback would
    let_go.set()


get_engine().portal.start_task_soon(hold_the_loop)
held.wait(10)
results = []
for n, algorithm in ((1, "naive"), (7919, "ring"), ((1 << 18) + 3, "naive"), ((1 << 18) + 3, "ring"), (1000, "auto")):
    x = np.arange(n, dtype=np.float64) * (rank + 1)
    got = dist.all_reduce(x, algorithm=algorithm, out=np.empty_like(x))   # numpy out: no tensor, no device
    results.append(np.array_equal(got, np.arange(n, dtype=np.float64) * sum(range(1, world + 1))))
    dist.barrier()
released.set()
let_go.wait(40)
print(f"HELD {by_us == [True]} EQUAL {all(results)}", flush=True)   # the loop was let go by us, not its 30 s
dist.destroy()
