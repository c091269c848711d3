"""Process replay: every corpus graph schedules and lowers byte for byte as its golden recorded.

A mismatch means the schedule or the emitted IR changed. If that is the point of the change,
regenerate the goldens (the failure says how) and commit them with it; a golden is never written
by this test, so a missing one fails too. The corpus and what it leaves out: process_replay_corpus.py.
"""

from __future__ import annotations

import difflib

import llvmlite
import pytest

from tinydist.schedule import schedule_cache

from .process_replay_corpus import GOLDEN_DIR, GRAPHS, LLVMLITE_VERSION_FILE, golden_path, render, update_command

DIFF_LINES = 120  # enough to see what moved; the rest would bury it


def _mismatch(name: str, expected: str, actual: str) -> str:
    diff = list(difflib.unified_diff(expected.splitlines(), actual.splitlines(), f"golden/{name}.txt", f"now/{name}.txt",
                                     lineterm="", n=2))
    shown = diff[:DIFF_LINES] + ([f"... {len(diff) - DIFF_LINES} more diff lines"] if len(diff) > DIFF_LINES else [])
    recorded = LLVMLITE_VERSION_FILE.read_text(encoding="utf-8").strip() if LLVMLITE_VERSION_FILE.exists() else "unknown"
    hint = (f"\nThe goldens were written with llvmlite {recorded}, this is llvmlite {llvmlite.__version__}: "
            "its IR printer may differ." if recorded != llvmlite.__version__ else "")
    return (f"graph {name!r} no longer schedules or lowers as recorded in {golden_path(name)}:\n" + "\n".join(shown) + hint +
            f"\nIf the change is deliberate, regenerate and commit the goldens: {update_command(name)}")


@pytest.mark.parametrize("name", list(GRAPHS))
def test_graph_replays_as_recorded(name: str) -> None:
    path = golden_path(name)
    if not path.exists():
        pytest.fail(f"graph {name!r} has no golden {path}; generate it deliberately: {update_command(name)}",
                    pytrace=False)
    expected = path.read_text(encoding="utf-8")
    actual = render(name)
    if actual != expected:
        pytest.fail(_mismatch(name, expected, actual), pytrace=False)


@pytest.mark.parametrize("name", list(GRAPHS))
def test_schedule_cache_hit_replays_the_same(name: str) -> None:
    """The same graph built again is a schedule cache hit (what realize and td.jit see from the
    second step on), and must render exactly as the freshly scheduled one."""
    schedule_cache.clear()
    cold = render(name)
    hits = schedule_cache.hits
    assert render(name) == cold
    assert schedule_cache.hits == hits + 1


def test_every_golden_has_a_graph() -> None:
    stale = sorted(p.stem for p in GOLDEN_DIR.glob("*.txt") if p.stem not in GRAPHS)
    assert not stale, f"goldens without a corpus graph: {stale}; `{update_command()}` removes them"
