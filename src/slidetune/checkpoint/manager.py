"""The run's checkpoints as one policy: what the trainer calls, instead of the package's functions.

`CheckpointManager` owns where the run's checkpoints go, when they are written and how:

    resume()                     load the checkpoint to continue from; the step to start from
    maybe_save(step)             the periodic save (--save-every), in the background where it can
                                 (--async-save), then the older ones pruned to --keep-last
    maybe_save(step, final=True) the resumable checkpoint of `step`, blocking, unless it is the one
                                 written or loaded last (a stop, the end of the run)
    poll(wait=False)             a background save that ended: the callbacks' on_save, or its error
    export(final_dir)            final/ (the model alone), then the end-of-run checkpoint
    close(), abandon()           on the way out: wait for a save in flight, or give it up

A failed save stops the run with the run's own error type (the trainer's TrainingError, passed in:
this package never imports the trainer), saying that the previous checkpoint is intact and how to
continue from it. An earlier run's checkpoints in the same directory (`stale`) are deleted by this
run's first save, once it is complete and read back: until then they are what a crash would leave.

With several ranks every rank calls the manager in step: rank 0 writes the checkpoint from the
shared host state (Ranks.on_main) while the others wait for its outcome, serving rank 0's reads of
their GPU state where the engine shards layers over the GPUs (the engine's save_service).
"""
from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .background import PendingSave, start_async_save
from .export import ModelExport
from .format import CheckpointError, checkpoint_dir
from .reader import load_checkpoint
from .saver import CheckpointSaver, overlap_note, resolve_async_save
from .store import latest_checkpoint, prune_checkpoints
from .writer import save_checkpoint

if TYPE_CHECKING:
    from ..engine.interface import Engine
    from ..parallel.ranks import Ranks
    from .space import SavePlan


@dataclass(frozen=True)
class SavePolicy:
    """When the run saves and in what form (TrainConfig's save settings, resolved)."""
    total_steps: int            # the run's length: its end has the final save, never a periodic one
    save_every: int = 0         # a resumable checkpoint every N steps (0: only at a stop and at the end)
    keep_last: int = 2          # resumable checkpoints kept in the directory (final/ is apart)
    async_save: str = "off"     # auto | on | off: periodic saves in the background (saver.resolve_async_save)
    save_dtype: str = "fp32"    # final/'s weights (space.resolve_save_dtype); checkpoints keep FP32


@dataclass(frozen=True)
class RunHooks:
    """What the manager asks of the run it saves for, given by the trainer."""
    error: type[Exception]                       # what a failed save raises: the run's TrainingError
    log_rows: Callable[[], None]                 # the metrics rows so far to disk: a checkpoint's rows are there
    flush_files: Callable[[], None]              # the rows and the plot, on the way out of a failed save
    notify: Callable[[str, int, Any], None]      # the callbacks' hook(step, arg): on_save(step, path)
    metrics_path: Path                           # named in a failed save's message


class CheckpointManager:
    """The checkpoints of one invocation of a run: see the module docstring.

    `saved_step` is the step of the newest checkpoint in the directory that this invocation wrote
    or resumed from (a stop or the end at that step writes none again); `written_step` the newest
    it wrote itself (None after a resume until the first save: the trainer's hint when the resumed
    state itself diverges).
    """

    def __init__(self, engine: Engine, policy: SavePolicy, hooks: RunHooks, *, directory: Path, output_dir: Path,
                 ranks: Ranks, run_record: dict, tokenizer=None, resume_from: Path | None = None,
                 stale: list[Path] | None = None, space: SavePlan | None = None, on_gpu: bool = False):
        self.engine, self.policy, self.hooks, self.ranks = engine, policy, hooks, ranks
        self.directory, self.output_dir, self.tokenizer = directory, output_dir, tokenizer
        self.run_record = run_record             # the run's settings, in each checkpoint's state.json
        self.resume_from = resume_from           # verified before the engine existed (train_setup._resolve_resume)
        self.stale = list(stale or [])           # an earlier run's checkpoints, deleted by the first save
        self.saved_step: int | None = None
        self.written_step: int | None = None
        self.resumable = space is None or space.resumable      # resumable checkpoints fit the disk
        # final/ fits only once the disk tier's files are gone (space.py): removed before it is written
        self.release_scratch_first = space is not None and space.release_scratch_first
        # data parallel with sharded layers: the ranks that keep them serve rank 0's reads during a save
        self.save_service = engine.save_service
        # `on` where the engine cannot is refused here; every save's timing goes to saves.jsonl (rank 0)
        asynchronous, self.async_why = resolve_async_save(policy.async_save, engine, on_gpu)
        self.saver = CheckpointSaver(asynchronous, output_dir / "saves.jsonl" if ranks.is_main else None)
        self._overlap_noted = False              # the hint that background saves wait on each other: once

    # ------------------------------------------------------------------ start
    def resume(self) -> int:
        """Load the checkpoint to continue from, if any; the step to start from (0: a fresh start)."""
        if self.resume_from is None:
            return 0
        # every file was verified before the engine existed; what is left is checking each tensor
        # against this engine, before its state is touched
        state = load_checkpoint(self.engine, self.resume_from, checked=True)
        step = int(state.get("step", self.engine.step_index))
        if self.resume_from.parent.resolve() == self.directory.resolve():
            self.saved_step = step
        print(f"resumed from {self.resume_from} at step {step} of {self.policy.total_steps}")
        return step

    def announce(self) -> None:
        """Say, once before step 1, that the periodic checkpoints are written in the background."""
        if self.policy.save_every and self.saver.asynchronous and self.ranks.is_main:
            print(f"checkpoints every {self.policy.save_every} steps are written in the background while training "
                  f"goes on ({self.async_why}; what each one cost: {self.output_dir / 'saves.jsonl'})")

    # ------------------------------------------------------------------ saving
    def due(self, step: int) -> bool:
        """A periodic checkpoint after step `step` (the last step's is the end-of-run one, export's)."""
        every = self.policy.save_every
        return bool(every and step % every == 0 and step < self.policy.total_steps)

    def maybe_save(self, step: int, final: bool = False) -> Path | None:
        """The checkpoint of `step` where the policy asks for one; its path, or None (none written).

        Periodic (`final` False): on --save-every's multiples before the last step; in the background
        where the saver is asynchronous (this returns once the save has started, after the previous
        one has ended; poll collects it). `final`: the resumable checkpoint of `step` now, blocking
        (a stop, the end of the run), unless it is the one written or loaded last; None where
        resumable checkpoints do not fit the disk."""
        if final:
            if not self.resumable:
                return None
            self.poll(wait=True)
            return self._save_blocking(step) if self.saved_step != step else checkpoint_dir(self.directory, step)
        if not self.due(step):
            return None
        return self._start_async(step) if self.saver.asynchronous else self._save_blocking(step)

    def _start_async(self, step: int) -> Path:
        """Start the background save of `step` once the previous one has ended (a hint, once, if it
        was still being written)."""
        previous = self.poll(wait=True)                  # a second save waits for the first
        if previous is not None and not self._overlap_noted:
            note = overlap_note(previous.timing, self.policy.save_every)
            if note:
                print(note, file=sys.stderr)
                self._overlap_noted = True
        self.hooks.log_rows()
        path = checkpoint_dir(self.directory, step)
        stale = self.stale
        self.saver.start(lambda: start_async_save(
            self.engine, path, step=step, tokenizer=self.tokenizer, trainer_state=self._trainer_state(step),
            after=lambda done: after_save(self.directory, done, stale, self.policy.keep_last)))
        self.saved_step = self.written_step = step
        return path

    def _save_blocking(self, step: int) -> Path:
        """Write `checkpoint-<step>` now, timed, then on_save. With several ranks rank 0 writes the whole
        checkpoint from the shared host state (its synchronize() waits for every owner's updates; the
        other ranks cannot change the state meanwhile, as their next step waits for rank 0) and the
        others wait for the outcome."""
        path = self.ranks.on_main(
            lambda: self.saver.blocking(step, lambda streams: self._write(step, streams)), service=self.save_service)
        self.saved_step = self.written_step = step
        self.hooks.notify("on_save", step, path)
        return path

    def _write(self, step: int, stream_s: dict[str, float] | None = None) -> Path:
        """The checkpoint of `step` written, the metrics rows first (rank 0 alone); a failure is the
        run's error, naming what is intact and how to continue."""
        self.hooks.log_rows()
        try:
            return write_checkpoint(self.engine, self.directory, step, tokenizer=self.tokenizer,
                                    trainer_state=self._trainer_state(step), stale=self.stale,
                                    keep_last=self.policy.keep_last, stream_s=stream_s)
        except CheckpointError as e:
            self.hooks.flush_files()
            raise self.hooks.error(f"{e}. Training stopped after step {step}; metrics up to that step are in "
                                   f"{self.hooks.metrics_path}. Free some space (or fix the output directory) and "
                                   f"continue from the intact checkpoint with --output-dir {self.output_dir} "
                                   f"--resume auto") from e

    def _trainer_state(self, step: int) -> dict:
        """state.json's trainer state. The run's settings are in it: a resume compares its settings with
        the checkpoint's own, not with config.json (a fresh run rewrites that before its first save,
        while the earlier run's checkpoints are still the newest)."""
        return {"step": step, "config": self.run_record}

    def poll(self, wait: bool = False) -> PendingSave | None:
        """The background save in flight once it has ended (`wait`: waiting for it): on_save, or its
        error as the run's error (the previous checkpoint is intact). The save collected, or None
        (still running, or none)."""
        done = self.saver.poll(wait)
        if done is None:
            return None
        step = done.timing.step
        if done.error is not None:
            self.hooks.flush_files()
            raise self.hooks.error(
                f"{done.error}. Training stopped after step {self.engine.step_index} (the checkpoint of step {step} "
                f"was being written in the background, --async-save); metrics are in {self.hooks.metrics_path}. "
                f"Free some space (or fix the output directory) and continue from the intact checkpoint with "
                f"--output-dir {self.output_dir} --resume auto") from done.error
        self.hooks.notify("on_save", step, done.path)
        return done

    # ------------------------------------------------------------------ the end
    def export(self, final_dir: Path, export: ModelExport | None = None) -> None:
        """`final_dir` (the model alone, --save-dtype; `export`: as a model repository, export.py), then
        the end-of-run resumable checkpoint: the model is kept whether or not the resumable state can
        be written after it."""
        total = self.policy.total_steps
        if self.release_scratch_first:
            self.engine.release_disk_tier()
        self.ranks.on_main(lambda: self._write_final(final_dir, export), service=self.save_service)
        print(f"final model: {final_dir} (AutoModelForCausalLM.from_pretrained loads it)")
        self.hooks.notify("on_save", total, final_dir)
        self.maybe_save(total, final=True)

    def _write_final(self, final_dir: Path, export: ModelExport | None = None) -> None:
        """export's writing of `final_dir` (rank 0 alone); where it fails, the resumable checkpoint is
        written instead, so that the trained weights are kept and the export can be retried."""
        total = self.policy.total_steps
        try:
            save_checkpoint(self.engine, final_dir, step=total, tokenizer=self.tokenizer,
                            save_dtype=self.policy.save_dtype, with_optimizer=False, export=export)
        except CheckpointError as e:
            kept = None
            if self.resumable:
                try:
                    kept = (self._write(total) if self.saved_step != total
                            else checkpoint_dir(self.directory, total))
                except self.hooks.error:
                    kept = None
            self.hooks.flush_files()
            raise self.hooks.error(f"{e}. The training itself finished: " + (
                f"the resumable checkpoint {kept} holds the final weights; run again with --output-dir "
                f"{self.output_dir} --resume auto to retry the export" if kept
                else "no checkpoint could be written either")) from e

    def close(self) -> None:
        """On the way out (the end, or an error): wait for a save in flight; its failure is a note here
        (the run's own outcome, or its real error, is what is raised)."""
        try:
            done = self.saver.settle()
        except Exception as e:  # noqa: BLE001 - never hide the run's own error
            print(f"note: the checkpoint being written in the background could not be finished: {e}", file=sys.stderr)
            return
        if done is not None and done.error is not None:
            print(f"note: {done.error}", file=sys.stderr)

    def abandon(self) -> None:
        """Interrupted twice: give up a save in flight (its temporary directory goes at the next start)."""
        self.saver.abandon()

    def newest(self) -> Path | None:
        """The newest complete checkpoint in the directory (what an error names as intact)."""
        return latest_checkpoint(self.directory)

    def totals(self) -> dict:
        """summary.json's figures of this invocation's saves (CheckpointSaver.totals)."""
        return self.saver.totals()


def write_checkpoint(engine: Engine, directory: Path, step: int, *, tokenizer=None, trainer_state: dict | None = None,
                     stale: list[Path] | None = None, keep_last: int = 2,
                     stream_s: dict[str, float] | None = None) -> Path:
    """Save `checkpoint-<step>` in `directory`; then delete an earlier run's checkpoints (`stale`,
    emptied) and prune to `keep_last`."""
    path = save_checkpoint(engine, checkpoint_dir(directory, step), step=step, tokenizer=tokenizer,
                           trainer_state=trainer_state, stream_s=stream_s)
    after_save(directory, path, stale, keep_last)
    return path


def after_save(directory: Path, path: Path, stale: list[Path] | None, keep_last: int) -> None:
    """Once `path` is complete and read back against its digests (write_checkpoint, or a background
    save's last act): delete an earlier run's checkpoints (`stale`, emptied), then prune to `keep_last`."""
    for old in stale or []:
        if old.resolve() != path.resolve():
            shutil.rmtree(old, ignore_errors=True)
    if stale:
        stale.clear()
    prune_checkpoints(directory, keep_last, verified=path)
