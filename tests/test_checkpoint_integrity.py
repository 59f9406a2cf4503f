"""Damaged checkpoints (slidetune/checkpoint/__init__.py, "Integrity"): each file a resume reads,
truncated, with a byte flipped in the middle, or rewritten with a wrong dtype or type (its digest
re-signed in the manifest, so that only the type check can catch it). `--resume auto` sets the
damaged checkpoint aside, naming the file, falls back to the previous one and ends bit for bit where
an uninterrupted run ends. A save that does not read back as written fails before any pruning; a
checkpoint whose COMPLETE records a manifest is damaged without it or with it altered; a checkpoint
of an older slidetune (no trace of a manifest) still resumes once its tensors fit the model; a
non-finite loss right after a resume names the checkpoint it came from.

One uninterrupted 4-step reference run and one run stopped after step 3 (checkpoints 1-3) are
shared by the module; each case damages a copy of the latter and resumes it (two steps).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

from slidetune.checkpoint import MANIFEST, file_digest
from slidetune.faults import ENV
from test_train_errors import COMMON, metric_steps, run_cli, small_corpus  # noqa: F401

RUN = ["--max-steps", "4", "--save-every", "1", "--keep-last", "3"]
FILES = {"weights": "model.safetensors", "optimizer": "trainer_state/optimizer.safetensors",
         "rng": "trainer_state/rng.pt", "state": "trainer_state/state.json"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the uninterrupted run, a run stopped after step 3 with checkpoints 1, 2 and 3)."""
    root = tmp_path_factory.mktemp("integrity")
    ref, stopped = root / "ref", root / "stopped"
    for d, extra in ((ref, []), (stopped, ["--stop-after", "3"])):
        code, out, err = run_cli(*COMMON, *RUN, "--output-dir", str(d), *extra)
        assert code == 0, err[-3000:]
    assert sorted(p.name for p in (stopped / "checkpoints").iterdir()) == [f"checkpoint-{i}" for i in (1, 2, 3)]
    return ref, stopped


def state_of(ckpt: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's FP32 weights and AdamW state by name."""
    return {**safetensors.torch.load_file(ckpt / "model.safetensors"),
            **{f"optim.{k}": v for k, v in safetensors.torch.load_file(
                ckpt / "trainer_state" / "optimizer.safetensors").items()}}


def assert_bit_exact(run: Path, ref: Path) -> None:
    """The run's end-of-run checkpoint equals the uninterrupted run's, every tensor bit for bit."""
    got, want = state_of(run / "checkpoints" / "checkpoint-4"), state_of(ref / "checkpoints" / "checkpoint-4")
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def resign(ckpt: Path, rel: str) -> None:
    """Record `rel`'s current size and digest in the manifest (and the manifest's in COMPLETE): a
    file rewritten consistently, which only the checks of its content can refuse."""
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest["files"][rel] = file_digest(ckpt / rel).record()
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    complete = json.loads((ckpt / "COMPLETE").read_text())
    complete[MANIFEST] = file_digest(ckpt / MANIFEST).record()
    (ckpt / "COMPLETE").write_text(json.dumps(complete))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def flip_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def wrong_type(path: Path, kind: str) -> None:
    if kind in ("weights", "optimizer"):
        # every moment (or weight) rewritten as bf16: the audit's "moments as bf16"
        tensors = safetensors.torch.load_file(path)
        tensors = {k: v.to(torch.bfloat16) if (kind == "weights" or "exp_avg" in k) else v
                   for k, v in tensors.items()}
        safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})
    elif kind == "rng":
        state = torch.load(path, weights_only=True)
        state["torch_cpu"] = state["torch_cpu"].to(torch.int64)
        torch.save(state, path)
    else:
        path.write_text(json.dumps([json.loads(path.read_text())]))     # a JSON list, not an object


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "flipped", "wrong-type"])
@pytest.mark.parametrize("kind", list(FILES))
def test_a_damaged_checkpoint_is_set_aside_and_resume_auto_falls_back_bit_exact(runs, tmp_path, kind, damage):
    ref, stopped = runs
    d = tmp_path / "run"
    shutil.copytree(stopped, d)
    bad = d / "checkpoints" / "checkpoint-3"
    target = bad / FILES[kind]
    if damage == "truncated":
        truncate(target)
    elif damage == "flipped":
        flip_middle(target)
    else:
        wrong_type(target, kind)
        resign(bad, FILES[kind])
    code, out, err = run_cli(*COMMON, *RUN, "--resume", "auto", "--output-dir", str(d))
    assert code == 0 and "Traceback" not in err, err[-3000:]
    assert f"checkpoint {bad} is damaged: {target}:" in err, err[-3000:]
    assert f"resumed from {d / 'checkpoints' / 'checkpoint-2'} at step 2 of 4" in out
    aside = [p for p in (d / "checkpoints").iterdir() if p.name.startswith("checkpoint-3.corrupt-")]
    assert len(aside) == 1 and (aside[0] / FILES[kind]).exists(), "the damaged checkpoint was not kept"
    assert f"Set aside as {aside[0]}" in err
    assert metric_steps(d) == [0, 1, 2, 3, 4, 4]
    assert_bit_exact(d, ref)


@pytest.mark.slow
def test_an_explicit_resume_of_a_damaged_checkpoint_is_a_clear_error(runs, tmp_path):
    _, stopped = runs
    d = tmp_path / "run"
    shutil.copytree(stopped, d)
    bad = d / "checkpoints" / "checkpoint-3"
    truncate(bad / "trainer_state" / "optimizer.safetensors")
    code, out, err = run_cli(*COMMON, *RUN, "--resume", str(bad), "--output-dir", str(d))
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert f"{bad / 'trainer_state' / 'optimizer.safetensors'}: " in err and "truncated" in err
    assert bad.is_dir(), "an explicitly named checkpoint is reported, not moved"


@pytest.mark.slow
def test_a_save_that_does_not_read_back_fails_and_keeps_the_last_verified_checkpoint(runs, tmp_path, monkeypatch):
    """keep-last 1: the save of checkpoint 3 is corrupted on the disk after it was written (the
    bitrot fault). It must not count: checkpoint 2 is not pruned, the damaged one is set aside,
    and the next --resume auto continues from checkpoint 2 to the uninterrupted run's weights."""
    ref, _ = runs
    d = tmp_path / "run"
    args = [*COMMON, "--max-steps", "4", "--save-every", "1", "--keep-last", "1", "--output-dir", str(d)]
    monkeypatch.setenv(ENV, "bitrot:3")
    code, out, err = run_cli(*args)
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert "did not read back as it was written" in err and "checkpoint-2 is intact" in err, err[-3000:]
    names = sorted(p.name for p in (d / "checkpoints").iterdir())
    assert names[0] == "checkpoint-2" and len(names) == 2 and names[1].startswith("checkpoint-3.corrupt-"), names
    monkeypatch.delenv(ENV)
    code, out, err = run_cli(*args, "--resume", "auto")
    assert code == 0, err[-3000:]
    assert "at step 2 of 4" in out
    assert_bit_exact(d, ref)


@pytest.mark.slow
def test_a_checkpoint_without_a_manifest_resumes_with_a_note(runs, tmp_path):
    """As an older slidetune wrote it: no MANIFEST.json, a COMPLETE without its digest, state.json
    of format version 1."""
    ref, stopped = runs
    d = tmp_path / "run"
    shutil.copytree(stopped, d)
    for ckpt in (d / "checkpoints").iterdir():
        (ckpt / MANIFEST).unlink()
        state_path = ckpt / "trainer_state" / "state.json"
        state_path.write_text(json.dumps({**json.loads(state_path.read_text()), "format_version": 1}))
        complete = json.loads((ckpt / "COMPLETE").read_text())
        (ckpt / "COMPLETE").write_text(json.dumps({k: v for k, v in complete.items() if k != MANIFEST}))
    code, out, err = run_cli(*COMMON, *RUN, "--resume", "auto", "--output-dir", str(d))
    assert code == 0, err[-3000:]
    assert "at step 3 of 4" in out
    assert f"{d / 'checkpoints' / 'checkpoint-3'} has no MANIFEST.json (written by an older slidetune)" in err
    assert_bit_exact(d, ref)


@pytest.mark.slow
def test_a_non_finite_loss_right_after_a_resume_names_that_checkpoint(runs, tmp_path, monkeypatch):
    _, stopped = runs
    d = tmp_path / "run"
    shutil.copytree(stopped, d)
    monkeypatch.setenv(ENV, "nan:4")
    code, out, err = run_cli(*COMMON, *RUN, "--resume", "auto", "--output-dir", str(d))
    assert code == 2 and "non-finite loss (nan) at step 4" in err, err[-3000:]
    assert f"this run resumed from {d / 'checkpoints' / 'checkpoint-3'} (at step 3)" in err
    assert "intact" not in err


def make_legacy(ckpt: Path) -> None:
    """As an older slidetune wrote it: no MANIFEST.json, a COMPLETE without its digest, state.json
    of format version 1."""
    (ckpt / MANIFEST).unlink()
    state_path = ckpt / "trainer_state" / "state.json"
    state_path.write_text(json.dumps({**json.loads(state_path.read_text()), "format_version": 1}))
    complete = json.loads((ckpt / "COMPLETE").read_text())
    (ckpt / "COMPLETE").write_text(json.dumps({k: v for k, v in complete.items() if k != MANIFEST}))


def drop_entry(ckpt: Path, rel: str) -> None:
    """The manifest without `rel`'s entry, consistently re-signed in COMPLETE."""
    manifest = json.loads((ckpt / MANIFEST).read_text())
    del manifest["files"][rel]
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    complete = json.loads((ckpt / "COMPLETE").read_text())
    complete[MANIFEST] = file_digest(ckpt / MANIFEST).record()
    (ckpt / "COMPLETE").write_text(json.dumps(complete))


def assert_fell_back(d: Path, ref: Path, err: str, out: str, damaged: Path, culprit: Path) -> None:
    """checkpoint-3 was set aside naming `culprit`, the run resumed from checkpoint-2 and ended bit exact."""
    assert f"checkpoint {damaged} is damaged: {culprit}:" in err, err[-3000:]
    assert f"resumed from {d / 'checkpoints' / 'checkpoint-2'} at step 2 of 4" in out
    aside = [p for p in (d / "checkpoints").iterdir() if p.name.startswith("checkpoint-3.corrupt-")]
    assert len(aside) == 1 and f"Set aside as {aside[0]}" in err, err[-3000:]
    assert metric_steps(d) == [0, 1, 2, 3, 4, 4]
    assert_bit_exact(d, ref)


@pytest.mark.slow
def test_a_checkpoint_whose_recorded_manifest_was_deleted_is_damaged_not_an_older_ones(runs, tmp_path):
    """Issue 51: COMPLETE records the manifest's digest, so this slidetune wrote one: without it the
    flipped weights cannot be told from good ones, and the checkpoint is not used."""
    ref, stopped = runs
    d = tmp_path / "run"
    shutil.copytree(stopped, d)
    bad = d / "checkpoints" / "checkpoint-3"
    (bad / MANIFEST).unlink()
    flip_middle(bad / FILES["weights"])
    code, out, err = run_cli(*COMMON, *RUN, "--resume", "auto", "--output-dir", str(d))
    assert code == 0 and "Traceback" not in err, err[-3000:]
    assert f"{bad / MANIFEST}: missing, though COMPLETE records its digest" in err, err[-3000:]
    assert "older slidetune" not in err
    assert_fell_back(d, ref, err, out, bad, bad / MANIFEST)


@pytest.mark.slow
@pytest.mark.parametrize("alteration", ["digest-edited", "entry-dropped", "record-garbled"])
def test_an_altered_manifest_makes_the_checkpoint_damaged(runs, tmp_path, alteration):
    """The manifest changed (a digest edited; the weights' entry dropped and the manifest re-signed,
    with the weights flipped; COMPLETE's record of it garbled): set aside, the older one used."""
    ref, stopped = runs
    d = tmp_path / "run"
    shutil.copytree(stopped, d)
    bad = d / "checkpoints" / "checkpoint-3"
    culprit = bad / MANIFEST
    if alteration == "digest-edited":
        manifest = json.loads(culprit.read_text())
        entry = manifest["files"][FILES["weights"]]
        entry["digest"] = ("0" if entry["digest"][0] != "0" else "1") + entry["digest"][1:]
        culprit.write_text(json.dumps(manifest))
    elif alteration == "entry-dropped":
        drop_entry(bad, FILES["weights"])
        flip_middle(bad / FILES["weights"])
        culprit = bad / FILES["weights"]
    else:
        complete = json.loads((bad / "COMPLETE").read_text())
        (bad / "COMPLETE").write_text(json.dumps({**complete, MANIFEST: "garbled"}))
        culprit = bad / "COMPLETE"
    code, out, err = run_cli(*COMMON, *RUN, "--resume", "auto", "--output-dir", str(d))
    assert code == 0 and "Traceback" not in err, err[-3000:]
    assert_fell_back(d, ref, err, out, bad, culprit)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["intact", "weights-shape", "optimizer-shape", "weights-dtype"])
def test_a_checkpoint_of_an_older_slidetune_is_used_only_once_its_tensors_fit_the_model(runs, tmp_path, damage):
    """No manifest anywhere (every checkpoint as an older slidetune wrote it): the newest resumes with
    a warning that its tensors were checked against the model and its bytes could not be; one with a
    tensor of another shape or dtype is set aside like any damaged checkpoint, the older one used."""
    ref, stopped = runs
    d = tmp_path / "run"
    shutil.copytree(stopped, d)
    for ckpt in (d / "checkpoints").iterdir():
        make_legacy(ckpt)
    bad = d / "checkpoints" / "checkpoint-3"
    kind = damage.split("-")[0]
    path = bad / FILES["weights" if damage == "intact" else kind]
    if damage.endswith("shape"):
        # the same bytes, one tensor's two dimensions swapped (or a flat moment made 2-D)
        tensors = safetensors.torch.load_file(path)
        name = next(k for k, v in tensors.items() if v.dim() >= 1 and v.numel() > 1 and
                    (v.dim() == 1 or v.shape[0] != v.shape[1]))
        t = tensors[name]
        tensors[name] = t.reshape(2, -1) if t.dim() == 1 else t.reshape(t.shape[1], t.shape[0])
        safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})
    elif damage.endswith("dtype"):
        wrong_type(path, kind)
    code, out, err = run_cli(*COMMON, *RUN, "--resume", "auto", "--output-dir", str(d))
    assert code == 0 and "Traceback" not in err, err[-3000:]
    if damage == "intact":
        assert f"resumed from {bad} at step 3 of 4" in out
        assert f"warning: {bad} has no MANIFEST.json (written by an older slidetune)" in err, err[-3000:]
        assert "names, shapes and dtypes match the model" in err
        assert metric_steps(d) == [0, 1, 2, 3, 4, 4]
        assert_bit_exact(d, ref)
    else:
        assert "written by an older slidetune" in err
        assert_fell_back(d, ref, err, out, bad, path)
