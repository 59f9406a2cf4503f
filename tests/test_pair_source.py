"""A preference run's data (data/pair_source.py): records from JSONL, `datasets` and Python read
into pairs (errors naming the line), tokenized and cut as TRL's, held out by the SFT run's
permutation, and a step's whole pairs drawn by epochs."""
from __future__ import annotations

import json

import pytest
import torch

from slidetune.data import DataError
from slidetune.data.config import DataConfig
from slidetune.data.pair_source import build_pairs, read_pairs, step_pairs
from slidetune.data.split import plan_heldout
from test_data import make_tokenizer

WORDS = "abcdefgh"


def write_pairs(path, n: int, bad_line: int | None = None) -> None:
    lines = []
    for i in range(n):
        w = WORDS[i % 8]
        record = {"prompt": f"{w} {w}", "chosen": f" a b {w}", "rejected": f" c {w}"}
        if i + 1 == bad_line:
            del record["rejected"]
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")


def test_jsonl_pairs_are_read_and_a_bad_record_is_named(tmp_path):
    f = tmp_path / "pairs.jsonl"
    write_pairs(f, 5)
    pairs = read_pairs(str(f))
    assert len(pairs) == 5 and pairs[0].where == f"{f}:1"
    write_pairs(f, 5, bad_line=4)
    with pytest.raises(DataError, match=rf"{f}:4: .*rejected"):
        read_pairs(str(f))
    (tmp_path / "plain.txt").write_text("some text\n")
    with pytest.raises(DataError, match="not plain text"):
        read_pairs(str(tmp_path / "plain.txt"))


def test_pairs_through_datasets_and_from_python(tmp_path):
    import datasets
    rows = [{"prompt": "a b", "chosen": " c", "rejected": " d"}] * 3
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    pairs = read_pairs(str(tmp_path / "ds"))
    assert len(pairs) == 3 and pairs[2].where == f"{tmp_path / 'ds'} row 3"
    tok = make_tokenizer()
    data = build_pairs(DataConfig(seq_len=16, heldout_fraction=0.0), tok, records=rows)
    assert len(data.train) == 3 and data.heldout == []


def test_build_holds_out_the_sft_permutations_pairs_and_cuts_to_seq_len(tmp_path):
    f = tmp_path / "pairs.jsonl"
    write_pairs(f, 40)
    tok = make_tokenizer()
    cfg = DataConfig(path=str(f), seq_len=16, heldout_fraction=0.1, seed=3)
    data = build_pairs(cfg, tok)
    train_idx, held_idx, note = plan_heldout(40, 0.1, 3, str(f))
    assert note is None and len(data.train) == len(train_idx) and len(data.heldout) == len(held_idx) == 4
    assert [p.where for p in data.heldout] == [f"{f}:{i + 1}" for i in held_idx]
    assert data.max_length == 16
    # a cut that the prompt fills leaves the pair out; none left is refused naming the source
    with pytest.raises(DataError, match="no pair is left to train on"):
        build_pairs(DataConfig(path=str(f), seq_len=2, heldout_fraction=0.0), tok)
    with pytest.raises(DataError, match="needs preference data"):
        build_pairs(DataConfig(seq_len=16), tok)


def test_steps_draw_whole_pairs_by_seeded_epochs():
    seen = [step_pairs(10, 3, s, seed=1) for s in range(6)]           # 3 steps an epoch, 1 pair left out
    assert all(len(s) == 3 for s in seen)
    assert len(set(sum(seen[:3], []))) == 9 and len(set(sum(seen[3:], []))) == 9
    assert seen[:3] != seen[3:]                                      # a new permutation each epoch
    assert step_pairs(10, 3, 4, seed=1) == seen[4]                   # a resumed run draws the same
    with pytest.raises(DataError, match="cannot fill a batch of 11 pairs"):
        step_pairs(10, 11, 0, seed=1)


def test_each_rank_takes_its_whole_pairs_of_the_global_step(tmp_path):
    """Data parallel: 2 ranks at 2 pairs a micro-batch take, between them, the micro-batches of one
    rank at 4 (rank r the r-th 2 pairs of each), each normalized by the global step's counts."""
    from slidetune.data.pair_source import PairSampler
    from slidetune.objectives.preference import PreferenceConfig
    f = tmp_path / "pairs.jsonl"
    write_pairs(f, 40)
    data = build_pairs(DataConfig(path=str(f), seq_len=16, heldout_fraction=0.0), make_tokenizer())
    cfg = PreferenceConfig("simpo")          # an NLL term: its tokens' count is the step's too
    one = PairSampler(data, cfg, 4, 2, seed=5, pad_id=0).step_batches(3)
    ranks = [PairSampler(data, cfg, 2, 2, seed=5, pad_id=0, world_size=2, rank=r).step_batches(3) for r in (0, 1)]
    assert len(one) == len(ranks[0]) == len(ranks[1]) == 2
    for j, whole in enumerate(one):
        parts = [ranks[r][j] for r in (0, 1)]
        # a micro-batch's rows: its chosen, then its rejected; rank 0's pairs first, then rank 1's
        chosen = torch.cat([p.input_ids[:2] for p in parts])
        rejected = torch.cat([p.input_ids[2:] for p in parts])
        assert torch.equal(torch.cat([chosen, rejected]), whole.input_ids)
        for p in parts:
            assert p.pairs.pairs_in_step == whole.pairs.pairs_in_step == 8
            assert p.pairs.nll_tokens_in_step == whole.pairs.nll_tokens_in_step > 0
    assert len(PairSampler(data, cfg, 2, 2, 5, 0, world_size=2, rank=1)) == len(data.train) // 4
    with pytest.raises(DataError, match=r"a step of 48 pairs \(--batch-size 4 x --grad-accum 6 x 2 ranks\)"):
        PairSampler(data, cfg, 4, 6, 5, 0, world_size=2, rank=0)
