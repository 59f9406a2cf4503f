"""`slidetune train --objective dpo|simpo|...` end to end on the CPU (issue 47): the reference pass
before step 1 and its cache, the first DPO loss ln 2, TRL's metrics in metrics.csv, the held-out
preference evaluation, a resume bit-exact with the uninterrupted run (the reference read from the
cache, or computed again from the initial weights where there is no cache), a reference-free
objective, and the refusals of data that holds no pairs.

  A  DPO, 4 steps, a checkpoint at step 2, the reference computed and cached;
  B  the same run with --stop-after 2 (the reference read from A's cache), then --resume auto with
     the cache off (the reference computed again before the checkpoint's weights load).
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import random
from pathlib import Path

import pytest

from slidetune.cli import main
from test_train_e2e import BASE, read_metrics, run_cli, weights

STEPS = ["--max-steps", "4", "--save-every", "2"]


def write_pairs(path: Path, n: int = 48) -> Path:
    """n arithmetic pairs: the right sum chosen, a wrong one rejected."""
    r = random.Random(0)
    with path.open("w") as f:
        for _ in range(n):
            a, b = r.randint(1, 50), r.randint(1, 50)
            f.write(json.dumps({"prompt": f"Question: what is {a} plus {b}? Answer:", "chosen": f" {a + b}.",
                                "rejected": f" {a + b + r.randint(1, 9)}."}) + "\n")
    return path


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


@pytest.fixture(scope="module")
def dpo_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    pairs, cache = write_pairs(root / "pairs.jsonl"), root / "cache"
    common = BASE + ["--data", str(pairs), "--objective", "dpo", "--beta", "0.2"] + STEPS
    out = {"A": run_cli(*common, "--output-dir", str(root / "A"), "--data-cache-dir", str(cache))}
    out["B1"] = run_cli(*common, "--output-dir", str(root / "B"), "--data-cache-dir", str(cache), "--stop-after", "2")
    out["B1_summary"] = summary(root / "B")
    out["B2"] = run_cli(*common, "--output-dir", str(root / "B"), "--data-cache-dir", "off", "--resume", "auto")
    return root, out


def test_a_dpo_run_trains_evaluates_and_caches_its_reference(dpo_runs):
    root, out = dpo_runs
    code, stdout, stderr = out["A"]
    assert code == 0, stderr
    assert "4 steps of 2 pairs (2 x 2 sequences)" in stdout and "objective dpo (beta 0.2)" in stdout
    assert "reference log-probabilities of 48 pairs (46 training, 2 held out): computed in" in stdout
    assert len(list((root / "cache").glob("reference-logps-*.safetensors"))) == 1
    rows = read_metrics(root / "A")
    steps = [r for r in rows if r["loss"]]
    # the policy is its own reference at step 1: every pair's log-ratio is 0
    assert float(steps[0]["loss"]) == pytest.approx(math.log(2), rel=1e-6)
    for r in steps:
        assert all(r[k] != "" for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracies",
                                        "rewards/margins", "logps/chosen", "logps/rejected"))
        assert 0.0 <= float(r["rewards/accuracies"]) <= 1.0 and float(r["logps/chosen"]) < 0
    evals = [r for r in rows if r["eval_loss"]]
    assert [int(r["step"]) for r in evals] == [0, 4]
    assert float(evals[0]["eval_loss"]) == pytest.approx(math.log(2), rel=1e-6)
    assert float(evals[0]["eval_rewards/margins"]) == 0.0 and evals[0]["eval_ppl"] == ""
    s = summary(root / "A")
    assert s["objective"] == "dpo" and (s["train_pairs"], s["heldout_pairs"]) == (46, 2)
    assert s["reference_cached"] is False and s["reference_s"] > 0
    assert s["eval_before"]["eval_rewards/accuracies"] == 0.0 and set(s["eval_after"]) >= {
        "eval_loss", "eval_rewards/accuracies", "eval_rewards/margins", "eval_logps/chosen"}
    assert "46 preference pairs" in (root / "A" / "final" / "README.md").read_text()


def test_the_second_run_reads_the_reference_from_the_cache(dpo_runs):
    _, out = dpo_runs
    code, stdout, stderr = out["B1"]
    assert code == 0, stderr
    assert "reference log-probabilities of 48 pairs (46 training, 2 held out): read from" in stdout
    assert out["B1_summary"]["reference_cached"] is True


def test_a_resumed_dpo_run_ends_bit_exact_with_the_uninterrupted_one(dpo_runs):
    root, out = dpo_runs
    code, stdout, stderr = out["B2"]
    assert code == 0, stderr
    # no cache this time: the reference computed again, with the initial weights (before the resume)
    assert "computed in" in stdout and "resumed from" in stdout + stderr
    timing = {"tokens_per_s", "tflops", "step_s", "gpu_peak_alloc_gib", "gpu_peak_reserved_gib", "cpu_rss_gib"}

    def values(run: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in timing} for r in read_metrics(run)]
    assert values(root / "A") == values(root / "B")          # every loss, norm and metric, digit for digit
    for sub in ("final", "checkpoints/checkpoint-4"):
        wa, wb = weights(root / "A" / sub), weights(root / "B" / sub)
        assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa), sub


def test_a_reference_free_objective_trains_without_a_reference_pass(tmp_path):
    pairs = write_pairs(tmp_path / "pairs.jsonl", 24)
    code, stdout, stderr = run_cli(*BASE, "--data", str(pairs), "--objective", "simpo", "--max-steps", "2",
                                   "--output-dir", str(tmp_path / "run"), "--data-cache-dir", "off")
    assert code == 0, stderr
    assert "reference log-probabilities" not in stdout
    s = summary(tmp_path / "run")
    assert s["objective"] == "simpo" and s["reference_s"] is None
    steps = [r for r in read_metrics(tmp_path / "run") if r["loss"]]
    # SimPO's log-probabilities are per token (CPOTrainer's): each above a sequence sum's
    assert len(steps) == 2 and all(-20 < float(r["logps/chosen"]) < 0 for r in steps)


def test_data_without_pairs_is_refused_naming_the_file(tmp_path):
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "just text"}) + "\n")
    code, _, stderr = run_cli(*BASE, "--data", str(text), "--objective", "dpo", "--max-steps", "1",
                              "--output-dir", str(tmp_path / "run"))
    assert code != 0 and f"{text}:1: a preference record needs" in stderr and "'chosen' is missing" in stderr
    code, _, stderr = run_cli(*BASE, "--objective", "orpo", "--max-steps", "1", "--output-dir", str(tmp_path / "r2"))
    assert code != 0 and "needs preference data" in stderr
    assert not (tmp_path / "run" / "final").exists()


def test_more_pairs_a_step_than_the_data_holds_is_refused(tmp_path):
    pairs = write_pairs(tmp_path / "pairs.jsonl", 6)
    code, _, stderr = run_cli(*BASE, "--data", str(pairs), "--objective", "ipo", "--batch-size", "4",
                              "--grad-accum", "2", "--max-steps", "1", "--output-dir", str(tmp_path / "run"))
    assert code != 0 and "cannot fill a step of 8 pairs" in stderr


def test_plan_counts_a_pair_as_two_sequences():
    """`plan --objective dpo --batch-size 8` fits what an SFT plan of 16 sequences fits (the pairs
    carry no padding mask, as packed SFT rows)."""
    def estimate(*flags: str) -> list[str]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["plan", "--model", "qwen3-8b", "--seq-len", "1024", "--gpu-free-gib", "24", "--host-gib",
                         "125", "--no-limits", *flags]) == 0
        return [line for line in out.getvalue().splitlines() if "GiB" in line and "limits" not in line]
    assert estimate("--objective", "dpo", "--batch-size", "8") == estimate("--batch-size", "16")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["plan", "--model", "qwen3-8b", "--seq-len", "1024", "--gpu-free-gib", "24", "--host-gib", "125",
              "--objective", "dpo", "--batch-size", "8"])
    assert "the verdict above is for 8 pairs = 16 sequences a micro-batch" in out.getvalue()


def test_the_reference_pass_floor_is_a_forward_and_one_upload_of_each_host_unit():
    """bench/reference_floor.py: a batch's compute is every layer's probed forward plus a third of the
    head's forward and backward; its PCIe one upload of each host-updated unit's BF16 weights."""
    from slidetune.bench.reference_floor import reference_pass_terms
    from slidetune.bench.roofline import plan_of_runtime
    comp = {"num_layers": 4, "layer_params": 1_000_000, "vocab_params": 2_000_000, "layer_forward_s": 0.01,
            "head_s": 0.03, "embed_s": 0.0}
    plan = plan_of_runtime(comp)                      # every unit on the host
    terms = reference_pass_terms(comp, {"h2d_gib_s": 1.0}, plan)
    assert terms["compute_s"] == pytest.approx(4 * 0.01 + 0.01)
    assert terms["h2d_s"] == pytest.approx(2 * (4 * 1_000_000 + 2_000_000) / 2**30)
