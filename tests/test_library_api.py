"""slidetune as a library (docs/library.md): `slidetune.train(slidetune.TrainConfig(...), callbacks=[...])`.

Real tiny runs (tiny-llama on 40 documents of the built-in corpus, CPU): the callbacks hear of every
step, evaluation and save with the right steps, metrics and paths; a callback that raises stops the
run with a TrainingError naming it, the metrics so far kept.
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

import slidetune
from slidetune.data.corpus import builtin_corpus


class Recorder(slidetune.Callback):
    def __init__(self):
        self.events: list[tuple] = []

    def on_step(self, step, metrics):
        self.events.append(("step", step, dict(metrics)))

    def on_eval(self, step, metrics):
        self.events.append(("eval", step, dict(metrics)))

    def on_save(self, step, path):
        self.events.append(("save", step, Path(path)))


class StopAtStep(slidetune.Callback):
    """Raises in on_step at `step` (only on_step is overridden: the other hooks do nothing)."""

    def __init__(self, step: int):
        self.step = step

    def on_step(self, step, metrics):
        if step == self.step:
            raise ValueError(f"loss {metrics['loss']:.3f} is not what I wanted")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "small.jsonl"
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in builtin_corpus()[:40]))
    return path


def config(corpus: Path, out: Path, **kw) -> slidetune.TrainConfig:
    return slidetune.TrainConfig(model="tiny-llama", data=slidetune.DataConfig(path=str(corpus), seq_len=32),
                                 runtime=slidetune.RuntimeConfig(device="cpu"), batch_size=2, eval_batches=2,
                                 progress=False, output_dir=str(out), report_to="csv", **kw)


def test_the_public_names():
    assert callable(slidetune.train) and slidetune.__version__
    for name in slidetune.__all__:
        assert getattr(slidetune, name) is not None, name
    assert {"train", "TrainConfig", "Callback", "TrainSummary", "TrainingError"} <= set(slidetune.__all__)
    from slidetune import trainer
    assert slidetune.train is trainer.train             # the function, not a module named like it
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        slidetune.nope  # noqa: B018


def test_an_object_without_the_hooks_is_refused_before_the_run(tmp_path, corpus):
    with pytest.raises(TypeError, match=r"<built-in function print> is not a slidetune.Callback "
                                        r"\(it lacks on_step, on_eval, on_save\)"):
        slidetune.train(config(corpus, tmp_path / "run", max_steps=1), callbacks=[StopAtStep(1), print])
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_callbacks_hear_each_step_evaluation_and_save(tmp_path, corpus):
    out = tmp_path / "run"
    rec = Recorder()
    summary = slidetune.train(config(corpus, out, max_steps=4, eval_every=2, save_every=2, keep_last=3),
                              callbacks=[rec])
    assert isinstance(summary, slidetune.TrainSummary) and summary.steps == 4
    steps = [(step, m) for kind, step, m in rec.events if kind == "step"]
    assert [s for s, _ in steps] == [1, 2, 3, 4]
    with (out / "metrics.csv").open(newline="") as f:
        losses = {int(r["step"]): float(r["loss"]) for r in csv.DictReader(f) if r["loss"]}
    for step, m in steps:
        assert {"loss", "lr", "tokens_per_s", "step_s", "cpu_rss_gib"} <= set(m)
        assert m["loss"] == pytest.approx(losses[step], rel=1e-6)
    evals = [(step, m) for kind, step, m in rec.events if kind == "eval"]
    assert [s for s, _ in evals] == [0, 2, 4]
    assert all(math.isfinite(m["eval_loss"]) and m["eval_ppl"] == pytest.approx(math.exp(m["eval_loss"]))
               for _, m in evals)
    assert evals[-1][1]["eval_loss"] == pytest.approx(summary.eval_loss_after)
    saves = [(step, path) for kind, step, path in rec.events if kind == "save"]
    assert saves == [(2, out / "checkpoints" / "checkpoint-2"), (4, out / "final"),
                     (4, out / "checkpoints" / "checkpoint-4")]
    assert all(path.is_dir() for _, path in saves)
    # in order: step 2's save follows its evaluation, which follows the step
    kinds = [(kind, step) for kind, step, _ in rec.events]
    assert kinds.index(("step", 2)) < kinds.index(("eval", 2)) < kinds.index(("save", 2)) < kinds.index(("step", 3))


@pytest.mark.slow
def test_a_callback_that_raises_stops_the_run_naming_it(tmp_path, corpus):
    out = tmp_path / "run"
    rec = Recorder()
    with pytest.raises(slidetune.TrainingError) as caught:
        slidetune.train(config(corpus, out, max_steps=4, save_every=1), callbacks=[rec, StopAtStep(2)])
    message = str(caught.value)
    assert message.startswith("callback StopAtStep.on_step raised at step 2: ValueError: loss ")
    assert "is not what I wanted: training stopped" in message
    assert f"the newest checkpoint, {out / 'checkpoints' / 'checkpoint-1'}, is intact" in message
    assert isinstance(caught.value.__cause__, ValueError)
    # the recorder before it heard step 2; nothing after it ran; the metrics so far are on disk
    assert [(k, s) for k, s, _ in rec.events] == [("eval", 0), ("step", 1), ("save", 1), ("step", 2)]
    with (out / "metrics.csv").open(newline="") as f:
        assert [r["step"] for r in csv.DictReader(f)] == ["0", "1", "2"]
    assert not (out / "final").exists()


def _in_python(out: Path, **kw) -> slidetune.TrainConfig:
    return slidetune.TrainConfig(model="tiny-llama", data=slidetune.DataConfig(seq_len=32),
                                 runtime=slidetune.RuntimeConfig(device="cpu"), batch_size=2, eval_batches=2,
                                 progress=False, output_dir=str(out), report_to="csv", max_steps=2,
                                 skip_reference_check=True, **kw)


def test_a_datasets_dataset_given_in_python_trains_as_its_file_would(tmp_path):
    """slidetune.train(cfg, train_dataset=Dataset, eval_dataset=Dataset): the rows read like a
    JSONL file's (here prompt/completion), the same losses as the file, summary.json naming the
    dataset by its fingerprint; a list of record dicts too; the data given twice is refused."""
    import datasets
    rows = [{"prompt": doc[:80], "completion": doc[80:240]} for doc in builtin_corpus()[:40]]
    held = [{"prompt": doc[:80], "completion": doc[80:240]} for doc in builtin_corpus()[40:50]]
    path, eval_path = tmp_path / "rows.jsonl", tmp_path / "held.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    eval_path.write_text("".join(json.dumps(r) + "\n" for r in held))
    from_file = slidetune.train(dataclasses_replace_data(_in_python(tmp_path / "file"), path=str(path),
                                                         eval_path=str(eval_path)))
    given = slidetune.train(_in_python(tmp_path / "given"), train_dataset=datasets.Dataset.from_list(rows),
                            eval_dataset=datasets.Dataset.from_list(held))
    assert (given.first_loss, given.last_loss, given.eval_loss_after) == (from_file.first_loss, from_file.last_loss,
                                                                         from_file.eval_loss_after)
    summary = json.loads((tmp_path / "given" / "summary.json").read_text())
    assert summary["data_source"].startswith("<datasets.Dataset of 40 rows, fingerprint ")
    assert summary["heldout_sequences"] == 10
    listed = slidetune.train(_in_python(tmp_path / "listed"), train_dataset=rows, eval_dataset=held)
    assert listed.last_loss == from_file.last_loss
    from slidetune.data import DataError
    with pytest.raises(DataError, match="the data is given twice"):
        slidetune.train(dataclasses_replace_data(_in_python(tmp_path / "twice"), path=str(path)), train_dataset=rows)


def dataclasses_replace_data(cfg: slidetune.TrainConfig, **data) -> slidetune.TrainConfig:
    import dataclasses
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **data))


def test_an_iterable_dataset_streams_through_the_token_cache_as_its_file_would(tmp_path):
    """slidetune.train(cfg, train_dataset=IterableDataset): streamed a chunk at a time into the cache's
    token file (keyed by its content), training as the same rows streamed from a file do; a second
    run finds that token file; a generator, which cannot be read twice, is refused."""
    import datasets
    rows = [{"prompt": doc[:80], "completion": doc[80:240]} for doc in builtin_corpus()[:40]]
    path, cache = tmp_path / "rows.jsonl", tmp_path / "cache"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from_file = slidetune.train(dataclasses_replace_data(_in_python(tmp_path / "file"), path=str(path),
                                                         streaming="on", cache_dir=str(cache)))
    stream = datasets.Dataset.from_list(rows).to_iterable_dataset()
    given = slidetune.train(dataclasses_replace_data(_in_python(tmp_path / "given"), cache_dir=str(cache)),
                            train_dataset=stream)
    assert (given.first_loss, given.last_loss, given.eval_loss_after) == (from_file.first_loss, from_file.last_loss,
                                                                         from_file.eval_loss_after)
    summary = json.loads((tmp_path / "given" / "summary.json").read_text())
    assert summary["data_source"] == "<datasets.IterableDataset of 40 rows given in Python>"
    entries = sorted(cache.glob("stream-*.bin"))
    assert len(entries) == 2                          # the file's and the iterable's, each keyed by its source
    again = slidetune.train(dataclasses_replace_data(_in_python(tmp_path / "again"), cache_dir=str(cache)),
                            train_dataset=stream)
    assert sorted(cache.glob("stream-*.bin")) == entries and again.last_loss == given.last_loss
    from slidetune.data import DataError
    with pytest.raises(DataError, match="can be read only once"):
        slidetune.train(_in_python(tmp_path / "gen"), train_dataset=(r for r in rows))
