"""CheckpointManager's policy on a tiny CPU model (slide mode, fp32): which steps are saved, what a
save deletes, what a failed save raises, what export writes and in which order, resume."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from slidetune.checkpoint import (CheckpointManager, RunHooks, SavePlan, SavePolicy, check_checkpoint,
                                  complete_checkpoints)
from slidetune.checkpoint.manager import write_checkpoint
from slidetune.parallel.ranks import Ranks
from test_checkpoint import assert_close, batches, make_engine, masters, shut
from test_train_errors import fill_disk_for


class Failed(RuntimeError):
    """Stands in for the trainer's TrainingError: what the manager is told to raise."""


class RunSide:
    """The trainer's side of RunHooks, recording each call in order."""

    def __init__(self):
        self.events: list = []

    def log_rows(self) -> None:
        self.events.append("rows")

    def flush_files(self) -> None:
        self.events.append("files")

    def notify(self, hook: str, step: int, arg) -> None:
        self.events.append((hook, step, Path(arg).name))

    def saves(self) -> list[tuple[int, str]]:
        """(step, directory name) of each on_save heard."""
        return [(e[1], e[2]) for e in self.events if isinstance(e, tuple) and e[0] == "on_save"]


@pytest.fixture
def engine():
    eng = make_engine()
    yield eng
    shut(eng)


def manager_for(engine, out: Path, run: RunSide, *, total: int = 6, save_every: int = 2, keep_last: int = 2,
                async_save: str = "off", **kw) -> CheckpointManager:
    policy = SavePolicy(total, save_every=save_every, keep_last=keep_last, async_save=async_save)
    hooks = RunHooks(error=Failed, log_rows=run.log_rows, flush_files=run.flush_files, notify=run.notify,
                     metrics_path=out / "metrics.csv")
    return CheckpointManager(engine, policy, hooks, directory=out / "checkpoints", output_dir=out,
                             ranks=Ranks.single(), run_record={"model": "tiny", "seed": 1}, **kw)


def step(engine, s: int) -> int:
    """Train step `s` (0-based); the number of steps done."""
    engine.train_step(batches(s), 1e-3)
    return s + 1


def names(out: Path) -> list[str]:
    return [p.name for p in complete_checkpoints(out / "checkpoints")]


def save_records(out: Path) -> list[dict]:
    path = out / "saves.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_periodic_saves_fall_on_save_every_multiples_before_the_last_step(engine, tmp_path):
    run = RunSide()
    m = manager_for(engine, tmp_path, run, total=6, save_every=2, keep_last=5)
    written = {}
    for s in range(6):
        done = step(engine, s)
        assert m.due(done) == (done in (2, 4))
        written[done] = m.maybe_save(done)
    assert {k: v.name for k, v in written.items() if v is not None} == {2: "checkpoint-2", 4: "checkpoint-4"}
    assert names(tmp_path) == ["checkpoint-2", "checkpoint-4"]
    # the metrics rows go to disk before each save, and the callbacks hear of each save after it
    assert run.events == ["rows", ("on_save", 2, "checkpoint-2"), "rows", ("on_save", 4, "checkpoint-4")]
    assert [(r["step"], r["mode"], r["ok"]) for r in save_records(tmp_path)] == [(2, "blocking", True),
                                                                                 (4, "blocking", True)]
    # the run's record and step in the checkpoint's state.json: what a resume compares with
    state = json.loads((tmp_path / "checkpoints/checkpoint-4/trainer_state/state.json").read_text())
    assert state["trainer_state"] == {"step": 4, "config": {"model": "tiny", "seed": 1}}
    assert m.saved_step == m.written_step == 4 and m.totals()["checkpoint_saves"] == 2


def test_no_periodic_save_without_save_every(engine, tmp_path):
    m = manager_for(engine, tmp_path, RunSide(), total=3, save_every=0)
    assert [m.maybe_save(step(engine, s)) for s in range(2)] == [None, None]
    assert names(tmp_path) == [] and save_records(tmp_path) == []


def test_keep_last_prunes_to_the_newest_checkpoints(engine, tmp_path):
    m = manager_for(engine, tmp_path, RunSide(), total=5, save_every=1, keep_last=2)
    for s in range(4):
        m.maybe_save(step(engine, s))
    assert names(tmp_path) == ["checkpoint-3", "checkpoint-4"]


def test_the_first_save_deletes_an_earlier_runs_checkpoints(engine, tmp_path):
    ckpts = tmp_path / "checkpoints"
    for old in (5, 7):       # an earlier run's, at steps beyond this run's first save
        write_checkpoint(engine, ckpts, old, trainer_state={"step": old}, keep_last=5)
    stale = complete_checkpoints(ckpts)
    m = manager_for(engine, tmp_path, RunSide(), total=6, save_every=2, keep_last=2, stale=stale)
    step(engine, 0)
    assert m.maybe_save(1) is None
    assert names(tmp_path) == ["checkpoint-5", "checkpoint-7"]       # kept until this run has a checkpoint
    step(engine, 1)
    m.maybe_save(2)
    assert names(tmp_path) == ["checkpoint-2"] and m.stale == []
    assert sorted(p.name for p in ckpts.iterdir()) == ["checkpoint-2"]


def test_a_failed_save_raises_the_runs_error_and_keeps_the_previous_checkpoint(engine, tmp_path, monkeypatch):
    run = RunSide()
    m = manager_for(engine, tmp_path, run, total=6, save_every=2)
    for s in range(2):
        step(engine, s)
    m.maybe_save(2)
    fill_disk_for(monkeypatch, "checkpoint-4")
    for s in range(2, 4):
        step(engine, s)
    with pytest.raises(Failed) as caught:
        m.maybe_save(4)
    message = str(caught.value)
    assert "No space left on device" in message
    assert (f"Training stopped after step 4; metrics up to that step are in {tmp_path / 'metrics.csv'}. Free some "
            f"space (or fix the output directory) and continue from the intact checkpoint with --output-dir "
            f"{tmp_path} --resume auto") in message
    assert names(tmp_path) == ["checkpoint-2"]
    check_checkpoint(tmp_path / "checkpoints/checkpoint-2")
    # the rows and the plot flushed on the way out; no on_save for the failed one
    assert run.events[-2:] == ["rows", "files"] and run.saves() == [(2, "checkpoint-2")]
    assert [r["ok"] for r in save_records(tmp_path)] == [True, False]
    assert m.saved_step == 2


def test_a_final_save_is_written_once_a_step_and_not_where_it_does_not_fit(engine, tmp_path):
    run = RunSide()
    m = manager_for(engine, tmp_path, run, total=6, save_every=2)
    for s in range(2):
        step(engine, s)
    periodic = m.maybe_save(2)
    assert m.maybe_save(2, final=True) == periodic                    # a stop right after a save: none again
    step(engine, 2)
    assert m.maybe_save(3, final=True).name == "checkpoint-3"
    assert run.saves() == [(2, "checkpoint-2"), (3, "checkpoint-3")] and len(save_records(tmp_path)) == 2
    unfit = manager_for(engine, tmp_path / "unfit", RunSide(), space=SavePlan(1, 1, resumable=False))
    assert unfit.maybe_save(3, final=True) is None and names(tmp_path / "unfit") == []


def test_export_writes_final_then_the_resumable_checkpoint(engine, tmp_path):
    run = RunSide()
    m = manager_for(engine, tmp_path, run, total=3, save_every=0)
    for s in range(3):
        step(engine, s)
    m.export(tmp_path / "final")
    assert run.saves() == [(3, "final"), (3, "checkpoint-3")]
    assert check_checkpoint(tmp_path / "checkpoints/checkpoint-3").step == 3
    assert (tmp_path / "final/COMPLETE").exists() and (tmp_path / "final/model.safetensors").exists()
    assert not (tmp_path / "final/trainer_state/optimizer.safetensors").exists()     # the model alone
    assert m.saved_step == 3


def test_a_failed_export_keeps_the_final_weights_in_the_resumable_checkpoint(engine, tmp_path, monkeypatch):
    run = RunSide()
    m = manager_for(engine, tmp_path, run, total=2, save_every=0)
    for s in range(2):
        step(engine, s)
    fill_disk_for(monkeypatch, "exported")
    with pytest.raises(Failed) as caught:
        m.export(tmp_path / "exported")
    kept = tmp_path / "checkpoints/checkpoint-2"
    assert (f"The training itself finished: the resumable checkpoint {kept} holds the final weights; run again "
            f"with --output-dir {tmp_path} --resume auto to retry the export") in str(caught.value)
    check_checkpoint(kept)
    assert run.saves() == [] and "files" in run.events


def test_resume_loads_the_checkpoint_and_counts_it_as_saved(tmp_path):
    first, second = make_engine(seed=1), make_engine(seed=2)
    try:
        m = manager_for(first, tmp_path, RunSide(), total=6, save_every=2)
        for s in range(2):
            step(first, s)
        path = m.maybe_save(2)
        resumed = manager_for(second, tmp_path, RunSide(), total=6, save_every=2, resume_from=path)
        assert resumed.resume() == 2
        assert_close(masters(second), masters(first))
        assert resumed.saved_step == 2 and resumed.written_step is None
        assert resumed.maybe_save(2, final=True) == path and len(save_records(tmp_path)) == 1
        assert manager_for(second, tmp_path / "fresh", RunSide()).resume() == 0
    finally:
        shut(first)
        shut(second)


def test_a_background_save_is_collected_by_poll(engine, tmp_path, monkeypatch):
    run = RunSide()
    m = manager_for(engine, tmp_path, run, total=6, save_every=2, async_save="on")
    for s in range(2):
        step(engine, s)
    path = m.maybe_save(2)                        # returns once the save has started
    assert path.name == "checkpoint-2" and m.saved_step == 2
    done = m.poll(wait=True)
    assert done.path == path and run.saves() == [(2, "checkpoint-2")]
    assert [r["mode"] for r in save_records(tmp_path)] == ["async"]

    fill_disk_for(monkeypatch, "checkpoint-4")
    for s in range(2, 4):
        step(engine, s)
    m.maybe_save(4)
    with pytest.raises(Failed, match=r"Training stopped after step 4 \(the checkpoint of step 4 was being written "
                                     r"in the background, --async-save\)"):
        m.poll(wait=True)
    assert names(tmp_path) == ["checkpoint-2"] and run.events[-1] == "files"


def test_close_makes_a_failed_background_save_a_note(engine, tmp_path, monkeypatch, capsys):
    run = RunSide()
    m = manager_for(engine, tmp_path, run, total=6, save_every=2, async_save="on")
    fill_disk_for(monkeypatch, "checkpoint-2")
    for s in range(2):
        step(engine, s)
    m.maybe_save(2)
    m.close()                       # on the way out: the run's own outcome is what is raised, not this
    err = capsys.readouterr().err
    assert err.startswith("note: saving the checkpoint") and "No space left on device" in err
    assert [(r["mode"], r["ok"]) for r in save_records(tmp_path)] == [("async", False)]
    assert run.saves() == [] and names(tmp_path) == []
