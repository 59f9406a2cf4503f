"""The reference pass (issue 47, objectives/reference.py): each pair's chosen and rejected
log-probability sums from the engine that will train (no second model), equal to a stock HF
model's; cached on the initial weights' fingerprint, the pairs, the cut and the dtype; a cache that
does not check out is computed again."""
from __future__ import annotations

import os

import pytest
import torch

from reference import build_reference
from test_equivalence import LR, make_loaded
from test_preference_engine import make_pairs, sequence_logps
from slidetune.data.preference import collate_pairs, pair_micro_batches
from slidetune.engine import AdamWConfig, RuntimeConfig, build_engine
from slidetune.models.load import RandomInit, SafetensorsSource, StateDictSource
from slidetune.objectives.preference import PreferenceConfig
from slidetune.objectives.reference import cached_reference_logps, reference_logps

CFG = PreferenceConfig("dpo")


def expected(loaded, pairs) -> torch.Tensor:
    model = build_reference(loaded)
    with torch.no_grad():
        logps, _, _ = sequence_logps(model, pair_micro_batches(collate_pairs(pairs, 0), CFG)[0])
    return torch.stack(logps.float().chunk(2), dim=1)                                     # [P, 2]


@pytest.mark.parametrize("mode", ["slide", "gpu"])
def test_the_engine_computes_the_reference_models_sums(mode):
    loaded = make_loaded("qwen3", tied=True)
    pairs = make_pairs(0) + make_pairs(1)                                                 # 8 pairs
    engine = build_engine(loaded, RuntimeConfig(mode=mode, dtype="fp32", device="cpu", head_chunk_tokens=16),
                          AdamWConfig(lr=LR))
    try:
        got = reference_logps(engine, pairs, CFG, pad_id=0, max_length=None, batch_pairs=3)   # 3, 3, 2
    finally:
        engine.close()
    torch.testing.assert_close(got, expected(loaded, pairs), rtol=1e-5, atol=1e-5)


class _Refusing:
    def token_losses(self, batch):
        raise AssertionError("the cache should have answered")


def test_the_cache_answers_a_second_run_and_only_for_the_same_inputs(tmp_path, caplog):
    loaded = make_loaded("llama", tied=False, layers=2)
    pairs = make_pairs(0)
    engine = build_engine(loaded, RuntimeConfig(mode="gpu", dtype="fp32", device="cpu"), AdamWConfig(lr=LR))
    fp = loaded.source.fingerprint()
    kw = dict(cfg=CFG, pad_id=0, max_length=None, batch_pairs=2, cache_dir=tmp_path, dtype="fp32")
    try:
        computed = cached_reference_logps(engine, pairs, model_fingerprint=fp, **kw)
        first = computed.logps
        (file,) = tmp_path.glob("reference-logps-*.safetensors")
        assert not computed.read and computed.file == file
        hit = cached_reference_logps(_Refusing(), pairs, model_fingerprint=fp, **kw)
        assert hit.read and hit.file == file and torch.equal(hit.logps, first)
        # other weights, other pairs, another cut: computed again, each its own file
        cached_reference_logps(engine, pairs, model_fingerprint=fp + "x", **kw)
        cached_reference_logps(engine, pairs[:3], model_fingerprint=fp, **kw)
        cached_reference_logps(engine, pairs, model_fingerprint=fp, **dict(kw, max_length=6))
        assert len(list(tmp_path.glob("reference-logps-*.safetensors"))) == 4
        with pytest.raises(AssertionError, match="cache should have answered"):
            cached_reference_logps(_Refusing(), pairs, model_fingerprint=fp, **dict(kw, dtype="bf16"))
        # a damaged file is noted and computed again (and rewritten)
        data = bytearray(file.read_bytes())
        data[-3] ^= 0xFF
        file.write_bytes(bytes(data))
        again = cached_reference_logps(engine, pairs, model_fingerprint=fp, **kw)
        assert "computing the reference log-probabilities again" in caplog.text
        assert not again.read and torch.equal(again.logps, first)
        assert torch.equal(cached_reference_logps(_Refusing(), pairs, model_fingerprint=fp, **kw).logps, first)
    finally:
        engine.close()


def test_weight_fingerprints_follow_the_weights(tmp_path):
    assert RandomInit(1).fingerprint() == RandomInit(1).fingerprint() != RandomInit(2).fingerprint()
    state = {"a": torch.ones(3), "b": torch.zeros(2, 2)}
    changed = dict(state, a=torch.tensor([1.0, 1.0, 2.0]))
    assert StateDictSource(state).fingerprint() != StateDictSource(changed).fingerprint()
    from safetensors.torch import save_file
    save_file(state, str(tmp_path / "model.safetensors"))
    first = SafetensorsSource(tmp_path).fingerprint()
    assert SafetensorsSource(tmp_path).fingerprint() == first
    save_file(changed, str(tmp_path / "model.safetensors"))           # same names, shapes and size
    st = (tmp_path / "model.safetensors").stat()
    os.utime(tmp_path / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert SafetensorsSource(tmp_path).fingerprint() != first
