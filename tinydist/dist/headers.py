"""The header check every collective starts with: all ranks' headers compared, so every rank raises
the same `CollectiveMismatch` (naming each rank's value) before any result is computed.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from tinydist.dist.errors import CollectiveMismatch

FIELDS = ("coll", "op", "dtype", "shape", "axis", "ndim", "shape_except_axis", "src", "algorithm")


def verdict(name: str, headers: dict[int, dict[str, Any]]) -> None:
    """Raise the same CollectiveMismatch on every rank when the headers disagree."""
    ranks = sorted(headers)
    bad = [f"rank {r}: {headers[r]['error']}" for r in ranks if headers[r].get("error")]
    if bad:
        raise CollectiveMismatch(f"{name}: invalid arguments on {'; '.join(bad)}")
    seqs = {headers[r].get("seq") for r in ranks}
    if len(seqs) > 1:
        raise CollectiveMismatch(f"{name}: ranks are at different collective calls: "
                                 + ", ".join(f"rank {r} #{headers[r].get('seq')}" for r in ranks))
    problems = []
    broadcast = headers[ranks[0]].get("coll") == "broadcast"
    for field in FIELDS:
        values = {r: headers[r].get(field) for r in ranks}
        if broadcast and field in ("shape", "dtype"):   # non-root ranks may pass no tensor
            values = {r: v for r, v in values.items() if v is not None}
        if len({json.dumps(v) for v in values.values()}) > 1:
            problems.append(f"{field}: " + ", ".join(f"rank {r} {show(field, v)}" for r, v in values.items()))
            if field == "coll":
                break
    if problems:
        raise CollectiveMismatch(f"{name}: ranks disagree on " + "; ".join(problems))


def show(field: str, value: Any) -> str:
    if field == "dtype" and value is not None:
        return str(np.dtype(value))
    if field in ("shape", "shape_except_axis") and value is not None:
        return str(tuple(value))
    return repr(value)

