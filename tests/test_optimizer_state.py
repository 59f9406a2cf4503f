"""The optimizer's own description of its state (engine/adamw.py FP32_ADAMW), which the fit, the
placement, the disk tier, the roofline and the save plan count, against what FlatAdamW allocates."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from slidetune.engine.adamw import FP32_ADAMW, AdamWConfig, FlatAdamW, optimizer_state
from slidetune.engine.placement import STATES, PlacementPlan, UnitPlace
from slidetune.engine.tiers import TIERS, Tier


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_the_state_description_is_what_flat_adamw_allocates():
    n = 1000
    master = torch.zeros(n)                                   # [n] fp32
    opt = FlatAdamW(master, n_decay=600, cfg=AdamWConfig())
    assert FlatAdamW.STATE is FP32_ADAMW
    state = opt.state_tensors()
    moments = {k: v for k, v in state.items() if k != "step"}
    assert tuple(moments) == FP32_ADAMW.moment_names == ("exp_avg", "exp_avg_sq")
    assert all(v.numel() == n and v.dtype == FP32_ADAMW.moment_dtype for v in moments.values())
    assert sum(_nbytes(v) for v in moments.values()) == FP32_ADAMW.moment_bytes * n == 8 * n
    assert _nbytes(master) == FP32_ADAMW.master_bytes * n == 4 * n
    assert _nbytes(master) + sum(_nbytes(v) for v in moments.values()) == FP32_ADAMW.bytes_per_param * n == 12 * n
    assert state["step"].dtype == FP32_ADAMW.step_dtype and _nbytes(state["step"]) == FP32_ADAMW.step_bytes == 4
    # moments elsewhere (the disk tier): only the step is allocated here
    away = FlatAdamW(master, n_decay=n, cfg=AdamWConfig(), moments_here=False)
    assert away.exp_avg is None and away.exp_avg_sq is None and _nbytes(away.step_count) == FP32_ADAMW.step_bytes


def test_one_step_moves_the_state_it_describes():
    """After a step every moment the description names has been written (none is dead weight)."""
    n = 5000
    opt = FlatAdamW(torch.ones(n), n_decay=n, cfg=AdamWConfig(lr=1e-3), kernel="torch")
    opt.begin_step()
    opt.update(torch.full((n,), 0.5), lr=1e-3)
    assert all(bool((opt.state_tensors()[name] != 0).all()) for name in FP32_ADAMW.moment_names)


def test_a_disk_unit_holds_the_moments_or_the_whole_state_on_disk():
    moments = UnitPlace(1, "layer.0", 10, state="disk", slot="window")
    everything = UnitPlace(1, "layer.0", 10, state="disk", slot="window", master="disk")
    host = UnitPlace(2, "layer.1", 10, state="host", slot="window")
    plan = PlacementPlan(units=(moments, host), window_slots=3, gpu_checkpoints=0, schedule="eager")
    assert plan.disk_bytes_per_param(moments) == FP32_ADAMW.moment_bytes == 8
    assert plan.disk_bytes_per_param(everything) == FP32_ADAMW.bytes_per_param == 12
    assert plan.disk_bytes_per_param(host) == 0
    compact = dataclasses.replace(plan, host_state=optimizer_state("bf16", "8bit"))
    assert compact.disk_bytes_per_param(moments) == 2 + 2 * 4 / 256
    assert compact.disk_bytes_per_param(everything) == 4 + 2 * 4 / 256


def test_the_placement_tiers_are_registered_once():
    """engine/tiers.py: each place a unit's state lives is one registered class, which the plan's
    records name (STATES, in the order they always had) and the plan's readers ask."""
    assert STATES == ("gpu", "shard", "host", "disk")
    assert [t.name for t in TIERS.host_updated()] == ["host", "disk"]
    files = TIERS.with_files
    assert files.name == "disk" and files.keeps_files and files.streams_state
    assert [t.name for t in TIERS if t.keeps_files] == ["disk"]
    with pytest.raises(ValueError, match="a name of its own"):
        TIERS.register(type("HostAgain", (Tier,), {"name": "host"}))
    with pytest.raises(ValueError, match="not a tier"):
        TIERS["tape"]
    # a disk unit's master defaults to RAM; only a disk unit's master can live on disk
    assert UnitPlace(1, "layer.0", 10, state="disk", slot="window").master == "host"
    with pytest.raises(ValueError, match="only a disk unit's master can live on disk"):
        UnitPlace(1, "layer.0", 10, state="host", slot="window", master="disk")
    unit = UnitPlace(1, "layer.0", 10, state="disk", slot="window", master="disk")
    plan = PlacementPlan(units=(unit,), window_slots=3, gpu_checkpoints=0, schedule="eager")
    assert files.holds(unit) and files.holds_master(unit) and plan.master_units(files) == 1
    assert plan.disk_io_bytes() == files.io_bytes_per_step(plan) == 2 * 12 * 10


def test_the_readers_numbers_are_the_ones_they_wrote_before():
    """Each reader's figure, built from FP32_ADAMW, is still the number it stated: the roofline's
    AdamW passes (26/28 B/param, the split pair 18 + 18, the copy pass 16) and upload read (4), the
    disk probe's moments-only block, the shared host state's layout (master, two moments, step)."""
    from slidetune.bench.floor_probes import ADAMW_BYTES
    from slidetune.bench.roofline import UPLOAD_READ_BYTES
    from slidetune.engine.distributed import SharedHostState
    from slidetune.engine.slide.disk_tier import block_layout
    assert ADAMW_BYTES == {"adamw_bf16_grad_params_per_s": 26, "adamw_fp32_grad_params_per_s": 28,
                           "adamw_weights_pass_params_per_s": 18, "adamw_moments_pass_params_per_s": 18,
                           "adamw_weights_copy_pass_params_per_s": 16}
    assert UPLOAD_READ_BYTES == 4
    moments, both = block_layout(FP32_ADAMW, False, 1024), block_layout(FP32_ADAMW, True, 1024)
    assert moments.names == ("exp_avg", "exp_avg_sq") and both.names == ("master", "exp_avg", "exp_avg_sq")
    assert moments.offsets == {"exp_avg": 0, "exp_avg_sq": 4096}        # the files' layout, as it always was
    assert moments.file_bytes(1024) == 8 * 1024 and both.file_bytes(1024) == 12 * 1024
    # 64-byte aligned pieces: 1024 params -> 4096 B each of master and moments, a step 64, versions 16 -> 64
    assert SharedHostState.layout_bytes([1024]) == 3 * 4096 + 64 + 64
    assert SharedHostState.layout_bytes([1024], frozenset({0})) == 4096 + 64 + 64
