"""`slidetune train` bad inputs and failures (issue 3's table): the message, the exit code, nothing lost.

A module-scoped finished run (`prev`) is the "earlier output": every error detected at
start-up is provoked with `--output-dir` pointing at it, and its files must be
byte-for-byte untouched afterwards. Failures during training (NaN, disk full, signals)
run in their own directories and check what they keep.
"""
from __future__ import annotations

import contextlib
import csv
import errno
import hashlib
import io
import json
import math
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from slidetune import run_setup
from slidetune import train_setup as train_mod
from slidetune.cli import main
from slidetune.engine.result import StepResult
from slidetune.data.corpus import builtin_corpus
from test_train_e2e import after_each_step, norm_read_spy

BASE = ["--model", "tiny-llama", "--seq-len", "32", "--batch-size", "2", "--eval-batches", "2",
        "--progress", "false", "--device", "cpu"]
COMMON = list(BASE)          # + --data <a small slice of the built-in corpus>, set by small_corpus


@pytest.fixture(scope="module", autouse=True)
def small_corpus(tmp_path_factory):
    """40 documents of the built-in corpus (~10K tokens): tokenized in milliseconds, not seconds."""
    path = tmp_path_factory.mktemp("data") / "small.txt"
    path.write_text("\n\n".join(builtin_corpus()[:40]) + "\n")
    COMMON[:] = BASE + ["--data", str(path)]
    return path


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["train", *args])
    return code, out.getvalue(), err.getvalue()


def snapshot(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def metric_steps(run: Path) -> list[int]:
    with (run / "metrics.csv").open(newline="") as f:
        return [int(r["step"]) for r in csv.DictReader(f)]


def assert_loads(ckpt: Path) -> None:
    """A complete checkpoint: transformers loads it and it gives finite logits."""
    from transformers import AutoModelForCausalLM
    assert (ckpt / "COMPLETE").exists(), ckpt
    model = AutoModelForCausalLM.from_pretrained(str(ckpt)).eval()
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 200]])).logits
    assert torch.isfinite(logits).all()


@pytest.fixture(scope="module")
def prev(tmp_path_factory):
    """A finished 2-step run with a checkpoint per step: the earlier output that must survive."""
    d = tmp_path_factory.mktemp("train_errors") / "prev"
    code, out, err = run_cli(*COMMON, "--max-steps", "2", "--save-every", "1", "--output-dir", str(d))
    assert code == 0, err[-3000:]
    snap = snapshot(d)
    assert {"metrics.csv", "loss.png", "config.json", "checkpoints/checkpoint-2/COMPLETE",
            "final/model.safetensors"} <= set(snap)
    return d, snap


def refused(prev, *args: str) -> str:
    """Run with prev's output dir; the run must fail with exit code 2 and leave prev untouched."""
    d, snap = prev
    code, out, err = run_cli(*COMMON, "--max-steps", "2", "--output-dir", str(d), *args)
    assert code == 2, (out[-2000:], err[-2000:])
    assert "slidetune: error:" in err and "Traceback" not in err
    assert snapshot(d) == snap, "earlier outputs were modified"
    return err


# ----------------------------------------------------------------------------- data
def test_missing_data_file(prev, tmp_path):
    path = tmp_path / "nowhere" / "train.jsonl"
    err = refused(prev, "--data", str(path))
    assert str(path) in err and "does not exist" in err and "DataError" in err


def test_malformed_jsonl_line_names_file_and_line(prev, tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"text": "first document"}\n{"text": "second document"}\n{"text": "broken\n')
    err = refused(prev, "--data", str(path))
    assert f"{path}:3:" in err and "malformed JSON" in err


def test_jsonl_record_of_no_known_format_names_the_line(prev, tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"text": "fine"}\n\n{"body": "no known key"}\n')
    err = refused(prev, "--data", str(path))
    assert f"{path}:3:" in err and "'body'" in err and "accepted key sets" in err


def test_empty_data_file(prev, tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    err = refused(prev, "--data", str(path))
    assert str(path) in err and "no examples found" in err


def test_dataset_empty_after_tokenization(prev, tmp_path):
    # (two short documents train now, one per row: tests/test_small_data.py) empty completions
    # leave nothing to train on
    path = tmp_path / "empty_completions.jsonl"
    path.write_text('{"prompt": "Say nothing.", "completion": ""}\n' * 2)
    err = refused(prev, "--data", str(path), "--heldout-fraction", "0")
    assert str(path) in err and "empty after tokenization" in err and "no usable training examples" in err


# ----------------------------------------------------------------------------- optimizer settings, YAML types
def refused_before_the_model(tmp_path, monkeypatch, *args: str) -> str:
    """The run is refused (exit 2, no traceback) before the model loads and the output dir is made."""
    def forbidden(*a, **k):
        raise AssertionError("must be refused before the model loads")

    monkeypatch.setattr(run_setup, "load_model", forbidden)
    code, out, err = run_cli(*COMMON, "--max-steps", "2", "--output-dir", str(tmp_path / "never"), *args)
    assert code == 2, (out[-2000:], err[-2000:])
    assert "slidetune: error:" in err and "Traceback" not in err
    assert not (tmp_path / "never").exists()
    return err


@pytest.mark.parametrize("flag, value, rule", [
    ("--lr", "-1", ">= 0"), ("--lr", "nan", ">= 0"), ("--lr", "inf", ">= 0"),
    ("--beta1", "2", "[0, 1)"), ("--beta1", "-0.1", "[0, 1)"), ("--beta2", "1", "[0, 1)"),
    ("--eps", "0", "> 0"), ("--eps", "-1", "> 0"), ("--weight-decay", "-0.1", ">= 0"),
    ("--epochs", "nan", "> 0"), ("--max-grad-norm", "nan", "not nan")])
def test_bad_optimizer_settings_are_refused_naming_the_flag(tmp_path, monkeypatch, flag, value, rule):
    err = refused_before_the_model(tmp_path, monkeypatch, flag, value)
    assert flag in err and rule in err and value in err, err


@pytest.mark.parametrize("yaml_text, words", [
    ("lr: -1\n", ["c.yaml", "--lr", ">= 0", "-1"]),
    ("lr: .nan\n", ["c.yaml", "--lr", "nan"]),
    ("optim: {beta1: 1.5}\n", ["c.yaml", "--beta1", "[0, 1)", "1.5"]),
    ("optim:\n  eps: 0\n", ["c.yaml", "--eps", "> 0"]),
    ("max_steps: true\n", ["c.yaml", "max_steps", "expected int", "True"]),     # a bool is not an int
    ("tuning: {chunk_mb: yes}\n", ["c.yaml", "runtime.chunk_mb", "expected int"]),
    ("warmup_steps: 1.5\n", ["c.yaml", "warmup_steps", "expected int"]),
    ("min_lr_ratio: false\n", ["c.yaml", "min_lr_ratio", "expected float"])])
def test_bad_yaml_values_are_refused_as_the_flags_are(tmp_path, monkeypatch, yaml_text, words):
    f = tmp_path / "c.yaml"
    f.write_text(yaml_text)
    err = refused_before_the_model(tmp_path, monkeypatch, "--config", str(f))
    assert all(w in err for w in words), (yaml_text, err)


def test_a_flag_replaces_a_bad_yaml_value_and_a_bad_flag_is_not_blamed_on_the_file(tmp_path, monkeypatch):
    from slidetune.cli import build_parser
    from slidetune.config import config_from_args
    f = tmp_path / "c.yaml"
    f.write_text("lr: -1\neps: 1e-6\n")
    cfg = config_from_args(build_parser().parse_args(["train", "--config", str(f), "--lr", "2e-5"]))
    assert cfg.optim.lr == 2e-5 and cfg.optim.eps == 1e-6            # explicit flags win, as always
    err = refused_before_the_model(tmp_path, monkeypatch, "--config", str(f), "--lr", "2e-5", "--beta2", "1")
    assert "--beta2" in err and "c.yaml" not in err, err


def test_yaml_that_is_not_utf8_names_the_file(tmp_path, monkeypatch):
    f = tmp_path / "latin1.yaml"
    f.write_bytes("model: tiny-llama\n# r\u00e9glages\n".encode("latin-1"))
    err = refused_before_the_model(tmp_path, monkeypatch, "--config", str(f))
    assert str(f) in err and "not UTF-8" in err, err


# ----------------------------------------------------------------------------- model
@pytest.mark.parametrize("model", ["no-such-model", "/no/such/hf_dir"])
def test_unknown_model_lists_presets(prev, model):
    err = refused(prev, "--model", model)
    assert repr(model) in err
    for preset in ("smollm2-135m", "tiny-llama", "qwen3-8b", "llama-3.1-8b", "mistral-7b"):
        assert preset in err, preset


def test_seq_len_beyond_context(prev):
    err = refused(prev, "--seq-len", "4096")
    assert "4096" in err and "2048" in err and "max_position_embeddings" in err


# ----------------------------------------------------------------------------- memory
def test_configuration_that_does_not_fit_is_refused_before_allocating(prev, monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("must not get this far")

    monkeypatch.setattr(run_setup, "build_engine", forbidden)       # nothing allocated
    monkeypatch.setattr(train_mod, "build_datasets", forbidden)     # not even the data is tokenized
    monkeypatch.setenv("SLIDETUNE_HOST_MEMORY_BYTES", "3G")
    t0 = time.perf_counter()
    err = refused(prev, "--seq-len", "2048", "--batch-size", "512")
    assert time.perf_counter() - t0 < 20
    assert "InsufficientMemoryError" in err and "host RAM" in err
    assert "needs" in err and "GiB" in err and "3.00 GiB available" in err       # the numbers
    assert "Options that fit" in err                                              # the options:
    m = re.search(r"--batch-size (\d+) --grad-accum (\d+)", err)    # the same 512 sequences per step
    assert m and int(m[1]) < 512 and int(m[1]) * int(m[2]) == 512, err


# ----------------------------------------------------------------------------- resume
def test_resume_from_missing_checkpoint(prev, tmp_path):
    err = refused(prev, "--resume", str(tmp_path / "no-checkpoint"))
    assert "no-checkpoint" in err and "--resume auto" in err


def test_resume_beyond_max_steps(prev):
    err = refused(prev, "--resume", "auto", "--max-steps", "1")
    assert "step 2" in err and "1 steps" in err


def test_fresh_run_replaces_an_earlier_runs_checkpoints(prev, tmp_path):
    d = tmp_path / "rerun"
    shutil.copytree(prev[0], d)
    code, out, err = run_cli(*COMMON, "--max-steps", "1", "--output-dir", str(d))
    assert code == 0, err[-2000:]
    assert "earlier run" in err and "--resume auto" in err
    # the earlier run's checkpoint-2 is gone: it is not mistaken for this run's newest
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == ["checkpoint-1"]
    assert json.loads((d / "checkpoints/checkpoint-1/COMPLETE").read_text())["step"] == 1
    assert metric_steps(d) == [0, 1, 1]


# ----------------------------------------------------------------------------- NaN / inf
@pytest.mark.parametrize("what", ["loss", "grad_norm"])
def test_non_finite_step_stops_naming_the_step(tmp_path, what):
    d = tmp_path / "nan"

    def poison(engine, res):
        if engine.step_index == 3:
            if what == "loss":
                return StepResult(loss=float("nan"), n_tokens=res.n_tokens, grad_norm_value=res.grad_norm())
            return StepResult(loss=res.loss, n_tokens=res.n_tokens, grad_norm_value=float("inf"))
        return res

    with after_each_step(poison):
        code, out, err = run_cli(*COMMON, "--max-steps", "4", "--save-every", "1", "--output-dir", str(d))
    assert code == 2, err[-2000:]
    assert "TrainingError" in err and "at step 3" in err and "non-finite" in err
    assert "Hint" in err and "--lr" in err and "--warmup-steps" in err and "--resume auto" in err
    assert "checkpoint-2" in err and "intact" in err
    # metrics up to the failure are kept (held-out eval at 0, steps 1 and 2), the plot too
    assert metric_steps(d) == [0, 1, 2]
    with (d / "metrics.csv").open(newline="") as f:
        assert all(math.isfinite(float(r["loss"])) for r in csv.DictReader(f) if r["loss"])
    assert (d / "loss.png").read_bytes()[:4] == b"\x89PNG"
    # the previous checkpoint is intact and resumable, nothing of step 3 was saved
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == ["checkpoint-1", "checkpoint-2"]
    assert_loads(d / "checkpoints/checkpoint-2")
    assert json.loads((d / "checkpoints/checkpoint-2/trainer_state/state.json").read_text())["step"] == 2
    assert not (d / "final").exists()


# ----------------------------------------------------------------------------- disk full
def fill_disk_for(monkeypatch, fragment: str, on_full=None):
    """A disk that fills under the checkpoint files whose path holds `fragment`: their write raises
    ENOSPC (after `on_full()`, where given); the others are written. Returns the real writer."""
    import slidetune.checkpoint.writer as writer_mod
    real = writer_mod.write_safetensors

    def write(tensors, filename, *args, **kwargs):
        if fragment in str(filename):
            if on_full is not None:
                on_full()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(filename))
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(writer_mod, "write_safetensors", write)
    return real


def test_disk_full_while_saving_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import slidetune.checkpoint.writer as writer_mod
    d = tmp_path / "full"
    seen = {}
    real = fill_disk_for(monkeypatch, "checkpoint-2",
                         on_full=lambda: seen.setdefault("before", snapshot(d / "checkpoints/checkpoint-1")))
    code, out, err = run_cli(*COMMON, "--max-steps", "3", "--save-every", "1", "--output-dir", str(d))
    assert code == 2, err[-2000:]
    assert "No space left on device" in err
    assert "checkpoint-1 is intact" in err and "--resume auto" in err
    assert seen, "the failing save was not reached"
    # intact: byte for byte as before the failed save, loadable, and nothing half-written left
    assert snapshot(d / "checkpoints/checkpoint-1") == seen["before"]
    assert [p.name for p in (d / "checkpoints").iterdir()] == ["checkpoint-1"]
    assert_loads(d / "checkpoints/checkpoint-1")
    assert metric_steps(d) == [0, 1, 2]
    assert not (d / "final").exists()

    # and the run continues from it once there is space again
    monkeypatch.setattr(writer_mod, "write_safetensors", real)
    code, out, err = run_cli(*COMMON, "--max-steps", "3", "--save-every", "1", "--resume", "auto",
                             "--output-dir", str(d))
    assert code == 0, err[-2000:]
    assert "resumed from" in out and "at step 1 of 3" in out
    assert metric_steps(d) == [0, 1, 2, 3, 3]
    assert_loads(d / "final")


class _FullDisk:
    """A file on a disk that fills up: a write gets half its data through, then fails with ENOSPC
    (a partial file is left behind, as on a real full disk)."""

    def __init__(self, f):
        self.f = f

    def write(self, data):
        self.f.write(data[:len(data) // 2])
        self.f.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def __getattr__(self, name):
        return getattr(self.f, name)


@pytest.mark.parametrize("name, nth", [("metrics.csv", 3), ("config.json", 1), ("summary.json", 1)])
def test_disk_full_writing_a_run_file_names_it_and_leaves_no_tmp(tmp_path, monkeypatch, name, nth):
    """ENOSPC while metrics.csv is appended (at step 3: step 2's rows are on disk), config.json (before
    step 1) or summary.json (at the end) is written: the message names the file, no `<name>.tmp` is
    left and the previous version of the file is unchanged (metrics.csv is cut back to its rows before)."""
    d = tmp_path / "full"
    real_open, opened, before = Path.open, [], {}

    def writes_target(path: Path, mode: str) -> bool:
        if name == "metrics.csv":                        # appended in place, row by row
            return path.name == name and "a" in mode
        return path.name == f"{name}.tmp" and "w" in mode

    def open_(self, mode="r", *a, **k):
        if writes_target(self, mode):
            opened.append(self)
            if len(opened) >= nth:                       # the disk stays full from then on
                if len(opened) == nth:
                    target = self.with_name(name)
                    before["bytes"] = target.read_bytes() if target.exists() else None
                return _FullDisk(real_open(self, mode, *a, **k))
        return real_open(self, mode, *a, **k)
    monkeypatch.setattr(Path, "open", open_)
    code, out, err = run_cli(*COMMON, "--max-steps", "3", "--output-dir", str(d))
    assert len(opened) >= nth, "the failing write was not reached"
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert f"could not write {d / name}: No space left on device" in err, err[-2000:]
    assert not [p.name for p in d.rglob("*.tmp*")]
    after = (d / name).read_bytes() if (d / name).exists() else None
    assert after == before["bytes"]                      # the previous version, as it was
    if name == "metrics.csv":
        assert metric_steps(d) == [0, 1]                 # the rows written at step 2


def test_disk_full_drawing_loss_png_is_a_note(tmp_path, monkeypatch):
    """loss.png is best effort: a full disk is a note naming it, the run succeeds, no temporary left."""
    from matplotlib.figure import Figure
    d = tmp_path / "png"

    def savefig(self, fname, **kw):
        Path(fname).write_bytes(b"\x89PNG partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(Figure, "savefig", savefig)
    code, out, err = run_cli(*COMMON, "--max-steps", "1", "--output-dir", str(d))
    assert code == 0, err[-2000:]
    assert f"could not write {d / 'loss.png'}: No space left on device" in err
    assert not [p.name for p in d.rglob("*.tmp*")] and not (d / "loss.png").exists()


@pytest.mark.parametrize("content", ["[1, 2]", "{not json", b"\xff\xfe"])
def test_invalid_run_config_on_resume_is_named(tmp_path, capsys, content):
    """A checkpoint without its own config record is compared with the run's config.json: one that is
    not a JSON object of settings is named in a note, and the resume goes on."""
    from slidetune.config import TrainConfig
    ckpt = tmp_path / "checkpoints" / "checkpoint-1"
    ckpt.mkdir(parents=True)
    run_config = tmp_path / "config.json"
    if isinstance(content, bytes):
        run_config.write_bytes(content)
    else:
        run_config.write_text(content)
    train_mod._warn_changed_config(ckpt, run_config, TrainConfig())
    err = capsys.readouterr().err
    assert f"note: {run_config} cannot be read as the run's config" in err, err


# ----------------------------------------------------------------------------- Ctrl-C / SIGTERM
def test_ctrl_c_writes_a_resumable_checkpoint_and_exits_130(tmp_path):
    d = tmp_path / "sigint"

    def ctrl_c(engine, res):
        if engine.step_index == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return res

    handler = signal.getsignal(signal.SIGINT)
    with after_each_step(ctrl_c):
        code, out, err = run_cli(*COMMON, "--max-steps", "3", "--output-dir", str(d))
    assert signal.getsignal(signal.SIGINT) == handler
    assert code == 130, err[-2000:]
    assert "stopped by SIGINT after step 1 of 3" in err and "--resume auto" in err
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == ["checkpoint-1"]
    state = json.loads((d / "checkpoints/checkpoint-1/trainer_state/state.json").read_text())
    assert state["step"] == 1 and state["with_optimizer"]
    assert_loads(d / "checkpoints/checkpoint-1")
    assert metric_steps(d) == [0, 1] and not (d / "final").exists()
    assert json.loads((d / "summary.json").read_text())["interrupted"] is True


def test_second_ctrl_c_stops_at_once_keeping_the_last_checkpoint(tmp_path):
    d = tmp_path / "sigint2"

    def ctrl_c_twice(engine, res):
        if engine.step_index == 2:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return res

    with after_each_step(ctrl_c_twice):
        code, out, err = run_cli(*COMMON, "--max-steps", "3", "--save-every", "1", "--output-dir", str(d))
    assert code == 130
    assert "interrupted twice" in err and "checkpoint-1" in err and "intact" in err
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == ["checkpoint-1"]
    assert_loads(d / "checkpoints/checkpoint-1")
    assert metric_steps(d) == [0, 1]


def test_next_step_is_issued_before_the_last_steps_norm_is_awaited(tmp_path):
    """A step's gradient norm waits for all of its host updates: the loop reads it only once
    the next step is issued, so those updates overlap the next forward (benchmarks/NOTES.md "Measuring a step").
    Steps that must be complete at once (here the last) are checked right away."""
    events: list[tuple[str, int]] = []
    run = tmp_path / "run"
    with after_each_step(norm_read_spy(events)):
        code, out, err = run_cli(*COMMON, "--max-steps", "4", "--eval-every", "0", "--save-every", "0",
                                 "--output-dir", str(run))
    assert code == 0, err
    assert events == [("issued", 0), ("issued", 1), ("norm", 0), ("issued", 2), ("norm", 1), ("issued", 3),
                      ("norm", 2), ("norm", 3)]
    assert sorted({s for s in metric_steps(run) if s}) == [1, 2, 3, 4]      # + the final eval row
