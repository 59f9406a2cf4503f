"""Asynchronous checkpoints (checkpoint/background.py, checkpoint/saver.py; issue 33 item 7).

- an asynchronous save writes the blocking save's files byte for byte (every tensor file, the
  RNG states) while the run trains on, and resuming from it ends bit for bit where the blocking
  save's run ends: the clipped schedule (the default), eager, units updated on the device, units
  on the disk tier (moments and masters);
- the updates really waited for a slow writer, and the run's trajectory is unchanged by it;
- a failing writer (a full disk, an injected fault) raises in the step loop, keeps the previous
  checkpoint byte for byte, leaves nothing behind, and never leaves an update waiting;
- `train --async-save on`: a second save waits for the first (saves.jsonl), the run matches one
  with blocking saves, and a kill -9 during a save (stalled past its tensors while training goes
  on) leaves the previous checkpoint complete, from which --resume auto ends with the
  uninterrupted run's weights.
"""
from __future__ import annotations

import csv
import errno
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import slidetune
import slidetune.checkpoint.writer as writer_mod
import slidetune.faults as faults
from slidetune.checkpoint.background import start_async_save
from slidetune.checkpoint import CheckpointError, check_checkpoint, checkpoint_dir, load_checkpoint, save_checkpoint
from slidetune.checkpoint.background import SaveTiming
from slidetune.checkpoint.saver import CheckpointSaver, overlap_note, resolve_async_save
from slidetune.engine.slide.disk_tier import StreamedTensor
from test_checkpoint import make_engine, shut, train
from test_train_errors import fill_disk_for
from test_disk_tier import DISK, assert_identical, state

SRC = str(Path(slidetune.__file__).resolve().parents[1])
RECIPES = {                      # name -> make_engine options (max_grad_norm set: the clipped schedule)
    "clipped": dict(max_grad_norm=0.5),
    "eager": dict(),
    "device-units": dict(max_grad_norm=0.5, runtime={"device_layers": 2}),
    "eager-vocab-device": dict(runtime={"vocab_update": "device"}),
    "disk-master": dict(max_grad_norm=0.5, runtime=dict(disk_units=2, disk_master="on", **DISK)),
}


def engine_for(recipe: str, tmp_path: Path, seed: int = 1):
    kw = dict(RECIPES[recipe])
    if "disk_units" in kw.get("runtime", {}):
        scratch = tmp_path / "scratch"
        scratch.mkdir(exist_ok=True)
        kw["runtime"] = dict(kw["runtime"], disk_dir=str(scratch))
    return make_engine(seed=seed, **kw)


def slow_writes(monkeypatch, delay_s: float) -> None:
    """Every tensor a checkpoint writes takes `delay_s` more (a slow disk): the steps after an
    asynchronous save's start overtake its writer."""
    real = writer_mod.write_safetensors

    def slowed(t):
        def source():
            for part in (t.chunks() if isinstance(t, StreamedTensor) else [t.detach().reshape(-1)]):
                time.sleep(delay_s)
                yield part
        return StreamedTensor(tuple(t.shape), t.dtype, source)

    def slow(tensors, path, *a, **kw):
        return real({k: slowed(t) for k, t in tensors.items()}, path, *a, **kw)
    monkeypatch.setattr(writer_mod, "write_safetensors", slow)


def manifest(ckpt: Path) -> dict:
    return json.loads((ckpt / "MANIFEST.json").read_text())["files"]


def tree(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


def leftovers(d: Path) -> list[str]:
    return [p.name for p in d.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


# --------------------------------------------------------------------------- library level
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_async_save_is_the_blocking_save_and_resumes_exactly(recipe, tmp_path, monkeypatch):
    async_against_blocking(recipe, tmp_path, monkeypatch)


@pytest.mark.parametrize("recipe", ["clipped", "disk-master"])
def test_async_save_with_the_optimizer_state_in_parts(recipe, tmp_path, monkeypatch):
    """A large checkpoint's optimizer state goes out as two files beside the weights (three streams):
    the units are still released front to back, and the files are the blocking save's."""
    parts = pytest.MonkeyPatch()              # apart from `monkeypatch`, which the run undoes midway
    parts.setattr(writer_mod, "OPTIM_PARTS_FROM_BYTES", 1)
    try:
        async_against_blocking(recipe, tmp_path, monkeypatch)
    finally:
        parts.undo()
    files = sorted(p.name for p in (checkpoint_dir(tmp_path / "a", 2) / "trainer_state").iterdir())
    assert "optimizer-00002-of-00002.safetensors" in files and "optimizer.safetensors" not in files


def async_against_blocking(recipe, tmp_path, monkeypatch) -> None:
    # A: an asynchronous save at step 2, two steps trained while a slow writer writes it
    a = engine_for(recipe, tmp_path)
    try:
        train(a, range(2))
        torch.manual_seed(7)
        slow_writes(monkeypatch, 0.02)
        pending = start_async_save(a, checkpoint_dir(tmp_path / "a", 2), step=2, trainer_state={"row": 3})
        losses_a = train(a, range(2, 4))
        assert pending.wait() == checkpoint_dir(tmp_path / "a", 2)
        monkeypatch.undo()
        timing = pending.timing
        assert timing.ok and timing.mode == "async" and timing.written_s <= timing.save_s
        assert timing.held_s > 0, "no update waited for the writer: the save did not overlap the steps"
        end_a = state(a)
    finally:
        shut(a)
    # B: the same run with a blocking save
    b = engine_for(recipe, tmp_path)
    try:
        train(b, range(2))
        torch.manual_seed(7)
        save_checkpoint(b, checkpoint_dir(tmp_path / "b", 2), step=2, trainer_state={"row": 3})
        losses_b = train(b, range(2, 4))
        end_b = state(b)
    finally:
        shut(b)
    assert losses_a == losses_b                      # the same trajectory, bit for bit
    assert_identical(end_a, end_b)
    got, want = manifest(checkpoint_dir(tmp_path / "a", 2)), manifest(checkpoint_dir(tmp_path / "b", 2))
    assert got.keys() == want.keys()
    for name in got:                                 # state.json differs by its time alone
        if name != "trainer_state/state.json":
            assert got[name] == want[name], name
    assert check_checkpoint(checkpoint_dir(tmp_path / "a", 2)).verified
    # C: resumed from the asynchronous checkpoint, it ends where B (and A) ended
    c = engine_for(recipe, tmp_path, seed=99)
    try:
        assert load_checkpoint(c, checkpoint_dir(tmp_path / "a", 2)) == {"row": 3, "step": 2}
        assert train(c, range(2, 4)) == losses_b
        assert_identical(state(c), end_b)
    finally:
        shut(c)


@pytest.mark.parametrize("how", ["disk full", "injected", "abandoned"])
def test_a_failing_writer_raises_keeps_the_previous_checkpoint_and_releases_the_updates(how, tmp_path,
                                                                                        monkeypatch):
    eng = engine_for("clipped", tmp_path)
    try:
        train(eng, range(2))
        first = save_checkpoint(eng, checkpoint_dir(tmp_path, 2), step=2)
        before = tree(first)
        train(eng, range(2, 3))
        if how == "disk full":
            def enospc(*a, **kw):
                raise OSError(errno.ENOSPC, "No space left on device")
            monkeypatch.setattr(writer_mod, "write_safetensors", enospc)
        elif how == "injected":
            monkeypatch.setenv("SLIDETUNE_INJECT_FAULT", "checkpoint:3")
        else:
            slow_writes(monkeypatch, 0.05)
        pending = start_async_save(eng, checkpoint_dir(tmp_path, 3), step=3)
        if how == "abandoned":                       # a second Ctrl-C: given up, never renamed into place
            pending.abandon()
        train(eng, range(3, 5))                      # no update waits for a writer that failed
        with pytest.raises(CheckpointError) as info:
            pending.wait()
        assert str(first) in str(info.value) and "intact" in str(info.value)
        assert {"disk full": "No space left", "injected": "injected fault", "abandoned": "abandoned"}[how] \
            in str(info.value)
        assert pending.timing.ok is False and all(h.released for h in pending.holds)
        monkeypatch.undo()
        assert tree(first) == before and leftovers(tmp_path) == []
        assert not checkpoint_dir(tmp_path, 3).exists()
        # the engine is whole: the next save works
        assert start_async_save(eng, checkpoint_dir(tmp_path, 5), step=5).wait() == checkpoint_dir(tmp_path, 5)
    finally:
        shut(eng)


def test_the_overlap_note_names_a_save_every_that_keeps_the_saves_apart():
    # a save of 137 s whose next one came due 40 s into it: 20 steps took 97 s, so 20 x 137/97 x 1.1 -> 32
    late = SaveTiming(step=20, mode="async", save_s=137.0, waited_s=40.0)
    note = overlap_note(late, save_every=20)
    assert note.startswith("note: the checkpoint of step 20 was still being written") and "waited 40.0 s" in note
    assert "--save-every 32 or more" in note
    assert overlap_note(SaveTiming(step=20, mode="async", save_s=137.0, waited_s=0.2), 20) is None
    assert overlap_note(SaveTiming(step=20, mode="blocking", save_s=114.0, waited_s=5.0), 20) is None


def test_a_run_whose_async_saves_overlap_says_so_once(tmp_path, monkeypatch, capsys):
    corpus = tmp_path / "small.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " * 30}) + "\n" for i in range(40)))
    # the save of step 1 stalls 2 s past its tensors (its holds released): step 2's save waits for it
    monkeypatch.setenv("SLIDETUNE_INJECT_FAULT", "stall:1")
    monkeypatch.setattr(faults, "STALL_S", 2.0)
    cfg = slidetune.TrainConfig(model="tiny-llama", data=slidetune.DataConfig(path=str(corpus), seq_len=32),
                                runtime=slidetune.RuntimeConfig(device="cpu"), batch_size=2, eval_batches=1,
                                progress=False, output_dir=str(tmp_path / "run"), report_to="csv",
                                max_steps=4, save_every=1, keep_last=1, async_save="on")
    slidetune.train(cfg)
    err = capsys.readouterr().err
    assert err.count("was still being written when the next one came due") == 1, err
    saves = [json.loads(line) for line in (tmp_path / "run" / "saves.jsonl").read_text().splitlines()]
    assert [s["mode"] for s in saves] == ["async"] * 3 + ["blocking"] and saves[0]["waited_s"] >= 1.0
    assert int(re.search(r"--save-every (\d+) or more", err).group(1)) > 1, err
    assert all(s["streams_s"].keys() == {"weights", "optimizer.safetensors"} for s in saves)


def test_a_second_save_waits_for_the_first_and_each_is_recorded(tmp_path, monkeypatch):
    eng = engine_for("clipped", tmp_path)
    log = tmp_path / "saves.jsonl"
    saver = CheckpointSaver(True, log)
    try:
        train(eng, range(1))
        slow_writes(monkeypatch, 0.02)
        saver.start(lambda: start_async_save(eng, checkpoint_dir(tmp_path, 1), step=1))
        with pytest.raises(RuntimeError, match="still being written"):
            saver.start(lambda: start_async_save(eng, checkpoint_dir(tmp_path, 2), step=2))
        train(eng, range(1, 2))
        first = saver.poll(wait=True)                # what Trainer.save_checkpoint does before the next
        assert first.path == checkpoint_dir(tmp_path, 1) and first.error is None
        saver.start(lambda: start_async_save(eng, checkpoint_dir(tmp_path, 2), step=2))
        path = saver.blocking(3, lambda streams: save_checkpoint(eng, checkpoint_dir(tmp_path, 3), step=3,
                                                                 stream_s=streams))
        assert path.exists() and saver.pending is None     # the blocking save waited for the second
        # each save's streams, timed: the weights and the optimizer file, within the save
        for timing in saver.timings:
            assert timing.streams_s.keys() == {"weights", "optimizer.safetensors"}
            assert 0 < max(timing.streams_s.values()) <= timing.save_s
    finally:
        shut(eng)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["step"], r["mode"], r["ok"]) for r in records] == [(1, "async", True), (2, "async", True),
                                                                   (3, "blocking", True)]
    for prev, nxt in zip(records, records[1:]):
        assert nxt["started"] >= prev["started"] + prev["save_s"] - 0.01     # never two at once
    assert records[2]["blocked_s"] == records[2]["save_s"]
    assert saver.totals()["async_saves"] == 2


def test_async_save_is_refused_or_falls_back_where_it_cannot_run(tmp_path):
    plain = make_engine(mode="gpu")
    slide = engine_for("clipped", tmp_path)
    try:
        assert resolve_async_save("auto", plain, on_gpu=True)[0] is False
        with pytest.raises(ValueError, match="--async-save on is not possible"):
            resolve_async_save("on", plain, on_gpu=True)
        with pytest.raises(ValueError, match="not possible"):
            start_async_save(plain, tmp_path / "checkpoint-0", step=0)
        assert resolve_async_save("auto", slide, on_gpu=True)[0] is True
        assert resolve_async_save("auto", slide, on_gpu=False)[0] is False      # a CPU: off
        assert resolve_async_save("on", slide, on_gpu=False)[0] is True
        assert resolve_async_save("off", slide, on_gpu=True)[0] is False
    finally:
        shut(plain)
        shut(slide)


# --------------------------------------------------------------------------- the train command
def tiny_model(tmp_path: Path) -> list[str]:
    from slidetune.data.corpus import builtin_corpus
    data = tmp_path / "small.txt"
    data.write_text("\n\n".join(builtin_corpus()[:40]) + "\n")
    return ["--model", "tiny-llama", "--data", str(data), "--seq-len", "32", "--batch-size", "2",
            "--eval-batches", "1", "--progress", "false", "--device", "cpu"]


def run_train(argv: list[str], env: dict | None = None) -> subprocess.Popen:
    code = "import sys; from slidetune.cli import main; sys.exit(main(sys.argv[1:]))"
    full_env = {k: v for k, v in os.environ.items() if k != "SLIDETUNE_INJECT_FAULT"}
    full_env.update(PYTHONPATH=SRC, **(env or {}))
    return subprocess.Popen([sys.executable, "-c", code, "train", *argv], env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finished(proc: subprocess.Popen, timeout_s: float = 600) -> str:
    out, _ = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, out[-3000:]
    return out


def metric_rows(run: Path) -> list[dict]:
    if not (run / "metrics.csv").exists():
        return []
    with (run / "metrics.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(run / "final" / "model.safetensors"))


@pytest.mark.slow
def test_train_with_async_saves_matches_blocking_saves_and_records_them(tmp_path):
    """Periodic saves in the background (with an evaluation while one is in flight, and a stop whose
    own save waits for it) follow the blocking saves' run to the same weights."""
    base = tiny_model(tmp_path) + ["--max-steps", "4", "--save-every", "1", "--keep-last", "2", "--eval-every", "2"]
    runs = {mode: run_train(base + ["--async-save", mode, "--output-dir", str(tmp_path / mode)])
            for mode in ("on", "off")}
    stopped = tmp_path / "stopped"
    finished(run_train(base + ["--async-save", "on", "--stop-after", "3", "--output-dir", str(stopped)]))
    for proc in runs.values():
        finished(proc)
    on, off = tmp_path / "on", tmp_path / "off"
    assert [r["loss"] for r in metric_rows(on)] == [r["loss"] for r in metric_rows(off)]
    got, want = final_weights(on), final_weights(off)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert sorted(p.name for p in (on / "checkpoints").iterdir()) == ["checkpoint-3", "checkpoint-4"]
    for name in ("model.safetensors", "trainer_state/optimizer.safetensors"):
        assert manifest(on / "checkpoints/checkpoint-3")[name] == manifest(off / "checkpoints/checkpoint-3")[name]
    records = [json.loads(line) for line in (on / "saves.jsonl").read_text().splitlines()]
    assert [(r["step"], r["mode"]) for r in records] == [(1, "async"), (2, "async"), (3, "async"), (4, "blocking")]
    summary = json.loads((on / "summary.json").read_text())
    assert summary["checkpoint_saves"] == 4 and summary["async_saves"] == 3 and summary["save_blocked_s"] >= 0
    assert [r["mode"] for r in map(json.loads, (off / "saves.jsonl").read_text().splitlines())] == ["blocking"] * 4
    # the stop after step 3 waited for the save of step 2, then saved step 3 itself; resumed, the run
    # ends with the same weights
    records = [json.loads(line) for line in (stopped / "saves.jsonl").read_text().splitlines()]
    assert [(r["step"], r["mode"], r["ok"]) for r in records] == [(1, "async", True), (2, "async", True),
                                                                   (3, "blocking", True)]
    finished(run_train(base + ["--async-save", "on", "--resume", "auto", "--output-dir", str(stopped)]))
    got = final_weights(stopped)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


@pytest.mark.slow
def test_kill_9_during_an_async_save_leaves_the_previous_checkpoint_resumable_and_exact(tmp_path):
    base = tiny_model(tmp_path) + ["--max-steps", "5", "--save-every", "1", "--keep-last", "2",
                                   "--async-save", "on"]
    reference = run_train(base + ["--output-dir", str(tmp_path / "ref")])
    killed_dir = tmp_path / "killed"
    # the save of step 2 stalls once its tensors are written: training goes on to step 3, whose
    # save then waits for it
    proc = run_train(base + ["--output-dir", str(killed_dir)], env={"SLIDETUNE_INJECT_FAULT": "stall:2"})
    ckpts = killed_dir / "checkpoints"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        stalled = ckpts.is_dir() and any(p.name.startswith("checkpoint-2.tmp-") and
                                         (p / "trainer_state" / "optimizer.safetensors").exists()
                                         for p in ckpts.iterdir())
        if stalled and [r["step"] for r in metric_rows(killed_dir)][-1:] == ["3"]:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    time.sleep(0.5)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    names = sorted(p.name for p in ckpts.iterdir())
    assert "checkpoint-2" not in names and any(n.startswith("checkpoint-2.tmp-") for n in names), names
    assert check_checkpoint(ckpts / "checkpoint-1").step == 1       # complete and verified
    out = finished(run_train(base + ["--output-dir", str(killed_dir), "--resume", "auto"]))
    assert "resumed from" in out and "at step 1 of 5" in out
    assert not [n for n in os.listdir(ckpts) if ".tmp-" in n]
    finished(reference)
    got, want = final_weights(killed_dir), final_weights(tmp_path / "ref")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


@pytest.mark.slow
def test_train_stops_on_a_failed_async_save_keeping_the_previous_checkpoint(tmp_path, monkeypatch):
    """The disk fills while checkpoint-2 is written in the background: the step loop raises it (exit 2,
    the intact checkpoint-1 named, how to continue), nothing of checkpoint-2 is left, and no
    checkpoint was pruned for it."""
    import contextlib
    import io

    from slidetune.cli import main
    fill_disk_for(monkeypatch, "checkpoint-2")
    d = tmp_path / "full"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["train", *tiny_model(tmp_path), "--max-steps", "4", "--save-every", "1", "--keep-last", "1",
                     "--async-save", "on", "--output-dir", str(d)])
    err = err.getvalue()
    assert code == 2, err[-3000:]
    assert "No space left on device" in err and "checkpoint-1 is intact" in err and "--resume auto" in err
    assert "in the background" in err
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == ["checkpoint-1"]
    assert check_checkpoint(d / "checkpoints/checkpoint-1").step == 1
    assert not (d / "final").exists()


def test_the_watchdog_counts_a_held_wait_from_the_writers_last_progress():
    """A save that takes minutes is not a hang while its writer releases units; one that stops is."""
    from slidetune.engine.slide.update_hold import UpdateHold
    from slidetune.engine.slide.watchdog import HangError, Watchdog
    dog = Watchdog()
    dog.override_s = 1.0
    holds = [UpdateHold(), UpdateHold()]
    dog.watch_save(holds)
    dog._holds_since -= 10.0                     # the save started 10 s ago
    holds[0].release()                           # ... and its writer released a unit just now
    dog.check(5.0, "an upload", [])              # waited 5 s, but only ~0 s since the writer's progress
    holds[0].released_at -= 10.0                # no progress for 10 s: a stuck writer
    with pytest.raises(HangError):
        dog.check(5.0, "an upload", [])
    holds[1].release()                           # no save holds anything: the plain bound again
    with pytest.raises(HangError):
        dog.check(5.0, "an upload", [])


# --------------------------------------------------------------------------- on a GPU (the lead's machine)
GPU_RECIPES = {
    "clipped": ({}, 1.0),
    "clipped-device-layers-vocab-device": ({"device_layers": 1, "vocab_update": "device"}, 1.0),
    "eager-vocab-device": ({"vocab_update": "device"}, None),
}


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", list(GPU_RECIPES))
def test_on_the_gpu_the_async_checkpoint_holds_its_steps_state_while_training_goes_on(recipe, tmp_path, monkeypatch):
    """CUDA: page-locked masters, units updated on the device (copied down by the writer while their
    update waits on the compute thread). Two GPU runs need not agree bit for bit (atomics), so the
    checkpoint is compared with the engine's own state at the step it was taken."""
    from safetensors.torch import load_file

    from slidetune.engine import AdamWConfig, RuntimeConfig, build_engine
    from slidetune.models.load import LoadedModel, RandomInit, skeleton
    from slidetune.models.presets import tiny_config
    from slidetune.models.units import SplitModel
    from test_checkpoint import VOCAB
    runtime, clip = GPU_RECIPES[recipe]
    cfg = tiny_config("llama", vocab_size=VOCAB, layers=3)
    loaded = LoadedModel("t", SplitModel(skeleton(cfg)), RandomInit(1, std=0.1), None)
    eng = build_engine(loaded, RuntimeConfig(mode="slide", dtype="bf16", device="cuda", **runtime),
                       AdamWConfig(lr=1e-3, weight_decay=0.1), max_grad_norm=clip)
    try:
        train(eng, range(2))
        eng.synchronize()
        want = {k: v.detach().cpu().clone() for k, v in eng.named_master_params()}
        want.update({k: v.detach().cpu().clone() for k, v in eng.optimizer_tensors().items()})
        slow_writes(monkeypatch, 0.02)
        pending = start_async_save(eng, checkpoint_dir(tmp_path, 2), step=2)
        train(eng, range(2, 4))
        path = pending.wait()
        monkeypatch.undo()
        assert pending.timing.held_s > 0
        got = load_file(str(path / "model.safetensors")) | load_file(str(path / "trainer_state/optimizer.safetensors"))
        assert got.keys() == want.keys()
        for k in got:
            assert torch.equal(got[k].reshape(-1), want[k].reshape(-1)), k
        assert eng.step_index == 4 and check_checkpoint(path).step == 2
    finally:
        shut(eng)
