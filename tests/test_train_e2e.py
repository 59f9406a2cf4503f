"""`slidetune train` end to end on the CPU: the CSV, the plot, the checkpoints, resume equivalence, the config.

One module-scoped fixture runs the CLI in-process (the tiny preset with the embedded
tokenizer, loaded once per process) and the tests inspect what the runs left:

  A  4 steps uninterrupted, configured by a YAML file plus overriding flags;
  B  --max-steps 4 --stop-after 2, then --resume auto;
  C  --max-steps 4 stopped by a SIGTERM sent to this process after step 2, then --resume auto.
"""
from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import re
import signal
from pathlib import Path

import pytest
import torch

from slidetune import run_setup
from slidetune.cli import build_parser, main
from slidetune.config import CPU_DEFAULT_JOB, TrainConfig, _FLAG_NAMES, _leaf_fields, config_from_args, config_to_dict, tuning_paths
from slidetune.data.corpus import builtin_corpus

BASE = ["--model", "tiny-llama", "--seq-len", "32", "--batch-size", "2", "--eval-batches", "2",
        "--progress", "false", "--device", "cpu"]
COMMON = list(BASE)          # + --data <a small slice of the built-in corpus>, set by small_corpus


@pytest.fixture(scope="module", autouse=True)
def small_corpus(tmp_path_factory):
    """40 documents of the built-in corpus (~10K tokens): tokenized in milliseconds, not seconds."""
    path = tmp_path_factory.mktemp("data") / "small.jsonl"
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in builtin_corpus()[:40]))
    COMMON[:] = BASE + ["--data", str(path)]
    return path
REQUIRED = ["step", "loss", "lr", "grad_norm", "tokens_per_s", "gpu_peak_alloc_gib", "cpu_rss_gib"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["train", *args])
    return code, out.getvalue(), err.getvalue()


def read_metrics(run: Path) -> list[dict]:
    with (run / "metrics.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def train_losses(run: Path) -> dict[int, float]:
    return {int(r["step"]): float(r["loss"]) for r in read_metrics(run) if r["loss"]}


def weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(directory / "model.safetensors"))


def norm_read_spy(events: list[tuple[str, int]]):
    """An after_each_step hook recording ("issued", n) as step n (0-based) is issued and ("norm", n)
    when its gradient norm is read (the step is then complete: every update applied)."""
    def spy(engine, res):
        n = sum(1 for kind, _ in events if kind == "issued")
        events.append(("issued", n))
        real_norm = res.grad_norm

        def norm():
            events.append(("norm", n))
            return real_norm()
        res.grad_norm = norm
        return res
    return spy


@contextlib.contextmanager
def after_each_step(hook):
    """Wrap every engine built by the trainer: `hook(engine, result)` runs after each of its
    train_step calls and returns the result the trainer gets."""
    real = run_setup.build_engine

    def build(*args, **kwargs):
        engine = real(*args, **kwargs)
        inner = engine.train_step

        def train_step(mbs, lr):
            return hook(engine, inner(mbs, lr))

        engine.train_step = train_step
        return engine

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(run_setup, "build_engine", build)
        yield


@contextlib.contextmanager
def signal_after_step(sig: int, step: int):
    """Wrap every engine built by the trainer so that `sig` is sent to this process after its step `step`."""
    def send(engine, res):
        if engine.step_index == step:
            os.kill(os.getpid(), sig)
        return res

    with after_each_step(send):
        yield


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_corpus):
    base = tmp_path_factory.mktemp("train_e2e")
    r: dict = {"base": base}

    # A: YAML (nested sections and flat flag-style keys) + flags that override it.
    yaml_file = base / "job.yaml"
    yaml_file.write_text(
        "model: tiny-llama\n"
        f"data:\n  path: {small_corpus}\n  seq_len: 32\n"
        "runtime:\n  device: cpu\n"
        "batch-size: 2\n"
        "eval_batches: 2\n"
        "progress: false\n"
        "max_steps: 99          # overridden by --max-steps\n"
        "output_dir: not/used   # overridden by --output-dir\n")
    r["yaml"] = yaml_file
    a = base / "A"
    r["A"] = a
    r["A_run"] = run_cli("--config", str(yaml_file), "--max-steps", "4", "--output-dir", str(a))

    # B: stop after 2 steps (the schedule of a 4-step run), then resume.
    b = base / "B"
    r["B"] = b
    r["B_first"] = run_cli(*COMMON, "--max-steps", "4", "--stop-after", "2", "--output-dir", str(b))
    r["B_after_first"] = {"checkpoints": sorted(p.name for p in (b / "checkpoints").iterdir()),
                          "final": (b / "final").exists(), "steps": [r_["step"] for r_ in read_metrics(b)]}
    r["B_second"] = run_cli(*COMMON, "--max-steps", "4", "--resume", "auto", "--output-dir", str(b))

    # C: SIGTERM after step 2, then resume.
    c = base / "C"
    r["C"] = c
    handler_before = signal.getsignal(signal.SIGTERM)
    with signal_after_step(signal.SIGTERM, 2):
        r["C_first"] = run_cli(*COMMON, "--max-steps", "4", "--output-dir", str(c))
    r["C_handler_restored"] = signal.getsignal(signal.SIGTERM) == handler_before
    r["C_after_first"] = {"checkpoints": sorted(p.name for p in (c / "checkpoints").iterdir()),
                          "final": (c / "final").exists(), "steps": [r_["step"] for r_ in read_metrics(c)],
                          "png": (c / "loss.png").exists()}
    r["C_second"] = run_cli(*COMMON, "--max-steps", "4", "--resume", "auto", "--output-dir", str(c))
    return r


# ----------------------------------------------------------------------------- (a) the CSV
def test_runs_succeed(runs):
    for key in ("A_run", "B_first", "B_second", "C_second"):
        code, out, err = runs[key]
        assert code == 0, (key, out[-2000:], err[-2000:])
    assert "slidetune train: tiny-llama on " in runs["A_run"][1]
    assert "held-out before training" in runs["A_run"][1] and "held-out after training" in runs["A_run"][1]


def test_metrics_csv_columns_and_finite_training_rows(runs):
    rows = read_metrics(runs["A"])
    assert set(REQUIRED) <= set(rows[0].keys())
    training = [r for r in rows if r["loss"]]
    assert [int(r["step"]) for r in training] == [1, 2, 3, 4]
    for r in training:
        for col in REQUIRED:
            assert math.isfinite(float(r[col])), (col, r)
        assert float(r["tokens_per_s"]) > 0 and float(r["cpu_rss_gib"]) > 0 and float(r["grad_norm"]) > 0
    # held-out evaluation before (step 0) and after (step 4)
    evals = [(int(r["step"]), float(r["eval_loss"])) for r in rows if r["eval_loss"]]
    assert [s for s, _ in evals] == [0, 4] and all(math.isfinite(v) for _, v in evals)
    summary = json.loads((runs["A"] / "summary.json").read_text())
    assert summary["steps"] == 4 and not summary["interrupted"] and math.isfinite(summary["ppl_after"])


# ----------------------------------------------------------------------------- (b) the plot
def test_loss_png(runs):
    png = runs["A"] / "loss.png"
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000


# ----------------------------------------------------------------------------- (c) reload
@pytest.mark.parametrize("sub", ["final", "checkpoints/checkpoint-4"])
def test_exports_reload_with_transformers(runs, sub):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    directory = runs["A"] / sub
    assert (directory / "COMPLETE").exists()
    model = AutoModelForCausalLM.from_pretrained(str(directory)).eval()
    tok = AutoTokenizer.from_pretrained(str(directory))
    ids = torch.tensor([tok("The quick brown fox jumps over the lazy dog.")["input_ids"]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()
    # the exported weights are the trained masters
    mine = weights(directory)
    for name, p in model.state_dict().items():
        if name in mine:
            torch.testing.assert_close(p, mine[name], rtol=0, atol=0)


def test_checkpoints_are_resumable_and_final_is_an_export(runs):
    state = json.loads((runs["A"] / "checkpoints/checkpoint-4/trainer_state/state.json").read_text())
    assert state["step"] == 4 and state["with_optimizer"]
    assert (runs["A"] / "checkpoints/checkpoint-4/trainer_state/optimizer.safetensors").exists()
    assert not (runs["A"] / "final/trainer_state/optimizer.safetensors").exists()


# ----------------------------------------------------------------------------- (d) resume
def _assert_same_run(ref: Path, other: Path):
    ref_rows, rows = read_metrics(ref), read_metrics(other)
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows]          # no duplicated rows
    a, b = train_losses(ref), train_losses(other)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-6), step
    for sub in ("final", "checkpoints/checkpoint-4"):
        wa, wb = weights(ref / sub), weights(other / sub)
        assert wa.keys() == wb.keys()
        for name in wa:
            torch.testing.assert_close(wb[name], wa[name], rtol=1e-6, atol=0, msg=f"{sub}: {name}")
    from safetensors.torch import load_file
    oa = load_file(str(ref / "checkpoints/checkpoint-4/trainer_state/optimizer.safetensors"))
    ob = load_file(str(other / "checkpoints/checkpoint-4/trainer_state/optimizer.safetensors"))
    for name in oa:
        torch.testing.assert_close(ob[name], oa[name], rtol=1e-6, atol=0, msg=name)


def test_stop_after_leaves_a_resumable_checkpoint(runs):
    code, out, _ = runs["B_first"]
    assert code == 0
    assert "--stop-after 2" in out and "--resume auto" in out
    assert runs["B_after_first"] == {"checkpoints": ["checkpoint-2"], "final": False,
                                     "steps": ["0", "1", "2"]}
    assert "resumed from" in runs["B_second"][1] and "at step 2 of 4" in runs["B_second"][1]
    assert "differ" not in runs["B_second"][2]           # same settings: no warning


def test_resume_after_stop_after_matches_uninterrupted(runs):
    _assert_same_run(runs["A"], runs["B"])


def test_sigterm_writes_checkpoint_and_exits_130(runs):
    code, out, err = runs["C_first"]
    assert code == 130, (out[-2000:], err[-2000:])
    assert "SIGTERM" in err and "after step 2 of 4" in err and "--resume auto" in err
    assert runs["C_after_first"] == {"checkpoints": ["checkpoint-2"], "final": False,
                                     "steps": ["0", "1", "2"], "png": True}
    assert runs["C_handler_restored"]
    summary = json.loads((runs["C"] / "summary.json").read_text())   # rewritten by the resumed run
    assert summary["steps"] == 4 and not summary["interrupted"]


def test_resume_after_sigterm_matches_uninterrupted(runs):
    _assert_same_run(runs["A"], runs["C"])


def test_resume_of_finished_run_does_not_duplicate_rows(runs, tmp_path):
    import shutil
    d = tmp_path / "again"
    shutil.copytree(runs["A"], d)
    code, out, err = run_cli(*COMMON, "--max-steps", "4", "--resume", "auto", "--output-dir", str(d))
    assert code == 0, err[-2000:]
    assert [r["step"] for r in read_metrics(d)] == [r["step"] for r in read_metrics(runs["A"])]
    for name, t in weights(runs["A"] / "final").items():
        torch.testing.assert_close(weights(d / "final")[name], t, rtol=0, atol=0)


def test_resume_with_changed_settings_says_so(runs, tmp_path):
    import shutil
    d = tmp_path / "changed"
    shutil.copytree(runs["B"], d)
    shutil.rmtree(d / "checkpoints" / "checkpoint-4")          # back to the state after the stop at step 2
    code, out, err = run_cli(*COMMON, "--max-steps", "4", "--lr", "2e-5", "--resume", "auto",
                             "--output-dir", str(d))
    assert code == 0, err[-2000:]
    assert "at step 2 of 4" in out
    assert "differ" in err and "optim.lr: 1e-05 -> 2e-05" in err


# ----------------------------------------------------------------------------- (e) the config
def _help_text() -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exc:
        main(["train", "--help"])
    assert exc.value.code == 0
    return out.getvalue()


def test_help_lists_every_field_with_its_default():
    text = _help_text()
    defaults = TrainConfig()
    entries = {}
    # one entry per option: from "  --flag" to the next option line
    for m in re.finditer(r"^  (--[\w-]+)(.*?)(?=^  -|\Z)", text, flags=re.S | re.M):
        entries[m.group(1)] = " ".join(m.group(2).split())
    knobs = tuning_paths()
    for path, f in _leaf_fields(TrainConfig):
        flag = _FLAG_NAMES.get(path, path.split(".")[-1])
        if flag is None:
            continue                     # data.seed follows --seed
        if path in knobs:
            assert "--" + flag.replace("_", "-") not in entries, f"tuning knob {path} in --help (--help-tuning has it)"
            continue
        obj = defaults
        for part in path.split(".")[:-1]:
            obj = getattr(obj, part)
        default = getattr(obj, f.name)
        opt = "--" + flag.replace("_", "-")
        assert opt in entries, f"{opt} ({path}) missing from --help"
        assert f"(default: {default})" in entries[opt], (opt, entries[opt])
        assert len(entries[opt]) > len(f"(default: {default})") + 8, f"{opt} has no description"
    assert "--stop-after" in entries and "resumable checkpoint" in entries["--stop-after"]


def test_resolved_config_saved_yaml_and_flag_precedence(runs):
    saved = json.loads((runs["A"] / "config.json").read_text())
    assert saved["max_steps"] == 4                        # flag over YAML (99)
    assert saved["output_dir"] == str(runs["A"])          # flag over YAML
    assert saved["data"]["seq_len"] == 32                 # YAML (nested) over the default 256
    assert saved["batch_size"] == 2                       # YAML flat flag-style key `batch-size`
    assert saved["model"] == "tiny-llama" and saved["progress"] is False
    assert saved["optim"]["lr"] == TrainConfig().optim.lr  # default where neither says
    # the saved config is valid --config input and reproduces the run's config
    ns = build_parser().parse_args(["train", "--config", str(runs["A"] / "config.json")])
    assert json.loads(json.dumps(config_to_dict(config_from_args(ns)))) == saved


def test_yaml_values_are_converted_and_checked(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("lr: 1e-4\nmax_grad_norm: 0\nseq-len: '64'\ndata: corpus.txt\noffload_activations: yes\n")
    cfg = config_from_args(build_parser().parse_args(["train", "--config", str(f), "--lr", "3e-4"]))
    assert cfg.optim.lr == 3e-4                              # flag wins
    cfg = config_from_args(build_parser().parse_args(["train", "--config", str(f)]))
    assert cfg.optim.lr == 1e-4 and isinstance(cfg.optim.lr, float)   # YAML reads 1e-4 as a string
    assert cfg.max_grad_norm is None and cfg.data.seq_len == 64 and cfg.data.path == "corpus.txt"
    assert cfg.runtime.offload_activations == "on"
    for bad, words in (("batch_size: lots\n", ["batch_size", "lots"]),
                       ("no_such_field: 1\n", ["no_such_field", "known fields"]),
                       ("runtime: {bogus: 1}\n", ["bogus", "runtime"]),
                       ("model: [unclosed\n", ["not valid YAML"])):
        f.write_text(bad)
        code, out, err = run_cli("--config", str(f), "--output-dir", str(tmp_path / "never"))
        assert code == 2, (bad, err)
        assert "slidetune: error:" in err and all(w in err for w in words), (bad, err)
        assert not (tmp_path / "never").exists()
    code, _, err = run_cli("--config", str(tmp_path / "missing.yaml"))
    assert code == 2 and "missing.yaml" in err and "does not exist" in err


def test_no_arguments_is_the_readme_default_job():
    """`slidetune train` alone: SmolLM2-135M on the built-in corpus, slide mode, GPU if any else CPU,
    a short run with held-out evaluation before and after, written to runs/default/."""
    cfg = config_from_args(build_parser().parse_args(["train"]))
    # on a CPU the default job's shape is CPU_DEFAULT_JOB's (where no flag sets it), else TrainConfig's own
    if not torch.cuda.is_available():
        assert (cfg.batch_size, cfg.data.seq_len, cfg.eval_batches) == (
            CPU_DEFAULT_JOB["batch_size"], CPU_DEFAULT_JOB["data.seq_len"], CPU_DEFAULT_JOB["eval_batches"])
        cfg = config_from_args(build_parser().parse_args(["train", "--batch-size", "4", "--seq-len", "256",
                                                          "--eval-batches", "8"]))
    assert cfg == TrainConfig()
    assert cfg.model == "smollm2-135m"
    assert cfg.data.path is None                         # the built-in corpus
    assert cfg.runtime.mode == "slide" and cfg.runtime.device == "auto"
    assert cfg.output_dir == "runs/default"
    assert cfg.max_steps is None and cfg.epochs is None and cfg.stop_after is None
    assert 1 <= cfg.resolved_max_steps(on_gpu=False) <= 50 and cfg.resolved_max_steps(on_gpu=True) >= 100
    assert cfg.data.heldout_fraction > 0 and cfg.resume is None and cfg.check_memory
    ns = build_parser().parse_args(["train"])
    assert ns.func.__name__ == "_train"
