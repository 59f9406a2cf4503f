"""Models and datasets named by Hub id (`org/name`), resolved through the local HF cache, offline.

A tiny Llama (2 layers, a BPE tokenizer trained in a second) and a tiny parquet dataset are laid out
as huggingface_hub lays out its cache (``models--org--name/snapshots/<commit>/``, ``refs/main``);
HF_HUB_CACHE / HF_HOME / HF_DATASETS_CACHE point at temporary directories and HF_HUB_OFFLINE=1, so
nothing is downloaded. A cached id loads by name; an uncached one is refused with the cache directory
and the command that fetches it.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from slidetune.data import DataConfig, DataError, build_datasets
from slidetune.data.corpus import builtin_corpus
from slidetune.models.hub import hub_cache_dir, looks_like_hub_id
from slidetune.models.load import ModelNotFoundError, load_model
from test_train_errors import run_cli

COMMIT = "0123456789abcdef0123456789abcdef01234567"
MODEL_ID = "tiny-org/tiny-llama"
DATASET_ID = "tiny-org/tiny-notes"
TRAIN = ["--seq-len", "16", "--batch-size", "2", "--eval-batches", "1", "--max-steps", "2", "--progress", "false",
         "--device", "cpu"]


def snapshot_path(cache: Path, repo_id: str, kind: str) -> Path:
    """Where huggingface_hub keeps ``repo_id``'s files at COMMIT, with refs/main naming it."""
    repo = cache / f"{kind}s--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True, exist_ok=True)
    return snap


def save_tiny_model(directory: Path) -> None:
    """A random 2-layer Llama and a byte-level BPE tokenizer (320 ids) trained on the built-in corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from slidetune.models.presets import tiny_config
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(builtin_corpus()[:40], trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  pad_token="</s>")
    AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tok), layers=2)).save_pretrained(directory)
    tok.save_pretrained(directory)


def notes(n: int, start: int = 0) -> list[dict]:
    return [{"text": f"Note {i}. A short paragraph about item {i}, kept for the tests of the data layer."}
            for i in range(start, start + n)]


@pytest.fixture(scope="module")
def hub_root(tmp_path_factory) -> Path:
    """An HF home whose hub cache holds MODEL_ID and DATASET_ID (train and test splits, parquet)."""
    import datasets
    root = tmp_path_factory.mktemp("hf_home")
    save_tiny_model(snapshot_path(root / "hub", MODEL_ID, "model"))
    snap = snapshot_path(root / "hub", DATASET_ID, "dataset")
    (snap / "data").mkdir()
    datasets.Dataset.from_list(notes(60)).to_parquet(str(snap / "data" / "train-00000-of-00001.parquet"))
    datasets.Dataset.from_list(notes(12, start=100)).to_parquet(str(snap / "data" / "test-00000-of-00001.parquet"))
    (snap / "README.md").write_text("---\nlicense: mit\n---\n# tiny notes\n")
    return root


@pytest.fixture
def offline_hf(hub_root, tmp_path, monkeypatch) -> Path:
    """HF_HOME at hub_root, the Hub unreachable by setting, a fresh datasets cache."""
    monkeypatch.setenv("HF_HOME", str(hub_root))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_root / "hub"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets_cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub_root


def test_hub_id_shape():
    assert looks_like_hub_id("Qwen/Qwen3-0.6B") and looks_like_hub_id("HuggingFaceH4/ultrachat_200k")
    for path in ("data/train.jsonl", "./org/name", "../org/name", "/abs/org", "a/b/c", "qwen3-8b", "x/y.gguf"):
        assert not looks_like_hub_id(path), path


def test_cached_model_loads_by_id_with_its_tokenizer(offline_hf):
    loaded = load_model(MODEL_ID)
    assert loaded.name == MODEL_ID and loaded.tokenizer is not None
    assert loaded.split.config.num_hidden_layers == 2 and loaded.split.config.vocab_size == len(loaded.tokenizer)
    assert loaded.source_dir == offline_hf / "hub" / f"models--{MODEL_ID.replace('/', '--')}" / "snapshots" / COMMIT
    assert loaded.tokenizer.eos_token == "</s>"


def test_uncached_model_offline_says_how_to_get_it(offline_hf):
    with pytest.raises(ModelNotFoundError) as info:
        load_model("some-org/not-cached-model")
    msg = str(info.value)
    for part in ("some-org/not-cached-model", str(hub_cache_dir()), "hf download some-org/not-cached-model",
                 "huggingface-cli download", "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE"):
        assert part in msg, (part, msg)


def test_cached_dataset_loads_by_id(offline_hf):
    from slidetune.models.load import load_model
    tok = load_model(MODEL_ID).tokenizer
    train, heldout = build_datasets(DataConfig(path=DATASET_ID, seq_len=16), tok, min_rows=2)
    assert train.source == DATASET_ID and train.num_examples + heldout.num_examples == 60   # the train split
    # --eval-data of the same id: its test split (12 notes), and all 60 train
    train, heldout = build_datasets(DataConfig(path=DATASET_ID, eval_path=DATASET_ID, seq_len=16), tok, min_rows=2)
    assert train.num_examples == 60 and heldout.num_examples == 12
    train, _ = build_datasets(DataConfig(path=DATASET_ID, split="test", heldout_fraction=0, seq_len=16), tok)
    assert train.num_examples == 12


def test_uncached_dataset_offline_names_the_cache_and_the_setting(offline_hf):
    with pytest.raises(DataError) as info:
        build_datasets(DataConfig(path="some-org/not-cached-data"), None)
    msg = str(info.value)
    for part in ("some-org/not-cached-data", str(hub_cache_dir()), "HF_HUB_OFFLINE",
                 "hf download --repo-type dataset some-org/not-cached-data"):
        assert part in msg, (part, msg)


@pytest.mark.slow
def test_train_cached_model_on_cached_dataset_by_id(offline_hf, tmp_path):
    out = tmp_path / "run"
    code, stdout, err = run_cli("--model", MODEL_ID, "--data", DATASET_ID, *TRAIN, "--output-dir", str(out))
    assert code == 0, err[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and math.isfinite(summary["last_loss"]) and math.isfinite(summary["eval_loss_after"])
    assert (out / "final" / "model.safetensors").exists() and (out / "final" / "tokenizer.json").exists()


def test_train_refuses_uncached_ids_offline(offline_hf, tmp_path):
    code, _, err = run_cli("--model", MODEL_ID, "--data", "some-org/missing-data", *TRAIN,
                           "--output-dir", str(tmp_path / "a"))
    assert code == 2 and "some-org/missing-data" in err and "HF_HUB_OFFLINE" in err
    code, _, err = run_cli("--model", "some-org/missing-model", "--data", DATASET_ID, *TRAIN,
                           "--output-dir", str(tmp_path / "b"))
    assert code != 0 and "some-org/missing-model" in err and "hf download" in err
