"""The training loop: data -> engine steps -> metrics, evaluation, checkpoints.

Interruptions are safe: SIGINT/SIGTERM set a flag that the loop checks between steps;
it then writes a resumable checkpoint and exits. A non-finite loss stops the run
with the step number. Everything is deterministic in (config, seed): the batch of
step k is a pure function of k, so `--resume auto` continues the same trajectory.
"""
from __future__ import annotations

import csv
import json
import math
import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import torch

from .checkpoint import latest_checkpoint, load_checkpoint, prune_checkpoints, save_checkpoint
from .config import TrainConfig, config_to_dict
from .data import BatchSampler, build_datasets, default_pad_id, eval_batches
from .device import Device
from .engine import build_engine
from .engine.fit import check_fit
from .models.load import load_model
from .telemetry.flops import train_flops_per_token

METRIC_COLUMNS = ["step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops", "step_s",
                  "gpu_peak_alloc_gib", "gpu_peak_reserved_gib", "cpu_rss_gib", "eval_loss", "eval_ppl"]


class TrainingError(RuntimeError):
    pass


def lr_at(cfg: TrainConfig, step: int, total: int) -> float:
    peak = cfg.optim.lr
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return peak
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
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
    """SIGINT/SIGTERM -> finish the current step, checkpoint, exit."""

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
    interrupted: bool = False


def evaluate(engine, heldout, batch_size: int, pad_id: int, max_batches: int) -> tuple[float, float]:
    total, count = 0.0, 0
    for i, batch in enumerate(eval_batches(heldout, batch_size, pad_id)):
        if max_batches and i >= max_batches:
            break
        s, n = engine.eval_loss(batch)
        total += s
        count += n
    if count == 0:
        return float("nan"), float("nan")
    loss = total / count
    return loss, math.exp(min(loss, 50.0))


def train(cfg: TrainConfig) -> TrainSummary:
    t_start = time.perf_counter()
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    seed_everything(cfg.seed)
    device = Device.resolve(cfg.runtime.device)
    loaded = load_model(cfg.model, num_layers=cfg.num_layers, seed=cfg.seed)
    if loaded.tokenizer is None:
        raise TrainingError(f"model {cfg.model!r} has no tokenizer, so text data cannot be tokenized; "
                            f"use a model directory with tokenizer files or a preset with a >= 49152 vocabulary")
    max_pos = getattr(loaded.split.config, "max_position_embeddings", None)
    if max_pos is not None and cfg.data.seq_len > max_pos:
        raise TrainingError(f"--seq-len {cfg.data.seq_len} exceeds the model's context of {max_pos} tokens "
                            f"(max_position_embeddings); use --seq-len {max_pos} or less")
    train_ds, heldout = build_datasets(cfg.data, loaded.tokenizer)
    pad_id = default_pad_id(loaded.tokenizer)
    sampler = BatchSampler(train_ds, cfg.batch_size, cfg.seed, pad_id)
    total_steps = cfg.max_steps
    if cfg.epochs is not None:
        total_steps = max(1, int(cfg.epochs * len(sampler) / cfg.grad_accum))

    if cfg.check_memory:
        check_fit(loaded.split, cfg.runtime if cfg.runtime.device != "auto" else _with_device(cfg, device),
                  batch_size=cfg.batch_size, seq_len=cfg.data.seq_len, grad_accum=cfg.grad_accum,
                  max_grad_norm=cfg.max_grad_norm)
    (out / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2))
    engine = build_engine(loaded, cfg.runtime, cfg.optim, device, grad_accum=cfg.grad_accum,
                          max_grad_norm=cfg.max_grad_norm)
    try:
        return _loop(cfg, engine, loaded, sampler, heldout, pad_id, total_steps, device, out, t_start)
    finally:
        engine.close()


def _with_device(cfg: TrainConfig, device: Device):
    import dataclasses
    return dataclasses.replace(cfg.runtime, device=device.device.type)


def _loop(cfg, engine, loaded, sampler, heldout, pad_id, total_steps, device, out, t_start) -> TrainSummary:
    start_step = 0
    ckpt_dir = out / "checkpoints"
    if cfg.resume:
        ckpt = latest_checkpoint(ckpt_dir) if cfg.resume == "auto" else Path(cfg.resume)
        if ckpt is not None:
            state = load_checkpoint(engine, ckpt)
            start_step = int(state.get("step", engine.step_index))
            print(f"resumed from {ckpt} at step {start_step}")
        elif cfg.resume != "auto":
            raise TrainingError(f"--resume {cfg.resume}: no such checkpoint")
    metrics_path = out / "metrics.csv"
    rows = _read_rows(metrics_path, upto=start_step) if start_step else []
    flops_tok = train_flops_per_token(loaded.split, cfg.data.seq_len)
    proc = psutil.Process()
    before = None
    if start_step == 0 and heldout is not None and len(heldout) > 0:
        before = evaluate(engine, heldout, cfg.batch_size, pad_id, cfg.eval_batches)
        print(f"held-out before training: loss {before[0]:.4f}  perplexity {before[1]:.2f}")
        rows.append(_row(step=0, eval_loss=before[0], eval_ppl=before[1]))
    bar = None
    if cfg.progress:
        from tqdm import tqdm
        bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True)
    first_loss = last_loss = None
    interrupted = False
    tok_rates = []
    device.reset_peak()
    last_t = time.perf_counter()
    with _StopFlag() as stop:
        for step in range(start_step, total_steps):
            mbs = [sampler.batch(step * cfg.grad_accum + j) for j in range(cfg.grad_accum)]
            lr = lr_at(cfg, step, total_steps)
            res = engine.train_step(mbs, lr)
            now = time.perf_counter()
            dt, last_t = now - last_t, now
            if not math.isfinite(res.loss):
                _write_rows(metrics_path, rows)
                raise TrainingError(
                    f"non-finite loss ({res.loss}) at step {step + 1}; the weights of that step were not "
                    f"saved. Try a lower --lr (now {cfg.optim.lr}), --max-grad-norm 1.0, --dtype bf16 "
                    f"instead of fp16, or resume from the last checkpoint")
            tokens = sum(int(mb.input_ids.numel()) for mb in mbs)
            tps = tokens / dt
            if step > start_step:                   # the first step includes warm-up
                tok_rates.append(tps)
            first_loss = res.loss if first_loss is None else first_loss
            last_loss = res.loss
            row = _row(step=step + 1, loss=res.loss, lr=lr, grad_norm=res.grad_norm(), tokens_per_s=tps,
                       tflops=tps * flops_tok / 1e12, step_s=dt,
                       gpu_peak_alloc_gib=device.max_memory_allocated() / 2**30,
                       gpu_peak_reserved_gib=device.max_memory_reserved() / 2**30,
                       cpu_rss_gib=proc.memory_info().rss / 2**30)
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < total_steps and len(heldout):
                row["eval_loss"], row["eval_ppl"] = evaluate(engine, heldout, cfg.batch_size, pad_id,
                                                             cfg.eval_batches)
            rows.append(row)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{res.loss:.4f}", tok_s=f"{tps:,.0f}", tflops=f"{row['tflops']:.1f}",
                                gpu=f"{row['gpu_peak_alloc_gib']:.1f}G", rss=f"{row['cpu_rss_gib']:.1f}G")
            if (step + 1) % max(1, cfg.log_every) == 0:
                _write_rows(metrics_path, rows)
            if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < total_steps:
                _checkpoint(cfg, engine, loaded, ckpt_dir, step + 1)
            if stop.signal is not None:
                _write_rows(metrics_path, rows)
                path = _checkpoint(cfg, engine, loaded, ckpt_dir, step + 1)
                print(f"\nstopped by signal {stop.signal} after step {step + 1}; resumable checkpoint: {path}\n"
                      f"continue with: slidetune train ... --output-dir {out} --resume auto")
                interrupted = True
                break
        if bar is not None:
            bar.close()
    after = None
    if not interrupted:
        engine.synchronize()
        if heldout is not None and len(heldout) > 0:
            after = evaluate(engine, heldout, cfg.batch_size, pad_id, cfg.eval_batches)
            print(f"held-out after training: loss {after[0]:.4f}  perplexity {after[1]:.2f}")
            rows.append(_row(step=total_steps, eval_loss=after[0], eval_ppl=after[1]))
        _checkpoint(cfg, engine, loaded, ckpt_dir, total_steps)
        save_checkpoint(engine, out / "final", step=total_steps, tokenizer=loaded.tokenizer,
                        save_dtype=cfg.save_dtype, with_optimizer=False)
    _write_rows(metrics_path, rows)
    _plot(metrics_path, out / "loss.png")
    summary = TrainSummary(
        output_dir=str(out), steps=engine.step_index,
        eval_loss_before=before[0] if before else None, eval_loss_after=after[0] if after else None,
        ppl_before=before[1] if before else None, ppl_after=after[1] if after else None,
        first_loss=first_loss, last_loss=last_loss,
        tokens_per_s=float(np.median(tok_rates)) if tok_rates else None,
        wall_s=time.perf_counter() - t_start, interrupted=interrupted)
    (out / "summary.json").write_text(json.dumps(summary.__dict__, indent=2))
    return summary


def _checkpoint(cfg, engine, loaded, ckpt_dir: Path, step: int) -> Path:
    path = save_checkpoint(engine, ckpt_dir / f"checkpoint-{step}", step=step, tokenizer=loaded.tokenizer,
                           trainer_state={"step": step})
    prune_checkpoints(ckpt_dir, cfg.keep_last)
    return path


def _row(**kw) -> dict:
    return {c: kw.get(c, "") for c in METRIC_COLUMNS}


def _read_rows(path: Path, upto: int) -> list[dict]:
    if not path.exists():
        return []
    with path.open() as f:
        return [r for r in csv.DictReader(f) if r["step"] and int(float(r["step"])) <= upto]


def _write_rows(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".csv.tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=METRIC_COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    os.replace(tmp, path)


def _plot(metrics: Path, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with metrics.open() as f:
        rows = list(csv.DictReader(f))
    train_pts = [(int(r["step"]), float(r["loss"])) for r in rows if r["loss"]]
    eval_pts = [(int(r["step"]), float(r["eval_loss"])) for r in rows if r["eval_loss"]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if train_pts:
        ax.plot(*zip(*train_pts), label="train loss")
    if eval_pts:
        ax.plot(*zip(*eval_pts), "o--", label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = png.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, png)
