"""gpt-oss checkpoints with MXFP4 experts (models/mxfp4.py), loaded through slidetune's real loader.

The checkpoint is written here as the published gpt-oss ones are: a tiny gpt-oss whose expert
matrices are packed to MXFP4 (`*_blocks` uint8 [E, R, G, 16], `*_scales` e8m0 [E, R, G]: the decoder's
layout run backwards), everything else BF16, `quantization_config.quant_method = "mxfp4"`. Then:

- every tensor slidetune's loader builds equals transformers' own `from_pretrained` of the directory
  (which dequantizes on a CPU to BF16), exactly; the load says so in one line;
- final/ is BF16, unquantized, in the layout transformers saves gpt-oss in, and loads back as the
  same model;
- another quantization method is refused naming config.json and the method.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

from test_export import export_source
from test_families import gpt_oss_config, gpt_oss_model
from slidetune.checkpoint import resolve_save_dtype
from slidetune.models.load import load_model
from slidetune.models.mxfp4 import dequantize

_GRID = torch.tensor(FP4_VALUES)                     # code -> value (e2m1), codes 0..15
_EXPERTS = ("gate_up_proj", "down_proj")
_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's expert tensor w [E, In, R] -> (blocks uint8 [E, R, In/32, 16], scales uint8
    [E, R, In/32]): each block of 32 inputs scaled by a power of two so its largest value fits 6, each
    value rounded to the nearest FP4 code, two codes a byte (even index in the low nibble)."""
    rows = w.transpose(1, 2).float()                                       # [E, R, In]
    E, R, In = rows.shape
    x = rows.reshape(E, R, In // 32, 32)                                   # [E, R, G, 32]
    peak = x.abs().amax(-1).clamp_min(2.0 ** -100)                         # [E, R, G]
    exponent = torch.ceil(torch.log2(peak / 6.0)).clamp(-127, 127)
    scaled = x / torch.exp2(exponent).unsqueeze(-1)                        # |scaled| <= 6
    codes = (scaled.unsqueeze(-1) - _GRID).abs().argmin(-1).to(torch.uint8)   # [E, R, G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)                    # [E, R, G, 16]
    return blocks.contiguous(), (exponent + 127).to(torch.uint8).contiguous()


def write_mxfp4_checkpoint(directory, seed: int = 1) -> dict[str, torch.Tensor]:
    """A tiny gpt-oss saved as the published checkpoints are; returns its tensors as saved."""
    config = gpt_oss_config(vocab=320)
    model = gpt_oss_model(config, seed)
    model.save_pretrained(str(directory))                                  # config.json, the layout
    tensors = {}
    for name, t in model.state_dict().items():
        if name.endswith(tuple(f"experts.{e}" for e in _EXPERTS)):
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = pack_mxfp4(t)
        else:
            tensors[name] = t.to(torch.bfloat16).contiguous()
    (directory / "model.safetensors").unlink()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((directory / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": _NOT_CONVERTED}
    cfg["dtype"] = "bfloat16"
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    return tensors


def test_packing_is_the_decoders_inverse():
    """pack_mxfp4 (the test's writer) lays blocks out as transformers' decoder reads them: decoding
    is within FP4's rounding of the input, and packing the decoded tensor again gives it back."""
    w = torch.randn(3, 64, 48, generator=torch.Generator().manual_seed(0))     # [E, In, R]
    blocks, scales = pack_mxfp4(w)
    assert blocks.shape == (3, 48, 2, 16) and scales.shape == (3, 48, 2)
    decoded = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert decoded.shape == w.shape
    assert float((decoded - w).abs().max()) <= float(w.abs().max()) / 6      # half a step at most
    assert torch.equal(convert_moe_packed_tensors(*pack_mxfp4(decoded), dtype=torch.float32), decoded)
    assert torch.equal(dequantize(blocks, scales, "w_blocks", torch.float32), decoded)
    with pytest.raises(ValueError, match="w_blocks: MXFP4 blocks"):
        dequantize(blocks[..., :8], scales, "w_blocks")


def test_mxfp4_checkpoint_loads_as_transformers_dequantizes_it(tmp_path, capsys):
    source = tmp_path / "model"
    saved = write_mxfp4_checkpoint(source)
    assert any(k.endswith("gate_up_proj_blocks") for k in saved)
    hf = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.bfloat16)   # transformers' own dequantization
    want = {k: v.float() for k, v in hf.state_dict().items()}
    loaded = load_model(str(source), with_tokenizer=False)
    assert "MXFP4" in capsys.readouterr().out
    assert not hasattr(loaded.split.config, "quantization_config")
    seen = set()
    for unit in loaded.split.units:
        flat = torch.empty(unit.numel)
        loaded.source.fill(unit, flat)
        for p, view in zip(unit.params, unit.views(flat).values()):
            assert torch.equal(view, want[p.full_name]), p.full_name
            seen.add(p.full_name)
    assert {f"model.layers.{i}.mlp.experts.{e}" for i in (0, 1) for e in _EXPERTS} <= seen

    save_dtype = resolve_save_dtype("auto", loaded.split.config, "fp32")   # what a run's final/ gets
    assert save_dtype == "bf16"
    final = export_source(source, tmp_path / "final", save_dtype)
    config = json.loads((final / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    with safe_open(str(final / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_slice("model.layers.0.mlp.experts.gate_up_proj").get_dtype() == "BF16"
    assert not any(k.endswith(("_blocks", "_scales")) for k in keys)
    assert keys == set(hf.state_dict())                  # transformers' unquantized layout for gpt-oss
    again = AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32)
    for name, t in again.state_dict().items():
        assert torch.equal(t, want[name]), name


def test_another_quantization_method_is_refused_by_name(tmp_path):
    source = tmp_path / "model"
    write_mxfp4_checkpoint(source)
    cfg = json.loads((source / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (source / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        load_model(str(source), with_tokenizer=False)
    assert str(source / "config.json") in str(e.value) and "'fp8'" in str(e.value)
