"""Pre-tokenized corpora (.bin, .npy, a save_to_disk directory of input_ids) read memory-mapped:
windows, document boundaries from EOS, the held-out tail, resume on the same batch, errors."""
from __future__ import annotations

import json
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from slidetune.data import BatchSampler, DataConfig, DataError, build_datasets
from slidetune.data.batch import IGNORE_INDEX
from slidetune.data.token_arrays import TokenArrayDataset, TokenStream

EOS = 2
TOKENIZER = types.SimpleNamespace(eos_token_id=EOS, bos_token_id=None)


def corpus(n_docs: int = 40, seed: int = 0) -> np.ndarray:
    """Documents of 3-20 random tokens (ids 3..999), each ending with EOS."""
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(3, 1000, rng.integers(3, 21)), EOS) for _ in range(n_docs)]
    return np.concatenate(docs)


def build(path, **kw):
    return build_datasets(DataConfig(path=str(path), **kw), TOKENIZER)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_windows_are_memory_mapped_slices(tmp_path, dtype):
    tokens = corpus()
    path = tmp_path / "train.bin"
    tokens.astype(dtype).tofile(path)
    train, heldout = build(path, seq_len=16, token_dtype=dtype, heldout_fraction=0.1)
    assert isinstance(train, TokenArrayDataset) and isinstance(train.stream.segments[0], np.memmap)
    n = (len(tokens) - 1) // 16
    assert len(train) + len(heldout) == n and len(heldout) == round(n * 0.1)
    ids, targets, starts = train.window(2)
    assert ids.tolist() == tokens[32:49].tolist() and bool(targets.all())
    assert starts[1:].tolist() == (tokens[32:48] == EOS).tolist()
    ids, _, _ = heldout.window(0)                     # the tail: right after the train windows
    assert ids.tolist() == tokens[len(train) * 16:len(train) * 16 + 17].tolist()


def test_wrong_token_dtype_is_named(tmp_path):
    path = tmp_path / "odd.bin"
    np.arange(11, dtype=np.uint8).tofile(path)        # 11 bytes: no whole number of uint16
    with pytest.raises(DataError, match="--token-dtype"):
        build(path, seq_len=4)
    with pytest.raises(ValueError, match="uint16 or uint32"):
        DataConfig(token_dtype="int8")


def test_npy_dtype_from_header_and_masked_batches(tmp_path):
    tokens = corpus().astype(np.uint32)
    path = tmp_path / "train.npy"
    np.save(path, tokens)
    train, _ = build(path, seq_len=32, heldout_fraction=0.0)
    assert train.stream.segments[0].dtype == np.uint32
    batch = BatchSampler(train, 4, seed=0, pad_id=0).batch(0)
    rows = BatchSampler(train, 4, seed=0, pad_id=0).rows(0)
    for b, r in enumerate(rows):
        window = tokens[r * 32:r * 32 + 33].astype(np.int64)
        assert batch.input_ids[b].tolist() == window[:-1].tolist()
        after_eos = np.flatnonzero(window[:-1] == EOS)          # label t predicts a new document
        assert (batch.labels[b, after_eos] == IGNORE_INDEX).all()
        assert (batch.position_ids[b, after_eos[after_eos < 31] + 1] == 0).all()
    causal = BatchSampler(build(path, seq_len=32, heldout_fraction=0.0, packing="causal")[0], 4, 0, 0).batch(0)
    assert causal.position_ids is None and causal.num_target_tokens() == 4 * 32


def test_npy_of_floats_or_2d_is_refused(tmp_path):
    np.save(tmp_path / "f.npy", np.zeros(100, dtype=np.float32))
    with pytest.raises(DataError, match="1-D integer array"):
        build(tmp_path / "f.npy", seq_len=4)


def test_resume_lands_on_the_same_batch_in_a_new_process(tmp_path):
    """Batch k is a function of (seed, k): a fresh process (a resumed run) draws the same rows."""
    path = tmp_path / "train.bin"
    corpus(200).astype(np.uint16).tofile(path)
    train, _ = build(path, seq_len=16)
    sampler = BatchSampler(train, 4, seed=3, pad_id=0)
    index = 2 * len(sampler) + 5                            # in the third epoch
    code = (f"import sys, types, json; from slidetune.data import *; "
            f"t, _ = build_datasets(DataConfig(path={str(path)!r}, seq_len=16), "
            f"types.SimpleNamespace(eos_token_id={EOS}, bos_token_id=None)); "
            f"print(json.dumps(BatchSampler(t, 4, seed=3, pad_id=0).batch({index}).input_ids.tolist()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == sampler.batch(index).input_ids.tolist()
    assert sampler.batch(index).input_ids.tolist() != sampler.batch(index - 1).input_ids.tolist()


def test_too_short_corpus_says_what_to_do(tmp_path):
    path = tmp_path / "tiny.bin"
    np.arange(3, 13, dtype=np.uint16).tofile(path)
    with pytest.raises(DataError, match="smaller --seq-len or --batch-size"):
        build_datasets(DataConfig(path=str(path), seq_len=8), TOKENIZER, min_rows=2)


def _save_to_disk_dir(tmp_path, docs: list[list[int]]):
    """A save_to_disk layout (dataset_info.json, state.json, an Arrow stream) written with pyarrow."""
    pa = pytest.importorskip("pyarrow")
    d = tmp_path / "ds"
    d.mkdir()
    table = pa.table({"input_ids": pa.array(docs, type=pa.list_(pa.int32()))})
    with pa.OSFile(str(d / "data-00000-of-00001.arrow"), "wb") as sink, \
            pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=3):   # several record batches: several segments
            writer.write_batch(batch)
    (d / "dataset_info.json").write_text(json.dumps(
        {"features": {"input_ids": {"feature": {"dtype": "int32", "_type": "Value"}, "_type": "Sequence"}}}))
    (d / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    return d


def test_save_to_disk_directory_rows_are_documents(tmp_path):
    rng = np.random.default_rng(1)
    docs = [rng.integers(3, 1000, rng.integers(2, 12)).tolist() for _ in range(30)]   # no EOS at all
    d = _save_to_disk_dir(tmp_path, docs)
    train, _ = build(d, seq_len=8, heldout_fraction=0.0)
    flat = np.concatenate(docs)
    firsts = np.cumsum([0] + [len(x) for x in docs])[:-1]
    for r in range(len(train)):
        ids, _, starts = train.window(r)
        assert ids.tolist() == flat[r * 8:r * 8 + 9].tolist()
        assert np.flatnonzero(starts.numpy()).tolist() == [f - r * 8 for f in firsts if r * 8 <= f < r * 8 + 9]


def test_save_to_disk_directory_without_pyarrow_names_the_package(tmp_path, monkeypatch):
    d = tmp_path / "ds"
    d.mkdir()
    (d / "dataset_info.json").write_text(json.dumps({"features": {"input_ids": {"_type": "Sequence"}}}))
    (d / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    monkeypatch.setitem(sys.modules, "pyarrow", None)      # as if not installed (it is not, here)
    with pytest.raises(DataError, match="pip install pyarrow"):
        build(d, seq_len=8)


def test_stream_reads_across_segments():
    a, b = np.arange(0, 5, dtype=np.uint16), np.arange(5, 12, dtype=np.uint16)
    stream = TokenStream([a, b], "two", doc_offsets=np.array([0, 5]))
    assert stream.read(3, 9).tolist() == [3, 4, 5, 6, 7, 8] and len(stream) == 12
    ids = stream.read(3, 9)
    assert stream.doc_starts(3, ids, eos_id=None).tolist() == [False, False, True, False, False, False]
    assert torch.equal(torch.from_numpy(stream.read(0, 12)), torch.arange(12))


def test_a_pretokenized_corpus_trains_without_a_tokenizer(tmp_path, monkeypatch):
    """A model without a tokenizer (here: a preset whose embedded tokenizer is unavailable, as on
    a machine without the SmolLM2 package) trains on token ids; text data is still refused, and
    the message names the pre-tokenized way."""
    import contextlib
    import io
    from slidetune.cli import main
    from slidetune.models import load as load_mod

    def no_tokenizer():
        raise load_mod.ModelNotFoundError("the embedded SmolLM2 GGUF is not installed")
    monkeypatch.setattr(load_mod, "embedded_tokenizer", no_tokenizer)
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint32))
    text = tmp_path / "text.txt"
    text.write_text("A short document.\n\nAnother one.\n")
    base = ["train", "--model", "tiny-llama", "--seq-len", "32", "--batch-size", "2", "--max-steps", "2",
            "--eval-batches", "1", "--progress", "false", "--device", "cpu"]

    def run(*args):
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            return main([*base, *args]), err.getvalue()
    code, err = run("--data", str(tokens), "--output-dir", str(tmp_path / "tok"))
    assert code == 0, err
    assert (tmp_path / "tok" / "final" / "config.json").exists()
    assert not (tmp_path / "tok" / "final" / "tokenizer.json").exists()
    code, err = run("--data", str(text), "--output-dir", str(tmp_path / "text_run"))
    assert code != 0 and "has no tokenizer" in err and "pre-tokenized corpus" in err, err
