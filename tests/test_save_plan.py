"""The disk is part of the fit: final/ and resumable checkpoints against the free space."""
from __future__ import annotations


import pytest
import torch

from slidetune.checkpoint.space import (FILES_MARGIN, FREE_MARGIN, SAVE_DTYPE_BYTES, DiskSpaceError, plan_saves,
                                        resolve_save_dtype)
from test_train_errors import COMMON, assert_loads, fill_disk_for, metric_steps, run_cli

GiB = 2**30
P8B = 8_190_735_360                       # Qwen3-8B's parameters: a checkpoint is 98 GB


def plan(free_gib: float, ckpt_free_gib: float | None = None, **kw):
    args = dict(save_dtype="bf16", output_dir="/tmp", checkpoint_dir="/tmp", save_every=0, keep_last=2)
    args.update(kw)
    return plan_saves(P8B, output_free=int(free_gib * GiB), same_disk=ckpt_free_gib is None,
                      checkpoint_free=int((free_gib if ckpt_free_gib is None else ckpt_free_gib) * GiB), **args)


def test_the_8b_on_the_gpu_machine_disk_writes_final_only_and_says_so():
    """64 GiB free: final/ (bf16, 15 GiB) fits, a 92 GiB resumable checkpoint does not: the run goes
    on, without resumable checkpoints, and the note names the sizes and the way out."""
    p = plan(64)
    assert p.final_bytes == 2 * P8B + FILES_MARGIN and p.checkpoint_bytes == 12 * P8B + FILES_MARGIN
    assert not p.resumable
    (note,) = p.notes
    assert "only final/" in note and "--checkpoint-dir" in note and "cannot be resumed" in note
    assert plan(200).resumable and plan(200).notes == []


def test_periodic_checkpoints_that_do_not_fit_are_refused_with_options_that_do():
    with pytest.raises(DiskSpaceError) as e:
        plan(64, save_every=50)
    msg = str(e.value)
    assert "--save-every 0" in msg and "--checkpoint-dir on a disk with at least" in msg
    assert "Options that fit: --save-every 0" in msg and "--keep-last 1 " not in msg    # not even one fits
    # 250 GiB on the checkpoint disk: 3 at once (keep_last 2 + the one written) do not fit, 2 do
    with pytest.raises(DiskSpaceError) as e:
        plan(64, 250, save_every=50)
    assert "--keep-last 1 " in str(e.value)
    assert plan(64, 250, save_every=50, keep_last=1).resumable
    # on another disk, final/ does not count against the checkpoints' room
    assert plan(20, 300, save_every=50).resumable


def test_a_resume_counts_the_checkpoints_already_on_the_disk_once():
    """The 4x H200 host's disk (2026-11-28): 235 GiB free before the run, --save-every 12 --keep-last 1
    fits (two 92 GiB checkpoints at once beside a 15 GiB final/). After checkpoint 12, 143 GiB are
    free; the resume keeps the same promise (the one on the disk and the next one), so it must not ask
    for two new ones, which the same disk refused."""
    assert plan(235, save_every=12, keep_last=1).resumable
    assert plan(143.1, save_every=12, keep_last=1, existing_checkpoints=1).resumable
    with pytest.raises(DiskSpaceError):       # what the resume asked before: two more beside the one there
        plan(143.1, save_every=12, keep_last=1)
    # still one new checkpoint at least, however many are there
    with pytest.raises(DiskSpaceError) as e:
        plan(60, save_every=12, keep_last=1, existing_checkpoints=3)
    assert "beside the 3 already there" in str(e.value)
    # keep_last 2 with one there: two more at once (the old one, the next, the one written)
    assert not _fits(143.1, save_every=12, keep_last=2, existing_checkpoints=1)
    assert _fits(210, save_every=12, keep_last=2, existing_checkpoints=1)


def _fits(free_gib: float, **kw) -> bool:
    try:
        return plan(free_gib, **kw).resumable
    except DiskSpaceError:
        return False


def test_the_disk_tier_takes_its_room_first(tmp_path):
    """The disk tier's files are allocated when the engine starts, before anything is saved: on the
    output's disk they come off its free space. The 14B of the GPU machine: a 55 GiB tier on its
    64 GiB disk leaves 9 GiB, no room for final/ (27.5 GiB bf16). With nothing but final/ asked
    for, the tier's files are removed when training ends and final/ is written then (said up front);
    periodic checkpoints on that disk are refused, naming the tier. On another disk (a different
    device) the tier takes nothing from the output's."""
    P14B = 14_768_307_200
    args = dict(save_dtype="bf16", output_dir=tmp_path, checkpoint_dir=tmp_path, keep_last=2,
                output_free=64 * GiB, checkpoint_free=64 * GiB, same_disk=True)
    alone = plan_saves(P14B, save_every=0, **args)
    assert alone.final_bytes < 28 * GiB and not alone.release_scratch_first
    shared = plan_saves(P14B, save_every=0, scratch=(tmp_path, 55 * GiB), **args)
    assert shared.release_scratch_first and not shared.resumable
    (note,) = shared.notes
    assert "tier's files are removed when training ends, then final/ is written" in note and "--checkpoint-dir" in note
    with pytest.raises(DiskSpaceError) as e:
        plan_saves(P14B, save_every=50, scratch=(tmp_path, 55 * GiB), **args)
    assert "disk tier's 55.0 GiB of files" in str(e.value) and "--disk-dir on another disk" in str(e.value)
    assert "9.0 GiB free" in str(e.value)
    # a disk too small for final/ even without the tier: refused
    with pytest.raises(DiskSpaceError, match="final/"):
        plan_saves(P14B, save_every=0, scratch=(tmp_path, 55 * GiB), **dict(args, output_free=20 * GiB))
    # the tier elsewhere: /proc is another filesystem than tmp_path's
    other = plan_saves(P14B, save_every=0, scratch=("/proc", 55 * GiB), **args)
    assert not other.release_scratch_first and other.notes


def test_a_run_whose_disk_tier_and_final_do_not_fit_together_removes_the_tier_first(tmp_path, monkeypatch):
    """End to end on CPU: slide mode with 2 disk units, and a disk reported with room for final/ but
    not for final/ beside the tier's files. The run says so up front, trains, removes the tier's
    files, writes final/ (loadable), and no resumable checkpoint."""
    import slidetune.train_setup as train_mod
    d, tier = tmp_path / "out", tmp_path / "tier"
    tier.mkdir()
    seen = {}

    def tier_then_final(num_params, **kw):
        final = num_params * SAVE_DTYPE_BYTES[kw["save_dtype"]] + FILES_MARGIN
        scratch = kw["scratch"]
        seen["scratch"] = scratch
        free = int((final + scratch[1] // 2) / (1 - FREE_MARGIN))         # final/ fits, not with the tier
        return plan_saves(num_params, **kw, output_free=free, checkpoint_free=free, same_disk=True)

    monkeypatch.setattr(train_mod, "plan_saves", tier_then_final)
    code, out, err = run_cli(*COMMON, "--mode", "slide", "--max-steps", "2", "--output-dir", str(d),
                             "--disk-dir", str(tier), "--tuning.disk_units", "2")
    assert code == 0, err[-2000:]
    assert seen["scratch"][0] == tier and seen["scratch"][1] > 0
    assert "tier's files are removed when training ends" in err
    assert_loads(d / "final")
    assert list(tier.iterdir()) == [] and not (d / "checkpoints").exists() and metric_steps(d)[-1] == 2


def test_final_that_does_not_fit_is_refused_and_bf16_offered():
    with pytest.raises(DiskSpaceError, match="--save-dtype bf16"):
        plan(20, save_dtype="fp32")                       # 30.5 GiB in FP32, 15.3 in BF16
    with pytest.raises(DiskSpaceError, match="--output-dir on a disk"):
        plan(10)


def test_save_dtype_auto_is_the_checkpoints_own():
    class Cfg:
        def __init__(self, dtype):
            self.dtype = dtype
    assert resolve_save_dtype("auto", Cfg(torch.bfloat16), "fp32") == "bf16"
    assert resolve_save_dtype("auto", Cfg("float32"), "bf16") == "fp32"
    assert resolve_save_dtype("auto", Cfg(None), "bf16") == "bf16"       # a preset shape: the compute dtype
    assert resolve_save_dtype("auto", Cfg(None), "fp16") == "fp32"
    assert resolve_save_dtype("fp32", Cfg(torch.bfloat16), "bf16") == "fp32"


def test_a_run_whose_checkpoint_does_not_fit_writes_final_only(tmp_path, monkeypatch):
    """The CLI end to end: the free space reported leaves room for final/ only; the run says so up
    front, trains, writes final/ (loadable) and metrics, and no checkpoint directory."""
    import slidetune.train_setup as train_mod
    d = tmp_path / "small_disk"

    def small_disk(num_params, **kw):
        """A disk with room for final/ and a little more, whatever the model's size."""
        final = num_params * SAVE_DTYPE_BYTES[kw["save_dtype"]] + FILES_MARGIN
        free = int((final + 12 * num_params + FILES_MARGIN - 4096) / (1 - FREE_MARGIN))   # a checkpoint 4 KiB short
        return plan_saves(num_params, **kw, output_free=free, checkpoint_free=free, same_disk=True)

    monkeypatch.setattr(train_mod, "plan_saves", small_disk)
    code, out, err = run_cli(*COMMON, "--max-steps", "2", "--output-dir", str(d))
    assert code == 0, err[-2000:]
    assert "only final/" in err
    assert_loads(d / "final")
    assert not (d / "checkpoints").exists() and metric_steps(d)[-1] == 2
    # periodic checkpoints asked for on that disk: refused before step 1, nothing written
    code, out, err = run_cli(*COMMON, "--max-steps", "2", "--save-every", "1", "--output-dir", str(tmp_path / "r"))
    assert code != 0 and "--save-every 0" in err and not (tmp_path / "r").exists()


def test_final_survives_a_failed_resumable_save(tmp_path, monkeypatch):
    """final/ is written first: a disk that fills while the end-of-run resumable checkpoint is
    written leaves final/ whole and loadable, and the error says what is there."""
    fill_disk_for(monkeypatch, "checkpoint-")
    d = tmp_path / "fills"
    code, out, err = run_cli(*COMMON, "--max-steps", "2", "--output-dir", str(d))
    assert code != 0 and "No space left on device" in err
    assert_loads(d / "final")
    assert not any(p.name.startswith("checkpoint-2") for p in (d / "checkpoints").iterdir())
