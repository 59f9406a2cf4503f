"""The training loop: data -> engine steps -> metrics, evaluation, checkpoints.

Interruptions are safe: SIGINT/SIGTERM set a flag that the loop checks between steps;
it then writes a resumable checkpoint and exits (`--stop-after N` does the same after N
steps of one invocation, for time-limited jobs). A non-finite loss or gradient norm stops
the run naming the step, keeping the metrics so far and the previous checkpoint. A failed
save (disk full) leaves the previous checkpoint intact and says so. Everything is
deterministic in (config, seed): the batch of step k is a pure function of k, and the
checkpoint holds the optimizer and RNG states, so `--resume auto` continues the same
trajectory (metrics.csv keeps the rows up to the checkpoint, then continues).

The metrics go to the trackers --report-to names (telemetry/run_metrics.py, telemetry/trackers.py:
metrics.csv, appended, and TensorBoard, W&B, MLflow), on rank 0; Python callers get each step,
evaluation and save through callbacks (callbacks.py, docs/library.md). What comes before step 1 (the
checks, the data, the output directory, the checkpoint to resume from) is train_setup.py; the
checkpoints' policy is checkpoint/manager.py.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import numpy as np
import torch

from .callbacks import Callback, CallbackFailed, call_hook
from .checkpoint import CheckpointManager, RunHooks, RunLock, SavePolicy, lock_run_directories, run_export
from .config import TrainConfig
from .data import IGNORE_INDEX, collate
from .data.build import BUILTIN_NAME
from .data.chat_template import load_chat_template
from .data.token_cache import cache_root
from .device import Device
from .engine import StepResult
from .engine.compile_cache import CompileCounters, describe_compile, remember_compile
from .evaluation.samples import decode_completion, encode_prompt, greedy_completions, write_samples
from .faults import maybe_fail
from .models.load import LoadedModel
from .objectives.pair_run import PairRun
from .parallel.ranks import Ranks
from .telemetry.flops import train_flops_per_token
from .telemetry.run_metrics import RunMetrics, _scalars, host_rss_meter, metric_columns
from .telemetry.trackers import TrackerUnavailable, resolve_report_to
from .train_setup import (Reporting, RunInputs, TrainingError, check_callbacks, checkpoint_root, prepare_training,
                          print_config, resolve_config_dtype, run_record, write_text)

if TYPE_CHECKING:
    from .engine.interface import Engine


def lr_at(cfg: TrainConfig, step: int, total: int) -> float:
    peak, warmup = cfg.optim.lr, cfg.warmup_for(total)
    if step < warmup:
        return peak * (step + 1) / warmup
    if cfg.lr_schedule == "constant":
        return peak
    progress = (step - warmup) / max(1, total - warmup)
    progress = min(1.0, max(0.0, progress))
    floor = peak * cfg.min_lr_ratio
    if cfg.lr_schedule == "linear":
        return floor + (peak - floor) * (1.0 - progress)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class _StopFlag:
    """SIGINT/SIGTERM -> finish the current step, checkpoint, exit; a second one aborts at once.

    Installed for the whole run once the engine exists: a signal during the held-out
    evaluation stops after the first step; one during the final evaluation or export lets
    them finish (the run is complete then).
    """

    def __init__(self):
        self.signal: int | None = None
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:      # not the main thread (e.g. under some test runners)
                pass
        return self

    def _handle(self, signum, frame):
        if self.signal is not None:       # a second Ctrl-C aborts immediately
            raise KeyboardInterrupt
        self.signal = signum
        try:                              # os.write: safe inside a signal handler, unlike print
            os.write(2, f"\nslidetune: received {signal.Signals(signum).name}: finishing the current step, "
                        f"then saving a resumable checkpoint (send it again to abort at once)\n".encode())
        except OSError:
            pass

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


@dataclass
class TrainSummary:
    output_dir: str
    steps: int
    eval_loss_before: float | None
    eval_loss_after: float | None
    ppl_before: float | None
    ppl_after: float | None
    first_loss: float | None
    last_loss: float | None
    tokens_per_s: float | None
    wall_s: float
    interrupted: bool = False            # stopped by SIGINT/SIGTERM (resumable checkpoint written)
    stopped_early: bool = False          # stopped by --stop-after (resumable checkpoint written)
    # what the perplexities were measured on: the built-in corpus is the running Python's
    # own documentation, so it (and the absolute perplexity) differs between Python versions
    data_source: str = ""
    train_sequences: int = 0
    heldout_sequences: int = 0
    device: str = ""
    dtype: str = ""                      # the compute dtype the run used (--dtype auto resolved)
    # resumable checkpoints this invocation wrote (saves.jsonl has each one): how many, how many in
    # the background (--async-save), their seconds, and the seconds they blocked the step loop
    checkpoint_saves: int = 0
    async_saves: int = 0
    save_s: float = 0.0
    save_blocked_s: float = 0.0
    # a preference objective (objectives/): its name, its pairs, the reference pass (seconds; read from
    # the cache rather than computed), and every held-out metric before and after (TRL's names)
    objective: str = "sft"
    train_pairs: int = 0
    heldout_pairs: int = 0
    reference_s: float | None = None
    reference_cached: bool | None = None
    eval_before: dict | None = None
    eval_after: dict | None = None
    # compiled layers (engine/compile_cache.py): dynamo's compile seconds over the run and inductor's
    # FX-graph / AOTAutograd cache hits and misses; None where the layers were not compiled
    compile_s: float | None = None
    compile_fx_cache_hits: int | None = None
    compile_fx_cache_misses: int | None = None
    compile_fx_cache_bypasses: int | None = None
    compile_autograd_cache_hits: int | None = None
    compile_autograd_cache_misses: int | None = None
    compile_frames: int | None = None       # Dynamo frames compiled: 2 for HF's layer, more is a recompile


def _full_batch(heldout, rows: list[int], real: int, batch_size: int, pad_id: int):
    """Rows `rows` of `heldout` as a batch of batch_size rows: the first `real` count, the rest (repeats of
    the first row) have every label ignored and add nothing. The last, shorter batch may leave a rank no
    row: it still runs a forward, as every rank must (the collectives a forward may issue, dp_weights=gather's
    broadcasts, match across ranks). Always batch_size rows: the training batches' shape, so compiled layers
    (dynamic=False) do not compile the evaluation's last batch anew; an 8B's ~12 held-out rows of 1024 at
    batch 16 were a [12, 1024] compile of the forward before the first step (2026-11-29)."""
    batch = collate(heldout, rows + [rows[0]] * (batch_size - len(rows)), pad_id)
    if real < batch_size:
        labels = batch.labels.clone()                                  # [batch_size, S]
        labels[real:] = IGNORE_INDEX
        batch = dataclasses.replace(batch, labels=labels)
    return batch


def evaluate(engine, heldout, batch_size: int, pad_id: int, max_batches: int,
             ranks: Ranks | None = None) -> tuple[float, float]:
    """Held-out (loss, perplexity) over every row once (the first `max_batches` batches if set).

    With several ranks the batches are global (batch_size rows per rank, as in training): each
    rank evaluates its rows of each and the sums are added over the ranks, so N ranks at batch b
    evaluate the rows one rank at batch N b does (a collective: every rank calls it)."""
    ranks = ranks or Ranks.single()
    total, count = 0.0, 0
    global_batch = batch_size * ranks.world_size
    for i, start in enumerate(range(0, len(heldout), global_batch)):
        if max_batches and i >= max_batches:
            break
        mine = ranks.rows(range(start, min(start + global_batch, len(heldout))), batch_size)
        s, n = engine.eval_loss(_full_batch(heldout, mine or [start], len(mine), batch_size, pad_id))
        total += s
        count += n
    total, count = ranks.sum([total, float(count)])
    if count == 0:
        return float("nan"), float("nan")
    loss = total / count
    return loss, math.exp(min(loss, 50.0))


def train(cfg: TrainConfig, callbacks: list[Callback] | None = None, *, verbose: bool = False,
          train_dataset=None, eval_dataset=None) -> TrainSummary:
    """Run (or continue) the training job `cfg`; see the module docstring. `callbacks` (callbacks.py)
    hear of each step, evaluation and save; one that raises stops the run with a TrainingError naming it.
    `train_dataset` / `eval_dataset`: the data as a `datasets.Dataset` (or a list of record dicts)
    instead of `cfg.data.path` / `cfg.data.eval_path`, each row read like a JSONL line (a resumed
    run is given the same one again: summary.json names it by its fingerprint).

    Everything that can be refused is checked before the output directory is touched (but for
    what killed saves left there) or anything large is allocated: the model, the sequence
    length against its context, the memory estimate, the data, the checkpoint to resume from.
    First of all the output directory and the checkpoint directory are locked for this run: a
    second run on either, or inside either, is refused at once (checkpoint/lock.py).
    """
    t_start = time.perf_counter()
    out = Path(cfg.output_dir)
    callbacks = check_callbacks(callbacks)
    try:
        trackers = resolve_report_to(cfg.report_to)      # a tracker asked for but not installed: refused first
    except TrackerUnavailable as e:
        raise TrainingError(str(e)) from None
    seed_everything(cfg.seed)
    ranks, device = Ranks.start(cfg.runtime.device, waits=cfg.runtime.host.cuda_waits)
    held: list[RunLock] = []
    try:
        # One run per directory (checkpoint/lock.py), held until the run ends. Taken first: a second run is
        # refused before it loads anything, and the lock costs an open and a flock. Rank 0 writes
        # the run's files, so rank 0 alone holds it; the other ranks learn of a refusal (on_main).
        ranks.on_main(lambda: held.extend(lock_run_directories(out, checkpoint_root(cfg, out))))
        cfg, dtype_why = resolve_config_dtype(cfg, device)
        print_config(cfg, device, dtype_why, verbose, given=train_dataset is not None)
        return _train(cfg, ranks, device, out, t_start, verbose, Reporting(trackers, callbacks),
                      (train_dataset, eval_dataset))
    finally:
        for lock in reversed(held):      # the checkpoint directory first: it may lie inside the output directory
            lock.release()
        ranks.close()


def _train(cfg: TrainConfig, ranks: Ranks, device: Device, out: Path, t_start: float,
           verbose: bool = False, reporting: Reporting | None = None, given: tuple = (None, None)) -> TrainSummary:
    """The run set up (train_setup.py), then the loop until it ends or stops; the engine closed after."""
    prepared, run = prepare_training(cfg, ranks, device, out, verbose, given)
    engine = prepared.engine
    try:
        with _StopFlag() as stop:       # from here on a signal means: finish the step, checkpoint, exit
            return Trainer(cfg, engine, prepared.loaded, run, device, out, t_start, stop, ranks=ranks,
                           reporting=reporting or Reporting(["csv"], [])).run()
    finally:
        engine.close()


@dataclass
class _IssuedStep:
    """One optimizer step handed to the engine; its loss and gradient norm may still be in flight."""
    step: int                            # 0-based
    res: StepResult
    lr: float
    tokens: int
    dt: float                            # seconds since the previous step was issued


class Trainer:
    """One invocation of a training run, in named steps (after torchtitan's `Trainer`).

    Holds the run's state (engine, data, metrics: telemetry/run_metrics.py) and its checkpoints' manager
    (checkpoint/manager.py); `run()` is the driver: resume, evaluate, step, stop or export, summarize.
    `run`: what train_setup.prepare_training read and decided (the data, the steps, the checkpoints' plan).
    """

    def __init__(self, cfg: TrainConfig, engine: Engine, loaded: LoadedModel, run: RunInputs, device: Device,
                 out: Path, t_start: float, stop: _StopFlag | None = None, ranks: Ranks | None = None,
                 reporting: Reporting | None = None):
        self.cfg, self.engine, self.loaded, self.device = cfg, engine, loaded, device
        # data parallel: every rank runs this loop in step; rank 0 alone writes files
        self.ranks = ranks or Ranks.single()
        self.sampler, self.heldout, self.pad_id = run.sampler, run.heldout, run.pad_id
        # a preference objective's pairs, reference pass and evaluation (objectives/pair_run.py)
        self.pairs = PairRun(run.pairs, cfg.batch_size, cfg.eval_batches, self.ranks) if run.pairs else None
        self.eval_prompts = list(run.eval_prompts)   # sampled greedily at each evaluation (evaluation/samples.py)
        self.total_steps, self.out, self.t_start = run.total_steps, out, t_start
        self.stop_flag = stop or _StopFlag()
        self.start_step = 0
        reporting = reporting or Reporting(["csv"], [])
        self.callbacks = reporting.callbacks
        # the metrics rows, the trackers (opened once the step to start from is known), the bar, loss.png
        self.metrics = RunMetrics(out, reporting.trackers, self.ranks, metric_columns(cfg.objective))
        self.flops_tok = train_flops_per_token(loaded.split, cfg.data.seq_len)
        self.host_rss = host_rss_meter(self.ranks, engine)
        self.before: dict[str, float] | None = None      # the held-out metrics before step 1 (eval_loss, ...)
        self.after: dict[str, float] | None = None
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self.tok_rates: list[float] = []
        self.interrupted = False         # stopped by SIGINT/SIGTERM
        self.stopped_early = False       # stopped by --stop-after
        self.stop_message: str | None = None
        self.stop_signal: int | None = None   # the signal that stopped the run (any rank's, agreed)
        self.last_t = 0.0
        # A step's checks and metrics wait for its gradient norm, i.e. for all of its host updates.
        # They run once the next step is issued (its forward needs those updates anyway), so the
        # updates overlap the next forward instead of stalling the loop; a step that must be
        # complete at once (eval, save, stop, the last one) is checked right away.
        self.pending: _IssuedStep | None = None
        self.compile = run.compile       # compiled layers: where their cache is, the counters before
        self.where = "start-up"          # the phase running now: what a GPU out-of-memory names
        # where checkpoints go, when and how they are written (checkpoint/manager.py)
        self.checkpoints = CheckpointManager(
            engine, SavePolicy(run.total_steps, save_every=cfg.save_every, keep_last=cfg.keep_last,
                               async_save=cfg.async_save, save_dtype=run.save_dtype),
            RunHooks(error=TrainingError, log_rows=self.metrics.log_rows, flush_files=self.metrics.flush_files,
                     notify=self.notify, metrics_path=self.metrics.path),
            directory=run.ckpt_dir, output_dir=out, ranks=self.ranks,
            run_record=run_record(cfg, self.ranks.world_size), tokenizer=loaded.tokenizer,
            resume_from=run.resume_from, stale=run.stale if self.ranks.is_main else [], space=run.saves,
            on_gpu=device.is_cuda)

    # ------------------------------------------------------------------ the driver
    def run(self) -> TrainSummary:
        """Resume (if asked), evaluate, train to the end or a stop, export, write the summary."""
        if self.pairs is not None:        # with the initial weights: before a resume loads its own
            self.where = "the reference pass before step 1"
            self.pairs.prepare_reference(self.engine, cache_root(self.cfg.data.cache_dir),
                                         self.loaded.source.fingerprint(), self.cfg.runtime.dtype)
        self.start_step = self.checkpoints.resume()
        self.metrics.open_trackers(self.start_step, run_record(self.cfg, self.ranks.world_size))
        try:
            return self._run()
        except KeyboardInterrupt:
            self.checkpoints.abandon()    # interrupted twice: a save in flight is given up
            raise
        finally:
            self.checkpoints.close()      # the engine closes after this: no save may still read it
            self.metrics.close_trackers()

    def _run(self) -> TrainSummary:
        """run's part between opening the trackers and closing them."""
        try:
            self.where = "the held-out evaluation before step 1"
            self.evaluate_before()
            self.device.reset_peak()
            self.checkpoints.announce()
            self.metrics.open_progress(self.cfg.progress, self.start_step, self.total_steps)
            self.last_t = time.perf_counter()        # the step clock
            try:
                for step in range(self.start_step, self.total_steps):
                    if not self.advance(step):
                        break
                self.checkpoints.poll(wait=True)
            except KeyboardInterrupt:
                self.abort()
                raise
            finally:
                self.metrics.close_progress()
            if self.stop_message and self.ranks.is_main:
                print(self.stop_message, file=sys.stderr if self.interrupted else sys.stdout)
            if not (self.interrupted or self.stopped_early):
                self.where = "the held-out evaluation after the last step"
                self.evaluate_after()
                self.metrics.write()
                # final/, then the end-of-run checkpoint: with several ranks rank 0 writes both
                cfg = self.cfg
                self.checkpoints.export(self.out / "final", run_export(
                    cfg.model, self.loaded.source_dir, load_chat_template(cfg.data.chat_template),
                    [self.data_line()], run_record(cfg, self.ranks.world_size), self.total_steps,
                    _loss_ppl(self.before), _loss_ppl(self.after)))
        except Exception as e:
            oom = _out_of_memory(e)
            if oom is None:
                raise
            self.fail_out_of_memory(oom, e)
        self.metrics.flush()
        return self.write_summary()

    def advance(self, step: int) -> bool:
        """Issue `step`, finish the pending one, then evaluate / log / stop / save as due; False: stop."""
        self.checkpoints.poll()              # a background save that ended: its on_save, or its error
        issued = self.train_step(step)
        if self.pending is not None:
            self.finish_step(self.pending)
            self.pending = None
        done = step + 1
        stopping = self.stop_due(done)
        evaluating = self.eval_due(done)
        saving = self.checkpoints.due(done)
        if stopping or evaluating or saving or done == self.total_steps:
            row = self.finish_step(issued)
            if evaluating:
                self.where = f"the held-out evaluation after step {done}"
                held = self.evaluate()
                row.update(held)
                self.notify("on_eval", done, held)
                self.sample_prompts(done)
        else:
            self.pending = issued
        if done % self.cfg.log_every == 0:
            self.metrics.write()
        if stopping:
            self.stop(done)
            return False
        if saving:
            self.checkpoints.maybe_save(done)
        return True

    # ------------------------------------------------------------------ steps
    def train_step(self, step: int) -> _IssuedStep:
        """One optimizer step: its micro-batches and learning rate to the engine (the norm may still run)."""
        self.where = f"step {step + 1}"               # what a GPU out-of-memory interrupted
        maybe_fail("data", step + 1)                 # tests only (faults.py)
        if self.pairs is not None:           # whole pairs, the step's normalization in each micro-batch
            mbs = self.pairs.step_batches(step)
        else:
            mbs = [self.micro_batch(step * self.cfg.grad_accum + j) for j in range(self.cfg.grad_accum)]
        lr = lr_at(self.cfg, step, self.total_steps)
        res = self.engine.train_step(mbs, lr)
        now = time.perf_counter()
        dt, self.last_t = now - self.last_t, now
        # the whole run's tokens (every rank's rows have the same [B, S] shape): tokens_per_s and
        # tflops in metrics.csv are the run's, over all ranks
        tokens = sum(int(mb.input_ids.numel()) for mb in mbs) * self.ranks.world_size
        return _IssuedStep(step=step, res=res, lr=lr, tokens=tokens, dt=dt)

    def micro_batch(self, index: int):
        """This rank's rows of the sampler's global batch `index` (all of it on one rank)."""
        if self.ranks.world_size == 1:
            return self.sampler.batch(index)
        rows = self.ranks.rows(self.sampler.rows(index), self.cfg.batch_size)
        return collate(self.sampler.dataset, rows, self.pad_id)

    def finish_step(self, s: _IssuedStep) -> dict:
        """A step's deferred part: refuse a non-finite loss or norm, append its metrics row, tick the bar."""
        res = s.res
        grad_norm = res.grad_norm()
        if not math.isfinite(res.loss):
            self.fail_non_finite(s.step, f"non-finite loss ({res.loss})")
        elif grad_norm is not None and not math.isfinite(grad_norm):
            self.fail_non_finite(s.step, f"non-finite gradient norm ({grad_norm}, loss {res.loss:.4f})")
        tps = s.tokens / s.dt if s.dt > 0 else float("nan")
        if s.step > self.start_step:            # the first step includes warm-up
            self.tok_rates.append(tps)
        if s.step == self.start_step and self.compile is not None:
            self.report_compile()
        self.first_loss = res.loss if self.first_loss is None else self.first_loss
        self.last_loss = res.loss
        row = self.metrics.row(dict(step=s.step + 1, loss=res.loss, lr=s.lr, grad_norm=grad_norm, tokens_per_s=tps,
                                    tflops=tps * self.flops_tok / 1e12, step_s=s.dt,
                                    gpu_peak_alloc_gib=self.device.max_memory_allocated() / 2**30,
                                    gpu_peak_reserved_gib=self.device.max_memory_reserved() / 2**30,
                                    cpu_rss_gib=self.host_rss.bytes() / 2**30, **res.metrics))
        self.metrics.add_step(row, self.total_steps, self.device.is_cuda, self.cfg.log_every)
        self.notify("on_step", s.step + 1, _scalars(row))
        return row

    def report_compile(self) -> None:
        """After the first step: whether the layers came from the compile cache, and the cache's marker
        for the next run's compile_layers auto (engine/compile_cache.py)."""
        done = CompileCounters.now().since(self.compile.before)
        if self.ranks.is_main:
            print(describe_compile(done, self.compile.cache))
            remember_compile(self.compile.cache, self.compile.key, done)

    def fail_non_finite(self, step: int, bad: str) -> NoReturn:
        """Stop the run at a non-finite step: metrics so far to disk, then a TrainingError with hints."""
        cfg = self.cfg
        self.metrics.flush()
        self.checkpoints.close()          # a checkpoint being written in the background is the newest once whole
        newest = self.checkpoints.newest()
        resumed_from = self.checkpoints.resume_from
        if resumed_from is not None and self.checkpoints.written_step is None:
            # no save since the resume: the state it loaded may itself be what diverges
            last = (f"this run resumed from {resumed_from} (at step {self.start_step}) and failed "
                    f"{step + 1 - self.start_step} step(s) after it, so that checkpoint's weights or optimizer "
                    f"state may be the cause (its files matched the digests written with them: what was saved "
                    f"may already have been diverging); resuming from it again will likely fail the same way: "
                    f"resume from an older checkpoint with --resume PATH, or change the settings")
        elif newest:
            last = (f"the newest checkpoint, {newest}, is intact (read back against its digests after writing; "
                    f"resume from it with --resume auto after changing the settings)")
        else:
            last = "no checkpoint had been written yet"
        hints = [f"lower the learning rate (--lr, now {cfg.optim.lr:g})"]
        if cfg.max_grad_norm is None:
            hints.append("clip gradients (--max-grad-norm 1.0)")
        hints.append(f"use more --warmup-steps (now {cfg.warmup_steps})")
        hints.append(f"check the data of step {step + 1}")
        raise TrainingError(
            f"{bad} at step {step + 1}: training stopped; the weights of that step were not saved "
            f"and {last}; metrics up to step {step} are in {self.metrics.path}. "
            f"Hint: {'; '.join(hints)}")

    def fail_out_of_memory(self, oom: BaseException, error: BaseException) -> NoReturn:
        """Stop the run at a GPU out-of-memory (in `self.where`: a step or an evaluation): metrics so far
        to disk, then a TrainingError naming the OOM, the step, the memory budget and what makes it fit."""
        cfg = self.cfg
        self.metrics.flush()
        self.checkpoints.close()
        newest = self.checkpoints.newest()
        last = (f"the newest checkpoint, {newest}, is intact: continue from it with --output-dir {self.out} "
                f"--resume auto and the changed settings" if newest else "no checkpoint had been written yet")
        if cfg.gpu_memory_limit is not None:
            budget = f"the GPU memory limit is {cfg.gpu_memory_limit:g} GiB (--gpu-memory-limit)"
        elif self.device.is_cuda:
            budget = f"the whole GPU, {self.device.free_and_total()[1] / 2**30:.1f} GiB, was available"
        else:
            budget = "no GPU memory limit was set"
        fixes = [f"a smaller --batch-size (now {cfg.batch_size}; --grad-accum keeps the tokens per step)",
                 f"a shorter --seq-len (now {cfg.data.seq_len})"]
        if cfg.runtime.mode == "slide" and not cfg.runtime.offloads_activations:
            fixes.append("--offload-activations (layer inputs kept in host RAM)")
        if cfg.runtime.mode == "slide":
            fixes.append("--tuning.cache_units 3 --tuning.device_layers 0 (a window of layers, none kept on the GPU)")
        fixes.append("a larger --gpu-memory-limit, or a GPU with more free memory (other processes on it?)")
        where = "" if isinstance(error, torch.OutOfMemoryError) else f" ({str(error).split(':')[0]})"
        first_line = str(oom).strip().splitlines()[0] if str(oom).strip() else type(oom).__name__
        metrics = (f"the finished steps' metrics are in {self.metrics.path}" if self.first_loss is not None
                   else "no step of this run had finished")
        raise TrainingError(
            f"GPU out of memory during {self.where}{where}: training stopped; {budget}; {last}; {metrics}. "
            f"Fix: {'; '.join(fixes)}. (torch: {first_line[:300]})"
        ) from error

    def stop_due(self, done: int) -> bool:
        """A signal arrived, or --stop-after steps of this invocation are done (and the run is not)."""
        cfg = self.cfg
        # every rank must stop after the same step: a signal that reached any rank stops them all
        # (one small all-reduce a step with several ranks)
        if self.ranks.any(self.stop_flag.signal is not None):
            self.stop_signal = self.stop_flag.signal or signal.SIGTERM
            return True
        return bool(cfg.stop_after and done - self.start_step >= cfg.stop_after and done < self.total_steps)

    def eval_due(self, done: int) -> bool:
        """A periodic held-out evaluation after step `done` (the last one has its own)."""
        return bool(self.cfg.eval_every and done % self.cfg.eval_every == 0 and done < self.total_steps
                    and self.has_heldout())

    # ------------------------------------------------------------------ evaluation
    def has_heldout(self) -> bool:
        if self.pairs is not None:
            return self.pairs.has_heldout()
        return self.heldout is not None and len(self.heldout) > 0

    def evaluate(self) -> dict[str, float]:
        """The held-out metrics of the current weights: eval_loss and eval_ppl, or a preference
        objective's loss and TRL's eval_rewards/... (objectives/evaluation.py)."""
        cfg = self.cfg
        if self.pairs is not None:      # a collective under data parallel: the ranks share the forwards
            return self.pairs.evaluate(self.engine)
        loss, ppl = evaluate(self.engine, self.heldout, cfg.batch_size, self.pad_id, cfg.eval_batches, self.ranks)
        return {"eval_loss": loss, "eval_ppl": ppl}

    def describe_eval(self, held: dict[str, float]) -> str:
        if self.pairs is not None:
            return self.pairs.describe(held)
        return f"loss {held['eval_loss']:.4f}  perplexity {held['eval_ppl']:.2f}"

    def evaluate_before(self) -> None:
        """The held-out evaluation before step 1 (a fresh start only), as metrics row 0."""
        if self.start_step == 0 and self.has_heldout():
            self.before = self.evaluate()
            print(f"held-out before training: {self.describe_eval(self.before)}")
            self.metrics.rows.append(self.metrics.row({"step": 0, **self.before}))
            self.notify("on_eval", 0, self.before)
        if self.start_step == 0:
            self.sample_prompts(0)

    def evaluate_after(self) -> None:
        """The held-out evaluation of the finished run, once the last updates have landed."""
        self.engine.synchronize()
        if self.has_heldout():
            self.after = self.evaluate()
            print(f"held-out after training: {self.describe_eval(self.after)}")
            self.metrics.rows.append(self.metrics.row({"step": self.total_steps, **self.after}))
            self.notify("on_eval", self.total_steps, self.after)
        self.sample_prompts(self.total_steps)

    def data_line(self) -> str:
        """The run's data in one line (the model card's)."""
        cfg = self.cfg
        if self.pairs is not None:
            return self.pairs.data_line()
        return (f"{self.sampler.dataset.source}: {len(self.sampler.dataset)} training sequences of {cfg.data.seq_len} "
                f"tokens, {len(self.heldout) if self.heldout is not None else 0} held out")

    def sample_prompts(self, step: int) -> None:
        """The eval prompts' greedy samples with the current weights, after step `step` (evaluation/samples.py):
        appended to eval_samples.jsonl and logged to the trackers by rank 0. Every rank runs the same
        forwards (a forward may issue collectives), taking rank 0's tokens."""
        if not self.eval_prompts:
            return
        tok = self.loaded.tokenizer
        completions = greedy_completions(
            self.engine.next_token_logits, [encode_prompt(tok, p.text) for p in self.eval_prompts],
            self.cfg.data.seq_len, self.cfg.batch_size, self.cfg.eval_max_new_tokens, tok.eos_token_id,
            self.pad_id, agree=lambda picks: self.ranks.on_main(lambda: picks))
        samples = [(p.text, decode_completion(tok, c)) for p, c in zip(self.eval_prompts, completions)]
        if self.ranks.is_main:
            write_samples(self.out / "eval_samples.jsonl", step, samples)
            for i, (prompt, completion) in enumerate(samples):
                self.metrics.trackers.log_text(step, f"eval_samples/{i}", prompt + completion)

    # ------------------------------------------------------------------ stopping
    def stop(self, done: int) -> None:
        """Stop after step `done` (signal or --stop-after): metrics, a resumable checkpoint if it fits,
        and the message saying how to continue (printed once the progress bar is closed)."""
        self.metrics.write()
        path = self.checkpoints.maybe_save(done, final=True)
        if self.stop_signal is not None:
            self.interrupted = True
            why = f"stopped by {signal.Signals(self.stop_signal).name}"
        else:
            self.stopped_early = True
            why = f"stopped as asked (--stop-after {self.cfg.stop_after})"
        self.stop_message = (f"{why} after step {done} of {self.total_steps}; resumable checkpoint: {path}\n"
                             f"continue with: slidetune train <same options> --output-dir {self.out} "
                             f"--resume auto") if path else (
            f"{why} after step {done} of {self.total_steps}; no resumable checkpoint was written: it does not "
            f"fit the disk of {self.checkpoints.directory} (the note at the start); metrics are in {self.metrics.path}")

    def abort(self) -> None:
        """A second Ctrl-C / SIGTERM while the first one was being handled: keep the metrics, say what is left."""
        self.metrics.flush()
        newest = self.checkpoints.newest()
        print("\ninterrupted twice: stopped without saving the current step; "
              + (f"the newest checkpoint, {newest}, is intact" if newest else "no checkpoint was written"),
              file=sys.stderr)

    def write_summary(self) -> TrainSummary:
        """summary.json of this invocation; also returned."""
        cfg, before, after, heldout = self.cfg, self.before, self.after, self.heldout
        if self.pairs is not None:        # the pairs, the reference pass, TRL's held-out metrics
            data = {**self.pairs.summary(), "eval_before": before, "eval_after": after}
        else:
            ds = self.sampler.dataset
            data = dict(data_source=cfg.data.path or (ds.source if ds.source != BUILTIN_NAME else
                                                      f"built-in corpus (Python {platform.python_version()} docs)"),
                        train_sequences=len(ds), heldout_sequences=len(heldout) if heldout is not None else 0)
        summary = TrainSummary(
            output_dir=str(self.out), steps=self.engine.step_index,
            eval_loss_before=before["eval_loss"] if before else None,
            eval_loss_after=after["eval_loss"] if after else None,
            ppl_before=before.get("eval_ppl") if before else None, ppl_after=after.get("eval_ppl") if after else None,
            first_loss=self.first_loss, last_loss=self.last_loss,
            tokens_per_s=float(np.median(self.tok_rates)) if self.tok_rates else None,
            wall_s=time.perf_counter() - self.t_start, interrupted=self.interrupted,
            stopped_early=self.stopped_early,
            device=torch.cuda.get_device_name() if self.device.is_cuda else "cpu", dtype=cfg.runtime.dtype,
            objective=cfg.objective, **data, **self.checkpoints.totals(),
            **(CompileCounters.now().since(self.compile.before).summary() if self.compile is not None else {}))
        # rank 0 writes it and the other ranks wait for it (on_main): a rank that ended first would
        # make torchrun stop the others (SIGTERM), rank 0 perhaps before this file is written
        self.ranks.on_main(lambda: write_text(self.out / "summary.json", json.dumps(summary.__dict__, indent=2) + "\n"))
        return summary

    # ------------------------------------------------------------------ callbacks
    def notify(self, hook: str, step: int, arg) -> None:
        """The callbacks' `hook(step, arg)` (rank 0 calls them; every rank learns of a failure). One that
        raises stops the run: the metrics so far are written, then a TrainingError names it."""
        if not self.callbacks:
            return
        try:
            self.ranks.on_main(lambda: call_hook(self.callbacks, hook, step, arg))
        except CallbackFailed as e:
            self.metrics.flush()
            newest = self.checkpoints.newest()
            raise TrainingError(
                f"{e}: training stopped; metrics so far are in {self.metrics.path}; "
                + (f"the newest checkpoint, {newest}, is intact (--resume auto continues from it)" if newest
                   else "no checkpoint had been written yet")) from e.error


def _loss_ppl(held: dict[str, float] | None) -> tuple[float, float] | None:
    """(held-out loss, perplexity) of an evaluation's metrics (the model card's); NaN where none."""
    return (held["eval_loss"], held.get("eval_ppl", math.nan)) if held else None


def _out_of_memory(error: BaseException) -> BaseException | None:
    """The torch.OutOfMemoryError behind `error` (itself, or the cause a pipeline thread's failure
    carries), else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, torch.OutOfMemoryError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None
