"""A rank that reaches RDMA only through the environment: td.dist with TINYDIST_TRANSPORT=rdma."""

import sys

import numpy as np

import tinydist as td
from tinydist import dist

dist.init()
rank = dist.rank()
kinds = {peer: link.kind for peer, link in dist.get_group().links.items()}
total = dist.all_reduce(td.Tensor(np.arange(1000, dtype=np.float32) * (rank + 1)), op="sum").numpy()
expected = np.arange(1000, dtype=np.float32) * 3
print(f"rank {rank} links {sorted(set(kinds.values()))} ok {np.array_equal(total, expected)}")
sys.exit(0 if np.array_equal(total, expected) else 1)
