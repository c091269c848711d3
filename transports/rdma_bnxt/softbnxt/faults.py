"""A seeded, deterministic fault plan for the NIC model.

    plan = FaultPlan(seed=7)
    plan.hwrm("func_qcfg").resp_len(0xffff)     # .seq_id(+1) .req_type(x) .valid(2) .error(0x10, times=3) .never() .delay(s)
    plan.rcfw("create_qp").status(1)             # .never()  .cookie(0x7abc)
    plan.wire(drop=0.05, dup=0.02, reorder=0.05) # per transmitted frame, from the seeded RNG
    plan.cqe(nth=3, status=7)                    # the 3rd requester CQE carries status 7 (an error CQE)
    plan.cq_full(nth=2)                          # the 2nd CQE post finds the CQ full -> CQ_ERROR (0xc1)
    nic.link(False)                              # port down (frames dropped both ways; port_phy_qcfg says down)

Rules match the n-th occurrence (1-based) of their request and fire `times` times; `plan.fired`
counts what actually fired, so a test proves its fault was exercised.
"""

from __future__ import annotations

import collections
import random
from typing import Any


class Rule:
    def __init__(self, kind: str, name: str, nth: int, times: int) -> None:
        self.kind, self.name, self.nth, self.times = kind, name, nth, times
        self.action: dict[str, Any] = {}

    def _set(self, **kw: Any) -> Rule:
        self.action.update(kw)
        return self

    # HWRM
    def resp_len(self, value: int) -> Rule: return self._set(resp_len=value)
    def seq_id(self, delta: int = 1) -> Rule: return self._set(seq_delta=delta)
    def req_type(self, value: int) -> Rule: return self._set(req_type=value)
    def valid(self, value: int) -> Rule: return self._set(valid=value)
    def error(self, code: int) -> Rule: return self._set(error=code)
    def never(self) -> Rule: return self._set(never=True)
    def delay(self, seconds: float) -> Rule: return self._set(delay=seconds)
    # RCFW
    def status(self, value: int) -> Rule: return self._set(status=value)
    def cookie(self, value: int) -> Rule: return self._set(cookie=value)


class FaultPlan:
    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.rules: list[Rule] = []
        self.seen: collections.Counter[tuple[str, str]] = collections.Counter()
        self.fired: collections.Counter[str] = collections.Counter()
        self.drop = self.dup = self.reorder = 0.0
        self.cqe_faults: dict[int, int] = {}
        self.cq_full_at: set[int] = set()
        self.req_cqes = 0
        self.cqe_posts = 0

    def hwrm(self, name: str, nth: int = 1, times: int = 1) -> Rule:
        self.rules.append(rule := Rule("hwrm", name, nth, times))
        return rule

    def rcfw(self, name: str, nth: int = 1, times: int = 1) -> Rule:
        self.rules.append(rule := Rule("rcfw", name, nth, times))
        return rule

    def wire(self, drop: float = 0.0, dup: float = 0.0, reorder: float = 0.0) -> FaultPlan:
        self.drop, self.dup, self.reorder = drop, dup, reorder
        return self

    def cqe(self, nth: int, status: int) -> FaultPlan:
        self.cqe_faults[nth] = status
        return self

    def cq_full(self, nth: int) -> FaultPlan:
        self.cq_full_at.add(nth)
        return self

    # ---- used by the model ------------------------------------------------------------------

    def match(self, kind: str, name: str) -> dict[str, Any]:
        self.seen[(kind, name)] += 1
        n = self.seen[(kind, name)]
        out: dict[str, Any] = {}
        for r in self.rules:
            if r.kind == kind and r.name == name and r.nth <= n < r.nth + r.times:
                out.update(r.action)
                self.fired[f"{kind}:{name}:" + ",".join(sorted(r.action))] += 1
        return out

    def roll(self, what: str) -> bool:
        p = getattr(self, what)
        if p and self.rng.random() < p:
            self.fired[f"wire:{what}"] += 1
            return True
        return False

    def req_cqe_status(self) -> int | None:
        self.req_cqes += 1
        status = self.cqe_faults.get(self.req_cqes)
        if status is not None:
            self.fired["cqe:status"] += 1
        return status

    def cq_is_full(self) -> bool:
        self.cqe_posts += 1
        if self.cqe_posts in self.cq_full_at:
            self.fired["cq:full"] += 1
            return True
        return False

    def total_fired(self) -> int:
        return sum(self.fired.values())
