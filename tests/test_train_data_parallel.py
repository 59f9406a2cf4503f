"""`slidetune train --gpus N` on CPU (docs/data_parallel.md): 2 gloo ranks through the launcher.

One 2-rank run at --batch-size 2 (3 steps, clipping that clips, a checkpoint at step 2) is
compared with one rank at --batch-size 4: the same losses, gradient norms and final weights (fp32,
relative 1e-5: only the order of the gradient sums differs). The 2-rank run's step-2 checkpoint,
resumed on one rank, ends where the uninterrupted one-rank run ends. Rank 0 alone writes: one set
of files, each step once in metrics.csv. The runs are made once for the module (a 2-rank run costs
about a minute here: two processes importing torch and transformers).
"""
from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from slidetune.parallel import launch
from slidetune.cli import main
from slidetune.data.corpus import builtin_corpus
from slidetune.telemetry.trackers import is_installed

STEPS = 3
SAVE_EVERY = 2
CLIP = 0.05            # below every step's gradient norm here: the clipped path runs (asserted)
PER_RANK = 2           # --batch-size of each of the 2 ranks; one rank runs at 2 x this


def common_args(data: Path) -> list[str]:
    return ["--model", "tiny-llama", "--device", "cpu", "--dtype", "fp32", "--seq-len", "32", "--data", str(data),
            "--max-steps", str(STEPS), "--max-grad-norm", str(CLIP), "--save-every", str(SAVE_EVERY),
            "--eval-batches", "1", "--progress", "false", "--skip-reference-check"]


def run_in_process(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["train", *args])
    return code, out.getvalue(), err.getvalue()


def run_launcher(*args: str) -> subprocess.CompletedProcess:
    """`slidetune train --gpus 2 ...` as a user runs it (the launcher re-executes into torchrun)."""
    return subprocess.run([sys.executable, "-m", "slidetune.cli", "train", *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp-train")
    data = tmp / "small.jsonl"     # 40 documents of the built-in corpus: tokenized in milliseconds
    data.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in builtin_corpus()[:40]))
    args = common_args(data)
    two = run_launcher(*args, "--batch-size", str(PER_RANK), "--gpus", "2", "--output-dir", str(tmp / "two"))
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-5000:]
    code, out, err = run_in_process(*args, "--batch-size", str(2 * PER_RANK), "--output-dir", str(tmp / "one"))
    assert code == 0, out[-3000:] + err[-3000:]
    # the 2-rank run's step-2 checkpoint, continued on one rank at the same global batch
    (tmp / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp / "two" / "checkpoints" / f"checkpoint-{SAVE_EVERY}",
                    tmp / "resumed" / "checkpoints" / f"checkpoint-{SAVE_EVERY}")
    code, r_out, r_err = run_in_process(*args, "--batch-size", str(2 * PER_RANK), "--resume", "auto",
                                        "--output-dir", str(tmp / "resumed"))
    assert code == 0, r_out[-3000:] + r_err[-3000:]
    return {"tmp": tmp, "two": two, "resumed_out": r_out, "resumed_err": r_err}


def metrics(run: Path) -> list[dict]:
    with (run / "metrics.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def step_rows(run: Path) -> dict[int, dict]:
    return {int(r["step"]): r for r in metrics(run) if r["loss"]}


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(f))
    assert out, f"no weights in {model_dir}"
    return out


def worst_rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert got.keys() == want.keys()
    return max((float((got[k].double() - want[k].double()).norm() / want[k].double().norm().clamp_min(1e-30)), k)
               for k in want)


def close(a: float, b: float, rel: float = 1e-5) -> bool:
    return abs(a - b) <= rel * abs(b)


@pytest.mark.slow
def test_two_ranks_train_like_one_rank_at_twice_the_batch(runs):
    tmp = runs["tmp"]
    two, one = step_rows(tmp / "two"), step_rows(tmp / "one")
    assert sorted(two) == sorted(one) == list(range(1, STEPS + 1))
    for step in one:
        for key in ("loss", "grad_norm", "lr"):
            assert close(float(two[step][key]), float(one[step][key])), (step, key, two[step][key], one[step][key])
        assert float(one[step]["grad_norm"]) > CLIP, "the clip threshold must clip every step"
    # the held-out evaluation (split over the ranks, summed) before and after training
    for run_two, run_one in zip(metrics(tmp / "two"), metrics(tmp / "one")):
        if run_one["eval_loss"]:
            assert close(float(run_two["eval_loss"]), float(run_one["eval_loss"]))
    worst, where = worst_rel(weights(tmp / "two" / "final"), weights(tmp / "one" / "final"))
    assert worst < 1e-5, f"{where}: relative difference {worst:.2e}"
    # the weights moved: a run that trained nothing would pass the comparison above
    start = weights(tmp / "two" / "checkpoints" / f"checkpoint-{SAVE_EVERY}")
    assert worst_rel(weights(tmp / "one" / "final"), start)[0] > 1e-7


@pytest.mark.slow
def test_two_rank_checkpoint_resumes_on_one_rank(runs):
    tmp = runs["tmp"]
    assert f"resumed from {tmp / 'resumed' / 'checkpoints' / f'checkpoint-{SAVE_EVERY}'}" in runs["resumed_out"]
    # 2 ranks x 2 rows and 1 rank x 4 rows are the same global batch: no "settings differ" note
    assert "differ" not in runs["resumed_err"], runs["resumed_err"]
    one, resumed = step_rows(tmp / "one"), step_rows(tmp / "resumed")
    for step in range(SAVE_EVERY + 1, STEPS + 1):
        assert close(float(resumed[step]["loss"]), float(one[step]["loss"])), step
    worst, where = worst_rel(weights(tmp / "resumed" / "final"), weights(tmp / "one" / "final"))
    assert worst < 1e-5, f"{where}: relative difference {worst:.2e}"


@pytest.mark.slow
def test_only_rank_zero_writes(runs):
    tmp = runs["tmp"]
    out = tmp / "two"
    # --report-to auto: TensorBoard's events too where it is installed (the test extra installs it)
    tensorboard = ["tensorboard"] if is_installed("tensorboard") else []
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in (tmp / "one").iterdir()) == sorted([
        "checkpoints", "config.json", "final", "loss.png", "metrics.csv", "saves.jsonl", "summary.json",
        *tensorboard])
    if tensorboard:
        assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1, "rank 0 alone logs"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"checkpoint-{SAVE_EVERY}",
                                                                        f"checkpoint-{STEPS}"]
    assert not list(tmp.rglob("*.tmp*")) and not list(tmp.rglob("*.old-*")), "a save left a partial copy"
    steps = [int(r["step"]) for r in metrics(out) if r["loss"]]
    assert steps == list(range(1, STEPS + 1)), "each step once in metrics.csv"
    saved = json.loads((out / "config.json").read_text())
    assert saved["world_size"] == 2 and saved["batch_size"] == PER_RANK
    state = json.loads((out / "checkpoints" / f"checkpoint-{STEPS}" / "trainer_state" / "state.json").read_text())
    assert state["trainer_state"]["config"]["world_size"] == 2
    # rank 1 prints nothing but errors: the run's report appears once
    stdout = runs["two"].stdout
    for once in ("slidetune train: ", "final model:", "held-out perplexity"):
        assert stdout.count(once) == 1, (once, stdout[-3000:])
    assert "torch.distributed.run --standalone --nproc-per-node 2" in stdout


def test_more_gpus_than_visible_is_refused(tmp_path):
    code, _, err = run_in_process("--model", "tiny-llama", "--device", "cuda", "--gpus", "2",
                                  "--output-dir", str(tmp_path / "run"))
    assert code == 2
    assert "--gpus 2 with --device cuda: this machine has 0 visible GPUs" in err, err
    assert "--device cpu" in err           # the fix for a machine without GPUs
    assert not (tmp_path / "run").exists()


def test_launcher_command_drops_gpus_and_refuses_nesting(monkeypatch):
    argv = ["--model", "m", "--gpus", "4", "--batch-size", "2", "--gpus=4"]
    assert launch.without_gpus_flag(argv) == ["--model", "m", "--batch-size", "2"]
    cmd = launch.torchrun_command(4, ["--model", "m"])
    assert cmd[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "--shutdown-timeout",
                       str(launch.SHUTDOWN_TIMEOUT_S), "-m", "--", "slidetune.cli", "--model", "m"]
    # torchrun's parser hands the run every flag, those that abbreviate one of its own included
    # (--master: --master-addr, --master-port)
    from torch.distributed.run import get_args_parser
    run = ["train", "--master", "bf16", "--moments", "8bit", "--nnodes-x", "1", "--", "x"]
    parsed = get_args_parser().parse_args(launch.torchrun_command(2, run)[3:])
    assert parsed.module and parsed.training_script == "slidetune.cli" and parsed.training_script_args == run
    # torch 2.11's torchrun (the GPU machine's) has no --shutdown-timeout: the flag is left out there
    monkeypatch.setattr(launch, "torchrun_has_shutdown_timeout", lambda: False)
    assert "--shutdown-timeout" not in launch.torchrun_command(4, ["--model", "m"])
    with pytest.raises(ValueError, match="fewer"):
        launch.check_gpus(4, "cuda", visible=2)
    launch.check_gpus(2, "cuda", visible=2)
    launch.check_gpus(3, "cpu", visible=0)
    with pytest.raises(ValueError, match="at least 1"):
        launch.check_gpus(0, "cpu", visible=0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="leave --gpus out under torchrun"):
        launch.check_gpus(2, "cpu", visible=0)


def launcher_args(tmp: Path, steps: int) -> list[str]:
    data = tmp / "small.jsonl"
    data.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in builtin_corpus()[:40]))
    no_saves = common_args(data)
    at = no_saves.index("--save-every")
    del no_saves[at:at + 2]              # the only checkpoints: those a stop writes
    return no_saves + [
        "--batch-size", str(PER_RANK), "--gpus", "2", "--max-steps", str(steps), "--log-every", "1",
        "--output-dir", str(tmp / "run")]


@pytest.mark.slow
def test_a_failing_rank_ends_every_rank_naming_it(tmp_path):
    args = launcher_args(tmp_path, steps=4)
    proc = subprocess.run([sys.executable, "-m", "slidetune.cli", "train", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "SLIDETUNE_INJECT_FAULT": "data:2:1"})
    err = proc.stderr
    assert proc.returncode != 0
    assert "slidetune: error (rank 1 of 2): InjectedFault: injected fault in the data thread at step 2 on rank 1" \
        in err, err[-5000:]
    assert "slidetune: error (rank 0 of 2)" in err, "rank 0 must end too, not wait for rank 1"
    assert not (tmp_path / "run" / "final").exists()


@pytest.mark.slow
@pytest.mark.parametrize("supervised", [False, True], ids=["exec", "supervised"])
def test_sigint_to_the_launcher_stops_every_rank_after_one_step_with_one_checkpoint(tmp_path, supervised):
    """exec: the launcher becomes torchrun, which forwards the signal (torch >= 2.13 with
    --shutdown-timeout); supervised: the launcher stays, torchrun runs in a session of its own and
    the signal goes to the ranks alone (what older torchrun, the GPU machine's 2.11, gets)."""
    args = launcher_args(tmp_path, steps=500)
    run = tmp_path / "run"
    env = {**os.environ, launch.SUPERVISE_ENV: "1"} if supervised else None
    proc = subprocess.Popen([sys.executable, "-m", "slidetune.cli", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if (run / "metrics.csv").exists() and len(step_rows(run)) >= 2:
                break
            time.sleep(0.5)
        assert proc.poll() is None, "the run ended before it could be interrupted"
        proc.send_signal(signal.SIGINT)       # torchrun (exec) or the supervising launcher forwards it
        out, _ = proc.communicate(timeout=180)
        if supervised:       # torchrun never got the signal: no forwarding and no kill timer of its own
            assert proc.returncode == 130 and "death signal" not in out, (proc.returncode, out[-3000:])
        else:
            assert "death signal" in out, out[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert len(checkpoints) == 1, checkpoints
    done = int(checkpoints[0].removeprefix("checkpoint-"))
    assert (run / "checkpoints" / checkpoints[0] / "COMPLETE").exists()
    assert out.count(f"stopped by SIGINT after step {done} of 500") == 1, out[-5000:]
    assert sorted(step_rows(run)) == list(range(1, done + 1)), "both ranks stopped after the same step"
    assert json.loads((run / "summary.json").read_text())["interrupted"] is True


@pytest.mark.slow
def test_two_ranks_with_every_tier_train_like_one_rank(tmp_path):
    """The three tiers under data parallel, as a user launches it: the vocabulary and layer 0
    updated on each rank's device, layer 1 on the host (shared), layer 2's moments in local rank
    0's disk tier. 2 ranks x 2 rows end where 1 rank x 4 rows ends, with the same placement; the
    disk tier's scratch directories are gone afterwards."""
    data = tmp_path / "small.jsonl"
    data.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in builtin_corpus()[:40]))
    disk = tmp_path / "disk"
    disk.mkdir()
    args = [*common_args(data), "--disk-dir", str(disk), "--tuning.disk_units", "1", "--tuning.device_layers", "1",
            "--tuning.vocab_update", "device", "--tuning.dp_weights", "gather",
            "--eval-batches", "0"]       # every held-out batch: the last leaves rank 1 no row (10 rows, 4 a batch)
    # --verbose: the placement (the GPU's slots and tiers) is printed on the CPU only then
    two = run_launcher(*args, "--batch-size", str(PER_RANK), "--gpus", "2", "--output-dir", str(tmp_path / "two"),
                       "--verbose")
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-5000:]
    assert "disk tier (moments; master in host RAM): layer 2" in two.stdout
    assert "GPU (master + moments, updated on the GPU): embed, layer 0, head" in two.stdout
    code, out, err = run_in_process(*args, "--batch-size", str(2 * PER_RANK), "--output-dir", str(tmp_path / "one"))
    assert code == 0, out[-3000:] + err[-3000:]
    two_rows, one_rows = step_rows(tmp_path / "two"), step_rows(tmp_path / "one")
    for step in one_rows:
        for key in ("loss", "grad_norm"):
            assert close(float(two_rows[step][key]), float(one_rows[step][key])), (step, key)
    worst, where = worst_rel(weights(tmp_path / "two" / "final"), weights(tmp_path / "one" / "final"))
    assert worst < 1e-5, f"{where}: relative difference {worst:.2e}"
    evals = [(float(a["eval_loss"]), float(b["eval_loss"]))
             for a, b in zip(metrics(tmp_path / "two"), metrics(tmp_path / "one")) if b["eval_loss"]]
    assert len(evals) == 2 and all(close(a, b) for a, b in evals), evals
    held = json.loads((tmp_path / "two" / "summary.json").read_text())["heldout_sequences"]
    assert 0 < held % (2 * PER_RANK) <= PER_RANK, held       # the last held-out batch leaves rank 1 no row
    # the end-of-run resumable checkpoint holds the disk unit's moments (read from rank 0's tier)
    assert_same_optimizer_state(tmp_path / "two", tmp_path / "one")
    # the 2-rank step-2 checkpoint resumed at 2 ranks (every rank checks the shapes; rank 0's tier
    # takes the disk unit's moments back) ends where the uninterrupted run ends
    assert_resumes_at_two_ranks(tmp_path, args)
    assert not list(disk.iterdir()), "the disk tier's scratch directories must be removed at the end"


def assert_same_optimizer_state(run: Path, want: Path) -> None:
    """The end-of-run checkpoints' optimizer states agree (1e-5)."""
    files = [r / "checkpoints" / f"checkpoint-{STEPS}" / "trainer_state" / "optimizer.safetensors" for r in (run, want)]
    worst, where = worst_rel(load_file(files[0]), load_file(files[1]))
    assert worst < 1e-5, f"optimizer {where}: relative difference {worst:.2e}"


def assert_resumes_at_two_ranks(tmp_path: Path, args: list[str]) -> None:
    """tmp_path/two's step-SAVE_EVERY checkpoint, resumed at 2 ranks, ends where tmp_path/one ended."""
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "two" / "checkpoints" / f"checkpoint-{SAVE_EVERY}",
                    tmp_path / "resumed" / "checkpoints" / f"checkpoint-{SAVE_EVERY}")
    resumed = run_launcher(*args, "--batch-size", str(PER_RANK), "--gpus", "2", "--resume", "auto",
                           "--output-dir", str(tmp_path / "resumed"))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    assert "resumed from" in resumed.stdout
    worst, where = worst_rel(weights(tmp_path / "resumed" / "final"), weights(tmp_path / "one" / "final"))
    assert worst < 1e-5, f"resumed {where}: relative difference {worst:.2e}"


@pytest.mark.slow
def test_two_ranks_with_compact_state_train_save_and_resume_bit_exact(tmp_path):
    """--master bf16 --moments 8bit under --gpus 2, as a user launches it, with layer 2's state in
    local rank 0's disk tier: the checkpoints hold the format (codes, scales; state.json says
    which), and the step-2 checkpoint resumed at 2 ranks ends where the uninterrupted 2-rank run
    ends, in every bit of the final weights and the optimizer state."""
    data = tmp_path / "small.jsonl"
    data.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in builtin_corpus()[:40]))
    disk = tmp_path / "disk"
    disk.mkdir()
    args = [*common_args(data), "--master", "bf16", "--moments", "8bit", "--disk-dir", str(disk),
            "--tuning.disk_units", "1", "--batch-size", str(PER_RANK), "--gpus", "2"]
    two = run_launcher(*args, "--output-dir", str(tmp_path / "two"), "--verbose")
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-5000:]
    assert "disk tier (moments; master in host RAM): head" in two.stdout
    ckpt = tmp_path / "two" / "checkpoints" / f"checkpoint-{SAVE_EVERY}"
    state = json.loads((ckpt / "trainer_state" / "state.json").read_text())
    assert state["master"] == "bf16" and state["moments"] == "8bit"
    optim = load_file(ckpt / "trainer_state" / "optimizer.safetensors")
    assert optim["head.exp_avg"].dtype == torch.uint8 and "head.exp_avg_scales" in optim      # the disk unit's
    assert optim["layer.0.exp_avg_sq"].dtype == torch.uint8 and "layer.0.exp_avg_sq_scales" in optim
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(ckpt, tmp_path / "resumed" / "checkpoints" / f"checkpoint-{SAVE_EVERY}")
    resumed = run_launcher(*args, "--resume", "auto", "--output-dir", str(tmp_path / "resumed"))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    assert "resumed from" in resumed.stdout
    for got, want in ((weights(tmp_path / "resumed" / "final"), weights(tmp_path / "two" / "final")),
                      *((load_file(r / "checkpoints" / f"checkpoint-{STEPS}" / "trainer_state" / "optimizer.safetensors")
                         for r in (tmp_path / "resumed", tmp_path / "two")),)):
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert not any(disk.iterdir())               # the scratch directories are gone


@pytest.mark.slow
def test_two_ranks_with_sharded_layers_train_save_and_resume_like_one_rank(tmp_path):
    """--tuning.shard_layers 2 as a user launches it: two layers each on one rank's device (master
    and moments), broadcast to the other through its window; rank 0's checkpoints and final/ read
    the layer rank 1 keeps from rank 1. 2 ranks x 2 rows end where 1 rank x 4 rows ends (there the
    same layers are device layers), the checkpoints' optimizer state too, and the 2-rank step-2
    checkpoint resumed at 2 ranks ends there as well."""
    data = tmp_path / "small.jsonl"
    data.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in builtin_corpus()[:40]))
    args = [*common_args(data), "--tuning.shard_layers", "2", "--tuning.cache_units", "2"]
    two = run_launcher(*args, "--batch-size", str(PER_RANK), "--gpus", "2", "--output-dir", str(tmp_path / "two"),
                       "--verbose")
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-5000:]
    assert "the host's GPUs, one each (master + moments on its owner's GPU, broadcast to the others): layers" \
        in two.stdout
    code, out, err = run_in_process(*args, "--batch-size", str(2 * PER_RANK), "--output-dir", str(tmp_path / "one"))
    assert code == 0, out[-3000:] + err[-3000:]
    two_rows, one_rows = step_rows(tmp_path / "two"), step_rows(tmp_path / "one")
    assert sorted(two_rows) == sorted(one_rows) == list(range(1, STEPS + 1))
    for step in one_rows:
        for key in ("loss", "grad_norm"):
            assert close(float(two_rows[step][key]), float(one_rows[step][key])), (step, key)
    worst, where = worst_rel(weights(tmp_path / "two" / "final"), weights(tmp_path / "one" / "final"))
    assert worst < 1e-5, f"{where}: relative difference {worst:.2e}"
    assert_same_optimizer_state(tmp_path / "two", tmp_path / "one")
    assert_resumes_at_two_ranks(tmp_path, args)
