"""A BERT-shaped encoder, frame after frame, against onnxruntime.

Regression tests for two bugs of the frame loop (`OnnxModel.__call__` → `TinyJit.call_numpy`):

* A BERT encoder exported by torch.onnx.export declares three int64 inputs (input_ids,
  attention_mask, token_type_ids) of one shape and dtype, and its graph reaches them out of that
  order (the token-type embedding and the mask come before the word embedding). Calls 1 and 2 were
  right; from call 3 on the replay copied the arrays into the captured input buffers by list
  position, not argument position, so the inputs were silently swapped.
* A model loaded on a device other than the default one failed on its first call with "matmul:
  operands are on different devices": the call before capture uploaded the inputs to the default
  device, next to weights on the model's device.

So each test replays many calls with different random inputs (ids, padding masks, segments) at
two batch sizes, interleaved, and compares every call with onnxruntime. The graph is built with
onnx.helper in the shape exporters emit: Gather embeddings, Shape/Gather/Concat reshapes, the
attention mask made additive with Cast/Sub/Mul (or Where), LayerNormalization (opset 17) or its
decomposed ReduceMean/Sub/Pow/Sqrt/Div form (older exporters, opset 13), Erf GELU, two layers.
The last tests export a real torch module (and transformers' BertModel) when those are installed.
"""

from __future__ import annotations

import io
import itertools
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import tinydist.onnx as tdo
from tinydist import cli

F32 = np.float32
# float32 attention over 32 features and two layers: onnxruntime and tinydist differ by ~1e-6
# (summation order); 1e-4 is far below what a swapped input or a wrong mask produces (O(1)).
RTOL = ATOL = 1e-4


@dataclass(frozen=True)
class Bert:
    """Sizes and the exporter dialect of a tiny BERT encoder."""

    vocab: int = 40
    hidden: int = 32
    heads: int = 4
    intermediate: int = 64
    layers: int = 2
    max_positions: int = 24
    type_vocab: int = 2
    layernorm: str = "fused"  # "fused": LayerNormalization (opset 17); "decomposed": ReduceMean/Sub/Pow/Sqrt/Div (opset 13)
    mask: str = "mul"         # "mul": (1 - Cast(mask)) * min (transformers); "where": Where(mask == 0, min, 0)

    @property
    def opset(self) -> int:
        return 17 if self.layernorm == "fused" else 13


class _Graph:
    """Nodes and initializers with generated names: `g.op("MatMul", a, b)` returns the output's name."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._ids = itertools.count()

    def const(self, value: Any, dtype: Any = F32) -> str:
        name = f"c{next(self._ids)}"
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def weight(self, *shape: int, scale: float) -> str:
        return self.const(self.rng.standard_normal(shape) * scale)

    def op(self, op_type: str, *inputs: str, **attrs: Any) -> str:
        out = f"{op_type.lower()}{next(self._ids)}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out

    def dim(self, x: str, axis: int) -> str:
        """x.shape[axis] as a 1-element int64 tensor, the way exporters spell a dynamic size."""
        return self.op("Unsqueeze", self.op("Gather", self.op("Shape", x), self.const(axis, np.int64), axis=0),
                       self.const([0], np.int64))

    def linear(self, x: str, n_in: int, n_out: int) -> str:
        return self.op("Add", self.weight(n_out, scale=0.1), self.op("MatMul", x, self.weight(n_in, n_out, scale=n_in ** -0.5)))

    def layernorm(self, x: str, cfg: Bert) -> str:
        gamma, beta = self.const(1 + 0.1 * self.rng.standard_normal(cfg.hidden)), self.weight(cfg.hidden, scale=0.1)
        if cfg.layernorm == "fused":
            return self.op("LayerNormalization", x, gamma, beta, axis=-1, epsilon=1e-12)
        mean = self.op("ReduceMean", x, axes=[-1], keepdims=1)
        centered = self.op("Sub", x, mean)
        var = self.op("ReduceMean", self.op("Pow", centered, self.const(2.0)), axes=[-1], keepdims=1)
        normed = self.op("Div", centered, self.op("Sqrt", self.op("Add", var, self.const(1e-12))))
        return self.op("Add", self.op("Mul", normed, gamma), beta)


def bert_model(cfg: Bert, seed: int = 0) -> onnx.ModelProto:
    """The encoder with symbolic batch and sequence, outputs (last_hidden_state, pooler_output)."""
    g = _Graph(np.random.default_rng(seed))
    d, h = cfg.hidden, cfg.heads
    dh = d // h
    # Consumed out of declaration order: token types first, then the mask, then the ids.
    types = g.op("Gather", g.weight(cfg.type_vocab, d, scale=0.5), "token_type_ids")
    mask4 = g.op("Unsqueeze", "attention_mask", g.const([1, 2], np.int64))                  # (B, 1, 1, S)
    lowest = g.const(np.finfo(F32).min)
    if cfg.mask == "mul":
        additive = g.op("Mul", g.op("Sub", g.const(1.0), g.op("Cast", mask4, to=TensorProto.FLOAT)), lowest)
    else:
        additive = g.op("Where", g.op("Equal", mask4, g.const(0, np.int64)), lowest, g.const(0.0))
    words = g.op("Gather", g.weight(cfg.vocab, d, scale=0.5), "input_ids")
    position_ids = g.const(np.arange(cfg.max_positions)[None], np.int64)                    # a buffer, sliced to S
    positions = g.op("Slice", position_ids, g.const([0], np.int64), g.dim("input_ids", 1), g.const([1], np.int64))
    x = g.layernorm(g.op("Add", g.op("Add", types, words), g.op("Gather", g.weight(cfg.max_positions, d, scale=0.5), positions)), cfg)
    for _ in range(cfg.layers):
        batch, seq = g.dim(x, 0), g.dim(x, 1)
        heads_shape = g.op("Concat", batch, seq, g.const([h, dh], np.int64), axis=0)

        def split_heads(t: str, perm: list[int]) -> str:
            return g.op("Transpose", g.op("Reshape", t, heads_shape), perm=perm)
        q = split_heads(g.linear(x, d, d), [0, 2, 1, 3])
        kt = split_heads(g.linear(x, d, d), [0, 2, 3, 1])
        v = split_heads(g.linear(x, d, d), [0, 2, 1, 3])
        scores = g.op("Add", g.op("Div", g.op("MatMul", q, kt), g.const(np.sqrt(dh))), additive)
        context = g.op("MatMul", g.op("Softmax", scores, axis=-1), v)
        merged = g.op("Reshape", g.op("Transpose", context, perm=[0, 2, 1, 3]),
                      g.op("Concat", batch, seq, g.const([d], np.int64), axis=0))
        x = g.layernorm(g.op("Add", g.linear(merged, d, d), x), cfg)
        up = g.linear(x, d, cfg.intermediate)
        erf = g.op("Erf", g.op("Div", up, g.const(np.sqrt(2.0))))                              # GELU as exported:
        gelu = g.op("Mul", g.op("Mul", up, g.op("Add", erf, g.const(1.0))), g.const(0.5))     # x (1 + erf(x/√2)) / 2
        x = g.layernorm(g.op("Add", g.linear(gelu, cfg.intermediate, d), x), cfg)
    g.nodes.append(helper.make_node("Identity", [x], ["last_hidden_state"]))
    first = g.op("Gather", x, g.const(0, np.int64), axis=1)
    g.nodes.append(helper.make_node("Tanh", [g.linear(first, d, d)], ["pooler_output"]))
    inputs = [helper.make_tensor_value_info(name, TensorProto.INT64, ["batch", "sequence"])
              for name in ("input_ids", "attention_mask", "token_type_ids")]
    outputs = [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", "sequence", d]),
               helper.make_tensor_value_info("pooler_output", TensorProto.FLOAT, ["batch", d])]
    graph = helper.make_graph(g.nodes, "bert_like", inputs, outputs, g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", cfg.opset)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def random_frame(rng: np.random.Generator, batch: int, seq: int, vocab: int) -> dict[str, np.ndarray]:
    """Random ids, a padding mask (every row keeps at least one token), and two segments."""
    lengths = rng.integers(1, seq + 1, batch)
    mask = (np.arange(seq) < lengths[:, None]).astype(np.int64)
    ids = np.where(mask == 1, rng.integers(1, vocab, (batch, seq)), 0).astype(np.int64)  # 0: the pad token
    types = ((np.arange(seq) >= rng.integers(1, seq + 1, (batch, 1))) & (mask == 1)).astype(np.int64)
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


def session(model_bytes: bytes) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    return ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])


def frames(seed: int, batches: tuple[int, ...], calls: int, seq: int, vocab: int) -> Iterator[dict[str, np.ndarray]]:
    """`calls` frames per batch size, the sizes interleaved (each shape has its own capture)."""
    rng = np.random.default_rng(seed)
    for _ in range(calls):
        for batch in batches:
            yield random_frame(rng, batch, seq, vocab)


def assert_frames_match(model_bytes: bytes, device: str, feeds: Iterator[dict[str, np.ndarray]]) -> None:
    """Every call of the loaded model equals onnxruntime's run of the same frame."""
    loaded, reference = tdo.load(model_bytes, device=device), session(model_bytes)
    names = [o.name for o in reference.get_outputs()]
    for call, feed in enumerate(feeds, 1):
        got = loaded(feed)
        assert list(got) == names
        for name, want in zip(names, reference.run(None, feed)):
            shape = feed["input_ids"].shape
            np.testing.assert_allclose(got[name], want, rtol=RTOL, atol=ATOL,
                                       err_msg=f"call {call}, batch x seq {shape}, output {name!r}")


@pytest.mark.parametrize("device", ["CPU", "CPU:1"])
@pytest.mark.parametrize("cfg", [Bert(layernorm="fused", mask="mul"), Bert(layernorm="decomposed", mask="where")],
                         ids=["layernorm-opset17", "decomposed-opset13"])
def test_bert_like_frames_equal_onnxruntime(cfg: Bert, device: str) -> None:
    """10 frames per batch size (1 and 8), interleaved: calls 1 and 2 of each shape run and capture, the rest replay."""
    model_bytes = bert_model(cfg).SerializeToString()
    assert_frames_match(model_bytes, device, frames(seed=1, batches=(1, 8), calls=10, seq=16, vocab=cfg.vocab))


# ---- the CLI ---------------------------------------------------------------------------------

def test_cli_infer_on_another_device_equals_onnxruntime(tmp_path: Path, capsys: Any, restore_logging: None) -> None:
    """`tinydist infer --device CPU:1` on a saved encoder and .npy inputs: the first frame (saved
    with --save-outputs) equals onnxruntime, and the benchmark's captured replays run there too."""
    cfg = Bert(layers=1)
    model_bytes = bert_model(cfg).SerializeToString()
    (tmp_path / "bert.onnx").write_bytes(model_bytes)
    feed = random_frame(np.random.default_rng(6), 2, 8, cfg.vocab)
    args = ["infer", str(tmp_path / "bert.onnx"), "--device", "CPU:1", "--save-outputs", str(tmp_path / "out"),
            "--bench", "4", "--warmup", "1"]
    for name, value in feed.items():
        np.save(tmp_path / f"{name}.npy", value)
        args += ["--input", f"{name}={tmp_path / name}.npy"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "last_hidden_state  shape (2, 8, 32)  float32" in out and "pooler_output  shape (2, 32)  float32" in out
    assert "p50" in out
    for name, want in zip(("last_hidden_state", "pooler_output"), session(model_bytes).run(None, feed)):
        np.testing.assert_allclose(np.load(tmp_path / "out" / f"{name}.npy"), want, rtol=RTOL, atol=ATOL, err_msg=name)


# ---- real exporters -------------------------------------------------------------------------

def _export(module: Any, feed: dict[str, np.ndarray], output_names: list[str]) -> bytes:
    """torch.onnx.export's TorchScript exporter (the one that does not need onnxscript), with
    dynamic batch and sequence as transformers' own export recipe declares them."""
    torch = pytest.importorskip("torch")
    names = list(feed)
    args = tuple(torch.from_numpy(feed[n]) for n in names)
    axes = {n: {0: "batch", 1: "sequence"} for n in names} | {"last_hidden_state": {0: "batch", 1: "sequence"},
                                                              "pooler_output": {0: "batch"}}
    buffer = io.BytesIO()
    with warnings.catch_warnings():  # the exporter warns that it is the legacy one, and about tracing
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), args, buffer, input_names=names, output_names=output_names,
                          dynamic_axes=axes, opset_version=17, dynamo=False)
    return buffer.getvalue()


def test_torch_exported_bert_like_encoder_frames_equal_onnxruntime() -> None:
    """A BERT-shaped torch module through the real exporter: the int64 inputs it reaches out of order."""
    torch = pytest.importorskip("torch")
    nn = torch.nn
    cfg = Bert()

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.words, self.types = nn.Embedding(cfg.vocab, cfg.hidden), nn.Embedding(cfg.type_vocab, cfg.hidden)
            self.positions = nn.Embedding(cfg.max_positions, cfg.hidden)
            self.norm = nn.LayerNorm(cfg.hidden, eps=1e-12)
            self.register_buffer("position_ids", torch.arange(cfg.max_positions)[None])
            self.qkv = nn.ModuleList(nn.Linear(cfg.hidden, 3 * cfg.hidden) for _ in range(cfg.layers))
            self.out = nn.ModuleList(nn.Linear(cfg.hidden, cfg.hidden) for _ in range(cfg.layers))
            self.norms = nn.ModuleList(nn.LayerNorm(cfg.hidden, eps=1e-12) for _ in range(2 * cfg.layers))
            self.ffn = nn.ModuleList(nn.Sequential(nn.Linear(cfg.hidden, cfg.intermediate), nn.GELU(),
                                                   nn.Linear(cfg.intermediate, cfg.hidden)) for _ in range(cfg.layers))
            self.pooler = nn.Linear(cfg.hidden, cfg.hidden)

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> tuple[Any, Any]:
            embedded = self.types(token_type_ids)  # token types first, as transformers does
            additive = (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
            seq = input_ids.shape[1]
            x = self.norm(embedded + self.words(input_ids) + self.positions(self.position_ids[:, :seq]))
            b, d, h = x.shape[0], cfg.hidden, cfg.heads
            for layer in range(cfg.layers):
                q, k, v = (t.reshape(b, seq, h, d // h).transpose(1, 2) for t in self.qkv[layer](x).split(d, dim=-1))
                attn = torch.softmax(q @ k.transpose(-1, -2) / (d // h) ** 0.5 + additive, dim=-1)
                x = self.norms[2 * layer](x + self.out[layer]((attn @ v).transpose(1, 2).reshape(b, seq, d)))
                x = self.norms[2 * layer + 1](x + self.ffn[layer](x))
            return x, torch.tanh(self.pooler(x[:, 0]))

    torch.manual_seed(0)
    rng = np.random.default_rng(2)
    model_bytes = _export(Encoder(), random_frame(rng, 2, 16, cfg.vocab), ["last_hidden_state", "pooler_output"])
    for device in ("CPU", "CPU:1"):
        assert_frames_match(model_bytes, device, frames(seed=3, batches=(1, 8), calls=5, seq=16, vocab=cfg.vocab))


def test_transformers_bert_model_frames_equal_onnxruntime() -> None:
    """transformers' own BertModel (tiny, random weights) through torch.onnx.export."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=24, type_vocab_size=2,
                                     attn_implementation="eager", return_dict=False)  # outputs as a tuple
    torch.manual_seed(0)
    rng = np.random.default_rng(4)
    model_bytes = _export(transformers.BertModel(config), random_frame(rng, 2, 16, config.vocab_size),
                          ["last_hidden_state", "pooler_output"])
    for device in ("CPU", "CPU:1"):
        assert_frames_match(model_bytes, device, frames(seed=5, batches=(1, 8), calls=5, seq=16, vocab=config.vocab_size))
