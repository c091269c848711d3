"""The real-architecture set against onnxruntime: every model, both opsets, batch 1 and 8, 10 calls.

The models in tests/onnx/architectures/models/ were exported by torch from torchvision, timm and
transformers code with random weights (`python -m tests.onnx.architectures.export`, see its
docstring and docs/onnx.md): at the exporter's default opset and at 13, with a dynamic batch axis.
Each test loads one file once, then makes 10 calls with different random inputs (fixed seeds; token
ids over the vocabulary, padding masks, segment ids; images and spectrograms in [-1, 1]) and
compares every output with onnxruntime.

The tolerance is relative to the output's scale — max |tinydist - onnxruntime| <= 2e-5 * max
|onnxruntime| — because logits and hidden states range from ~1e-2 to ~10 across these models and
float32 differences come from summation order (seen here: at most 6.0e-7 of the scale, MLP-Mixer
at opset 13; 30x margin for other machines' vector widths); a wrong op, a swapped input or a wrong
mask is off by O(1) of it (the batch-reuse bug fixed with this set: 0.13-0.5 of the scale).
"""

from __future__ import annotations

import functools
import math
import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import tinydist.onnx as tdo
from tinydist.engine import parallel

MODELS = Path(__file__).resolve().parent / "architectures" / "models"
MANIFEST: dict[str, Any] = json.loads((MODELS / "manifest.json").read_text())
FILES = sorted(name for name in MANIFEST if name.endswith(".onnx"))
CALLS = 10
SCALE_TOL = 2e-5


@functools.cache
def _tinydist(name: str) -> tdo.OnnxModel:
    return tdo.load(str(MODELS / name))


@functools.cache
def _onnxruntime(name: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    return ort.InferenceSession(str(MODELS / name), options, providers=["CPUExecutionProvider"])


def feeds(entry: dict[str, Any], batch: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for spec in entry["inputs"]:
        shape = tuple(batch if d == "batch" else d for d in spec["shape"])
        if spec["dtype"] == "int64":
            value = rng.integers(spec["low"], spec["high"], shape, dtype=np.int64)
            if spec["name"] == "attention_mask":  # right padding of a random length, at least one token kept
                lengths = rng.integers(1, shape[1] + 1, shape[0])
                value = (np.arange(shape[1])[None, :] < lengths[:, None]).astype(np.int64)
        else:
            value = rng.uniform(spec["low"], spec["high"], shape).astype(spec["dtype"])
        out[spec["name"]] = value
    return out


@pytest.mark.parametrize(("name", "batch"), [pytest.param(name, batch, id=f"{name.removesuffix('.onnx')}-b{batch}")
                                             for name in FILES for batch in (1, 8)])
def test_architecture_equals_onnxruntime(name: str, batch: int) -> None:
    entry = MANIFEST[name]
    model, session = _tinydist(name), _onnxruntime(name)
    for call in range(CALLS):
        feed = feeds(entry, batch, seed=1000 * batch + call)
        want = session.run(None, feed)
        got = model(feed)
        assert list(got) == entry["outputs"]
        for (out_name, have), expected in zip(got.items(), want):
            where = f"{name} batch {batch} call {call} output {out_name!r}"
            assert have.dtype == expected.dtype and have.shape == expected.shape, (
                f"{where}: {have.dtype}{have.shape} vs onnxruntime {expected.dtype}{expected.shape}")
            scale = float(np.abs(expected).max())
            assert np.ptp(expected) > 1e-3 * scale, f"{where}: onnxruntime's output is constant, the comparison shows nothing"
            err = float(np.abs(have.astype(np.float64) - expected).max())
            assert err <= SCALE_TOL * scale, f"{where}: max error {err:.3g} vs scale {scale:.3g}"


def test_manifest_lists_every_file_at_its_opset() -> None:
    """The set is what the manifest says: every file listed, each at the opset recorded, both
    variants of every model (the default opset above 13), a dynamic batch axis on every input."""
    on_disk = sorted(p.name for p in MODELS.glob("*.onnx"))
    assert on_disk == FILES
    for name in FILES:
        proto = onnx.load(str(MODELS / name), load_external_data=False)
        opset = next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
        assert opset == MANIFEST[name]["opset"], name
        assert [i.name for i in proto.graph.input] == [s["name"] for s in MANIFEST[name]["inputs"]], name
        for value in proto.graph.input:
            assert value.type.tensor_type.shape.dim[0].dim_param, f"{name}: input {value.name} has a fixed batch"
    models = {MANIFEST[n]["model"] for n in FILES}
    for model in models:
        opsets = sorted(MANIFEST[n]["opset"] for n in FILES if MANIFEST[n]["model"] == model)
        assert len(opsets) == 2 and opsets[0] == 13 < opsets[1], (model, opsets)


@pytest.mark.parametrize("name", ["resnet_default.onnx", "gpt2_default.onnx"])
def test_weights_in_an_external_data_file(name: str, tmp_path: Path) -> None:
    """torch.onnx.export's default (external_data=True) writes the weights beside the graph in
    `<file>.data`; loading the path reads them from there, as onnxruntime does."""
    proto = onnx.load(str(MODELS / name))
    path = tmp_path / name
    onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=f"{name}.data", size_threshold=0)
    stored = onnx.load(str(path), load_external_data=False).graph.initializer
    assert all(t.data_location == onnx.TensorProto.EXTERNAL for t in stored if t.dims)
    feed = feeds(MANIFEST[name], 2, seed=7)
    want = _onnxruntime(name).run(None, feed)
    got = tdo.load(str(path))(feed)
    for have, expected in zip(got.values(), want):
        np.testing.assert_allclose(have, expected, rtol=0, atol=SCALE_TOL * float(np.abs(expected).max()))


@pytest.mark.parametrize("name", [name for name in FILES if name.endswith("_default.onnx")],
                         ids=lambda name: name.removesuffix("_default.onnx"))
def test_threads_equal_one_thread_bitwise(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The intra-op split (`tinydist.engine.parallel`) computes every element with the code one
    thread uses: 1 and 2 threads agree bitwise, at batch 8 (where the big calls split). Every call
    big enough splits here, even in a frame whose splits would not pay for their waits (most of
    this set's frames run on one thread then): the pieces' code is what this test is about."""
    monkeypatch.setattr(parallel, "FRAME_MIN_SAVING", -math.inf)
    entry = MANIFEST[name]
    one, two = tdo.load(str(MODELS / name), threads=1), tdo.load(str(MODELS / name), threads=2)
    for call in range(3):
        feed = feeds(entry, 8, seed=7000 + call)
        for (out_name, a), b in zip(one(feed).items(), two(feed).values()):
            np.testing.assert_array_equal(a, b, err_msg=f"{name} call {call} output {out_name!r}")
