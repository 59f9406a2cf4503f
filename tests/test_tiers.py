"""The tier registry's formulas (engine/tiers.py, issue 49): the disk tier's floor term and host RAM
items and its directory check, from the tier, against the documented formulas computed here (FP32:
16 B/param through the disk a step, 24 with the master there; 4 B/param of master in RAM, or the
compute dtype's weights with the master on disk); a tier without files answers 0 and no items."""
from __future__ import annotations

import pytest

from slidetune.bench.roofline import floor_terms, plan_of_runtime
from slidetune.engine import RuntimeConfig
from slidetune.engine.fit import estimate_memory
from slidetune.engine.slide.disk_tier import DiskTierError
from slidetune.engine.tiers import TIERS

from test_fit import cuda_rt, split_of

GIB = 2**30
# 4 decoder layers of 100 Mi parameters, an embedding and a head of 25 Mi each: 6 units
COMP = {"num_layers": 4, "layer_params": 100 * 2**20, "vocab_params": 50 * 2**20, "compute_s": 1.0,
        "layer_recompute_backward_s": 0.15, "head_s": 0.05, "embed_s": 0.01, "layer_forward_s": 0.05}
LAYER, VOCAB = 100 * 2**20, 25 * 2**20
MIXED = {"read_gib_s": 1.0, "write_gib_s": 2.0, "mixed_gib_s": 4.0}
SPLIT = {"read_gib_s": 1.0, "write_gib_s": 2.0}
# (disk_units, disk_master) -> (parameters on disk, of them with their master there)
PLANS = {(2, "off"): (VOCAB + LAYER, 0),                  # the head and layer 3
         (2, "on"): (VOCAB + LAYER, VOCAB + LAYER),
         (5, "off"): (VOCAB + 4 * LAYER, 0),              # every unit but the embedding
         (5, "on"): (VOCAB + 4 * LAYER, VOCAB + 4 * LAYER)}


def plan_of(disk_units: int, disk_master: str):
    return plan_of_runtime(COMP, {"disk_dir": "/x", "disk_units": disk_units, "disk_master": disk_master})


@pytest.mark.parametrize("disk_units, disk_master", list(PLANS))
def test_the_disk_tiers_io_seconds_are_16_bytes_a_param_24_with_the_master(disk_units, disk_master):
    plan, files = plan_of(disk_units, disk_master), TIERS.with_files
    on_disk, masters = PLANS[disk_units, disk_master]
    assert plan.params(files) == on_disk and plan.master_params(files) == masters
    io = 16 * (on_disk - masters) + 24 * masters
    assert files.io_seconds(plan, MIXED) == pytest.approx(io / (4.0 * GIB))
    # no mixed rate: half the bytes read, half written, one after the other
    assert files.io_seconds(plan, SPLIT) == pytest.approx(io / 2 / GIB + io / 2 / (2.0 * GIB))
    assert files.io_seconds(plan, None) == 0.0
    # the floor's disk_s is the tier's term
    terms = floor_terms(COMP, {"h2d_gib_s": 50.0, "d2h_gib_s": 50.0}, {"adamw_params_per_s": 1e9}, plan, disk=MIXED)
    assert terms["disk_s"] == pytest.approx(io / (4.0 * GIB))


@pytest.mark.parametrize("disk_units, disk_master", list(PLANS))
def test_the_disk_tiers_host_ram_items(disk_units, disk_master):
    plan = plan_of(disk_units, disk_master)
    on_disk, masters = PLANS[disk_units, disk_master]
    want = {}
    if on_disk > masters:
        want["disk units' masters (4 B/param; moments on disk)"] = 4 * (on_disk - masters)
    if masters:
        want["disk-master units' weights (2 B/param; master + moments on disk)"] = 2 * masters
    want["disk tier block buffers"] = 12345
    assert TIERS.with_files.host_ram_items(plan, 2, 12345) == want
    # page-locked: the block buffers and the disk-master units' weights (one async H2D each upload)
    assert TIERS.with_files.pinned_host_bytes(plan, 2, 12345) == 12345 + 2 * masters
    host = VOCAB + 4 * LAYER + VOCAB - on_disk          # the rest: master and moments in RAM
    assert TIERS["host"].host_ram_items(plan, 2, 12345) == {"master + Adam moments (12 B/param)": 12 * host}


def test_tiers_without_files_answer_nothing(tmp_path):
    plan = plan_of(2, "on")
    rt = RuntimeConfig(disk_dir=str(tmp_path / "missing"), disk_units=2)
    for tier in TIERS:
        if tier.keeps_files:
            continue
        assert tier.io_seconds(plan, MIXED) == 0.0 and tier.pinned_host_bytes(plan, 2, 12345) == 0
        assert tier.free_bytes(rt) is None
        tier.check_resources(rt, plan, 10 * GIB)       # no directory to check: nothing raised
        if tier is not TIERS["host"]:
            assert tier.host_ram_items(plan, 2, 12345) == {}
    no_disk = plan_of(0, "off")
    assert TIERS.with_files.io_seconds(no_disk, MIXED) == 0.0
    assert TIERS.with_files.host_ram_items(no_disk, 2, 0) == {}
    assert TIERS.with_files.pinned_host_bytes(no_disk, 2, 12345) == 0


def test_the_estimate_holds_each_tiers_items():
    """Qwen3-14B, 10 disk units, BF16 weights: the estimate's host parts are the tiers' items."""
    split = split_of("qwen3-14b")
    for master in ("off", "on"):
        rt = cuda_rt(disk_dir="/x", disk_units=10, disk_master=master, cache_units=3, vocab_update="host",
                     device_layers=0)
        est = estimate_memory(split, rt, batch_size=4, seq_len=1024, max_grad_norm=1.0)
        files = TIERS.with_files
        P_disk, P_host = est.plan.params(files), est.plan.params("host")
        assert P_disk and P_host
        assert est.host_parts["master + Adam moments (12 B/param)"] == 12 * P_host
        if master == "on":
            assert est.host_parts["disk-master units' weights (2 B/param; master + moments on disk)"] == 2 * P_disk
        else:
            assert est.host_parts["disk units' masters (4 B/param; moments on disk)"] == 4 * P_disk
        for tier in TIERS:
            for label, nbytes in tier.host_ram_items(est.plan, 2, est.host_parts["disk tier block buffers"]).items():
                assert est.host_parts[label] == nbytes


def test_the_disk_tiers_directory_is_its_resource(tmp_path):
    files, plan = TIERS.with_files, plan_of(2, "off")
    rt = RuntimeConfig(disk_dir=str(tmp_path), disk_units=2)
    assert files.free_bytes(rt) > 0
    files.check_resources(rt, plan, 1)                               # there, writable, room
    files.check_resources(rt, plan, 1 << 60, free_bytes=2 << 60)     # a described disk: its size only
    with pytest.raises(DiskTierError, match=r"20.0 GiB free but the disk tier needs 30.0 GiB"):
        files.check_resources(rt, plan, 30 * GIB, free_bytes=20 * GIB)
    missing = RuntimeConfig(disk_dir=str(tmp_path / "missing"), disk_units=2)
    assert files.free_bytes(missing) is None
    files.check_resources(missing, plan, 0)                          # no files: nothing to check
    with pytest.raises(DiskTierError, match="--disk-dir .*missing does not exist"):
        files.check_resources(missing, plan, 1)


def test_the_floor_counts_a_disk_units_pass_in_the_host_format():
    """A disk unit's blocks hold the host's format (--moments), so its AdamW pass moves that
    format's bytes: with 8-bit moments fewer than FP32's 26 B/param (2026-11-29: it was FP32's)."""
    from slidetune.bench.floor_probes import adamw_bytes
    from slidetune.bench.roofline import adamw_dram_bytes
    from slidetune.engine.adamw import FP32_ADAMW
    key = "adamw_bf16_grad_params_per_s"
    for moments in ("fp32", "8bit"):
        plan = plan_of_runtime(COMP, {"disk_dir": "/x", "disk_units": 5, "disk_master": "off", "moments": moments})
        files = TIERS.with_files
        assert files.swept_state(plan) is plan.host_state
        on_disk, in_ram = plan.params(files), plan.params("host")
        want = adamw_bytes(plan.host_state)[key] * (on_disk + in_ram)
        assert adamw_dram_bytes(plan, {"grad_dtype": "bf16"}) == pytest.approx(want)
        if moments == "8bit":
            assert want < adamw_bytes(FP32_ADAMW)[key] * (on_disk + in_ram)
