"""Where a run's metrics go (telemetry/trackers.py, --report-to): metrics.csv appended row by row and cut
back on a resume, TensorBoard's event files read back with TensorBoard's own reader, and a tracker asked
for but not installed refused with its install line before the run starts.

The tracker classes are exercised on their own first (milliseconds), then through real tiny training
runs (tiny-llama on 40 documents of the built-in corpus, CPU).
"""
from __future__ import annotations

import contextlib
import csv
import io
import json
import math
from pathlib import Path

import pytest

from slidetune.cli import main
from slidetune.config import TrainConfig
from slidetune.data.config import DataConfig
from slidetune.data.corpus import builtin_corpus
from slidetune.engine.config import RuntimeConfig
from slidetune.telemetry.csv_tracker import CsvTracker
from slidetune.telemetry.run_metrics import METRIC_COLUMNS, PRECISE_COLUMNS, _end_of_run_eval_row
from slidetune.telemetry.tracker import Tracker, Trackers
from slidetune.telemetry.trackers import (TensorBoardTracker, TrackerUnavailable, is_installed, parse_report_to,
                                          resolve_report_to)
from slidetune.trainer import train

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def read_rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def scalars(logdir: Path, tag: str) -> dict[int, float]:
    """step -> value of `tag`, as TensorBoard reads the directory (purged steps dropped)."""
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def csv_tracker(path: Path, resume_step: int | None = None) -> CsvTracker:
    return CsvTracker(path, METRIC_COLUMNS, PRECISE_COLUMNS, resume_step=resume_step,
                      drop_at_resume=_end_of_run_eval_row)


def log_steps(tracker: Tracker, steps, loss=lambda s: 3.0 - 0.1 * s) -> None:
    for s in steps:
        tracker.log_scalars(s, {"loss": loss(s), "lr": 1e-3, "tokens_per_s": 1234.5})
    tracker.flush()


# ----------------------------------------------------------------------------- metrics.csv on its own
def test_csv_is_appended_and_earlier_rows_stay_byte_identical(tmp_path):
    path = tmp_path / "metrics.csv"
    t = csv_tracker(path)
    assert read_rows(path) == [] and path.read_text().startswith("step,loss,lr,")
    t.log_scalars(0, {"eval_loss": 3.25, "eval_ppl": math.exp(3.25)})
    log_steps(t, [1, 2])
    first = path.read_bytes()
    log_steps(t, [3])
    second = path.read_bytes()
    assert len(second) > len(first) and second[:len(first)] == first
    t.close()
    rows = read_rows(path)
    assert [r["step"] for r in rows] == ["0", "1", "2", "3"]
    assert float(rows[3]["loss"]) == pytest.approx(2.7) and rows[3]["eval_loss"] == ""
    assert float(rows[0]["eval_ppl"]) == pytest.approx(math.exp(3.25), rel=1e-5)


def test_csv_refuses_a_scalar_it_has_no_column_for(tmp_path):
    t = csv_tracker(tmp_path / "metrics.csv")
    with pytest.raises(ValueError, match=r"metrics.csv has no column for bogus"):
        t.log_scalars(1, {"loss": 1.0, "bogus": 2.0})


def test_csv_resume_cuts_back_to_the_checkpoint_then_appends(tmp_path):
    """A killed run logged steps 1-7 (and half a row of step 8) with its checkpoint at step 5: the
    resume keeps rows 0-5 byte for byte, drops the rest, and the steps it logs follow them once each."""
    path = tmp_path / "metrics.csv"
    t = csv_tracker(path)
    t.log_scalars(0, {"eval_loss": 3.3, "eval_ppl": 27.1})
    log_steps(t, range(1, 6))
    upto_checkpoint = path.read_bytes()
    log_steps(t, range(6, 8))
    with path.open("a") as f:
        f.write("8,2.2,0.001")                 # the kill cut this append short
    resumed = csv_tracker(path, resume_step=5)
    assert path.read_bytes() == upto_checkpoint
    log_steps(resumed, range(6, 9), loss=lambda s: 9.0)
    resumed.close()
    assert path.read_bytes()[:len(upto_checkpoint)] == upto_checkpoint
    rows = read_rows(path)
    assert [int(r["step"]) for r in rows] == list(range(0, 9))
    assert [float(r["loss"]) for r in rows[6:]] == [9.0, 9.0, 9.0]


def test_csv_resume_of_a_finished_run_drops_its_closing_evaluation(tmp_path):
    """The held-out row after the last step (eval only) is the end of the earlier invocation: a resume at
    that step drops it (the resumed run's end evaluates again); the eval-only row 0 stays."""
    path = tmp_path / "metrics.csv"
    t = csv_tracker(path)
    t.log_scalars(0, {"eval_loss": 3.3})
    log_steps(t, [1, 2])
    t.log_scalars(2, {"eval_loss": 3.1})
    t.close()
    csv_tracker(path, resume_step=2).close()
    assert [(r["step"], bool(r["loss"])) for r in read_rows(path)] == [("0", False), ("1", True), ("2", True)]


def test_csv_resume_rewrites_a_file_of_older_columns(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text("step,loss,lr\r\n1,2.5,0.001\r\n2,2.4,0.001\r\n3,2.3,0.001\r\n", newline="")
    csv_tracker(path, resume_step=2).close()
    rows = read_rows(path)
    assert list(rows[0]) == METRIC_COLUMNS and [r["loss"] for r in rows] == ["2.5", "2.4"]


def test_text_goes_to_text_jsonl_and_is_cut_back_on_resume(tmp_path):
    path = tmp_path / "metrics.csv"
    t = csv_tracker(path)
    t.log_text(2, "samples", "a sample\nover two lines")
    t.log_text(4, "samples", "later")
    t.close()
    csv_tracker(path, resume_step=3).close()
    lines = [json.loads(line) for line in (tmp_path / "text.jsonl").read_text().splitlines()]
    assert lines == [{"step": 2, "tag": "samples", "text": "a sample\nover two lines"}]


# ----------------------------------------------------------------------------- TensorBoard on its own
def test_tensorboard_events_read_back_and_a_resume_purges_the_steps_after_the_checkpoint(tmp_path):
    logdir = tmp_path / "tensorboard"
    t = TensorBoardTracker(logdir, resume_step=None)
    log_steps(t, range(1, 8))
    t.log_text(3, "samples", "hello")
    t.log_scalars(0, {"eval_loss": 3.3, "eval_ppl": 27.1})
    t.close()
    assert scalars(logdir, "train/loss") == pytest.approx({s: 3.0 - 0.1 * s for s in range(1, 8)})
    assert scalars(logdir, "eval/perplexity") == pytest.approx({0: 27.1})
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    assert acc.Tensors("samples/text_summary")[0].tensor_proto.string_val == [b"hello"]
    # resumed at the checkpoint of step 5: steps 6 and 7 of the killed run are gone, the new ones shown
    t = TensorBoardTracker(logdir, resume_step=5)
    log_steps(t, range(6, 9), loss=lambda s: 9.0)
    t.close()
    assert scalars(logdir, "train/loss") == pytest.approx({**{s: 3.0 - 0.1 * s for s in range(1, 6)},
                                                           6: 9.0, 7: 9.0, 8: 9.0})
    # a fresh run in the same directory starts the events afresh
    t = TensorBoardTracker(logdir, resume_step=None)
    log_steps(t, [1])
    t.close()
    assert list(scalars(logdir, "train/loss")) == [1]


class _Failing(Tracker):
    name = "failing"

    def __init__(self, log: list):
        self.log = log

    def close(self) -> None:
        self.log.append(self.name)
        raise OSError("cannot close")


class _Recording(_Failing):
    name = "recording"

    def log_scalars(self, step, values):
        self.log.append((step, values))

    def close(self) -> None:
        self.log.append(self.name)


def test_fan_out_reaches_every_tracker_and_closes_each_despite_a_failure():
    log: list = []
    both = Trackers([_Failing(log), _Recording(log)])
    assert both.names == ["failing", "recording"]
    both.trackers[1].log_scalars(1, {"loss": 2.0})
    with pytest.raises(OSError, match="cannot close"):
        both.close()
    assert log == [(1, {"loss": 2.0}), "failing", "recording"]


# ----------------------------------------------------------------------------- --report-to
def test_report_to_names_are_checked():
    assert parse_report_to("CSV, tensorboard,csv") == ["csv", "tensorboard"]
    assert resolve_report_to("auto") == ["csv", "tensorboard"]          # tensorboard is installed here
    assert resolve_report_to("csv") == ["csv"]
    assert resolve_report_to("tensorboard") == ["csv", "tensorboard"]  # metrics.csv is always written
    with pytest.raises(ValueError, match=r"report_to \(--report-to\) must be auto or a comma list of csv, "
                                         r"tensorboard, wandb, mlflow; got 'tensorbord'"):
        TrainConfig(report_to="tensorbord")


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_a_missing_tracker_asked_for_is_refused_with_its_install_line(tmp_path, name):
    if is_installed(name):
        pytest.skip(f"{name} is installed here")
    with pytest.raises(TrackerUnavailable, match=rf"--report-to {name}: the {name} package is not installed; "
                                                 rf"install it with `pip install {name}`"):
        resolve_report_to(f"csv,{name}")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["train", "--model", "tiny-llama", "--device", "cpu", "--report-to", name,
                     "--output-dir", str(tmp_path / "run")])
    assert code == 2 and "Traceback" not in err.getvalue()
    assert err.getvalue().startswith("slidetune: error: ")
    assert f"--report-to {name}: the {name} package is not installed; install it with `pip install {name}`, " \
           f"or leave {name} out of --report-to" in err.getvalue()
    assert not (tmp_path / "run").exists()                  # refused before anything was written


# ----------------------------------------------------------------------------- through training runs
@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "small.jsonl"
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in builtin_corpus()[:40]))
    return path


def tiny_config(corpus: Path, out: Path, **kw) -> TrainConfig:
    return TrainConfig(model="tiny-llama", data=DataConfig(path=str(corpus), seq_len=32),
                       runtime=RuntimeConfig(device="cpu"), batch_size=2, eval_batches=2, progress=False,
                       output_dir=str(out), **kw)


@pytest.mark.slow
def test_a_stopped_and_resumed_run_logs_each_step_once_to_csv_and_tensorboard(tmp_path, corpus):
    """4 steps stopped after 2 (checkpoint-2), a row of step 3 appended as a killed run would have left
    it, then --resume auto: metrics.csv keeps the first invocation's bytes, and metrics.csv and
    TensorBoard hold each step once with the same values."""
    out = tmp_path / "run"
    first = train(tiny_config(corpus, out, max_steps=4, stop_after=2, report_to="csv,tensorboard"))
    assert first.stopped_early and (out / "checkpoints" / "checkpoint-2").is_dir()
    kept = (out / "metrics.csv").read_bytes()
    with (out / "metrics.csv").open("a", newline="") as f:
        f.write("3,99.0,0.001,,,,,,,,,\r\n")   # logged past the checkpoint by a run that was then killed
    train(tiny_config(corpus, out, max_steps=4, resume="auto", report_to="csv,tensorboard"))
    data = (out / "metrics.csv").read_bytes()
    assert data[:len(kept)] == kept and len(data) > len(kept)
    rows = read_rows(out / "metrics.csv")
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3, 4, 4]            # the last: the closing evaluation
    csv_loss = {int(r["step"]): float(r["loss"]) for r in rows if r["loss"]}
    assert 99.0 not in csv_loss.values()
    tb_loss = scalars(out / "tensorboard", "train/loss")
    assert tb_loss == pytest.approx(csv_loss, rel=1e-6)
    assert sorted(scalars(out / "tensorboard", "eval/loss")) == [0, 4]
    for tag in ("train/lr", "train/grad_norm", "speed/tokens_per_s", "memory/host_rss_gib", "eval/perplexity"):
        assert all(math.isfinite(v) for v in scalars(out / "tensorboard", tag).values()), tag
