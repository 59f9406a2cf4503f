"""The techniques scenario's tokenized dataset file: safetensors, exact round trip, and an old
torch.save'd (pickle) file refused without ever being unpickled."""
import argparse
import pickle
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from slidetune.bench.baselines import hf_train
from slidetune.bench.baselines.hf_train import (DatasetFileError, TechniqueSpec, load_datasets,
                                                 save_datasets)
from slidetune.data import TokenDataset, collate


def _split(n_rows: int, seq_len: int, seed: int, split: str) -> TokenDataset:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, seq_len + 2, (n_rows,), generator=g).to(torch.int64)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]]) if n_rows else lengths
    total = int(lengths.sum())
    return TokenDataset(tokens=torch.randint(0, 49152, (total,), generator=g, dtype=torch.int32),
                        targets=torch.rand(total, generator=g) > 0.3, starts=starts, lengths=lengths,
                        seq_len=seq_len, packed=False, split=split, source="<builtin corpus> é ✓",
                        format="chat", num_examples=n_rows + 3, num_truncated=2, num_dropped=1)


def _data(seq_len=16):
    return _split(23, seq_len, 0, "train"), _split(5, seq_len, 1, "heldout"), 7


def _assert_same(a: TokenDataset, b: TokenDataset):
    for f in fields(TokenDataset):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), f.name
        else:
            assert type(x) is type(y) and x == y, f.name


def test_round_trip_is_exact(tmp_path):
    train, heldout, pad = _data()
    path = save_datasets(tmp_path / "sub" / "corpus.safetensors", train, heldout, pad)
    assert path == tmp_path / "sub" / "corpus.safetensors" and path.exists()
    assert [p.name for p in path.parent.iterdir()] == ["corpus.safetensors"]      # no temporary left
    train2, heldout2, pad2 = load_datasets(path)
    _assert_same(train, train2)
    _assert_same(heldout, heldout2)
    assert pad2 == pad and type(pad2) is int
    rows = list(range(len(train)))
    b1, b2 = collate(train, rows, pad), collate(train2, rows, pad2)
    assert torch.equal(b1.input_ids, b2.input_ids) and torch.equal(b1.labels, b2.labels)
    # also a plain safetensors file: readable by any safetensors reader
    import safetensors.torch
    assert set(safetensors.torch.load_file(path)) == {f"{s}.{k}" for s in ("train", "heldout")
                                                     for k in ("tokens", "targets", "starts", "lengths")}


def test_round_trip_empty_split(tmp_path):
    train, _, pad = _data()
    empty = TokenDataset.empty(16, True, split="heldout")
    train2, heldout2, _ = load_datasets(save_datasets(tmp_path / "c.safetensors", train, empty, pad))
    _assert_same(train, train2)
    _assert_same(empty, heldout2)


def test_hf_train_reads_the_file(tmp_path):
    train, heldout, pad = _data()
    path = save_datasets(tmp_path / "c.safetensors", train, heldout, pad)
    spec = TechniqueSpec.from_dict(dict(seq_len=16, batch_size=4, dataset_path=str(path)))
    batch, heldout_batches = hf_train._data(spec, vocab=49152)
    g = torch.Generator().manual_seed(spec.workload.seed * 1_000_003 + 3)
    rows = torch.randint(0, len(train), (4,), generator=g).tolist()
    want, got = collate(train, rows, pad), batch(3)
    assert torch.equal(want.input_ids, got.input_ids) and torch.equal(want.labels, got.labels)
    assert sum(b.input_ids.shape[0] for b in heldout_batches()) == len(heldout)


class _Payload:
    """Unpickling this creates `marker`: proof that a file was unpickled."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _forbid_unpickling(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a dataset file was unpickled")
    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)


def _malicious(tmp_path, name):
    marker = tmp_path / f"{name}.marker"
    path = tmp_path / name
    torch.save((_Payload(marker), None, 0), path)
    return path, marker


def test_the_payload_works_when_unpickled(tmp_path):
    """Control: the crafted file does create its marker when unpickled, so the refusals below mean something."""
    path, marker = _malicious(tmp_path, "control.pt")
    torch.load(path, weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("name", ["old.pt", "renamed.safetensors"])
def test_pickle_file_refused_without_unpickling(tmp_path, monkeypatch, name):
    path, marker = _malicious(tmp_path, name)
    _forbid_unpickling(monkeypatch)
    with pytest.raises(DatasetFileError, match="regenerate") as e:
        load_datasets(path)
    assert ("pickle" in str(e.value)) and ".safetensors" in str(e.value)
    with pytest.raises(DatasetFileError):
        hf_train._data(TechniqueSpec.from_dict(dict(seq_len=16, dataset_path=str(path))), vocab=49152)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["old.pt", "renamed.safetensors"])
def test_techniques_refuses_a_pickle_dataset(tmp_path, monkeypatch, name):
    from slidetune.bench.scenarios import techniques
    path, marker = _malicious(tmp_path, name)
    before = path.read_bytes()
    _forbid_unpickling(monkeypatch)
    monkeypatch.setattr(hf_train, "corpus_datasets", lambda *a, **k: pytest.fail("should not tokenize"))
    with pytest.raises(SystemExit, match="regenerate"):
        techniques._dataset(tmp_path / "out", {"seq_len": 16}, path)
    assert not marker.exists()
    assert path.read_bytes() == before                  # refused, not overwritten either


def test_techniques_refuses_a_missing_pt_path(tmp_path, monkeypatch):
    """A new file is never written under the pickle-era name."""
    from slidetune.bench.scenarios import techniques
    monkeypatch.setattr(hf_train, "corpus_datasets", lambda *a, **k: pytest.fail("should not tokenize"))
    with pytest.raises(SystemExit, match=r"\.safetensors"):
        techniques._dataset(tmp_path, {"seq_len": 16}, tmp_path / "new.pt")
    assert not (tmp_path / "new.pt").exists()


def test_techniques_dataset_writes_then_reads(tmp_path, monkeypatch):
    from slidetune.bench.scenarios import techniques
    calls = []

    def fake_corpus(seq_len, seed=0):
        calls.append(seq_len)
        return _data(seq_len)
    monkeypatch.setattr(hf_train, "corpus_datasets", fake_corpus)
    # no --dataset: a temporary file in OUT, ours to delete
    path, temporary = techniques._dataset(tmp_path, {"seq_len": 16}, None)
    assert path == tmp_path / ".corpus-s16.safetensors" and temporary and path.exists()
    # --dataset that does not exist: written there, kept; then read (not tokenized again)
    given = tmp_path / "carry" / "corpus-s16.safetensors"
    assert techniques._dataset(tmp_path, {"seq_len": 16}, given) == (given, False)
    assert techniques._dataset(tmp_path, {"seq_len": 16}, given) == (given, False)
    assert calls == [16, 16]
    _assert_same(load_datasets(given)[0], _data()[0])
    with pytest.raises(SystemExit, match="holds seq 16, not 32"):
        techniques._dataset(tmp_path, {"seq_len": 32}, given)


def test_other_safetensors_files_refused(tmp_path):
    import safetensors.torch
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file({"w": torch.zeros(2)}, path)
    with pytest.raises(DatasetFileError, match="not a slidetune dataset file"):
        load_datasets(path)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(DatasetFileError, match="not a safetensors file"):
        load_datasets(tmp_path / "junk.safetensors")


def test_dataset_help_names_the_format():
    from slidetune.bench.scenarios import techniques
    p = argparse.ArgumentParser()
    techniques.add_arguments(p)
    assert ".safetensors" in p.format_help()
