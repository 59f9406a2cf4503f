"""Whole-example packing (packing_strategy bfd, the default for chat/instruction data).

Best-fit decreasing puts every example whole into one row of at most seq_len+1 tokens (a reply is
never cut from its prompt); rows are padded per batch without an attention mask, the padding a
document of its own under the document mask, so a packed row still trains like its examples run
alone. Plain text keeps the windows of the concatenated stream (wrapped).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from reference import ReferenceTrainer, build_reference
from slidetune.data import IGNORE_INDEX, Batch, BatchSampler, DataConfig, TokenDataset, build_datasets, collate
from slidetune.engine import AdamWConfig, RuntimeConfig, build_engine
from slidetune.data.packing import best_fit_decreasing, fill_ratio, pack_whole
from slidetune.data.tokenization import TokenizedExample
from slidetune.ops.packed_attention import use_packed_attention
from test_data import make_tokenizer
from test_packing import VOCAB, _reference_step, alone_losses, make_loaded, per_token_losses


def random_examples(n: int, max_len: int, seed: int = 0, vocab: int = VOCAB) -> list[TokenizedExample]:
    """Examples of random tokens (3..vocab-1, so no id repeats a special) with random prompt lengths."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(2, max_len)
        prompt = rng.randint(1, length - 1)
        ids = [rng.randint(3, vocab - 1) for _ in range(length)]
        out.append(TokenizedExample(ids, [False] * prompt + [True] * (length - prompt), f"ex{i}"))
    return out


def row_pieces(rows, r: int) -> list[list[int]]:
    """Row r split at its document starts: the token ids of each document in it."""
    start, length = int(rows.starts[r]), int(rows.lengths[r])
    ids = rows.tokens[start:start + length].tolist()
    firsts = torch.nonzero(rows.doc_starts[start:start + length]).flatten().tolist()
    assert firsts and firsts[0] == 0, "a row starts with an example's first token"
    return [ids[a:b] for a, b in zip(firsts, firsts[1:] + [length])]


def test_best_fit_decreasing_by_hand():
    # longest first: 9 -> bin 0 (room 1); 6 -> bin 1 (room 4); 5 fits no room -> bin 2 (room 5);
    # 4 -> the tightest room, bin 1's 4; 3 -> bin 2 (room 2); 2 -> bin 2 (room 0)
    assert best_fit_decreasing([5, 9, 4, 6, 3, 2], 10) == [[1], [3, 2], [0, 4, 5]]
    assert best_fit_decreasing([], 10) == []
    assert best_fit_decreasing([10, 10], 10) == [[0], [1]]


@pytest.mark.parametrize("seed", range(5))
def test_best_fit_decreasing_places_every_item_once_and_packs_tightly(seed):
    rng = random.Random(seed)
    capacity = rng.choice([16, 64, 257])
    lengths = [rng.randint(1, capacity) for _ in range(rng.randint(1, 400))]
    bins = best_fit_decreasing(lengths, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert max(loads) <= capacity and min(len(b) for b in bins) >= 1
    # any-fit packing: no two bins would fit into one (the later bin's first item did not fit the earlier)
    ordered = sorted(loads)
    assert len(loads) < 2 or ordered[0] + ordered[1] > capacity
    assert best_fit_decreasing(lengths, capacity) == bins          # deterministic


def test_pack_whole_keeps_every_example_whole_in_one_row():
    seq_len = 64
    examples = random_examples(300, 40, seed=1)
    rows = pack_whole(examples, seq_len)
    assert rows.num_truncated == rows.num_dropped == 0
    assert int(rows.lengths.max()) <= seq_len + 1
    pieces = [p for r in range(len(rows.starts)) for p in row_pieces(rows, r)]
    # each example exactly once, contiguous, starting at a document start
    assert sorted(map(tuple, pieces)) == sorted(tuple(e.ids) for e in examples)
    assert rows.tokens.numel() == rows.num_stream_tokens == sum(len(e.ids) for e in examples)
    # targets travel with their tokens
    by_ids = {tuple(e.ids): e.targets for e in examples}
    for r in range(len(rows.starts)):
        start, length = int(rows.starts[r]), int(rows.lengths[r])
        want = [t for p in row_pieces(rows, r) for t in by_ids[tuple(p)]]
        assert rows.targets[start:start + length].tolist() == want
    ratio = fill_ratio(rows, seq_len)
    assert ratio == pytest.approx(rows.num_stream_tokens / (len(rows.starts) * (seq_len + 1)))
    assert ratio > 0.9  # 300 examples of 2..40 tokens leave little room unfilled
    again = pack_whole(examples, seq_len)
    assert torch.equal(again.tokens, rows.tokens) and torch.equal(again.starts, rows.starts)


def test_pack_whole_truncates_long_examples_to_their_own_row_and_drops_untrainable_ones():
    seq_len = 8
    long = TokenizedExample(list(range(3, 23)), [False] * 2 + [True] * 18, "long")      # 20 > 9 tokens
    prompt_only = TokenizedExample(list(range(3, 15)), [False] * 10 + [True] * 2, "late")   # targets past 9
    short = TokenizedExample([3, 4, 5], [False, True, True], "short")
    rows = pack_whole([long, prompt_only, short], seq_len)
    assert rows.num_truncated == 2 and rows.num_dropped == 1
    assert [row_pieces(rows, r) for r in range(len(rows.starts))] == [[list(range(3, 12))], [[3, 4, 5]]]


def write_jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


WORDS = "a b c d e f g h".split()


def prompt_completion_records(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": " ".join(rng.choices(WORDS, k=rng.randint(1, 6))),
             "completion": " ".join(rng.choices(WORDS, k=rng.randint(1, 5)))} for _ in range(n)]


def test_instruction_data_packs_whole_by_default_and_text_in_windows(tmp_path, capsys):
    tok = make_tokenizer()
    pc = write_jsonl(tmp_path / "pc.jsonl", prompt_completion_records(60))
    train, _ = build_datasets(DataConfig(path=pc, seq_len=16, heldout_fraction=0.0), tok)
    assert train.packed and train.document_mask
    assert int(train.lengths.max()) <= 17 and int(train.lengths.min()) < 17
    # every row starts an example: BOS at each row's first token, EOS at its last
    assert (train.tokens[train.starts] == 1).all() and (train.tokens[train.starts + train.lengths - 1] == 2).all()
    err = capsys.readouterr().err
    assert f"the 60 training examples are packed whole into {len(train)} rows" in err and "% of the row" in err
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": r["prompt"] + " " + r["completion"]}
                                              for r in prompt_completion_records(60)])
    windows, _ = build_datasets(DataConfig(path=text, seq_len=16, heldout_fraction=0.0), tok)
    assert (windows.lengths == 17).all()                               # wrapped: full windows
    wrapped, _ = build_datasets(DataConfig(path=pc, seq_len=16, heldout_fraction=0.0,
                                           packing_strategy="wrapped"), tok)
    assert (wrapped.lengths == 17).all()
    whole_text, _ = build_datasets(DataConfig(path=text, seq_len=16, heldout_fraction=0.0,
                                              packing_strategy="bfd"), tok)
    assert (whole_text.tokens[whole_text.starts] == 1).all()


def test_long_examples_are_truncated_with_one_warning_that_counts_them(tmp_path):
    tok = make_tokenizer()
    records = prompt_completion_records(30) + [{"prompt": "a b", "completion": " ".join(["c"] * 30)}] * 3
    pc = write_jsonl(tmp_path / "pc.jsonl", records)
    with pytest.warns(UserWarning, match=r"3 of 33 train examples are longer than seq_len\+1 = 17 tokens") as rec:
        train, _ = build_datasets(DataConfig(path=pc, seq_len=16, heldout_fraction=0.0), tok)
    assert len([w for w in rec if "truncated" in str(w.message)]) == 1 and train.num_truncated == 3


@pytest.mark.parametrize("packing", ["masked", "causal"])
def test_collate_pads_whole_example_rows_without_an_attention_mask(tmp_path, packing):
    tok = make_tokenizer()
    pc = write_jsonl(tmp_path / "pc.jsonl", prompt_completion_records(40))
    train, _ = build_datasets(DataConfig(path=pc, seq_len=16, heldout_fraction=0.0, packing=packing), tok)
    short = [r for r in range(len(train)) if int(train.lengths[r]) < 16]
    assert short
    batch = collate(train, short[:4], pad_id=0)
    assert batch.attention_mask is None
    for b, r in enumerate(short[:4]):
        n = int(train.lengths[r])
        assert (batch.labels[b, n - 1:] == IGNORE_INDEX).all()          # padding (and its edge) untrained
        if packing == "masked":
            # positions restart at each example and at the padding, a document of its own
            starts = torch.nonzero(train.doc_starts[int(train.starts[r]):int(train.starts[r]) + n]).flatten()
            assert (batch.position_ids[b, starts] == 0).all() and batch.position_ids[b, n] == 0
            assert batch.position_ids[b, n:].tolist() == list(range(16 - n))
        else:
            assert batch.position_ids is None


def test_masked_whole_example_rows_train_like_each_example_alone():
    model = build_reference(make_loaded("llama")).eval()
    batch, alone = whole_example_batch(model)
    assert batch.attention_mask is None and batch.position_ids is not None
    with torch.no_grad():
        use_packed_attention(model)
        packed = per_token_losses(model, batch)                             # [N, S]
    keep = batch.labels != IGNORE_INDEX
    assert torch.equal(keep, ~alone.isnan())
    torch.testing.assert_close(packed[keep], alone[keep], rtol=1e-5, atol=1e-6)


def whole_example_batch(model, seq_len: int = 24) -> tuple[Batch, torch.Tensor]:
    """A collated batch of padded whole-example rows, and [N, S] each example's losses alone
    under ``model`` (NaN where no label)."""
    examples = [TokenizedExample(e.ids, [True] * len(e.ids), e.where) for e in random_examples(12, 14, seed=3)]
    rows = pack_whole(examples, seq_len)
    ds = TokenDataset.from_rows(rows, seq_len, True, document_mask=True)
    assert int(ds.lengths.min()) < seq_len + 1                             # some rows are padded
    with torch.no_grad():
        alone = []
        for r in range(len(ds)):
            docs = [torch.tensor(p) for p in row_pieces(rows, r)]
            pad = seq_len - sum(len(p) for p in docs)
            alone.append(torch.cat([alone_losses(model, docs)[:seq_len], torch.full((max(pad, 0),), float("nan"))]))
    return collate(ds, range(len(ds)), pad_id=0), torch.stack(alone)     # Batch, [N, S]


@pytest.mark.slow
def test_slide_engine_trains_padded_whole_example_rows_like_the_reference():
    """Slide mode on padded whole-example rows: each example's eval loss is its loss alone, and
    training steps follow the HF reference with the same mask."""
    loaded = make_loaded("llama", tied=True)
    reference = build_reference(loaded)
    batch, alone = whole_example_batch(reference.eval())
    use_packed_attention(loaded.split.model)
    use_packed_attention(reference)
    rt = RuntimeConfig(mode="slide", dtype="fp32", device="cpu", head_chunk_tokens=16, chunk_mb=1)
    engine = build_engine(loaded, rt, AdamWConfig(lr=1e-3, eps=1e-6))
    try:
        keep = batch.labels != IGNORE_INDEX
        docs = batch.document_ids()
        for b in range(batch.labels.shape[0]):
            for doc in docs[b].unique().tolist():
                select = keep[b] & (docs[b] == doc)
                if not select.any():
                    continue                                              # the padding
                labels = torch.full_like(batch.labels, IGNORE_INDEX)
                labels[b] = torch.where(select, batch.labels[b], IGNORE_INDEX)
                loss, n = engine.eval_loss(Batch(batch.input_ids, labels, None, batch.position_ids))
                assert n == int(select.sum())
                assert loss == pytest.approx(float(alone[b][select].sum()), rel=1e-5, abs=1e-6), (b, doc)
        trainer = ReferenceTrainer(reference.train(), lr=1e-3, eps=1e-6)
        for step in range(2):
            want, _ = _reference_step(trainer, batch)
            assert engine.train_step([batch], 1e-3).loss == pytest.approx(want, rel=1e-5), step
    finally:
        engine.close()


def test_batches_depend_only_on_seed_and_index(tmp_path):
    tok = make_tokenizer()
    pc = write_jsonl(tmp_path / "pc.jsonl", prompt_completion_records(80))
    cfg = DataConfig(path=pc, seq_len=16, heldout_fraction=0.1, seed=5)
    first = BatchSampler(build_datasets(cfg, tok)[0], 4, seed=5, pad_id=0)
    second = BatchSampler(build_datasets(cfg, tok)[0], 4, seed=5, pad_id=0)
    for k in (0, 3, len(first) + 1):          # the second epoch too
        a, b = first.batch(k), second.batch(k)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
        assert torch.equal(a.position_ids, b.position_ids)
