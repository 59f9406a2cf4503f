"""The estimate: the GPU, host, pinned and disk bytes of a configuration, item by item.

    est = estimate_memory(split, rt, batch_size=16, seq_len=1024)    # itemized bytes

What each engine allocates (see slide/engine.py and plain.py):
  slide  GPU : K layer slots + G gradient slots of P_L*b each, dedicated embed/head weight
               and gradient slots ((P_E+P_H)*b each), layer-input checkpoints (L*A*N*d*b on
               the GPU for A micro-batches, run layer by layer; with --offload-activations
               A*N*d*b for each kept there by gpu_checkpoints, plus those in flight), plus the
               largest of the transient working sets (one micro-batch's recompute + backward
               of a layer, the head, the embedding backward).
         host: 12 B/param (FP32 master + two moments: adamw.FP32_ADAMW), + the compute dtype's size (2 B/param for
               BF16) with the deferred schedule (clipping): the held gradients, page-locked;
               disk units (the disk tier) 4 B/param (the master), or b with their master on disk
               too (the compute-dtype weights the uploads copy, page-locked), + its block buffers;
               pinned upload/download rings of chunk_mb each, one FP32 scratch chunk, and with
               offload A*N*d*b pinned for each offloaded checkpoint.
  gpu/ckpt   : per param FP32 master 4 + moments 8 + FP32 grad 4 + compute copy b + compute
               grad b, all on the device; full saved activations for layers that are not
               recomputed, an N*d*b checkpoint for those that are.
On device "cpu" the "GPU" parts live in host RAM and are checked against it. Notation as in
byte_models.py, plus P parameters, P_E / P_H the embedding and head units, L layers.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ...models.units import SplitModel
from ..adamw import FP32_ADAMW
from ..config import RuntimeConfig
from ..placement import PlacementPlan, unit_shapes
from ..slide.disk_tier import buffer_bytes, tier_bytes
from ..slide.host_store import BUILD_WORKERS
from ..tiers import TIERS
from .byte_models import (ACTIVATION_MARGIN, HEAD_MARGIN, GiB, device_type_of, head_bytes, layer_activation_bytes,
                          materialized_masks, model_shape, side_input_bytes, summing_bytes, working_set_bytes,
                          working_set_margin)


# CUDA context + allocator slack. mem_get_info() is read after the context exists, but
# cuBLAS handles and workspaces, kernel modules loaded lazily during the first steps,
# and the caching allocator's rounding and fragmentation (blocks come from 2 MiB /
# 20 MiB pools; a freed logits chunk is not always reused exactly) come later. 1 GiB is
# a round allowance for these, not a measurement: compare it with a run's
# max_memory_reserved - max_memory_allocated on the GPU before you tighten it.
CUDA_OVERHEAD_BYTES = 1 * GiB
# Host memory that appears after the check: with CUDA, the driver's host-side state
# and pinned staging of the caching host allocator (~0.3-0.6 GB RSS), plus tokenizer,
# data pipeline and Python objects. On a CPU-only run only the latter.
HOST_OVERHEAD_BYTES = {"cuda": 1 * GiB, "cpu": GiB // 2}


# ----------------------------------------------------------------------------- results


# host parts held once per host under data parallel (the shared state; the owners' held gradients;
# the disk tier, which local rank 0 alone keeps)
SHARED_PER_HOST = ("master + Adam moments", "held gradients", "disk units' masters", "disk tier block buffers")


def gib(n: int) -> str:
    return f"{n / GiB:.2f}"


@dataclass
class MemoryEstimate:
    """Bytes a configuration needs. host_bytes includes pinned_bytes (pinned is a part of RAM)."""

    gpu_bytes: int
    host_bytes: int
    pinned_bytes: int
    gpu_parts: dict[str, int]            # sums to gpu_bytes: persistent buffers + the peak phase
    host_parts: dict[str, int]           # sums to host_bytes
    device_type: str = "cuda"            # "cpu": gpu_* is memory of the CPU device, i.e. host RAM
    phases: dict[str, int] = field(default_factory=dict)  # transient working sets; only the largest counts
    schedule: str | None = None          # slide mode: eager | deferred
    disk_bytes: int = 0                  # the disk tier's files (slide mode with disk units)
    plan: PlacementPlan | None = None    # slide mode: the placement the estimate is of

    @property
    def host_total_bytes(self) -> int:
        """What the host must hold: on device cpu the device parts live in RAM too."""
        return self.host_bytes + (self.gpu_bytes if self.device_type == "cpu" else 0)

    def host_bytes_per_host(self, ranks_per_host: int = 1) -> int:
        """What the host must hold with `ranks_per_host` data-parallel ranks on it: the state
        (master + moments) and the held gradients once (one shared copy; each owner holds its own
        units' gradients), everything else (rings, checkpoints, on device cpu the device parts) once
        per rank (docs/data_parallel.md)."""
        once = sum(v for k, v in self.host_parts.items() if k.startswith(SHARED_PER_HOST))
        return once + ranks_per_host * (self.host_total_bytes - once)

    def summary(self) -> str:
        def items(parts):
            return ", ".join(f"{k} {gib(v)}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]) if v)
        dev = "GPU" if self.device_type == "cuda" else "device (cpu: in RAM)"
        return (f"{dev} {gib(self.gpu_bytes)} GiB [{items(self.gpu_parts)}]; host {gib(self.host_bytes)} GiB "
                f"(pinned {gib(self.pinned_bytes)}) [{items(self.host_parts)}]"
                + (f"; disk tier {gib(self.disk_bytes)} GiB" if self.disk_bytes else ""))


@dataclass
class _Work:
    """What one estimate is of: the device, the compute dtype, the batch and the model's sizes."""

    dev: str                    # cuda | cpu
    dtype: torch.dtype
    b: int                      # bytes per element of the compute dtype
    B: int                      # sequences per micro-batch
    S: int                      # tokens per sequence
    N: int                      # tokens per micro-batch, B * S
    # slide mode runs a step's micro-batches layer by layer: the checkpoints, the head and the
    # embedding backward see every micro-batch's tokens at once, a layer's working set one's
    N_step: int                 # tokens per step, N * grad_accum
    grad_accum: int
    L: int                      # decoder layers
    d: int                      # hidden width
    P: int                      # parameters of the whole model
    P_L: int                    # parameters of the largest decoder layer
    P_E: int                    # parameters of the embedding unit
    P_H: int                    # parameters of the head unit
    largest_param: int          # elements of the largest single parameter
    masks: int                  # [B,1,S,S] masks HF materializes (materialized_masks)
    layer_inputs: int           # bytes every layer receives besides the hidden states
    head: int                   # bytes of the head phase

    @property
    def ckpt_micro(self) -> int:
        """One micro-batch's checkpoint of one layer: [B, S, d] in the compute dtype."""
        return self.N * self.d * self.b

    @property
    def ckpt(self) -> int:
        """A layer's checkpoints, every micro-batch: [grad_accum * B, S, d]."""
        return self.N_step * self.d * self.b


@dataclass
class _Parts:
    """The estimate's terms as they are gathered (insertion order is the order they print in)."""

    gpu: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    phases: dict[str, int] = field(default_factory=dict)
    pinned: int = 0
    disk_bytes: int = 0


def _work(split: SplitModel, rt: RuntimeConfig, batch_size: int, seq_len: int, grad_accum: int,
          padded: bool) -> _Work:
    dtype = rt.torch_dtype
    b = torch.empty((), dtype=dtype).element_size()
    sh = model_shape(split)
    B, S, N = batch_size, seq_len, batch_size * seq_len
    # what every layer receives besides the hidden states: the [B,1,S,S] bool masks HF
    # materializes (materialized_masks), rotary cos/sin [1,S,hd] fp32
    masks = materialized_masks(split, S, padded)
    layer_inputs = masks * B * S * S + 2 * S * sh.head_dim * 4 + 2 * N * 8   # + ids, labels
    # slide mode's head computes its gradients without autograd, scaled in place (engine/slide)
    head = int(HEAD_MARGIN * head_bytes(split, N, dtype, rt.resolved_head_impl, rt.head.head_chunk_tokens,
                                        grads_in_place=rt.mode == "slide"))
    return _Work(dev=device_type_of(rt), dtype=dtype, b=b, B=B, S=S, N=N, N_step=N * grad_accum,
                 grad_accum=grad_accum, L=sh.layers, d=sh.d, P=split.num_params(),
                 P_L=max((u.numel for u in split.layer_units), default=0),
                 P_E=split.embed_unit.numel, P_H=split.head_unit.numel,
                 largest_param=max(p.numel for u in split.units for p in u.params),
                 masks=masks, layer_inputs=layer_inputs, head=head)


def estimate_memory(split: SplitModel, rt: RuntimeConfig, *, batch_size: int, seq_len: int,
                    grad_accum: int = 1, max_grad_norm: float | None = None, padded: bool = True,
                    ranks_per_host: int = 1) -> MemoryEstimate:
    """Bytes of GPU, host and pinned memory the configuration needs (nothing is allocated).

    padded: whether batches may carry padding (then HF materializes [B,1,S,S] masks, which SDPA
    also copies per layer: the S^2 terms of long sequences). Packed data and synthetic benchmark
    batches have none; the default assumes they may.
    ranks_per_host: data parallel's ranks on each host; the GPU bytes are one rank's (the busiest,
    where shard_layers spread layers over the host's GPUs), the host bytes one rank's too
    (MemoryEstimate.host_bytes_per_host counts the host)."""
    if batch_size < 1 or seq_len < 1 or grad_accum < 1:
        raise ValueError("batch_size, seq_len and grad_accum must be >= 1")
    w = _work(split, rt, batch_size, seq_len, grad_accum, padded)
    parts = _Parts()
    schedule = plan = None
    if rt.mode == "slide":
        schedule = rt.resolved_schedule(grad_accum, max_grad_norm)
        plan = PlacementPlan.build(unit_shapes(split), rt, schedule, ranks=ranks_per_host)
        _slide_terms(parts, split, rt, w, schedule, plan)
    else:
        _whole_model_terms(parts, split, rt, w)
    peak_name = max(parts.phases, key=parts.phases.get)
    parts.gpu[f"{peak_name} (peak phase)"] = parts.phases[peak_name]
    if w.dev == "cuda":
        parts.gpu["cuda context + allocator slack"] = CUDA_OVERHEAD_BYTES
    parts.host["runtime overhead"] = HOST_OVERHEAD_BYTES[w.dev if w.dev in HOST_OVERHEAD_BYTES else "cuda"]
    return MemoryEstimate(gpu_bytes=int(sum(parts.gpu.values())), host_bytes=int(sum(parts.host.values())),
                          pinned_bytes=int(parts.pinned), gpu_parts={k: int(v) for k, v in parts.gpu.items()},
                          host_parts={k: int(v) for k, v in parts.host.items()}, device_type=w.dev,
                          phases={k: int(v) for k, v in parts.phases.items()}, schedule=schedule,
                          disk_bytes=int(parts.disk_bytes), plan=plan)


def _whole_model_terms(parts: _Parts, split: SplitModel, rt: RuntimeConfig, w: _Work) -> None:
    """gpu and ckpt modes: the whole model, its optimizer state and its activations on the device."""
    gpu = parts.gpu
    P, N, d, b, L = w.P, w.N, w.d, w.b, w.L
    recomputed = rt.recomputed_layers(L)
    gpu["fp32 master"] = FP32_ADAMW.master_bytes * P
    gpu["Adam moments"] = FP32_ADAMW.moment_bytes * P
    gpu["fp32 grad accumulator"] = 4 * P
    gpu["compute weights"] = b * P
    gpu["compute grads"] = b * P
    stored = len(recomputed) * N * d * b
    act = layer_activation_bytes(split, w.B, w.S, w.dtype, masked=w.masks > 0)
    stored += (L - len(recomputed)) * int(ACTIVATION_MARGIN * act["saved"])
    gpu["stored activations"] = stored
    gpu["layer inputs (masks, rotary, ids)"] = w.layer_inputs
    # backward of one layer above what is stored: its whole working set when it is
    # recomputed, only the backward temporaries when its activations are stored
    bwd = int(ACTIVATION_MARGIN * (act["peak_no_param_grads"] - (0 if recomputed else act["saved"])))
    parts.phases = {"layer working set": bwd, "head/logits": w.head}
    if w.dev == "cuda":  # each unit is built in host RAM, then copied to the device
        parts.host["weight loading transient"] = max(u.numel for u in split.units) * 4


def _grad_slot_bytes(plan: PlacementPlan, b: int) -> int:
    """Bytes per element of the gradient slots: FP32, or the compute dtype's b."""
    return 4 if plan.grad_slots_fp32 else b


def _device_layer_params(split: SplitModel, plan: PlacementPlan) -> int:
    return sum(u.numel for u in split.layer_units[:plan.device_layers])


def _slide_terms(parts: _Parts, split: SplitModel, rt: RuntimeConfig, w: _Work, schedule: str,
                 plan: PlacementPlan) -> None:
    """slide mode: the window's GPU buffers, the GPU-updated units, the host's state and buffers."""
    if w.grad_accum > 1:
        # a micro-batch at a time, its parameter gradients summed in FP32 (a tied embedding's too)
        w = dataclasses.replace(w, head=w.head + 4 * (split.head_unit.numel
                                                      + (split.embed_unit.numel if split.tied else 0)))
    _slide_gpu_buffers(parts, rt, w, plan)
    side = side_input_bytes(split, w.B, w.S, w.dtype)
    if side:        # Gemma 4 E2B / E4B: every micro-batch's, from its embedding's forward to its backward
        parts.gpu["side inputs (per-layer inputs, shared keys and values)"] = w.grad_accum * side
    parts.phases = _slide_phases(split, rt, w)
    _device_update_terms(parts, split, rt, w, schedule, plan)
    tiers_pinned = _host_state_terms(parts, split, rt, w, plan)
    held, copies = _deferred_host_buffers(parts, split, w, schedule, plan)
    rings = _transfer_buffers(parts, rt, w, schedule, plan)
    kept = plan.gpu_checkpoints
    offloaded = _offloaded_checkpoint_bytes(plan, w)
    if kept < w.L:
        parts.host["offloaded checkpoints"] = offloaded
    if w.dev == "cuda":
        # page-locked: the rings, the offloaded checkpoints' own slots, the held gradients, the tiers'
        # items (the disk tier's block buffers and disk-master units' weights) and the upload copies
        parts.pinned = rings + offloaded + held + tiers_pinned + copies
    parts.host["weight loading transient"] = _weight_loading_transient(split, w, plan, parts.host)


def _offloaded_checkpoint_bytes(plan: PlacementPlan, w: _Work) -> int:
    """Host bytes of the offloaded checkpoints' own slots: each offloaded layer's w.ckpt (every
    micro-batch's), less what its held gradient buffer takes of it where it lends one
    (checkpoints_in_held: the layer's parameters in the compute dtype, w.b bytes each)."""
    return sum(max(0, w.ckpt - (plan.units[i + 1].numel * w.b if plan.lends_checkpoint(i) else 0))
               for i in range(w.L - plan.gpu_checkpoints))


def _slide_gpu_buffers(parts: _Parts, rt: RuntimeConfig, w: _Work, plan: PlacementPlan) -> None:
    """The window's weight and gradient slots, the vocabulary's, the checkpoints kept on the GPU."""
    gpu, b, P_L, L = parts.gpu, w.b, w.P_L, w.L
    K = plan.layer_slots                              # window slots + resident layers' own
    gpu["layer weight slots"] = K * P_L * b
    gb = _grad_slot_bytes(plan, b)
    gpu["layer grad slots"] = plan.grad_slots * P_L * gb
    gpu["vocab weight slots"] = (w.P_E + w.P_H) * b
    gpu["vocab grad slots"] = sum(plan.vocab_grad_slot_numels()) * gb
    if rt.transfer.upload_cast_stream == "compute" and (rt.casts_on_gpu(w.dev == "cuda") or w.dev != "cuda"):
        gpu["fp32 landing buffers (cast on the compute stream)"] = (K * P_L + w.P_E + w.P_H) * 4
    # offload: those kept on the GPU, plus in forward the micro-batches' outputs of the layer
    # being computed and the one whose D2H copy is in flight (in backward, the checkpoint being
    # read and the one prefetched, no more)
    gpu["activation checkpoints"] = min(L * w.ckpt, plan.gpu_checkpoints * w.ckpt + w.ckpt + w.ckpt_micro)
    gpu["layer inputs (masks, rotary, ids)"] = w.layer_inputs


def _slide_phases(split: SplitModel, rt: RuntimeConfig, w: _Work) -> dict[str, int]:
    """slide mode's transient working sets; only the largest counts."""
    ws = working_set_bytes(split, rt, w.B, w.S, w.dtype, masked=w.masks > 0)["peak"]
    return {
        # recompute + backward of one layer; autograd.grad also returns the layer's
        # parameter gradients as fresh tensors before they are copied into a grad slot
        # with several micro-batches, the other micro-batches' output gradients wait beside it,
        # and the layer's gradient sums in FP32 (a compute-dtype sum would round each add)
        "layer working set": int(working_set_margin(split, rt) * ws)
        + (w.grad_accum - 1) * w.ckpt_micro + summing_bytes(rt.transfer.grad_sum, w.grad_accum, w.P_L),
        # the head phase (head_bytes counts the last layer's output and its gradient)
        "head/logits": w.head,
        # embedding backward: a dense [V, d] gradient, and the incoming gradient
        # every micro-batch's incoming gradient; with several, a micro-batch at a time into
        # an FP32 sum
        "embedding backward": w.P_E * w.b + w.ckpt + (4 * w.P_E if w.grad_accum > 1 else 0),
    }


def _device_update_terms(parts: _Parts, split: SplitModel, rt: RuntimeConfig, w: _Work, schedule: str,
                         plan: PlacementPlan) -> None:
    """The units updated on the GPU: the vocabulary (vocab_update=device) and the device layers."""
    gpu, b = parts.gpu, w.b
    state = FP32_ADAMW.bytes_per_param                # 12 B/param
    n_dev = plan.device_layers
    vocab_device = plan.vocab_on_device
    if vocab_device:
        gpu[f"vocab master + Adam moments (vocab_update=device, {state} B/param)"] = state * (w.P_E + w.P_H)
    P_dev = _device_layer_params(split, plan)
    if n_dev:
        gpu[f"device layers: master + Adam moments ({state} B/param) + own weight slots"] = (state + b) * P_dev
        if schedule == "deferred":
            gpu["device layers' held gradients (deferred schedule)"] = _grad_slot_bytes(plan, b) * P_dev
    own = plan.busiest_shard_units()
    n_own, P_own = len(own), sum(u.numel for u in own)
    if n_own:
        # this GPU's share of the sharded layers: master and moments (their weights come through the
        # window, broadcast by their owners), and their held gradients until the clip is known
        gpu[f"sharded layers this GPU owns ({n_own} of {plan.shard_layers}): master + Adam moments "
            f"({state} B/param)"] = state * P_own
        if schedule == "deferred":
            gpu["sharded layers' held gradients (deferred schedule)"] = _grad_slot_bytes(plan, b) * P_own
    device_units = ([w.P_E, w.P_H] if vocab_device else []) + [u.numel for u in split.layer_units[:n_dev]] \
        + ([max(u.numel for u in own)] if own else [])
    # the update widens a compute-dtype gradient a chunk at a time
    if device_units and _grad_slot_bytes(plan, b) != 4:
        gpu["device update widening buffer"] = 4 * min(rt.transfer.chunk_elems(w.P_L), max(device_units))


def _host_state_terms(parts: _Parts, split: SplitModel, rt: RuntimeConfig, w: _Work, plan: PlacementPlan) -> int:
    """The host-updated units' masters and moments, each tier's items (Tier.host_ram_items): the
    host's, and the disk tier's masters or weights in RAM and block buffers; its files' bytes.
    Returns the bytes of those items that are page-locked (Tier.pinned_host_bytes)."""
    # the block buffers' size is the runtime's (block size, count), not the tier's
    buffers = buffer_bytes(plan, rt.disk.disk_block_mb)
    for tier in TIERS:
        parts.host.update(tier.host_ram_items(plan, w.b, buffers))
    if plan.params(TIERS.with_files):
        parts.disk_bytes = tier_bytes(plan, rt.disk.disk_block_mb)
    return sum(tier.pinned_host_bytes(plan, w.b, buffers) for tier in TIERS)


def _deferred_host_buffers(parts: _Parts, split: SplitModel, w: _Work, schedule: str,
                           plan: PlacementPlan) -> tuple[int, int]:
    """The deferred schedule's held gradients and upload copies on the host: (held, copies) bytes."""
    b = w.b
    # one buffer per host-updated unit, and the plan's second buffers (auto left unresolved:
    # one, what the engine does)
    held = b * plan.held_numel() if schedule == "deferred" else 0
    if held:
        two = sum(u.numel for u in plan.units if u.held == 2)
        what = (f"{b} B/param" if not two else f"{2 * b} B/param" if two == plan.host_updated_params else
                f"{b} B/param, {2 * b} for {plan.ranges(lambda u: u.held == 2)}")
        parts.host[f"held gradients (deferred schedule, {what})"] = held
    # clip_sweep=weights: the compute-dtype weights the uploads read, written by the weights pass
    copies = b * plan.upload_copy_numel() if schedule == "deferred" else 0
    if copies:
        parts.host[f"upload copies (clip_sweep weights, {b} B/param)"] = copies
    return held, copies


def _transfer_buffers(parts: _Parts, rt: RuntimeConfig, w: _Work, schedule: str, plan: PlacementPlan) -> int:
    """The upload/download rings on the host, the GPU's cast staging; returns the rings' bytes."""
    b = w.b
    # Mirrors SlideEngine: chunks of chunk_mb MiB of FP32; on CUDA the casts run on the
    # GPU (FP32 master registered in place, FP32 gradient ring, 4 GPU staging chunks).
    chunk_elems = rt.transfer.chunk_elems(w.P_L)
    gpu_cast = rt.casts_on_gpu(w.dev == "cuda")
    deferred = schedule == "deferred"          # gradients straight into the held buffers: no ring
    down_chunks = 0 if deferred else rt.download_chunks(w.P_L)
    downloads_fp32 = rt.downloads_fp32(w.dev == "cuda")
    rings = down_chunks * chunk_elems * (4 if downloads_fp32 else b)
    staging = 0
    if gpu_cast:
        staging += rt.transfer.upload_stages * chunk_elems * 4            # uploads: FP32 from the registered master
    else:
        rings += rt.transfer.upload_ring * chunk_elems * b
    if gpu_cast and downloads_fp32 and not plan.grad_slots_fp32 and not deferred:
        staging += 2 * chunk_elems * 4                           # the D2H stream's cast
    if staging:
        parts.gpu["fp32 cast staging"] = staging
    if not downloads_fp32 and not deferred:
        # widening into FP32 before AdamW where native_adamw's kernel cannot be built
        parts.host["fp32 drain scratch"] = chunk_elems * 4
    parts.host["upload/download rings"] = rings
    return rings


def _weight_loading_transient(split: SplitModel, w: _Work, plan: PlacementPlan, host: dict[str, int]) -> int:
    """Host bytes the model's build passes through before the first step, beyond the offloaded
    checkpoints it never coexists with."""
    # units kept on the device are built a parameter at a time (models.load.fill_on_device:
    # their largest matrix passes through RAM), disk-master units through a host buffer of the
    # whole unit (4 B/param), up to BUILD_WORKERS at once, beside the host units (HostStore)
    def largest(unit) -> int:
        return max((p.numel for p in unit.params), default=0)
    passing = ([largest(split.units[0]), largest(split.units[-1])] if plan.vocab_on_device else []) \
        + [largest(u) for u in split.layer_units[:plan.device_layers]] \
        + [largest(split.units[u.index]) for u in plan.busiest_shard_units()] \
        + [u.numel for u in plan.units if TIERS.with_files.holds_master(u)]
    building = sorted(passing, reverse=True)[:BUILD_WORKERS]
    # freed before the first step, when the offloaded checkpoints' slots are allocated (in
    # the first forward): the two never coexist, so only what the transient takes beyond
    # them raises the peak
    return max(0, max(w.largest_param, sum(building)) * 4 - host.get("offloaded checkpoints", 0))
