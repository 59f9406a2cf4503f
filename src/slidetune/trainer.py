"""The training loop: data -> engine steps -> metrics, evaluation, checkpoints.

Interruptions are safe: SIGINT/SIGTERM set a flag that the loop checks between steps;
it then writes a resumable checkpoint and exits (`--stop-after N` does the same after N
steps of one invocation, for time-limited jobs). A non-finite loss or gradient norm stops
the run naming the step, keeping the metrics so far and the previous checkpoint. A failed
save (disk full) leaves the previous checkpoint intact and says so. Everything is
deterministic in (config, seed): the batch of step k is a pure function of k, and the
checkpoint holds the optimizer and RNG states, so `--resume auto` continues the same
trajectory (metrics.csv keeps the rows up to the checkpoint, then continues).

The metrics go to the trackers --report-to names (telemetry/trackers.py: metrics.csv, appended, and
TensorBoard, W&B, MLflow), on rank 0; Python callers get each step, evaluation and save through
callbacks (callbacks.py, docs/library.md).
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
from .checkpoint import (CheckpointCorrupt, CheckpointError, CheckpointManager, DiskSpaceError, LegacyLayout, RunHooks,
                         RunLock, SavePlan, SavePolicy, check_checkpoint, complete_checkpoints, lock_run_directories,
                         plan_saves, recover_leftovers, resolve_save_dtype, run_export, set_aside, write_atomically)
from .config import TrainConfig, config_to_dict, group_tuning
from .data import IGNORE_INDEX, BatchSampler, TokenDataset, build_datasets, collate, default_pad_id
from .data.build import BUILTIN_NAME, load_source
from .data.chat_template import load_chat_template
from .data.errors import DataError
from .data.token_arrays import is_token_source
from .device import Device, resolve_dtype
from .engine import RuntimeConfig, StepResult
from .engine.autos import describe_autos
from .engine.compile_policy import choose_compile_layers, resolve_compile_layers
from .faults import maybe_fail
from .engine.placement import PlacementPlan
from .engine.slide.disk_tier import tier_bytes
from .eval_samples import (EvalPrompt, decode_completion, encode_prompt, greedy_completions,
                           resolve_eval_prompts, write_samples)
from .models.load import LoadedModel
from .models.reference_check import require_faithful
from .ops.packed_attention import use_packed_attention
from .ranks import Ranks
from .run_setup import PreparedRun, RunRequest, prepare_run
from .telemetry.flops import train_flops_per_token
from .telemetry.run_metrics import RunMetrics, _row, _scalars, host_rss_meter
from .telemetry.trackers import TrackerUnavailable, resolve_report_to

if TYPE_CHECKING:
    from .engine.interface import Engine

class TrainingError(RuntimeError):
    pass


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
        if mine:
            batch = collate(heldout, mine, pad_id)
        else:
            # The last, shorter batch may leave this rank none. It still runs a forward, of a row with
            # every label ignored (it adds nothing): every rank must run the same forwards, as the
            # collectives a forward may issue (dp_weights=gather's broadcasts) match across ranks.
            batch = collate(heldout, [start], pad_id)
            batch = dataclasses.replace(batch, labels=torch.full_like(batch.labels, IGNORE_INDEX))
        s, n = engine.eval_loss(batch)
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
    callbacks = _check_callbacks(callbacks)
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
        ranks.on_main(lambda: held.extend(lock_run_directories(out, _checkpoint_root(cfg, out))))
        cfg, dtype_why = _resolve_dtype(cfg, device)
        _print_config(cfg, device, dtype_why, verbose, given=train_dataset is not None)
        return _train(cfg, ranks, device, out, t_start, verbose, _Reporting(trackers, callbacks),
                      (train_dataset, eval_dataset))
    finally:
        for lock in reversed(held):      # the checkpoint directory first: it may lie inside the output directory
            lock.release()
        ranks.close()


def _checkpoint_root(cfg: TrainConfig, out: Path) -> Path:
    """Where the run's checkpoints go: --checkpoint-dir, or `<output_dir>/checkpoints`. The lock is
    taken on it whichever names it (checkpoint/lock.py): another run given it by --checkpoint-dir is refused."""
    return Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else out / "checkpoints"


@dataclass
class _Reporting:
    """Where a run reports: the trackers --report-to resolved to (telemetry/trackers.py) and the callbacks."""
    trackers: list[str]
    callbacks: list[Callback]


def _check_callbacks(callbacks) -> list[Callback]:
    """`callbacks` as a list, each with the three hooks (a Callback, or an object with on_step, on_eval
    and on_save); TypeError names one that is not."""
    callbacks = list(callbacks or [])
    for cb in callbacks:
        missing = [h for h in ("on_step", "on_eval", "on_save") if not callable(getattr(cb, h, None))]
        if missing:
            raise TypeError(f"train(callbacks=...): {cb!r} is not a slidetune.Callback (it lacks "
                            f"{', '.join(missing)}); subclass slidetune.Callback and override the hooks you need")
    return callbacks


def _resolve_dtype(cfg: TrainConfig, device: Device) -> tuple[TrainConfig, str]:
    """The config with --dtype auto resolved for `device` (device.resolve_dtype), and why: everything
    after this (the fit, the engine, the save dtype, config.json) sees the dtype that runs."""
    dtype, why = resolve_dtype(cfg.runtime.dtype, device.device.type)
    if cfg.runtime.dtype == "auto":
        why = f"--dtype auto: {why}"
    elif dtype == "bf16" and not device.is_cuda and resolve_dtype("auto", "cpu")[0] == "fp32":
        print(f"note: --dtype bf16 on a CPU without bf16 instructions is emulated and many times slower than "
              f"fp32 ({resolve_dtype('auto', 'cpu')[1]}); --dtype auto picks fp32 here", file=sys.stderr)
    return dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, dtype=dtype)), why


def _refuse_under_data_parallel(cfg: TrainConfig, ranks: Ranks) -> None:
    """Settings the data-parallel engine does not run (docs/data_parallel.md), refused by name."""
    rt = cfg.runtime
    bad = []
    if rt.mode != "slide":
        bad.append(f"--mode {rt.mode} (data parallel runs in slide mode only)")
    if rt.disk.disk_master not in ("off", "auto"):
        bad.append("--tuning.disk_master (the masters of disk units on disk; use off or auto)")
    if bad:
        raise TrainingError(f"{ranks.world_size} ranks (data parallel) do not support yet: " + "; ".join(bad)
                            + ". Drop these settings, or run on one rank")


def _silent(*args, **kwargs) -> None:
    pass


def _print_config(cfg: TrainConfig, device: Device, dtype_why: str, verbose: bool, given: bool = False) -> None:
    """The run in a few lines (every setting: config.json, or the whole of it here with --verbose)."""
    if verbose:
        print("resolved config:\n" + json.dumps(config_to_dict(cfg), indent=2), flush=True)
    steps = (f"{cfg.epochs:g} epochs" if cfg.epochs is not None
             else f"{cfg.resolved_max_steps(device.is_cuda)} steps")
    data = cfg.data.path or ("the dataset given in Python" if given else "the built-in corpus")
    clip = f"gradient clipping at {cfg.max_grad_norm:g}" if cfg.max_grad_norm else "no gradient clipping"
    evals = "held-out loss before and after" + (f", every {cfg.eval_every} steps" if cfg.eval_every else "")
    print(f"slidetune train: {cfg.model} on {data}, {cfg.runtime.mode} mode on {device.device}, {cfg.runtime.dtype} "
          f"({dtype_why})\n"
          f"  {steps} of {cfg.batch_size} x {cfg.data.seq_len} tokens"
          + (f" x {cfg.grad_accum} micro-batches" if cfg.grad_accum > 1 else "")
          + f", AdamW lr {cfg.optim.lr:g} ({cfg.lr_schedule}, "
          + (f"{cfg.warmup_steps} warmup steps" if cfg.warmup_ratio is None else
             f"warmup over {cfg.warmup_ratio:g} of the steps")
          + f"), {clip}; {evals}\n"
          f"  output: {cfg.output_dir}/ (every setting in config.json" + ("" if verbose else ", --verbose prints them")
          + ")", flush=True)


@dataclass
class _RunInputs:
    """What train reads and decides between the fit check and the engine: the data, the steps, the
    output directory's state (prepare_run's before_build)."""
    sampler: BatchSampler
    heldout: TokenDataset | None
    pad_id: int
    total_steps: int
    ckpt_dir: Path
    save_dtype: str
    saves: SavePlan
    resume_from: Path | None
    stale: list[Path]


def _train(cfg: TrainConfig, ranks: Ranks, device: Device, out: Path, t_start: float,
           verbose: bool = False, reporting: _Reporting | None = None, given: tuple = (None, None)) -> TrainSummary:
    if ranks.world_size > 1:
        _refuse_under_data_parallel(cfg, ranks)
        print(f"data parallel: rank {ranks.rank} of {ranks.world_size} on {device.device}; global batch "
              f"{cfg.batch_size * ranks.world_size} ({cfg.batch_size} rows per rank)")
    # the data first, read and parsed (a missing file, a malformed line: refused in seconds), then
    # the model, then the reference check on it; a pre-tokenized corpus is opened once the
    # tokenizer's EOS is known (build_datasets below)
    source = None if is_token_source(cfg.data.path) else ranks.on_each(lambda: load_source(cfg.data, *given))
    # what the auto settings chose: the GPU's placement (on the CPU only with --verbose: no GPU there)
    say = print if device.is_cuda or verbose else _silent
    inputs: list[_RunInputs] = []
    prompts: list[list[EvalPrompt]] = []

    def before_build(prepared: PreparedRun) -> RuntimeConfig:
        # the eval prompts read (a bad file refused) before the engine allocates anything
        prompts.append(ranks.on_each(lambda: _eval_prompts(cfg, source, prepared.loaded)))
        run_inputs, runtime = _prepare_inputs(cfg, prepared, source, ranks, device, out, say)
        inputs.append(run_inputs)
        return runtime

    prepared = prepare_run(
        _run_request(cfg), device, ranks, after_load=lambda loaded: _check_model(cfg, loaded),
        on_placed=lambda p: _say_autos(cfg, p, device.is_cuda or verbose, say), before_build=before_build)
    engine, loaded, (run,) = prepared.engine, prepared.loaded, inputs
    try:
        with _StopFlag() as stop:       # from here on a signal means: finish the step, checkpoint, exit
            return Trainer(cfg, engine, loaded, run.sampler, run.heldout, run.pad_id, run.total_steps, device, out,
                           t_start, run.resume_from, run.stale if ranks.is_main else [], stop, ckpt_dir=run.ckpt_dir,
                           saves=run.saves, save_dtype=run.save_dtype, ranks=ranks,
                           reporting=reporting or _Reporting(["csv"], []), eval_prompts=prompts[0]).run()
    finally:
        engine.close()


def _eval_prompts(cfg: TrainConfig, source, loaded: LoadedModel) -> list[EvalPrompt]:
    """The prompts sampled at each evaluation (eval_samples.py), a bad --eval-prompts file as a TrainingError."""
    try:
        return resolve_eval_prompts(cfg.eval_prompts, source, cfg.data, loaded.tokenizer)
    except DataError as e:
        raise TrainingError(str(e)) from e


def _run_request(cfg: TrainConfig) -> RunRequest:
    """The run prepare_run sets up for `cfg`: packed rows are full windows, so no batch carries
    padding (no [B,1,S,S] padding masks; masked packing builds its document mask as a
    FlexAttention BlockMask on CUDA)."""
    return RunRequest(model=cfg.model, runtime=cfg.runtime, optim=cfg.optim, batch_size=cfg.batch_size,
                      seq_len=cfg.data.seq_len, grad_accum=cfg.grad_accum, max_grad_norm=cfg.max_grad_norm,
                      padded=not cfg.data.packed, num_layers=cfg.num_layers, seed=cfg.seed,
                      gpu_memory_limit_gib=cfg.gpu_memory_limit, check_memory=cfg.check_memory, announce=True)


def _check_model(cfg: TrainConfig, loaded: LoadedModel) -> None:
    """The model against the run, before it is placed: the reference check, a tokenizer where the
    data is text, the sequence length against the model's context."""
    _reference_check(cfg, loaded)
    # a pre-tokenized corpus needs no tokenizer (with no EOS known, each row is one document:
    # token_arrays.py); text data does
    if loaded.tokenizer is None and not is_token_source(cfg.data.path):
        raise TrainingError(f"model {cfg.model!r} has no tokenizer, so text data cannot be tokenized; "
                            f"use a model directory with tokenizer files, a preset with a >= 49152 vocabulary, "
                            f"or a pre-tokenized corpus (--data tokens.npy / .bin)")
    max_pos = getattr(loaded.split.config, "max_position_embeddings", None)
    if max_pos is not None and cfg.data.seq_len > max_pos:
        raise TrainingError(f"--seq-len {cfg.data.seq_len} exceeds the context of model {cfg.model!r}: "
                            f"{max_pos} tokens (max_position_embeddings); use --seq-len {max_pos} or less")


def _say_autos(cfg: TrainConfig, prepared: PreparedRun, gpu_lines: bool, say) -> None:
    """What the auto settings chose (engine.autos), then the placement; the GPU's lines through
    `say`, the disk tier's always."""
    for line in describe_autos(cfg.runtime, prepared.runtime, prepared.plan, gpu_lines=gpu_lines):
        print(line)
    if prepared.plan is not None:
        say("placement:\n" + "\n".join(prepared.plan.summary_lines()))


def _prepare_inputs(cfg: TrainConfig, prepared: PreparedRun, source, ranks: Ranks, device: Device, out: Path,
                    say) -> tuple[_RunInputs, RuntimeConfig]:
    """After the fit check, before the engine allocates anything: the data tokenized, the steps
    counted, the layers to compile chosen, the output directory prepared. Returns those and the
    runtime with compile_layers resolved."""
    loaded, runtime = prepared.loaded, prepared.runtime
    # the sampler draws global batches (--batch-size rows per rank) from (seed, step); each rank
    # takes its rows of each (Trainer.micro_batch): N ranks train on one rank's data at N x the batch
    global_batch = cfg.batch_size * ranks.world_size
    # a pre-tokenized corpus's ids are checked against the model's vocabulary here, before step 1
    train_ds, heldout = ranks.on_each(lambda: build_datasets(cfg.data, loaded.tokenizer, min_rows=global_batch,
                                                             vocab_size=loaded.split.config.vocab_size,
                                                             source=source))
    if train_ds.document_mask:
        use_packed_attention(loaded.split.model)   # packing "masked": attention per document
    # without a tokenizer (pre-tokenized rows, full windows) any id pads: padding is never
    # attended to nor trained on
    pad_id = default_pad_id(loaded.tokenizer) if loaded.tokenizer is not None else 0
    sampler = BatchSampler(train_ds, global_batch, cfg.seed, pad_id)
    total_steps = cfg.resolved_max_steps(device.is_cuda)
    if cfg.epochs is not None:
        total_steps = max(1, int(cfg.epochs * len(sampler) / cfg.grad_accum))
    compiled = choose_compile_layers(runtime, loaded.split, is_cuda=device.is_cuda, steps=total_steps,
                                     tokens_per_step=cfg.batch_size * cfg.grad_accum * cfg.data.seq_len,
                                     seq_len=cfg.data.seq_len)
    runtime = resolve_compile_layers(runtime, compiled)
    if cfg.runtime.mode == "slide":
        say(f"compile_layers {cfg.runtime.compile_layers} -> {compiled.compile_layers} ({compiled.reason})")
    ckpt_dir = _checkpoint_root(cfg, out)
    save_dtype = resolve_save_dtype(cfg.save_dtype, loaded.split.config, runtime.dtype)
    # Rank 0 alone reads and changes the output directory before the run (leftovers, free space,
    # the checkpoint to resume from, an earlier run's checkpoints) and every rank gets its answer.
    saves, resume_from, stale = ranks.on_main(lambda: _prepare_output(cfg, loaded, prepared.plan, runtime, out,
                                                                      ckpt_dir, save_dtype, total_steps,
                                                                      ranks.world_size))
    return _RunInputs(sampler, heldout, pad_id, total_steps, ckpt_dir, save_dtype, saves, resume_from,
                      stale), runtime


def _prepare_output(cfg: TrainConfig, loaded: LoadedModel, plan: PlacementPlan | None, runtime, out: Path,
                    ckpt_dir: Path, save_dtype: str, total_steps: int,
                    world_size: int) -> tuple[SavePlan, Path | None, list[Path]]:
    """Before step 1 (rank 0 only): restore what killed saves set aside, check that final/ and the
    checkpoints asked for fit the disk, find the checkpoint to resume from, write config.json.
    Returns (the save plan, the checkpoint to resume from or None, an earlier run's checkpoints)."""
    # Before the free space is measured and a checkpoint looked for: a killed save leaves a
    # directory as large as what it was writing (kill -9 or the OOM killer during an export).
    for src, dst in recover_leftovers(out, "final") + recover_leftovers(ckpt_dir):
        print(f"note: {dst} was missing: restored the complete copy that a killed save had set aside in "
              f"{src.name}", file=sys.stderr)
    try:
        # before step 1: final/ must fit, and periodic checkpoints asked for (checkpoint/space.py)
        tier = (Path(runtime.disk_dir), tier_bytes(plan, runtime.disk.disk_block_mb)) \
            if plan is not None and plan.indices("disk") else None
        saves = plan_saves(loaded.split.num_params(), save_dtype=save_dtype, output_dir=out, checkpoint_dir=ckpt_dir,
                           save_every=cfg.save_every, keep_last=cfg.keep_last, scratch=tier,
                           scratch_holds_weights=plan is not None and plan.master_params("disk") > 0,
                           existing_checkpoints=len(complete_checkpoints(ckpt_dir)),
                           checkpoint_bytes=plan.checkpoint_bytes() if plan is not None else None)
    except DiskSpaceError as e:
        raise TrainingError(str(e)) from e
    for note in saves.notes:
        print(note, file=sys.stderr)
    resume_from = _resolve_resume(cfg, ckpt_dir, total_steps, LegacyLayout.of_units(loaded.split.units))
    stale = []
    if resume_from is None:
        stale = complete_checkpoints(ckpt_dir)
        if stale:
            print(f"note: {ckpt_dir} holds checkpoints of an earlier run (newest: {stale[-1].name}); this new run "
                  f"replaces them once it saves its first checkpoint (use --resume auto to continue that run "
                  f"instead)", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    if resume_from is not None:
        _warn_changed_config(resume_from, out / "config.json", cfg, world_size)
    # config.json describes the newest invocation; what a resume is compared with is the config
    # saved inside each checkpoint (checkpoint/manager.py), as this file is rewritten before the first save.
    _write_text(out / "config.json", json.dumps(_run_record(cfg, world_size), indent=2) + "\n")
    return saves, resume_from, stale


def _run_record(cfg: TrainConfig, world_size: int) -> dict:
    """The run's settings as saved (config.json, each checkpoint): the config, plus the ranks it ran
    on where several (batch_size is per rank: the global batch is batch_size x world_size)."""
    record = config_to_dict(cfg)
    if world_size > 1:
        record["world_size"] = world_size
    return record


def _reference_check(cfg: TrainConfig, loaded: LoadedModel) -> None:
    """The split against transformers on a tiny copy of the model's config (about a second):
    a family whose forward does arithmetic the split misses refuses here, before anything."""
    if cfg.skip_reference_check:
        print(f"reference check skipped (--skip-reference-check): the split of "
              f"{loaded.split.config.model_type!r} is not verified against transformers")
        return
    result = require_faithful(loaded.split.config, seed=cfg.seed)
    print(f"reference check passed (the model's layers as slidetune runs them, against transformers on a tiny "
          f"random copy): {result.summary()}")


def _resolve_resume(cfg: TrainConfig, ckpt_dir: Path, total_steps: int, legacy: LegacyLayout) -> Path | None:
    """The checkpoint to continue from (None: a fresh start), checked before anything is allocated.

    Every file of it is verified (check_checkpoint: digests, then types) before the engine exists;
    one with no manifest (an older slidetune's) is used only if its tensors fit `legacy`, the
    model's layout. With --resume auto a damaged checkpoint is set aside (renamed, never deleted)
    with a message naming the file and what is wrong, and the next older one is tried; with
    --resume PATH the damage is the error."""
    if not cfg.resume:
        return None
    if cfg.resume == "auto":
        candidates = complete_checkpoints(ckpt_dir)[::-1]        # newest first
        if not candidates:
            print(f"--resume auto: no complete checkpoint in {ckpt_dir}; starting from step 0")
            return None
        checked, set_apart = None, []
        for ckpt in candidates:
            try:
                checked = check_checkpoint(ckpt, legacy)
                break
            except CheckpointCorrupt as e:
                aside = set_aside(ckpt)
                set_apart.append(aside)
                print(f"note: --resume auto: {e}. Set aside as {aside} (kept, not deleted); trying the next "
                      f"older checkpoint", file=sys.stderr)
            except CheckpointError as e:
                raise TrainingError(f"--resume auto: {e}") from e
        if checked is None:
            raise TrainingError(f"--resume auto: no checkpoint in {ckpt_dir} passed verification; each was set "
                                f"aside: {', '.join(p.name for p in set_apart)}. Start over without --resume "
                                f"(nothing was deleted)")
    else:
        ckpt = Path(cfg.resume)
        if not ckpt.is_dir():
            raise TrainingError(f"--resume {cfg.resume}: no such checkpoint directory (use --resume auto for the "
                                f"newest complete checkpoint in {ckpt_dir})")
        try:
            checked = check_checkpoint(ckpt, legacy)
        except CheckpointError as e:
            raise TrainingError(f"--resume {cfg.resume}: {e}" + (
                ". Resume from an older checkpoint instead (--resume auto sets a damaged one aside and takes the "
                "next older one)" if isinstance(e, CheckpointCorrupt) else "")) from e
    if not checked.verified:
        print(f"warning: {checked.path} has no MANIFEST.json (written by an older slidetune): its bytes cannot be "
              f"verified against digests, only its files' structure was checked and its tensors' names, shapes and "
              f"dtypes match the model", file=sys.stderr)
    if checked.step > total_steps:
        raise TrainingError(f"checkpoint {checked.path} is at step {checked.step}, beyond this run's {total_steps} "
                            f"steps (--max-steps/--epochs); resume with the run's original length")
    return checked.path


def _warn_changed_config(ckpt: Path, run_config: Path, cfg: TrainConfig, world_size: int = 1) -> None:
    """On resume: say which settings differ from those the checkpoint `ckpt` was made with
    (they change the trajectory); checkpoints older than that record fall back to the run's
    `config.json`. The batch is compared globally (batch_size x ranks): 2 ranks at 4 rows and one
    rank at 8 train alike."""
    try:
        old = json.loads((ckpt / "trainer_state" / "state.json").read_text())["trainer_state"]["config"]
        source = f"those {ckpt.name} was saved with"
        if not isinstance(old, dict):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        if not run_config.exists():
            return
        try:
            old = json.loads(run_config.read_text())
            if not isinstance(old, dict):
                raise ValueError(f"a JSON {type(old).__name__}, not an object of settings")
        except (OSError, ValueError) as e:
            # only read to compare settings, and rewritten below: the resume goes on, and says so
            print(f"note: {run_config} cannot be read as the run's config ({e}); the settings of this resume "
                  f"are not compared with the earlier run's", file=sys.stderr)
            return
        source = f"the run's saved config.json ({run_config})"
    ignore = {"resume", "stop_after", "progress", "log_every", "report_to", "output_dir", "gpu_memory_limit",
              "world_size", "eval_prompts", "eval_max_new_tokens"}
    old = group_tuning(old)             # one saved before the tuning knobs had their group compares the same
    new = config_to_dict(cfg)
    old_world = int(old.get("world_size", 1))
    if isinstance(old.get("batch_size"), int) and old["batch_size"] * old_world == cfg.batch_size * world_size:
        ignore.add("batch_size")
    elif old_world != world_size:
        new["batch_size"] = f"{cfg.batch_size} x {world_size} ranks"
        old["batch_size"] = f"{old.get('batch_size')} x {old_world} ranks"
    changed = []
    for key, value in new.items():
        if key in ignore:
            continue
        if isinstance(value, dict) and isinstance(old.get(key), dict):
            changed += [f"{key}.{k}: {old[key].get(k)!r} -> {v!r}" for k, v in value.items()
                        if k in old[key] and old[key][k] != v]
        elif key in old and old[key] != value:
            changed.append(f"{key}: {old[key]!r} -> {value!r}")
    if changed:
        print(f"note: resuming with settings that differ from {source}, so the result will "
              "differ from an uninterrupted run: " + "; ".join(changed), file=sys.stderr)


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

    Holds the run's state (engine, data, metrics rows) and its checkpoints' manager
    (checkpoint/manager.py); `run()` is the driver: resume, evaluate, step, stop or export, summarize.
    """

    def __init__(self, cfg: TrainConfig, engine: Engine, loaded: LoadedModel,
                 sampler: BatchSampler, heldout: TokenDataset | None, pad_id: int, total_steps: int,
                 device: Device, out: Path, t_start: float, resume_from: Path | None = None,
                 stale: list[Path] | None = None, stop: _StopFlag | None = None, ckpt_dir: Path | None = None,
                 saves: SavePlan | None = None, save_dtype: str = "fp32", ranks: Ranks | None = None,
                 reporting: _Reporting | None = None, eval_prompts: list[EvalPrompt] | None = None):
        self.cfg, self.engine, self.loaded, self.device = cfg, engine, loaded, device
        # data parallel: every rank runs this loop in step; rank 0 alone writes files
        self.ranks = ranks or Ranks.single()
        self.sampler, self.heldout, self.pad_id = sampler, heldout, pad_id
        self.eval_prompts = list(eval_prompts or [])   # sampled greedily at each evaluation (eval_samples.py)
        self.total_steps, self.out, self.t_start = total_steps, out, t_start
        self.stop_flag = stop or _StopFlag()
        self.start_step = 0
        reporting = reporting or _Reporting(["csv"], [])
        self.callbacks = reporting.callbacks
        # the metrics rows, the trackers (opened once the step to start from is known), the bar, loss.png
        self.metrics = RunMetrics(out, reporting.trackers, self.ranks)
        self.flops_tok = train_flops_per_token(loaded.split, cfg.data.seq_len)
        self.host_rss = host_rss_meter(self.ranks, engine)
        self.before: tuple[float, float] | None = None
        self.after: tuple[float, float] | None = None
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
        self.where = "start-up"          # the phase running now: what a GPU out-of-memory names
        # where checkpoints go, when and how they are written (checkpoint/manager.py)
        self.checkpoints = CheckpointManager(
            engine, SavePolicy(total_steps, save_every=cfg.save_every, keep_last=cfg.keep_last,
                               async_save=cfg.async_save, save_dtype=save_dtype),
            RunHooks(error=TrainingError, log_rows=self.metrics.log_rows, flush_files=self.metrics.flush_files,
                     notify=self.notify,
                     metrics_path=self.metrics.path),
            directory=ckpt_dir or out / "checkpoints", output_dir=out, ranks=self.ranks,
            run_record=_run_record(cfg, self.ranks.world_size), tokenizer=loaded.tokenizer, resume_from=resume_from,
            stale=stale, space=saves, on_gpu=device.is_cuda)

    # ------------------------------------------------------------------ the driver
    def run(self) -> TrainSummary:
        """Resume (if asked), evaluate, train to the end or a stop, export, write the summary."""
        self.start_step = self.checkpoints.resume()
        self.metrics.open_trackers(self.start_step, _run_record(self.cfg, self.ranks.world_size))
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
                    [f"{self.sampler.dataset.source}: {len(self.sampler.dataset)} training sequences of "
                     f"{cfg.data.seq_len} tokens, {len(self.heldout) if self.heldout is not None else 0} held out"],
                    _run_record(cfg, self.ranks.world_size), self.total_steps, self.before, self.after))
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
                row["eval_loss"], row["eval_ppl"] = self.evaluate()
                self.notify("on_eval", done, {"eval_loss": row["eval_loss"], "eval_ppl": row["eval_ppl"]})
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
        self.first_loss = res.loss if self.first_loss is None else self.first_loss
        self.last_loss = res.loss
        row = _row(step=s.step + 1, loss=res.loss, lr=s.lr, grad_norm=grad_norm, tokens_per_s=tps,
                   tflops=tps * self.flops_tok / 1e12, step_s=s.dt,
                   gpu_peak_alloc_gib=self.device.max_memory_allocated() / 2**30,
                   gpu_peak_reserved_gib=self.device.max_memory_reserved() / 2**30,
                   cpu_rss_gib=self.host_rss.bytes() / 2**30)
        self.metrics.add_step(row, self.total_steps, self.device.is_cuda, self.cfg.log_every)
        self.notify("on_step", s.step + 1, _scalars(row))
        return row

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
                    and len(self.heldout))

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> tuple[float, float]:
        """Held-out (loss, perplexity) of the current weights."""
        return evaluate(self.engine, self.heldout, self.cfg.batch_size, self.pad_id, self.cfg.eval_batches, self.ranks)

    def evaluate_before(self) -> None:
        """The held-out evaluation before step 1 (a fresh start only), as metrics row 0."""
        if self.start_step == 0 and self.heldout is not None and len(self.heldout) > 0:
            self.before = self.evaluate()
            print(f"held-out before training: loss {self.before[0]:.4f}  perplexity {self.before[1]:.2f}")
            self.metrics.rows.append(_row(step=0, eval_loss=self.before[0], eval_ppl=self.before[1]))
            self.notify("on_eval", 0, {"eval_loss": self.before[0], "eval_ppl": self.before[1]})
        if self.start_step == 0:
            self.sample_prompts(0)

    def evaluate_after(self) -> None:
        """The held-out evaluation of the finished run, once the last updates have landed."""
        self.engine.synchronize()
        if self.heldout is not None and len(self.heldout) > 0:
            self.after = self.evaluate()
            print(f"held-out after training: loss {self.after[0]:.4f}  perplexity {self.after[1]:.2f}")
            self.metrics.rows.append(_row(step=self.total_steps, eval_loss=self.after[0], eval_ppl=self.after[1]))
            self.notify("on_eval", self.total_steps, {"eval_loss": self.after[0], "eval_ppl": self.after[1]})
        self.sample_prompts(self.total_steps)

    def sample_prompts(self, step: int) -> None:
        """The eval prompts' greedy samples with the current weights, after step `step` (eval_samples.py):
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
        summary = TrainSummary(
            output_dir=str(self.out), steps=self.engine.step_index,
            eval_loss_before=before[0] if before else None, eval_loss_after=after[0] if after else None,
            ppl_before=before[1] if before else None, ppl_after=after[1] if after else None,
            first_loss=self.first_loss, last_loss=self.last_loss,
            tokens_per_s=float(np.median(self.tok_rates)) if self.tok_rates else None,
            wall_s=time.perf_counter() - self.t_start, interrupted=self.interrupted,
            stopped_early=self.stopped_early,
            data_source=cfg.data.path or (self.sampler.dataset.source if self.sampler.dataset.source != BUILTIN_NAME
                                          else f"built-in corpus (Python {platform.python_version()} docs)"),
            train_sequences=len(self.sampler.dataset), heldout_sequences=len(heldout) if heldout is not None else 0,
            device=torch.cuda.get_device_name() if self.device.is_cuda else "cpu", dtype=cfg.runtime.dtype,
            **self.checkpoints.totals())
        # rank 0 writes it and the other ranks wait for it (on_main): a rank that ended first would
        # make torchrun stop the others (SIGTERM), rank 0 perhaps before this file is written
        self.ranks.on_main(lambda: _write_text(self.out / "summary.json", json.dumps(summary.__dict__, indent=2) + "\n"))
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


def _write_text(path: Path, text: str) -> None:
    write_atomically(path, lambda tmp: tmp.write_text(text))
