"""A streamed source's token files are a cache like any other (issue 51): an entry records its token count
and a digest of each file, is checked when it is opened, and one that is damaged is discarded with a note
naming it and rebuilt to what a fresh build gives; a good one is reused without reading a record.

Built from a 40-record JSON lines file streamed with test_hub_ids' 320-id BPE tokenizer.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from slidetune.data import DataConfig, build_datasets, streaming
from test_data_hf import _count_tokenized, records

FRESH_NOTE = "note: streamed token cache entry"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from test_hub_ids import save_tiny_model
    from transformers import AutoTokenizer
    d = tmp_path_factory.mktemp("model")
    save_tiny_model(d)
    return AutoTokenizer.from_pretrained(str(d))


@pytest.fixture
def cfg(tmp_path, monkeypatch) -> DataConfig:
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "pc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records(40)))
    return DataConfig(path=str(data), streaming="on", seq_len=16, cache_dir=str(tmp_path / "cache"))


def _entry(cfg: DataConfig) -> Path:
    (file,) = Path(cfg.cache_dir).glob("stream-*.bin")
    return file


def _windows(splits) -> list[list]:
    """Every window of (train, heldout), copied: the files under a dataset's memory maps change below."""
    return [[tuple(x.clone() if x is not None else None for x in ds.window(i)) for i in range(len(ds))]
            for ds in splits]


def _same(a: list[list], b: list[list]) -> None:
    assert [len(s) for s in a] == [len(s) for s in b]
    for wa, wb in zip((w for s in a for w in s), (w for s in b for w in s)):
        for x, y in zip(wa, wb):
            assert (x is None and y is None) or torch.equal(x, y)


def _damage(file: Path, how: str) -> None:
    """Bytes of the ids flipped, the ids cut in half, the mask inverted (a valid mask: only its digest
    tells), another digest recorded for the ids, or the record removed."""
    if how == "flipped bytes":
        raw = bytearray(file.read_bytes())
        at = len(raw) // 8 * 4
        raw[at:at + 4] = bytes(b ^ 0xFF for b in raw[at:at + 4])
        file.write_bytes(bytes(raw))
    elif how == "truncated":
        file.write_bytes(file.read_bytes()[:file.stat().st_size // 8 * 4])
    elif how == "mask changed":
        targets = file.with_suffix(".targets")
        targets.write_bytes(bytes(1 - b for b in targets.read_bytes()))
    elif how == "digest does not match":
        record_file = file.with_suffix(".json")
        record = json.loads(record_file.read_text())
        record["ids_xxh3_128"] = "0" * 32
        record_file.write_text(json.dumps(record))
    else:
        file.with_suffix(".json").unlink()


@pytest.mark.parametrize("how", ["flipped bytes", "truncated", "mask changed", "digest does not match",
                                 "record missing"])
def test_a_damaged_streamed_entry_is_discarded_and_rebuilt(tokenizer, cfg, monkeypatch, capsys, how):
    seen = _count_tokenized(monkeypatch, streaming)
    fresh = _windows(build_datasets(cfg, tokenizer, min_rows=2))
    file = _entry(cfg)
    _damage(file, how)
    seen.clear()
    capsys.readouterr()
    again = _windows(build_datasets(cfg, tokenizer, min_rows=2))
    assert f"{FRESH_NOTE} {file} discarded (" in capsys.readouterr().err
    assert sum(seen) == 40, "the source is streamed and tokenized again"
    _same(fresh, again)
    assert streaming._check(file) == ""                                   # rebuilt whole, its record too
    assert not list(Path(cfg.cache_dir).glob("*.tmp"))
    seen.clear()
    build_datasets(cfg, tokenizer, min_rows=2)
    assert seen == [] and FRESH_NOTE not in capsys.readouterr().err


def test_a_good_streamed_entry_is_reused_and_hashed_as_it_is_written(tokenizer, cfg, monkeypatch, capsys):
    """The record holds the files' length and digests, computed while writing (no pass over the files
    then); a second build checks them once and reads no record."""
    import xxhash
    seen = _count_tokenized(monkeypatch, streaming)
    hashed: list[str] = []
    real = streaming._file_digest
    monkeypatch.setattr(streaming, "_file_digest", lambda path: hashed.append(path.suffix) or real(path))
    fresh = _windows(build_datasets(cfg, tokenizer, min_rows=2))
    assert sum(seen) == 40 and hashed == []
    file = _entry(cfg)
    record = json.loads(file.with_suffix(".json").read_text())
    ids, targets = np.fromfile(file, dtype=np.uint32), file.with_suffix(".targets").read_bytes()
    assert record["tokens"] == ids.shape[0] == len(targets) and record["examples"] == 40
    assert record["ids_xxh3_128"] == xxhash.xxh3_128(ids.tobytes()).hexdigest()
    assert record["targets_xxh3_128"] == xxhash.xxh3_128(targets).hexdigest()
    before = {p.name: p.stat().st_mtime_ns for p in Path(cfg.cache_dir).iterdir()}
    seen.clear()
    capsys.readouterr()
    again = _windows(build_datasets(cfg, tokenizer, min_rows=2))
    assert seen == [] and hashed == [".bin", ".targets"] and FRESH_NOTE not in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in Path(cfg.cache_dir).iterdir()} == before
    _same(fresh, again)
