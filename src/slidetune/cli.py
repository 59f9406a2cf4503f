"""`slidetune train | plan | eval | bench | report` command line.

Expected failures (bad data, unknown model, a configuration that does not fit, a failed
save, a non-finite loss, ...) print `slidetune: error: <what and where>` and exit with
status 2; an interrupted run exits with 130. Set SLIDETUNE_TRACEBACK=1 to get the
traceback as well. Output into a pipe whose reader has gone (`slidetune ... | head`) ends
the command quietly with status 141, as SIGPIPE ends a Unix tool.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import select
import signal
import sys
from pathlib import Path

from .config import ConfigArgumentParser, add_config_flags, config_from_args


def _train(ns) -> int:
    cfg = config_from_args(ns)
    if ns.gpus is not None:
        from .parallel import launch
        launch.check_gpus(ns.gpus, cfg.runtime.device,
                          launch.visible_gpus() if cfg.runtime.device != "cpu" else 0)
        if ns.gpus > 1:
            launch.relaunch(ns.gpus, ns.argv)          # does not return
    from .trainer import train
    # several ranks: rank 0 alone prints the run's progress (errors still come from every rank)
    quiet = _rank()[0] > 0
    with open(os.devnull, "w") if quiet else contextlib.nullcontext(sys.stdout) as out, \
            contextlib.redirect_stdout(out):
        summary = train(cfg, verbose=ns.verbose)
        print(json.dumps(summary.__dict__, indent=2) if ns.verbose else _summary_line(summary))
    return 130 if summary.interrupted else 0


def _summary_line(summary) -> str:
    """The end of a run in one line (summary.json holds all of it)."""
    minutes, seconds = divmod(round(summary.wall_s), 60)
    held_out = (f"; held-out perplexity {summary.ppl_before:.2f} -> {summary.ppl_after:.2f}"
                if summary.ppl_before is not None and summary.ppl_after is not None else "")
    return (f"{'stopped' if summary.interrupted or summary.stopped_early else 'done'}: {summary.steps} steps in "
            f"{minutes}:{seconds:02d}{held_out}; {summary.output_dir}/ holds metrics.csv, loss.png, summary.json"
            + ("" if summary.interrupted or summary.stopped_early else " and final/"))


def _rank() -> tuple[int, int]:
    """(rank, world size) from torchrun's environment; (0, 1) for a single process."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _plan(ns) -> int:
    """Print the memory estimate of a configuration and the verdict (fits, or does not with the options
    that do) for this machine or the one the flags describe, allocating nothing."""
    from .models.load import load_model
    if ns.card is not None:
        if ns.gpu_free_gib is not None:
            raise ValueError("give --card NAME or --gpu-free-gib GIB, not both: the card's memory is its GPU's")
        ns.gpu_free_gib = ns.card.memory_gib     # the placement the card would get
    cfg, on_gpu = _plan_config(ns)
    loaded = load_model(cfg.model, num_layers=cfg.num_layers, with_tokenizer=False)
    estimate = _plan_estimator(cfg, loaded.split, ranks=max(1, ns.gpus))
    est = estimate()
    _print_estimate(cfg, loaded.split, est, on_gpu)
    # --terms probes first: the auto settings then choose between placements at this machine's rates
    fl = _probe_floor(cfg, ns.card) if ns.terms and cfg.runtime.mode == "slide" else None
    plan, choice = _plan_resolved(ns, cfg, loaded.split, _plan_rates(fl, ns.card))
    if cfg.runtime.mode != "slide":
        return 0
    plan = plan or est.plan         # no GPU described: the placement of the settings as given
    if ns.terms:
        _plan_terms(cfg, loaded.split, plan, ns.card, fl, choice)
        if ns.gpus > 1:
            print(f"(the terms above are one rank's; under {ns.gpus} ranks the gradient all-reduce adds a term "
                  f"probed on {ns.gpus} GPUs: slidetune bench throughput --gpus 1,{ns.gpus})")
    if not on_gpu:
        return 0
    _print_auto_hints(cfg, loaded.split, estimate)
    return 0


def _plan_config(ns):
    """(config, on_gpu): the configuration of the flags with its dtype and device resolved for the
    device planned for: a GPU (this machine's, or one described by --gpu-free-gib or
    --gpu-memory-limit), else the CPU. Prints how an auto dtype was chosen."""
    import dataclasses

    import torch

    from .device import resolve_dtype
    cfg = config_from_args(ns)
    on_gpu = cfg.runtime.device.startswith("cuda") or (cfg.runtime.device == "auto" and (
        ns.gpu_free_gib is not None or cfg.gpu_memory_limit is not None or torch.cuda.is_available()))
    dtype, why = resolve_dtype(cfg.runtime.dtype, "cuda" if on_gpu else "cpu")
    if cfg.runtime.dtype == "auto":
        print(f"dtype auto -> {dtype}: {why}")
    cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(
        cfg.runtime, dtype=dtype, device=cfg.runtime.device if cfg.runtime.device != "auto" else
        ("cuda" if on_gpu else "cpu")))
    return cfg, on_gpu


def _plan_estimator(cfg, split, ranks: int = 1):
    """estimate(**changes): the estimate of this configuration with some runtime settings changed
    (one of `ranks` data-parallel ranks on the host)."""
    import dataclasses

    from .engine.fit import estimate_memory

    def estimate(**changes):
        """The estimate of this configuration with some runtime settings changed (the GPU's hints:
        without disk units, which a GPU holding more layers may leave no room for)."""
        if "device_layers" in changes:
            changes.setdefault("disk_units", 0)
        # as train: packed rows and preference pairs carry no padding mask; a pair is two rows
        return estimate_memory(split, dataclasses.replace(cfg.runtime, **changes), batch_size=cfg.rows_per_micro_batch,
                               seq_len=cfg.data.seq_len, grad_accum=cfg.grad_accum, max_grad_norm=cfg.max_grad_norm,
                               padded=cfg.padded_rows, ranks_per_host=ranks)
    return estimate


def _print_estimate(cfg, split, est, on_gpu: bool) -> None:
    """The model's size and the estimate's device and host bytes, part by part (and a MoE note)."""
    from .models.families import moe_note
    gib = 2**30
    print(f"model {cfg.model}: {split.num_params() / 1e9:.3f} B parameters, mode {cfg.runtime.mode}")
    # on the CPU the device's buffers are host RAM too (the verdict below counts them there)
    print(f"{'GPU ' if on_gpu else 'device buffers (host RAM on the CPU)'} {est.gpu_bytes / gib:8.2f} GiB")
    for k, v in est.gpu_parts.items():
        print(f"   {k:<28} {v / gib:8.2f}")
    print(f"host {est.host_bytes / gib:8.2f} GiB (pinned {est.pinned_bytes / gib:.2f})")
    for k, v in est.host_parts.items():
        print(f"   {k:<28} {v / gib:8.2f}")
    note = moe_note(split.config, split.units[1].numel if split.num_layers else 0, bytes_per_param=2)
    if note:
        print(note)


def _print_auto_hints(cfg, split, estimate) -> None:
    """For each runtime setting left on auto, what the GPU would need for the faster choice."""
    from .engine.fit import free_memory_needed
    from .engine.placement import AUTO_WINDOW, cache_unit_options
    gib = 2**30
    # the slot choices engine.fit.choose_auto_settings tries for cache_units
    cache_options = cache_unit_options(cfg.runtime.placement.cache_units)
    if cfg.runtime.placement.cache_units == -1:
        resident = estimate(cache_units=0)
        print(f"cache_units auto: the estimate above is the {AUTO_WINDOW}-slot window; on a GPU with at least "
              f"{free_memory_needed(resident.gpu_bytes) / gib:.1f} GiB free every layer stays resident "
              f"(GPU {resident.gpu_bytes / gib:.2f} GiB; faster: the forward no longer waits on PCIe)")
    if cfg.runtime.transfer.grad_slot_dtype == "auto" and cfg.runtime.transfer.grad_download == "compute":
        print("grad_slot_dtype auto: compute (gradients cross PCIe in the compute dtype and the host's AdamW "
              "widens them, grad_download=compute)")
    elif cfg.runtime.transfer.grad_slot_dtype == "auto":
        for cache_units in cache_options:
            fp32 = estimate(cache_units=cache_units, grad_slot_dtype="fp32")
            print(f"grad_slot_dtype auto: with cache_units {cache_units}, FP32 gradient slots need a GPU with "
                  f"{free_memory_needed(fp32.gpu_bytes) / gib:.1f} GiB free (GPU {fp32.gpu_bytes / gib:.2f} GiB; the gradient "
                  f"copies then need no cast kernel); below that the slots keep the compute dtype")
    if cfg.runtime.placement.device_layers == -1:
        one = estimate(device_layers=1).gpu_bytes - estimate(device_layers=0).gpu_bytes
        every = estimate(device_layers=split.num_layers).gpu_bytes
        print(f"device_layers auto: each layer kept and updated on the GPU adds about {one / gib:.2f} GiB "
              f"to the estimate above and takes its share off the host's AdamW; all "
              f"{split.num_layers} need a GPU with {free_memory_needed(every) / gib:.1f} GiB free")
    if cfg.runtime.offloads_activations and cfg.runtime.placement.gpu_checkpoints == -1:
        one = estimate(gpu_checkpoints=1).host_bytes - estimate(gpu_checkpoints=0).host_bytes
        print(f"gpu_checkpoints auto: the estimate above offloads every checkpoint; each one kept on the GPU "
              f"moves {-one / gib:.2f} GiB from pinned host RAM to the GPU (as many as fit after device_layers, "
              f"or before them where host RAM is what does not fit)")
    if cfg.runtime.placement.vocab_update == "auto":
        for cache_units in cache_options:
            dev = estimate(cache_units=cache_units, vocab_update="device")
            print(f"vocab_update auto: with cache_units {cache_units}, the embedding and head are updated on "
                  f"the GPU on one with {free_memory_needed(dev.gpu_bytes) / gib:.1f} GiB free (GPU {dev.gpu_bytes / gib:.2f} "
                  f"GiB; less host AdamW per step); below that on the host")


def _probe_floor(cfg, card=None) -> dict:
    """The floor's probes on this machine (bench.scenarios.roofline.measure_floor: GPU compute of both
    layer kinds, PCIe copies, host AdamW, the disk tier's directory where units may go there; with a
    --card, the GEMM rate its compute is scaled by)."""
    from .bench.scenarios.roofline import measure_floor
    import torch
    rt = cfg.runtime
    disk = rt.disk_dir if rt.disk_dir and rt.disk.disk_units != 0 else None
    print("probing this machine for the floor's terms (GPU compute, PCIe copies, host AdamW"
          + (", disk" if disk else "") + "; about a minute) ...", flush=True)
    on_gpu = rt.device != "cpu" and torch.cuda.is_available()
    return measure_floor(cfg.model, cfg.rows_per_micro_batch, cfg.data.seq_len, cfg.num_layers, rt.device,
                         adamw_n=128 * 2**20 if on_gpu else 16 * 2**20,     # the CPU machine's probe: small and quick
                         compile_layers=rt.compile_layers != "off", grad_download=rt.transfer.grad_download,
                         host_adamw=rt.host.host_adamw, disk_dir=disk, disk_block_mb=rt.disk.disk_block_mb,
                         disk_io_threads=rt.disk.disk_io_threads, moments=rt.moments, master=rt.master,
                         gemm=card is not None, progress=True)


def _plan_rates(fl: dict | None, card=None):
    """The rates the auto settings' step model takes (bench/step_model.py): the probed ones where
    --terms probed, else the nominal ones; scaled to --card's link and BF16 rate."""
    from .bench.step_model import NOMINAL_RATES, rates_for_card, rates_from_floor
    rates = rates_from_floor(fl) if fl is not None else NOMINAL_RATES
    return rates_for_card(card, rates) if card is not None else rates


def _plan_terms(cfg, split, plan, card=None, fl: dict | None = None, choice=None) -> None:
    """The floor's terms for this placement, each probed on this machine (bench.roofline; fl:
    _probe_floor's result): the seconds a step each resource needs at best, and the largest of them,
    the floor; then the placements the auto settings weighed against it (choice:
    engine.fit.choose_placement's). card (bench/cards.py): the same terms predicted for that card in
    this machine, beside them."""
    from .bench.step_model import StepModel, rates_from_floor
    from .engine.tiers import TIERS
    rt = choice.chosen if choice is not None and choice.pick is not None else cfg.runtime
    if fl.get("status") != "ok":
        print(f"the probes failed: {fl.get('error', fl)}")
        return
    files = TIERS.with_files
    disk = files.probe_of(fl)
    if fl.get("partial"):       # no GPU here: the host's terms only
        terms = {"adamw_s": plan.host_updated_params / fl["adamw"]["adamw_params_per_s"]}
        if disk and plan.params(files):
            terms["disk_s"] = files.io_seconds(plan, disk)
    else:
        # the step model's terms at the probed rates: the layer kind the placement runs, the
        # offloaded checkpoints' traffic, every micro-batch
        model = StepModel(split, batch_size=cfg.rows_per_micro_batch, seq_len=cfg.data.seq_len,
                          grad_accum=cfg.grad_accum, rates=rates_from_floor(fl))
        terms = model.predict(rt, plan).terms
    def count(n: int) -> str:
        return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.1f} M"

    what = {"compute_s": "GPU: every layer's forward, recompute and backward, head, GPU-updated units' AdamW",
            "h2d_s": f"PCIe H2D: {count(plan.upload_params())} params of BF16 weights uploaded"
                     + (f", {plan.num_layers - plan.gpu_checkpoints} offloaded checkpoints back"
                        if plan.gpu_checkpoints < plan.num_layers else ""),
            "d2h_s": f"PCIe D2H: BF16 gradients of {count(plan.host_updated_params)} host-updated params"
                     + (f", {plan.num_layers - plan.gpu_checkpoints} checkpoints offloaded"
                        if plan.gpu_checkpoints < plan.num_layers else ""),
            "adamw_s": f"host AdamW over {count(plan.host_updated_params)} params",
            "disk_s": (f"disk: moments of {count(plan.params(files))} params read and written "
                       f"({2 * plan.host_state.moment_bytes:g} B/param)"
                       + (f", masters of {count(plan.master_params(files))} of them too "
                          f"(+{2 * plan.host_state.master_bytes} B/param)"
                          if plan.master_params(files) else "")),
            "host_dram_s": "host DRAM: AdamW's passes, the uploads' reads, the gradients' and checkpoints' DMA",
            "clip_sweep_s": "clipped: the backward, then the update sweep the next forward waits for"}
    print("floor terms (seconds a step, from this machine's probes):")
    for k, v in terms.items():
        print(f"   {k:<13} {v:8.3f}   {what.get(k, '')}")
    if disk:
        print(f"   (disk probe: read {disk['read_gib_s']:.2f}, write {disk['write_gib_s']:.2f}, "
              f"both at once {disk['mixed_gib_s']:.2f} GiB/s, {'O_DIRECT' if disk['direct_io'] else 'buffered'})")
    bound = max(terms, key=terms.get)
    tokens = cfg.rows_per_micro_batch * cfg.grad_accum * cfg.data.seq_len
    if terms[bound] <= 0:       # no GPU here and nothing updated on the host: no term to bound a step
        print("floor: no term this machine can price (every unit is updated on the GPU, whose terms need a GPU's probes)")
    else:
        print(f"floor {terms[bound]:.3f} s a step (bound by {bound}): at best {tokens / terms[bound]:,.0f} tokens/s"
              + (" (host terms only: no GPU here)" if fl.get("partial") else ""))
    preference = cfg.preference()
    if preference is not None and preference.needs_reference and not fl.get("partial"):
        _print_reference_terms(cfg, fl, plan)
    if card is not None:
        _print_card_terms(cfg, fl, plan, card, terms)
    if choice is not None:
        print("the auto settings' choice by predicted step (bench/step_model.py; engine/fit/choice.py):")
        print("\n".join(choice.table_lines()))


def _print_card_terms(cfg, fl: dict, plan, card, terms: dict) -> None:
    """The floor's terms predicted for `card` (bench/cards.py) beside this machine's, for the card's
    placement (plan --card plans for its memory): compute scaled by the GEMM rates, the copies at
    the card's link, the host's terms as probed here."""
    from .bench.cards import card_probes
    from .bench.roofline import floor_terms
    from .engine.tiers import TIERS
    rt = cfg.runtime
    what = (f"{card.name} ({card.memory_gib:g} GiB, PCIe {card.pcie_gb_s:g} GB/s each way, "
            f"{card.bf16_tflops:g} dense BF16 TFLOP/s)")
    if fl.get("partial"):
        print(f"{what}: the placement above is the card's, and so are the host terms above (the same host); "
              f"its compute_s, h2d_s and d2h_s cannot be predicted here: they scale a GPU's probes and this "
              f"machine has none")
        return
    comp, copy = card_probes(fl["compute"], fl["copy"], fl.get("gemm"), card)
    predicted = floor_terms(comp, copy, fl["adamw"], plan, device_adamw=fl.get("device_adamw"),
                            disk=TIERS.with_files.probe_of(fl), split_sweep=rt.clip.clip_sweep != "whole")
    gemm = fl["gemm"]["gemm_tflops"]
    print(f"on {what}: compute x {gemm:.0f} / {card.bf16_tflops:g} (this GPU's probed BF16 GEMM TFLOP/s over the "
          f"card's), copies x {fl['copy']['h2d_gib_s']:.1f} / {card.pcie_gib_s:.1f} and "
          f"{fl['copy']['d2h_gib_s']:.1f} / {card.pcie_gib_s:.1f} GiB/s, host terms as probed here:")
    print(f"   {'term':<13} {'here':>8} {card.name:>8}")
    for k, v in predicted.items():
        print(f"   {k:<13} {terms.get(k, float('nan')):8.3f} {v:8.3f}")
    tokens = cfg.rows_per_micro_batch * cfg.grad_accum * cfg.data.seq_len
    here, there = max(terms.values()), max(predicted.values())
    print(f"floor {here:.3f} s a step here ({tokens / here:,.0f} tokens/s), {there:.3f} s on {card.name} "
          f"(bound by {max(predicted, key=predicted.get)}): at best {tokens / there:,.0f} tokens/s")


def _print_reference_terms(cfg, fl: dict, plan) -> None:
    """The reference pass's floor (bench/reference_floor.py): a batch's terms and the pass over N pairs."""
    from .bench.reference_floor import reference_pass_terms
    ref = reference_pass_terms(fl["compute"], fl["copy"], plan)
    batch_s = max(ref.values())
    print(f"reference pass ({cfg.objective}, once before step 1, cached): a forward over each batch of "
          f"{cfg.batch_size} pairs: compute {ref['compute_s']:.3f} s, PCIe H2D {ref['h2d_s']:.3f} s; at best "
          f"{batch_s:.3f} s a batch, {batch_s / cfg.batch_size * 1000:.1f} s per 1,000 pairs")


def _plan_resolved(ns, cfg, split, rates=None):
    """The verdict: what the auto settings resolve to on the machine planned for (as train would
    resolve them there: a GPU, this machine's or one described by --gpu-free-gib, or the CPU), the
    estimate of that placement, its predicted step (`rates`: bench.step_model's, default nominal),
    and whether check_fit lets it run ("fits", or "does not fit" with the options that do).
    Returns (that placement plan, engine.fit.choose_placement's choice); (None, None) outside slide
    mode or without a GPU described."""
    import torch

    from .engine.autos import describe_autos
    from .engine.distributed import SharedMemoryError
    from .engine.limits import MachineBudget
    from .engine.slide.disk_tier import DiskTierError
    from .engine.fit import FIT_SAFETY, InsufficientMemoryError, check_fit, choose_placement, estimate_memory
    from .engine.fit import query_gpu_free_bytes, query_host_available_bytes, shared_state_bytes
    from .engine.tiers import TIERS
    gib = 2**30
    rt = cfg.runtime
    on_gpu = rt.device.startswith("cuda")
    limit = int(cfg.gpu_memory_limit * gib) if cfg.gpu_memory_limit is not None and on_gpu else None
    if on_gpu and ns.gpu_free_gib is None and limit is None and not torch.cuda.is_available():
        print("no GPU here to plan for: pass --gpu-free-gib GIB (and --host-gib GIB) to see what the auto settings "
              "resolve to on such a GPU and host, and whether it fits")
        return None, None
    free = int(ns.gpu_free_gib * gib) if ns.gpu_free_gib is not None and on_gpu else None
    if limit is not None:
        # --gpu-memory-limit caps the GPU planned for, as train caps its own (the GPU described, this
        # machine's, or without either a GPU of that size)
        here = free if free is not None else query_gpu_free_bytes(rt) if torch.cuda.is_available() else limit
        free = min(here, limit)
    host = int(ns.host_gib * gib) if ns.host_gib is not None else query_host_available_bytes()
    kw = dict(batch_size=cfg.rows_per_micro_batch, seq_len=cfg.data.seq_len, grad_accum=cfg.grad_accum,
              max_grad_norm=cfg.max_grad_norm, padded=cfg.padded_rows)
    ranks = max(1, ns.gpus)
    choice = choose_placement(split, rt, gpu_free_bytes=free, host_available_bytes=host, ranks_per_host=ranks,
                              rates=rates, **kw)
    resolved = choice.chosen
    est = estimate_memory(split, resolved, ranks_per_host=ranks, **kw)
    if not on_gpu:
        where = "the CPU (no GPU: weights, activations and optimizer state all in host RAM)"
    else:
        where = f"a GPU with {free / gib:.1f} GiB free" if free is not None else "this machine's GPU"
        if limit is not None:
            where += f" (--gpu-memory-limit {cfg.gpu_memory_limit:g})"
    if ranks > 1:
        where = f"{ranks} ranks on one host, each on {where}"
    plan = est.plan
    host_words = (f"host {est.host_bytes_per_host(ranks) / gib:.2f} GiB for its {ranks} ranks (the shared state, "
                  f"{shared_state_bytes(plan) / gib:.2f} GiB in /dev/shm, once)" if ranks > 1 and plan is not None
                  else f"host {est.host_bytes / gib:.2f} GiB")
    settings = _resolved_settings(resolved, plan, est.schedule, on_gpu)
    print(f"resolved on {where} and {host / gib:.1f} GiB of host RAM{': ' + settings if settings else ''}: "
          + (f"GPU {est.gpu_bytes / gib:.2f} GiB{' per rank' if ranks > 1 else ''}, " if on_gpu else "") + host_words
          + (f", disk tier {est.disk_bytes / gib:.2f} GiB" if est.disk_bytes else ""))
    # why each auto setting resolved as it did: the lines `slidetune train` prints before its run
    for line in describe_autos(rt, resolved, plan, gpu_lines=on_gpu):
        print(f"  {line}")
    shm = int(ns.shm_gib * gib) if ns.shm_gib is not None else None
    disk = int(ns.disk_free_gib * gib) if ns.disk_free_gib is not None else None
    try:
        check_fit(split, resolved, gpu_free_bytes=free, host_available_bytes=host, ranks_per_host=ranks,
                  shm_free_bytes=shm, disk_free_bytes=disk, **kw)
        print(f"fits ({FIT_SAFETY:.0%} of each)" if on_gpu else f"fits ({FIT_SAFETY:.0%} of the host's RAM)")
        if on_gpu and choice.summary_line():
            print(choice.summary_line())      # the predicted step, and how many other placements fit
    except (InsufficientMemoryError, SharedMemoryError, DiskTierError) as e:
        print(f"does not fit: {str(e).removeprefix('slidetune: ')}")
    # the placement is the GPU's (slots, uploads); on the CPU only where the disk tier takes units
    if plan is not None and (on_gpu or plan.indices(TIERS.with_files)):
        print("placement:\n" + "\n".join(plan.summary_lines()))
    if not ns.no_limits:
        budget = MachineBudget.resolved(rt, gpu_free_bytes=free, host_available_bytes=host, disk_free_bytes=disk,
                                        shm_free_bytes=shm, ranks_per_host=ranks)
        _plan_limits(cfg, split, budget)
    return plan, choice


def _resolved_settings(resolved, plan, schedule: str, on_gpu: bool) -> str:
    """The auto settings as `plan` resolved them, in one line of NAME=value (empty outside slide mode)."""
    from .engine.tiers import TIERS
    settings = ""
    if plan is not None and on_gpu:
        settings = (f"cache_units={resolved.placement.cache_units} "
                    + (f"resident_layers={plan.resident_layers} " if resolved.placement.cache_units else "")
                    + f"vocab_update={resolved.placement.vocab_update} "
                    + f"grad_slot_dtype={resolved.transfer.grad_slot_dtype} "
                    f"device_layers={plan.device_layers}"
                    + (f" shard_layers={plan.shard_layers}" if plan.shard_layers else "")
                    + f" offload_activations={resolved.offload_activations}"
                    + (f" gpu_checkpoints={plan.gpu_checkpoints}" if resolved.offloads_activations else "")
                    + f" lean_layer={resolved.layer.lean_layer} head_impl={resolved.resolved_head_impl}"
                    + (f" held_buffers={resolved.clip.held_buffers}" if schedule == "deferred" else ""))
    if plan is not None and resolved.disk_dir:
        settings += f" disk_units={len(plan.indices(TIERS.with_files))} disk_master={resolved.disk.disk_master}"
    return settings.strip()


def _plan_limits(cfg, split, budget) -> None:
    """The largest batch at the run's sequence and the longest sequence at batch 1 that fit the machine
    planned for, with and without clipping (engine.limits: each size resolved and checked as above)."""
    from .engine.limits import find_limits, limit_words
    if cfg.objective != "sft":
        # the limits search sizes in sequences at batch 1; a pair is two sequences that stay together
        print(f"limits: not searched for --objective {cfg.objective} (a pair is two sequences; the verdict above "
              f"is for {cfg.batch_size} pairs = {cfg.rows_per_micro_batch} sequences a micro-batch)")
        return
    limits = find_limits(split, cfg.runtime, budget, seq_len=cfg.data.seq_len, batch_size=cfg.batch_size,
                         grad_accum=cfg.grad_accum, max_grad_norm=cfg.max_grad_norm, padded=not cfg.data.packed)
    if not limits.recipes:
        return
    batch = "micro-batch" if cfg.grad_accum > 1 else "batch"
    rows = [(f"largest {batch} at seq {limits.seq_len:,}:", lambda r: r.largest_batch),
            ("longest sequence at batch 1:", lambda r: r.longest_seq)]
    title_width = max(len(title) for title, _ in rows)
    name_width = max(len(r.recipe.name) for r in limits.recipes)
    print("limits (each size's auto settings resolved and checked as above; --no-limits skips this):")
    for title, pick in rows:
        for i, r in enumerate(limits.recipes):
            print(f"  {title if i == 0 else '':<{title_width}} {r.recipe.name:<{name_width}} -> {limit_words(pick(r))}")
    def host_binds(recipes) -> bool:
        return any("host RAM" in (lim.over.binds if lim.over else ())
                   for r in recipes for lim in (r.largest_batch, r.longest_seq))
    if host_binds(limits.recipes) and cfg.runtime.mode == "slide" and not cfg.runtime.disk_dir:
        print("  (where host RAM binds, the disk tier may go further: plan again with --disk-dir PATH on a local disk)")
    clipped = [r for r in limits.recipes if r.recipe.max_grad_norm]
    if host_binds(clipped) and cfg.runtime.mode == "slide" and cfg.runtime.clip.checkpoints_in_held == "off":
        # Llama-3.1-8B, 24 GiB GPU, 123 GiB host: the longest clipped sequence 69,632 -> 101,376 tokens
        print("  (clipped, where host RAM binds: --tuning.clip_sweep whole --tuning.checkpoints_in_held on keeps "
              "the offloaded checkpoints in the held gradient buffers, exactly; plan again with them)")


def _bench_runtime(ns) -> int:
    from pathlib import Path
    from .bench.runtime_check import run
    parts = tuple(ns.parts.split(","))
    checks = run(Path(ns.out), smoke=ns.smoke, big_model=ns.big_model, big_batch=ns.big_batch, parts=parts)
    print(json.dumps(checks, indent=1, default=float))
    return 0


def _bench_scenario(ns) -> int:
    out = ns.scenario_module.run(ns)
    print(f"results: {out}")
    return 0


def _eval(ns) -> int:
    from .evaluation.harness import HarnessRequest, parse_tasks, run_harness, summary_lines
    req = HarnessRequest(Path(ns.model), parse_tasks(ns.tasks), batch_size=ns.batch_size, limit=ns.limit,
                         device=ns.device, dtype=ns.dtype, output=Path(ns.output) if ns.output else None)
    for line in summary_lines(run_harness(req)):
        print(line)
    if req.output is not None:
        print(f"results: {req.output}")
    return 0


def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="run lm-evaluation-harness benchmarks on a saved model (a run's final/)",
                       description="lm-evaluation-harness (pip install 'slidetune[eval]') on a saved model "
                                   "directory: slidetune eval --model runs/x/final --tasks hellaswag,arc_easy")
    p.add_argument("--model", required=True, metavar="DIR", help="the model directory (config.json and safetensors "
                                                                 "weights: a run's final/)")
    p.add_argument("--tasks", required=True, help="comma list of lm-evaluation-harness tasks, e.g. hellaswag,arc_easy")
    p.add_argument("--batch-size", default="auto", help="rows per forward: a number or auto")
    p.add_argument("--limit", type=float, default=None,
                   help="examples per task (below 1: a fraction of each); default: all")
    p.add_argument("--device", default="auto", help="auto (cuda where available) | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (the saved dtype) | float32 | bfloat16 | float16")
    p.add_argument("--output", default=None, metavar="FILE", help="also write the results as JSON to FILE")
    p.set_defaults(func=_eval)


def _push(ns) -> int:
    from .checkpoint.push import PushRequest, push
    push(PushRequest(Path(ns.dir), ns.repo, private=ns.private, message=ns.message, dry_run=ns.dry_run))
    return 0


def _add_push(sub) -> None:
    p = sub.add_parser("push", help="upload a run's final/ to a model repository on the Hugging Face Hub",
                       description="slidetune push runs/x/final --repo org/name: the export checked against its "
                                   "manifest, then huggingface_hub's upload_folder (the token from HF_TOKEN or "
                                   "`hf auth login`)")
    p.add_argument("dir", metavar="DIR", help="the export: a run's final/")
    p.add_argument("--repo", required=True, metavar="ORG/NAME", help="the model repository (created if absent)")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument("--message", default="Upload a model fine-tuned with slidetune", help="the commit message")
    p.add_argument("--dry-run", action="store_true", help="check and list the files; upload nothing")
    p.set_defaults(func=_push)


def _report(ns) -> int:
    from .bench.report import main_report
    main_report(ns.dir, ns.compare_seeds)
    return 0


def _add_bench(sub) -> None:
    from .bench.scenarios import SCENARIO_HELP, SCENARIOS, scenario_module
    p_bench = sub.add_parser("bench", help="run a benchmark scenario (each configuration in its own process)")
    scen = p_bench.add_subparsers(dest="scenario", required=True)
    p_rt = scen.add_parser("runtime", help="the runtime's GPU acceptance checks (memory ratios, depth, 8B)")
    p_rt.add_argument("--out", default="benchmarks/results/runtime")
    p_rt.add_argument("--smoke", action="store_true", help="tiny sizes that run on the CPU in seconds")
    p_rt.add_argument("--parts", default="memory,big", help="comma list of memory, slide, big")
    p_rt.add_argument("--big-model", default="qwen3-8b")
    p_rt.add_argument("--big-batch", type=int, default=16)
    p_rt.set_defaults(func=_bench_runtime)
    for name in SCENARIOS:
        if name == "runtime":
            continue
        mod = scenario_module(name)
        p = scen.add_parser(name, help=SCENARIO_HELP[name], description=mod.__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(func=_bench_scenario, scenario_module=mod)


# `plan`'s description of a machine (and --gpus of train and plan), checked as argparse reads them, so
# that the refusal names the argument: `--gpu-free-gib -5` planned for "usable -4.75 GiB", `nan`
# failed converting to bytes, and `plan --gpus 0` said "fits" where train refuses it
def _gib(text: str, low: float, low_ok: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and (value >= low if low_ok else value > low)):
        raise argparse.ArgumentTypeError(f"must be a finite number of GiB {'>=' if low_ok else '>'} {low:g}, "
                                         f"not {text!r}")
    return value


def _gib_above_0(text: str) -> float:
    """The GPU's free memory or the host's RAM planned for: a machine with none is no machine."""
    return _gib(text, 0, low_ok=False)


def _gib_at_least_0(text: str) -> float:
    """Free space in /dev/shm or on the disk tier's disk: 0 (full) is a state to plan against."""
    return _gib(text, 0, low_ok=True)


def _rank_count(text: str) -> int:
    """--gpus N: a whole number of ranks, at least one."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of ranks >= 1, not {text!r}")
    return value


_TRAIN_DESCRIPTION = ("Fine-tune every parameter of a decoder-only model on one GPU. The flags below are the "
                      "choices a run makes; the pipeline's tuning knobs (rings, chunk sizes, streams, wait modes, "
                      "update order, disk blocks) have measured defaults and are set as --tuning.NAME VALUE or in a "
                      "YAML `tuning:` section: --help-tuning lists them.")


def _card_names() -> list[str]:
    from .bench.cards import CARDS
    return list(CARDS)


def _card(text: str):
    """--card NAME: a card of bench/cards.py, or a refusal naming the known ones."""
    from .bench.cards import card_named
    try:
        return card_named(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    # ConfigArgumentParser (and its subparsers): unknown --tuning.NAME names the valid knobs
    parser = ConfigArgumentParser(prog="slidetune", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="fine-tune a model (default: SmolLM2-135M on the built-in corpus)",
                             description=_TRAIN_DESCRIPTION, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_config_flags(p_train)
    p_train.add_argument("--gpus", type=_rank_count, default=None, metavar="N",
                         help="data parallel on N GPUs of this host: restarts the command through torchrun "
                              "(torch.distributed.run) with N ranks, --batch-size rows each (the global batch is "
                              "N x --batch-size); with --device cpu, N CPU processes over gloo (testing). "
                              "docs/data_parallel.md")
    p_train.add_argument("--verbose", action="store_true",
                         help="print the whole resolved config at the start (config.json in the output directory "
                              "holds it either way), what every auto setting chose, and the summary at the end")
    p_train.set_defaults(func=_train)
    p_plan = sub.add_parser("plan", help="print the memory a configuration needs, allocating nothing",
                            description=_TRAIN_DESCRIPTION.replace("Fine-tune", "Plan the memory of fine-tuning"))
    add_config_flags(p_plan)
    p_plan.add_argument("--gpu-free-gib", type=_gib_above_0, default=None, metavar="GIB",
                        help="slide on CUDA: resolve the auto settings for a GPU with this much free memory "
                             "(default: this machine's GPU, if it has one) and say whether it fits")
    p_plan.add_argument("--host-gib", type=_gib_above_0, default=None, metavar="GIB",
                        help="with --gpu-free-gib: the host RAM available (default: this machine's)")
    p_plan.add_argument("--gpus", type=_rank_count, default=1, metavar="N",
                        help="data parallel: N ranks on this host (train --gpus N): the auto settings and the "
                             "host check count them all (one shared state, each rank's own buffers), and the "
                             "shared state must fit /dev/shm (--shm-gib)")
    p_plan.add_argument("--shm-gib", type=_gib_at_least_0, default=None, metavar="GIB",
                        help="with --gpus N > 1: the free space of /dev/shm (default: this machine's)")
    p_plan.add_argument("--disk-free-gib", type=_gib_at_least_0, default=None, metavar="GIB",
                        help="with --disk-dir: the free space of its disk (default: what it has here), as "
                             "--host-gib describes the host; the directory then need not exist here (a plan "
                             "for another machine)")
    p_plan.add_argument("--no-limits", action="store_true",
                        help="skip the largest batch and the longest sequence that fit (a search of a few "
                             "seconds over the same estimate)")
    p_plan.add_argument("--card", type=_card, default=None, metavar="NAME",
                        help="plan for a consumer card in this machine (its memory: the placement it gets) and, "
                             "with --terms, predict its step from this machine's probes: "
                             + ", ".join(_card_names()))
    p_plan.add_argument("--terms", action="store_true",
                        help="also probe this machine (GPU compute, PCIe, host AdamW, the disk tier's directory; "
                             "about a minute) and print the seconds a step each term of the floor costs")
    p_plan.set_defaults(func=_plan)
    _add_eval(sub)
    _add_push(sub)
    _add_bench(sub)
    p_report = sub.add_parser("report", help="turn a results directory into Markdown + PNG plots")
    p_report.add_argument("dir", type=Path)
    p_report.add_argument("--compare-seeds", action="store_true",
                          help="set each seed report's table beside ours, as ratios (the hardware differs)")
    p_report.set_defaults(func=_report)
    return parser


# Errors whose message is the interface (bad input, a refused configuration, I/O):
# shown without a traceback. Anything else is a bug and keeps its traceback.
_CLEAN_ERRORS = (ValueError, OSError, RuntimeError, ImportError, KeyError)


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()      # a closed pipe fails here, where it is caught, not at the interpreter's exit
    except BrokenPipeError:
        if not _stdout_closed():
            raise
        return _end_quietly()


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    ns.argv = list(sys.argv[1:] if argv is None else argv)     # what --gpus restarts through torchrun
    try:
        return ns.func(ns)
    except KeyboardInterrupt:
        print("slidetune: interrupted", file=sys.stderr)
        return 130
    except _CLEAN_ERRORS as e:
        if isinstance(e, BrokenPipeError) and _stdout_closed():
            raise                   # main ends quietly: the reader of our output has gone
        if os.environ.get("SLIDETUNE_TRACEBACK"):
            import traceback
            traceback.print_exc()
        msg = str(e.args[0] if isinstance(e, KeyError) and len(e.args) == 1 else e)
        msg = msg.removeprefix("slidetune: ")        # some messages carry the program name already
        rank, world = _rank()
        where = f" (rank {rank} of {world})" if world > 1 else ""
        print(f"slidetune: error{where}: {type(e).__name__}: {msg}", file=sys.stderr)
        return 2


def _stdout_closed() -> bool:
    """Whether stdout is a pipe (or socket) whose reader has gone: poll reports an error on its
    write end. A BrokenPipeError from anything else (a socket to a tracker, a child's pipe) is a
    failure to report, not the end of the output."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):       # replaced by a StringIO: not a pipe
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _end_quietly() -> int:
    """`slidetune train --help-tuning | head`: the reader took what it wanted and left. The rest of
    the output goes to /dev/null (so that the interpreter's flush at exit does not fail again), and
    the status is a Unix tool's that SIGPIPE ended (128 + 13), without a traceback."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
