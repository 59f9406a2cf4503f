"""What each auto setting resolved to, in words: `slidetune train` prints these lines before
the run, `slidetune plan` beside its verdict. The choices themselves are engine.fit's
(choose_auto_settings) and the placement plan's (engine/placement.py); this only reads them."""
from __future__ import annotations

from .config import RuntimeConfig
from .placement import PlacementPlan
from .slide.disk_tier import buffer_bytes, tier_bytes
from .tiers import TIERS


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def describe_autos(requested: RuntimeConfig, resolved: RuntimeConfig, plan: PlacementPlan | None, *,
                   gpu_lines: bool = True) -> list[str]:
    """One line per setting `requested` left on auto, saying what `resolved` (engine.fit's choice)
    made of it and why; `plan` is resolved's placement (None outside slide mode).

    gpu_lines=False leaves out the GPU placement's lines (a CPU run has no GPU to place on) and
    keeps the disk tier's, which hold on the CPU too."""
    slide = requested.mode == "slide" and plan is not None
    lines: list[tuple[bool, str]] = []        # (a GPU placement line, the line)
    if slide:
        lines += _slot_lines(requested, resolved, plan)
        lines += _disk_buffer_lines(requested, resolved, plan)
        lines += _host_lines(requested, resolved, plan)
    if requested.head.head_impl == "auto":
        lines.append((True, f"head_impl auto -> {resolved.resolved_head_impl}"))
    if slide:
        lines += _checkpoint_and_disk_lines(requested, resolved, plan)
    return [line for gpu, line in lines if gpu_lines or not gpu]


def _slot_lines(requested: RuntimeConfig, resolved: RuntimeConfig, plan: PlacementPlan) -> list[tuple[bool, str]]:
    lines = []
    if requested.placement.cache_units == -1:
        resident, window = plan.resident_layers, plan.window_slots
        lines.append((True, f"cache_units auto -> {resolved.placement.cache_units}: "
                      + (f"a {window}-slot window" + (f" and {resident} resident layers" if resident else "")
                         if window else "every host-updated layer stays on the GPU between steps")))
    if requested.transfer.grad_slot_dtype == "auto":
        lines.append((True, f"grad_slot_dtype auto -> {resolved.transfer.grad_slot_dtype}"))
    if requested.layer.lean_layer == "auto":
        lines.append((True, f"lean_layer auto -> {resolved.layer.lean_layer}"
                      + (" (only the lean layer's smaller working set makes the run fit, on the GPU or, through "
                         f"the checkpoints the GPU then keeps, the host: lean RMSNorms, the MLP in tiles of "
                         f"{resolved.layer.mlp_tile_tokens} tokens)" if resolved.layer.lean_layer == "on"
                         else " (HF's layer: it fits)")))
    return lines


def _disk_buffer_lines(requested: RuntimeConfig, resolved: RuntimeConfig,
                       plan: PlacementPlan) -> list[tuple[bool, str]]:
    if requested.disk.disk_buffers != -1 or not plan.indices(TIERS.with_files):
        return []
    return [(False, f"disk_buffers auto -> {resolved.disk.disk_buffers}: "
                    f"{_size(buffer_bytes(plan, resolved.disk.disk_block_mb))} of block buffers, the disk tier's "
                    f"read-ahead (as deep as host RAM has room for, at most half the disk units' "
                    f"{_size(tier_bytes(plan, resolved.disk.disk_block_mb))})")]


def _host_lines(requested: RuntimeConfig, resolved: RuntimeConfig, plan: PlacementPlan) -> list[tuple[bool, str]]:
    lines = []
    if requested.clip.held_buffers == -1:
        lines.append((True, f"held_buffers auto -> {resolved.clip.held_buffers}"
                      + ("" if resolved.clip.held_buffers == 1 else
                         " (the clipped schedule's gradients alternate between two host buffers)"
                         if resolved.clip.held_second_units == -1 else
                         f" for the lowest {resolved.clip.held_second_units} host units "
                         f"({plan.ranges(lambda u: u.held == 2)}: as many as host RAM has room for), one for the rest")))
    if requested.placement.vocab_update == "auto":
        lines.append((True, f"vocab_update auto -> {resolved.placement.vocab_update}"
                      + (" (embedding and head updated on the GPU)"
                         if resolved.placement.vocab_update == "device" else "")))
    if requested.placement.device_layers == -1:
        lines.append((True, f"device_layers auto -> {max(0, resolved.placement.device_layers)}"
                      + (f" (decoder layers 0-{resolved.placement.device_layers - 1} kept and updated on the GPU)"
                         if resolved.placement.device_layers > 0 else "")))
    if requested.placement.shard_layers == -1 and plan.shard_layers:
        lines.append((True, f"shard_layers auto -> {plan.shard_layers} ({plan.ranges(lambda u: u.state == 'shard')}: "
                            f"each one's master and moments on one GPU of the host, which the host's RAM could "
                            f"not hold)"))
    if requested.offload_activations == "auto":
        lines.append((True, f"offload_activations auto -> {resolved.offload_activations}"
                      + (" (not every layer-input checkpoint fits the GPU: the rest go to pinned host RAM)"
                         if resolved.offloads_activations else " (every layer-input checkpoint stays on the GPU)")))
    return lines


def _checkpoint_and_disk_lines(requested: RuntimeConfig, resolved: RuntimeConfig,
                               plan: PlacementPlan) -> list[tuple[bool, str]]:
    lines = []
    if requested.placement.gpu_checkpoints == -1 and resolved.offloads_activations:
        kept = plan.gpu_checkpoints
        lines.append((True, f"gpu_checkpoints auto -> {kept}"
                      + (f" (the input checkpoints of the last {kept} decoder layers stay on the GPU)"
                         if kept else "")))
    files = TIERS.with_files
    if requested.disk.disk_units == -1 and resolved.disk_dir:
        lines.append((False, f"disk_units auto -> {len(plan.indices(files))}"
                      + (f" ({plan.ranges(files.holds)}: AdamW moments in {resolved.disk_dir})"
                         if plan.indices(files) else " (host RAM holds the state)")))
    if requested.disk.disk_master == "auto" and resolved.disk_dir:
        lines.append((False, f"disk_master auto -> {resolved.disk.disk_master}"
                      + (f" ({plan.ranges(files.holds_master)}: FP32 masters on "
                         f"disk too, their compute-dtype weights in host RAM)" if plan.master_params(files) else "")))
    return lines
