"""The ONNX node conformance suite, generated from the installed onnx package, run on tinydist.

The onnx wheel ships the generators (`onnx.backend.test.case.node`), not the data: collecting the
cases takes ~12 s, so they are generated once per onnx version into the cache dir
(`$TINYDIST_CACHE_DIR/onnx-node-suite/<onnx version>-<format>/<case>.npz`: the model's bytes, every data
set's inputs and expected outputs, onnx's rtol/atol; no pickles). A case is in the suite when no
graph input or output (nor a sequence's or optional's element) is of a dtype among string /
bfloat16 / float8 / float4 / float6 / int4 / int2. Sequence values are stored element by element
and fed as lists of arrays, an empty optional as None, as onnxruntime takes them; cases with map
values are in the suite and fail.

Each case is loaded with `tinydist.onnx.load` and called on every data set; outputs are compared as
onnx's own backend runner does (shape, dtype, then `assert_allclose(rtol, atol)` with the case's
tolerances). The outcome is "pass" or the first line of the failure.

    python -m tests.onnx.node_suite            # run, print the summary
    python -m tests.onnx.node_suite --update   # rewrite the known-missing list and docs/onnx.md's table
"""

from __future__ import annotations

import collections
import io
import re
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
MISSING_FILE = Path(__file__).with_name("node_suite_missing.txt")
DOC_FILE = ROOT / "docs" / "onnx.md"
TABLE_BEGIN, TABLE_END = "<!-- node-suite table: begin (python -m tests.onnx.node_suite --update) -->", \
    "<!-- node-suite table: end -->"

# TensorProto element types left out of the suite: strings and the sub-byte / 8-bit / 16-bit-brain floats
EXCLUDED_ELEM = {8: "string", 16: "bfloat16", 17: "float8", 18: "float8", 19: "float8", 20: "float8", 24: "float8",
                 23: "float4", 21: "int4", 22: "int4", 25: "int2", 26: "int2", 27: "float6", 28: "float6"}


_FORMAT = 3  # of the cached files: 3 stores sequences and optionals (2 read TensorProto data sets as arrays)


class Case:
    __slots__ = ("name", "op", "opset", "model", "data_sets", "rtol", "atol", "non_tensor")

    def __init__(self, name: str, op: str, opset: int, model: bytes, data_sets: list[tuple[list[np.ndarray], list[np.ndarray]]],
                 rtol: float, atol: float, non_tensor: bool) -> None:
        self.name, self.op, self.opset, self.model, self.data_sets = name, op, opset, model, data_sets
        self.rtol, self.atol, self.non_tensor = rtol, atol, non_tensor


def _cache_dir() -> Path:
    import onnx

    from tinydist.base.config import settings
    return Path(settings.CACHE_DIR) / "onnx-node-suite" / f"{onnx.__version__}-{_FORMAT}"


def _value_elems(model: Any) -> list[int | None]:
    """Element type of every graph input and output, through sequences and optionals (None: a map
    or another type the suite does not feed)."""
    def elem(tp: Any) -> int | None:
        field = tp.WhichOneof("value")
        if field == "tensor_type":
            return int(tp.tensor_type.elem_type)
        if field in ("sequence_type", "optional_type"):
            return elem(getattr(tp, field).elem_type)
        return None
    return [elem(vi.type) for vi in list(model.graph.input) + list(model.graph.output)]


def _storable(value: Any) -> bool:
    if isinstance(value, list):
        return all(_storable(v) for v in value)
    return value is None or isinstance(value, (np.ndarray, np.generic))


def _store(arrays: dict[str, np.ndarray], key: str, value: Any) -> None:
    """`key` holds an array; a sequence is `key.seq` (its length) and `key.<k>` per element; None is `key.none`."""
    if value is None:
        arrays[key + ".none"] = np.zeros(0)
    elif isinstance(value, list):
        arrays[key + ".seq"] = np.array(len(value))
        for k, v in enumerate(value):
            _store(arrays, f"{key}.{k}", v)
    else:
        arrays[key] = np.asarray(value)


def _restore(z: Any, key: str) -> Any:
    if key + ".none" in z.files:
        return None
    if key + ".seq" in z.files:
        return [_restore(z, f"{key}.{k}") for k in range(int(z[key + ".seq"]))]
    return z[key]


def _opset(model: Any) -> int:
    return next((imp.version for imp in model.opset_import if imp.domain in ("", "ai.onnx")), 0)


def _as_array(value: Any) -> Any:
    """A data set's value as numpy: some generators give TensorProtos (Cast's, to keep exact bits)."""
    from onnx import TensorProto, numpy_helper
    return numpy_helper.to_array(value) if isinstance(value, TensorProto) else value


def _generate(directory: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from onnx.backend.test.case import node
        cases = node.collect_testcases(None)
    single = {c.name: c.model.graph.node[0].op_type for c in cases if len(c.model.graph.node) == 1}
    directory.mkdir(parents=True, exist_ok=True)
    for case in cases:
        elems = _value_elems(case.model)
        if any(e in EXCLUDED_ELEM for e in elems):
            continue
        case.data_sets = [([_as_array(v) for v in ins], [_as_array(v) for v in outs]) for ins, outs in case.data_sets]
        base = re.sub(r"_expanded.*$", "", case.name)
        op = single.get(case.name) or single.get(base) or case.model.graph.node[-1].op_type
        non_tensor = None in elems or not all(_storable(v) for ins, outs in case.data_sets for v in (*ins, *outs))
        arrays: dict[str, np.ndarray] = {"model": np.frombuffer(case.model.SerializeToString(), np.uint8),
                                         "meta": np.array([case.rtol, case.atol, _opset(case.model), non_tensor], np.float64),
                                         "op": np.array(op)}
        if not non_tensor:
            for i, (ins, outs) in enumerate(case.data_sets):
                for j, v in enumerate(ins):
                    _store(arrays, f"in_{i}_{j}", v)
                for j, v in enumerate(outs):
                    _store(arrays, f"out_{i}_{j}", v)
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        (directory / f"{case.name}.npz").write_bytes(buffer.getvalue())
    (directory / "complete").write_text(str(len(cases)))


def load_cases() -> list[Case]:
    """Every case of the suite, generated into the cache dir on first use."""
    directory = _cache_dir()
    if not (directory / "complete").exists():
        _generate(directory)
    cases = []
    for path in sorted(directory.glob("*.npz")):
        with np.load(path, allow_pickle=False) as z:
            rtol, atol, opset, non_tensor = z["meta"].tolist()
            sets: dict[int, tuple[dict[int, Any], dict[int, Any]]] = collections.defaultdict(lambda: ({}, {}))
            for key in z.files:
                kind, _, rest = key.partition("_")
                if kind in ("in", "out"):
                    i, j = (int(p) for p in rest.split(".")[0].split("_"))
                    sets[i][0 if kind == "in" else 1][j] = _restore(z, f"{kind}_{i}_{j}")
            data = [([ins[j] for j in sorted(ins)], [outs[j] for j in sorted(outs)]) for _, (ins, outs) in sorted(sets.items())]
            cases.append(Case(path.stem, str(z["op"]), int(opset), z["model"].tobytes(), data, rtol, atol, bool(non_tensor)))
    return cases


def run_case(case: Case) -> str:
    """'pass', or the first line of what went wrong (a refusal at load or call, or a mismatch)."""
    import onnx

    import tinydist.onnx as tdo

    if case.non_tensor:
        return "map values are not supported"
    proto = onnx.load_from_string(case.model)
    try:
        model = tdo.load(proto)
        input_names = [vi.name for vi in proto.graph.input if vi.name not in {i.name for i in proto.graph.initializer}]
        for ins, want in case.data_sets:
            got = model(dict(zip(input_names, ins)))
            have = list(got.values())
            if len(have) != len(want):
                return f"{len(have)} outputs, expected {len(want)}"
            for k, (h, w) in enumerate(zip(have, want)):
                problem = _compare(f"output {k}", h, w, case)
                if problem:
                    return problem
    except AssertionError as e:
        return "mismatch: " + " ".join(str(e).split())[:160]
    except Exception as e:  # noqa: BLE001 - every failure is an outcome to record
        text = str(e).strip().splitlines()
        return f"{type(e).__name__}: {text[0] if text else ''}"[:200]
    return "pass"


def _compare(what: str, have: Any, want: Any, case: Case) -> str | None:
    """None when `have` matches `want` (arrays, lists of them for sequences, None for an empty
    optional), else what differs; values by `assert_allclose` (raises AssertionError)."""
    if want is None:
        return None if have is None else f"{what}: {type(have).__name__}, expected None (an empty optional)"
    if isinstance(want, list):
        if not isinstance(have, list):
            return f"{what}: {type(have).__name__}, expected a sequence"
        if len(have) != len(want):
            return f"{what}: a sequence of {len(have)}, expected {len(want)}"
        return next((p for k, (h, w) in enumerate(zip(have, want)) if (p := _compare(f"{what}[{k}]", h, w, case))), None)
    if not isinstance(have, np.ndarray):
        return f"{what}: {type(have).__name__}, expected an array"
    if have.shape != want.shape:
        return f"{what}: shape {have.shape}, expected {want.shape}"
    if have.dtype != want.dtype:
        return f"{what}: dtype {have.dtype}, expected {want.dtype}"
    np.testing.assert_allclose(have, want, rtol=case.rtol, atol=case.atol)
    return None


def run_all(cases: list[Case] | None = None) -> dict[str, str]:
    import structlog

    cases = load_cases() if cases is None else cases
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))  # a refusal logs; keep the run quiet
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return {case.name: run_case(case) for case in cases}


# ---- the committed list and the doc -----------------------------------------------------------

def read_missing() -> dict[str, str]:
    found = {}
    for line in MISSING_FILE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, reason = line.partition(" ")
            found[name] = reason.strip()
    return found


def missing_text(outcomes: dict[str, str]) -> str:
    lines = [(f"# onnx {_onnx_version()}: node-suite cases tinydist does not pass yet, `name  reason` "
              "(python -m tests.onnx.node_suite --update)."),
             "# tests/onnx/test_node_suite.py fails when a case not listed fails, and when a listed case passes."]
    lines += [f"{name}  {reason}" for name, reason in sorted(outcomes.items()) if reason != "pass"]
    return "\n".join(lines) + "\n"


def table(cases: list[Case], outcomes: dict[str, str]) -> str:
    counts: dict[tuple[str, int], list[int]] = collections.defaultdict(lambda: [0, 0])
    for case in cases:
        cell = counts[(case.op, case.opset)]
        cell[0] += outcomes[case.name] == "pass"
        cell[1] += 1
    passed = sum(o == "pass" for o in outcomes.values())
    lines = [TABLE_BEGIN, "",
             (f"**{passed} of {len(outcomes)} cases pass ({100 * passed / len(outcomes):.1f} %)**, onnx "
              f"{_onnx_version()}: every case of `onnx.backend.test.case.node` whose graph inputs and outputs avoid "
              "string, bfloat16, float8, float4, float6, int4 and int2; `_expanded` cases (an op's function body) "
              "count under the op."), "",
             "| op | opset | pass / cases |", "|---|---|---|"]
    for (op, opset), (ok, total) in sorted(counts.items()):
        lines.append(f"| {op} | {opset} | {ok} / {total}{'' if ok == total else ' ✗'} |")
    lines += ["", TABLE_END]
    return "\n".join(lines)


def _onnx_version() -> str:
    import onnx
    return onnx.__version__


def doc_with_table(text: str, new_table: str) -> str:
    start, end = text.find(TABLE_BEGIN), text.find(TABLE_END)
    if start < 0 or end < 0:
        raise ValueError(f"{DOC_FILE} has no node-suite table markers")
    return text[:start] + new_table + text[end + len(TABLE_END):]


def summary(outcomes: dict[str, str]) -> Iterator[str]:
    passed = sum(o == "pass" for o in outcomes.values())
    yield f"{passed} / {len(outcomes)} pass ({100 * passed / len(outcomes):.2f} %)"
    reasons = collections.Counter(re.sub(r"'[^']*'|\d+", "…", o)[:90] for o in outcomes.values() if o != "pass")
    for reason, n in reasons.most_common(40):
        yield f"{n:5d}  {reason}"


def main(argv: list[str]) -> None:
    started = time.perf_counter()
    cases = load_cases()
    outcomes = run_all(cases)
    for line in summary(outcomes):
        print(line)
    print(f"{time.perf_counter() - started:.0f} s")
    if "--update" in argv:
        MISSING_FILE.write_text(missing_text(outcomes))
        DOC_FILE.write_text(doc_with_table(DOC_FILE.read_text(), table(cases, outcomes)))


if __name__ == "__main__":
    main(sys.argv[1:])
