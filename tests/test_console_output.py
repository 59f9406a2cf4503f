"""What a run prints fits the device: on the CPU no GPU words (placement, slots, gpu=/tflops in the
bar); without a progress bar one short line per logging step; the config in a few lines (the whole
of it with --verbose, and in config.json either way); `bench --help` in whole sentences without
internal names."""
from __future__ import annotations

import contextlib
import io
import json
import re

import pytest

from slidetune.cli import main
from slidetune.data.corpus import builtin_corpus

from test_train_e2e import BASE, run_cli

GPU_WORDS = re.compile(r"GPU|gpu=|tflops|checkpoints on the|weight slots|cache_units|device_layers")


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "small.jsonl"
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in builtin_corpus()[:20]))
    return path


def test_cpu_run_without_a_bar_prints_a_line_a_step_and_no_gpu_words(tmp_path, small_data):
    out = tmp_path / "run"
    code, stdout, err = run_cli(*BASE, "--data", str(small_data), "--max-steps", "3", "--output-dir", str(out))
    assert code == 0, err
    steps = re.findall(r"^step (\d+)/3  loss [\d.]+  lr [\d.e+-]+  [\d.]+ s  [\d,]+ tok/s  rss [\d.]+G$", stdout, re.M)
    assert steps == ["1", "2", "3"], stdout
    assert not GPU_WORDS.search(stdout + err), GPU_WORDS.search(stdout + err)
    before_eval = stdout.split("held-out before training")[0]
    assert "resolved config" not in before_eval and len(before_eval.splitlines()) <= 6, before_eval
    assert stdout.rstrip().splitlines()[-1].startswith("done: 3 steps in ")
    saved = json.loads((out / "config.json").read_text())
    assert saved["max_steps"] == 3 and saved["runtime"]["dtype"] in ("bf16", "fp32")


def test_verbose_prints_the_whole_resolved_config(tmp_path, small_data):
    code, stdout, err = run_cli(*BASE, "--data", str(small_data), "--max-steps", "1", "--verbose",
                                "--output-dir", str(tmp_path / "run"))
    assert code == 0, err
    dumped = stdout.split("resolved config:\n", 1)[1]
    config = json.JSONDecoder().raw_decode(dumped)[0]
    assert config == json.loads((tmp_path / "run" / "config.json").read_text())
    assert '"eval_loss_before"' in stdout                # the summary at the end, whole


def test_bench_help_has_whole_lines_and_no_internal_names():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = out.getvalue()
    assert not re.search(r"T1M\d|seeds/|`slidetune bench", text), text
    for name in ("modes", "recompute", "head", "techniques", "throughput", "roofline", "pipeline", "soak"):
        assert re.search(rf"^    {name}\s+\S", text, re.M), name
