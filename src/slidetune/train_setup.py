"""What `train` checks and prepares before its loop, around run_setup.prepare_run.

run_setup.prepare_run is the setup every run shares (train and the benches): the memory limit, the
model, the placement, the fit check, the engine. This module is train's own part of it, in order:
the callbacks and the dtype checked, the run printed; data parallel's refusals; the data read; the
model checked (after_load: the reference check, the tokenizer, the context); what the autos chose
said (on_placed); then, after the fit check and before the engine allocates anything (before_build),
the eval prompts, the data tokenized, the steps counted, the layers to compile chosen, and the output
directory prepared: leftovers of killed saves restored, the disk space planned, the checkpoint to
resume from resolved and verified, the settings that changed since it said, config.json written.
Everything refused here is refused before anything large is allocated.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .callbacks import Callback
from .checkpoint import (CheckpointCorrupt, CheckpointError, DiskSpaceError, LegacyLayout, SavePlan,
                         check_checkpoint, complete_checkpoints, plan_saves, recover_leftovers, resolve_save_dtype,
                         set_aside, write_atomically)
from .config import TrainConfig, config_to_dict, group_tuning
from .data import BatchSampler, TokenDataset, build_datasets, default_pad_id
from .data.build import load_source
from .data.errors import DataError
from .data.pair_source import PairRecords, PairSampler, read_pair_records, tokenize_pair_records
from .data.token_arrays import is_token_source
from .device import Device, resolve_dtype
from .engine import RuntimeConfig
from .engine.autos import describe_autos
from .engine.compile_cache import CompileCache, CompileCounters, cache_holds, describe_cache, layer_compile_key
from .engine.compile_policy import choose_compile_layers, resolve_compile_layers
from .engine.fit import InsufficientMemoryError, check_fit, fit_counts_compiled
from .engine.placement import PlacementPlan
from .engine.slide.disk_tier import tier_bytes
from .engine.tiers import TIERS
from .evaluation.samples import EvalPrompt, resolve_eval_prompts
from .models.load import LoadedModel
from .models.reference_check import require_faithful
from .ops.packed_attention import use_packed_attention
from .parallel.ranks import Ranks
from .run_setup import PreparedRun, RunRequest, prepare_run


class TrainingError(RuntimeError):
    pass


def checkpoint_root(cfg: TrainConfig, out: Path) -> Path:
    """Where the run's checkpoints go: --checkpoint-dir, or `<output_dir>/checkpoints`. The lock is
    taken on it whichever names it (checkpoint/lock.py): another run given it by --checkpoint-dir is refused."""
    return Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else out / "checkpoints"


@dataclass
class Reporting:
    """Where a run reports: the trackers --report-to resolved to (telemetry/trackers.py) and the callbacks."""
    trackers: list[str]
    callbacks: list[Callback]


def check_callbacks(callbacks) -> list[Callback]:
    """`callbacks` as a list, each with the three hooks (a Callback, or an object with on_step, on_eval
    and on_save); TypeError names one that is not."""
    callbacks = list(callbacks or [])
    for cb in callbacks:
        missing = [h for h in ("on_step", "on_eval", "on_save") if not callable(getattr(cb, h, None))]
        if missing:
            raise TypeError(f"train(callbacks=...): {cb!r} is not a slidetune.Callback (it lacks "
                            f"{', '.join(missing)}); subclass slidetune.Callback and override the hooks you need")
    return callbacks


def resolve_config_dtype(cfg: TrainConfig, device: Device) -> tuple[TrainConfig, str]:
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


def print_config(cfg: TrainConfig, device: Device, dtype_why: str, verbose: bool, given: bool = False) -> None:
    """The run in a few lines (every setting: config.json, or the whole of it here with --verbose)."""
    if verbose:
        print("resolved config:\n" + json.dumps(config_to_dict(cfg), indent=2), flush=True)
    steps = (f"{cfg.epochs:g} epochs" if cfg.epochs is not None
             else f"{cfg.resolved_max_steps(device.is_cuda)} steps")
    rows = (f"{cfg.batch_size} pairs (2 x {cfg.batch_size} sequences) of up to {cfg.data.seq_len} tokens"
            if cfg.objective != "sft" else f"{cfg.batch_size} x {cfg.data.seq_len} tokens")
    objective = "" if cfg.objective == "sft" else f", objective {cfg.objective} (beta {cfg.beta:g})"
    data = cfg.data.path or ("the dataset given in Python" if given else "the built-in corpus")
    clip = f"gradient clipping at {cfg.max_grad_norm:g}" if cfg.max_grad_norm else "no gradient clipping"
    evals = "held-out loss before and after" + (f", every {cfg.eval_every} steps" if cfg.eval_every else "")
    print(f"slidetune train: {cfg.model} on {data}, {cfg.runtime.mode} mode on {device.device}, {cfg.runtime.dtype} "
          f"({dtype_why})\n"
          f"  {steps} of {rows}"
          + (f" x {cfg.grad_accum} micro-batches" if cfg.grad_accum > 1 else "")
          + f", AdamW lr {cfg.optim.lr:g} ({cfg.lr_schedule}, "
          + (f"{cfg.warmup_steps} warmup steps" if cfg.warmup_ratio is None else
             f"warmup over {cfg.warmup_ratio:g} of the steps")
          + f"){objective}, {clip}; {evals}\n"
          f"  output: {cfg.output_dir}/ (every setting in config.json" + ("" if verbose else ", --verbose prints them")
          + ")", flush=True)


@dataclass
class RunInputs:
    """What train reads and decides between the fit check and the engine: the data, the steps, the
    output directory's state, the eval prompts (prepare_run's before_build). A supervised run's
    data is `sampler` and `heldout`; a preference objective's is `pairs` (and those are None)."""
    sampler: BatchSampler | None
    heldout: TokenDataset | None
    pad_id: int
    total_steps: int
    ckpt_dir: Path
    save_dtype: str
    saves: SavePlan
    resume_from: Path | None
    stale: list[Path]
    eval_prompts: list[EvalPrompt] = field(default_factory=list)   # sampled at each evaluation (evaluation/samples.py)
    pairs: PairSampler | None = None     # a preference objective's pairs (data/pair_source.py)
    compile: CompiledLayers | None = None    # the layers are compiled: where their cache is, the counters before


@dataclass(frozen=True)
class CompiledLayers:
    """A run that compiles its layers: the cache (engine/compile_cache.py), its key for this run's
    layers, and dynamo's counters before the engine was built (the first step reports the difference)."""
    cache: CompileCache
    key: str
    before: CompileCounters


def prepare_training(cfg: TrainConfig, ranks: Ranks, device: Device, out: Path, verbose: bool = False,
                     given: tuple = (None, None)) -> tuple[PreparedRun, RunInputs]:
    """The run of `cfg` set up in the module docstring's order: the engine built (prepared.engine)
    and what the loop reads (the data, the steps, the checkpoints' plan, the eval prompts).
    `given`: the train and eval datasets passed to train() in Python, or None."""
    if ranks.world_size > 1:
        _refuse_under_data_parallel(cfg, ranks)
        print(f"data parallel: rank {ranks.rank} of {ranks.world_size} on {device.device}; global batch "
              f"{cfg.batch_size * ranks.world_size} ({cfg.batch_size} {'rows' if cfg.objective == 'sft' else 'pairs'} "
              f"per rank)")
    # the data first, read and parsed (a missing file, a malformed line: refused in seconds), then
    # the model, then the reference check on it; a pre-tokenized corpus is opened once the
    # tokenizer's EOS is known (build_datasets below)
    # a preference objective's records (pairs), parsed now and tokenized once the tokenizer is loaded
    pair_records = ranks.on_each(lambda: read_pair_records(cfg.data, *given)) if cfg.objective != "sft" else None
    source = None if is_token_source(cfg.data.path) or pair_records is not None else \
        ranks.on_each(lambda: load_source(cfg.data, *given))
    # what the auto settings chose: the GPU's placement (on the CPU only with --verbose: no GPU there)
    say = print if device.is_cuda or verbose else _silent
    inputs: list[RunInputs] = []

    def before_build(prepared: PreparedRun) -> RuntimeConfig:
        # the eval prompts read (a bad file refused) before the engine allocates anything
        prompts = ranks.on_each(lambda: _eval_prompts(cfg, source, prepared.loaded))
        run_inputs, runtime = _prepare_inputs(cfg, prepared, source, pair_records, ranks, device, out, say)
        run_inputs.eval_prompts = prompts
        inputs.append(run_inputs)
        return runtime

    prepared = prepare_run(
        _run_request(cfg), device, ranks, after_load=lambda loaded: _check_model(cfg, loaded),
        on_placed=lambda p: _say_autos(cfg, p, device.is_cuda or verbose, say), before_build=before_build)
    return prepared, inputs[0]


def _eval_prompts(cfg: TrainConfig, source, loaded: LoadedModel) -> list[EvalPrompt]:
    """The prompts sampled at each evaluation (evaluation/samples.py), a bad --eval-prompts file as a TrainingError."""
    try:
        return resolve_eval_prompts(cfg.eval_prompts, source, cfg.data, loaded.tokenizer)
    except DataError as e:
        raise TrainingError(str(e)) from e


def _run_request(cfg: TrainConfig) -> RunRequest:
    """The run prepare_run sets up for `cfg`: packed rows are full windows, so no batch carries
    padding (no [B,1,S,S] padding masks; masked packing builds its document mask as a
    FlexAttention BlockMask on CUDA); nor do a preference objective's pairs (padded on the right)."""
    # a preference objective's micro-batch is --batch-size pairs: twice as many rows, right-padded
    # without a mask (data/preference.pair_micro_batches)
    return RunRequest(model=cfg.model, runtime=cfg.runtime, optim=cfg.optim, batch_size=cfg.rows_per_micro_batch,
                      seq_len=cfg.data.seq_len, grad_accum=cfg.grad_accum, max_grad_norm=cfg.max_grad_norm,
                      padded=cfg.padded_rows, num_layers=cfg.num_layers, seed=cfg.seed,
                      gpu_memory_limit_gib=cfg.gpu_memory_limit, check_memory=cfg.check_memory, announce=True,
                      objective=cfg.preference())


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


@dataclass
class _TrainingData:
    sampler: BatchSampler | None
    heldout: TokenDataset | None
    pairs: PairSampler | None
    pad_id: int
    micro_batches_per_epoch: int
    rows: int                       # sequences a micro-batch


def _training_data(cfg: TrainConfig, loaded: LoadedModel, source, pair_records: PairRecords | None,
                   ranks: Ranks) -> _TrainingData:
    """The data tokenized: a supervised run's rows and sampler, or a preference objective's pairs."""
    # without a tokenizer (pre-tokenized rows, full windows) any id pads: padding is never
    # attended to nor trained on
    pad_id = default_pad_id(loaded.tokenizer) if loaded.tokenizer is not None else 0
    if pair_records is not None:
        data = ranks.on_each(lambda: tokenize_pair_records(pair_records, cfg.data, loaded.tokenizer))
        # each step's pairs are the global step's (--batch-size pairs a micro-batch per rank); each
        # rank takes its micro-batches of it (PairSampler), as an SFT rank takes its rows
        pairs = PairSampler(data, cfg.preference(), cfg.batch_size, cfg.grad_accum, cfg.seed, pad_id,
                            world_size=ranks.world_size, rank=ranks.rank)
        return _TrainingData(None, None, pairs, pad_id, len(pairs), 2 * cfg.batch_size)
    # the sampler draws global batches (--batch-size rows per rank) from (seed, step); each rank
    # takes its rows of each (Trainer.micro_batch): N ranks train on one rank's data at N x the batch
    global_batch = cfg.batch_size * ranks.world_size
    # a pre-tokenized corpus's ids are checked against the model's vocabulary here, before step 1
    train_ds, heldout = ranks.on_each(lambda: build_datasets(cfg.data, loaded.tokenizer, min_rows=global_batch,
                                                             vocab_size=loaded.split.config.vocab_size,
                                                             source=source))
    if train_ds.document_mask:
        use_packed_attention(loaded.split.model)   # packing "masked": attention per document
    sampler = BatchSampler(train_ds, global_batch, cfg.seed, pad_id)
    return _TrainingData(sampler, heldout, None, pad_id, len(sampler), cfg.batch_size)


def _placement_needs_compile(prepared: PreparedRun, device: Device) -> bool:
    """Whether the placement fits only with HF's layer compiled: the fit counted it compiled
    (fit/byte_models.fit_counts_compiled, compile_layers auto on CUDA) and the eager layer's working
    set does not fit the same budget, so compile_layers auto must resolve on."""
    rt = dataclasses.replace(prepared.runtime, device=device.device.type)
    if prepared.runtime.compile_layers != "auto" or not fit_counts_compiled(rt):
        return False
    try:
        check_fit(prepared.loaded.split, dataclasses.replace(rt, compile_layers="off"), **prepared.work.fit_kwargs())
    except InsufficientMemoryError:
        return True
    return False


def _prepare_inputs(cfg: TrainConfig, prepared: PreparedRun, source, pair_records: PairRecords | None, ranks: Ranks,
                    device: Device, out: Path, say) -> tuple[RunInputs, RuntimeConfig]:
    """After the fit check, before the engine allocates anything: the data tokenized, the steps
    counted, the layers to compile chosen, the output directory prepared. Returns those and the
    runtime with compile_layers resolved."""
    loaded, runtime = prepared.loaded, prepared.runtime
    data = _training_data(cfg, loaded, source, pair_records, ranks)
    total_steps = cfg.resolved_max_steps(device.is_cuda)
    if cfg.epochs is not None:
        total_steps = max(1, int(cfg.epochs * data.micro_batches_per_epoch / cfg.grad_accum))
    cache = prepared.compile_cache
    key = layer_compile_key(loaded.split.config, runtime, data.rows, cfg.data.seq_len, device_name(device)) \
        if cache is not None else ""
    compiled = choose_compile_layers(runtime, loaded.split, is_cuda=device.is_cuda, steps=total_steps,
                                     tokens_per_step=data.rows * cfg.grad_accum * cfg.data.seq_len,
                                     seq_len=cfg.data.seq_len, cached=cache is not None and cache_holds(cache, key),
                                     placement_needs_it=_placement_needs_compile(prepared, device))
    runtime = resolve_compile_layers(runtime, compiled)
    compile_layers = CompiledLayers(cache, key, CompileCounters.now()) \
        if cache is not None and runtime.compiles_layers() else None
    if cfg.runtime.mode == "slide":
        say(f"compile_layers {cfg.runtime.compile_layers} -> {compiled.compile_layers} ({compiled.reason})")
    if compile_layers is not None:
        print(describe_cache(cache))        # always: where files are written between runs
    ckpt_dir = checkpoint_root(cfg, out)
    save_dtype = resolve_save_dtype(cfg.save_dtype, loaded.split.config, runtime.dtype)
    # Rank 0 alone reads and changes the output directory before the run (leftovers, free space,
    # the checkpoint to resume from, an earlier run's checkpoints) and every rank gets its answer.
    saves, resume_from, stale = ranks.on_main(lambda: _prepare_output(cfg, loaded, prepared.plan, runtime, out,
                                                                      ckpt_dir, save_dtype, total_steps,
                                                                      ranks.world_size))
    return RunInputs(data.sampler, data.heldout, data.pad_id, total_steps, ckpt_dir, save_dtype, saves, resume_from,
                     stale, pairs=data.pairs, compile=compile_layers), runtime


def device_name(device: Device) -> str:
    """The device the layers compile for, by model: a compiled layer's kernels are the GPU's."""
    import torch
    return torch.cuda.get_device_name(device.device) if device.is_cuda else device.device.type


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
            if plan is not None and plan.indices(TIERS.with_files) else None
        saves = plan_saves(loaded.split.num_params(), save_dtype=save_dtype, output_dir=out, checkpoint_dir=ckpt_dir,
                           save_every=cfg.save_every, keep_last=cfg.keep_last, scratch=tier,
                           scratch_holds_weights=plan is not None and plan.master_params(TIERS.with_files) > 0,
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
    write_text(out / "config.json", json.dumps(run_record(cfg, world_size), indent=2) + "\n")
    return saves, resume_from, stale


def run_record(cfg: TrainConfig, world_size: int) -> dict:
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


def write_text(path: Path, text: str) -> None:
    write_atomically(path, lambda tmp: tmp.write_text(text))
