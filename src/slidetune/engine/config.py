"""Typed configuration of the training runtime (what runs where, in which precision).

RuntimeConfig holds the user's choices (mode, dtype, device, recompute, activation offload,
compile, the disk directory: top-level flags of `slidetune train`) and, in one section per
component, the pipeline's tuning knobs: `placement` (what lives on the GPU: engine/placement.py,
engine/fit/), `transfer` (PCIe staging and the GPU's gradient slots), `host` (the host's AdamW
worker and the pipeline's threads), `clip` (the update schedule and the clipped sweep), `disk`
(the disk tier), `layer` (the lean decoder layer) and `head` (the output layer).

The sections are an internal grouping: a knob's name is unique across them, so the CLI keeps
`--tuning.NAME` (`slidetune train --help-tuning`), YAML a flat `tuning:` section, config.json a
flat "tuning" group (config.py), and `RuntimeConfig(chunk_mb=64)` or
`dataclasses.replace(rt, chunk_mb=64)` route the name to its section. Code reads
`rt.transfer.chunk_mb`.

Each knob is declared once, with `tuning_field`: its measured default, a one-line `help` and a
one-line `when` (its whole documentation; a comment above keeps a reason only where help does
not say it). A choice is typed `Literal[...]`; one validator (check_fields) checks those and the
ranges declared with `valid=` (and every field's type: fields.py, shared with the other config
classes), and gives argparse its `choices` (literal_choices). Measurement history lives in
benchmarks/NOTES.md and benchmarks/LOG.md.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass, field
from typing import Literal

import torch

from ..fields import TUNING_SECTION, check_fields, checked_field, literal_choices  # noqa: F401 - re-exported
from .adamw import FP32_ADAMW, OptimizerState, optimizer_state

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


@dataclass(frozen=True)
class TuningDoc:
    """What a tuning knob is (help) and when a user should touch it (when): one line each."""
    help: str
    when: str


def tuning_field(default, *, help: str, when: str, valid=None, normalize=None):  # noqa: A002 - argparse's word
    """A section field that is a pipeline tuning knob rather than a user's choice: its default is
    measured, `help` says what it is and `when` when to change it (shown by --help-tuning). Both
    must be one line: they are the knob's whole documentation there. `valid`: (predicate, rule)
    for a numeric range (the message says "NAME must be RULE"); `normalize`: a function of
    (value, name) that maps other spellings to the canonical value (and refuses the rest)."""
    if not help.strip() or not when.strip() or "\n" in help + when:
        raise ValueError("tuning_field needs a one-line help and a one-line when")
    return checked_field(default, valid=valid, normalize=normalize,
                         **{TUNING_SECTION: TuningDoc(help.strip(), when.strip())})


def _count_or_auto(v) -> bool:
    return v >= -1


_COUNT_OR_AUTO = (_count_or_auto, ">= 0, or -1 for auto")


def _on_off_auto(value, name: str) -> str:
    """auto | on | off, from those or a bool or true/false/yes/no/1/0 (YAML, older configs)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    text = str(value).strip().lower()
    if text in ("on", "true", "yes", "1"):
        return "on"
    if text in ("off", "false", "no", "0"):
        return "off"
    if text == "auto":
        return "auto"
    raise ValueError(f"{name} must be auto, on or off, not {value!r}")


def _disk_master(value, name: str = "disk_master") -> str:
    """disk_master: off | on | auto, or a count of disk units ("2", 2); on/off also from booleans."""
    text = str(value).strip().lower()
    if isinstance(value, int) and not isinstance(value, bool) or text.isdigit():
        if int(text) < 0:
            raise ValueError(f"{name} must be off, on, auto or a count of disk units, not {value!r}")
        return str(int(text)) if int(text) else "off"
    try:
        return _on_off_auto(value, name)
    except ValueError:
        raise ValueError(f"{name} must be off, on, auto or a count of disk units, not {value!r}") from None


def _disk_units(value, name: str = "disk_units"):
    """A count (an int), a fraction 0 < x < 1 of the units that may go to disk, or -1 (auto)."""
    if value < -1 or (value >= 1 and value != int(value)):
        raise ValueError(f"{name} must be a count, a fraction between 0 and 1, or -1 for auto, not {value}")
    return int(value) if value == int(value) else value


# the devices the engines run on: a CUDA device by index or not, the CPU, or auto (cuda if available)
_DEVICE = (lambda v: re.fullmatch(r"auto|cpu|cuda(:\d+)?", v) is not None, "auto, cpu, cuda or cuda:N")
_RECOMPUTE_FORMS = 'all, none, every:K (K >= 1) or a comma list of layer numbers such as "0,3,7"'


def _recompute(value, name: str = "recompute") -> str:
    """The ckpt-mode layer selection in one spelling: all, none, every:K or "0,3,7" (sorted, once
    each); "" is all. The layers' range needs the model: recompute_set checks it."""
    text = str(value).strip().lower().replace(" ", "")
    if text in ("all", "", "none"):
        return text or "all"
    try:
        if text.startswith("every:"):
            k = int(text.split(":", 1)[1])
            if k >= 1:
                return f"every:{k}"
        else:
            layers = sorted({int(x) for x in text.split(",")})
            if layers[0] >= 0:
                return ",".join(map(str, layers))
    except ValueError:          # int("banana"), int("") of "0,,3": refused below
        pass
    raise ValueError(f"{name} must be {_RECOMPUTE_FORMS}, not {value!r} (--recompute)")


class _Section:
    """A section of tuning knobs: frozen (a replaced RuntimeConfig may share it), checked at build."""

    def __post_init__(self):
        check_fields(self, "runtime")


@dataclass(frozen=True)
class PlacementTuning(_Section):
    """Where the state and weights live: what PlacementPlan.build (engine/placement.py) places and
    engine.fit.choose_auto_settings resolves (-1/auto: as it fits this machine; left unresolved, as
    an engine built directly: a 3-slot window, nothing on the GPU, every checkpoint offloaded)."""
    # a slot per layer keeps the weights on the GPU between steps, each uploaded once as its update
    # lands, so the forward never waits on PCIe (Qwen3-8B b16: 2.65 -> 2.36 s)
    cache_units: int = tuning_field(
        -1, help="GPU layer slots: -1 auto, 0 one per layer (weights stay on the GPU), N >= 2 a window of N",
        when="auto picks 0 where everything fits, else 3; a window of 3-4 frees GPU memory for a larger batch",
        valid=(lambda v: v in (-1, 0) or v >= 2, ">= 2 (one computing, one loading), 0 for one per layer or -1 "
                                                 "for auto"))
    # a resident layer is uploaded once a step instead of twice (forward and backward); the
    # all-window placement spent 40% of Qwen3-14B b8's H2D time outside compute on an H200
    resident_layers: int = tuning_field(
        -1, help="with a window: the lowest N host-updated layers get a GPU slot of their own (-1 auto)",
        when="lower it to give GPU memory back to the batch; auto fills what the GPU has left", valid=_COUNT_OR_AUTO)
    # the optimizer's state (FP32_ADAMW) and a weight slot of its own on the GPU a layer (the held
    # gradient too, deferred); the host's AdamW loses their share (Qwen3-8B b16 on the H100:
    # 8 layers, 2.22 -> 1.75 s)
    device_layers: int = tuning_field(
        -1, help="the lowest N layers keep master and AdamW state on the GPU, updated there (-1 auto: as fit)",
        when="0 keeps every layer's state on the host (a DeepSpeed-like comparison); lower it to free GPU memory",
        valid=_COUNT_OR_AUTO)
    # data parallel on one host: N GPUs hold N times the optimizer state of one, where device_layers
    # keeps a copy on every GPU (Llama-3.1-70B's 789 GiB of master and moments do not fit an 8-GPU
    # host's RAM and 220 GiB disk, but fit its GPUs and RAM together)
    shard_layers: int = tuning_field(
        -1, help="data parallel: N layers above the device and resident layers keep master and AdamW state on one "
                 "GPU of the host each (their owner's, round robin), which updates them and broadcasts their "
                 "weights to the others through the window; one rank per host: device layers. -1 auto: none "
                 "where the host holds the rest, else the fewest that make it",
        when="0 to keep the state off the GPUs (the disk tier then takes what the host cannot); N to put more "
             "of a large model's state on the host's GPUs (plan --gpus N says what fits)",
        valid=_COUNT_OR_AUTO)
    # device: ~5 ms each at HBM speed, off PCIe and off the host's AdamW (Llama-3.1-8B b16: ~0.23 s
    # of a 2.1 s step), for the optimizer's bytes per parameter of the vocabulary on the GPU
    vocab_update: Literal["auto", "host", "device"] = tuning_field(
        "auto", help="where the embedding and head are updated: device (GPU), host, or auto (device where it fits)",
        when=f"host to free {FP32_ADAMW.bytes_per_param} B/param of the vocabulary on the GPU (the optimizer's "
             f"state); device to insist on it")
    # each kept checkpoint is B x S x d compute-dtype bytes less of pinned host RAM and of PCIe each
    # way (an 8B layer's at 1 x 128K tokens: 1 GiB); the backward reads the kept ones first
    gpu_checkpoints: int = tuning_field(
        -1, help="with --offload-activations: the last N layers' input checkpoints stay on the GPU (-1 auto)",
        when="lower to free GPU memory; raise where the backward's first layers wait for their prefetch",
        valid=_COUNT_OR_AUTO)


@dataclass(frozen=True)
class TransferTuning(_Section):
    """PCIe staging and the GPU's gradient slots (engine/slide/transfer.py, slots.py, grad_sum.py)."""
    cast_on: Literal["auto", "cpu", "gpu"] = tuning_field(
        "auto", help="where FP32 <-> compute-dtype casts run: auto (gpu on CUDA), gpu or cpu",
        when="cpu where page-locking the FP32 masters fails (a low `ulimit -l`): small pinned buffers instead")
    chunk_mb: int = tuning_field(
        256, help="cast/copy/update granularity in MiB of FP32 (256 beat 64 by 4% on 8B layers)",
        when="lower (64) where pinned host RAM is short; units smaller than a chunk use one chunk anyway")
    upload_ring: int = tuning_field(
        4, help="pinned staging chunks for uploads (chunk_mb each)",
        when="raise when a profile shows uploads waiting for a staging chunk; lower to save pinned RAM")
    upload_stages: int = tuning_field(
        2, help="GPU FP32 staging chunks per upload when the cast runs on the copy stream",
        when="rarely: raise when an upload's cast waits for a free staging chunk", valid=(lambda v: v >= 1, ">= 1"))
    # a cast kernel on the copy stream needs SMs while the GEMMs hold them; "compute" casts a whole
    # unit on the compute stream right before it runs (0.5 ms an 8B layer), for FP32 slot buffers
    upload_cast_stream: Literal["copy", "compute"] = tuning_field(
        "copy", help="where GPU casts run: copy (a kernel on the copy stream) or compute (whole unit, FP32 slots)",
        when="compute where copy-stream casts stall behind the GEMMs (H2D gaps in a profile) and the GPU has room")
    # one being written, one draining, one of slack; under deadline order with every layer resident
    # the slots also hold the upper layers' gradients until the host gets to them
    grad_slots: int = tuning_field(
        0, help="GPU gradient slots (0 auto: 3, or 16 under deadline order with every layer resident)",
        when="raise when a profile shows the backward waiting for a free gradient slot; lower to save GPU memory",
        valid=(lambda v: v >= 0, ">= 1, or 0 for auto"))
    # FP32 slots make the backward's copy into the slot the cast (2 B/param more a slot;
    # Llama-3.1-8B b16: 2.38 -> 2.16 s); left unresolved, compute
    grad_slot_dtype: Literal["auto", "compute", "fp32"] = tuning_field(
        "auto", help="gradient slots in the compute dtype or FP32 (auto: fp32 where it fits and downloads are fp32)",
        when="fp32 with --tuning.grad_download fp32 where D2H casts wait for SMs; compute to save GPU memory")
    # compute: half the D2H bytes, and the host's AdamW widens them in its own kernel (reads 26
    # instead of 28 B/param of DRAM); without a C compiler the host widens into a scratch chunk
    grad_download: Literal["compute", "fp32"] = tuning_field(
        "compute", help="dtype gradients cross PCIe in: compute (the host's AdamW widens them) or fp32",
        when="fp32 only to A/B: it doubles the D2H bytes and the host's DRAM traffic rises 26 -> 28 B/param")
    download_ring: int = tuning_field(
        0, help="pinned staging chunks for gradient downloads (0 auto: 8 layers under deadline order, 3 fifo)",
        when="raise where host RAM allows and the backward's last layers wait for AdamW; lower to save pinned RAM")
    # fused: one Triton pass over up to 4 held micro-batch gradients into the slot (10 B/param of
    # HBM traffic against torch's 42 at 4 micro-batches, the same bits; checked at first use)
    grad_sum: Literal["auto", "fused", "torch"] = tuning_field(
        "auto", help="how a layer's micro-batch gradients are summed on the GPU: auto (fused on CUDA with "
                     "Triton), fused or torch",
        when="torch to A/B the fused sum, or where Triton misbehaves; only matters with gradient accumulation")
    # gather reads the master once and each NVLink carries its shard (2x H100 NV18, Qwen3-8B b16/GPU
    # clipped: gather 2.267 s a step, upload 2.327 s); one rank: ignored
    dp_weights: Literal["upload", "gather"] = tuning_field(
        "gather", help="data parallel: gather (a host unit's owner uploads it and broadcasts it to the host's "
                       "other GPUs) or upload (every rank uploads every host unit)",
        when="upload where the host's GPUs have no NVLink between them (the broadcasts then cross PCIe "
             "beside the uploads); measure with bench throughput --gpus --runtime dp_weights=upload")

    # --gpu-memory-limit emulates a smaller card's memory, not its link: the H200 VM's Gen5 x16
    # moves ~50 GB/s pinned each way, an RTX 4090's PCIe 4.0 x16 ~25 (engine/slide/pacing.py)
    pcie_gbps: float | None = tuning_field(
        None, help="cap each direction of the weights' uploads and the gradients' downloads at this many GB/s "
                   "(decimal; unset: no cap)",
        when="to emulate a slower card's link on a faster host, beside --gpu-memory-limit (25 for PCIe 4.0 x16)",
        valid=(lambda v: v > 0, "> 0 GB/s"))

    def chunk_elems(self, layer_numel: int, align: int = 1) -> int:
        """Elements per transfer chunk: chunk_mb MiB of FP32 (the host-side element size), but
        no more than one decoder layer: a small model must not get 256 MB staging buffers.
        Units larger than a chunk (the vocabulary matrices) stream through in pieces.
        align: a multiple of it (8-bit moments: their block, so every update range starts on one)."""
        chunk = max(1, min(self.chunk_mb * 2**20 // 4, layer_numel))
        return max(align, chunk - chunk % align)


@dataclass(frozen=True)
class HostOptimizerTuning(_Section):
    """The host's AdamW worker (engine/native_adamw.py) and how the pipeline's threads run beside it."""
    # deadline: the unit the next forward needs first goes first among those whose gradients are
    # down, so the upper layers' updates overlap the next forward; needs the gradient ring's backlog
    update_order: Literal["deadline", "fifo"] = tuning_field(
        "deadline", help="order of the eager host updates: deadline (the next forward's first units first) or fifo",
        when="fifo only to A/B the deadline order or to shrink the gradient ring to 3 layers")
    # an AdamW thread preempted mid-block holds the whole parallel region: on CUDA one core is left
    # to the launching thread (3.30 -> 4.88 G params/s beside it; Qwen3-4B b8 1.01 -> 0.90 s)
    host_threads: int = tuning_field(
        0, help="intra-op threads of the host's AdamW worker (0 auto: all cores but one on CUDA)",
        when="lower when other processes share the host's cores; auto leaves a core to the launching thread",
        valid=(lambda v: v >= 0, ">= 1, or 0 for torch's default"))
    # dynamic: one OpenMP loop whose threads claim 32K-element blocks, run without the GIL (5.26 G
    # params/s alone on the H100 host, static 4.66); no C compiler: torch's (logged)
    host_adamw: Literal["dynamic", "static", "torch"] = tuning_field(
        "dynamic", help="the host's AdamW kernel: dynamic or static (native OpenMP loops) or torch (its fused one)",
        when="torch to rule the native kernel out; static to A/B the schedule (dynamic measured 13% faster)")
    cuda_waits: Literal["block", "spin"] = tuning_field(
        "block", help="how host threads wait on the GPU: block (sleep) or spin (CUDA's default)",
        when="spin only to A/B: a spinning waiter slowed the host's AdamW by up to 41%")
    # each torch call of the host's AdamW loop gives the GIL up and waits up to this long to take it
    # back behind a busy compute thread (0.87x at 0.5 ms for ~16 ms chunks, ~0.97x at 0.2 ms)
    gil_switch_ms: float = tuning_field(
        0.5, help="Python's GIL switch interval while the slide engine runs, in ms (0.01-100)",
        when="lower (0.2) when the host's AdamW waits for the GIL behind a busy compute thread",
        valid=(lambda v: 0.01 <= v <= 100, "within 0.01-100 ms"))
    gc_freeze: bool = tuning_field(
        True, help="after step 1, move every live object into the GC's permanent generation",
        when="off only to debug leaks: a full collection then stops the compute thread (0.54 s in a 1.06 s step)")


@dataclass(frozen=True)
class ClipScheduleTuning(_Section):
    """When updates run, and the clipped (deferred) schedule's host sweep and held gradients
    (engine/slide/deferred.py)."""
    # deferred: gradients wait where they landed (host units' in the compute dtype, 2 B/param of RAM
    # for BF16) until the global norm is known; the clipped sweep overlaps the next forward
    schedule: Literal["auto", "eager", "deferred"] = tuning_field(
        "auto", help="when updates run: eager (as each gradient completes) or deferred (after the global norm); auto",
        when="leave auto (deferred when clipping, else eager); eager cannot clip, deferred without clipping only A/Bs")
    # split was as fast or faster everywhere measured (Llama-3.1-8B b8, 24 GiB GPU: 2.54 s against
    # whole's 2.61); weights: no gain measured yet (NOTES.md "PCIe uploads"), to be A/B'd
    clip_sweep: Literal["split", "weights", "whole"] = tuning_field(
        "split", help="the clipped schedule's host sweep: split (weights first, moments under the next step), "
                      "weights (BF16 weights for the upload first, master and moments under the next step; "
                      "2 B/param more host RAM) or whole",
        when="weights to A/B on a host whose DRAM the weights pass binds (BF16 compute, one rank); whole only "
             "to A/B: split was as fast or faster everywhere measured")
    # with one buffer the moments pass paced the next backward (0.43 s of gradient-slot waits a
    # step on the H100); two: Qwen3-8B b16 clipped 2.221 -> 2.146 s for +9.7 GiB of RSS
    held_buffers: Literal[-1, 1, 2] = tuning_field(
        -1, help="the clipped schedule's held gradient buffers per host unit: 1, 2 (on alternate steps) or -1 "
                "(auto: 2 where host RAM has room, for every host unit or the lowest that fit)",
        when="2 where the compute thread waits for gradient slots in a clipped step (wait_grad_slot in a "
             "profile) and host RAM has 2 B/param to spare")
    # the backward catches the moments pass from the head down, so the units it reaches last (the
    # lowest) are the ones worth a second buffer
    held_second_units: int = tuning_field(
        -1, help="with --tuning.held_buffers 2: host-updated units with the second buffer, from the embedding up "
                 "(-1: all)",
        when="set by held_buffers auto where host RAM has room for some units' second buffer, not all",
        valid=(lambda v: isinstance(v, int) and v >= -1, "a count >= 0, or -1 for all"))
    # A decoder layer's held gradient buffer is idle from the clipped sweep's read of it (whole: its
    # one pass) until the next backward reaches the layer, the span in which the layer's offloaded
    # input checkpoint lives: the checkpoint can borrow it, and only what exceeds the buffer takes a
    # slot of its own (Qwen3-8B b64 x 1024: a 0.50 GiB checkpoint against a 0.38 GiB gradient)
    checkpoints_in_held: Literal["off", "on"] = tuning_field(
        "off", help="offloaded layer-input checkpoints borrow their layer's held gradient buffer (host RAM for "
                    "the larger of the two, not both); needs the clipped schedule, --tuning.clip_sweep whole and "
                    "one held buffer",
        when="on where host RAM cannot hold both the offloaded checkpoints and the held gradients (the whole "
             "sweep may cost the next forward: measure it)")


@dataclass(frozen=True)
class DiskTuning(_Section):
    """The disk tier (engine/slide/disk_tier.py) under --disk-dir: which units' state lives in its
    files (the head, then decoder layers from the top down), and its blocks, buffers and threads."""
    disk_units: float = tuning_field(
        -1, help="units whose AdamW moments live under --disk-dir: a count, a fraction, or -1 auto (fewest that fit)",
        when="more to leave host RAM to other work; fewer where the disk's bandwidth binds the step",
        normalize=_disk_units)
    disk_master: str = tuning_field(
        "auto", help="the FP32 masters of disk units on disk too: off, on, auto (only where RAM needs it) or a count",
        when="on to leave host RAM ~2 B/param of a disk unit; off where the disk's bandwidth binds (24 vs 16 B/param)",
        normalize=_disk_master)
    disk_block_mb: float = tuning_field(
        64, help="disk I/O block in MiB: one block's moments (m and v) per pinned buffer",
        when="raise for disks that want larger requests; lower to save pinned RAM (buffers x block)",
        valid=(lambda v: v > 0, "> 0"))
    # the read-ahead is as deep as the buffers: in a clipped step the update waits for the clip
    # coefficient, and 8 buffers left the disk idle (Qwen3-8B, 4 layers on disk: 64 took 7.03 -> 5.53 s)
    disk_buffers: int = tuning_field(
        -1, help="pinned block buffers: reads ahead, the block in AdamW, writes behind (>= 3, or -1: auto, "
                 "as many as host RAM has room for, up to half the disk units' blocks)",
        when="lower to leave pinned RAM to something else; each costs disk_block_mb of pinned RAM",
        valid=(lambda v: v >= 3 or v == -1, ">= 3 (one read ahead, one in AdamW, one written behind; or -1, auto)"))
    disk_io_threads: int = tuning_field(
        4, help="threads issuing preadv/pwritev (each releases the GIL)",
        when="raise for NVMe with deep queues or striped disks; lower on one slow disk",
        valid=(lambda v: v >= 1, ">= 1"))

    def disk_master_units(self, disk_units: int) -> int:
        """How many of `disk_units` disk units keep their master on disk (the first ones in disk
        order): every one for on, none for off or an unresolved auto, else the count."""
        if self.disk_master == "on":
            return disk_units
        if self.disk_master in ("off", "auto"):
            return 0
        return min(disk_units, int(self.disk_master))


@dataclass(frozen=True)
class LayerTuning(_Section):
    """The lean decoder layer (models/lean_layer.py): HF's arithmetic for Llama-style families with
    RMSNorms that save only their input and 1/rms, and the MLP half in token tiles."""
    # auto: engine.fit's ladder of recipes takes it only where its working set makes the run fit
    lean_layer: Literal["auto", "on", "off"] = tuning_field(
        "auto", help="lean decoder layer (lean RMSNorm backward, MLP in token tiles): auto, on or off",
        when="off to compare with HF's own layer; on refuses a family whose layer is not Llama's",
        normalize=_on_off_auto)
    mlp_tile_tokens: int = tuning_field(
        8192, help="tokens per MLP tile of the lean layer's recompute + backward",
        when="lower when one layer's working set does not fit; each tile more costs time (2 vs 1 at 16K: +8%, "
             "NOTES.md \"Lean layer\")", valid=(lambda v: v >= 1, ">= 1"))
    # row tiles bound what the attention half saves (Qwen3-8B b64 x 1024: 8.5 -> ~4.9 GiB in tiles of
    # 16 sequences); each tile more adds an FP32 sum of the layer's gradients (0.7 GiB a Qwen3-8B layer)
    layer_row_tokens: int = tuning_field(
        16384, help="the lean layer's recompute + backward a few sequences at a time: at most this many tokens "
                    "a row tile (at least one sequence)",
        when="lower when one layer's working set does not fit at a large batch; 0 runs every row at once",
        valid=(lambda v: v >= 0, ">= 0 (0: no row tiles)"))
    lean_kernels: Literal["auto", "torch", "liger"] = tuning_field(
        "auto", help="the lean layer's RMSNorm, SwiGLU and rotary kernels: auto (torch for now), torch or liger "
                     "(Liger's Triton kernels: CUDA, pip install 'slidetune[liger]')",
        when="liger to A/B Liger's kernels against torch on a GPU; auto takes them once measured faster")


@dataclass(frozen=True)
class HeadTuning(_Section):
    """The output layer and its loss (ops/cross_entropy.py)."""
    # auto: fused on CUDA where Triton imports (Qwen3-8B's head at 16K tokens: 73 ms and 6.2 GiB
    # against chunked's 104 ms and 8.3 GiB on the H100), chunked elsewhere
    head_impl: Literal["auto", "full", "chunked", "fused"] = tuning_field(
        "auto", help="output layer: full logits, chunked (head_chunk_tokens at a time), fused (Triton), or auto "
                     "(fused on CUDA, else chunked)",
        when="full only for small vocabularies and short sequences; chunked keeps the logits' peak bounded")
    head_chunk_tokens: int = tuning_field(
        4096, help="tokens per logits chunk (4096 x 152k vocab x 2 B = 1.2 GB)",
        when="lower when the head's peak does not fit the GPU; higher rarely helps")


# RuntimeConfig's sections: attribute -> class, in --help-tuning's order
SECTIONS: dict[str, type] = {"placement": PlacementTuning, "transfer": TransferTuning, "host": HostOptimizerTuning,
                             "clip": ClipScheduleTuning, "disk": DiskTuning, "layer": LayerTuning, "head": HeadTuning}
# knob name -> the section that holds it (names are unique across sections: --tuning.NAME is flat)
KNOB_SECTION: dict[str, str] = {f.name: s for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


def tuning_docs() -> dict[str, TuningDoc]:
    """The tuning knobs, section by section in declaration order: knob name -> its TuningDoc."""
    return {f.name: f.metadata[TUNING_SECTION] for cls in SECTIONS.values() for f in dataclasses.fields(cls)}


def runtime_fields() -> dict[str, dataclasses.Field]:
    """RuntimeConfig's settings by their flat name: the user's fields, then every section's knobs
    (the namespace of the CLI, YAML, config.json and RuntimeConfig(**kwargs))."""
    user = {f.name: f for f in dataclasses.fields(RuntimeConfig) if f.name not in SECTIONS}
    return {**user, **{f.name: f for cls in SECTIONS.values() for f in dataclasses.fields(cls)}}


def cli_flag(name: str) -> str:
    """The command-line spelling of a RuntimeConfig field: `--tuning.NAME` for a tuning knob,
    `--the-name` for a user's flag (the spelling messages that suggest a change must use)."""
    if name in KNOB_SECTION:
        return f"--{TUNING_SECTION}.{name}"
    return "--" + name.replace("_", "-")


def _route_knobs(init):
    """RuntimeConfig's __init__ also takes the knobs by their flat names (`RuntimeConfig(chunk_mb=64)`,
    `dataclasses.replace(rt, chunk_mb=64)`, a config's flat "tuning" group): each goes into its
    section, over the section given (or the defaults)."""
    @functools.wraps(init)
    def __init__(self, **kwargs):
        knobs: dict[str, dict] = {}
        for name in [k for k in kwargs if k in KNOB_SECTION]:
            knobs.setdefault(KNOB_SECTION[name], {})[name] = kwargs.pop(name)
        for section, changes in knobs.items():
            given = kwargs.get(section)
            if isinstance(given, dict):
                given = SECTIONS[section](**given)
            kwargs[section] = dataclasses.replace(given or SECTIONS[section](), **changes)
        init(self, **kwargs)
    return __init__


def _runtime_config(cls):
    cls.__init__ = _route_knobs(cls.__init__)
    return cls


@_runtime_config
@dataclass
class RuntimeConfig:
    mode: Literal["gpu", "ckpt", "slide"] = "slide"     # gpu | ckpt | slide
    # compute precision: auto | bf16 | fp32 | fp16. auto (device.resolve_dtype): bf16 where the device
    # computes it natively (a CUDA GPU with bf16, a CPU with AMX-BF16 or AVX512-BF16), else fp32
    dtype: Literal["auto", "bf16", "fp32", "fp16"] = "auto"
    device: str = checked_field("auto", valid=_DEVICE)     # auto -> cuda if available else cpu
    # ckpt mode: which decoder layers recompute their activations in backward; checked in every
    # mode, so that a typo is refused where the field is not read too
    recompute: str = checked_field("all", normalize=_recompute)     # all | none | comma list "0,3,7" | "every:k"
    # Layer-input checkpoints in pinned host memory (on), on the GPU (off), or auto: off where the
    # run fits with every checkpoint on the GPU, else on, with gpu_checkpoints auto keeping as many
    # there as fit (engine.fit.choose_auto_settings); left unresolved, off.
    offload_activations: Literal["auto", "on", "off"] = checked_field("auto", normalize=_on_off_auto)
    # torch.compile the decoder layers' forward (slide mode; one graph per kind of layer,
    # recompute and backward included): 18% less layer time on the H100 for a ~40 s compile at
    # the first step. auto: on CUDA where the planned run earns the compile back 2.5x over
    # (engine/compile_policy.py; `slidetune train` prints the estimate); left unresolved (an
    # engine built directly, a benchmark) it means off. on | off (true | false) force it.
    compile_layers: Literal["auto", "on", "off"] = checked_field("auto", normalize=_on_off_auto)
    # Where the compiled layers are kept between runs (engine/compile_cache.py: inductor's FX-graph and
    # AOTAutograd caches, Triton's kernels with them): None -> $XDG_CACHE_HOME/slidetune/compile (else
    # ~/.cache/slidetune/compile); "off": torch's defaults (/tmp, emptied at reboot). A
    # TORCHINDUCTOR_CACHE_DIR the user set is kept.
    compile_cache_dir: str | None = None
    # The disk tier's directory (--tuning.disk_units and disk_master say what goes there)
    disk_dir: str | None = None
    # AdamW's moments of the host-updated units: fp32 (exact, the default), or bf16 / 8bit (issue 46:
    # 8 -> 4 or ~2 B/param of host RAM; engine/adamw.py OPTIMIZER_STATES). A runtime field, not an
    # optimizer one: the placement plan and the fit read it. Units updated on the GPU stay FP32.
    moments: Literal["fp32", "bf16", "8bit"] = "fp32"
    # the host-updated units' master weights: fp32 (the default) or bf16, rounded stochastically at
    # each update (issue 46: 4 -> 2 B/param; the uploads then copy it as it is, no cast)
    master: Literal["fp32", "bf16"] = "fp32"
    placement: PlacementTuning = field(default_factory=PlacementTuning)
    transfer: TransferTuning = field(default_factory=TransferTuning)
    host: HostOptimizerTuning = field(default_factory=HostOptimizerTuning)
    clip: ClipScheduleTuning = field(default_factory=ClipScheduleTuning)
    disk: DiskTuning = field(default_factory=DiskTuning)
    layer: LayerTuning = field(default_factory=LayerTuning)
    head: HeadTuning = field(default_factory=HeadTuning)

    def __post_init__(self):
        check_fields(self, "runtime")
        if self.host_state is not FP32_ADAMW and (self.mode != "slide" or self.host.host_adamw == "torch"):
            raise ValueError(f"{self.host_state.flags} keeps the host units' state compact, in slide mode through "
                             f"the native host AdamW: it needs --mode slide and --tuning.host_adamw dynamic or static "
                             f"(got --mode {self.mode}, --tuning.host_adamw {self.host.host_adamw})")
        if self.disk.disk_units > 0 and not self.disk_dir:
            raise ValueError("--tuning.disk_units needs a disk directory: --disk-dir PATH (a local disk with room "
                             f"for {FP32_ADAMW.moment_bytes} bytes per parameter of those units)")

    @property
    def host_state(self) -> OptimizerState:
        """What the host-updated units keep per parameter (--master, --moments; FP32_ADAMW by default)."""
        return optimizer_state(self.master, self.moments)

    def setting(self, name: str):
        """A setting by its flat name, a user's field or a knob (for code that walks them by name:
        config.json, --help-tuning, the fit's fill of counts, the CLI's suggestions)."""
        return getattr(getattr(self, KNOB_SECTION[name]), name) if name in KNOB_SECTION else getattr(self, name)

    def to_flat(self) -> dict:
        """Every setting by its flat name (runtime_fields' order): a results file's "runtime" record,
        and what `RuntimeConfig(**d)` builds back."""
        return {name: self.setting(name) for name in runtime_fields()}

    @property
    def torch_dtype(self) -> torch.dtype:
        """The compute dtype; auto, unresolved (an engine built directly), as train resolves it on
        this config's device (device.resolve_dtype)."""
        if self.dtype == "auto":
            from ..device import resolve_dtype
            device = self.device if self.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
            return DTYPES[resolve_dtype("auto", torch.device(device).type)[0]]
        return DTYPES[self.dtype]

    def compiles_layers(self) -> bool:
        """Whether the slide engine compiles its layers (auto, unresolved: no)."""
        return self.compile_layers == "on"

    def recomputed_layers(self, num_layers: int) -> set[int]:
        """The decoder layers whose forward runs again in the backward: every layer in slide mode
        (the engine keeps a layer's input only, and recomputes the layer before its backward),
        the `recompute` selection in ckpt mode (plain.py checkpoints those), none in gpu mode."""
        if self.mode == "slide":
            return set(range(num_layers))
        return recompute_set(self.recompute, num_layers) if self.mode == "ckpt" else set()

    # Layers of gradients the pinned ring holds under update_order=deadline: the backlog still queued
    # when the backward ends (~11 layers, Qwen3-8B b16 compiled); 8 (6.2 GB pinned for an 8B model)
    # keeps the host within 12.5 B/param + 8 GiB (NOTES.md "Gradient downloads")
    DEADLINE_RING_LAYERS = 8
    # GPU gradient slots under deadline order with every layer resident: the end-of-backward backlog
    # (~18 layers of an 8B model, NOTES.md "Update order") minus the ring; 0.39 GB each for an 8B layer
    DEADLINE_GRAD_SLOTS = 16

    def resolved_grad_slots(self, num_layers: int, eager: bool = True) -> int:
        if self.transfer.grad_slots:
            return self.transfer.grad_slots
        # only with every layer resident: a step from 3 to 16 slots as the first layer became
        # resident would stop choose_auto_settings' fill of resident layers at none
        resident = self.placement.cache_units == 0
        if eager and resident and self.host.update_order == "deadline":
            return max(3, min(self.DEADLINE_GRAD_SLOTS, num_layers))
        return 3

    def download_chunks(self, layer_numel: int) -> int:
        """Pinned gradient ring, in chunks. fifo: three layers (one filling, one in AdamW, one
        of slack); deadline: DEADLINE_RING_LAYERS layers, so the backward never waits for
        AdamW while updates are reordered."""
        layers = self.DEADLINE_RING_LAYERS if self.host.update_order == "deadline" else 3
        chunks = -(-layers * layer_numel // self.transfer.chunk_elems(layer_numel))
        return self.transfer.download_ring or max(4, chunks)

    def downloads_fp32(self, is_cuda: bool) -> bool:
        """Whether gradients land in host memory as FP32: FP32 slots, or a cast on the GPU's D2H
        stream (grad_download=fp32 with GPU casts). Otherwise in the compute dtype."""
        return self.grad_slots_fp32() or (self.casts_on_gpu(is_cuda) and self.transfer.grad_download == "fp32")

    @property
    def offloads_activations(self) -> bool:
        """Whether layer-input checkpoints go to pinned host memory (auto left unresolved: no)."""
        return self.offload_activations == "on"

    @property
    def resolved_head_impl(self) -> str:
        """The output layer's implementation, auto resolved for this config's device."""
        if self.head.head_impl != "auto":
            return self.head.head_impl
        from ..ops.cross_entropy import auto_impl
        device = ("cuda" if torch.cuda.is_available() else "cpu") if self.device in (None, "auto") \
            else torch.device(self.device).type
        return auto_impl(device)

    def grad_slots_fp32(self) -> bool:
        """Whether the gradient slots are FP32 (auto, unresolved, means the compute dtype)."""
        return self.transfer.grad_slot_dtype == "fp32"

    def resolved_host_threads(self, is_cuda: bool) -> int:
        """The host worker's AdamW threads: host_threads, or for 0 one core left to the compute
        thread on CUDA (all of torch's on the CPU)."""
        if self.host.host_threads:
            return self.host.host_threads
        cores = torch.get_num_threads()
        return max(1, cores - 1) if is_cuda else cores

    def casts_on_gpu(self, is_cuda: bool) -> bool:
        return is_cuda and self.transfer.cast_on in ("auto", "gpu")

    def resolved_schedule(self, grad_accum: int, max_grad_norm: float | None) -> str:
        """eager, or deferred where clipping needs the global norm first. Accumulation needs
        neither: a unit's micro-batches are summed on the GPU before its update."""
        needs_deferred = max_grad_norm is not None and max_grad_norm > 0
        if self.clip.schedule == "eager" and needs_deferred:
            raise ValueError("the eager schedule updates each unit as soon as its gradient is complete, so it "
                             "cannot clip by the global norm; use --tuning.schedule deferred (or auto)")
        if self.clip.schedule == "auto":
            return "deferred" if needs_deferred else "eager"
        return self.clip.schedule


def recompute_set(spec: str, num_layers: int) -> set[int]:
    """The ckpt-mode layer selection of a model of `num_layers` layers."""
    spec = _recompute(spec)
    if spec == "all":
        return set(range(num_layers))
    if spec == "none":
        return set()
    if spec.startswith("every:"):
        return set(range(0, num_layers, int(spec.split(":", 1)[1])))
    layers = {int(x) for x in spec.split(",")}
    bad = sorted(i for i in layers if i >= num_layers)
    if bad:
        raise ValueError(f"--recompute names layers {bad}, but the model's layers are 0..{num_layers - 1}")
    return layers
