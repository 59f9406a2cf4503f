"""Measure one configuration in this process and write a JSON result.

Run as `python -m slidetune.bench.measure SPEC.json OUT.json`; the runner starts one
process per configuration so each peak (GPU allocated/reserved, host VmHWM) is clean.
Warm-up steps are excluded from every statistic. Per-layer times come from events
recorded on the compute stream and read once per step.
"""
from __future__ import annotations

import gc
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..data import Batch
from ..device import Device
from ..engine import AdamWConfig, RuntimeConfig
from ..objectives.preference import PreferenceConfig
from ..parallel.ranks import Ranks
from ..run_setup import PreparedRun, RunRequest, prepare_run
from ..telemetry.events import EventTimer
from ..telemetry.flops import train_flops_per_token
from ..telemetry.machine import host_memory_snapshot, host_peak_rss, machine_info, memory_parts, peak_rss_bytes
from .workload import BenchWorkload, WorkloadSpec


@dataclass
class MeasureSpec(WorkloadSpec):
    name: str = "run"
    # steps: measured steps, after `warmup` more; batch_size: rows per micro-batch (and per rank)
    workload: BenchWorkload = field(default_factory=lambda: BenchWorkload("qwen3-1.7b", seq_len=256))
    grad_accum: int = 1
    max_grad_norm: float | None = None
    runtime: dict = field(default_factory=dict)   # RuntimeConfig fields
    per_layer: bool = True
    profile: bool = False            # one extra profiled step -> trace summary
    # slide: refuse (status "refused", the fit check's message) what engine.fit says does not
    # fit, before anything large is allocated: a host that runs out of RAM may take more than
    # this process with it, and the OOM killer leaves no message
    check_memory: bool = True
    # data-parallel ranks on this host (slide mode, docs/data_parallel.md): run_isolated starts this
    # many processes under torchrun; batch_size is per rank (the step's tokens are ranks x batch x
    # seq); the result is rank 0's, with every rank's peaks and step time, the host's RSS counting
    # the shared host state once
    ranks: int = 1
    # "sft", or a preference objective (dpo, ipo, simpo, orpo: objectives/preference.py, TRL's
    # defaults): each micro-batch's rows are then batch_size / 2 pairs, synthetic_batches' pairs
    objective: str = "sft"

    @property
    def preference(self) -> PreferenceConfig | None:
        return PreferenceConfig(self.objective) if self.objective != "sft" else None


def synthetic_batches(vocab: int, batch: int, seq: int, n: int, seed: int,
                      objective: PreferenceConfig | None = None) -> list[Batch]:
    """`n` micro-batches of `batch` random rows of `seq` tokens, every position a target. With a
    preference objective: batch / 2 pairs a micro-batch, each row's first half its prompt and the
    rest its completion (rows padded to `seq` as the pair collator pads them: none here), with
    random reference sums; the step's normalization over all `n` micro-batches."""
    g = torch.Generator().manual_seed(seed)
    pin = torch.cuda.is_available()
    if objective is not None:
        from ..data.preference import TokenizedPair, collate_pairs, pair_micro_batches
        if batch % 2:
            raise ValueError(f"a preference objective's micro-batch holds whole pairs: {batch} rows is not even")
        half = seq // 2
        pairs = [TokenizedPair("synthetic", *(torch.randint(0, vocab, (k,), generator=g).tolist()
                                              for k in (half, seq - half, seq - half)))
                 for _ in range(n * batch // 2)]
        ref = -torch.rand(n * batch, generator=g, dtype=torch.float64) * seq - seq
        out = pair_micro_batches(collate_pairs(pairs, pad_id=0), objective, ref.float(), n)
        return [Batch(b.input_ids.pin_memory() if pin else b.input_ids, b.labels, b.attention_mask, pairs=b.pairs)
                for b in out]
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        labels = torch.roll(ids, -1, 1)
        labels[:, -1] = -100
        out.append(Batch(ids.pin_memory() if pin else ids, labels, None))
    return out


def step_timeline(gpu_spans, host_spans, t0: float, t1: float) -> list[list]:
    """One step as Gantt rows [lane, what, unit, start_ms, end_ms] relative to its start `t0`:
    the GPU's per-layer spans (lane "gpu", what = phase; pass the previous step's too, whose
    backward runs into this interval) and the host threads' spans (lane = thread), clipped to
    [t0, t1]. GPU spans without a host-clock position are left out."""
    rows = []
    for s in gpu_spans:
        if s.start_s is not None and s.end_s > t0 and s.start_s < t1:
            unit = f"layer.{s.layer}" if s.layer >= 0 else ""
            rows.append(["gpu", s.phase, unit, (max(s.start_s, t0) - t0) * 1e3, (min(s.end_s, t1) - t0) * 1e3])
    for thread, what, s, e, *rest in host_spans:
        if e > t0 and s < t1:
            rows.append([thread, what, rest[0] if rest else "", (max(s, t0) - t0) * 1e3, (min(e, t1) - t0) * 1e3])
    return rows


def lane_busy_fraction(timeline: dict | None, lane: str) -> float | None:
    """The share of a step_timeline's step (its "step_ms") in which the lane had a span open: e.g.
    the disk tier's (its name), its reads and writes (its I/O threads), whose union is its busy time. None
    where the timeline has no such lane."""
    from ..telemetry.host_timeline import union
    if not timeline or not timeline.get("step_ms"):
        return None
    spans = [(float(row[3]), float(row[4])) for row in timeline.get("rows") or [] if row[0] == lane]
    if not spans:
        return None
    return sum(e - s for s, e in union(spans)) / float(timeline["step_ms"])


def _mean_by_key(dicts: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the mean over `dicts` (a key missing from one counts as 0 there)."""
    keys = sorted({k for d in dicts for k in d})
    return {k: sum(d.get(k, 0.0) for d in dicts) / len(dicts) for k in keys}


class GCPauses:
    """Python's garbage collections while installed: (generation, seconds) each, via gc.callbacks.
    A full (generation 2) collection of a process holding a model's worth of tensors stops every
    Python thread, the compute thread that launches the GPU's work included."""

    def __init__(self):
        self._pauses: list[tuple[int, float]] = []
        self._t0 = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self._pauses.append((info["generation"], time.perf_counter() - self._t0))

    def take(self) -> list[tuple[int, float]]:
        out, self._pauses = self._pauses, []
        return out

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


def start_ranks(spec: MeasureSpec, rt: RuntimeConfig) -> tuple[Ranks, Device]:
    """One rank: the runtime's device. spec.ranks > 1 (under torchrun, bench.runner): this process's
    rank and device as training takes them (ranks.Ranks.start: cuda:LOCAL_RANK over NCCL, or gloo
    on the CPU)."""
    if spec.ranks <= 1:
        return Ranks.single(), Device.resolve(rt.device, waits=rt.host.cuda_waits)
    if rt.mode != "slide":
        raise ValueError(f"{spec.ranks} ranks: data parallel runs in slide mode only, not {rt.mode}")
    ranks, device = Ranks.start(rt.device, rt.host.cuda_waits)
    if ranks.world_size != spec.ranks:
        ranks.close()
        raise ValueError(f"the spec asks for {spec.ranks} ranks, but this process is one of {ranks.world_size} "
                         f"(run it through bench.runner.run_isolated)")
    return ranks, device


def rank_summary(ranks: Ranks, result: dict, shared_bytes: int) -> dict:
    """Every rank's peaks and step time, gathered (a collective: every rank calls it), and the
    host's peak RSS with the shared host state (`shared_bytes`, its /dev/shm file) counted once
    (telemetry.machine.host_peak_rss)."""
    mine = {"rank": ranks.rank, **memory_parts(), "step_s_mean": result.get("step_s_mean"),
            "gpu_peak_alloc_gib": result.get("gpu_peak_alloc_gib"), "host_memory": result.get("host_memory")}
    every = ranks.gather(mine)
    return {"world_size": ranks.world_size, "rank_results": every, "shared_state_gib": shared_bytes / 2**30,
            "host_rss_gib": host_peak_rss(every, shared_bytes) / 2**30,
            "host_pss_gib": sum(r["pss"] for r in every) / 2**30}


DISK_WARMUP_WHY = ("the disk tier's files start as unwritten extents (posix_fallocate), so the first "
                   "step's update reads zeros the disk never serves: its sweep, which the next step's "
                   "interval waits for, is not a step like the others")


def disk_tier_warmup(asked: int, engine) -> int:
    """Warm-up steps for a run: at least 2 where the engine has a disk tier (DISK_WARMUP_WHY; a
    Qwen3-14B run with one warm-up step measured 22 s then 65 s, 2026-11-25)."""
    return max(asked, 2) if engine.disk is not None else asked


def fit_estimate(prepared: PreparedRun, device: Device) -> dict[str, float]:
    """The fit's estimate of the placement that runs (GiB), beside the measured peaks (the fit
    margin's calibration, engine/fit/budget.py FIT_SAFETY), and the GPU memory it planned with (read
    before the engine allocates anything)."""
    from ..engine.fit import estimate_memory
    work = prepared.work
    free = work.gpu_free_bytes
    if free is None and device.is_cuda:                 # the device's own free memory, as the autos read it
        free = torch.cuda.mem_get_info(device.device)[0]
    est = estimate_memory(prepared.loaded.split, prepared.runtime, batch_size=work.batch_size, seq_len=work.seq_len,
                          grad_accum=work.grad_accum, max_grad_norm=work.max_grad_norm, padded=work.padded)
    return {"gpu": est.gpu_bytes / 2**30, "host": est.host_bytes_per_host(work.ranks_per_host) / 2**30,
            "gpu_free": (free or 0) / 2**30}


def measure(spec: MeasureSpec) -> dict:
    rt = RuntimeConfig(**spec.runtime)
    ranks, device = start_ranks(spec, rt)
    try:
        return _measure(spec, rt, ranks, device)
    finally:
        ranks.close()


def _measure(spec: MeasureSpec, rt: RuntimeConfig, ranks: Ranks, device: Device) -> dict:
    wl = spec.workload
    # the process's host memory by kind at its start, after the build and after the steps: a rank's
    # fixed cost (CUDA context, libraries, communicators) apart from the state (data parallel's
    # host RSS against one GPU's, NOTES.md "Data parallel")
    host_memory = {"start": host_memory_snapshot()}
    t0 = time.perf_counter()
    timer = EventTimer(device, enabled=spec.per_layer)
    estimates: list[dict[str, float]] = []      # the fit's, of the placement that runs (slide mode)
    # synthetic batches are full rows: never padded (no [B,1,S,S] masks); several ranks: placed
    # and checked as training does. The fit check refuses slide runs only: a plain baseline
    # that runs out of memory is measured as such.
    prepared = prepare_run(RunRequest(
        model=wl.model, runtime=rt, optim=AdamWConfig(lr=wl.lr), batch_size=wl.batch_size, seq_len=wl.seq_len,
        grad_accum=spec.grad_accum, max_grad_norm=spec.max_grad_norm, padded=False, num_layers=wl.num_layers,
        seed=wl.seed, with_tokenizer=False, gpu_memory_limit_gib=wl.gpu_memory_limit_gib,
        check_memory=spec.check_memory and rt.mode == "slide", refusal_as_result=True,
        objective=spec.preference), device, ranks, timer=timer,
        on_placed=lambda placed: estimates.append(fit_estimate(placed, device)) if placed.plan is not None else None)
    rt, loaded, engine = prepared.runtime, prepared.loaded, prepared.engine
    if prepared.refusal is not None:
        return {"spec": spec.to_dict(), "machine": machine_info(), "runtime": rt.to_flat(),
                "status": "refused", "error": prepared.refusal}
    init_s = time.perf_counter() - t0
    host_memory["built"] = host_memory_snapshot()
    timeline = engine.timeline
    if timeline is not None:
        timeline.enabled = True
    memory = engine.memory
    if memory is not None:
        memory.enabled = True
    split = loaded.split
    result = _result_head(spec, rt, engine, split, device, init_s)
    if estimates:
        result["fit_estimate_gib"] = estimates[0]
    warmup = disk_tier_warmup(wl.warmup, engine)
    if warmup != wl.warmup:
        result["warmup_raised"] = {"asked": wl.warmup, "used": warmup, "why": DISK_WARMUP_WHY}
    gc_pauses = GCPauses()               # Python's collections inside each step (a stall the GPU sees)
    try:
        raw, alloc_before, disk_io = _run_steps(spec, engine, split.config.vocab_size, ranks, device, timer, timeline, memory,
                                  gc_pauses, warmup)
        last_measured = warmup + wl.steps - 1 if wl.steps > 0 else -1
        steps = _step_records(raw, alloc_before, result, timer, timeline, warmup, last_measured)
        engine.synchronize()
        _record_peaks(result, engine, device, host_memory, disk_io, warmup)
        if spec.preference is not None and spec.preference.needs_reference:
            # after the peaks: they stay the training step's
            result.update(reference_pass(spec, engine, split.config.vocab_size, ranks, device))
        if spec.profile:
            result["trace_summary"] = _profile(engine, split.config.vocab_size, spec)
        _summarize_steps(result, steps, spec, ranks, split)
        result["steps"] = steps
        if ranks.world_size > 1:
            result.update(rank_summary(ranks, result, engine.shared.nbytes if engine.shared is not None else 0))
        else:
            result.update(world_size=1, host_rss_gib=result["cpu_peak_rss_gib"])
        result["status"] = "ok"
    except torch.OutOfMemoryError as e:
        result.update(status="oom", error=str(e).splitlines()[0],
                      gpu_peak_alloc_gib=device.max_memory_allocated() / 2**30)
    finally:
        gc_pauses.close()
        engine.close()
    return result


def _result_head(spec: MeasureSpec, rt: RuntimeConfig, engine, split, device: Device, init_s: float) -> dict:
    """The result's first keys: the spec, the machine, the runtime as the engine resolved it."""
    runtime = rt.to_flat()
    if engine.resident_layers is not None:
        # the layers with a slot of their own as the engine resolved them (auto left unresolved
        # means none; a window that would hold every other layer makes them all resident)
        runtime["resident_layers"] = engine.resident_layers
    return {"spec": spec.to_dict(), "machine": machine_info(), "init_s": init_s, "runtime": runtime,
            "cuda_context_waits": device.context_waits,
            # resolved where the runtime left them on auto (host_threads=0)
            "host_threads": engine.host_threads,
            "device_layers": engine.device_layers,
            "params": split.num_params(), "num_layers": split.num_layers}


def _run_steps(spec: MeasureSpec, engine, vocab: int, ranks: Ranks, device: Device, timer: EventTimer, timeline,
               memory, gc_pauses: GCPauses, warmup: int) -> tuple[list, dict, list[int]]:
    """Run the warm-up and measured steps with nothing but the engine between two calls; returns each
    step's raw record (times, result, pending GPU events, host spans, memory points, allocator
    counters, GC pauses), resolved after the loop; the allocator counters before the first step; and
    the disk tier's bytes moved at each return."""
    wl = spec.workload
    total_steps = warmup + wl.steps
    # All batches before the loop: making synthetic data is not the engine's time.
    # (each rank its own rows)
    data = [synthetic_batches(vocab, wl.batch_size, wl.seq_len, spec.grad_accum,
                              wl.seed * 1000 + k + 10**6 * ranks.rank, spec.preference) for k in range(total_steps)]
    # A step's time is the interval from the previous step's return to this one's: train_step
    # returns once the step's work is issued, while the GPU tail and the host's D2H and AdamW go
    # on in the background, so the call's own duration ("call_s") under-reads the step, and any
    # pause between calls would hide work. Nothing but the engine runs between two calls.
    prev_end = None
    raw = []
    alloc_before = device.allocator_counters()
    disk = engine.disk
    disk_io = []            # the tier's bytes read + written at each step's return
    for k in range(total_steps):
        if k == warmup:
            device.synchronize()
            device.reset_peak()
            timer.anchor()             # one synchronize, before the measured steps
        t = time.perf_counter()
        res = engine.train_step(data[k], wl.lr)
        t_end = time.perf_counter()
        start = t if prev_end is None else prev_end
        prev_end = t_end
        raw.append((k, start, t, t_end, res, timer.cut(),      # resolved after the loop: no GPU wait here
                    timeline.take() if timeline is not None else [],
                    memory.take() if memory is not None else [],
                    device.allocator_counters(), gc_pauses.take()))
        if disk is not None:
            disk_io.append(disk.bytes_read + disk.bytes_written)
    return raw, alloc_before, disk_io


def _step_records(raw: list, alloc_before: dict, result: dict, timer: EventTimer, timeline, warmup: int,
                  last_measured: int) -> list[dict]:
    """Each step's record from its raw one (GPU spans resolved now, allocator counters differenced);
    puts the last measured step's Gantt chart in `result["step_timeline"]`."""
    before = alloc_before
    steps = []
    prev_spans: list = []
    for k, start, t, t_end, res, pending, host_spans, mem_points, alloc, gcs in raw:
        # allocator events of this step (cumulative counters differenced), and GC pauses
        alloc_step = {key: v - before.get(key, 0) for key, v in alloc.items()}
        before = alloc
        spans = timer.resolve(pending)
        # train_step returns once its head's loss is out, with its backward still queued on
        # the GPU: the first part of the next interval is that backward. What the GPU does in
        # [start, t_end] is this step's spans and the previous step's (both clipped to it).
        in_interval = prev_spans + spans
        prev_spans = spans
        if k == last_measured and (host_spans or spans):
            # the last measured step, every thread and the GPU on one clock (a Gantt chart)
            result["step_timeline"] = {"step": k, "step_ms": (t_end - start) * 1e3,
                                       "rows": step_timeline(in_interval, host_spans, start, t_end)}
        host, overlap = {}, {}
        if timeline is not None:
            from ..telemetry.host_timeline import overlap_report, summarize
            host = summarize(host_spans, start, t_end)
            gpu = [(s.start_s, s.end_s) for s in in_interval if s.start_s is not None]
            if gpu:
                overlap = overlap_report(gpu, host_spans, start, t_end)
        steps.append({"step": k, "warmup": k < warmup, "wall_s": t_end - start, "call_s": t_end - t,
                      "loss": res.loss,
                      "memory": [p.row() for p in mem_points],
                      "grad_norm": res.grad_norm(), "host_s": host, "overlap": overlap,
                      "alloc": alloc_step, "gc_s": sum(d for _, d in gcs),
                      "gc_gen2": sum(1 for gen, _ in gcs if gen == 2),
                      "spans": [(s.phase, s.layer, s.ms) for s in spans]})
    return steps


def _record_peaks(result: dict, engine, device: Device, host_memory: dict, disk_io: list[int], warmup: int) -> None:
    """The run's peak memory (GPU, host RSS, host by kind) and the disk tier's I/O a step."""
    result["gpu_peak_alloc_gib"] = device.max_memory_allocated() / 2**30
    result["gpu_peak_reserved_gib"] = device.max_memory_reserved() / 2**30
    result["cpu_peak_rss_gib"] = peak_rss_bytes() / 2**30
    result["host_memory"] = {**host_memory, "stepped": host_memory_snapshot()}
    result["engine_memory"] = engine.memory_report()
    if engine.disk is not None:
        # what the plan moves through the disk a step; over the step time, the rate the run got
        # (bench throughput's disk_gib_s), beside the probe's rate in its floor
        result["disk_io_bytes_per_step"] = engine.plan.disk_io_bytes()
        # ... and what the tier moved: each measured interval holds one sweep (the previous
        # step's), so the mean over them is a step's I/O; above the plan's, blocks were read
        # more than once (the 2026-11-25 14B run: 1.5x, a defect the tier's prefetch had)
        moved = [b - a for a, b in zip(disk_io, disk_io[1:])][warmup - 1:]
        if moved:
            result["disk_io_bytes_measured"] = sum(moved) / len(moved)


REFERENCE_REPEATS = 3       # timed passes over a step's pairs (after one untimed: its first allocations)


def reference_pass(spec: MeasureSpec, engine, vocab: int, ranks: Ranks, device: Device) -> dict:
    """A preference objective with a reference (dpo, ipo): the time of its reference pass over one
    step's pairs, measured on this engine. A run computes the reference's log-probabilities once
    before training, a forward-only pass over every pair (objectives/reference.py reference_logps);
    timed here as it runs there, over the step's micro-batches: each one's per-token losses
    (Engine.token_losses), brought to the host and summed per completion. Here the weights are those
    after the timed steps, not the initial ones: the same work, the same time.
    reference_s: seconds of the pass per step's pairs (mean of REFERENCE_REPEATS passes);
    reference_tokens_per_s: the step's tokens over it, every rank's as tokens_per_s counts them."""
    from ..objectives.preference import completion_sums
    wl = spec.workload
    batches = synthetic_batches(vocab, wl.batch_size, wl.seq_len, spec.grad_accum,
                                wl.seed * 1000 + 500_000 + 10**6 * ranks.rank, spec.preference)
    engine.synchronize()                  # the last step's updates done: the pass starts on an idle engine
    timer_enabled = engine.timer.enabled
    engine.timer.enabled = False          # the bare pass, as a run's (no per-layer events)
    times = []
    try:
        for k in range(REFERENCE_REPEATS + 1):
            device.synchronize()
            t = time.perf_counter()
            for b in batches:
                rows = engine.token_losses(b).float().cpu()          # [B * S]; .cpu() waits for the GPU
                completion_sums(rows, b.pairs, b.input_ids.shape[0])
            device.synchronize()
            if k:                         # the first pass allocates the forward's buffers: untimed
                times.append(time.perf_counter() - t)
    except torch.OutOfMemoryError as e:   # the pass's own failure: the steps' measurement stands
        return {"reference_error": str(e).splitlines()[0]}
    finally:
        engine.timer.enabled = timer_enabled
    mean = sum(times) / len(times)
    tokens = wl.batch_size * wl.seq_len * spec.grad_accum * ranks.world_size
    return {"reference_s": mean, "reference_s_repeats": times, "reference_tokens_per_s": tokens / mean}


def _summarize_steps(result: dict, steps: list[dict], spec: MeasureSpec, ranks: Ranks, split) -> None:
    """The measured steps' means: step time, tokens/s, model TFLOPS, host phases and overlap."""
    wl = spec.workload
    kept = [s for s in steps if not s["warmup"]]
    measured = [s["wall_s"] for s in kept]
    tokens = wl.batch_size * wl.seq_len * spec.grad_accum * ranks.world_size     # every rank's
    result["tokens_per_step"] = tokens
    result["flops_per_token"] = train_flops_per_token(split, wl.seq_len)
    ov = [s["overlap"] for s in kept if s.get("overlap")]
    if ov:
        result["overlap_mean"] = _mean_by_key(ov)
    if measured:
        import statistics
        result["call_s_mean"] = statistics.mean(s["call_s"] for s in kept)
        result["host_s_mean"] = _mean_by_key([s["host_s"] for s in kept])
        mean = statistics.mean(measured)
        result["step_s_mean"] = mean
        result["step_s_std"] = statistics.stdev(measured) if len(measured) > 1 else 0.0
        result["tokens_per_s"] = tokens / mean
        result["tokens_per_s_per_gpu"] = tokens / mean / ranks.world_size
        result["model_tflops"] = tokens * result["flops_per_token"] / mean / 1e12


def _profile(engine, vocab: int, spec: MeasureSpec) -> dict:
    from torch.profiler import ProfilerActivity, profile, record_function
    from ..telemetry.trace_summary import lanes, stream_stats, summarize_trace
    wl = spec.workload
    mbs_list = [synthetic_batches(vocab, wl.batch_size, wl.seq_len, spec.grad_accum, 99_000 + k, spec.preference)
                for k in range(3)]
    timer_enabled = engine.timer.enabled
    engine.timer.enabled = False         # profile the bare pipeline
    kwargs = {}
    try:   # record the worker threads' ranges too (slidetune.adamw, slidetune.cast); torch >= 2.7
        from torch._C._profiler import _ExperimentalConfig
        kwargs["experimental_config"] = _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):
        pass
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, **kwargs) as prof:
        for mbs in mbs_list:
            with record_function("slidetune.step"):
                engine.train_step(mbs, wl.lr)
        engine.synchronize()
    engine.timer.enabled = timer_enabled
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        summary = summarize_trace(path)
        summary["streams"] = stream_stats(path)
        summary["lanes"] = lanes(path, step_index=1)     # the middle of the three profiled steps
    return summary


def main(argv: list[str] | None = None) -> int:
    from .baselines.proc import worker_main
    return worker_main(lambda spec: measure(MeasureSpec.from_dict(spec)), argv)


if __name__ == "__main__":
    sys.exit(main())
