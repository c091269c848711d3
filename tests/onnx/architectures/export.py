"""Export the real-architecture test set: small-config torchvision, timm and transformers models as ONNX.

Run in an environment with torch, torchvision, timm, transformers, onnx and onnxscript (not the
project's own: those are large and only this script needs them):

    python -m tests.onnx.architectures.export            # writes tests/onnx/architectures/models/

Every model is built from code and a config with random weights under a fixed seed (nothing is
downloaded), shrunk to a few thousand to ~100k parameters so that the committed files stay small,
and exported twice with a dynamic batch axis: at the exporter's default opset
(`torch.onnx.export(..., dynamo=True)`, what a user gets without options) and at opset 13 (the
TorchScript exporter, `dynamo=False`, the exporter that writes opset 13 natively). The layers, and
so the op patterns, are those of the full-size models: only widths, depths and image sizes shrink.
`manifest.json` records, per file, the inputs (name, shape with the batch axis as "batch", dtype,
value range) and the outputs; `tests/onnx/test_architectures.py` reads it.
"""

from __future__ import annotations

import argparse
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import torch
from torch import nn

HERE = Path(__file__).resolve().parent
MODELS = HERE / "models"
OPSET_OLD = 13
IMAGE = 32          # spatial size of the CNN / ViT inputs
SEQ = 16            # token count of the text models
VOCAB = 100
EXAMPLE_BATCH = 2   # the batch the exporter traces with (1 would be specialised away)


@dataclass
class Arch:
    """One model of the set: how to build it and what it takes."""

    name: str
    source: str                                  # the library its layers come from
    build: Callable[..., nn.Module]              # attention models take sdpa=: False for opset 13
    inputs: list[dict[str, Any]]                 # name, shape (batch first, "batch"), dtype, low, high
    outputs: list[str]
    attention: bool = False                      # build() takes sdpa=


def _image(channels: int = 3) -> list[dict[str, Any]]:
    return [{"name": "x", "shape": ["batch", channels, IMAGE, IMAGE], "dtype": "float32", "low": -1.0, "high": 1.0}]


def _tokens(*names: str) -> list[dict[str, Any]]:
    ranges = {"input_ids": (0, VOCAB), "attention_mask": (0, 2), "token_type_ids": (0, 2)}
    return [{"name": n, "shape": ["batch", SEQ], "dtype": "int64", "low": ranges[n][0], "high": ranges[n][1]} for n in names]


class _Outputs(nn.Module):
    """A transformers model called with keyword inputs, returning a tuple of its named outputs
    (torch.export matches the dynamic shapes to a forward with one named parameter per input)."""

    def __init__(self, model: nn.Module, outputs: list[str], cache: bool) -> None:
        super().__init__()
        self.model, self.names = model, outputs
        self.extra = {"use_cache": False} if cache else {}

    def _run(self, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.model(**inputs, **self.extra)
        return tuple(getattr(out, n) for n in self.names)


class _Ids(_Outputs):
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self._run(input_ids=input_ids, attention_mask=attention_mask)


class _IdsTypes(_Outputs):
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self._run(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)


class _Features(_Outputs):
    def forward(self, input_features: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self._run(input_features=input_features)


def _hf(model: nn.Module, inputs: list[str], outputs: list[str], cache: bool = False) -> nn.Module:
    wrapper = {2: _Ids, 3: _IdsTypes}.get(len(inputs), _Features)
    return wrapper(model, outputs, cache)


# ---- torchvision ---------------------------------------------------------------------------------

def resnet() -> nn.Module:
    """torchvision's ResNet class at resnet18's structure is 11M parameters whatever the depth (its
    stage widths are fixed at 64..512), so the net is assembled from torchvision's own BasicBlock
    and Bottleneck at widths 8..32: stem conv/bn/relu/maxpool, identity and downsample shortcuts."""
    from torchvision.models.resnet import BasicBlock, Bottleneck, conv1x1

    def down(cin: int, cout: int, stride: int) -> nn.Module:
        return nn.Sequential(conv1x1(cin, cout, stride), nn.BatchNorm2d(cout))

    return nn.Sequential(
        nn.Conv2d(3, 8, 7, 2, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1),
        BasicBlock(8, 8), BasicBlock(8, 16, 2, down(8, 16, 2)),
        Bottleneck(16, 8, 2, down(16, 32, 2)), Bottleneck(32, 8),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(32, 10))


def mobilenet_v3() -> nn.Module:
    from torchvision.models.mobilenetv3 import MobileNetV3, _mobilenet_v3_conf
    setting = _mobilenet_v3_conf("mobilenet_v3_small", width_mult=0.25)[0]
    # the first four blocks: ReLU and hardswish, with and without squeeze-excite
    return MobileNetV3(setting[:4], last_channel=64, num_classes=10)


def efficientnet() -> nn.Module:
    from torchvision.models.efficientnet import EfficientNet, _efficientnet_conf
    setting = _efficientnet_conf("efficientnet_b0", width_mult=0.25, depth_mult=0.25)[0]
    return EfficientNet(setting[:5], dropout=0.2, last_channel=64, num_classes=10)  # the first 5 of 7 stages


def densenet() -> nn.Module:
    from torchvision.models.densenet import DenseNet
    return DenseNet(growth_rate=8, block_config=(2, 2, 2), num_init_features=16, bn_size=2, num_classes=10)


def convnext() -> nn.Module:
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt
    return ConvNeXt([CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)], num_classes=10)


def regnet() -> nn.Module:
    from torchvision.models.regnet import BlockParams, RegNet
    params = BlockParams.from_init_params(depth=4, w_0=8, w_a=8.0, w_m=2.0, group_width=8, se_ratio=0.25)
    return RegNet(params, stem_width=8, num_classes=10)


def shufflenet_v2() -> nn.Module:
    from torchvision.models.shufflenetv2 import ShuffleNetV2
    return ShuffleNetV2(stages_repeats=[2, 1, 1], stages_out_channels=[8, 16, 32, 64, 64], num_classes=10)


def squeezenet() -> nn.Module:
    """SqueezeNet 1.1's layer pattern (ceil-mode max pools, torchvision's Fire modules, dropout, a
    1x1-conv classifier with ReLU and adaptive average pool) at an eighth of its widths."""
    from torchvision.models.squeezenet import Fire
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, ceil_mode=True),
        Fire(16, 4, 8, 8), Fire(16, 4, 8, 8), nn.MaxPool2d(3, 2, ceil_mode=True),
        Fire(16, 8, 16, 16),
        nn.Dropout(0.5), nn.Conv2d(32, 10, 1), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten(1))


# ---- timm ----------------------------------------------------------------------------------------

def vit(sdpa: bool = True) -> nn.Module:
    from timm.layers import set_fused_attn
    from timm.models.vision_transformer import VisionTransformer
    set_fused_attn(sdpa)
    return VisionTransformer(img_size=IMAGE, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0, num_classes=10)


def mlp_mixer() -> nn.Module:
    from timm.models.mlp_mixer import MlpMixer
    return MlpMixer(img_size=IMAGE, patch_size=8, embed_dim=32, num_blocks=2, mlp_ratio=(0.5, 2.0), num_classes=10)


def _attention(sdpa: bool) -> str:
    return "sdpa" if sdpa else "eager"


# ---- transformers --------------------------------------------------------------------------------

def bert(sdpa: bool = True) -> nn.Module:
    from transformers import BertConfig, BertModel
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, attn_implementation=_attention(sdpa))
    return _hf(BertModel(config), ["input_ids", "attention_mask", "token_type_ids"], ["last_hidden_state", "pooler_output"])


def gpt2(sdpa: bool = True) -> nn.Module:
    from transformers import GPT2Config, GPT2Model
    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64, attn_implementation=_attention(sdpa))
    return _hf(GPT2Model(config), ["input_ids", "attention_mask"], ["last_hidden_state"], cache=True)


def llama(sdpa: bool = True) -> nn.Module:
    from transformers import LlamaConfig, LlamaModel
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation=_attention(sdpa))
    return _hf(LlamaModel(config), ["input_ids", "attention_mask"], ["last_hidden_state"], cache=True)


def t5_encoder(sdpa: bool = True) -> nn.Module:
    """Eager attention at both opsets: with sdpa, torch.export's decomposition fails on T5's
    attention (transformers 5.24, torch 2.14: "Cannot view a tensor with shape [s43, 16, 4, 8] and
    strides (512, 8, 128, 1) as a tensor with shape (s43, 16, 32)")."""
    from transformers import T5Config, T5EncoderModel
    config = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, attn_implementation="eager")
    return _hf(T5EncoderModel(config), ["input_ids", "attention_mask"], ["last_hidden_state"])


WHISPER_MELS, WHISPER_FRAMES = 16, 32


def whisper_encoder(sdpa: bool = True) -> nn.Module:
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder
    config = WhisperConfig(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
                           num_mel_bins=WHISPER_MELS, max_source_positions=WHISPER_FRAMES // 2, attn_implementation=_attention(sdpa))
    return _hf(WhisperEncoder(config), ["input_features"], ["last_hidden_state"])


ARCHS = [
    Arch("resnet", "torchvision", resnet, _image(), ["logits"]),
    Arch("mobilenet_v3", "torchvision", mobilenet_v3, _image(), ["logits"]),
    Arch("efficientnet", "torchvision", efficientnet, _image(), ["logits"]),
    Arch("densenet", "torchvision", densenet, _image(), ["logits"]),
    Arch("convnext", "torchvision", convnext, _image(), ["logits"]),
    Arch("regnet", "torchvision", regnet, _image(), ["logits"]),
    Arch("shufflenet_v2", "torchvision", shufflenet_v2, _image(), ["logits"]),
    Arch("squeezenet", "torchvision", squeezenet, _image(), ["logits"]),
    Arch("vit", "timm", vit, _image(), ["logits"], attention=True),
    Arch("mlp_mixer", "timm", mlp_mixer, _image(), ["logits"]),
    Arch("bert", "transformers", bert, _tokens("input_ids", "attention_mask", "token_type_ids"),
         ["last_hidden_state", "pooler_output"], attention=True),
    Arch("gpt2", "transformers", gpt2, _tokens("input_ids", "attention_mask"), ["last_hidden_state"], attention=True),
    Arch("llama", "transformers", llama, _tokens("input_ids", "attention_mask"), ["last_hidden_state"], attention=True),
    Arch("t5_encoder", "transformers", t5_encoder, _tokens("input_ids", "attention_mask"), ["last_hidden_state"], attention=True),
    Arch("whisper_encoder", "transformers", whisper_encoder,
         [{"name": "input_features", "shape": ["batch", WHISPER_MELS, WHISPER_FRAMES], "dtype": "float32",
           "low": -1.0, "high": 1.0}], ["last_hidden_state"], attention=True),
]


def example_inputs(arch: Arch, batch: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for spec in arch.inputs:
        shape = [batch if d == "batch" else d for d in spec["shape"]]
        if spec["dtype"] == "int64":
            t = torch.randint(spec["low"], spec["high"], shape, generator=g)
            if spec["name"] == "attention_mask":
                t[:, 0] = 1    # at least one token attended in every row
        else:
            t = torch.rand(shape, generator=g) * (spec["high"] - spec["low"]) + spec["low"]
        out.append(t)
    return tuple(out)


def randomize_constants(model: nn.Module) -> None:
    """Give random values to what the libraries initialise to a constant: zero heads (timm's
    MLP-Mixer head is all zeros, so its logits would be 0 whatever the op semantics), zero biases,
    unit norm scales and BatchNorm's 0/1 running statistics. Then every weight, and the BatchNorm
    fold, is exercised, and no output is constant."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if not tensor.is_floating_point() or tensor.numel() < 2 or tensor.std() > 0:
                continue
            base = float(tensor.flatten()[0])
            noise = torch.rand(tensor.shape, generator=g) * 0.2 - 0.1
            # scales near 1 (norm weights, running variances), shifts near 0 (biases, heads, means)
            tensor.copy_(base + noise * (abs(base) if base else 1.0))


def attention_kind(model: nn.Module) -> str | None:
    """What the built model's attention runs as: "sdpa" (torch's fused scaled_dot_product_attention)
    or "eager" (the libraries' matmul/softmax); None for a model without attention."""
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            return "sdpa" if config._attn_implementation == "sdpa" else "eager"
        if hasattr(m, "fused_attn"):
            return "sdpa" if m.fused_attn else "eager"
    return None


def export(arch: Arch, opset: int | None, path: Path) -> str | None:
    torch.manual_seed(0)
    # the TorchScript exporter has no opset-13 scaled_dot_product_attention (it starts at 14), so
    # at 13 the attention models are built with their libraries' eager (matmul/softmax) attention
    model = (arch.build(sdpa=False) if opset == OPSET_OLD and arch.attention else arch.build()).eval()
    randomize_constants(model)
    args = example_inputs(arch, EXAMPLE_BATCH, seed=0)
    names = [s["name"] for s in arch.inputs]
    dynamic_axes = {n: {0: "batch"} for n in names + arch.outputs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if opset is None:
            batch = torch.export.Dim("batch", min=1, max=1024)
            program = torch.onnx.export(model, args, input_names=names, output_names=arch.outputs,
                                        dynamic_shapes=tuple({0: batch} for _ in names), dynamo=True,
                                        external_data=False, optimize=True)
            assert program is not None
            program.save(str(path), external_data=False)
        else:
            torch.onnx.export(model, args, str(path), input_names=names, output_names=arch.outputs,
                              dynamic_axes=dynamic_axes, opset_version=opset, dynamo=False, do_constant_folding=True)
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto)
    return attention_kind(model)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="model names to export (default: all)")
    parser.add_argument("--out", type=Path, default=MODELS)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    manifest_path = args.out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    import timm
    import torchvision
    import transformers
    for arch in ARCHS:
        if args.only and arch.name not in args.only:
            continue
        for opset in (None, OPSET_OLD):
            tag = "default" if opset is None else f"opset{opset}"
            path = args.out / f"{arch.name}_{tag}.onnx"
            attention = export(arch, opset, path)
            proto = onnx.load(str(path))
            model_opset = next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
            params = sum(p.numel() for p in arch.build().parameters())
            manifest[path.name] = {
                "model": arch.name, "source": arch.source, "opset": model_opset, "variant": tag,
                "exporter": "torch.onnx.export(dynamo=True)" if opset is None else "torch.onnx.export(dynamo=False)",
                "parameters": params, "attention": attention, "inputs": arch.inputs, "outputs": arch.outputs,
                "ops": sorted({n.op_type for n in proto.graph.node}),
            }
            print(f"{path.name}: opset {model_opset}, {params} parameters, {path.stat().st_size} bytes")
    manifest["_versions"] = {"torch": torch.__version__, "torchvision": torchvision.__version__,
                             "timm": timm.__version__, "transformers": transformers.__version__,
                             "onnx": onnx.__version__}
    manifest_path.write_text(json.dumps(dict(sorted(manifest.items())), indent=1) + "\n")


if __name__ == "__main__":
    main()
