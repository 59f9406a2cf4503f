"""The floor of a slide step on this machine, from short probes.

floor = max(GPU compute, weight bytes H2D / H2D bandwidth, gradient bytes D2H / D2H
bandwidth, parameters / CPU AdamW rate). Each term is measured, not assumed, by a probe
(bench.floor_probes):
  compute  one decoder layer resident on the GPU: forward (no autograd) + recompute +
           backward, times the number of layers, plus head and embedding;
  copies   pinned <-> device bandwidth each way and both at once (1 GiB transfers);
  AdamW    the host AdamW over a flat FP32 tensor, params/s at the current thread count,
           through the engine's kernel (--tuning.host_adamw), on BF16 gradients
           (grad_download=compute, the default) or FP32 ones; and the GPU's AdamW of the units
           updated there (vocab_update=device, device_layers), added to compute;
  collective  N data-parallel ranks on one host: the gradient all-reduce at the bus bandwidth
           bench.collective probed at N ranks, on the compute stream (floor_terms, `ranks`).

The hardware floor: the same terms with the GPU's work at what this GPU can do rather than what
slidetune's layer takes (a slow layer would otherwise sit "1.01x its floor"): the step's FLOPs,
recomputation counted (telemetry.flops.StepFlops), matmuls at the BF16 GEMM rate cuBLAS gets on
the layer's own shapes and attention at SDPA's rate at the workload's shape, both probed
(bench.hardware_floor: probe_hardware, hardware_compute); the GPU's AdamW and the all-reduce stay
as they are.

Here: the floor's terms from the probes' results (floor_terms) and the floor of a workload (floor).
"""
from __future__ import annotations

from ..engine.adamw import FP32_ADAMW
from ..engine.config import RuntimeConfig, runtime_fields
from ..engine.distributed import plan_owners, shared_layout
from ..engine.placement import PlacementPlan, shapes_from_counts
from ..engine.tiers import TIERS
from ..models.load import load_model
from .collective import allgather_seconds, allreduce_term
from .floor_probes import (ADAMW_BYTES, _probed_state, adamw_bytes, probe_adamw, probe_compute, probe_copy, probing,
                           probe_device_adamw)
from .hardware_floor import hardware_compute, probe_hardware


def plan_of_runtime(comp: dict, runtime: dict | None = None, clipped: bool = False) -> PlacementPlan:
    """The placement plan of a run, from its resolved RuntimeConfig (as bench.measure records it) and
    the probe's shapes; -1 and auto, left unresolved, mean what an engine built directly does
    (nothing on the GPU, a 3-slot window). No runtime: the design's placement, every unit on the
    host. clipped: the run clipped by the global norm (its max_grad_norm > 0)."""
    known = runtime_fields()
    rt = RuntimeConfig(**{k: v for k, v in (runtime or {}).items() if k in known})
    schedule = "deferred" if clipped or rt.clip.schedule == "deferred" else "eager"
    vocab = comp["vocab_params"]
    embed = comp.get("embed_params", vocab // 2)
    shapes = shapes_from_counts(comp["num_layers"], comp["layer_params"], embed, vocab - embed)
    return PlacementPlan.build(shapes, rt, schedule)


# Bytes of host DRAM an upload reads per parameter: the FP32 master (the GPU-cast path page-locks it
# and DMAs it as is; the CPU-cast path reads it too, and writes and re-reads a BF16 copy besides).
# The floor takes the plan's (host_state.master_bytes): a BF16 master (--master bf16) is read as is, 2.
UPLOAD_READ_BYTES = FP32_ADAMW.master_bytes


def largest_shard(plan: PlacementPlan, ranks: int) -> int:
    """Parameters of the host-updated units the busiest of `ranks` local ranks owns: only a unit's
    owner copies its gradient down and runs its AdamW. The owners as SlideEngine assigns them
    (distributed.plan_owners: the host-updated units balanced, the disk tier's on local rank 0);
    units updated on the GPU have no owner (every rank updates its own copy). One rank: every
    host-updated parameter."""
    if ranks <= 1:
        return plan.host_updated_params
    numels, _ = shared_layout(plan)
    owners = plan_owners(plan, ranks)
    load = [0] * ranks
    for n, r in zip(numels, owners):
        load[r] += n
    return max(load)


def adamw_dram_bytes(plan: PlacementPlan, adamw: dict, split_sweep: bool = True) -> int:
    """Host DRAM bytes of the host's AdamW a step (ADAMW_BYTES): one pass over each host-updated
    unit (26 B/param, 28 with FP32 gradients); clipped with the split sweep (probed), the units
    with master and moments in RAM take both passes (18 + 18), those with an upload copy the
    copy pass and the whole update (16 + 26); disk units one whole pass."""
    key = "adamw_bf16_grad_params_per_s" if adamw.get("grad_dtype") == "bf16" else "adamw_fp32_grad_params_per_s"
    ram = adamw_bytes(plan.host_state)          # the RAM units' format (--moments)
    ram_params = plan.params("host")
    # the tiers that stream their state (the disk tier): one whole pass, in the format the tier says
    streamed = sum(adamw_bytes(t.swept_state(plan))[key] * plan.params(t)
                   for t in TIERS.host_updated() if t.streams_state)
    if plan.schedule != "deferred" or not split_sweep or not adamw.get("adamw_moments_pass_params_per_s"):
        return ram[key] * ram_params + streamed
    copies = plan.upload_copy_numel()
    split = ram_params - copies
    passes = ram["adamw_weights_pass_params_per_s"] + ram["adamw_moments_pass_params_per_s"]
    return (passes * split + (ADAMW_BYTES["adamw_weights_copy_pass_params_per_s"] + ADAMW_BYTES[key]) * copies
            + streamed)


def host_dram_term(plan: PlacementPlan, adamw: dict, ranks: int, split_sweep: bool = True,
                   grad_bytes: int = 2) -> float | None:
    """Seconds a step of the host DRAM's traffic: the host's AdamW streams its state
    (adamw_dram_bytes), the uploads' DMA reads the master (UPLOAD_READ_BYTES per uploaded
    parameter; `ranks` ranks sharing one host each read every unit from the one shared master),
    and the gradients' DMA writes `grad_bytes` per host-updated parameter (each unit once, by its
    owner); at the largest DRAM bandwidth the probes saw (probe_host_dram's a += b, or an AdamW
    pass's own traffic). None where probe_adamw measured no DRAM bandwidth.
    One rank too: on a 24 GiB GPU (Llama-3.1-8B clipped, every unit on the host) the AdamW
    passes' probed rates gave 1.9 s a step and the engine's took 2.3-2.4 s, the DMA's 8 B/param
    (uploads 6, gradients 2) beside their 36 on the same DRAM (NOTES.md "Floor probes")."""
    best = best_dram_gib_s(adamw)
    if not best:
        return None
    # (a BF16 master, --master bf16: the uploads read 2 B/param)
    nbytes = (ranks * plan.host_state.master_bytes * plan.upload_params() + grad_bytes * plan.host_updated_params
              + adamw_dram_bytes(plan, adamw, split_sweep))
    return nbytes / (best * 2**30)


def best_dram_gib_s(adamw: dict) -> float | None:
    """The largest host DRAM bandwidth the probes saw: probe_host_dram's a += b, or an AdamW pass's
    own traffic (ADAMW_BYTES at its probed rate). None where probe_adamw measured no DRAM bandwidth."""
    if not adamw.get("dram_gib_s"):
        return None
    return max([adamw["dram_gib_s"]] + [adamw[k] * b / 2**30 for k, b in adamw_bytes(_probed_state(adamw)).items()
                                        if adamw.get(k)])


def floor_terms(comp: dict, copy: dict, adamw: dict, plan: PlacementPlan | None = None,
                device_adamw: dict | None = None, disk: dict | None = None, split_sweep: bool = True,
                collective: dict | None = None, ranks: int = 1, grad_bytes: int | None = None,
                dp_weights: str = "upload") -> dict:
    """The floor's terms (seconds) for a placement plan (engine/placement.py; None: the design's,
    every unit on the host, a 3-slot window), from the probes' results.

    Only host-updated units (host and disk) cost host AdamW, D2H (BF16 gradients, 2 B/param)
    and uploads (BF16 weights). Uploads: resident host layers once a step; a window twice
    (forward and backward) except the slots still holding layers at the turn
    (PlacementPlan.uploads_per_step); host vocabulary units once.
    Disk units (with `disk`, probe_disk's result): their moments (and masters, where they live
    there) are read and written once a step (16 B/param through the disk, 24 with the master,
    at the probe's mixed rate): disk_s (the tier's io_seconds). Unclipped, that I/O runs beside the whole step
    (the backward releases the disk units first, the next forward needs them last); clipped, see
    _clip_sweep_terms.
    Units updated on the GPU run their AdamW on the compute stream: with `device_adamw` (the
    probe_device_adamw rate) it is added to compute_s (~26 B/param at HBM speed; the engine's
    optimizer_device spans were 38 ms a step for a Qwen3-4B with every unit there).
    Clipped (the deferred schedule): clip_sweep_s and the two-pass adamw_s, _clip_sweep_terms.

    `ranks` data-parallel ranks on this host (docs/data_parallel.md), a rank's terms:
    - allreduce_s (with `collective`, bench.collective's probe at that rank count): every unit's
      gradient slot is all-reduced as its backward ends, 2 (N - 1) / N x its bytes (`grad_bytes`
      per parameter, default the probe's dtype: BF16 on the GPU) at the bus bandwidth probed nearest
      its size (bench.collective.allreduce_term). The engine issues it on the compute stream
      (SlideEngine._gradient_complete calls dist.all_reduce there and the unit's norm, D2H and the
      next layer's backward are queued behind it), so it adds to compute_s and to the clipped
      sweep's backward; it is also listed alone.
    - d2h_s: only a unit's owner copies its gradient down: the busiest rank's shard (largest_shard),
      over its own PCIe link. h2d_s is unchanged: every rank uploads every unit over its own link.
    - adamw_s is unchanged: each rank updates its shard, but the ranks share the host's cores and
      DRAM, so the host's AdamW a step is still every host parameter at the host's probed rate
      (a lower bound: each rank runs its shard on its share of the cores, and an uneven shard,
      e.g. the disk units all on rank 0, ends later). Units updated on the GPU: every rank
      updates its own copy, so device AdamW and the disk tier's I/O (rank 0's) stay per host.
    - host_dram_s: the N uploads of each unit all read the one shared master from the same DRAM,
      beside AdamW's traffic and the gradients' DMA (host_dram_term; one rank has the term too).
    - dp_weights="gather" (--tuning.dp_weights): a unit's owner alone uploads it and
      broadcasts it to the host's other GPUs: h2d_s is the busiest rank's share of the uploads,
      host_dram_s reads the master once, and gather_s (_gather_term) is beside the step.
    One rank gives exactly the one-rank terms."""
    plan = plan or plan_of_runtime(comp)
    host_params = plan.host_updated_params
    # each GPU updates its own copy of the device units and its share of the sharded layers
    device_params = plan.params("gpu") + sum(u.numel for u in plan.busiest_shard_units())
    device_update_s = device_params / device_adamw["device_adamw_params_per_s"] if device_adamw and device_params \
        else 0.0
    gib = 2**30
    if collective is not None and collective.get("world_size") != ranks:
        raise ValueError(f"the collective probe ran on {collective.get('world_size')} ranks, the floor is for {ranks}")
    reduce_s = (allreduce_term([u.numel for u in plan.units], collective, grad_bytes)
                if ranks > 1 and collective is not None else 0.0)
    gathering = ranks > 1 and dp_weights == "gather"
    upload_share = largest_shard(plan, ranks) / host_params if gathering and host_params else 1.0
    terms = {
        "compute_s": comp["compute_s"] + device_update_s + reduce_s,
        "h2d_s": 2 * plan.upload_params() * upload_share / (copy["h2d_gib_s"] * gib),
        "d2h_s": 2 * largest_shard(plan, ranks) / (copy["d2h_gib_s"] * gib),
        "adamw_s": host_params / adamw["adamw_params_per_s"],
    }
    if reduce_s:
        terms["allreduce_s"] = reduce_s
    if gathering and collective is not None:
        terms["gather_s"] = _gather_term(plan, collective)
    dram_s = host_dram_term(plan, adamw, 1 if gathering else ranks, split_sweep)
    if dram_s:
        terms["host_dram_s"] = dram_s
    disk_io_s = TIERS.with_files.io_seconds(plan, disk)
    if disk_io_s:
        terms["disk_s"] = disk_io_s
    if plan.schedule == "deferred" and host_params:
        _clip_sweep_terms(terms, plan, comp, adamw, split_sweep=split_sweep, reduce_s=reduce_s,
                          device_update_s=device_update_s, uploads=1 if gathering else ranks)
    return terms


def add_checkpoint_traffic(terms: dict, offloaded_bytes: int, copy: dict, adamw: dict) -> dict:
    """`terms` (floor_terms') with the offloaded activation checkpoints' traffic added: each crosses
    PCIe down in the forward (d2h_s) and up again in the backward (h2d_s), on the links the weights
    and gradients use, and its pinned host buffer is written and read by the DMA (host_dram_s, at
    the best DRAM rate the probes saw). `offloaded_bytes`: every offloaded checkpoint of a step
    (the plan's layers past gpu_checkpoints, [grad_accum * B, S, d] each in the compute dtype)."""
    if not offloaded_bytes:
        return terms
    gib = 2**30
    out = dict(terms)
    out["h2d_s"] = terms["h2d_s"] + offloaded_bytes / (copy["h2d_gib_s"] * gib)
    out["d2h_s"] = terms["d2h_s"] + offloaded_bytes / (copy["d2h_gib_s"] * gib)
    best = best_dram_gib_s(adamw)
    if best and "host_dram_s" in terms:
        out["host_dram_s"] = terms["host_dram_s"] + 2 * offloaded_bytes / (best * gib)
    return out


def _gather_term(plan: PlacementPlan, collective: dict) -> float:
    """gather_s under dp_weights="gather": each upload's owner broadcasts it to the host's other GPUs
    on a stream of its own, every upload's bytes (BF16 weights) at the probed all-gather bus
    bandwidth ((N - 1) / N of them cross each GPU's NVLink); the busiest rank's share of the uploads
    is its share of the host-updated parameters (the owners are balanced by size)."""
    layer_uploads, _ = plan.uploads_per_step()
    layer = max((u.numel for u in plan.layers), default=0)
    # the sharded layers' owners broadcast them too (cast from their GPU masters; no upload)
    messages = [layer] * (layer_uploads + plan.shard_broadcasts_per_step()) \
        + [u.numel for u in (plan.units[0], plan.units[-1]) if u.host_updated]
    return sum(allgather_seconds(2 * n, collective) for n in messages)   # BF16 weights


def _clip_sweep_terms(terms: dict, plan: PlacementPlan, comp: dict, adamw: dict, *, split_sweep: bool,
                      reduce_s: float, device_update_s: float, uploads: int) -> None:
    """Set clip_sweep_s (and the two-pass adamw_s) of a clipped step in `terms`.

    Clipped (the deferred schedule): no update may start before the global norm is known, at
    the end of the backward, and the next step's last host layer cannot compute before its
    update; so a step is at least the head, every layer's recompute + backward, the embedding's
    backward, the device units' AdamW, the host's weights pass over its units (at the probed
    rate of that pass: it writes the weights only, the moments follow where nothing waits) and
    one layer's forward: clip_sweep_s. (The forward runs in the sweep's shadow; nothing else of
    the host's sweep can overlap.) The weights pass takes at least its bytes and the following
    `uploads`' master reads at the best DRAM rate the probes saw, where that is the longer. Units
    with an upload copy (clip_sweep=weights) take that pass at the probed rate of the BF16-writing
    pass (adamw_weights_copy_pass_params_per_s), their second pass being the whole update.
    Disk units: disk_s stands alone and is not added to clip_sweep_s: the step's reads and writes
    need the disk for at least disk_s a step whatever overlaps them, and how much of them must
    follow the norm is not modelled. (Until 2026-11-25 clip_sweep_s took the larger of the weights
    pass and the whole disk_s after the backward; both machines' clipped disk4 steps ran below
    that: 0.79x on the H100, 0.94x on the H200 with the fastest of 3 probe passes, NOTES.md
    "Disk tier".)"""
    gib = 2**30
    L = comp["num_layers"]
    host_params = plan.host_updated_params
    disk_params = plan.params(TIERS.with_files)
    ram_params = host_params - disk_params
    # the sweep writes the weights only (the moments follow under the next step): its rate
    # where probed, else the whole AdamW's; disk units: their I/O is disk_s, a term of its own
    sweep_rate = (adamw.get("adamw_weights_pass_params_per_s") if split_sweep else None) \
        or adamw["adamw_params_per_s"]
    # clip_sweep=weights: the units with an upload copy (the plan's) write BF16 weights first
    # (16 B/param, its probed rate), then the whole update (the moments pass's place)
    copy_params = plan.upload_copy_numel() if split_sweep else 0
    copy_rate = adamw.get("adamw_weights_copy_pass_params_per_s") or sweep_rate
    backward = L * comp["layer_recompute_backward_s"] + comp["head_s"] + comp["embed_s"]
    sweep_s = (ram_params - copy_params) / sweep_rate + copy_params / copy_rate
    best = best_dram_gib_s(adamw) if split_sweep else None
    if best:
        # The forward that follows the sweep uploads each swept unit as its update lands, so
        # the sweep shares the DRAM with those uploads' reads (the master, 4 B/param; an
        # upload copy, 2): the sweep takes at least all those bytes at the best DRAM rate.
        # Llama-3.1-8B b16 on a 24 GiB GPU: the weights pass ran at 6.94 G params/s in the
        # step against 8.11 alone, 142 GiB/s of DRAM with the uploads (NOTES.md "Floor probes").
        swept = ((adamw_bytes(plan.host_state)["adamw_weights_pass_params_per_s"]
                  + uploads * plan.host_state.master_bytes)
                 * (ram_params - copy_params)
                 + (ADAMW_BYTES["adamw_weights_copy_pass_params_per_s"] + uploads * 2) * copy_params)
        sweep_s = max(sweep_s, swept / (best * gib))
    # (the disk units' AdamW, whole, on the same host threads after the norm)
    terms["clip_sweep_s"] = (backward + reduce_s + device_update_s + sweep_s
                             + disk_params / adamw["adamw_params_per_s"] + comp["layer_forward_s"])
    if split_sweep and adamw.get("adamw_moments_pass_params_per_s"):
        # the host's AdamW a step is both passes (each reads the gradient and the moments)
        split_params = ram_params - copy_params
        terms["adamw_s"] = (split_params / sweep_rate + split_params / adamw["adamw_moments_pass_params_per_s"]
                            + copy_params / copy_rate + copy_params / adamw["adamw_params_per_s"]
                            + disk_params / adamw["adamw_params_per_s"])


def floor(model: str, batch: int, seq: int, num_layers: int | None = None, cache_units: int = 3,
          copy: dict | None = None, adamw: dict | None = None, head_impl: str = "chunked",
          head_chunk_tokens: int = 4096, compile_layers: bool = False, layer: str = "both") -> dict:
    """The design's floor (every unit on the host, a window of `cache_units` slots) with its
    probes; floor_terms() gives the terms of any other placement from the same probes.
    Beside it the hardware floor (hw_*): the same terms with the GPU's work priced at the rates
    probe_hardware measured instead of slidetune's own layer timed (hardware_compute; the slide
    engine recomputes every layer). layer: the decoder layer timed (probe_compute's)."""
    with probing("PCIe copies"):
        copy = copy or probe_copy()
    with probing("host AdamW"):
        adamw = adamw or probe_adamw()
    with probing(f"the GPU's compute ({layer} layer{'s' if layer == 'both' else ''}"
                 f"{', compiled' if compile_layers else ''}, head, embedding)"):
        comp = probe_compute(model, batch, seq, num_layers, head_impl, head_chunk_tokens, compile_layers, layer=layer)
    plan = plan_of_runtime(comp, {"cache_units": cache_units})
    terms = floor_terms(comp, copy, adamw, plan)
    bound = max(terms, key=terms.get)
    with probing("the hardware's GEMM and SDPA rates"):
        hardware = probe_hardware(load_model(model, num_layers=num_layers, with_tokenizer=False).split, batch, seq)
    hw_terms = floor_terms({**comp, **hardware_compute(hardware, range(comp["num_layers"]))}, copy, adamw, plan)
    hw_bound = max(hw_terms, key=hw_terms.get)
    return {"floor_s": terms[bound], "bound_by": bound, "terms": terms, "copy": copy, "adamw": adamw,
            "compute": comp, "device_adamw": probe_device_adamw(), "tokens_per_step": batch * seq,
            "hardware": hardware, "hw_floor_s": hw_terms[hw_bound], "hw_bound_by": hw_bound, "hw_terms": hw_terms}
