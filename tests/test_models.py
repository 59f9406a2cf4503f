"""Model loading (preset, GGUF, HF directory) and splitting into sliding units."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

from slidetune.data import Batch
from slidetune.engine import AdamWConfig, RuntimeConfig, build_engine
from slidetune.models.load import ModelNotFoundError, RandomInit, load_model, skeleton
from slidetune.models.presets import PRESETS, preset_config, tiny_config
from slidetune.models.units import SplitModel, UnsupportedModelError


@pytest.mark.parametrize("name,billions", [("llama-3.1-8b", 8.03), ("qwen3-8b", 8.19), ("qwen3-1.7b", 1.72),
                                           ("qwen3-4b", 4.02), ("qwen3-14b", 14.77), ("mistral-7b", 7.25),
                                           ("llama-3.2-1b", 1.24), ("qwen3-32b", 32.76), ("qwen2.5-32b", 32.76),
                                           ("llama-3.1-70b", 70.55)])
def test_presets_have_the_published_sizes(name, billions):
    split = SplitModel(skeleton(preset_config(name)))       # meta device: free
    assert split.num_params() / 1e9 == pytest.approx(billions, abs=0.01)


def test_units_cover_every_parameter_once():
    for fam, tied in (("llama", True), ("qwen2", False), ("qwen3", True), ("mistral", False)):
        model = skeleton(tiny_config(fam, tied=tied, vocab_size=256))
        split = SplitModel(model)
        names = [p.full_name for u in split.units for p in u.params]
        assert len(names) == len(set(names))
        assert set(names) == {n for n, _ in model.named_parameters()}
        assert split.tied == tied
        for u in split.units:        # decayed matrices first, then norms and biases
            assert all(p.decay for p in u.params[: sum(p.decay for p in u.params)])
            assert u.n_decay == sum(p.numel for p in u.params if p.decay)


def test_layer_kwargs_come_from_the_models_own_mask_logic():
    split = SplitModel(skeleton(tiny_config("mistral", sliding_window=4, vocab_size=256)))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0
    kw = split.layer_kwargs(2, 8, torch.float32, torch.device("cpu"), attention_mask=mask)
    assert len(kw) == split.num_layers
    cos, sin = kw[0]["position_embeddings"]
    assert cos.shape[-2] == 8
    m = kw[0]["attention_mask"]          # padded batch: an explicit mask, banded by the window
    assert m is not None and m.shape[-1] == 8


def test_unsupported_model_gets_a_clear_error():
    with pytest.raises(UnsupportedModelError, match="decoder"):   # refused by name at load (families.py)
        SplitModel(skeleton(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100)))


def test_unknown_model_lists_presets():
    with pytest.raises(ModelNotFoundError) as e:
        load_model("no-such-model-xyz")
    for name in ("qwen3-8b", "llama-3.1-8b", "smollm2-135m"):
        assert name in str(e.value)
    with pytest.raises(KeyError, match="presets"):
        preset_config("nope")
    assert "tiny-llama" in PRESETS


def test_hf_directory_round_trip(tmp_path):
    cfg = tiny_config("qwen2", vocab_size=256)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    flat = torch.empty(loaded.split.units[1].numel)
    loaded.source.fill(loaded.split.units[1], flat)
    ref = dict(model.named_parameters())
    for p in loaded.split.units[1].params:
        torch.testing.assert_close(flat[p.offset:p.offset + p.numel].view(p.shape), ref[p.full_name].detach())


def test_random_init_is_reproducible_per_unit():
    split = SplitModel(skeleton(tiny_config("llama", vocab_size=256)))
    a, b = torch.empty(split.units[2].numel), torch.empty(split.units[2].numel)
    RandomInit(3).fill(split.units[2], a)
    RandomInit(3).fill(split.units[2], b)
    assert torch.equal(a, b)


@pytest.mark.slow
def test_embedded_gguf_first_loss_equals_hf_loss():
    """SmolLM2-135M from the GGUF: our first loss on a batch equals the HF model's own loss."""
    loaded = load_model("smollm2-135m")
    tok = loaded.tokenizer
    assert tok.eos_token == "<|im_end|>"
    text = ["The quick brown fox jumps over the lazy dog. Python is a programming language.",
            "Lists are mutable sequences, typically used to store collections of items."]
    ids = tok(text, return_tensors="pt", padding="max_length", max_length=20, truncation=True).input_ids
    from slidetune.models.load import embedded_gguf
    d, f = embedded_gguf()
    hf = AutoModelForCausalLM.from_pretrained(str(d), gguf_file=f, dtype=torch.float32)
    with torch.no_grad():
        want = float(hf(input_ids=ids, labels=ids).loss)
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    engine = build_engine(loaded, RuntimeConfig(mode="slide", dtype="fp32", device="cpu"), AdamWConfig(lr=1e-5))
    try:
        res = engine.train_step([Batch(ids, labels, None)], 1e-5)
        assert res.loss == pytest.approx(want, rel=1e-5)
        assert 1.0 < want < 6.0          # a real pretrained model, not random weights
    finally:
        engine.close()
