"""Checkpoints: exact resume, HF loadability, atomicity, run-directory helpers, errors."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from slidetune.checkpoint import (CheckpointCorrupt, CheckpointError, checkpoint_dir, latest_checkpoint, load_checkpoint,
                                  prune_checkpoints, save_checkpoint)
from slidetune.data import Batch
from slidetune.engine import AdamWConfig, RuntimeConfig, build_engine
from slidetune.models.load import LoadedModel, RandomInit, skeleton
from slidetune.models.presets import tiny_config
from slidetune.models.units import SplitModel

VOCAB = 512
VARIANTS = {                      # name -> (family, tied, grad_accum, max_grad_norm, runtime options)
    "untied": ("llama", False, 1, None, {}),
    "tied": ("qwen3", True, 1, None, {}),
    "deferred": ("llama", False, 2, 0.5, {}),
    # slide: embedding and head state kept on the device (saved from and restored to it)
    "vocab-device": ("llama", False, 1, None, {"vocab_update": "device"}),
    # slide: the lowest layers' state kept on the device as well
    "device-layers": ("llama", False, 1, None, {"device_layers": 2}),
}


def make_engine(mode="slide", family="llama", tied=False, grad_accum=1, max_grad_norm=None, seed=1, layers=3,
                runtime: dict | None = None):
    cfg = tiny_config(family, tied=tied, vocab_size=VOCAB, layers=layers)
    loaded = LoadedModel("t", SplitModel(skeleton(cfg)), RandomInit(seed, std=0.1), None)
    return build_engine(loaded, RuntimeConfig(mode=mode, dtype="fp32", device="cpu", **(runtime or {})),
                        AdamWConfig(lr=1e-3, weight_decay=0.1), grad_accum=grad_accum,
                        max_grad_norm=max_grad_norm)


def batches(step: int, n_micro: int = 1, B: int = 2, S: int = 16) -> list[Batch]:
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(n_micro):
        ids = torch.randint(0, VOCAB, (B, S), generator=g)            # [B, S]
        labels = ids.roll(-1, dims=1)
        labels[:, -1] = -100
        out.append(Batch(ids, labels, None))
    return out


def train(eng, steps, n_micro=1) -> list[float]:
    return [eng.train_step(batches(s, n_micro), 1e-3).loss for s in steps]


def masters(eng) -> dict[str, torch.Tensor]:
    eng.synchronize()
    return {k: v.clone() for k, v in eng.named_master_params()}


def optim(eng) -> dict[str, torch.Tensor]:
    eng.synchronize()
    return {k: v.clone() for k, v in eng.optimizer_tensors().items()}


def assert_close(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        diff = (a[k] - b[k]).abs().max().item() if a[k].numel() else 0.0
        scale = max(a[k].abs().max().item() if a[k].numel() else 0.0, 1e-30)
        assert diff / scale <= 1e-7, f"{k}: relative difference {diff / scale:.3g}"


def tree_digest(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture
def engines():
    made = []

    def factory(*a, **kw):
        e = make_engine(*a, **kw)
        made.append(e)
        return e
    yield factory
    for e in made:
        shut(e)


def shut(eng) -> None:
    # Engine.close() is not idempotent (a second close waits forever on a stopped worker).
    if not getattr(eng, "_test_closed", False):
        eng._test_closed = True
        eng.close()


# --------------------------------------------------------------------------- (1) exact resume
@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("mode", ["slide", "gpu"], ids=["mode=slide", "mode=gpu"])
def test_resume_is_exact(tmp_path, engines, mode, variant):
    family, tied, accum, clip, runtime = VARIANTS[variant]
    kw = dict(mode=mode, family=family, tied=tied, grad_accum=accum, max_grad_norm=clip, runtime=runtime)
    ref = engines(**kw)
    ref_losses = train(ref, range(4), accum)
    ref_masters, ref_optim = masters(ref), optim(ref)

    first = engines(**kw)
    losses = train(first, range(2), accum)
    torch.manual_seed(123)
    random.seed(7)
    np.random.seed(5)
    ckpt = save_checkpoint(first, checkpoint_dir(tmp_path, 2), step=2, trainer_state={"epoch": 0, "row": 17})
    expect_rng = (torch.rand(3), random.random(), np.random.rand())
    shut(first)

    resumed = engines(**kw, seed=99)          # different init: everything must come from the checkpoint
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    state = load_checkpoint(resumed, ckpt)
    assert state == {"epoch": 0, "row": 17, "step": 2}
    assert resumed.step_index == 2
    got_rng = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got_rng[0], expect_rng[0]) and got_rng[1:] == expect_rng[1:]
    losses += train(resumed, range(2, 4), accum)

    rel = [abs(a - b) / abs(a) for a, b in zip(losses, ref_losses)]
    assert max(rel) <= 1e-7, (losses, ref_losses)
    assert_close(masters(resumed), ref_masters)
    assert_close(optim(resumed), ref_optim)


@pytest.mark.parametrize("saved,resumed", [("device", "host"), ("host", "device")])
def test_resume_across_placements(tmp_path, engines, saved, resumed):
    """A checkpoint does not depend on where the state lived: saved with the lowest layers and the
    vocabulary updated on the device and resumed with everything on the host (device_layers auto
    can resolve differently on another GPU), or the other way, the run goes on as if uninterrupted."""
    placement = {"device": {"device_layers": 2, "vocab_update": "device", "cache_units": 0},
                 "host": {"device_layers": 0, "vocab_update": "host"}}
    ref = engines(runtime=placement[saved])
    ref_losses = train(ref, range(4))
    ref_masters, ref_optim = masters(ref), optim(ref)
    first = engines(runtime=placement[saved])
    losses = train(first, range(2))
    ckpt = save_checkpoint(first, checkpoint_dir(tmp_path, 2), step=2)
    shut(first)
    other = engines(runtime=placement[resumed], seed=99)
    load_checkpoint(other, ckpt)
    assert [u.on_device for u in other.units][1] is (resumed == "device")
    losses += train(other, range(2, 4))
    assert max(abs(a - b) / abs(a) for a, b in zip(losses, ref_losses)) <= 1e-6, (losses, ref_losses)
    for got, want in ((masters(other), ref_masters), (optim(other), ref_optim)):
        assert got.keys() == want.keys()
        for k in got:
            torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-9, msg=k)


@pytest.mark.parametrize("mode", ["slide", "gpu"], ids=["mode=slide", "mode=gpu"])
def test_resume_keeps_the_routers_correction_biases(tmp_path, mode):
    """GLM-4.5's MoE: the routers' constant biases are saved under HF's names (FP32), and a resume
    into a model built with HF's init (zeros) reads them back; the next step is the same."""
    from safetensors import safe_open

    from slidetune.models.load import StateDictSource
    from test_families import router_biases, router_config, router_model
    config = router_config(VOCAB)
    hf = router_model(config)
    biases = router_biases(hf)
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}

    def engine(source):
        return build_engine(LoadedModel("glm4_moe", SplitModel(skeleton(config)), source, None),
                            RuntimeConfig(mode=mode, dtype="fp32", device="cpu"), AdamWConfig(lr=1e-3, weight_decay=0.1))
    eng = engine(StateDictSource(state))
    try:
        train(eng, range(2))
        path = save_checkpoint(eng, checkpoint_dir(tmp_path, 2), step=2)
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            for name, b in biases.items():
                assert f.get_slice(name).get_dtype() == "F32" and torch.equal(f.get_tensor(name), b), name
        after = train(eng, range(2, 3))
    finally:
        shut(eng)
    fresh = engine(RandomInit(5, std=0.1))
    try:
        assert all(not b.any() for _, b in fresh.named_buffers())          # transformers' init
        load_checkpoint(fresh, path)
        got = dict(fresh.named_buffers())
        assert got.keys() == biases.keys() and all(torch.equal(got[n], b) for n, b in biases.items())
        assert train(fresh, range(2, 3)) == after
    finally:
        shut(fresh)


def test_rng_states_are_restored(tmp_path, engines):
    eng = engines()
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    ckpt = save_checkpoint(eng, tmp_path / "checkpoint-0", step=0)
    want = (torch.rand(5), random.random(), np.random.rand(4))
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    load_checkpoint(eng, ckpt)
    got = (torch.rand(5), random.random(), np.random.rand(4))
    assert torch.equal(got[0], want[0]) and got[1] == want[1] and np.array_equal(got[2], want[2])


# --------------------------------------------------------------------------- (2) HF loadability
def reference_logits(eng, ids):
    cfg = eng.split.config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    missing, unexpected = model.load_state_dict(masters(eng), strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing)
    if eng.split.tied:
        model.tie_weights()
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


@pytest.mark.parametrize("family,tied", [("llama", False), ("qwen3", True)])
def test_from_pretrained_matches_engine(tmp_path, engines, family, tied):
    eng = engines(family=family, tied=tied)
    train(eng, range(2))
    d = save_checkpoint(eng, tmp_path / "checkpoint-2", step=2)
    assert (d / "model.safetensors").exists() and not (d / "model.safetensors.index.json").exists()
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["dtype"] == "float32" and "quantization_config" not in cfg
    assert cfg["tie_word_embeddings"] is tied
    ids = batches(9)[0].input_ids
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    sd = model.state_dict()
    for k, v in masters(eng).items():
        assert torch.equal(sd[k], v), k
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    torch.testing.assert_close(logits, reference_logits(eng, ids), rtol=0, atol=0)


def test_bf16_export_loads_but_cannot_resume(tmp_path, engines):
    eng = engines(family="qwen3", tied=True)
    train(eng, range(1))
    d = save_checkpoint(eng, tmp_path / "final", step=1, save_dtype="bf16", with_optimizer=True)
    assert not (d / "trainer_state" / "optimizer.safetensors").exists()
    assert json.loads((d / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    sd = model.state_dict()
    for k, v in masters(eng).items():
        assert sd[k].dtype == torch.bfloat16 and torch.equal(sd[k], v.to(torch.bfloat16)), k
    with pytest.raises(CheckpointError, match="cannot be resumed exactly"):
        load_checkpoint(engines(family="qwen3", tied=True), d)


def test_a_checkpoint_of_a_newer_format_is_refused_not_called_damaged(tmp_path, engines):
    """A newer slidetune's checkpoint (its optimizer state in files this one would not find) gets a
    CheckpointError naming the versions, never a CheckpointCorrupt, which would set it aside."""
    eng = engines()
    train(eng, range(1))
    d = save_checkpoint(eng, tmp_path / "ckpt", step=1)
    state_path = d / "trainer_state" / "state.json"
    assert json.loads(state_path.read_text())["format_version"] == 2
    (d / "MANIFEST.json").unlink()                       # as if written without one: state.json is edited below
    complete = json.loads((d / "COMPLETE").read_text())
    (d / "COMPLETE").write_text(json.dumps({k: v for k, v in complete.items() if k != "MANIFEST.json"}))
    state_path.write_text(json.dumps({**json.loads(state_path.read_text()), "format_version": 3}))
    with pytest.raises(CheckpointError, match="format version 3, this slidetune reads versions 1, 2: a newer "
                                              "slidetune wrote it") as info:
        load_checkpoint(engines(), d)
    assert not isinstance(info.value, CheckpointCorrupt)


def test_tokenizer_files_are_saved(tmp_path, engines):
    saved = []

    class Tok:
        def save_pretrained(self, where):
            saved.append(where)
            Path(where, "tokenizer.json").write_text("{}")
    d = save_checkpoint(engines(), tmp_path / "checkpoint-0", step=0, tokenizer=Tok())
    assert (d / "tokenizer.json").exists() and len(saved) == 1


# --------------------------------------------------------------------------- (3) atomicity
def no_leftovers(run_dir: Path):
    return [p.name for p in run_dir.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def enospc(*a, **kw):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_streamed_safetensors_read_back_with_safetensors(tmp_path):
    """write_safetensors: the file the library reads, every dtype a checkpoint writes, scalars and
    empty tensors included, a conversion on the way, and non-contiguous views."""
    from safetensors import safe_open
    from safetensors.torch import load_file
    from slidetune.checkpoint import write_safetensors
    base = torch.randn(6, 10)
    tensors = {"a": torch.randn(3, 5), "view": base[:, ::2], "bf16": torch.randn(7).to(torch.bfloat16),
               "step": torch.tensor(3.0), "empty": torch.zeros(0), "ids": torch.arange(5)}
    write_safetensors(tensors, tmp_path / "x.safetensors")
    back = load_file(str(tmp_path / "x.safetensors"))
    assert back.keys() == tensors.keys()
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k
    floats = {k: tensors[k] for k in ("a", "view", "step")}
    write_safetensors(floats, tmp_path / "y.safetensors", dtype=torch.bfloat16)
    with safe_open(str(tmp_path / "y.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        for k, t in floats.items():
            assert torch.equal(f.get_tensor(k), t.to(torch.bfloat16)), k


def test_failed_save_leaves_previous_checkpoint(tmp_path, engines, monkeypatch):
    import slidetune.checkpoint.writer as writer_mod
    eng = engines()
    train(eng, range(2))
    first = save_checkpoint(eng, checkpoint_dir(tmp_path, 2), step=2)
    before = tree_digest(first)
    saved_masters = masters(eng)
    train(eng, range(2, 3))
    monkeypatch.setattr(writer_mod, "write_safetensors", enospc)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(eng, checkpoint_dir(tmp_path, 3), step=3)
    msg = str(info.value)
    assert "intact" in msg and str(first) in msg and "No space left" in msg
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    # the same when overwriting the checkpoint's own directory
    with pytest.raises(CheckpointError, match="intact"):
        save_checkpoint(eng, first, step=2)
    monkeypatch.undo()
    assert no_leftovers(tmp_path) == []
    assert not checkpoint_dir(tmp_path, 3).exists()
    assert tree_digest(first) == before
    assert latest_checkpoint(tmp_path) == first
    fresh = engines(seed=5)
    load_checkpoint(fresh, first)
    assert_close(masters(fresh), saved_masters)


def test_failed_rename_restores_old_directory(tmp_path, engines, monkeypatch):
    eng = engines()
    d = save_checkpoint(eng, tmp_path / "checkpoint-0", step=0)
    before = tree_digest(d)
    train(eng, range(1))
    real_replace = os.replace

    def flaky(src, dst, *a, **kw):
        if ".tmp-" in Path(src).name:
            raise OSError(errno.EIO, "I/O error")
        return real_replace(src, dst, *a, **kw)
    monkeypatch.setattr(os, "replace", flaky)
    with pytest.raises(CheckpointError, match="intact"):
        save_checkpoint(eng, d, step=0)
    monkeypatch.undo()
    assert tree_digest(d) == before and no_leftovers(tmp_path) == []
    # a successful overwrite replaces it completely
    save_checkpoint(eng, d, step=1)
    assert tree_digest(d) != before and no_leftovers(tmp_path) == []
    assert json.loads((d / "trainer_state" / "state.json").read_text())["step"] == 1


# --------------------------------------------------------------------------- (4) run-directory helpers
def fake_checkpoint(run: Path, name: str, complete: bool = True) -> Path:
    p = run / name
    p.mkdir(parents=True)
    if complete:
        (p / "COMPLETE").write_text("{}")
    return p


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_latest_and_prune(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    for s in (5, 10, 20, 100):
        fake_checkpoint(tmp_path, f"checkpoint-{s}")
    fake_checkpoint(tmp_path, "checkpoint-300", complete=False)          # unfinished
    fake_checkpoint(tmp_path, f"checkpoint-200.tmp-{dead_pid()}")        # crashed saver
    fake_checkpoint(tmp_path, f"checkpoint-150.tmp-{os.getpid()}")       # our own (in progress)
    fake_checkpoint(tmp_path, "final")
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-100"    # numeric, not lexical order
    prune_checkpoints(tmp_path, keep_last=2)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["checkpoint-20", "checkpoint-100", "checkpoint-300",
                           f"checkpoint-150.tmp-{os.getpid()}", "final"])
    prune_checkpoints(tmp_path, keep_last=5)
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-100"
    with pytest.raises(ValueError):
        prune_checkpoints(tmp_path, keep_last=0)


# --------------------------------------------------------------------------- (5) sharding
def test_sharded_save_loads_everywhere(tmp_path, engines):
    eng = engines(family="qwen3", tied=True)
    train(eng, range(2))
    d = save_checkpoint(eng, tmp_path / "checkpoint-2", step=2, max_shard_bytes=40_000)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n > 3 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (d / "model.safetensors").exists() and not list(d.glob("*.partial.*"))
    ref = masters(eng)
    assert set(index["weight_map"]) == set(ref)
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in ref.values())
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = batches(9)[0].input_ids
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference_logits(eng, ids), rtol=0, atol=0)
    fresh = engines(family="qwen3", tied=True, seed=4)
    load_checkpoint(fresh, d)
    assert_close(masters(fresh), ref)
    assert_close(optim(fresh), optim(eng))


# --------------------------------------------------------------------------- (6) errors
def test_load_errors(tmp_path, engines):
    import safetensors.torch
    eng = engines()
    with pytest.raises(CheckpointError, match="does not exist") as info:
        load_checkpoint(eng, tmp_path / "nope")
    assert str(tmp_path / "nope") in str(info.value)

    d = save_checkpoint(eng, tmp_path / "checkpoint-0", step=0)
    (d / "COMPLETE").unlink()
    with pytest.raises(CheckpointError, match="COMPLETE"):
        load_checkpoint(eng, d)
    assert latest_checkpoint(tmp_path) is None
    (d / "COMPLETE").write_text("{}")

    weights = safetensors.torch.load_file(d / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    del weights[name]
    safetensors.torch.save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointCorrupt, match="model.safetensors: .* MANIFEST.json records"):
        load_checkpoint(eng, d)
    (d / "MANIFEST.json").unlink()          # as an older slidetune wrote it: the structure is still checked
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_checkpoint(eng, d)

    other = engines(family="llama", layers=3, seed=1)
    other_cfg_engine = make_engine(family="qwen3", tied=True)       # other model: shapes/names differ
    try:
        d2 = save_checkpoint(other_cfg_engine, tmp_path / "checkpoint-1", step=1)
    finally:
        other_cfg_engine.close()
    with pytest.raises(CheckpointError, match="missing|shape|does not have"):
        load_checkpoint(other, d2)

    (d2 / "trainer_state" / "optimizer.safetensors").unlink()
    with pytest.raises(CheckpointCorrupt, match="optimizer.safetensors: missing"):
        load_checkpoint(engines(family="qwen3", tied=True), d2)


def test_save_rejects_bad_arguments(tmp_path, engines):
    eng = engines()
    with pytest.raises(ValueError, match="save_dtype"):
        save_checkpoint(eng, tmp_path / "c", step=0, save_dtype="fp8")
    with pytest.raises(TypeError, match="JSON"):
        save_checkpoint(eng, tmp_path / "c", step=0, trainer_state={"x": object()})
    assert not list(tmp_path.iterdir())
