"""Data module on the real embedded tokenizer (SmolLM2-135M-Instruct GGUF) and built-in corpus."""
from __future__ import annotations

import json

import pytest
import torch

from slidetune.data import (
    IGNORE_INDEX,
    BatchSampler,
    DataConfig,
    build_datasets,
    builtin_corpus,
    default_pad_id,
)
from slidetune.data.formats import read_source
from slidetune.data.tokenization import tokenize_examples

@pytest.fixture(scope="module")
def smol():
    # The loader takes EOS/PAD from the GGUF metadata (transformers 5.17 reads the file's
    # eos as "<|im_start|>" although tokenizer.ggml.eos_token_id = 2, "<|im_end|>").
    from slidetune.models.load import embedded_tokenizer

    tok = embedded_tokenizer()
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_id == 2 and tok.bos_token_id == 1
    return tok


def _runs(tok, ids, targets) -> list[str]:
    """Decoded maximal runs of target tokens."""
    runs, cur = [], []
    for i, t in zip(ids, targets):
        if t:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


def test_builtin_corpus_size_and_determinism():
    docs = builtin_corpus()
    assert sum(map(len, docs)) > 500_000
    assert len(docs) > 500 and len(set(docs)) == len(docs)
    assert docs == builtin_corpus()
    assert any("Python" in d_ for d_ in docs[:50])


def test_smollm_chat_masks_assistant_turns(tmp_path, smol):
    msgs = [{"role": "system", "content": "Be nice."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "Goodbye."}]
    p = tmp_path / "chat.jsonl"
    p.write_text(json.dumps({"messages": msgs}) + "\n")
    src = read_source(str(p))
    (ex,) = tokenize_examples(src.examples, smol, True, str(p))
    full = smol.apply_chat_template(msgs, tokenize=False)
    assert smol.decode(ex.ids) == full  # the template starts with <|im_start|> (BOS): no 2nd BOS,
    assert ex.ids[0] == 1              # and ends with "<|im_end|>\n": no extra EOS
    assert _runs(smol, ex.ids, ex.targets) == ["Hello there.<|im_end|>\n", "Goodbye.<|im_end|>\n"]


def test_smollm_prompt_completion(tmp_path, smol):
    p = tmp_path / "pc.jsonl"
    p.write_text(json.dumps({"prompt": "The capital of France is", "completion": " Paris."}) + "\n")
    src = read_source(str(p))
    (ex,) = tokenize_examples(src.examples, smol, True, str(p))
    assert ex.ids[0] == smol.bos_token_id and ex.ids[-1] == smol.eos_token_id
    assert _runs(smol, ex.ids, ex.targets) == [" Paris.<|im_end|>"]
    assert smol.decode(ex.ids[1:-1]) == "The capital of France is Paris."


def test_smollm_builtin_corpus_datasets(smol):
    cfg = DataConfig(seq_len=128, heldout_fraction=0.05, seed=0)
    train, heldout = build_datasets(cfg, smol)
    assert len(train) > 1000 and len(heldout) > 50
    assert train.packed and train.format == "text" and train.source == "<builtin corpus>"
    sampler = BatchSampler(train, batch_size=4, seed=0, pad_id=default_pad_id(smol))
    batch = sampler.batch(len(sampler) + 3)  # second epoch
    assert batch.input_ids.shape == batch.labels.shape == (4, 128)
    assert batch.attention_mask is None
    # Text is fully supervised except BOS: labels are the rows shifted by one, -100 on BOS.
    nxt = torch.stack([train[r].ids[1:] for r in sampler.rows(len(sampler) + 3)])   # [4, 128]
    assert torch.equal(batch.input_ids[:, 1:], nxt[:, :-1])
    is_bos = nxt == smol.bos_token_id
    assert torch.equal(batch.labels, torch.where(is_bos, IGNORE_INDEX, nxt))
    text = smol.decode(heldout[0].ids)
    assert len(text) > 200
