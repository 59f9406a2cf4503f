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


def build(path, vocab_size=None, **kw):
    return build_datasets(DataConfig(path=str(path), **kw), TOKENIZER, vocab_size=vocab_size)


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


@pytest.mark.parametrize("dtype", [np.uint16, np.int64])
def test_an_empty_npy_is_named_as_holding_no_tokens(tmp_path, dtype):
    """Not "0 tokens make -1 rows": the file holds no tokens, and how many one row and one batch need."""
    path = tmp_path / "empty.npy"
    np.save(path, np.zeros(0, dtype=dtype))
    with pytest.raises(DataError) as e:
        build_datasets(DataConfig(path=str(path), seq_len=8), TOKENIZER, min_rows=2)
    assert str(e.value) == (f"{path}: holds no tokens; a pre-tokenized corpus needs at least seq_len+1 = 9 tokens "
                            f"for one row, 17 for one batch (batch_size=2)")


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


# ----------------------------------------------------------------------------- ids against the vocabulary
@pytest.mark.parametrize("bad", [1000, 65535])
def test_bin_id_beyond_the_vocabulary_is_refused_with_its_position(tmp_path, monkeypatch, bad):
    from slidetune.data import token_arrays
    monkeypatch.setattr(token_arrays, "CHECK_CHUNK_TOKENS", 64)      # the bad id several chunks in
    tokens = corpus(n_docs=60) % 1000
    tokens[437] = bad
    path = tmp_path / "train.bin"
    tokens.astype(np.uint16).tofile(path)
    with pytest.raises(DataError) as e:
        build_datasets(DataConfig(path=str(path), seq_len=16), TOKENIZER, vocab_size=1000)
    msg = str(e.value)
    assert str(path) in msg and f"token id {bad} at token 437 " in msg and "vocabulary size 1000" in msg, msg
    assert "--token-dtype" in msg                   # a uint32 file read as uint16 gives such ids
    build_datasets(DataConfig(path=str(path), seq_len=16), TOKENIZER, vocab_size=bad + 1)   # fits a larger one


@pytest.mark.parametrize("dtype, bad, vocab", [("int32", -7, 1000), ("int64", -1, 1000),
                                               ("int16", -30000, 40000)])    # -30000 reads 35536 unsigned
def test_npy_negative_id_is_refused_with_its_position(tmp_path, dtype, bad, vocab):
    tokens = corpus().astype(dtype)
    tokens[123] = bad
    path = tmp_path / "train.npy"
    np.save(path, tokens)
    with pytest.raises(DataError, match=rf"token id {bad} at token 123 \(0-based\) of [\d,]+ is negative"):
        build(path, seq_len=16, vocab_size=vocab)


def test_save_to_disk_directory_bad_id_names_the_arrow_file_and_row(tmp_path):
    docs = [[3, 4, 5], [6, 7, 8, 9], [10, 11], [12, 13, 14], [15, 16, 5000, 17]] * 4
    d = _save_to_disk_dir(tmp_path, docs)
    with pytest.raises(DataError) as e:
        build(d, seq_len=4, heldout_fraction=0.0, vocab_size=1000)
    msg = str(e.value)
    assert str(d / "data-00000-of-00001.arrow") in msg and "token id 5000 at token 14 " in msg, msg
    assert "row 4 token 2" in msg, msg
    docs[4][2] = -1
    (tmp_path / "neg").mkdir()
    d2 = _save_to_disk_dir(tmp_path / "neg", docs)
    with pytest.raises(DataError, match="token id -1 at token 14 .* is negative"):
        build(d2, seq_len=4, heldout_fraction=0.0, vocab_size=1000)


def test_train_refuses_an_out_of_range_id_before_step_1(tmp_path, monkeypatch):
    """`slidetune train --data x.npy`: one id past tiny-llama's vocabulary at position 5000 (a 2-step
    run never reads it, a long one would fail there) is refused before the engine is built."""
    import contextlib
    import io
    from slidetune import run_setup
    from slidetune.cli import main
    from slidetune.models.presets import TINY_VOCAB

    def forbidden(*a, **k):
        raise AssertionError("must be refused before the engine is built")
    monkeypatch.setattr(run_setup, "build_engine", forbidden)
    tokens = np.random.default_rng(0).integers(0, 256, 20_000).astype(np.int32)
    for bad, what in ((TINY_VOCAB, f"vocabulary size {TINY_VOCAB}"), (-3, "negative")):
        tokens[5000] = bad
        path = tmp_path / "tokens.npy"
        np.save(path, tokens)
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = main(["train", "--model", "tiny-llama", "--seq-len", "32", "--batch-size", "2", "--max-steps", "2",
                         "--progress", "false", "--device", "cpu", "--data", str(path),
                         "--output-dir", str(tmp_path / "never")])
        msg = err.getvalue()
        assert code == 2 and "Traceback" not in msg, msg
        assert str(path) in msg and f"token id {bad} at token 5,000 " in msg and what in msg, msg
        assert not (tmp_path / "never").exists()
