"""A few dozen short examples train with the defaults (the usual first try), end to end.

40 short paragraphs are far less than one batch of packed windows of the default seq_len
(4 x 257 tokens): both splits fall back to one example per row, right-padded, with a printed
note; 40 prompt/completion records are packed whole (best-fit decreasing), a few rows; the
held-out loss is finite. Data with nothing to train on is refused with a message that
says so. (tests/test_data.py checks the rows themselves on a hand-checkable tokenizer.)
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from test_train_errors import run_cli

# the job's shape as TrainConfig's defaults (the GPU job's: 4 x 256 tokens; the CPU default job is
# smaller, config.CPU_DEFAULT_JOB), so the fallbacks below happen at the same sizes on every machine
DEFAULTS = ["--model", "tiny-llama", "--max-steps", "2", "--device", "cpu", "--progress", "false",
            "--batch-size", "4", "--seq-len", "256", "--eval-batches", "8"]
TOPICS = ["the moon", "a river", "fresh bread", "an old violin", "winter mornings", "the ocean",
          "a small library", "honey bees"]


def prompt_completion_file(path: Path, n: int = 40) -> Path:
    with path.open("w") as f:
        for i in range(n):
            topic = TOPICS[i % len(TOPICS)]
            record = {"prompt": f"Write one sentence about {topic}.\nAnswer:",
                      "completion": f" Example {i}: {topic} is quiet, and people like it."}
            f.write(json.dumps(record) + "\n")
    return path


def paragraphs_file(path: Path, n: int = 40) -> Path:
    paragraphs = [f"Paragraph {i}. This short note is about {TOPICS[i % len(TOPICS)]} and why it "
                  f"matters to someone today." for i in range(n)]
    path.write_text("\n\n".join(paragraphs) + "\n")
    return path


def train_ok(data: Path, out: Path, *extra: str) -> tuple[dict, str]:
    code, stdout, err = run_cli(*DEFAULTS, "--data", str(data), "--output-dir", str(out), *extra)
    assert code == 0, (stdout[-2000:], err[-3000:])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and math.isfinite(summary["last_loss"])
    assert (out / "final" / "model.safetensors").exists()
    return summary, err


def eval_losses(out: Path) -> list[float]:
    with (out / "metrics.csv").open(newline="") as f:
        return [float(r["eval_loss"]) for r in csv.DictReader(f) if r["eval_loss"]]


def test_40_prompt_completion_records_train_with_defaults(tmp_path):
    data = prompt_completion_file(tmp_path / "train.jsonl")
    summary, err = train_ok(data, tmp_path / "run")
    # 40 x 5% = 2 held out. Instruction data is packed whole (best-fit decreasing): the 2 held-out
    # examples (~70 tokens) share one row, the 38 training ones (~1300 tokens) fill a few
    assert summary["heldout_sequences"] == 1 and 4 <= summary["train_sequences"] < 38
    assert "note:" in err and "the 38 training examples are packed whole into" in err
    assert math.isfinite(summary["eval_loss_before"]) and math.isfinite(summary["eval_loss_after"])
    assert math.isfinite(summary["ppl_after"])
    losses = eval_losses(tmp_path / "run")                   # before and after, in metrics.csv
    assert len(losses) == 2 and all(map(math.isfinite, losses))


def test_40_short_paragraphs_train_with_defaults(tmp_path):
    data = paragraphs_file(tmp_path / "notes.txt")
    summary, err = train_ok(data, tmp_path / "run")
    # 38 training paragraphs (~850 tokens) fill fewer packed rows than one batch: one per row
    assert summary["train_sequences"] == 38 and summary["heldout_sequences"] == 2
    assert "note:" in err and "the 38 training examples" in err and "fewer than one batch" in err
    assert "right-padded" in err
    assert math.isfinite(summary["eval_loss_before"]) and math.isfinite(summary["eval_loss_after"])


def test_a_handful_of_examples_train_without_heldout(tmp_path):
    data = prompt_completion_file(tmp_path / "five.jsonl", n=5)
    summary, err = train_ok(data, tmp_path / "run")
    assert summary["train_sequences"] == 5 and summary["heldout_sequences"] == 0
    assert summary["eval_loss_before"] is None
    assert "5 example(s) are too few to hold some out" in err and "--heldout-fraction 0" in err


@pytest.mark.parametrize("records, args, why", [
    ([{"prompt": "Say nothing.", "completion": ""}] * 12, [],
     "1 more held out), 11 have no token to train on at all"),
    ([{"text": ""}] * 3, [], "3 have no token to train on at all"),
    ([{"prompt": "word " * 40, "completion": " end"}] * 4,
     ["--seq-len", "16", "--packing", "false"], "4 have none within the first seq_len+1 = 17"),
])
def test_no_usable_examples_is_refused_clearly(tmp_path, records, args, why):
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "run"
    code, _, err = run_cli(*DEFAULTS, "--data", str(data), "--output-dir", str(out), *args)
    assert code == 2 and "Traceback" not in err
    assert f"DataError: {data}: no usable training examples" in err and why in err
    assert "add examples" in err and "check the data's format" in err
    assert not out.exists()


def test_too_few_examples_for_one_batch_is_refused_clearly(tmp_path):
    data = prompt_completion_file(tmp_path / "three.jsonl", n=3)
    code, _, err = run_cli(*DEFAULTS, "--data", str(data), "--output-dir", str(tmp_path / "run"))
    assert code == 2 and "Traceback" not in err
    assert "too little training data for one batch" in err and "batch_size=4" in err
    assert "--batch-size" in err and "note:" not in err
