"""Sharded checkpoints: each rank saves its shard with td.save; a step counts only once committed.

    ckpt/step-00000012/rank-00003.tdz     one file per rank (written to a temp name, then renamed)
    ckpt/step-00000012/COMMITTED          written by rank 0 after every rank saved (a barrier)

`latest(directory, world_size)` is the newest committed step whose every rank file exists; a step
interrupted by a node loss is never committed, so a restarted job (the survivors plus replacement
nodes, same world size) resumes from the last complete one.
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


def latest(directory: str | os.PathLike[str], world_size: int) -> int | None:
    root = Path(directory)
    if not root.is_dir():
        return None
    steps = []
    for entry in root.glob("step-*/COMMITTED"):
        info = json.loads(entry.read_text())
        if info.get("world_size") == world_size and all((entry.parent / f"rank-{r:05d}.tdz").is_file() for r in range(world_size)):
            steps.append(int(info["step"]))
    return max(steps) if steps else None


def load_shard(directory: str | os.PathLike[str], step: int, rank: int) -> dict[str, Any]:
    import tinydist as td
    state = td.load(_step_dir(Path(directory), step) / f"rank-{rank:05d}.tdz")
    return {k: (v.numpy() if hasattr(v, "numpy") and not isinstance(v, np.ndarray) else v) for k, v in state.items()}
