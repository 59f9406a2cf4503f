"""`datasets` as the data layer: parquet, CSV, JSON lines and save_to_disk data train; --eval-data is what
is evaluated; a streamed corpus is read a chunk at a time, never whole; tokenized data is kept between runs.

The runs are 2-step `slidetune train` runs of a 2-layer Llama with a 320-id BPE tokenizer (test_hub_ids),
with every HF cache in a temporary directory and HF_HUB_OFFLINE=1.
"""
from __future__ import annotations

import csv
import json
import math
import tracemalloc
from pathlib import Path

import pytest
import torch

from slidetune.data import BatchSampler, DataConfig, build_datasets
from slidetune.data import hf_datasets, streaming, token_cache
from slidetune.data.build import load_source
from slidetune.data.errors import DataError
from slidetune.data.hf_datasets import StreamingSource, should_stream
from test_hub_ids import TRAIN, save_tiny_model
from test_train_errors import run_cli

TOPICS = ["the moon", "a river", "fresh bread", "an old violin", "winter mornings", "the ocean"]


def records(n: int, start: int = 0) -> list[dict]:
    return [{"prompt": f"On {TOPICS[i % len(TOPICS)]}:", "completion": f" {i} is quiet."}
            for i in range(start, start + n)]


def paragraphs(n: int, words: int = 12) -> list[dict]:
    return [{"text": f"Paragraph {i}. " + " ".join(f"{TOPICS[(i + k) % len(TOPICS)]} {k}" for k in range(words))}
            for i in range(n)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("model")
    save_tiny_model(d)
    return d


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(autouse=True)
def hf_caches(tmp_path, monkeypatch) -> Path:
    """Every HF cache in this test's directory; nothing may reach the Hub."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf"


def train(model_dir: Path, data: Path | str, out: Path, *extra: str) -> dict:
    code, stdout, err = run_cli("--model", str(model_dir), "--data", str(data), *TRAIN, "--output-dir", str(out),
                                *extra)
    assert code == 0, (stdout[-2000:], err[-3000:])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and math.isfinite(summary["last_loss"])
    return summary


def eval_losses(out: Path) -> list[float]:
    with (out / "metrics.csv").open(newline="") as f:
        return [float(r["eval_loss"]) for r in csv.DictReader(f) if r["eval_loss"]]


# ----------------------------------------------------------------------------- the formats train
def _parquet_dir(root: Path) -> Path:
    import datasets
    d = root / "pq"
    d.mkdir()
    datasets.Dataset.from_list(records(40)).to_parquet(str(d / "train.parquet"))
    return d


def _csv(root: Path) -> Path:
    import datasets
    datasets.Dataset.from_list(records(40)).to_csv(str(root / "train.csv"), index=False)
    return root / "train.csv"


def _jsonl_dir(root: Path) -> Path:
    d = root / "jsonl"
    d.mkdir()
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records(40)))
    return d


def _save_to_disk(root: Path) -> Path:
    import datasets
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records(40)),
                          "test": datasets.Dataset.from_list(records(6, start=500))}).save_to_disk(str(root / "disk"))
    return root / "disk"


@pytest.mark.slow
@pytest.mark.parametrize("make", [_parquet_dir, _csv, _jsonl_dir, _save_to_disk],
                         ids=["parquet_dir", "csv", "jsonl_dir", "save_to_disk"])
def test_each_datasets_format_trains(make, model_dir, tokenizer, tmp_path):
    data = make(tmp_path)
    source = load_source(DataConfig(path=str(data)))
    assert source.format == "prompt_completion" and len(source.examples) == 40      # the train split
    assert source.examples[0].where == f"{data} row 1"
    summary = train(model_dir, data, tmp_path / "run")
    assert summary["heldout_sequences"] > 0 and math.isfinite(summary["eval_loss_after"])


def test_a_record_of_no_known_format_names_its_row(tmp_path, tokenizer):
    import datasets
    rows = records(5) + [{"prompt": None, "completion": None}]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "bad.parquet"))
    with pytest.raises(ValueError, match=rf"{tmp_path / 'bad.parquet'} row 6: 'prompt' must be a string"):
        build_datasets(DataConfig(path=str(tmp_path / "bad.parquet")), tokenizer)


@pytest.mark.slow
# ----------------------------------------------------------------------------- --eval-data
def test_eval_data_is_what_is_evaluated(model_dir, tokenizer, tmp_path):
    import datasets
    train_file = tmp_path / "train.jsonl"
    train_file.write_text("".join(json.dumps(r) + "\n" for r in records(40)))
    datasets.Dataset.from_list(records(8, start=1000)).to_parquet(str(tmp_path / "eval.parquet"))
    cfg = DataConfig(path=str(train_file), eval_path=str(tmp_path / "eval.parquet"), seq_len=16)
    train_ds, heldout = build_datasets(cfg, tokenizer, min_rows=2)
    assert train_ds.num_examples == 40                          # no held-out split taken from --data
    assert heldout.num_examples == 8 and heldout.source == str(tmp_path / "eval.parquet")
    own = build_datasets(DataConfig(path=str(train_file), seq_len=16), tokenizer, min_rows=2)[1]
    assert own.num_examples == 2 and not torch.equal(own.tokens, heldout.tokens)

    out = tmp_path / "run"
    summary = train(model_dir, train_file, out, "--eval-data", str(tmp_path / "eval.parquet"))
    assert summary["heldout_sequences"] == len(heldout) and summary["train_sequences"] == len(train_ds)
    assert len(eval_losses(out)) == 2 and all(map(math.isfinite, eval_losses(out)))
    assert json.loads((out / "config.json").read_text())["data"]["eval_path"] == str(tmp_path / "eval.parquet")


# ----------------------------------------------------------------------------- streaming
def _peak_python_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.slow
def test_streaming_reads_a_chunk_at_a_time_and_trains(model_dir, tokenizer, tmp_path, monkeypatch):
    """A 1000-record corpus (parquet, row groups of 100 records) read 16 records at a time: the tokenizer
    never sees more, and the read's peak of Python objects is a small part of what reading it whole takes;
    the token file it writes trains, and a second run reads that file without reading a record."""
    import datasets
    corpus = tmp_path / "corpus.parquet"
    datasets.Dataset.from_list(paragraphs(1000, words=10)).to_parquet(str(corpus), batch_size=100)
    # the RAM cap: "auto" streams a source larger than STREAM_RAM_SHARE of the available RAM
    monkeypatch.setattr(hf_datasets, "STREAM_RAM_SHARE", 0.5 * corpus.stat().st_size / hf_available())
    assert should_stream(str(corpus), "auto")
    monkeypatch.setattr(hf_datasets, "STREAM_CHUNK_RECORDS", 16)
    seen = _count_tokenized(monkeypatch, streaming)
    cfg = DataConfig(path=str(corpus), seq_len=16, cache_dir=str(tmp_path / "cache"))
    source = load_source(cfg)
    assert isinstance(source, StreamingSource) and not hasattr(source, "examples")
    splits: list = []
    peak = _peak_python_bytes(lambda: splits.extend(build_datasets(cfg, tokenizer, min_rows=2, source=source)))
    train_ds, heldout = splits
    assert sum(seen) == 1000 and max(seen) == 16 and len(seen) == 63
    whole = DataConfig(path=str(corpus), seq_len=16, streaming="off", cache_dir="off")
    peak_whole = _peak_python_bytes(lambda: build_datasets(whole, tokenizer, min_rows=2))
    assert peak * 10 < peak_whole, (peak, peak_whole)
    assert len(train_ds) > 100 and len(heldout) > 0 and train_ds.document_mask
    files = list((tmp_path / "cache").glob("stream-*.bin"))
    assert len(files) == 1 and not list((tmp_path / "cache").glob("*.tmp"))

    seen.clear()
    out = tmp_path / "run"
    summary = train(model_dir, corpus, out, "--data-cache-dir", str(tmp_path / "cache"))
    assert seen == [], "the second read tokenized again"
    assert summary["train_sequences"] == len(train_ds) and math.isfinite(summary["eval_loss_after"])


def _count_tokenized(monkeypatch, module) -> list[int]:
    """The sizes of the example lists `module` hands to tokenize_examples, call by call."""
    seen: list[int] = []
    real = module.tokenize_examples

    def counting(examples, *args):
        seen.append(len(examples))
        return real(examples, *args)

    monkeypatch.setattr(module, "tokenize_examples", counting)
    return seen


def hf_available() -> int:
    import psutil
    return psutil.virtual_memory().available


def test_streamed_prompt_data_keeps_its_prompt_mask(tokenizer, tmp_path):
    """Streamed prompt/completion rows train on the completions only, as the same data read whole and
    cut the same way (windows: a streamed corpus is never packed whole, and says so when asked to)."""
    (tmp_path / "pc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records(40)))
    whole, _ = build_datasets(DataConfig(path=str(tmp_path / "pc.jsonl"), streaming="off", seq_len=16,
                                         heldout_fraction=0, packing_strategy="wrapped"), tokenizer, min_rows=2)
    with pytest.raises(DataError, match="--packing-strategy bfd packs whole examples"):
        build_datasets(DataConfig(path=str(tmp_path / "pc.jsonl"), streaming="on", seq_len=16, heldout_fraction=0,
                                  packing_strategy="bfd", cache_dir=str(tmp_path / "c")), tokenizer, min_rows=2)
    streamed, _ = build_datasets(DataConfig(path=str(tmp_path / "pc.jsonl"), streaming="on", seq_len=16,
                                            heldout_fraction=0, cache_dir=str(tmp_path / "c")), tokenizer, min_rows=2)
    assert isinstance(streamed, streaming.MaskedTokenArrayDataset) and len(streamed) == len(whole)
    for i in range(len(whole)):
        ids, targets, starts = streamed.window(i)
        ids_w, targets_w, starts_w = whole.window(i)
        assert torch.equal(ids, ids_w) and torch.equal(targets, targets_w)
        assert torch.equal(starts[1:], starts_w[1:])       # a row's first token starts its positions either way
    assert 0 < int(sum(streamed.window(i)[1].sum() for i in range(len(streamed)))) < len(streamed) * 17


# ----------------------------------------------------------------------------- the tokenization cache
def test_second_build_reads_the_tokens_from_the_cache(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(token_cache, "CACHE_MIN_CHARS", 0)      # cache even this small a data set
    calls = _count_tokenized(monkeypatch, token_cache)
    data = _parquet_dir(tmp_path)
    cfg = DataConfig(path=str(data), seq_len=16, cache_dir=str(tmp_path / "cache"))
    first = build_datasets(cfg, tokenizer, min_rows=2)
    assert sorted(calls) == [2, 38] and len(list((tmp_path / "cache").glob("tokens-*.npz"))) == 2
    calls.clear()
    second = build_datasets(cfg, tokenizer, min_rows=2)
    assert calls == [], "tokenized again"
    for a, b in zip(first, second):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.targets, b.targets) and torch.equal(a.starts, b.starts)
    # batch k is a function of (seed, k) alone: the same from cached tokens, as a resumed run needs
    samplers = [BatchSampler(split[0], 2, seed=3, pad_id=0) for split in (first, second)]
    for k in (0, 5, 40):
        a, b = (s.batch(k) for s in samplers)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    # what the tokens depend on is in the key: the prompt mask, the tokenizer's chat template, the content
    build_datasets(DataConfig(path=str(data), seq_len=16, cache_dir=str(tmp_path / "cache"), mask_prompt=False),
                   tokenizer, min_rows=2)
    assert sorted(calls) == [2, 38]
    calls.clear()
    build_datasets(DataConfig(path=str(data), seq_len=16, cache_dir="off"), tokenizer, min_rows=2)
    assert sorted(calls) == [2, 38] and len(list((tmp_path / "cache").glob("tokens-*.npz"))) == 4


def test_small_data_is_not_cached(tokenizer, tmp_path):
    data = _parquet_dir(tmp_path)
    build_datasets(DataConfig(path=str(data), seq_len=16, cache_dir=str(tmp_path / "cache")), tokenizer, min_rows=2)
    assert not (tmp_path / "cache").exists()       # under CACHE_MIN_CHARS: tokenizing is cheaper than a file


def _damage(entry: Path, how: str) -> None:
    """Flipped bytes in the ids' data (the zip's CRC no longer matches), the file cut in half, or a
    valid zip whose ids were changed under the digest stored with them."""
    import numpy as np
    raw = bytearray(entry.read_bytes())
    if how == "flipped bytes":
        at = raw.find(b"\x93NUMPY") + 128 + 8        # the first array's (ids') data: np.savez stores, no deflate
        raw[at:at + 4] = bytes(b ^ 0xFF for b in raw[at:at + 4])
        entry.write_bytes(bytes(raw))
    elif how == "truncated":
        entry.write_bytes(bytes(raw[:len(raw) // 2]))
    else:
        with np.load(entry) as z:
            arrays = {k: z[k] for k in z.files}
        arrays["ids"] = arrays["ids"][::-1].copy()     # the same tokens in another order: only a digest tells
        with open(entry, "wb") as f:
            np.savez(f, **arrays)


@pytest.mark.parametrize("how", ["flipped bytes", "truncated", "digest does not match"])
def test_a_damaged_cache_entry_is_tokenized_again_and_rewritten(tokenizer, tmp_path, monkeypatch, capsys, how):
    """A cache is only a cache: a damaged entry is deleted with a note naming it, the data tokenized
    again to what a fresh tokenization gives, and the entry written anew (the run after reads it)."""
    monkeypatch.setattr(token_cache, "CACHE_MIN_CHARS", 0)
    calls = _count_tokenized(monkeypatch, token_cache)
    cfg = DataConfig(path=str(_parquet_dir(tmp_path)), seq_len=16, cache_dir=str(tmp_path / "cache"))
    fresh = build_datasets(cfg, tokenizer, min_rows=2)
    entry = max((tmp_path / "cache").glob("tokens-*.npz"), key=lambda p: p.stat().st_size)    # the train split's
    _damage(entry, how)
    calls.clear()
    capsys.readouterr()
    again = build_datasets(cfg, tokenizer, min_rows=2)
    assert calls == [38], "the damaged entry (and only it) is tokenized again"
    assert f"note: token cache entry {entry} discarded (" in capsys.readouterr().err
    for a, b in zip(fresh, again):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.targets, b.targets) and torch.equal(a.starts, b.starts)
    assert token_cache._read(entry)[1] == ""                                  # rewritten whole
    assert not list((tmp_path / "cache").glob("*.tmp*"))
    calls.clear()
    build_datasets(cfg, tokenizer, min_rows=2)
    assert calls == [] and "token cache entry" not in capsys.readouterr().err
