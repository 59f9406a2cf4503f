"""A preference objective under `slidetune train --gpus N` on CPU (issue 47; docs/preference.md):
2 gloo ranks through the launcher against one rank at twice the batch.

  DPO    2 ranks at --batch-size 1 --grad-accum 2 (a step: 4 pairs, 2 a rank, each rank's micro-batches
         normalized by the global step) against 1 rank at --batch-size 2 --grad-accum 2, clipping that
         clips; the reference pass shared by the ranks and cached by rank 0 alone
  SimPO  (no reference; its NLL term normalized by the global step's chosen tokens) 2 ranks at
         --batch-size 1 against 1 rank at --batch-size 2

Every step's loss and gradient norm to 1e-5 relative, TRL's metrics and the held-out evaluation
alike, and the final weights to 1e-5 (fp32: only the order of the sums differs). The 2-rank DPO
run's step-2 checkpoint, resumed on 2 ranks with the cache off (the reference computed again before
the checkpoint loads), ends in the same digits. A 2-rank run costs
about a minute here (two processes importing torch and transformers), so the runs are made once.
"""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from test_train_data_parallel import close, metrics, run_in_process, run_launcher, step_rows, weights, worst_rel
from test_train_preference import write_pairs

STEPS = 3
SAVE_EVERY = 2
CLIP = 0.05            # below every DPO step's gradient norm here: the clipped path runs (asserted)
TRL = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
       "logps/rejected")


def args(data, objective: str, cache) -> list[str]:
    return ["--model", "tiny-llama", "--device", "cpu", "--dtype", "fp32", "--seq-len", "32", "--data", str(data),
            "--objective", objective, "--max-steps", str(STEPS), "--max-grad-norm", str(CLIP), "--eval-batches", "1",
            "--progress", "false", "--skip-reference-check", "--data-cache-dir", str(cache)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp-preference")
    data = write_pairs(tmp / "pairs.jsonl", 48)
    for objective, accum in (("dpo", "2"), ("simpo", "1")):
        common = args(data, objective, tmp / f"cache-{objective}-two") + ["--grad-accum", accum]
        two = run_launcher(*common, "--batch-size", "1", "--gpus", "2", "--save-every", str(SAVE_EVERY),
                           "--output-dir", str(tmp / f"{objective}-two"))
        assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-5000:]
        common = args(data, objective, tmp / f"cache-{objective}-one") + ["--grad-accum", accum]
        code, out, err = run_in_process(*common, "--batch-size", "2", "--output-dir", str(tmp / f"{objective}-one"))
        assert code == 0, out[-3000:] + err[-3000:]
    # the 2-rank DPO run's step-2 checkpoint resumed on 2 ranks with the cache off: the reference
    # computed again by both ranks' forwards, with the initial weights, before the checkpoint loads
    (tmp / "dpo-resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp / "dpo-two" / "checkpoints" / f"checkpoint-{SAVE_EVERY}",
                    tmp / "dpo-resumed" / "checkpoints" / f"checkpoint-{SAVE_EVERY}")
    resumed = run_launcher(*args(data, "dpo", "off"), "--grad-accum", "2", "--batch-size", "1", "--gpus", "2",
                           "--resume", "auto", "--output-dir", str(tmp / "dpo-resumed"))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    return {"tmp": tmp, "resumed": resumed.stdout}


def near(a: str, b: str) -> bool:
    """Metrics that may be 0 (DPO's rewards at step 1): relative 1e-5, or absolute 1e-6 about 0."""
    return abs(float(a) - float(b)) <= 1e-5 * abs(float(b)) + 1e-6


def assert_like_one_rank(tmp, objective: str, clipped: bool) -> None:
    two, one = step_rows(tmp / f"{objective}-two"), step_rows(tmp / f"{objective}-one")
    assert sorted(two) == sorted(one) == list(range(1, STEPS + 1))
    for step in one:
        for key in ("loss", "grad_norm"):
            assert close(float(two[step][key]), float(one[step][key])), (step, key, two[step][key], one[step][key])
        for key in TRL:
            assert two[step][key] != "" and near(two[step][key], one[step][key]), (step, key)
        if clipped:
            assert float(one[step]["grad_norm"]) > CLIP, "the clip threshold must clip every step"
    # the held-out evaluation (the forwards shared by the ranks) before and after training
    evals = [(a, b) for a, b in zip(metrics(tmp / f"{objective}-two"), metrics(tmp / f"{objective}-one"))
             if b["eval_loss"]]
    assert [int(b["step"]) for _, b in evals] == [0, STEPS]
    for a, b in evals:
        assert close(float(a["eval_loss"]), float(b["eval_loss"])) and near(a["eval_rewards/margins"],
                                                                           b["eval_rewards/margins"])
    worst, where = worst_rel(weights(tmp / f"{objective}-two" / "final"), weights(tmp / f"{objective}-one" / "final"))
    assert worst < 1e-5, f"{where}: relative difference {worst:.2e}"


@pytest.mark.slow
def test_two_ranks_run_dpo_like_one_rank_at_twice_the_batch(runs):
    tmp = runs["tmp"]
    assert_like_one_rank(tmp, "dpo", clipped=True)
    two = step_rows(tmp / "dpo-two")
    assert float(two[1]["loss"]) == pytest.approx(0.6931471805599453, rel=1e-6)     # ln 2: the policy is its reference
    # one reference file, written by rank 0, with the values one rank computes
    (file,) = (tmp / "cache-dpo-two").glob("reference-logps-*.safetensors")
    (want,) = (tmp / "cache-dpo-one").glob("reference-logps-*.safetensors")
    got, ref = load_file(file)["reference_logps"], load_file(want)["reference_logps"]
    assert got.shape == ref.shape and float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    assert not list(tmp.rglob("*.tmp*")), "a partial cache file was left"


@pytest.mark.slow
def test_a_resumed_two_rank_dpo_run_ends_where_the_uninterrupted_one_does(runs):
    tmp, stdout = runs["tmp"], runs["resumed"]
    assert "computed in" in stdout and "resumed from" in stdout, stdout[-3000:]
    two, resumed = step_rows(tmp / "dpo-two"), step_rows(tmp / "dpo-resumed")
    assert sorted(resumed) == list(range(SAVE_EVERY + 1, STEPS + 1))
    for step in resumed:
        for key in ("loss", "grad_norm", *TRL):
            assert resumed[step][key] == two[step][key], (step, key)          # the same ranks, the same digits
    got, want = weights(tmp / "dpo-resumed" / "final"), weights(tmp / "dpo-two" / "final")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
def test_two_ranks_run_simpo_like_one_rank_at_twice_the_batch(runs):
    assert_like_one_rank(runs["tmp"], "simpo", clipped=False)
    assert not list((runs["tmp"] / "cache-simpo-two").glob("reference-logps-*")), "SimPO has no reference pass"
