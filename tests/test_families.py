"""Every causal-LM family of transformers 5.17: faithful (split = transformers) or refused by name.

- the registry (models/families.py) covers MODEL_FOR_CAUSAL_LM_MAPPING_NAMES exactly once;
- each TESTED family: the reference self-check on a tiny config (2 layers, hidden 64,
  vocab 256, 2 x 16 tokens) agrees with transformers' loss and every gradient to 1e-4,
  with the family's model-level transforms set away from identity;
- Granite and Gemma 2 (embedding multiplier, logit scaling, softcapping) and GLM-4.5's MoE
  (routers' score-correction biases, constant buffers) train in slide mode against the plain
  PyTorch reference for several AdamW steps; the biases stay as the source gave them;
- the self-check refuses a deliberately unfaithful split, naming the family and the gap;
- refused families and MoE with the router's auxiliary loss get their reason at load.
"""
from __future__ import annotations

import pytest
import torch
from transformers import (CONFIG_MAPPING, AutoModelForCausalLM, GPT2Config, GptOssConfig, GraniteConfig, Gemma2Config,
                          Glm4MoeConfig, MambaConfig, MixtralConfig)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from reference import ReferenceTrainer, build_reference
from test_equivalence import VOCAB, make_batches, max_param_rel_diff
from slidetune.engine import AdamWConfig, RuntimeConfig, build_engine
from slidetune.models import units
from slidetune.models.families import (NOT_DECODER_ONLY, REFUSED, TESTED, UnsupportedFamilyError,
                                       family_status, moe_note)
from slidetune.models.load import LoadedModel, RandomInit, StateDictSource, skeleton
from slidetune.models.reference_check import ReferenceMismatchError, reference_check, require_faithful
from slidetune.models.transforms import ModelTransforms
from slidetune.models.units import SplitModel

# Model-level transforms away from 1 (the default configs have them at identity, which
# would test nothing), and fields whose default leaves the config unusable.
_MUP = dict(embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22, attention_multiplier=0.0156)
OVERRIDES = {
    "granite": _MUP, "granitemoe": _MUP, "granitemoeshared": dict(_MUP, shared_intermediate_size=64),
    "hyperclovax": dict(_MUP, logits_scaling=0.125),        # a multiplier here, a divisor in Granite
    "cohere": dict(logit_scale=0.25), "cohere2": dict(logit_scale=0.25), "cohere2_moe": dict(logit_scale=0.25),
    # a cap near the logits' size, so that tanh is far from linear
    "gemma2": dict(final_logit_softcapping=2.0, attn_logit_softcapping=5.0),
    "gemma3_text": dict(final_logit_softcapping=2.0), "vaultgemma": dict(final_logit_softcapping=2.0),
    # its default config has per-layer input embeddings (refused); the 31B's shape: keys shared with values
    "gemma4_text": dict(final_logit_softcapping=2.0, hidden_size_per_layer_input=0, attention_k_eq_v=True,
                        num_global_key_value_heads=1),
    "gemma4_unified_text": dict(final_logit_softcapping=2.0, attention_k_eq_v=True, num_global_key_value_heads=1),
    "nanochat": dict(final_logit_softcapping=2.0),
    "minicpm3": dict(scale_emb=12.0, scale_depth=1.4, dim_model_base=16),
    "deepseek_v2": dict(num_experts_per_tok=2),             # None by default: no routing at all
    "dots1": dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1),   # None by default: none built
}


def test_every_causal_lm_family_is_listed_once():
    listed = [*TESTED, *REFUSED, *NOT_DECODER_ONLY]
    assert len(listed) == len(set(listed))
    assert set(listed) == set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert all(REFUSED.values()) and all(NOT_DECODER_ONLY.values())


@pytest.mark.parametrize("family", TESTED)
def test_family_split_matches_transformers(family):
    result = reference_check(CONFIG_MAPPING[family](**OVERRIDES.get(family, {})))
    assert result.ok, result.summary()
    assert 1 <= result.num_layers <= 3, result.summary()      # tiny: each kind of layer once


def test_transformed_families_really_transform():
    """The overrides above change what the split must compute (else those rows test nothing)."""
    for family in ("granite", "hyperclovax", "cohere", "gemma2", "nanochat"):
        t = SplitModel(skeleton(CONFIG_MAPPING[family](**OVERRIDES[family]))).transforms
        assert t != ModelTransforms(), family
    t = SplitModel(skeleton(CONFIG_MAPPING["granite"](**OVERRIDES["granite"]))).transforms
    assert t.embed_multiplier == 12.0 and t.logits.scale == pytest.approx(1 / 8)
    assert SplitModel(skeleton(CONFIG_MAPPING["hyperclovax"](**OVERRIDES["hyperclovax"]))).transforms.logits.scale \
        == pytest.approx(0.125)


def test_check_refuses_an_unfaithful_split(monkeypatch):
    """Granite with its transforms dropped from the split: the gap the issue reported."""
    config = GraniteConfig(**_MUP)
    assert require_faithful(config).ok
    monkeypatch.setattr(units, "model_transforms", lambda cfg: ModelTransforms())
    with pytest.raises(ReferenceMismatchError) as e:
        require_faithful(config)
    msg = str(e.value)
    assert "'granite'" in msg and "gap" in msg and "--skip-reference-check" in msg
    result = reference_check(config)
    assert result.loss_gap > 1e-3 and not result.ok


def test_check_refuses_a_split_without_the_routers_biases(monkeypatch):
    """The check's correction biases are random (HF's init, zero, would hide them): a split left
    with zeros where transformers has the source's values is far off."""
    config = CONFIG_MAPPING["glm4_moe"]()
    assert require_faithful(config).ok
    monkeypatch.setattr(SplitModel, "set_buffers", lambda self, values: None)
    result = reference_check(config)
    assert not result.ok and result.loss_gap > 1e-4 and result.grad_gap > 1e-2, result.summary()


def router_config(vocab: int = VOCAB) -> Glm4MoeConfig:
    """A tiny GLM-4.5 MoE: a dense first layer, then MoE layers whose routers keep
    e_score_correction_bias [4] as a buffer."""
    return Glm4MoeConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                         n_group=1, topk_group=1, max_position_embeddings=256, initializer_range=0.1,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)


def router_model(config: Glm4MoeConfig, seed: int = 1):
    """transformers' model of `config` (its init), the routers' correction biases random: as a
    trained checkpoint has them (HF's init is zero)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return model.eval()


def router_biases(model) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}


def _tiny(config) -> LoadedModel:
    return LoadedModel("tiny", SplitModel(skeleton(config)), RandomInit(1, std=0.1, bias_std=0.1), None)


_SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=2, pad_token_id=2)


@pytest.mark.parametrize("config", [
    GraniteConfig(**_SMALL, **_MUP),
    # tied head, sqrt(hidden) embedding normalizer, softcapped logits and attention, sliding layers
    Gemma2Config(**_SMALL, head_dim=16, final_logit_softcapping=3.0, attn_logit_softcapping=5.0,
                 sliding_window=8, tie_word_embeddings=True),
], ids=["granite", "gemma2"])
def test_transformed_family_trains_in_slide_mode_like_the_reference(config):
    """The engine's numerical path (chunked head with the transform, deferred clipped AdamW)."""
    _trains_like_the_reference(_tiny(config))


def test_router_biases_train_in_slide_mode_like_the_reference_and_stay():
    """GLM-4.5's MoE from a state dict with non-zero correction biases (the GGUF path's source):
    three AdamW steps of the slide engine equal the reference's, and the biases, read in every
    forward, are neither differentiated nor updated."""
    config = router_config()
    hf = router_model(config)
    biases = router_biases(hf)
    assert len(biases) == 2 and all(bool(b.abs().min() > 0) for b in biases.values())
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    engine, ref = _trains_like_the_reference(
        LoadedModel("glm4_moe", SplitModel(skeleton(config)), StateDictSource(state), None), keep=True)
    try:
        for name, b in engine.named_buffers():
            assert torch.equal(b, biases[name]), name
        assert dict(engine.named_buffers()).keys() == biases.keys()
        assert all(torch.equal(b, router_biases(ref.model)[n]) for n, b in biases.items())
        assert not any(n.endswith("e_score_correction_bias") for n, _ in engine.named_master_params())
    finally:
        engine.close()


def gpt_oss_config(vocab: int = VOCAB) -> GptOssConfig:
    """A tiny gpt-oss: a sliding layer (window 8, inside the 24-token rows) then a full one, 4
    experts with biases (top 2, clamped SwiGLU), a router with a bias, attention sinks."""
    return GptOssConfig(vocab_size=vocab, hidden_size=64, intermediate_size=32, head_dim=16, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        sliding_window=8, max_position_embeddings=256, initializer_range=0.1, bos_token_id=1,
                        eos_token_id=2, pad_token_id=2)


def gpt_oss_model(config: GptOssConfig, seed: int = 1):
    """transformers' gpt-oss of `config`, every weight random: its init leaves the expert biases zero
    and the sinks near zero, which would hide a term the split dropped."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 1.0 if name.endswith("sinks") else 0.1, generator=gen)
    return model.eval()


def test_biases_of_any_shape_are_not_decayed():
    """Weight decay spares norms and biases (docs/engine.md), also the experts' 2-D bias matrices of
    gpt-oss ([E, 2I], [E, H]), as HF's Trainer spares every name holding "bias"."""
    split = SplitModel(skeleton(gpt_oss_config()))
    layer = split.layer_units[0]
    decayed = {p.local_name for p in layer.params if p.decay}
    assert {"mlp.experts.gate_up_proj", "mlp.experts.down_proj", "self_attn.q_proj.weight"} <= decayed
    assert not decayed & {"mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias", "mlp.router.bias",
                          "self_attn.sinks", "self_attn.q_proj.bias"}


def test_gpt_oss_trains_in_slide_mode_like_the_reference():
    """gpt-oss (sinks through SDPA, alternating sliding/full layers, its MoE with biases) from a state
    dict: three AdamW steps of the slide engine equal transformers' eager model trained by the
    reference, and the sinks are trained (they move, as the reference's do)."""
    config = gpt_oss_config()
    hf = gpt_oss_model(config)
    assert config.layer_types == ["sliding_attention", "full_attention"]
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    engine, ref = _trains_like_the_reference(
        LoadedModel("gpt_oss", SplitModel(skeleton(config)), StateDictSource(state), None), keep=True)
    try:
        assert ref.model.config._attn_implementation == "eager"
        assert engine.split.config._attn_implementation == "slidetune_sinks"
        sinks = dict(ref.model.named_parameters())["model.layers.0.self_attn.sinks"]
        assert not torch.equal(sinks, state["model.layers.0.self_attn.sinks"])
    finally:
        engine.close()


def _trains_like_the_reference(loaded: LoadedModel, keep: bool = False):
    """Three AdamW steps of the slide engine (deferred, clipped, accumulated) against the plain
    PyTorch reference: loss, gradient norm and weights. keep: (engine, reference) returned open."""
    ref = ReferenceTrainer(build_reference(loaded), lr=1e-3, weight_decay=0.1, eps=1e-6, max_grad_norm=0.5)
    rt = RuntimeConfig(mode="slide", dtype="fp32", device="cpu", schedule="deferred", head_chunk_tokens=16,
                       chunk_mb=1)
    engine = build_engine(loaded, rt, AdamWConfig(lr=1e-3, weight_decay=0.1, eps=1e-6), grad_accum=2,
                          max_grad_norm=0.5)
    try:
        for step in range(3):
            mbs = make_batches(step, 2)
            ref_loss, ref_norm = ref.step(mbs, 1e-3)
            res = engine.train_step(mbs, 1e-3)
            assert res.loss == pytest.approx(ref_loss, rel=1e-5), f"step {step}"
            assert res.grad_norm() == pytest.approx(ref_norm, rel=1e-5), f"step {step}"
        engine.synchronize()
        worst, where = max_param_rel_diff(engine, ref.model)
        assert worst < 1e-5, f"{where}: relative difference {worst:.2e}"
    except BaseException:
        engine.close()
        raise
    if keep:
        return engine, ref
    engine.close()


@pytest.mark.parametrize("config,family,words", [
    (GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100), "gpt2", "position embeddings"),
    (MambaConfig(num_hidden_layers=2, hidden_size=32, vocab_size=100), "mamba", "recurrent"),
    (CONFIG_MAPPING["bart"](), "bart", "encoder-decoder"),
])
def test_refused_family_gets_its_reason_at_load(config, family, words):
    with pytest.raises(UnsupportedFamilyError) as e:
        skeleton(config)
    assert f"'{family}'" in str(e.value) and words in str(e.value)
    assert family_status(family)[0] in ("refused", "not decoder-only")


def test_moe_with_router_aux_loss_is_refused_and_the_plan_says_what_slides():
    small = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)
    with pytest.raises(UnsupportedFamilyError, match="output_router_logits"):
        skeleton(MixtralConfig(**small, output_router_logits=True))
    config = MixtralConfig(**small)                 # transformers' default: cross-entropy alone
    split = SplitModel(skeleton(config))
    note = moe_note(config, split.layer_units[0].numel)
    assert "all 8 experts" in note and "2 of them" in note
    assert moe_note(GraniteConfig(**_SMALL), 1000) is None


@pytest.mark.slow
def test_train_runs_the_check_by_default_and_records_a_skip(tmp_path, monkeypatch, capsys):
    """`slidetune train` refuses an unfaithful split before anything; --skip-reference-check
    trains anyway and config.json says the check was skipped."""
    import json

    from slidetune.cli import main
    from slidetune.data.corpus import builtin_corpus
    data = tmp_path / "small.jsonl"
    data.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in builtin_corpus()[:20]))
    args = ["train", "--model", "tiny-llama", "--num-layers", "1", "--seq-len", "32", "--batch-size", "2",
            "--eval-batches", "1", "--progress", "false", "--device", "cpu", "--max-steps", "1",
            "--data", str(data)]
    monkeypatch.setattr(units, "model_transforms", lambda cfg: ModelTransforms(embed_multiplier=1.5))
    assert main([*args, "--output-dir", str(tmp_path / "refused")]) != 0
    err = capsys.readouterr().err
    assert "reference check failed for model family 'llama'" in err and "gap" in err
    assert not (tmp_path / "refused" / "config.json").exists()
    assert main([*args, "--output-dir", str(tmp_path / "skipped"), "--skip-reference-check"]) == 0
    assert "reference check skipped" in capsys.readouterr().out
    assert json.loads((tmp_path / "skipped" / "config.json").read_text())["skip_reference_check"] is True


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [{}, {"cache_units": 0, "compile_layers": True}], ids=["slide", "resident-compiled"])
def test_gpt_oss_bf16_on_cuda_within_noise(extra):
    """gpt-oss on CUDA in BF16 (the sinks through SDPA's fused kernels, the experts' grouped GEMMs):
    three AdamW steps of the slide engine stay within BF16 noise of transformers' eager FP32 model,
    the noise measured as in test_equivalence_gpu (gpu mode beside it)."""
    from test_equivalence_gpu import assert_bf16_within_noise
    torch.backends.cuda.matmul.allow_tf32 = False
    config = gpt_oss_config()
    state = {k: v.detach().clone() for k, v in gpt_oss_model(config).state_dict().items()}
    loaded = LoadedModel("gpt_oss", SplitModel(skeleton(config)), StateDictSource(state), None)
    assert_bf16_within_noise(loaded, "slide", "deferred", 2, 0.5, False, extra)
