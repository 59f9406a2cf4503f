"""One row of `bench throughput`'s table (throughput.csv) from a run's result, its floor and its
collective probe: the columns, the host timeline's, the placement's, and each row's scaling
efficiency against the one-rank row of the same call."""
from __future__ import annotations

from ...engine.placement import resolved_disk_buffers
from ...engine.tiers import TIERS
from ..measure import lane_busy_fraction
from .throughput_floor import _floor, _grad_bytes, _hardware_floor
from .throughput_recipe import parse_recipe


COLUMNS = ["model", "seq_len", "batch_size", "system", "recipe", "variant", "round", "gpus", "chosen_by", "status",
           "step_s_mean", "step_s_std", "reference_s", "reference_tokens_per_s",
           "tokens_per_s", "tokens_per_s_per_gpu", "scaling_efficiency", "model_tflops", "gpu_peak_alloc_gib",
           "gpu_peak_reserved_gib", "cpu_peak_rss_gib", "host_rss_gib", "allreduce_s", "allreduce_busbw_gib_s",
           "floor_s",
           "floor_bound_by", "floor_partial", "step_over_floor", "hw_floor_s", "hw_floor_bound_by",
           "step_over_hw_floor", "oom_requested_gib", "call_s_mean",
           "host_adamw_s", "host_wait_d2h_s", "fwd_wait_upload_s", "bwd_wait_grad_slot_s", "device_layers",
           "gpu_checkpoints", "host_threads", "disk_io_gib", "disk_gib_s", "disk_io_ratio", "disk_buffers",
           "disk_busy_frac", "error"]


# slide's host timeline, seconds per step (bench.measure host_s_mean): where a step goes
# (host_adamw_s: AdamW's time; under clipping the weights pass and the moments pass)
HOST_COLUMNS = {"host_adamw_s": ("host.adamw", "host.adamw_moments"),
                "host_wait_d2h_s": "host.d2h_wait",
                "fwd_wait_upload_s": "compute.wait_upload", "bwd_wait_grad_slot_s": "compute.wait_grad_slot"}


def _row(system, model, batch, seq, r, fpt, fl, recipe: dict | None = None, collective: dict | None = None,
         ranks: int = 1, variant: str = "", round_: int = 1, chosen_by: str | None = None) -> dict:
    """One row of throughput.csv. batch is per rank; tokens_per_s the step's over every rank (the
    per-GPU rate beside it); host_rss_gib the host's RSS over its ranks (the shared state once);
    chosen_by: how the workload was chosen where not given (--max-seq, --max-batch)."""
    recipe = recipe or parse_recipe("plain")
    row = dict(model=model, seq_len=seq, batch_size=batch, system=system, recipe=recipe["name"],
               variant=variant or None, round=round_ if variant else None, gpus=ranks, chosen_by=chosen_by,
               status=r.get("status"), step_s_mean=r.get("step_s_mean"), step_s_std=r.get("step_s_std"),
               tokens_per_s=r.get("tokens_per_s"),
               tokens_per_s_per_gpu=r.get("tokens_per_s_per_gpu") or (r["tokens_per_s"] / ranks
                                                                      if r.get("tokens_per_s") else None),
               gpu_peak_alloc_gib=r.get("gpu_peak_alloc_gib"), gpu_peak_reserved_gib=r.get("gpu_peak_reserved_gib"),
               cpu_peak_rss_gib=r.get("cpu_peak_rss_gib"),
               host_rss_gib=_host_rss_gib(r),
               oom_requested_gib=r.get("oom_requested_gib"), error=(r.get("error") or "")[:200] or None)
    if row["tokens_per_s"] and fpt:
        row["model_tflops"] = row["tokens_per_s"] * fpt / 1e12
    row["call_s_mean"] = r.get("call_s_mean")
    # dpo, ipo: the reference pass a run makes once before training, per step's pairs (bench.measure
    # reference_pass), beside the step it precedes
    row["reference_s"], row["reference_tokens_per_s"] = r.get("reference_s"), r.get("reference_tokens_per_s")
    if r.get("disk_io_bytes_per_step") and row["step_s_mean"]:
        # the disk tier's reads and writes a step over the step: the rate the run drew from the
        # disk (its floor's disk_s used the probe's mixed rate; a run below it lost time elsewhere)
        row["disk_io_gib"] = r["disk_io_bytes_per_step"] / 2**30
        row["disk_gib_s"] = row["disk_io_gib"] / row["step_s_mean"]
        if r.get("disk_io_bytes_measured"):
            # what the tier moved a step over the plan's bytes: ~1 when each block is read and
            # written once a step (a block a later entry took from a buffer is not read again; a
            # unit's last block is padded to a whole one)
            row["disk_io_ratio"] = r["disk_io_bytes_measured"] / r["disk_io_bytes_per_step"]
        # the tier's block buffers as the run resolved them (its read-ahead; auto left unresolved: 8)
        row["disk_buffers"] = resolved_disk_buffers(int((r.get("runtime") or {}).get("disk_buffers", -1)))
        # the share of the timed step the tier's I/O threads had a read or write open (the Gantt
        # chart's disk lanes): ~1 where the disk binds the step
        row["disk_busy_frac"] = lane_busy_fraction(r.get("step_timeline"), TIERS.with_files.name)
    # slide: decoder layers whose state stayed on the GPU, and the host AdamW's threads (resolved autos)
    row["device_layers"], row["host_threads"] = r.get("device_layers"), r.get("host_threads")
    row["gpu_checkpoints"] = _placement(r).get("gpu_checkpoints")
    host = r.get("host_s_mean") or {}
    for col, keys in HOST_COLUMNS.items():
        found = [host[k] for k in ((keys,) if isinstance(keys, str) else keys) if host.get(k) is not None]
        row[col] = sum(found) if found else None
    usable = collective if collective and collective.get("status") == "ok" and ranks > 1 else None
    if usable:
        from ..collective import allreduce_busbw
        numels = usable["sizes_from"].get("unit_numels") or [0]
        layer_bytes = max(numels[1:-1] or numels) * _grad_bytes(r.get("runtime"),           # a decoder layer's
                                                                usable["sizes_from"].get("grad_bytes", 2))
        row["allreduce_busbw_gib_s"] = allreduce_busbw(layer_bytes, usable) if layer_bytes else None
    if fl and fl.get("status") == "ok":
        floor_s, bound, terms = _floor(system, r, fl, recipe, usable, ranks)
        row.update(floor_s=floor_s, floor_bound_by=bound, floor_partial=fl.get("partial"),
                   allreduce_s=terms.get("allreduce_s"), gather_s=terms.get("gather_s"))
        if row["step_s_mean"] and floor_s:
            row["step_over_floor"] = row["step_s_mean"] / floor_s
        hw_s, hw_bound, _ = _hardware_floor(system, r, fl, recipe, usable, ranks)
        row.update(hw_floor_s=hw_s, hw_floor_bound_by=hw_bound)
        if row["step_s_mean"] and hw_s:
            row["step_over_hw_floor"] = row["step_s_mean"] / hw_s
    return row


def _placement(r: dict) -> dict:
    """Where a slide run's auto settings put things (its resolved runtime): layer slots (0: one
    per layer; with a window, the resident layers beside it), vocabulary updates, device layers,
    and with offload the checkpoints kept on the GPU."""
    rt = r.get("runtime") or {}
    if rt.get("mode") != "slide":
        return {}
    out = {"cache_units": rt.get("cache_units")}
    if rt.get("cache_units"):      # a window: the layers with a slot of their own beside it
        out["resident_layers"] = max(0, int(rt.get("resident_layers") or 0))
    out.update({k: rt.get(k) for k in ("vocab_update", "device_layers")})
    if rt.get("disk_dir"):
        out["disk_units"] = max(0, int(rt.get("disk_units") or 0))
    if rt.get("offload_activations") in (True, "on"):
        out["gpu_checkpoints"] = max(0, int(rt.get("gpu_checkpoints") or 0))
    return out


def _host_rss_gib(r: dict) -> float | None:
    """The host's peak RSS of a run: one process's, or a data-parallel run's over its ranks with the
    shared state file counted once (telemetry.machine.host_peak_rss), recounted from the ranks'
    parts where the run recorded the file's size (runs before that undercounted it)."""
    from ...telemetry.machine import host_peak_rss
    parts, shared = r.get("rank_results"), r.get("shared_state_gib")
    if parts and shared is not None:
        return host_peak_rss(parts, int(shared * 2**30)) / 2**30
    return r.get("host_rss_gib", r.get("cpu_peak_rss_gib"))


def add_scaling(rows: list[dict]) -> None:
    """Each row's scaling efficiency: its per-GPU tokens/s over that of the one-rank row of the same
    system, model, batch (per GPU), sequence and recipe in the same call (None without one)."""
    def key(r):
        return (r["model"], int(r["seq_len"]), int(r["batch_size"]), r["system"], r.get("recipe"), r.get("variant"))
    base = {key(r): r["tokens_per_s"] for r in rows if int(r.get("gpus") or 1) == 1 and r.get("tokens_per_s")}
    for r in rows:
        one = base.get(key(r))
        per_gpu = r.get("tokens_per_s_per_gpu")
        r["scaling_efficiency"] = per_gpu / one if one and per_gpu else None
