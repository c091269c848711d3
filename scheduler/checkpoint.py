"""Sharded checkpoints: each rank saves its shard with td.save; a step counts only once committed.

    ckpt/step-00000012/rank-00003.tdz     one file per rank (written to a temp name, then renamed)
    ckpt/step-00000012/COMMITTED          written by rank 0 after every rank saved (a barrier)

`latest(directory, world_size)` is the newest committed step whose every rank file exists; a step
interrupted by a node loss is never committed, so a restarted job (the survivors plus replacement
nodes, same world size) resumes from the last complete one.

Elastic restarts change the world size: `latest(directory)` (no world size) is the newest complete
step written by any world, and `load_resharded(directory, step, rank, world_size)` gives rank
`rank` of the new world its shard of every array: each rank file holds rank r's piece of one
global array per key, cut along axis 0 by numpy.array_split's rule (`graph.collectives.
shard_bounds`), the rule save_shard's callers use. Only the old files whose rows overlap the new
shard are read; keys in `replicated` (the same on every rank: a step count, a learning rate) come
from rank 0's file. The global length of a key is the sum of the old shards' lengths, read from
the COMMITTED record (`commit(..., meta={"rows": {key: [len of rank 0's piece, ...]}})` when the
caller gives them, else from every old file).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np


def _step_dir(directory: Path, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}"


def save_shard(directory: str | os.PathLike[str], step: int, rank: int, state: dict[str, Any]) -> Path:
    import tinydist as td
    target = _step_dir(Path(directory), step) / f"rank-{rank:05d}.tdz"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    td.save(state, tmp)
    os.replace(tmp, target)
    return target


def commit(directory: str | os.PathLike[str], step: int, world_size: int, meta: dict[str, Any] | None = None) -> None:
    """Rank 0, after a barrier that follows every rank's save_shard."""
    step_dir = _step_dir(Path(directory), step)
    missing = [r for r in range(world_size) if not (step_dir / f"rank-{r:05d}.tdz").is_file()]
    if missing:
        raise FileNotFoundError(f"cannot commit step {step}: ranks {missing} have no shard in {step_dir}")
    tmp = step_dir / "COMMITTED.tmp"
    tmp.write_text(json.dumps({"step": step, "world_size": world_size, **(meta or {})}))
    os.replace(tmp, step_dir / "COMMITTED")


def latest(directory: str | os.PathLike[str], world_size: int | None = None) -> int | None:
    """The newest committed step, written by a world of `world_size` ranks (None: any world size)."""
    root = Path(directory)
    if not root.is_dir():
        return None
    steps = []
    for entry in root.glob("step-*/COMMITTED"):
        info = json.loads(entry.read_text())
        world = int(info.get("world_size", 0))
        if (world_size is None or world == world_size) and world > 0 and all(
                (entry.parent / f"rank-{r:05d}.tdz").is_file() for r in range(world)):
            steps.append(int(info["step"]))
    return max(steps) if steps else None


def committed(directory: str | os.PathLike[str], step: int) -> dict[str, Any]:
    """The COMMITTED record of `step` (step, world_size and the caller's meta)."""
    path = _step_dir(Path(directory), step) / "COMMITTED"
    if not path.is_file():
        raise FileNotFoundError(f"step {step} of {directory} is not committed (no {path}): resume from "
                                f"checkpoint.latest({str(directory)!r})")
    info: dict[str, Any] = json.loads(path.read_text())
    return info


def load_resharded(directory: str | os.PathLike[str], step: int, rank: int, world_size: int,
                   replicated: tuple[str, ...] = ()) -> dict[str, Any]:
    """Rank `rank` of a `world_size`-rank job: its array_split piece of every key of `step`, written by
    a job of any world size (module docstring). Equal to load_shard when the world size is the same."""
    from tinydist.graph.collectives import shard_bounds
    old_world = int(committed(directory, step)["world_size"])
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    cache: dict[int, dict[str, Any]] = {}

    def old(r: int) -> dict[str, Any]:
        if r not in cache:
            cache[r] = load_shard(directory, step, r)
        return cache[r]

    rows = committed(directory, step).get("rows", {})
    out: dict[str, Any] = {}
    for key, value in old(0).items():
        if key in replicated:
            out[key] = value
            continue
        if np.ndim(value) == 0:
            raise ValueError(f"checkpoint {directory} step {step}: {key!r} is a scalar, not a piece of an array "
                             f"split along axis 0; name it in replicated=(...) to take rank 0's value")
        lengths = [int(n) for n in rows[key]] if key in rows else [len(old(r)[key]) for r in range(old_world)]
        starts = np.cumsum([0, *lengths])
        lo, hi = shard_bounds(int(starts[-1]), world_size)[rank]
        pieces = [old(r)[key][max(lo, starts[r]) - starts[r]:min(hi, starts[r + 1]) - starts[r]]
                  for r in range(old_world) if starts[r] < hi and starts[r + 1] > lo]
        out[key] = (np.concatenate(pieces, axis=0) if pieces
                    else np.asarray(value)[:0])           # an empty piece keeps dtype and trailing shape
    return out


def load_shard(directory: str | os.PathLike[str], step: int, rank: int) -> dict[str, Any]:
    import tinydist as td
    state = td.load(_step_dir(Path(directory), step) / f"rank-{rank:05d}.tdz")
    return {k: (v.numpy() if hasattr(v, "numpy") and not isinstance(v, np.ndarray) else v) for k, v in state.items()}
