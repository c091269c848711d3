"""Ranks that disagree: every rank must raise CollectiveMismatch, and the group must stay usable."""

import numpy as np

import tinydist as td
from tinydist import dist

dist.init()
r = dist.rank()
cases = {
    "shape": lambda: dist.all_reduce(np.ones(4 if r == 0 else 5)),
    "dtype": lambda: dist.all_reduce(np.ones(4, np.float32 if r == 0 else np.int64)),
    "op": lambda: dist.all_reduce(np.ones(4), op="sum" if r == 0 else "max"),
    "coll": lambda: dist.all_reduce(np.ones(4)) if r == 0 else dist.broadcast(np.ones(4)),
    "badop": lambda: dist.all_reduce(np.ones(4), op="avg" if r == 1 else "sum"),
    "algorithm": lambda: dist.all_reduce(np.ones(4), algorithm="ring" if r == 0 else "naive"),
    "gather": lambda: dist.all_gather(np.ones((2, 3 if r == 0 else 4))),
    # one round against many (with small TINYDIST_SHM_SLOT_BYTES): the ranks must still agree to fail
    "rounds": lambda: dist.all_reduce(np.ones(4 if r == 0 else 50_000)),
}
# out= that one rank cannot take: every rank refuses the call, and no rank's array is touched
readonly = np.full(40_000, r + 1.0)
readonly.flags.writeable = r != 1
strided = np.full(80_000, r + 1.0)
target = strided[::2] if r == 0 else strided[:40_000]
ints = np.full(40_000, r + 1)
cases.update({
    "out_readonly": lambda: dist.all_reduce(readonly, out=readonly),
    "out_strided": lambda: dist.all_reduce(target, out=target),
    "out_int_mean": lambda: dist.all_reduce(ints, op="mean", out=ints if r == 2 else ints.astype(np.float64)),
    "out_tensor": lambda: dist.all_reduce(np.ones(4), out=td.Tensor(np.ones(4)) if r == 0 else np.ones(4)),
})
for name, fn in cases.items():
    try:
        fn()
    except dist.CollectiveMismatch as exc:
        print(f"MISMATCH {name}: {exc}", flush=True)
    else:
        print(f"NO ERROR {name}", flush=True)
untouched = (readonly == r + 1).all() and (strided == r + 1).all() and (ints == r + 1).all()
print("OUT ARRAYS", "untouched" if untouched else "MODIFIED", flush=True)
print("AFTER", dist.all_reduce(np.full(3, r + 1.0)).numpy().tolist(), flush=True)
