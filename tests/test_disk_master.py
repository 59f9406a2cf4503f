"""The disk tier's masters (--tuning.disk_master, engine/slide/disk_tier.py): a disk unit's FP32
master lives in its blocks beside the moments (12 B/param on disk) and host RAM keeps only the
unit's weights in the compute dtype, which its uploads copy as they are.

- bit-exact against the in-RAM store over several steps, eager and clipped with accumulation,
  tied and untied embeddings, FP32 and BF16 compute (the FP32 master is what is exact; BF16
  weights cast once at the update are the ones an upload would cast);
- across a checkpoint/resume (test_disk_tier.py's resume test, "master" rows), and final/'s
  weights equal the in-RAM store's, streamed from the tier;
- the plan, the fit estimate, the tier's size and the floor's disk term read where each master
  lives from the one plan; auto puts masters on disk only where the moments alone leave host RAM
  short, and then as few as make it fit;
- the scratch files hold weights: never removed before final/ is written;
- `slidetune train --disk-dir D --tuning.disk_units 2 --tuning.disk_master on` end to end.
"""
from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from slidetune.bench.roofline import floor_terms, plan_of_runtime
from slidetune.checkpoint import save_checkpoint
from slidetune.engine import AdamWConfig, RuntimeConfig, build_engine
from slidetune.engine.fit import FIT_SAFETY, GiB, check_fit, choose_auto_settings, estimate_memory
from slidetune.engine.placement import PlacementPlan, shapes_from_counts, unit_shapes
from slidetune.engine.slide import disk_tier
from slidetune.engine.slide.disk_tier import StreamedTensor, block_elems, buffer_bytes, tier_bytes
from slidetune.models.load import LoadedModel, RandomInit, skeleton
from slidetune.models.presets import tiny_config
from slidetune.models.units import SplitModel
from slidetune.engine.tiers import TIERS
from slidetune.checkpoint.space import DiskSpaceError, plan_saves
from test_checkpoint import VOCAB, shut, train
from test_disk_tier import DISK, assert_identical, state
from test_fit import cuda_rt, split_of


def engine(tmp_path, master: str | None, *, family="llama", tied=False, accum=1, clip=None, dtype="fp32",
           layers=4, disk_units=3):
    """A tiny slide engine on the CPU; master None: everything in RAM; "off": the moments of
    `disk_units` units on disk; "on": their masters too."""
    cfg = tiny_config(family, tied=tied, vocab_size=VOCAB, layers=layers)
    loaded = LoadedModel("t", SplitModel(skeleton(cfg)), RandomInit(1, std=0.1, bias_std=0.1), None)
    extra = {} if master is None else dict(disk_units=disk_units, disk_dir=str(tmp_path), disk_master=master, **DISK)
    rt = RuntimeConfig(mode="slide", dtype=dtype, device="cpu", **extra)
    return build_engine(loaded, rt, AdamWConfig(lr=1e-3, weight_decay=0.1), grad_accum=accum, max_grad_norm=clip)


def P_masters(rt: RuntimeConfig) -> int:
    """Parameters of Qwen3-14B whose master `rt` puts on disk."""
    return PlacementPlan.build(unit_shapes(split_of("qwen3-14b")), rt).master_params("disk")


# --------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("embeddings", ["untied", "tied"])
@pytest.mark.parametrize("recipe", ["eager", "clip-accum2"])
def test_masters_on_disk_are_bit_exact_against_the_ram_store(tmp_path, recipe, embeddings):
    accum, clip = (1, None) if recipe == "eager" else (2, 0.5)
    family, tied = ("llama", False) if embeddings == "untied" else ("qwen3", True)
    ram = engine(tmp_path, None, family=family, tied=tied, accum=accum, clip=clip)
    disk = engine(tmp_path, "on", family=family, tied=tied, accum=accum, clip=clip)
    try:
        # the head and layers 3, 2: their masters are not in RAM, their weights are
        assert [u.tier.holds_master for u in disk.units] == [False, False, False, True, True, True]
        assert all(u.master is None and u.weights is not None for u in disk.units[3:])
        assert train(ram, range(4), accum) == train(disk, range(4), accum)
        want, got = state(ram), state(disk)
        assert_identical(want, got)
        for u in disk.units[3:]:         # the RAM copy the uploads read is the master's, updated last step
            flat = torch.cat([got[p.full_name].reshape(-1) for p in u.spec.params])
            assert torch.equal(u.weights, flat.to(u.weights.dtype))
        report = disk.memory_report()
        assert report["disk_state"] == 12 * sum(u.spec.numel for u in disk.units[3:])
        assert report["disk_read"] > 0 and report["disk_written"] > 0
    finally:
        shut(ram)
        shut(disk)


def test_bf16_weights_in_ram_are_what_the_uploads_would_cast(tmp_path):
    """BF16 compute: the disk-master units' uploads copy BF16 weights cast once at the update, the
    in-RAM store's cast the master at each upload: the same bits, so the same trajectory; and the
    host holds 2 B/param of those units instead of the moments-only tier's 4."""
    ram = engine(tmp_path, None, dtype="bf16")
    moments = engine(tmp_path, "off", dtype="bf16")
    masters = engine(tmp_path, "on", dtype="bf16")
    try:
        losses = train(ram, range(3))
        assert train(moments, range(3)) == losses and train(masters, range(3)) == losses
        want = state(ram)
        assert_identical(want, state(masters))
        P_disk = sum(u.spec.numel for u in masters.units[3:])
        assert all(u.weights.dtype == torch.bfloat16 for u in masters.units[3:])
        saved = moments.memory_report()["host_state"] - masters.memory_report()["host_state"]
        assert saved == (4 - 2) * P_disk
    finally:
        for e in (ram, moments, masters):
            shut(e)


def test_final_weights_stream_from_the_tier_and_equal_the_ram_stores(tmp_path):
    """final/ (BF16) and an FP32 save of a disk-master engine: its masters come as StreamedTensors
    (never a whole unit in RAM) and the files hold the same tensors as the in-RAM store's."""
    ram = engine(tmp_path, None, accum=2, clip=0.5)
    disk = engine(tmp_path, "on", accum=2, clip=0.5)
    try:
        train(ram, range(2), 2)
        train(disk, range(2), 2)
        disk.synchronize()
        streamed = {n for n, t in disk.named_master_params() if isinstance(t, StreamedTensor)}
        assert streamed == {p.full_name for u in disk.units[3:] for p in u.spec.params}
        for dtype in ("bf16", "fp32"):
            a = save_checkpoint(ram, tmp_path / f"ram-{dtype}", step=2, save_dtype=dtype, with_optimizer=False)
            b = save_checkpoint(disk, tmp_path / f"disk-{dtype}", step=2, save_dtype=dtype, with_optimizer=False)
            want, got = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
            assert want.keys() == got.keys()
            for k in want:
                assert torch.equal(want[k], got[k]), (dtype, k)
        with pytest.raises(RuntimeError, match="holds the FP32 masters .* until final/ is written"):
            disk.release_disk_tier()
    finally:
        shut(ram)
        shut(disk)


# --------------------------------------------------------------------------- the plan, the fit, the floor
def test_the_plan_says_where_each_master_lives():
    shapes = shapes_from_counts(6, 100, 50, 50)
    every = PlacementPlan.build(shapes, RuntimeConfig(disk_dir="/x", disk_units=3, disk_master="on"))
    assert [u.master for u in every.units] == ["host"] * 5 + ["disk"] * 3
    assert every.state_bytes() == {"gpu": 0, "host": 12 * 450, "disk": 12 * 250}
    assert every.disk_io_bytes() == 24 * 250
    assert "disk tier (master + moments; compute-dtype weights in host RAM): layers 4-5, head" \
        in "\n".join(every.summary_lines())
    # a count: the first disk units in disk order (the head, then layer 5); the third keeps its master in RAM
    two = PlacementPlan.build(shapes, RuntimeConfig(disk_dir="/x", disk_units=3, disk_master=2))
    assert [u.index for u in two.units if u.master == "disk"] == [6, 7]
    assert two.state_bytes() == {"gpu": 0, "host": 12 * 450 + 4 * 100, "disk": 12 * 150 + 8 * 100}
    assert two.disk_io_bytes() == 24 * 150 + 16 * 100
    assert "the masters of layer 5, head too" in "\n".join(two.summary_lines())
    # off, or auto left unresolved: masters in RAM
    for value in ("off", "auto", 0):
        plan = PlacementPlan.build(shapes, RuntimeConfig(disk_dir="/x", disk_units=3, disk_master=value))
        assert plan.master_params("disk") == 0 and plan.disk_io_bytes() == 16 * 250
    assert PlacementPlan.from_dict(two.to_dict()) == two
    legacy = dict(two.to_dict(), units=[u[:4] for u in two.to_dict()["units"]])      # a record from before
    assert PlacementPlan.from_dict(legacy).master_params("disk") == 0
    with pytest.raises(ValueError, match="disk_master must be off, on, auto or a count"):
        RuntimeConfig(disk_master="sometimes")


def test_the_tier_the_fit_and_the_floor_count_12_bytes_a_param():
    """Qwen3-14B, 10 disk units, BF16: the fit's host parts hold 2 B/param of the disk-master units
    (their weights) where the moments-only tier holds 4 (their masters); the tier's files 12 B/param
    (whole blocks), its buffers a master's block wide; the floor's disk term 24 B/param."""
    split = split_of("qwen3-14b")
    kw = dict(batch_size=4, seq_len=1024, max_grad_norm=1.0)
    rt = cuda_rt(disk_dir="/x", disk_units=10, cache_units=3, vocab_update="host", grad_slot_dtype="compute",
                 device_layers=0)
    off = estimate_memory(split, dataclasses.replace(rt, disk_master="off"), **kw)
    on = estimate_memory(split, dataclasses.replace(rt, disk_master="on"), **kw)
    P_disk = on.plan.params("disk")
    assert on.plan.master_params("disk") == P_disk and off.plan.master_params("disk") == 0
    assert on.host_parts["disk-master units' weights (2 B/param; master + moments on disk)"] == 2 * P_disk
    assert off.host_parts["disk units' masters (4 B/param; moments on disk)"] == 4 * P_disk
    assert "disk units' masters (4 B/param; moments on disk)" not in on.host_parts
    block = block_elems(rt.disk.disk_block_mb)
    # disk_buffers left at auto, unresolved: the plan's 8 (fit.choose_auto_settings resolves it)
    assert rt.disk.disk_buffers == -1 and on.plan.disk_buffers == 8
    assert on.host_parts["disk tier block buffers"] == 8 * 12 * block == buffer_bytes(on.plan, rt.disk.disk_block_mb)
    assert on.disk_bytes == tier_bytes(on.plan, rt.disk.disk_block_mb)
    assert 12 * P_disk <= on.disk_bytes < 12 * (P_disk + 11 * block)       # 10 units and the head, whole blocks
    assert on.disk_bytes == off.disk_bytes * 12 // 8
    assert on.pinned_bytes - off.pinned_bytes == 2 * P_disk + on.plan.disk_buffers * 4 * block
    # the weights are page-locked; each disk-master unit passes through a 4 B/param buffer while built
    assert on.host_parts["weight loading transient"] > off.host_parts["weight loading transient"]
    comp = {"num_layers": 4, "layer_params": 100 * 2**20, "vocab_params": 50 * 2**20, "compute_s": 1.0,
            "layer_recompute_backward_s": 0.15, "head_s": 0.05, "embed_s": 0.01, "layer_forward_s": 0.05}
    disk = {"read_gib_s": 1.0, "write_gib_s": 2.0, "mixed_gib_s": 4.0}
    plan = plan_of_runtime(comp, {"disk_dir": "/x", "disk_units": 2, "disk_master": "on"})   # the head and layer 3
    P = 25 * 2**20 + 100 * 2**20
    assert TIERS.with_files.io_seconds(plan, disk) == pytest.approx(24 * P / (4 * 2**30))
    terms = floor_terms(comp, {"h2d_gib_s": 50.0, "d2h_gib_s": 50.0}, {"adamw_params_per_s": 1e9}, plan, disk=disk)
    assert terms["disk_s"] == pytest.approx(24 * P / (4 * 2**30))
    assert TIERS.with_files.io_seconds(plan, {"read_gib_s": 1.0, "write_gib_s": 2.0}) \
        == pytest.approx(12 * P / 2**30 + 12 * P / 2**31)


def test_auto_puts_masters_on_disk_only_where_the_moments_do_not_make_ram_fit(tmp_path, monkeypatch):
    """Qwen3-14B b4 clipped on a 78 GiB GPU: with 123 GiB of host RAM the moments of a few units
    suffice (disk_master auto -> off). With so little RAM that every unit's moments on disk are
    not enough, every unit that may go there goes, and the masters of as few of them as make the
    host fit: one fewer and it does not."""
    split = split_of("qwen3-14b")
    kw = dict(batch_size=4, seq_len=1024, max_grad_norm=1.0)
    rt = cuda_rt(disk_dir=str(tmp_path))
    gpu = 78 * GiB
    roomy = choose_auto_settings(split, rt, gpu_free_bytes=gpu, host_available_bytes=123 * GiB, **kw)
    assert roomy.disk.disk_units > 0 and roomy.disk.disk_master == "off"
    # the least host RAM this placement can need: everything on disk, masters too
    floor_rt = choose_auto_settings(split, rt, gpu_free_bytes=gpu, host_available_bytes=1 * GiB, **kw)
    assert floor_rt.disk.disk_master == "on"
    cap = PlacementPlan.build(unit_shapes(split), floor_rt).disk_capacity()
    assert floor_rt.disk.disk_units == cap
    moments_only = estimate_memory(split, dataclasses.replace(floor_rt, disk_master="off"), **kw).host_bytes
    everything = estimate_memory(split, floor_rt, **kw).host_bytes
    assert moments_only - everything > 10 * GiB          # ~2 B/param of every disk unit
    host = int((moments_only + everything) / 2 / FIT_SAFETY)    # between the two
    got = choose_auto_settings(split, rt, gpu_free_bytes=gpu, host_available_bytes=host, **kw)
    assert got.disk.disk_units == cap and got.disk.disk_master not in ("off", "on", "auto")
    m = int(got.disk.disk_master)
    est = estimate_memory(split, got, **kw)
    assert est.host_bytes <= FIT_SAFETY * host and est.plan.master_params("disk") > 0
    fewer = estimate_memory(split, dataclasses.replace(got, disk_master=str(m - 1)), **kw)
    assert fewer.host_bytes > FIT_SAFETY * host
    monkeypatch.setattr(disk_tier.shutil, "disk_usage", lambda p: SimpleNamespace(free=2**40))   # a 1 TiB disk
    assert check_fit(split, got, gpu_free_bytes=gpu, host_available_bytes=host, **kw).disk_bytes > 12 * P_masters(got)
    # explicit disk units: masters only where those units' moments leave the host short
    two = dataclasses.replace(rt, disk_units=2)
    assert choose_auto_settings(split, two, gpu_free_bytes=gpu, host_available_bytes=400 * GiB, **kw).disk.disk_master \
        == "off"
    # explicit disk_master is kept; on the CPU, where host RAM holds the state, auto means off (where
    # it does not, the disk tier is resolved by memory there too: test_plan_verdict)
    assert choose_auto_settings(split, dataclasses.replace(rt, disk_master="on"), gpu_free_bytes=gpu,
                                host_available_bytes=400 * GiB, **kw).disk.disk_master == "on"
    cpu = RuntimeConfig(device="cpu", disk_dir=str(tmp_path))
    assert choose_auto_settings(split, cpu, host_available_bytes=400 * GiB, **kw).disk.disk_master == "off"


def test_a_tier_holding_masters_is_never_removed_before_final(tmp_path):
    """checkpoint/space.py: the moments-only tier goes first where final/ fits only without it; a tier holding
    masters cannot (final/ is written from it): refused, naming disk_master off."""
    P14B = 14_768_307_200
    args = dict(save_dtype="bf16", output_dir=tmp_path, checkpoint_dir=tmp_path, keep_last=2, save_every=0,
                output_free=64 * GiB, checkpoint_free=64 * GiB, same_disk=True, scratch=(tmp_path, 55 * GiB))
    assert plan_saves(P14B, **args).release_scratch_first
    with pytest.raises(DiskSpaceError, match="--tuning.disk_master off"):
        plan_saves(P14B, scratch_holds_weights=True, **args)


# --------------------------------------------------------------------------- end to end
def test_train_with_masters_on_disk_end_to_end(tmp_path):
    from test_train_errors import COMMON, assert_loads, metric_steps, run_cli
    d, tier = tmp_path / "out", tmp_path / "tier"
    tier.mkdir()
    code, out, err = run_cli(*COMMON, "--mode", "slide", "--max-steps", "3", "--save-every", "2", "--output-dir",
                             str(d), "--disk-dir", str(tier), "--tuning.disk_units", "2",
                             "--tuning.disk_master", "on", "--verbose")     # the placement, on a CPU
    assert code == 0, err[-2000:]
    assert "disk tier (master + moments; compute-dtype weights in host RAM)" in out
    # disk_buffers auto: the read-ahead the fit chose, said before step 1 (the tier's blocks and buffers)
    assert re.search(r"disk_buffers auto -> \d+: \d+ MiB of block buffers, the disk tier's read-ahead", out)
    assert_loads(d / "final")
    assert metric_steps(d)[-1] == 3 and (d / "checkpoints" / "checkpoint-3" / "COMPLETE").exists()
    assert list(tier.iterdir()) == []                    # the scratch files went at close
    # the resumable checkpoint's weights are final/'s (FP32 both: the tiny preset has no dtype of its own)
    ckpt = load_file(d / "checkpoints" / "checkpoint-3" / "model.safetensors")
    final = load_file(d / "final" / "model.safetensors")
    assert ckpt.keys() == final.keys() and all(torch.equal(ckpt[k].to(final[k].dtype), final[k]) for k in final)


def test_data_parallel_refuses_masters_on_disk_by_name():
    """Several ranks upload a disk unit from the shared mapping, which holds masters: the masters on
    disk are refused there, by name, and auto leaves them off (docs/data_parallel.md)."""
    from types import SimpleNamespace as NS

    from slidetune.config import TrainConfig
    from slidetune.train_setup import TrainingError, _refuse_under_data_parallel
    cfg = TrainConfig(runtime=RuntimeConfig(disk_dir="/x", disk_units=2, disk_master="on"))
    with pytest.raises(TrainingError, match="--tuning.disk_master"):
        _refuse_under_data_parallel(cfg, NS(world_size=2))
    _refuse_under_data_parallel(TrainConfig(runtime=RuntimeConfig(disk_dir="/x", disk_units=2)), NS(world_size=2))
    split = split_of("qwen3-14b")
    kw = dict(batch_size=4, seq_len=1024, max_grad_norm=1.0)
    two = choose_auto_settings(split, cuda_rt(disk_dir="/x"), gpu_free_bytes=78 * GiB, host_available_bytes=1 * GiB,
                               ranks_per_host=2, **kw)
    assert two.disk.disk_master == "off"
