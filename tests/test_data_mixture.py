"""Several data sources mixed with weights (data/mixture.py, issue 48): `--data a.jsonl:0.7,b.jsonl:0.3`
draws the sources' rows in the weights' proportions, deterministically (a resumed run draws the
same rows), each source holding out its own share; bad specifications refused by name."""
from __future__ import annotations

import json

import pytest
import torch

from slidetune.data import BatchSampler, DataConfig, DataError, build_datasets
from slidetune.data.mixture import epoch_counts, interleave, parse_mixture
from test_data import tok, write_jsonl  # noqa: F401 (a fixture)
from test_train_errors import run_cli


def test_a_specification_names_each_source_and_its_weight():
    assert parse_mixture("a.jsonl") is None and parse_mixture(None) is None
    assert parse_mixture("C:/data/a.jsonl") is None                    # a colon in a single path
    assert parse_mixture("a.jsonl:0.7, dir/b:0.3") == [("a.jsonl", pytest.approx(0.7)), ("dir/b", pytest.approx(0.3))]
    assert parse_mixture("a.jsonl:7,b.jsonl:3")[0][1] == pytest.approx(0.7)     # normalized
    for bad in ("a.jsonl:0.7,b.jsonl", "a.jsonl:0.7,b.jsonl:x", "a.jsonl:0,b.jsonl:1", ":1,b:1"):
        with pytest.raises(DataError, match="is not PATH:WEIGHT"):
            parse_mixture(bad)


def test_the_interleaving_holds_every_run_of_rows_to_its_share():
    counts = epoch_counts([0.7, 0.2, 0.1], 997)
    assert sum(counts) == 997 and counts == [698, 199, 100]
    labels = interleave(counts)
    for s, w in enumerate((0.7, 0.2, 0.1)):
        hits = (labels == s).to(torch.int64)
        for start in range(0, 900, 53):
            for n in (n for n in (10, 97, 400) if start + n <= 997):
                got = int(hits[start:start + n].sum())
                assert abs(got - w * n) <= 1.5, (s, start, n, got)


def _sources(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": "a b c d e f g h " * 2} for _ in range(300)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "a b", "completion": "h g f e"} for _ in range(60)])
    return a, b


def test_two_sources_mixed_0_7_0_3_draw_in_those_proportions_and_resume_exactly(tmp_path, tok):
    """1,000 rows drawn: 70% / 30% within 1% though b has a fifth of a's rows (it goes round more
    often); each source holds out its own share; a sampler built again draws the same batch k."""
    a, b = _sources(tmp_path)
    cfg = DataConfig(path=f"{a}:0.7,{b}:0.3", seq_len=16, heldout_fraction=0.1, packing="off")
    train, heldout = build_datasets(cfg, tok)
    (a0, na, wa), (b0, nb, wb) = train.parts
    assert (a0, na, b0, nb) == (0, 270, 270, 54) and (wa, wb) == pytest.approx((0.7, 0.3))
    assert len(heldout) == 30 + 6 and train.source == cfg.path
    sampler = BatchSampler(train, 8, seed=5, pad_id=0)
    drawn = [r for k in range(125) for r in sampler.rows(k)]            # 1,000 rows, past one epoch
    from_a = sum(r < na for r in drawn)
    assert abs(from_a - 700) <= 10, from_a
    assert set(drawn) >= set(range(na, na + nb))                        # every b row comes round
    again = BatchSampler(train, 8, seed=5, pad_id=0)
    assert again.rows(97) == sampler.rows(97) and again.rows(3) == sampler.rows(3)
    assert BatchSampler(train, 8, seed=6, pad_id=0).rows(0) != sampler.rows(0)


def test_a_mixture_trains_and_resumes_to_the_same_weights(tmp_path):
    """`slidetune train --data a:0.7,b:0.3`, stopped after step 2 and resumed, ends where the
    uninterrupted run ends."""
    a, b = _sources(tmp_path)
    args = ["--model", "tiny-llama", "--device", "cpu", "--seq-len", "16", "--data", f"{a}:0.7,{b}:0.3",
            "--max-steps", "4", "--save-every", "2", "--batch-size", "2", "--progress", "false",
            "--skip-reference-check", "--eval-batches", "1"]
    code, out, err = run_cli(*args, "--output-dir", str(tmp_path / "whole"))
    assert code == 0, err[-3000:]
    code, out, err = run_cli(*args, "--output-dir", str(tmp_path / "stopped"), "--stop-after", "2")
    assert code == 0, err[-3000:]
    code, out, err = run_cli(*args, "--output-dir", str(tmp_path / "stopped"), "--resume", "auto")
    assert code == 0 and "resumed from" in out, err[-3000:]
    from safetensors.torch import load_file
    whole, resumed = (load_file(tmp_path / d / "final" / "model.safetensors") for d in ("whole", "stopped"))
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert summary["data_source"] == f"{a}:0.7,{b}:0.3"


def test_what_a_mixture_does_not_take_is_refused(tmp_path, tok):
    a, b = _sources(tmp_path)
    with pytest.raises(DataError, match="mixes sources, and --eval-data"):
        build_datasets(DataConfig(path=f"{a}:1,{b}:1", eval_path=a, seq_len=16), tok)
    np_path = tmp_path / "ids.npy"
    import numpy as np
    np.save(np_path, np.arange(100, dtype=np.uint32))
    with pytest.raises(DataError, match="ids.npy is pre-tokenized"):
        build_datasets(DataConfig(path=f"{a}:1,{np_path}:1", seq_len=16), tok)


def test_a_config_file_lists_a_mixture_as_path_and_weight_items(tmp_path):
    """`data:` as a list in a config file (top level or the data section's `path:`) is the same
    mixture as `--data a:0.7,b:0.3`; a malformed item is refused naming the file and the item."""
    from slidetune.config import load_yaml
    a, b = _sources(tmp_path)
    forms = {
        "top.yaml": f"data:\n  - {{path: '{a}', weight: 0.7}}\n  - {{path: '{b}', weight: 0.3}}\n",
        "section.yaml": f"data:\n  path:\n    - {{path: '{a}', weight: 0.7}}\n    - '{b}:0.3'\n",
    }
    for name, text in forms.items():
        (tmp_path / name).write_text(text)
        assert load_yaml(tmp_path / name)["data"]["path"] == f"{a}:0.7,{b}:0.3", name
    assert parse_mixture(load_yaml(tmp_path / "top.yaml")["data"]["path"]) == [(str(a), 0.7), (str(b), 0.3)]
    bad = {
        "one.yaml": (f"data:\n  - {{path: '{a}', weight: 1}}\n", "at least two items"),
        "noweight.yaml": (f"data:\n  - '{a}'\n  - '{b}:1'\n", r"data item 1 \(.*\) has no weight"),
        "zero.yaml": (f"data:\n  - {{path: '{a}', weight: 0}}\n  - '{b}:1'\n", "data item 1 .* weight 0 must be"),
        "keys.yaml": (f"data:\n  - {{file: '{a}', weight: 1}}\n  - '{b}:1'\n", r"data item 1 .* is not \{path"),
        "comma.yaml": (f"data:\n  - {{path: 'x,y', weight: 1}}\n  - '{b}:1'\n", "without a comma"),
    }
    for name, (text, message) in bad.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=f"{name}.*{message}"):
            load_yaml(tmp_path / name)
