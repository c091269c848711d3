"""Prints what the launcher handed this rank (torchrun's variables and ours) and an all-reduce's
result as one `ENV {json}` line, and logs one record, at info level."""

import json
import os

import numpy as np

import tinydist as td
from tinydist.base.logs import get_logger

NAMES = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
         "TINYDIST_RANK", "TINYDIST_LOCAL_RANK", "TINYDIST_WORLD_SIZE", "TINYDIST_COORDINATOR",
         "TINYDIST_LOG_FORMAT", "TINYDIST_LOG_LEVEL"]

td.dist.init()
total = td.dist.all_reduce(np.full(3, td.dist.get_rank() + 1.0), op="sum").numpy()
get_logger(component="worker").info("worker.done", total=float(total[0]))
print("ENV " + json.dumps({name: os.environ.get(name) for name in NAMES}
                          | {"get_rank": td.dist.get_rank(), "get_world_size": td.dist.get_world_size(),
                             "total": total.tolist()}), flush=True)
td.dist.destroy()
