"""Checkpoints in the Hub's layout: MoE experts one tensor each, and the names families renamed.

transformers 5 models hold experts fused (`mlp.experts.gate_up_proj` [E, 2I, H]); the Hub's
checkpoints, and what transformers' own `save_pretrained` writes (it reverts its load-time
conversion), hold them per expert (`mlp.experts.0.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.0.w1.weight`). The checkpoints here are written by that save, so they
are laid out exactly as the Hub's:

- every tested family whose saved names differ from the model's: slidetune's loader gives each
  parameter and constant buffer exactly the model's value;
- Mixtral, Qwen3-MoE, GLM-4.5: the slide engine's loss on the loaded checkpoint equals
  transformers' `from_pretrained` of the same directory;
- a checkpoint of neither layout (an expert missing, a tensor missing, a piece mis-shaped) is
  refused naming the directory and the tensor.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

from test_families import OVERRIDES
from slidetune.data import Batch
from slidetune.engine import AdamWConfig, RuntimeConfig, build_engine
from slidetune.models.families import TESTED
from slidetune.models.load import load_model
from slidetune.models.reference_check import _cut

# The tested families whose checkpoints transformers 5.17 saves under other names than its model's
# (conversion_mapping.py): per-expert MoE layers, renamed routers / biases, split conv weights.
HUB_LAYOUT = ["afmoe", "axk1", "axk2", "cohere2_moe", "deepseek_v2", "deepseek_v3", "dots1", "ernie4_5_moe",
              "exaone_moe", "flex_olmo", "glm4_moe", "glm4_moe_lite", "granitemoe", "granitemoeshared", "hy_v3",
              "laguna", "longcat_flash", "mellum", "minimax_m2", "mixtral", "olmo_hybrid", "olmoe", "phimoe",
              "qwen2_moe", "qwen3_5_moe_text", "qwen3_moe", "qwen3_next", "solar_open"]
# first_k_dense_replace: DeepSeek-V3's default (3) leaves the 2-layer copy without an MoE layer
_MORE = {"deepseek_v3": dict(first_k_dense_replace=1)}


def tiny_model(family: str, seed: int = 0):
    """transformers' model of the family's tiny config, its weights and constant buffers random
    (a router's zero correction bias would hide a bias read from the wrong tensor)."""
    config = _cut(CONFIG_MAPPING[family](**OVERRIDES.get(family, {}), **_MORE.get(family, {})),
                  small_widths=True, small_vocab=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1, generator=gen)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1, generator=gen)
    return model.eval()


def hub_checkpoint(model, directory) -> set[str]:
    """`model` saved as the Hub holds it (transformers' save: its original, per-expert layout); the
    names saved."""
    model.save_pretrained(str(directory))
    return set(load_file(str(directory / "model.safetensors")))


@pytest.mark.parametrize("family", HUB_LAYOUT)
def test_hub_layout_loads_every_tensor_as_the_model_holds_it(family, tmp_path):
    assert family in TESTED
    model = tiny_model(family)
    state = model.state_dict()
    saved = hub_checkpoint(model, tmp_path)
    assert saved != set(state), "transformers saves this family under its model's names: nothing to test"
    loaded = load_model(str(tmp_path), with_tokenizer=False)
    seen = set()
    for unit in loaded.split.units:
        for p, t in loaded.source.param_tensors(unit):
            assert torch.equal(t, state[p.full_name]), p.full_name
            seen.add(p.full_name)
        for b, t in loaded.source.buffer_tensors(unit):
            assert torch.equal(t, state[b.full_name]), b.full_name
            seen.add(b.full_name)
        # fill() writes what param_tensors() yields, at the parameters' offsets
        flat = torch.empty(unit.numel)
        loaded.source.fill(unit, flat)
        for p, view in zip(unit.params, unit.views(flat).values()):
            assert torch.equal(view, state[p.full_name]), p.full_name
    assert seen - set(saved), "no tensor was built from pieces or renamed"


def _batch(vocab: int) -> Batch:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (2, 16), generator=g)
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    return Batch(ids, labels, None)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "glm4_moe"])
def test_slide_loss_on_a_hub_checkpoint_equals_transformers(family, tmp_path):
    """The slide engine on the per-expert checkpoint against transformers' own load of it."""
    saved = hub_checkpoint(tiny_model(family), tmp_path)
    assert any(".experts.0." in k for k in saved)
    mb = _batch(_cut_vocab(tmp_path))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        logits = hf(input_ids=mb.input_ids).logits
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), mb.labels.flatten(), reduction="sum")
    loaded = load_model(str(tmp_path), with_tokenizer=False)
    engine = build_engine(loaded, RuntimeConfig(mode="slide", dtype="fp32", device="cpu"), AdamWConfig(lr=1e-3))
    try:
        loss_sum, n = engine.eval_loss(mb)
    finally:
        engine.close()
    assert n == mb.num_target_tokens()
    assert loss_sum == pytest.approx(float(want), rel=1e-5)


def _cut_vocab(directory) -> int:
    return json.loads((directory / "config.json").read_text())["vocab_size"]


def _rewrite(directory, drop=(), change=None):
    """The checkpoint's file again without the keys `drop`, and `change`'s tensors replaced."""
    path = directory / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tensors = {k: v for k, v in load_file(str(path)).items() if k not in drop}
    tensors.update(change or {})
    save_file(tensors, str(path), metadata=meta)


def _read_all(directory):
    loaded = load_model(str(directory), with_tokenizer=False)
    for unit in loaded.split.units:
        for _ in loaded.source.param_tensors(unit):
            pass


def test_a_missing_expert_is_named(tmp_path):
    hub_checkpoint(tiny_model("mixtral"), tmp_path)
    _rewrite(tmp_path, drop={"model.layers.1.block_sparse_moe.experts.2.w3.weight"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj: the model has 4 experts, "
                                         r"the checkpoint 3 tensors matching '\.experts\.\*\.w3\.weight'"):
        _read_all(tmp_path)


def test_a_checkpoint_of_neither_layout_names_its_first_missing_tensor(tmp_path):
    hub_checkpoint(tiny_model("qwen3_moe"), tmp_path)
    gone = {k for k in load_file(str(tmp_path / "model.safetensors")) if k.startswith("model.layers.0.mlp.experts.")}
    _rewrite(tmp_path, drop=gone)
    with pytest.raises(KeyError) as e:
        _read_all(tmp_path)
    assert str(tmp_path) in str(e.value) and "'model.layers.0.mlp.experts.gate_up_proj' missing" in str(e.value)


def test_a_mis_shaped_expert_is_refused_not_broadcast(tmp_path):
    hub_checkpoint(tiny_model("qwen3_moe"), tmp_path)
    key = "model.layers.0.mlp.experts.1.down_proj.weight"
    t = load_file(str(tmp_path / "model.safetensors"))[key]
    _rewrite(tmp_path, change={key: t[:, :1].contiguous()})      # [H, 1] would broadcast into [H, I]
    with pytest.raises(ValueError, match=rf"{key}: shape"):
        _read_all(tmp_path)


@pytest.mark.parametrize("family,save_dtype", [("mixtral", "fp32"), ("qwen3_moe", "fp32"), ("minimax_m2", "bf16")])
def test_final_is_written_in_the_layout_transformers_saves(family, save_dtype, tmp_path):
    """final/ of a per-expert source holds the same names and shapes as the source (what
    save_pretrained writes), constant buffers FP32 under their saved names (MiniMax-M2 renames its
    router's bias) in a BF16 export too; from_pretrained(final) is the source's model."""
    from test_export import export_source
    model = tiny_model(family)
    source = tmp_path / "model"
    saved = hub_checkpoint(model, source)
    final = export_source(source, tmp_path / "final", save_dtype)
    want = load_file(str(source / "model.safetensors"))
    got = load_file(str(final / "model.safetensors"))
    assert set(got) == saved
    for k, v in want.items():
        exact = v if save_dtype == "fp32" or "e_score_correction_bias" in k else v.to(torch.bfloat16)
        assert got[k].dtype == exact.dtype and torch.equal(got[k], exact), k
    again = AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32).eval()
    ids = _batch(model.config.vocab_size).input_ids
    if save_dtype == "fp32":
        with torch.no_grad():
            torch.testing.assert_close(again(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
