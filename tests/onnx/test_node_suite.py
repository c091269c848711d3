"""The ONNX node conformance suite (tests/onnx/node_suite.py) against the committed list of cases
tinydist does not pass yet, and docs/onnx.md's per-op × per-opset table against the results.

A case that fails and is not listed is a regression; a listed case that passes is a stale entry:
both fail here. After adding an op: `python -m tests.onnx.node_suite --update` and commit the list
and the doc. The list belongs to one onnx version (its header); another version skips these tests
with that instruction. The whole suite runs once per session (~1-3 minutes on two cores)."""

from __future__ import annotations

import onnx
import pytest

from tests.onnx import node_suite

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def suite():
    version_line = node_suite.MISSING_FILE.read_text().splitlines()[0]
    if f"onnx {onnx.__version__}" not in version_line:
        pytest.skip(f"the known-missing list is for {version_line!r}, onnx {onnx.__version__} is installed: "
                    "run python -m tests.onnx.node_suite --update")
    cases = node_suite.load_cases()
    return cases, node_suite.run_all(cases)


def test_failures_are_exactly_the_known_missing_cases(suite):
    _, outcomes = suite
    listed = node_suite.read_missing()
    regressions = {name: why for name, why in outcomes.items() if why != "pass" and name not in listed}
    stale = sorted(name for name in listed if outcomes.get(name, "pass") == "pass")
    assert not regressions, f"{len(regressions)} cases fail that are not in {node_suite.MISSING_FILE.name}: " + \
        "; ".join(f"{n}: {w}" for n, w in sorted(regressions.items())[:20])
    assert not stale, f"{len(stale)} listed cases pass now (or are gone): {stale[:20]}; run python -m tests.onnx.node_suite --update"


def test_doc_table_matches_the_results(suite):
    cases, outcomes = suite
    table = node_suite.table(cases, outcomes)
    assert table in node_suite.DOC_FILE.read_text(), \
        "docs/onnx.md's node-suite table is out of date: run python -m tests.onnx.node_suite --update"


def test_suite_selection_leaves_out_only_the_excluded_dtypes(suite):
    cases, _ = suite
    assert len(cases) > 1000  # the installed onnx generates well over a thousand node cases
    for case in cases:
        model = onnx.load_from_string(case.model)
        assert not set(node_suite._value_elems(model)) & set(node_suite.EXCLUDED_ELEM), case.name


def _ops_of(graph: onnx.GraphProto) -> set[str]:
    ops = set()
    for node in graph.node:
        ops.add(node.op_type)
        for attribute in node.attribute:
            for sub in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                ops |= _ops_of(sub)
    return ops


def test_every_case_of_an_op_the_real_architectures_use_passes(suite):
    """Issue 28: 100 % of the node-suite cases of every op in tests/onnx/architectures/models/."""
    cases, outcomes = suite
    models = sorted((node_suite.ROOT / "tests" / "onnx" / "architectures" / "models").glob("*.onnx"))
    assert len(models) >= 30
    used = set().union(*(_ops_of(onnx.load(str(path), load_external_data=False).graph) for path in models))
    covered = {case.op for case in cases} & used
    assert len(covered) >= 40, f"the suite has cases for only {sorted(covered)} of the set's ops {sorted(used)}"
    failing = {case.name: outcomes[case.name] for case in cases if case.op in used and outcomes[case.name] != "pass"}
    assert not failing, f"node-suite cases of ops the real architectures use fail: {failing}"
