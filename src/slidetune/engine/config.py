"""Typed configuration of the training runtime (what runs where, in which precision).

Two kinds of field. The user's choices (mode, dtype, device, recompute, activation offload,
compile, the disk directory) are plain fields, top-level flags of `slidetune train`. The
pipeline's tuning knobs (rings, chunk sizes, streams, wait modes, update order, disk blocks...)
are declared with `tuning_field`, which carries their one-line help and when to touch them;
the CLI shows them under `--tuning.NAME` (`slidetune train --help-tuning`), YAML under
`tuning:`, and the resolved config.json groups them under "tuning" (config.py). Their
defaults were measured (benchmarks/NOTES.md); the comment above each keeps the reason.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}

TUNING_SECTION = "tuning"       # the YAML section, config.json group and flag prefix of the knobs


@dataclass(frozen=True)
class TuningDoc:
    """What a tuning knob is (help) and when a user should touch it (when): one line each."""
    help: str
    when: str


def tuning_field(default, *, help: str, when: str):  # noqa: A002 - argparse's word for it
    """A RuntimeConfig field that is a pipeline tuning knob rather than a user's choice: its
    default is measured, `help` says what it is and `when` when to change it (shown by
    --help-tuning). Both must be one line: they are the knob's whole documentation there."""
    if not help.strip() or not when.strip() or "\n" in help + when:
        raise ValueError("tuning_field needs a one-line help and a one-line when")
    return field(default=default, metadata={TUNING_SECTION: TuningDoc(help.strip(), when.strip())})


def tuning_docs() -> dict[str, TuningDoc]:
    """RuntimeConfig's tuning knobs, in declaration order: field name -> its TuningDoc."""
    return {f.name: f.metadata[TUNING_SECTION] for f in dataclasses.fields(RuntimeConfig)
            if TUNING_SECTION in f.metadata}


def cli_flag(name: str) -> str:
    """The command-line spelling of a RuntimeConfig field: `--tuning.NAME` for a tuning knob,
    `--the-name` for a user's flag (the spelling messages that suggest a change must use)."""
    if name in tuning_docs():
        return f"--{TUNING_SECTION}.{name}"
    return "--" + name.replace("_", "-")


@dataclass
class RuntimeConfig:
    mode: str = "slide"             # gpu | ckpt | slide
    # compute precision: auto | bf16 | fp32 | fp16. auto (device.resolve_dtype): bf16 where the device
    # computes it natively (a CUDA GPU with bf16, a CPU with AMX-BF16 or AVX512-BF16), else fp32
    dtype: str = "auto"
    device: str = "auto"            # auto -> cuda if available else cpu
    # ckpt mode: which decoder layers recompute their activations in backward
    recompute: str = "all"          # all | none | comma list "0,3,7" | "every:k"
    # slide mode
    # GPU layer slots: one computing, prefetches ahead in the rest. 0 = one per layer: the
    # weights stay on the GPU between steps and each layer is uploaded once per step, as
    # soon as its update lands (during the backward, where H2D has room), so the forward
    # runs without waiting on PCIe (Qwen3-8B b16: 2.65 -> 2.36 s). Costs num_layers x
    # layer size on the GPU. -1 = auto: 0 when the whole configuration then fits in GPU
    # memory (engine.fit.choose_auto_settings), else 3 (with resident layers beside them).
    cache_units: int = tuning_field(
        -1, help="GPU layer slots: -1 auto, 0 one per layer (weights stay on the GPU), N >= 2 a window of N",
        when="auto picks 0 where everything fits, else 3; a window of 3-4 frees GPU memory for a larger batch")
    # With a window (cache_units >= 2): the lowest `resident_layers` host-updated decoder layers
    # get a GPU slot of their own besides the window, uploaded once a step as their update lands
    # instead of twice (forward and backward) through the window; the upper layers use the
    # window. Costs a layer of compute-dtype weights per layer on the GPU, no host RAM. Where
    # host RAM binds, the auto settings put only as many layers' state on the GPU as the host
    # needs and give the rest of the GPU's room to resident layers (Qwen3-14B b8 on an H200:
    # the all-window placement spent 40% of its H2D time outside compute; benchmarks/NOTES.md "PCIe uploads").
    # -1 = auto (engine.fit.choose_auto_settings; unresolved, as in an engine built directly:
    # none). With cache_units=0 every host layer is resident and this is not used.
    resident_layers: int = tuning_field(
        -1, help="with a window: the lowest N host-updated layers get a GPU slot of their own (-1 auto)",
        when="lower it to give GPU memory back to the batch; auto fills what the GPU has left")
    # GPU gradient slots: one being written, one draining, one of slack. 0 = auto: 3, or
    # DEADLINE_GRAD_SLOTS with update_order=deadline, eager updates and resident layers,
    # where the slots also hold the gradients of the upper layers (late deadlines) until
    # the host gets to them, while the pinned ring carries the most urgent ones.
    grad_slots: int = tuning_field(
        0, help="GPU gradient slots (0 auto: 3, or 16 under deadline order with every layer resident)",
        when="raise when a profile shows the backward waiting for a free gradient slot; lower to save GPU memory")
    # Layer-input checkpoints in pinned host memory (on), on the GPU (off), or auto: off where the
    # run fits with every checkpoint on the GPU, else on, with gpu_checkpoints auto keeping as many
    # there as fit (engine.fit.choose_auto_settings); left unresolved, off.
    offload_activations: str = "auto"
    # With offload_activations: the input checkpoints of the last `gpu_checkpoints` decoder
    # layers stay on the GPU. The backward reads those first, so it starts without waiting
    # for a prefetch, and each is B x S x d compute-dtype bytes less of pinned host RAM and
    # of PCIe each way (at batch 1 x 128K tokens an 8B layer's is 1 GiB: 32 GiB of host RAM
    # for all of them, what bounds the longest sequence on a 128 GiB host). -1 (auto): as
    # many as fit in GPU memory after the other auto choices, or, where host RAM is what
    # does not fit, before them (engine.fit.choose_auto_settings); left unresolved (an engine
    # built directly) it means 0: every checkpoint offloaded.
    gpu_checkpoints: int = tuning_field(
        -1, help="with --offload-activations: the last N layers' input checkpoints stay on the GPU (-1 auto)",
        when="lower to free GPU memory; raise where the backward's first layers wait for their prefetch")
    # When updates run. "eager": each unit's AdamW as soon as its gradient is complete (after its
    # backward over every micro-batch: accumulation runs layer by layer, engine/slide/engine.py);
    # "deferred": gradients wait where they landed (host units' in the compute dtype, 2 B/param of
    # host RAM for BF16; device units' on the GPU) until the global norm is known, then the clipped
    # update sweep overlaps the next forward. auto: deferred when clipping, else eager.
    schedule: str = tuning_field(
        "auto", help="when updates run: eager (as each gradient completes) or deferred (after the global norm); auto",
        when="leave auto (deferred when clipping, else eager); eager cannot clip, deferred without clipping only A/Bs")
    cast_on: str = tuning_field(
        "auto", help="where FP32 <-> compute-dtype casts run: auto (gpu on CUDA), gpu or cpu",
        when="cpu where page-locking the FP32 masters fails (a low `ulimit -l`): small pinned buffers instead")
    # benchmarks/NOTES.md "Pipeline threads": 256 beat 64 by 4% on 8B layers
    chunk_mb: int = tuning_field(
        256, help="cast/copy/update granularity in MiB of FP32 (256 beat 64 by 4% on 8B layers)",
        when="lower (64) where pinned host RAM is short; units smaller than a chunk use one chunk anyway")
    upload_ring: int = tuning_field(
        4, help="pinned staging chunks for uploads (chunk_mb each)",
        when="raise when a profile shows uploads waiting for a staging chunk; lower to save pinned RAM")
    download_ring: int = tuning_field(
        0, help="pinned staging chunks for gradient downloads (0 auto: 8 layers under deadline order, 3 fifo)",
        when="raise where host RAM allows and the backward's last layers wait for AdamW; lower to save pinned RAM")
    # Order of the eager schedule's host updates. "deadline": the unit needed first by the
    # next forward goes first among those whose gradients are down (the embedding and layer
    # 0 before the upper layers), and the upper layers' updates overlap the next forward;
    # "fifo": in the order the backward releases them (head, L-1, ..., 0, embedding), so
    # the next forward waits for every update. Needs a gradient ring that holds the backlog
    # (auto: 8 layers; benchmarks/NOTES.md "Gradient downloads").
    update_order: str = tuning_field(
        "deadline", help="order of the eager host updates: deadline (the next forward's first units first) or fifo",
        when="fifo only to A/B the deadline order or to shrink the gradient ring to 3 layers")
    upload_stages: int = tuning_field(
        2, help="GPU FP32 staging chunks per upload when the cast runs on the copy stream",
        when="rarely: raise when an upload's cast waits for a free staging chunk")
    # Where the GPU casts run (cast_on=gpu). "copy": a cast kernel on the copy stream per
    # chunk; it needs SMs while the compute stream's GEMMs hold them, which can stall the
    # copies behind it. "compute": the copy streams only move bytes (DMA engines): uploads
    # land in an FP32 buffer per slot and the compute stream casts a whole unit right
    # before it computes (0.5 ms per 8B layer); gradient slots are FP32 and the gradient
    # copy that fills them is the cast. Costs FP32-sized slot buffers on the GPU.
    upload_cast_stream: str = tuning_field(
        "copy", help="where GPU casts run: copy (a kernel on the copy stream) or compute (whole unit, FP32 slots)",
        when="compute where copy-stream casts stall behind the GEMMs (H2D gaps in a profile) and the GPU has room")
    # Data parallel: how the host units' updated weights reach the host's GPUs. gather: the unit's
    # owner uploads it and broadcasts it to the host's other GPUs (NVLink under NCCL): the master
    # is read once and each link carries its shard. upload: every rank uploads every unit from the
    # shared master over its own PCIe link (N reads of the master from DRAM, N x the H2D bytes).
    # Measured on 2x H100 (NV18), Qwen3-8B b16/GPU clip 1.0: gather 2.267 s a step (1.88x one
    # GPU), upload 2.327 s (1.83x) (benchmarks/NOTES.md "Data parallel"). One rank: ignored.
    dp_weights: str = tuning_field(
        "gather", help="data parallel: gather (a host unit's owner uploads it and broadcasts it to the host's "
                       "other GPUs) or upload (every rank uploads every host unit)",
        when="upload where the host's GPUs have no NVLink between them (the broadcasts then cross PCIe "
             "beside the uploads); measure with bench throughput --gpus --runtime dp_weights=upload")
    # Gradient slots in FP32: the backward's gradient copy into the slot is the cast, and the
    # D2H copy stream moves bytes only (no cast kernel waiting for SMs). 2 B/param more per
    # slot; Llama-3.1-8B b16: 2.38 -> 2.16 s a step (NOTES.md "Gradient downloads"). auto: fp32 where the
    # whole configuration then fits in GPU memory (engine.fit.choose_auto_settings), else
    # the compute dtype; left unresolved (an engine built directly) it means compute.
    grad_slot_dtype: str = tuning_field(
        "auto", help="gradient slots in the compute dtype or FP32 (auto: fp32 where it fits and downloads are fp32)",
        when="fp32 with --tuning.grad_download fp32 where D2H casts wait for SMs; compute to save GPU memory")
    # The dtype in which gradients cross PCIe and land in host memory (cast_on=gpu; with
    # cast_on=cpu they always come down in the compute dtype). "compute": as the backward
    # made them (2 B/param for BF16), and the host's AdamW widens them inside its own kernel
    # (engine/native_adamw.py): the D2H bytes halve and AdamW reads 26 instead of 28 B/param
    # of host DRAM, which the two share (benchmarks/NOTES.md "Gradient downloads"). Needs a C compiler at run
    # time; without one (or with host_adamw=torch) the host widens into a scratch chunk
    # first. "fp32": widened on the GPU (a cast on the D2H stream). FP32 gradient slots (grad_slot_dtype=fp32) download FP32
    # either way, so auto never picks them with "compute".
    grad_download: str = tuning_field(
        "compute", help="dtype gradients cross PCIe in: compute (the host's AdamW widens them) or fp32",
        when="fp32 only to A/B: it doubles the D2H bytes and the host's DRAM traffic rises 26 -> 28 B/param")
    # Where the embedding and head units' FP32 master and AdamW state live and are updated.
    # "device": on the GPU, updated on the compute stream as soon as their gradient is
    # complete (~5 ms each at HBM speed for a 0.5 B-parameter vocabulary matrix), so they
    # cross PCIe neither way and the host's AdamW, the step's bound, loses their share
    # (Llama-3.1-8B: 1.05 of 8.0 B parameters; ~0.23 s of a 2.1 s step at b16). Costs 12
    # B/param of the vocabulary units on the GPU (12.6 GB for Llama-3.1-8B); under the deferred
    # schedule their gradients wait on the GPU for the clip coefficient. "host": with the
    # layers. auto: device where the whole configuration then fits in GPU memory
    # (engine.fit.choose_auto_settings); left unresolved (an engine built directly), host.
    vocab_update: str = tuning_field(
        "auto", help="where the embedding and head are updated: device (GPU), host, or auto (device where it fits)",
        when="host to free 12 B/param of the vocabulary on the GPU; device to insist on it")
    # The first `device_layers` decoder layers keep their FP32 master and AdamW moments on
    # the GPU and are updated there, on the compute stream, right after their backward (as
    # vocab_update=device does for the embedding and head): their weights never cross PCIe
    # and the host's AdamW, the bound of a host-limited step, loses their share. The lowest
    # layers, because the next forward needs them first. Costs 14 B/param on the GPU (master,
    # moments, a weight slot of their own) for each such layer, 2 more under the deferred
    # schedule (the gradient, held there for the clip coefficient). -1 (auto):
    # as many as fit in GPU memory after the other auto choices (engine.fit.choose_auto_settings;
    # Qwen3-8B b16 on the H100: 8 layers, 2.22 -> 1.75 s a step, NOTES.md "GPU-updated units"); left unresolved
    # (an engine built directly) it means 0. 0 keeps every layer's state on the host.
    device_layers: int = tuning_field(
        -1, help="the lowest N layers keep master and AdamW state on the GPU, updated there (-1 auto: as fit)",
        when="0 keeps every layer's state on the host (a DeepSpeed-like comparison); lower it to free GPU memory")
    # Intra-op threads of the host worker (AdamW, gradient norms). 0 (auto): on CUDA, one
    # fewer than torch's default (all cores), so the compute thread that launches the GPU's
    # kernels has a core of its own: an AdamW thread preempted mid-block holds the whole
    # parallel region for milliseconds (NOTES.md "Host AdamW": 3.30 -> 4.88 G params/s beside a
    # launching thread; Qwen3-4B b8 1.01 -> 0.90 s, NOTES.md "Host AdamW"); on the CPU, torch's default
    # (the compute thread computes with the same pool). Set in the worker thread, so the
    # compute thread keeps its own count.
    host_threads: int = tuning_field(
        0, help="intra-op threads of the host's AdamW worker (0 auto: all cores but one on CUDA)",
        when="lower when other processes share the host's cores; auto leaves a core to the launching thread")
    # The host's AdamW kernel (engine/native_adamw.py). "dynamic": one OpenMP loop compiled at
    # run time whose threads claim 32K-element blocks as they go (5.26 G params/s alone on the
    # H100 host, static 4.66; beside a busy thread neither schedule holds up, a free core
    # does: host_threads); reads BF16 gradients as they landed; it releases the GIL while it
    # runs, so the compute thread keeps launching (NOTES.md "Host AdamW"). "static": the same loop
    # split evenly up front (A/B of the schedule).
    # "torch": torch's fused kernel (a static split; BF16 gradients widened into a scratch
    # chunk first). Without a C compiler "dynamic" and "static" fall back to "torch" (logged).
    host_adamw: str = tuning_field(
        "dynamic", help="the host's AdamW kernel: dynamic or static (native OpenMP loops) or torch (its fused one)",
        when="torch to rule the native kernel out; static to A/B the schedule (dynamic measured 13% faster)")
    # How host threads wait on the GPU. "block": they sleep (blocking events, and the
    # context's blocking-sync flag for .item() and synchronize()); "spin": CUDA's default,
    # a busy core per waiter, which slowed the host's AdamW by up to 41% (NOTES.md "Pipeline threads").
    cuda_waits: str = tuning_field(
        "block", help="how host threads wait on the GPU: block (sleep) or spin (CUDA's default)",
        when="spin only to A/B: a spinning waiter slowed the host's AdamW by up to 41%")
    # Python's GIL switch interval while the slide engine runs (ms). Every torch call of the
    # host's AdamW loop gives the GIL up and must take it back, waiting up to this long when
    # the compute thread is busy in Python (benchmarks/scripts/gil_adamw.py: 0.87x at 0.5 ms
    # for ~16 ms chunks on the CPU machine, ~0.97x at 0.2 ms).
    gil_switch_ms: float = tuning_field(
        0.5, help="Python's GIL switch interval while the slide engine runs, in ms (0.01-100)",
        when="lower (0.2) when the host's AdamW waits for the GIL behind a busy compute thread")
    # After the first step, move every object then alive into Python's permanent GC generation
    # (engine/gc_policy.py): a full collection no longer walks the model and the compiled graphs
    # and stops the compute thread for a fraction of a second (Qwen3-4B b16: 0.54 s in one step
    # of 1.06 s, NOTES.md "GC pauses"). Undone at close().
    gc_freeze: bool = tuning_field(
        True, help="after step 1, move every live object into the GC's permanent generation",
        when="off only to debug leaks: a full collection then stops the compute thread (0.54 s in a 1.06 s step)")
    # torch.compile the decoder layers' forward (slide mode; one graph per kind of layer,
    # recompute and backward included): 18% less layer time on the H100 for a ~40 s compile at
    # the first step. auto: on CUDA where the planned run earns the compile back 2.5x over
    # (engine/compile_policy.py; `slidetune train` prints the estimate); left unresolved (an
    # engine built directly, a benchmark) it means off. on | off (true | false) force it.
    compile_layers: str = "auto"
    # The clipped (deferred) schedule's host sweep: "split" writes the new weights first and the
    # moments after, under the next step (the next forward waits for the weights only); "whole"
    # writes all of AdamW's state in one pass (28% less host DRAM traffic, all of it waited for).
    # Split was as fast or faster everywhere measured, even where the host's AdamW binds
    # (Llama-3.1-8B b8, 24 GiB GPU, one machine: 2.54 s against 2.61; NOTES.md "Clipping schedule").
    # weights: the weights pass writes each host unit's new weights in the compute dtype (BF16)
    # into a page-locked copy the upload reads (2 B/param of DMA instead of the FP32 master's 4,
    # and no master write: 16 B/param where the next forward waits instead of 18 + 4), and the
    # second pass writes master and moments; 2 B/param more page-locked host RAM (LOG.md 2026-11-25 "Next",
    # predicted 2.146 -> ~2.0 s for Qwen3-8B b16 clip on the H100). Measured 2026-11-25 (NOTES.md
    # "PCIe uploads"): no gain (2.398 vs 2.164 s, in a slower DRAM phase; a wash against each run's floor);
    # the copy now streams its stores, to be A/B'd in one call with bench throughput --variants.
    clip_sweep: str = tuning_field(
        "split", help="the clipped schedule's host sweep: split (weights first, moments under the next step), "
                      "weights (BF16 weights for the upload first, master and moments under the next step; "
                      "2 B/param more host RAM) or whole",
        when="weights to A/B on a host whose DRAM the weights pass binds (BF16 compute, one rank); whole only "
             "to A/B: split was as fast or faster everywhere measured")
    # How a layer's gradients are summed over a step's micro-batches on the GPU (engine/slide/
    # grad_sum.py): torch (an FP32 copy, a _foreach_add_ a micro-batch, a cast into the slot: 42
    # B/param of HBM traffic for 4 micro-batches) or fused (one Triton pass over up to 4 held
    # micro-batch gradients, straight into the slot: 10 B/param, the same bits; 2 B/param more of
    # one layer held at 4 micro-batches). auto: fused on CUDA with Triton, checked bit for bit
    # against torch at its first use. Predicted ~75 ms a step of Qwen3-8B clip+accum4 on the H100
    # (NOTES.md "Accumulation"), not yet measured.
    grad_sum: str = tuning_field(
        "auto", help="how a layer's micro-batch gradients are summed on the GPU: auto (fused on CUDA with "
                     "Triton), fused or torch",
        when="torch to A/B the fused sum, or where Triton misbehaves; only matters with gradient accumulation")
    # The clipped schedule's held gradients, per host unit: 1 buffer, or 2 used on alternate
    # steps. With one, a layer's next gradient can only go down once the moments pass has read
    # its buffer: on the H100 the moments pass paced the next backward (0.43 s of gradient-slot
    # waits a step, NOTES.md "Clipping schedule"). With two the backward writes one buffer while the moments pass
    # reads the other, for 2 more B/param of host RAM (BF16).
    # auto (-1): 2 where host RAM has room for them beside the auto placement
    # (engine.fit.choose_auto_settings); left unresolved, 1. Measured (NOTES.md "Clipping schedule"): Qwen3-8B b16
    # clipped on the H100, 2.221 -> 2.146 s (1.10x -> 1.05x its floor) for +9.7 GiB of RSS.
    held_buffers: int = tuning_field(
        -1, help="the clipped schedule's held gradient buffers per host unit: 1, 2 (on alternate steps) or -1 "
                "(auto: 2 where host RAM has room, for every host unit or the lowest that fit)",
        when="2 where the compute thread waits for gradient slots in a clipped step (wait_grad_slot in a "
             "profile) and host RAM has 2 B/param to spare")
    # With held_buffers 2: how many host-updated units get the second buffer, counted from the
    # embedding up (-1: all). The backward and the moments pass both run from the head down and
    # at small batches the backward is the faster, so it catches the pass and follows it; a
    # second buffer frees it only below the last unit that has one buffer, so the units it
    # reaches last (the lowest) are the ones worth the RAM (LOG.md 2026-11-25 "Next").
    held_second_units: int = tuning_field(
        -1, help="with --tuning.held_buffers 2: host-updated units with the second buffer, from the embedding up "
                 "(-1: all)",
        when="set by held_buffers auto where host RAM has room for some units' second buffer, not all")
    # The disk tier (engine/slide/disk_tier.py): the AdamW moments of `disk_units` host-updated
    # units (the head, then decoder layers from the top down: those the next forward needs last)
    # live in files under `disk_dir`, read ahead of each unit's update and written behind it.
    # Each such unit then takes 4 B/param of host RAM (its master) instead of 12, and moves
    # 16 B/param through the disk a step. A fraction (0 < x < 1) takes that share of the units
    # that may go there. -1 (auto): with a disk_dir, as few as make host RAM fit
    # (engine.fit.choose_auto_settings), else none; left unresolved, none.
    disk_dir: str | None = None
    disk_units: float = tuning_field(
        -1, help="units whose AdamW moments live under --disk-dir: a count, a fraction, or -1 auto (fewest that fit)",
        when="more to leave host RAM to other work; fewer where the disk's bandwidth binds the step")
    # The FP32 masters of disk units on disk too (the tier's block then holds master, m and v,
    # 12 B/param), with only the unit's compute-dtype weights in host RAM for its uploads (2 B/param
    # for BF16, instead of the 4 B/param master): 10 instead of 8 B/param off the host, for 24
    # instead of 16 B/param through the disk a step. off | on (every disk unit) | auto: off where the
    # moments alone make host RAM fit, else the masters of as few disk units as make it fit
    # (engine.fit.choose_auto_settings; resolved, a count N: the first N disk units, in the order
    # units go to disk); left unresolved (an engine built directly), off.
    disk_master: str = tuning_field(
        "auto", help="the FP32 masters of disk units on disk too: off, on, auto (only where RAM needs it) or a count",
        when="on to leave host RAM ~2 B/param of a disk unit; off where the disk's bandwidth binds (24 vs 16 B/param)")
    disk_block_mb: float = tuning_field(
        64, help="disk I/O block in MiB: one block's moments (m and v) per pinned buffer",
        when="raise for disks that want larger requests; lower to save pinned RAM (buffers x block)")
    # The tier's read-ahead is as deep as its buffers. In a clipped step a disk unit's update waits
    # for the clip coefficient, so with 8 buffers the tier read 512 MiB ahead and then idled until
    # the update sweep reached its units: 1.5 s of a 7.0 s Qwen3-8B step (4 layers on disk, H100).
    # 64 buffers kept the disk busy the whole step: 7.03 -> 5.53 s (NOTES.md "Disk tier").
    # auto (-1): as many as host RAM has room for beside the placement, up to half the blocks of the
    # disk units (fit.choose_auto_settings), at least 8; left unresolved, 8.
    disk_buffers: int = tuning_field(
        -1, help="pinned block buffers: reads ahead, the block in AdamW, writes behind (>= 3, or -1: auto, "
                 "as many as host RAM has room for, up to half the disk units' blocks)",
        when="lower to leave pinned RAM to something else; each costs disk_block_mb of pinned RAM")
    disk_io_threads: int = tuning_field(
        4, help="threads issuing preadv/pwritev (each releases the GIL)",
        when="raise for NVMe with deep queues or striped disks; lower on one slow disk")
    # output layer
    # The lean decoder layer (models/lean_layer.py): RMSNorms that save only their input and
    # 1/rms, and the MLP half run in token tiles, each recomputed and differentiated before the
    # next, so one layer's recompute + backward no longer holds the MLP's intermediates for every
    # token. The same arithmetic as HF's layer (Llama-style families, checked from the source);
    # others keep HF's layer. auto: the fit's ladder of recipes (engine/fit._memory_recipes) takes
    # it only where its working set makes the run fit; unresolved (an engine built directly), HF's.
    lean_layer: str = tuning_field(
        "auto", help="lean decoder layer (lean RMSNorm backward, MLP in token tiles): auto, on or off",
        when="off to compare with HF's own layer; on refuses a family whose layer is not Llama's")
    mlp_tile_tokens: int = tuning_field(
        8192, help="tokens per MLP tile of the lean layer's recompute + backward",
        when="lower when one layer's working set does not fit; each tile more costs time (2 vs 1 at 16K: +8%, NOTES.md \"Lean layer\")")
    # Row tiles bound what the attention half saves to a tile's tokens (Qwen3-8B b64 x 1024: the
    # lean layer's 8.5 GiB working set at 64K tokens -> ~4.9 in tiles of 16 sequences, the 24 GiB
    # GPU's room for 7 more checkpoints); each tile more adds an FP32 sum of the layer's
    # gradients (0.7 GiB a Qwen3-8B layer).
    layer_row_tokens: int = tuning_field(
        16384, help="the lean layer's recompute + backward a few sequences at a time: at most this many tokens "
                    "a row tile (at least one sequence)",
        when="lower when one layer's working set does not fit at a large batch; 0 runs every row at once")
    # The lean layer's RMSNorm, SwiGLU product and rotary (models/lean_kernels.py): torch (the
    # lean RMSNorm, HF's product and rotary) or Liger's Triton kernels (liger-kernel, an optional
    # extra; CUDA), which save less for the backward. auto: torch until Liger's measure faster on
    # the GPU (benchmarks/scripts/layer_memory.py's lean-liger variants, with --profile).
    lean_kernels: str = tuning_field(
        "auto", help="the lean layer's RMSNorm, SwiGLU and rotary kernels: auto (torch for now), torch or liger "
                     "(Liger's Triton kernels: CUDA, pip install 'slidetune[liger]')",
        when="liger to A/B Liger's kernels against torch on a GPU; auto takes them once measured faster")
    # auto: fused on CUDA where Triton imports (Qwen3-8B's head at 16K tokens: 73 ms and 6.2 GiB vs
    # chunked's 104 ms and 8.3 GiB on the H100, ops/cross_entropy.py), chunked elsewhere.
    head_impl: str = tuning_field(
        "auto", help="output layer: full logits, chunked (head_chunk_tokens at a time), fused (Triton), or auto "
                     "(fused on CUDA, else chunked)",
        when="full only for small vocabularies and short sequences; chunked keeps the logits' peak bounded")
    head_chunk_tokens: int = tuning_field(
        4096, help="tokens per logits chunk (4096 x 152k vocab x 2 B = 1.2 GB)",
        when="lower when the head's peak does not fit the GPU; higher rarely helps")

    def __post_init__(self):
        self.compile_layers = _on_off_auto(self.compile_layers, "compile_layers")
        self.lean_layer = _on_off_auto(self.lean_layer, "lean_layer")
        self.offload_activations = _on_off_auto(self.offload_activations, "offload_activations")
        if self.head_impl not in ("auto", "full", "chunked", "fused"):
            raise ValueError(f"head_impl must be auto, full, chunked or fused, not {self.head_impl!r}")
        if self.mlp_tile_tokens < 1:
            raise ValueError(f"mlp_tile_tokens must be >= 1, not {self.mlp_tile_tokens}")
        if self.layer_row_tokens < 0:
            raise ValueError(f"layer_row_tokens must be >= 0 (0: no row tiles), not {self.layer_row_tokens}")
        if self.lean_kernels not in ("auto", "torch", "liger"):
            raise ValueError(f"lean_kernels must be auto, torch or liger, not {self.lean_kernels!r}")
        if self.mode not in ("gpu", "ckpt", "slide"):
            raise ValueError(f"mode must be gpu, ckpt or slide, not {self.mode!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, not {self.dtype!r}")
        if self.schedule not in ("auto", "eager", "deferred"):
            raise ValueError(f"schedule must be auto, eager or deferred, not {self.schedule!r}")
        if self.cast_on not in ("auto", "cpu", "gpu"):
            raise ValueError(f"cast_on must be auto, cpu or gpu, not {self.cast_on!r}")
        if self.dp_weights not in ("upload", "gather"):
            raise ValueError(f"dp_weights must be upload or gather, not {self.dp_weights!r}")
        if self.upload_cast_stream not in ("copy", "compute"):
            raise ValueError(f"upload_cast_stream must be copy or compute, not {self.upload_cast_stream!r}")
        if self.grad_slot_dtype not in ("auto", "compute", "fp32"):
            raise ValueError(f"grad_slot_dtype must be auto, compute or fp32, not {self.grad_slot_dtype!r}")
        if not 0.01 <= self.gil_switch_ms <= 100:
            raise ValueError(f"gil_switch_ms must be within 0.01-100 ms, not {self.gil_switch_ms}")
        if self.grad_download not in ("compute", "fp32"):
            raise ValueError(f"grad_download must be compute or fp32, not {self.grad_download!r}")
        if self.vocab_update not in ("auto", "host", "device"):
            raise ValueError(f"vocab_update must be auto, host or device, not {self.vocab_update!r}")
        if self.gpu_checkpoints < -1:
            raise ValueError(f"gpu_checkpoints must be >= 0, or -1 for auto, not {self.gpu_checkpoints}")
        if self.resident_layers < -1:
            raise ValueError(f"resident_layers must be >= 0, or -1 for auto, not {self.resident_layers}")
        if self.device_layers < -1:
            raise ValueError(f"device_layers must be >= 0, or -1 for auto, not {self.device_layers}")
        if self.host_adamw not in ("dynamic", "static", "torch"):
            raise ValueError(f"host_adamw must be dynamic, static or torch, not {self.host_adamw!r}")
        if self.cuda_waits not in ("block", "spin"):
            raise ValueError(f"cuda_waits must be block or spin, not {self.cuda_waits!r}")
        if self.grad_sum not in ("auto", "fused", "torch"):
            raise ValueError(f"grad_sum must be auto, fused or torch, not {self.grad_sum!r}")
        if self.held_buffers not in (-1, 1, 2):
            raise ValueError(f"held_buffers must be 1, 2 or -1 (auto), not {self.held_buffers!r}")
        if not isinstance(self.held_second_units, int) or self.held_second_units < -1:
            raise ValueError(f"held_second_units must be a count >= 0, or -1 for all, not {self.held_second_units!r}")
        if self.clip_sweep not in ("split", "weights", "whole"):
            raise ValueError(f"clip_sweep must be split, weights or whole, not {self.clip_sweep!r}")
        if self.update_order not in ("deadline", "fifo"):
            raise ValueError(f"update_order must be deadline or fifo, not {self.update_order!r}")
        if self.upload_stages < 1:
            raise ValueError("upload_stages must be >= 1")
        if self.cache_units == 1 or self.cache_units < -1:
            raise ValueError("cache_units must be >= 2 (one computing, one loading), 0 for one per layer "
                             "or -1 for auto")
        if self.host_threads < 0:
            raise ValueError("host_threads must be >= 1, or 0 for torch's default")
        if self.grad_slots < 0:
            raise ValueError("grad_slots must be >= 1, or 0 for auto")
        if self.disk_units < -1 or (self.disk_units >= 1 and self.disk_units != int(self.disk_units)):
            raise ValueError(f"disk_units must be a count, a fraction between 0 and 1, or -1 for auto, "
                             f"not {self.disk_units}")
        if self.disk_units == int(self.disk_units):
            self.disk_units = int(self.disk_units)
        if self.disk_units > 0 and not self.disk_dir:
            raise ValueError("--tuning.disk_units needs a disk directory: --disk-dir PATH (a local disk with room "
                             "for 8 bytes per parameter of those units)")
        self.disk_master = _disk_master(self.disk_master)
        if self.disk_block_mb <= 0 or (self.disk_buffers < 3 and self.disk_buffers != -1) or self.disk_io_threads < 1:
            raise ValueError("--tuning.disk_block_mb must be > 0, --tuning.disk_buffers >= 3 (one read ahead, "
                             "one in AdamW, one written behind; or -1, auto) and --tuning.disk_io_threads >= 1")

    def disk_master_units(self, disk_units: int) -> int:
        """How many of `disk_units` disk units keep their master on disk (the first ones in disk
        order): every one for on, none for off or an unresolved auto, else the count."""
        if self.disk_master == "on":
            return disk_units
        if self.disk_master in ("off", "auto"):
            return 0
        return min(disk_units, int(self.disk_master))

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

    # Buffer sizing shared by the slide engine and the fit estimate (engine/fit.py).
    def chunk_elems(self, layer_numel: int) -> int:
        """Elements per transfer chunk: chunk_mb MiB of FP32 (the host-side element size), but
        no more than one decoder layer: a small model must not get 256 MB staging buffers.
        Units larger than a chunk (the vocabulary matrices) stream through in pieces."""
        return max(1, min(self.chunk_mb * 2**20 // 4, layer_numel))

    # Layers of gradients the pinned ring holds under update_order=deadline: the backlog of
    # updates still queued when the backward ends. Qwen3-8B b16 with compiled layers: AdamW
    # 1.70 s per step against 1.29 s of head + backward leaves ~0.4 s = ~11 layers queued;
    # 8 layers (6.2 GB pinned for an 8B model) keeps the host within 12.5 B/param + 8 GiB,
    # and the last ~3 layers of such a backward wait for AdamW (raise download_ring if RAM allows).
    DEADLINE_RING_LAYERS = 8

    # GPU gradient slots under deadline order with resident layers: the backlog of updates
    # at the end of a backward (benchmarks/NOTES.md "Update order": ~0.5 s of AdamW on an 8B model at
    # b16 with compiled layers, ~18 layers) minus the ring. 16 x 0.39 GB for an 8B layer.
    DEADLINE_GRAD_SLOTS = 16

    def resolved_grad_slots(self, num_layers: int, eager: bool = True) -> int:
        if self.grad_slots:
            return self.grad_slots
        # only with every layer resident: a step from 3 to 16 slots as the first layer became
        # resident would stop choose_auto_settings' fill of resident layers at none
        resident = self.cache_units == 0
        if eager and resident and self.update_order == "deadline":
            return max(3, min(self.DEADLINE_GRAD_SLOTS, num_layers))
        return 3

    def download_chunks(self, layer_numel: int) -> int:
        """Pinned gradient ring, in chunks. fifo: three layers (one filling, one in AdamW, one
        of slack); deadline: DEADLINE_RING_LAYERS layers, so the backward never waits for
        AdamW while updates are reordered."""
        layers = self.DEADLINE_RING_LAYERS if self.update_order == "deadline" else 3
        return self.download_ring or max(4, -(-layers * layer_numel // self.chunk_elems(layer_numel)))

    def downloads_fp32(self, is_cuda: bool) -> bool:
        """Whether gradients land in host memory as FP32: FP32 slots, or a cast on the GPU's D2H
        stream (grad_download=fp32 with GPU casts). Otherwise in the compute dtype."""
        return self.grad_slots_fp32() or (self.casts_on_gpu(is_cuda) and self.grad_download == "fp32")

    @property
    def offloads_activations(self) -> bool:
        """Whether layer-input checkpoints go to pinned host memory (auto left unresolved: no)."""
        return self.offload_activations == "on"

    @property
    def resolved_head_impl(self) -> str:
        """The output layer's implementation, auto resolved for this config's device."""
        if self.head_impl != "auto":
            return self.head_impl
        from ..ops.cross_entropy import auto_impl
        device = ("cuda" if torch.cuda.is_available() else "cpu") if self.device in (None, "auto") \
            else torch.device(self.device).type
        return auto_impl(device)

    def grad_slots_fp32(self) -> bool:
        """Whether the gradient slots are FP32 (auto, unresolved, means the compute dtype)."""
        return self.grad_slot_dtype == "fp32"

    def resolved_host_threads(self, is_cuda: bool) -> int:
        """The host worker's AdamW threads: host_threads, or for 0 one core left to the compute
        thread on CUDA (all of torch's on the CPU)."""
        if self.host_threads:
            return self.host_threads
        cores = torch.get_num_threads()
        return max(1, cores - 1) if is_cuda else cores

    def casts_on_gpu(self, is_cuda: bool) -> bool:
        return is_cuda and self.cast_on in ("auto", "gpu")

    def resolved_schedule(self, grad_accum: int, max_grad_norm: float | None) -> str:
        """eager, or deferred where clipping needs the global norm first. Accumulation needs
        neither: a unit's micro-batches are summed on the GPU before its update."""
        needs_deferred = max_grad_norm is not None and max_grad_norm > 0
        if self.schedule == "eager" and needs_deferred:
            raise ValueError("the eager schedule updates each unit as soon as its gradient is complete, so it "
                             "cannot clip by the global norm; use --tuning.schedule deferred (or auto)")
        if self.schedule == "auto":
            return "deferred" if needs_deferred else "eager"
        return self.schedule


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


def _disk_master(value) -> str:
    """disk_master: off | on | auto, or a count of disk units ("2", 2); on/off also from booleans."""
    text = str(value).strip().lower()
    if isinstance(value, int) and not isinstance(value, bool) or text.isdigit():
        if int(text) < 0:
            raise ValueError(f"disk_master must be off, on, auto or a count of disk units, not {value!r}")
        return str(int(text)) if int(text) else "off"
    try:
        return _on_off_auto(value, "disk_master")
    except ValueError:
        raise ValueError(f"disk_master must be off, on, auto or a count of disk units, not {value!r}") from None


def recompute_set(spec: str, num_layers: int) -> set[int]:
    """Parse the ckpt-mode layer selection."""
    spec = spec.strip().lower()
    if spec in ("all", ""):
        return set(range(num_layers))
    if spec == "none":
        return set()
    if spec.startswith("every:"):
        k = int(spec.split(":", 1)[1])
        if k < 1:
            raise ValueError("every:k needs k >= 1")
        return set(range(0, num_layers, k))
    layers = {int(x) for x in spec.split(",") if x.strip()}
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"recompute layers {bad} out of range 0..{num_layers - 1}")
    return layers
