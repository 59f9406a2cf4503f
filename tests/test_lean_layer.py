"""The lean decoder layer (models/lean_layer.py) computes what the family's HF layer computes.

FP32 on the CPU: the output, the input gradient and every parameter gradient of one layer's
recompute + backward within relative 1e-6 of `torch.autograd.grad` through the HF layer, per
family, for tiles of several sizes (one tile, a ragged last tile, one token a tile), causal,
with a padding mask and with packed documents' masks; the lean RMSNorm's forward is bit-identical to HF's in FP32 and BF16.
"""
from __future__ import annotations

import pytest
import torch
from transformers import GemmaConfig

from slidetune.data.batch import document_positions
from slidetune.models.lean_layer import LeanLayers, lean_support, rms_norm
from slidetune.models.load import RandomInit, skeleton
from slidetune.models.presets import tiny_config
from slidetune.models.units import SplitModel, run_layer
from slidetune.ops.packed_attention import use_packed_attention

FAMILIES = {"llama": {}, "qwen2": {}, "qwen3": {}, "mistral": {"sliding_window": 8}}


def _split(family: str, **kw) -> SplitModel:
    return SplitModel(skeleton(tiny_config(family, layers=2, vocab_size=128, **kw)))


def _params(split: SplitModel, i: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    unit = split.layer_units[i]
    flat = torch.empty(unit.numel)
    RandomInit(3, std=0.2, bias_std=0.1).fill(unit, flat)
    views = unit.views(flat.to(dtype))
    # norms away from 1 so their weight gradient matters
    return {k: (v + 0.3 * torch.randn_like(v) if "norm" in k else v).detach().requires_grad_(True)
            for k, v in views.items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("tile", [1000, 7, 1])
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("masking", ["causal", "padded", "documents"])
def test_recompute_backward_matches_the_hf_layer(family, tile, masking):
    torch.manual_seed(0)
    split = _split(family, **FAMILIES[family])
    B, S = 2, 24
    mask = positions = None
    if masking == "padded":
        mask = torch.ones(B, S, dtype=torch.long)
        mask[1, -5:] = 0
    if masking == "documents":                      # packed rows: attention within each document
        use_packed_attention(split.model)
        starts = torch.zeros(B, S, dtype=torch.bool)
        starts[:, 0] = starts[0, 9] = starts[1, 4] = starts[1, 15] = True
        positions = document_positions(starts)
    kwargs = split.layer_kwargs(B, S, torch.float32, torch.device("cpu"), attention_mask=mask,
                                position_ids=positions)
    if masking == "documents":
        assert kwargs[1]["attention_mask"] is not None
    params = _params(split, 1)
    x = torch.randn(B, S, split.hidden_size)
    dy = torch.randn(B, S, split.hidden_size)
    # the HF layer, before the lean norms are installed on these modules
    xr = x.clone().requires_grad_(True)
    ref_out = run_layer(split.layer_modules[1], params, xr, kwargs[1])
    ref = torch.autograd.grad(ref_out, [xr] + list(params.values()), dy)

    lean = LeanLayers(split.layer_modules, tile_tokens=tile)
    out = lean.forward(1, {k: v.detach() for k, v in params.items()}, x, kwargs[1])
    assert _rel(out, ref_out.detach()) < 1e-6
    got = lean.recompute_backward(1, params, x, dy.clone(), kwargs[1])
    names = ["input"] + list(params)
    assert len(got) == len(ref)
    for name, g, r in zip(names, got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        assert _rel(g, r) < 1e-6, f"{family} tile {tile}: {name} relative difference {_rel(g, r):.2e}"
    # with the lean norms installed, the HF layer's own forward is unchanged
    again = run_layer(split.layer_modules[1], params, x, kwargs[1])
    assert torch.equal(again.detach(), ref_out.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_rms_norm_is_llamas_forward_and_its_gradient(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    torch.manual_seed(0)
    norm = LlamaRMSNorm(32, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.add_(torch.randn(32, dtype=dtype) * 0.3)
    x = (torch.randn(5, 7, 32) * 3).to(dtype).requires_grad_(True)
    g = torch.randn(5, 7, 32).to(dtype)
    ref = norm(x)
    rx, rw = torch.autograd.grad(ref, [x, norm.weight], g)
    out = rms_norm(x, norm.weight, norm.variance_epsilon)
    assert torch.equal(out, ref)                     # the same ops in the same order
    lx, lw = torch.autograd.grad(out, [x, norm.weight], g)
    tol = 1e-6 if dtype == torch.float32 else 1e-2   # BF16: one rounding of the result
    assert _rel(lx, rx) < tol and _rel(lw, rw) < tol


def test_lean_rms_norm_backward_in_row_chunks(monkeypatch):
    import slidetune.models.lean_layer as ll
    torch.manual_seed(1)
    x = torch.randn(37, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    g = torch.randn(37, 16)
    whole = torch.autograd.grad(rms_norm(x, w, 1e-5), [x, w], g)
    monkeypatch.setattr(ll, "_NORM_BACKWARD_ROWS", 8)      # 5 chunks, the last ragged
    chunked = torch.autograd.grad(rms_norm(x, w, 1e-5), [x, w], g)
    assert _rel(chunked[0], whole[0]) < 1e-6 and _rel(chunked[1], whole[1]) < 1e-6


def test_families_whose_layer_is_not_llamas_keep_the_hf_layer():
    # Gemma: (1 + w) RMSNorm and a scaled embedding; its layer is not Llama's arithmetic
    cfg = GemmaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    split = SplitModel(skeleton(cfg))
    why = lean_support(split.layer_modules[0])
    assert why is not None and "RMSNorm" in why
    with pytest.raises(ValueError, match="cannot run lean"):
        LeanLayers(split.layer_modules, tile_tokens=16)
    for family in FAMILIES:
        assert lean_support(_split(family).layer_modules[0]) is None
