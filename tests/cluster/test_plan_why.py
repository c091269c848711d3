"""The plan's "why" line agrees with its own numbers (it once read "all2all is cheapest ... 1.15 ms vs
flat-ring 495 µs"): the winner's modelled time is at most the rival it quotes, both equal the
candidates' times, and a cheaper flat ring it cannot run is named as such, never as the runner-up."""

from __future__ import annotations

import re

import pytest

from tinydist.scheduler.plan import plan_allreduce
from tinydist.scheduler.topology import NodeSpec, Topology

UNITS = {"s": 1.0, "ms": 1e-3, "µs": 1e-6}
TIME = r"([0-9.e+-]+) (s|ms|µs)"
WHY = re.compile(rf"(?P<winner>\S+)(?: is the cheapest (?P<executable>executable )?candidate under the α–β model|"
                 rf": the across-groups algorithm was forced \(inter='(?P<forced>\w+)'\))"
                 rf"(?: \({TIME} vs (?P<rival>\S+) {TIME}\))?"
                 rf"(?:; flat-ring would be cheaper \({TIME}\) but is not executable between multi-device processes)?$")


def _seconds(number: str, unit: str) -> float:
    return float(number) * UNITS[unit]


def _cluster(nodes: int, devices: int, per_host: int) -> Topology:
    return Topology([NodeSpec(f"n{i}", i, f"h{i // per_host}", [f"CPU:{d}" for d in range(devices)])
                     for i in range(nodes)])


@pytest.mark.parametrize("executable", [True, False])
@pytest.mark.parametrize("inter", ["auto", "ring"])
@pytest.mark.parametrize("nodes,devices,per_host", [(1, 4, 1), (2, 2, 1), (8, 8, 1), (8, 1, 2), (64, 8, 1)])
@pytest.mark.parametrize("nbytes", [1024, 1 << 20, 256 << 20])
def test_why_agrees_with_the_candidates(nodes: int, devices: int, per_host: int, nbytes: int, inter: str,
                                        executable: bool) -> None:
    plan = plan_allreduce(_cluster(nodes, devices, per_host), nbytes, executable=executable, inter=inter, log=False)
    why = WHY.fullmatch(plan.reason)
    assert why, plan.reason
    winner = why["winner"]
    chosen = plan.candidates[winner]
    assert chosen == pytest.approx(plan.modelled_s)           # the winner named is the plan made
    if plan.strategy == "flat-ring":
        assert winner == "flat-ring"
    elif len(plan.groups) > 1:
        assert winner == f"hierarchical/{plan.inter_algorithm}"
    assert (why["forced"] is not None) == (inter != "auto")
    if why["rival"] is not None:
        quoted, rival = _seconds(why[4], why[5]), _seconds(why[7], why[8])
        assert quoted == pytest.approx(chosen, rel=5e-3) and rival == pytest.approx(plan.candidates[why["rival"]], rel=5e-3)
        if why["forced"] is None:
            assert chosen <= plan.candidates[why["rival"]], plan.reason     # cheapest means cheapest
        assert not (executable and why["rival"] == "flat-ring"), plan.reason
    flat = plan.candidates["flat-ring"]
    if executable:
        assert (why[9] is not None) == (flat < chosen), plan.reason
        if why[9] is not None:
            assert _seconds(why[9], why[10]) == pytest.approx(flat, rel=5e-3)
    else:
        assert why[9] is None
        if inter == "auto":
            assert chosen == min(plan.candidates.values()), plan.reason


def test_the_issue_s_case_names_the_flat_ring_apart() -> None:
    """8 hosts of 8 devices, 256 MiB: the flat ring is cheaper in the model and not executable."""
    plan = plan_allreduce(_cluster(8, 8, 1), 256 << 20, log=False)
    assert plan.candidates["flat-ring"] < plan.modelled_s
    assert plan.reason.startswith(f"hierarchical/{plan.inter_algorithm} is the cheapest executable candidate")
    assert "; flat-ring would be cheaper (" in plan.reason and " vs flat-ring" not in plan.reason
