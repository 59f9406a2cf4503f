"""The run directory across killed invocations: what a killed save leaves, and which config a
resume is compared with.

  - a save killed mid-way (kill -9, the OOM killer) leaves `<name>.tmp-<pid>` / `<name>.old-<pid>`
    beside `final/` or a checkpoint: the next run removes those of dead processes, and restores
    a complete `.old-` where the directory it was set aside from is missing;
  - a fresh run rewrites config.json before its first save: a resume of the earlier run's
    checkpoint is compared with the config saved inside that checkpoint, not with config.json.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from slidetune import train_setup as train_mod
from slidetune.checkpoint import recover_leftovers
from slidetune.config import TrainConfig, config_to_dict
from test_train_e2e import after_each_step
from test_train_errors import (COMMON, assert_loads, metric_steps, prev, run_cli,  # noqa: F401
                               small_corpus, snapshot)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def fake_save(path: Path, complete: bool, tag: str = "") -> Path:
    """A directory as a save leaves it: some weights, and the COMPLETE marker once whole."""
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"\0" * 4096)
    if complete:
        (path / "COMPLETE").write_text(json.dumps({"tag": tag}))
    return path


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


# ----------------------------------------------------------------------------- recover_leftovers
def test_recover_leftovers_removes_dead_savers_and_keeps_live_ones(tmp_path):
    dead, live = dead_pid(), os.getppid()
    fake_save(tmp_path / "final", complete=True, tag="current")
    fake_save(tmp_path / f"final.tmp-{dead}", complete=False)                # killed while writing
    fake_save(tmp_path / f"final.old-{dead}", complete=True, tag="older")    # killed while deleting it
    fake_save(tmp_path / f"final.tmp-{os.getpid()}", complete=False)         # an earlier process with our pid
    fake_save(tmp_path / f"final.tmp-{live}", complete=False)                # a save still running
    fake_save(tmp_path / f"checkpoint-3.tmp-{dead}", complete=False)         # not asked about
    assert recover_leftovers(tmp_path, "final") == []
    assert leftovers(tmp_path) == sorted([f"final.tmp-{live}", f"checkpoint-3.tmp-{dead}"])
    assert json.loads((tmp_path / "final/COMPLETE").read_text())["tag"] == "current"
    assert recover_leftovers(tmp_path) == []
    assert leftovers(tmp_path) == [f"final.tmp-{live}"]
    assert recover_leftovers(tmp_path / "missing") == []


def test_recover_leftovers_restores_a_complete_old_directory(tmp_path):
    dead = dead_pid()
    # killed between the two renames of an overwrite: the old one whole in .old-, the new one in .tmp-
    fake_save(tmp_path / f"final.old-{dead}", complete=True, tag="old")
    fake_save(tmp_path / f"final.tmp-{dead}", complete=True, tag="new")
    assert recover_leftovers(tmp_path, "final") == [(tmp_path / f"final.old-{dead}", tmp_path / "final")]
    assert json.loads((tmp_path / "final/COMPLETE").read_text())["tag"] == "old"
    assert leftovers(tmp_path) == []
    # an unfinished .old- is not a whole copy: deleted, nothing restored
    fake_save(tmp_path / f"checkpoint-2.old-{dead}", complete=False)
    assert recover_leftovers(tmp_path) == [] and leftovers(tmp_path) == []
    assert not (tmp_path / "checkpoint-2").exists()


# ----------------------------------------------------------------------------- end to end
def test_a_new_run_removes_what_a_killed_export_left(prev, tmp_path):
    """kill -9 during the final/ export left final.tmp-<pid> (and final.old-<pid>) in the output
    directory: a fresh run into it removes them at once, even one that exports nothing."""
    d = tmp_path / "rerun"
    shutil.copytree(prev[0], d)
    final_before = snapshot(d / "final")
    dead, live = dead_pid(), os.getppid()
    fake_save(d / f"final.tmp-{dead}", complete=False)
    fake_save(d / f"final.old-{dead}", complete=True)           # final exists: nothing to restore
    fake_save(d / f"final.tmp-{live}", complete=False)
    fake_save(d / "checkpoints" / f"checkpoint-2.tmp-{dead}", complete=False)
    code, out, err = run_cli(*COMMON, "--max-steps", "2", "--stop-after", "1", "--output-dir", str(d))
    assert code == 0, err[-2000:]
    assert leftovers(d) == [f"final.tmp-{live}"]
    assert leftovers(d / "checkpoints") == []
    assert snapshot(d / "final") == final_before and "restored" not in err


def test_resume_restores_a_final_set_aside_by_a_killed_export(prev, tmp_path):
    """Killed between the export's two renames: final/ is missing, the previous export is whole in
    final.old-<pid>. `--resume auto` puts it back (and drops the half-written final.tmp-<pid>)."""
    d = tmp_path / "resume"
    shutil.copytree(prev[0], d)
    final_before = snapshot(d / "final")
    dead = dead_pid()
    os.replace(d / "final", d / f"final.old-{dead}")
    fake_save(d / f"final.tmp-{dead}", complete=False)
    # resumed at step 2 and stopped after step 3 of 4: this invocation exports nothing itself
    code, out, err = run_cli(*COMMON, "--max-steps", "4", "--stop-after", "1", "--resume", "auto",
                             "--output-dir", str(d))
    assert code == 0, err[-2000:]
    assert "at step 2 of 4" in out
    assert f"restored the complete copy that a killed save had set aside in final.old-{dead}" in err
    assert leftovers(d) == []
    assert snapshot(d / "final") == final_before
    assert_loads(d / "final")


# ----------------------------------------------------------------------------- the config of a resume
def test_resume_is_compared_with_the_checkpoints_own_config(prev, tmp_path):
    """A fresh run with another --lr rewrites config.json and is killed before its first save: the
    newest checkpoint is still the earlier run's. Resuming it with the earlier flags says nothing;
    resuming it with the killed run's flags says the settings differ."""
    flags = ["--max-steps", "2", "--save-every", "1"]          # prev's, but for --lr
    d = tmp_path / "killed"
    shutil.copytree(prev[0], d)
    state = json.loads((d / "checkpoints/checkpoint-2/trainer_state/state.json").read_text())
    assert state["trainer_state"]["config"]["optim"]["lr"] == 1e-5          # saved with the checkpoint

    def killed(engine, res):
        if engine.step_index == 1:           # before any save: a second signal stops at once
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return res

    with after_each_step(killed):
        code, out, err = run_cli(*COMMON, *flags, "--lr", "2e-5", "--output-dir", str(d))
    assert code == 130 and "interrupted twice" in err
    assert json.loads((d / "config.json").read_text())["optim"]["lr"] == 2e-5
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == ["checkpoint-1", "checkpoint-2"]
    d2 = tmp_path / "killed2"
    shutil.copytree(d, d2)

    code, out, err = run_cli(*COMMON, *flags, "--resume", "auto", "--output-dir", str(d))
    assert code == 0, err[-2000:]
    assert "at step 2 of 2" in out and "differ" not in err

    code, out, err = run_cli(*COMMON, *flags, "--lr", "2e-5", "--resume", "auto", "--output-dir", str(d2))
    assert code == 0, err[-2000:]
    assert "at step 2 of 2" in out
    assert "settings that differ from those checkpoint-2 was saved with" in err
    assert "optim.lr: 1e-05 -> 2e-05" in err


def test_checkpoint_without_a_saved_config_is_compared_with_config_json(tmp_path, capsys):
    """Checkpoints written before the config was saved with them fall back to the run's config.json."""
    old = TrainConfig()
    new = dataclasses.replace(old, optim=dataclasses.replace(old.optim, lr=2 * old.optim.lr))
    run_config = tmp_path / "config.json"
    run_config.write_text(json.dumps(config_to_dict(old)))
    ckpt = tmp_path / "checkpoints" / "checkpoint-3"
    (ckpt / "trainer_state").mkdir(parents=True)
    (ckpt / "trainer_state" / "state.json").write_text(json.dumps({"step": 3, "trainer_state": {"step": 3}}))
    train_mod._warn_changed_config(ckpt, run_config, new)
    err = capsys.readouterr().err
    assert "the run's saved config.json" in err and f"optim.lr: {old.optim.lr!r} -> {new.optim.lr!r}" in err
    # with its own config, the checkpoint's wins over config.json
    (ckpt / "trainer_state" / "state.json").write_text(
        json.dumps({"step": 3, "trainer_state": {"step": 3, "config": config_to_dict(new)}}))
    train_mod._warn_changed_config(ckpt, run_config, new)
    assert capsys.readouterr().err == ""
