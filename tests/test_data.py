"""Data module tests on a tiny in-memory word-level tokenizer, so every id is checked by hand.

Tiny vocabulary: <pad>=0 <bos>=1 <eos>=2 <unk>=3 <|user|>=4 <|assistant|>=5 <|system|>=6
<|end|>=7, then a=8 b=9 c=10 d=11 e=12 f=13 g=14 h=15. Words split on whitespace.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from slidetune.data import (
    ALPACA_PROMPT,
    ALPACA_PROMPT_NO_INPUT,
    IGNORE_INDEX,
    BatchSampler,
    DataConfig,
    DataError,
    TokenDataset,
    build_datasets,
    collate,
    default_pad_id,
    eval_batches,
)
from slidetune.data.formats import read_source
from slidetune.data.split import heldout_split
from slidetune.data.tokenization import tokenize_examples

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>",
            "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
WORDS = list("abcdefgh")
PAD, BOS, EOS, UNK, USER, ASSISTANT, SYSTEM, END = range(8)
a, b, c, d, e, f, g, h = range(8, 16)

# "<|role|> content <|end|> " per message; the generation prompt is "<|assistant|> ".
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def make_tokenizer(chat_template: str | None = CHAT_TEMPLATE, eos: str | None = "<eos>"):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    kwargs = dict(bos_token="<bos>", pad_token="<pad>", unk_token="<unk>",
                  additional_special_tokens=SPECIALS[4:])
    if eos is not None:
        kwargs["eos_token"] = eos
    tok = PreTrainedTokenizerFast(tokenizer_object=core, **kwargs)
    tok.chat_template = chat_template
    return tok


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def tokenized(path: str, tokenizer, mask_prompt: bool = True):
    src = read_source(path)
    return tokenize_examples(src.examples, tokenizer, mask_prompt, src.name)


def build(path: str, tokenizer, **kw):
    kw.setdefault("heldout_fraction", 0.0)
    return build_datasets(DataConfig(path=path, **kw), tokenizer)


# --------------------------------------------------------------------------- formats and masks

def test_text_jsonl_fully_supervised(tmp_path, tok):
    p = write_jsonl(tmp_path / "t.jsonl", [{"text": "a b c"}, {"text": "d", "id": 7}])
    ex = tokenized(p, tok)
    assert ex[0].ids == [BOS, a, b, c, EOS]
    assert ex[0].targets == [False, True, True, True, True]  # BOS never a target
    assert ex[1].ids == [BOS, d, EOS]
    assert ex[1].where == f"{p}:2"


def test_prompt_completion_mask(tmp_path, tok):
    p = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "a b", "completion": "c d"}])
    (ex,) = tokenized(p, tok)
    assert ex.ids == [BOS, a, b, c, d, EOS]
    assert ex.targets == [False, False, False, True, True, True]  # completion + EOS
    (ex,) = tokenized(p, tok, mask_prompt=False)
    assert ex.targets == [False, True, True, True, True, True]


def test_alpaca_template_and_mask(tmp_path, tok):
    p = write_jsonl(tmp_path / "al.jsonl", [
        {"instruction": "a", "input": "b", "output": "c d"},
        {"instruction": "e", "input": "", "output": "f"},
        {"instruction": "g", "output": "h"},  # input is optional
    ])
    src = read_source(p)
    assert src.format == "alpaca"
    assert src.examples[0].segments[0].text == ALPACA_PROMPT.format(instruction="a", input="b")
    assert src.examples[1].segments[0].text == ALPACA_PROMPT_NO_INPUT.format(instruction="e")
    assert src.examples[2].segments[0].text == ALPACA_PROMPT_NO_INPUT.format(instruction="g")
    ex = tokenize_examples(src.examples, tok, True, p)
    n_prompt = len(tok(ALPACA_PROMPT.format(instruction="a", input="b"),
                       add_special_tokens=False).input_ids)
    assert ex[0].ids[-3:] == [c, d, EOS]
    assert ex[0].targets == [False] * (1 + n_prompt) + [True, True, True]
    assert ex[0].ids[1 + n_prompt - 1] != c  # the prompt ends before the output


def test_chat_only_assistant_turns_supervised(tmp_path, tok):
    msgs = [{"role": "system", "content": "a"}, {"role": "user", "content": "b c"},
            {"role": "assistant", "content": "d"}, {"role": "user", "content": "e"},
            {"role": "assistant", "content": "f g"}]
    p = write_jsonl(tmp_path / "chat.jsonl", [{"messages": msgs}])
    (ex,) = tokenized(p, tok)
    assert ex.ids == [BOS, SYSTEM, a, END, USER, b, c, END, ASSISTANT, d, END,
                      USER, e, END, ASSISTANT, f, g, END, EOS]
    F, T = False, True
    assert ex.targets == [F, F, F, F, F, F, F, F, F, T, T,
                          F, F, F, F, T, T, T, T]  # reply + its <|end|>, final EOS
    (ex,) = tokenized(p, tok, mask_prompt=False)
    assert ex.targets == [F] + [T] * 18


def test_chat_ending_with_user_turn_has_untrained_eos(tmp_path, tok):
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}]
    p = write_jsonl(tmp_path / "chat.jsonl", [{"messages": msgs}])
    (ex,) = tokenized(p, tok)
    assert ex.ids == [BOS, USER, a, END, ASSISTANT, b, END, USER, c, END, EOS]
    assert [i for i, t in zip(ex.ids, ex.targets) if t] == [b, END]


def test_chat_template_ending_with_eos_gets_no_second_eos(tmp_path):
    tmpl = "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <eos>\n{% endfor %}" \
           "{% if add_generation_prompt %}<|assistant|> {% endif %}"
    tk = make_tokenizer(chat_template=tmpl)
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    p = write_jsonl(tmp_path / "chat.jsonl", [{"messages": msgs}])
    (ex,) = tokenized(p, tk)
    assert ex.ids == [BOS, USER, a, EOS, ASSISTANT, b, EOS]
    assert ex.targets == [False] * 5 + [True, True]


def test_chat_opening_assistant_turn(tmp_path, tok):
    msgs = [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"},
            {"role": "assistant", "content": "c"}]
    p = write_jsonl(tmp_path / "chat.jsonl", [{"messages": msgs}])
    (ex,) = tokenized(p, tok)
    assert [i for i, t in zip(ex.ids, ex.targets) if t] == [a, END, c, END, EOS]


def test_txt_documents_split_on_blank_lines(tmp_path, tok):
    p = tmp_path / "doc.txt"
    p.write_text("a b\n\n\nc\n  \nd\ne\n\n")
    src = read_source(str(p))
    assert [ex.segments[0].text for ex in src.examples] == ["a b", "c", "d\ne"]
    assert [ex.where for ex in src.examples] == [f"{p}:1", f"{p}:4", f"{p}:6"]
    ex = tokenize_examples(src.examples, tok, True, str(p))
    assert ex[2].ids == [BOS, d, e, EOS]


def test_bos_equal_to_eos_is_not_prepended(tmp_path):
    tk = make_tokenizer(eos="<bos>")  # GPT-2 style: one <|endoftext|> token for both
    p = write_jsonl(tmp_path / "t.jsonl", [{"text": "a b"}])
    (ex,) = tokenized(p, tk)
    assert ex.ids == [a, b, BOS]


# --------------------------------------------------------------------------- packing, padding

def test_packing_windows_and_shift(tmp_path, tok):
    p = write_jsonl(tmp_path / "t.jsonl", [{"text": "a b"}, {"text": "c d e"}, {"text": "f"}])
    # stream: 1 8 9 2 | 1 10 11 12 2 | 1 13 2  (12 tokens); windows of 4, stride 3
    train, heldout = build(p, tok, seq_len=3)
    assert len(heldout) == 0 and train.packed
    assert [r.ids.tolist() for r in train] == [[BOS, a, b, EOS], [EOS, BOS, c, d], [d, e, EOS, BOS]]
    batch = collate(train, [0, 1, 2], pad_id=PAD)
    assert batch.input_ids.tolist() == [[BOS, a, b], [EOS, BOS, c], [d, e, EOS]]
    X = IGNORE_INDEX
    assert batch.labels.tolist() == [[a, b, EOS], [X, c, d], [e, EOS, X]]  # BOS never a target
    assert batch.attention_mask is None
    assert batch.num_target_tokens() == 7
    assert batch.input_ids.dtype == batch.labels.dtype == torch.int64
    assert train.num_target_tokens == 7


def test_packing_keeps_prompt_mask_across_the_shift(tmp_path, tok):
    p = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "a b", "completion": "c"},
                                            {"prompt": "d", "completion": "e f"}])
    # stream: 1 8 9 10 2 | 1 11 12 13 2 (10 tokens), targets: 10 2 | 12 13 2
    # windows: stream[0:5], stream[4:9] (wrapped: instruction data packs whole examples by default)
    train, _ = build(p, tok, seq_len=4, packing_strategy="wrapped")
    batch = collate(train, range(len(train)), pad_id=PAD)
    X = IGNORE_INDEX
    assert batch.input_ids.tolist() == [[BOS, a, b, c], [EOS, BOS, d, e]]
    assert batch.labels.tolist() == [[X, X, c, EOS], [X, X, e, f]]


def test_padding_truncation_and_attention_mask(tmp_path, tok):
    p = write_jsonl(tmp_path / "t.jsonl", [{"text": "a"}, {"text": "a b c"},
                                           {"text": "a b c d e f"}])
    with pytest.warns(UserWarning, match="1 of 3 train examples .* truncated"):
        train, _ = build(p, tok, seq_len=4, packing=False)
    assert not train.packed and train.num_truncated == 1
    batch = collate(train, [0, 1, 2], pad_id=PAD)
    X = IGNORE_INDEX
    assert batch.input_ids.tolist() == [[BOS, a, EOS, PAD], [BOS, a, b, c], [BOS, a, b, c]]
    assert batch.labels.tolist() == [[a, EOS, X, X], [a, b, c, EOS], [a, b, c, d]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert batch.attention_mask.dtype == torch.int64
    # A batch without padding has no mask; a pad id of EOS is still masked by position.
    assert collate(train, [1, 2], pad_id=EOS).attention_mask is None
    assert collate(train, [0], pad_id=EOS).labels.tolist() == [[a, EOS, X, X]]


def test_rows_without_targets_are_dropped(tmp_path, tok):
    p = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "a b c d e f", "completion": "g"},
                                            {"prompt": "a", "completion": "b"}])
    with pytest.warns(UserWarning) as caught:
        train, _ = build(p, tok, seq_len=4, packing=False)
    messages = [str(w.message) for w in caught]
    assert any("1 of 2 train examples" in m for m in messages)
    assert any("1 train rows have no target token" in m for m in messages)
    assert len(train) == 1 and train.num_dropped == 1
    assert train[0].ids.tolist() == [BOS, a, b, EOS]


def test_eval_batches_cover_every_row_once(tmp_path, tok):
    p = write_jsonl(tmp_path / "t.jsonl", [{"text": "a b c d e f g h"}] * 3)
    train, _ = build(p, tok, seq_len=4)
    batches = list(eval_batches(train, 2, pad_id=PAD))
    assert sum(bt.input_ids.shape[0] for bt in batches) == len(train)
    assert torch.equal(torch.cat([bt.input_ids for bt in batches]),
                       collate(train, range(len(train)), PAD).input_ids)


def test_default_pad_id(tok):
    assert default_pad_id(tok) == PAD
    tk = make_tokenizer()
    tk.pad_token = None
    assert default_pad_id(tk) == EOS


# --------------------------------------------------------------------------- held-out split

def test_heldout_split_deterministic_disjoint():
    tr, he = heldout_split(100, 0.1, seed=3, source_name="x")
    assert (tr, he) == heldout_split(100, 0.1, seed=3, source_name="x")
    assert len(he) == 10 and set(tr).isdisjoint(he) and sorted(tr + he) == list(range(100))
    assert heldout_split(100, 0.1, seed=4, source_name="x")[1] != he
    assert heldout_split(2, 0.01, 0, "x")[1] and heldout_split(2, 0.99, 0, "x")[0]  # one each
    assert heldout_split(5, 0.0, 0, "x") == ([0, 1, 2, 3, 4], [])
    with pytest.raises(DataError, match="1 example.*at least 2"):
        heldout_split(1, 0.5, 0, "x")


def test_heldout_documents_disjoint_in_datasets(tmp_path, tok, monkeypatch):
    import slidetune.data.split as split_mod
    monkeypatch.setattr(split_mod, "MIN_HELDOUT_EXAMPLES", 2)  # 8 documents: one per word
    # Each document is one distinct word repeated: the word identifies its document.
    docs = [{"text": " ".join([w] * 6)} for w in WORDS]
    p = write_jsonl(tmp_path / "t.jsonl", docs)
    cfg = dict(seq_len=3, heldout_fraction=0.25, seed=1)
    train, heldout = build(p, tok, **cfg)
    words = lambda ds: set(ds.tokens.tolist()) - {BOS, EOS}  # noqa: E731
    assert words(train).isdisjoint(words(heldout))
    assert words(train) | words(heldout) == set(range(a, h + 1))
    assert heldout.num_examples == 2 and train.num_examples == 6
    train2, heldout2 = build(p, tok, **cfg)
    assert torch.equal(heldout.tokens, heldout2.tokens) and torch.equal(train.tokens, train2.tokens)


# --------------------------------------------------------------------------- sampler

def _dataset(n_rows: int) -> TokenDataset:
    tokens = torch.arange(n_rows * 3, dtype=torch.int32)  # row r = [3r, 3r+1, 3r+2]
    return TokenDataset(tokens, torch.ones_like(tokens, dtype=torch.bool),
                        torch.arange(n_rows) * 3, torch.full((n_rows,), 3), seq_len=2, packed=True)


def test_sampler_is_a_pure_function_of_seed_and_index():
    ds = _dataset(10)
    s1 = BatchSampler(ds, batch_size=3, seed=5, pad_id=0)
    assert len(s1) == 3  # the 10th row's incomplete batch is dropped
    later = s1.batch(7)
    s2 = BatchSampler(ds, batch_size=3, seed=5, pad_id=0)
    for i in [7, 0, 4, 7]:  # any order, fresh sampler
        assert torch.equal(s2.batch(i).input_ids, s1.batch(i).input_ids)
    assert torch.equal(later.labels, s2.batch(7).labels)
    assert s1.epoch_of(2) == 0 and s1.epoch_of(3) == 1 and s1.epoch_of(7) == 2
    epoch0 = [r for i in range(3) for r in s1.rows(i)]
    epoch1 = [r for i in range(3, 6) for r in s1.rows(i)]
    assert len(set(epoch0)) == 9 and len(set(epoch1)) == 9  # no repeats within an epoch
    assert epoch0 != epoch1  # a new permutation per epoch
    assert epoch0 == torch.randperm(10, generator=torch.Generator().manual_seed(5))[:9].tolist()
    assert epoch1 == torch.randperm(10, generator=torch.Generator().manual_seed(6))[:9].tolist()
    assert [r for i in range(3) for r in BatchSampler(ds, 3, 6, 0).rows(i)] != epoch0


def test_sampler_same_batch_in_another_process():
    ds = _dataset(10)
    here = BatchSampler(ds, batch_size=3, seed=11, pad_id=0).batch(8).input_ids.tolist()
    code = (
        "import torch; from slidetune.data import BatchSampler, TokenDataset\n"
        "t = torch.arange(30, dtype=torch.int32)\n"
        "ds = TokenDataset(t, torch.ones_like(t, dtype=torch.bool), torch.arange(10) * 3, "
        "torch.full((10,), 3), seq_len=2, packed=True)\n"
        "print(BatchSampler(ds, 3, 11, 0).batch(8).input_ids.tolist())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(here)


def test_sampler_errors():
    with pytest.raises(ValueError, match="4 rows .* fewer than batch_size=5"):
        BatchSampler(_dataset(4), batch_size=5, seed=0, pad_id=0)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        BatchSampler(_dataset(4), batch_size=0, seed=0, pad_id=0)


# --------------------------------------------------------------------------- errors

def test_error_missing_path(tmp_path, tok):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match=f"{missing} does not exist"):
        build(missing, tok)


def test_error_malformed_json_names_line(tmp_path, tok):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "a"}\n\n{"text": "b",}\n')
    with pytest.raises(DataError, match=rf"{p}:3: malformed JSON: .*column"):
        build(str(p), tok)


def test_error_not_an_object(tmp_path, tok):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "a"}\n["a"]\n')
    with pytest.raises(DataError, match=rf"{p}:2: expected a JSON object, got list"):
        build(str(p), tok)


def test_error_unknown_keys_lists_formats(tmp_path, tok):
    p = write_jsonl(tmp_path / "bad.jsonl", [{"text": "a"}, {"question": "a", "answer": "b"}])
    with pytest.raises(DataError, match=rf"{p}:2: keys \['answer', 'question'\] match no known "
                                        r"format.*'messages'.*'instruction', 'output'.*'prompt', "
                                        r"'completion'.*'text'"):
        build(p, tok)


def test_error_mixed_formats(tmp_path, tok):
    p = write_jsonl(tmp_path / "mixed.jsonl", [{"text": "a"}, {"text": "b"},
                                               {"prompt": "a", "completion": "b"}])
    with pytest.raises(DataError, match=rf"{p}:3: this record is 'prompt_completion' data but "
                                        rf"{p}:1 is 'text'"):
        build(p, tok)


@pytest.mark.parametrize("record, expected", [
    ({"messages": "hi"}, r"'messages' must be a list .* got str"),
    ({"messages": []}, r"'messages' is an empty list"),
    ({"messages": ["hi"]}, r"messages\[0\] must be an object .* got str"),
    ({"messages": [{"role": "user"}]}, r"messages\[0\]\['content'\] must be a string, got missing"),
    ({"messages": [{"role": "user", "content": 3}]},
     r"messages\[0\]\['content'\] must be a string, got int"),
    ({"text": 5}, r"'text' must be a string, got int"),
    ({"prompt": "a", "completion": None}, r"'completion' must be a string, got NoneType"),
    ({"instruction": ["a"], "output": "b"}, r"'instruction' must be a string, got list"),
])
def test_error_wrong_types(tmp_path, tok, record, expected):
    p = tmp_path / "bad.jsonl"
    p.write_text("\n" + json.dumps(record) + "\n")  # line 2
    with pytest.raises(DataError, match=rf"{p}:2: {expected}"):
        build(str(p), tok)


def test_error_invalid_utf8(tmp_path, tok):
    p = tmp_path / "bad.jsonl"
    p.write_bytes(b'{"text": "a"}\n{"text": "\xff"}\n')
    with pytest.raises(DataError, match=rf"{p}:2: not valid UTF-8"):
        build(str(p), tok)
    q = tmp_path / "bad.txt"
    q.write_bytes(b"a\nb\n\xff\n")
    with pytest.raises(DataError, match=rf"{q}:3: not valid UTF-8"):
        build(str(q), tok)


def test_error_empty_sources(tmp_path, tok):
    p = tmp_path / "empty.jsonl"
    p.write_text("\n \n")
    with pytest.raises(DataError, match=rf"{p}: no examples found"):
        build(str(p), tok)
    q = tmp_path / "empty.txt"
    q.write_text("  \n\n")
    with pytest.raises(DataError, match=rf"{q}: no documents found"):
        build(str(q), tok)


def test_too_few_tokens_for_one_packed_row_falls_back_to_padding(tmp_path, tok, capsys):
    p = write_jsonl(tmp_path / "small.jsonl", [{"text": "a"}, {"text": "b c"}])
    # 3 + 4 = 7 tokens < seq_len + 1 = 9: no packed row, so one example per row
    train, heldout = build(p, tok, seq_len=8)
    assert not train.packed and len(train) == 2 and len(heldout) == 0
    assert [r.ids.tolist() for r in train] == [[BOS, a, EOS], [BOS, b, c, EOS]]
    batch = collate(train, [0, 1], pad_id=PAD)
    X = IGNORE_INDEX
    assert batch.labels.tolist() == [[a, EOS] + [X] * 6, [b, c, EOS] + [X] * 5]
    assert batch.attention_mask.tolist() == [[1] * 3 + [0] * 5, [1] * 4 + [0] * 4]
    err = capsys.readouterr().err
    assert "note:" in err and "too few to fill one packed row of seq_len+1 = 9" in err
    assert "one example per row" in err


def test_packed_rows_fewer_than_a_batch_fall_back_to_padding(tmp_path, tok, capsys):
    p = write_jsonl(tmp_path / "t.jsonl", [{"text": "a b c"}, {"text": "d e"}, {"text": "f"}])
    # 5 + 4 + 3 = 12 tokens: 2 packed rows of 5 (seq_len 4); 3 rows one example each
    train, _ = build(p, tok, seq_len=4)
    assert train.packed and len(train) == 2
    train, _ = build_datasets(DataConfig(path=p, seq_len=4, heldout_fraction=0.0), tok, min_rows=3)
    assert not train.packed and len(train) == 3
    assert "fill only 2 packed row(s)" in capsys.readouterr().err
    with pytest.raises(DataError, match=rf"{p}: too little training data for one batch: the 3 "
                                        r"training examples give 3 usable rows of one example "
                                        r"each, fewer than batch_size=4; add examples or use a "
                                        r"smaller --batch-size$"):
        build_datasets(DataConfig(path=p, seq_len=4, heldout_fraction=0.0), tok, min_rows=4)
    assert capsys.readouterr().err == ""    # an error comes without the notes of the fallback


def test_fewer_than_ten_examples_train_without_heldout(tmp_path, tok, capsys):
    p = write_jsonl(tmp_path / "small2.jsonl", [{"text": "a b c d e f g h"}, {"text": "a"}] * 4)
    train, heldout = build(p, tok, seq_len=5, heldout_fraction=0.5)
    assert len(heldout) == 0 and train.num_examples == 8
    err = capsys.readouterr().err
    assert "note:" in err and "8 example(s) are too few to hold some out" in err
    assert "--heldout-fraction 0" in err
    # from 10 examples up at least one is held out, even where the fraction rounds to 0
    p = write_jsonl(tmp_path / "ten.jsonl", [{"text": "a b c d e f g h"}] * 10)
    train, heldout = build(p, tok, seq_len=5, heldout_fraction=0.01)
    assert heldout.num_examples == 1 and train.num_examples == 9
    assert len(heldout) > 0 and heldout.packed


def test_heldout_too_small_to_pack_is_padded(tmp_path, tok, capsys):
    p = write_jsonl(tmp_path / "t.jsonl", [{"text": "a b"}] * 12)  # 4 tokens each
    train, heldout = build(p, tok, seq_len=5, heldout_fraction=0.1)  # 1 held out: 4 tokens < 6
    assert train.packed and len(train) == 8                          # 44 tokens: 8 rows of 6
    assert not heldout.packed and len(heldout) == 1 and heldout.num_examples == 1
    assert heldout[0].ids.tolist() == [BOS, a, b, EOS]
    assert "the 1 held-out examples (4 tokens) are too few to fill one packed row" in (
        capsys.readouterr().err)
    (batch,) = eval_batches(heldout, 4, pad_id=PAD)
    X = IGNORE_INDEX
    assert batch.input_ids.tolist() == [[BOS, a, b, EOS, PAD]]
    assert batch.labels.tolist() == [[a, b, EOS, X, X]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 0]]
    assert batch.num_target_tokens() == 3


def test_heldout_without_targets_is_dropped_with_a_note(tmp_path, tok, capsys):
    records = [{"prompt": "a", "completion": "b c"} for _ in range(10)]
    records[3] = {"prompt": "a b", "completion": ""}  # nothing to evaluate
    p = write_jsonl(tmp_path / "pc.jsonl", records)
    seed = next(s for s in range(1000) if heldout_split(10, 0.1, s, "x")[1] == [3])
    train, heldout = build(p, tok, seq_len=8, heldout_fraction=0.1, seed=seed)
    assert len(heldout) == 0 and train.num_examples == 9 and len(train) > 0
    assert "none of the 1 held-out examples has a token to evaluate" in capsys.readouterr().err


def test_error_no_target_tokens_unpacked(tmp_path, tok):
    p = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "a b c d", "completion": "e"}])
    with pytest.raises(DataError, match=rf"{p}: no usable training examples \(the train split is "
                                        r"empty after tokenization\): of the 1 training example "
                                        r"\(7 tokens\), 1 has none within the first seq_len\+1 = 3 "
                                        r"tokens .*larger --seq-len.*check the data's format"):
        build(p, tok, seq_len=2, packing=False)


def test_error_no_usable_examples(tmp_path, tok):
    # empty completions: the prompt is masked and EOS follows it, so nothing is a target
    empty = [{"prompt": "a b", "completion": ""}] * 3                   # 4 tokens each
    p = write_jsonl(tmp_path / "empty.jsonl", empty)
    for packing in (True, False):
        with pytest.raises(DataError) as err:
            build(p, tok, seq_len=4, packing=packing)
        msg = str(err.value)
        assert msg.startswith(f"{p}: no usable training examples (the train split is empty after "
                              f"tokenization): of the 3 training examples (12 tokens), 3 have no "
                              f"token to train on at all (an empty text or completion")
        assert "add examples" in msg and "check the data's format" in msg
        assert "--seq-len" not in msg                                 # would not help here
    # one per row (packing=False): long prompts leave nothing within seq_len+1 tokens
    long_prompt = [{"prompt": "a b c d e f g", "completion": "h"}] * 2    # 10 tokens each
    p = write_jsonl(tmp_path / "mixed.jsonl", empty + long_prompt)
    with pytest.raises(DataError) as err:
        build(p, tok, seq_len=4, packing=False)
    msg = str(err.value)
    assert "of the 5 training examples (32 tokens), 3 have no token to train on at all" in msg
    assert "and 2 have none within the first seq_len+1 = 5 tokens (a prompt of seq_len = 4" in msg
    assert "use a larger --seq-len" in msg


def test_error_chat_without_template_names_file(tmp_path):
    tk = make_tokenizer(chat_template=None)
    p = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "a"}]}])
    with pytest.raises(DataError, match=rf"{p}: chat data \('messages' at {p}:1\) needs a "
                                        r"tokenizer with a chat template"):
        build(p, tk)


def test_error_chat_template_not_prefix_stable(tmp_path):
    # Marks the last message specially: prefixes render differently from the whole.
    tmpl = "{% for m in messages %}{% if loop.last %}<|end|> {% endif %}<|{{ m['role'] }}|> " \
           "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
    tk = make_tokenizer(chat_template=tmpl)
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}]
    p = write_jsonl(tmp_path / "chat.jsonl", [{"messages": msgs}])
    with pytest.raises(DataError, match=rf"{p}:1: cannot locate assistant message 1"):
        build(p, tk)
    build(p, tk, mask_prompt=False, packing=False)  # no masking: no need to locate turns


def test_error_chat_template_raises(tmp_path):
    tk = make_tokenizer(chat_template="{{ raise_exception('roles must alternate') }}")
    p = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "a"}]}])
    with pytest.raises(DataError, match=rf"{p}:1: the tokenizer's chat template failed.*alternate"):
        build(p, tk)


def test_error_tokenizer_without_eos(tmp_path):
    tk = make_tokenizer(eos=None)
    p = write_jsonl(tmp_path / "t.jsonl", [{"text": "a"}])
    with pytest.raises(DataError, match=rf"{p}: the tokenizer has no eos_token"):
        build(p, tk)


def test_error_unknown_file_type(tmp_path, tok):
    p = tmp_path / "data.docx"
    p.write_text("a,b\n")
    with pytest.raises(DataError, match=rf"{p}: unknown data file type; expected .txt"):
        build(str(p), tok)


def test_config_validation():
    with pytest.raises(ValueError, match="seq_len"):
        DataConfig(seq_len=0)
    with pytest.raises(ValueError, match="heldout_fraction"):
        DataConfig(heldout_fraction=1.0)


# --------------------------------------------------------------------------- datasets directory

def _save_to_disk(path, **splits) -> str:
    import datasets
    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()}).save_to_disk(str(path))
    return str(path)


def test_datasets_dir_rows_read_like_jsonl(tmp_path, tok):
    rows = [{"prompt": "a", "completion": "b", "text": None}, {"prompt": "c", "completion": "d",
                                                               "text": None}]
    p = _save_to_disk(tmp_path / "disk", train=rows, test=[{"prompt": "e", "completion": "f", "text": None}])
    train, _ = build(p, tok, seq_len=3, packing=False)
    assert train.format == "prompt_completion"
    assert [r.ids.tolist() for r in train] == [[BOS, a, b, EOS], [BOS, c, d, EOS]]
    assert [r.targets.tolist() for r in train] == [[False, False, True, True]] * 2


def test_datasets_dir_errors_name_row(tmp_path, tok):
    p = _save_to_disk(tmp_path / "one", train=[{"text": "a"}, {"text": None}])
    with pytest.raises(DataError, match=rf"{p} row 2: 'text' must be a string"):
        build(p, tok)
    p = _save_to_disk(tmp_path / "two", a=[{"text": "a"}], b=[{"text": "b"}])
    with pytest.raises(DataError, match=r"no 'train' split and several others \(a, b\); choose one with "
                                        r"--data-split"):
        build(p, tok)


def test_tokenizer_ids_beyond_the_models_vocabulary_are_refused(tmp_path, tok):
    """A tokenizer with more ids than the model's embedding has rows (added tokens, embeddings not
    resized): refused when the data is built, naming the file, not an IndexError at some batch."""
    p = write_jsonl(tmp_path / "t.jsonl", [{"text": "a b c"}, {"text": "d"}] * 3)
    top = max(max(e.ids) for e in tokenized(p, tok))
    build_datasets(DataConfig(path=p, heldout_fraction=0.0, seq_len=8), tok, vocab_size=top + 1)
    with pytest.raises(DataError, match=rf"t.jsonl: the tokenizer gives token id {top}, beyond the model's "
                                        rf"vocabulary of {top} ids"):
        build_datasets(DataConfig(path=p, heldout_fraction=0.0, seq_len=8), tok, vocab_size=top)
