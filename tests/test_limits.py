"""engine.limits: the largest batch and the longest sequence that fit a machine, per recipe, found by
search over the fit check; `slidetune plan` states them.

Every limit is checked from outside the search, the way `slidetune train` would take it: the auto
settings resolved at the size (choose_auto_settings), then check_fit; the limit passes, one step
past it is refused. No limit number is asserted beyond sanity ranges (the fit margins move)."""
from __future__ import annotations

import contextlib
import io
import re

import pytest

from slidetune.cli import main
from slidetune.engine.config import RuntimeConfig
from slidetune.engine.distributed import SharedMemoryError
from slidetune.engine.fit import InsufficientMemoryError, check_fit, choose_auto_settings
from slidetune.engine.limits import (BATCH_CAP, MachineBudget, Recipe, find_limits, largest_fitting, limit_words,
                                     recipes_for, seq_step_for)
from slidetune.engine.slide.disk_tier import DiskTierError
from slidetune.models.load import load_model, skeleton
from slidetune.models.presets import tiny_config
from slidetune.models.units import SplitModel

GiB = 2**30


def trains(split, rt, budget: MachineBudget, batch: int, seq: int, recipe: Recipe, padded: bool) -> bool:
    """Would `slidetune train` take this size: its auto settings resolved, then check_fit."""
    kw = dict(batch_size=batch, seq_len=seq, max_grad_norm=recipe.max_grad_norm, padded=padded)
    resolved = choose_auto_settings(split, rt, gpu_free_bytes=budget.gpu_free_bytes,
                                    host_available_bytes=budget.host_available_bytes, **kw)
    try:
        check_fit(split, resolved, gpu_free_bytes=budget.gpu_free_bytes,
                  host_available_bytes=budget.host_available_bytes, disk_free_bytes=budget.disk_free_bytes, **kw)
    except (InsufficientMemoryError, DiskTierError, SharedMemoryError):
        return False
    return True


def assert_limits_hold(split, rt, budget, limits, padded):
    """Each recipe's limits fit and one step past them does not (or they are the cap); the plain
    recipe (no held gradients) reaches at least as far as the clipped one."""
    assert [r.recipe.name for r in limits.recipes] == ["clip 1.0", "no clip"]
    for r in limits.recipes:
        b, s = r.largest_batch, r.longest_seq
        assert b.monotone and s.monotone
        assert b.value >= 1 and trains(split, rt, budget, b.value, limits.seq_len, r.recipe, padded)
        if b.capped_by:
            assert b.value == BATCH_CAP
        else:
            assert not trains(split, rt, budget, b.value + 1, limits.seq_len, r.recipe, padded)
            assert b.over.batch_size == b.value + 1 and b.over.binds
        assert s.value % s.step == 0 and trains(split, rt, budget, 1, s.value, r.recipe, padded)
        if s.capped_by:
            assert s.value == s.cap
        else:
            assert not trains(split, rt, budget, 1, s.value + s.step, r.recipe, padded)
            assert s.over.seq_len == s.value + s.step and s.over.binds
    clip, plain = limits.recipes
    assert plain.largest_batch.value >= clip.largest_batch.value
    assert plain.longest_seq.value >= clip.longest_seq.value


# ----------------------------------------------------------------------------- the search


@pytest.mark.parametrize("limit", [0, 1, 2, 3, 7, 64, 100, 4095, 4096])
@pytest.mark.parametrize("start", [1, 16, 5000])
def test_largest_fitting_finds_the_boundary_of_a_monotone_fit(limit, start):
    probed = []

    def fits(k):
        probed.append(k)
        return k <= limit
    found, monotone = largest_fitting(fits, start, 4096)
    assert (found, monotone) == (limit, True)
    assert len(probed) <= 2 * 13 + 2            # doubling, one guard, bisection: logarithmic
    assert all(1 <= k <= 4096 for k in probed)


def test_largest_fitting_flags_a_fit_past_a_failure():
    """A fit that fails at 8 and 9 but holds again at 16: the guard sees it and the search goes on."""
    found, monotone = largest_fitting(lambda k: k <= 6 or 16 <= k <= 20, 1, 4096)
    assert not monotone and 16 <= found <= 20


def test_seq_step_is_1024_or_a_16th_of_a_short_context():
    assert seq_step_for(40960) == seq_step_for(131072) == seq_step_for(None) == 1024
    assert seq_step_for(2048) == 128 and seq_step_for(4096) == 256 and seq_step_for(8) == 1


def test_the_clipped_recipe_keeps_the_runs_own_norm():
    assert [r.name for r in recipes_for(0.5)] == ["clip 0.5", "no clip"]
    assert recipes_for(None)[0].max_grad_norm == 1.0


# ----------------------------------------------------------------------------- presets


@pytest.mark.parametrize("model", ["qwen3-8b", "llama-3.1-8b"])
@pytest.mark.parametrize("offload", [False, True])
def test_8b_presets_on_a_24_gib_gpu(model, offload):
    """The lead's target: a 24 GiB GPU beside 123 GiB of host RAM, padded rows (the training data's)."""
    split = load_model(model, with_tokenizer=False).split
    rt = RuntimeConfig(device="cuda", dtype="bf16", offload_activations=offload)
    budget = MachineBudget.resolved(rt, gpu_free_bytes=24 * GiB, host_available_bytes=123 * GiB)
    limits = find_limits(split, rt, budget, seq_len=1024, batch_size=16, padded=True)
    assert_limits_hold(split, rt, budget, limits, padded=True)
    clip, plain = limits.recipes
    # sanity: an 8B step on such a machine takes a few to a few hundred sequences of 1024, and at
    # least 8K tokens in one sequence
    assert 4 <= clip.largest_batch.value <= 512 and clip.longest_seq.value >= 8192
    if offload:
        # offloaded checkpoints spend host RAM: it is what binds the clipped recipe (its held gradients)
        assert "host RAM" in clip.largest_batch.over.binds


def test_a_disk_tier_too_small_is_what_binds(tmp_path):
    """With --disk-dir, the disk tier's units are re-chosen at every size; a disk with 20 GiB free
    stops the clipped recipe where its files outgrow it."""
    split = load_model("qwen3-8b", with_tokenizer=False).split
    rt = RuntimeConfig(device="cuda", dtype="bf16", offload_activations=True, disk_dir=str(tmp_path))
    budget = MachineBudget.resolved(rt, gpu_free_bytes=24 * GiB, host_available_bytes=100 * GiB,
                                    disk_free_bytes=20 * GiB)
    limits = find_limits(split, rt, budget, seq_len=1024, batch_size=4, padded=False)
    assert_limits_hold(split, rt, budget, limits, padded=False)
    clip = limits.recipes[0].largest_batch
    assert clip.over.binds == ("disk",)
    assert "units on disk" in clip.at.how() and clip.at.estimate.disk_bytes <= 20 * GiB


def test_a_recipe_the_runtime_cannot_run_is_left_out():
    split = load_model("qwen3-1.7b", with_tokenizer=False).split
    rt = RuntimeConfig(device="cuda", dtype="bf16", schedule="eager")
    budget = MachineBudget.resolved(rt, gpu_free_bytes=24 * GiB, host_available_bytes=64 * GiB)
    limits = find_limits(split, rt, budget, seq_len=1024, max_grad_norm=1.0)
    assert [r.recipe.name for r in limits.recipes] == ["no clip"]


# ----------------------------------------------------------------------------- tiny configs


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("device, gpu_gib, host_gib", [("cpu", None, 1.0), ("cuda", 1.5, 64)])
def test_tiny_configs_fit_exactly_up_to_their_limits(family, device, gpu_gib, host_gib):
    """On tiny models every size is checked, not only the boundary: each batch up to the limit fits
    and none past it, up to twice the limit (the monotonicity the search assumes)."""
    split = SplitModel(skeleton(tiny_config(family, layers=3)))
    rt = RuntimeConfig(device=device, dtype="fp32" if device == "cpu" else "bf16")
    budget = MachineBudget.resolved(rt, gpu_free_bytes=int(gpu_gib * GiB) if gpu_gib else None,
                                    host_available_bytes=int(host_gib * GiB))
    limits = find_limits(split, rt, budget, seq_len=64, padded=True)
    assert_limits_hold(split, rt, budget, limits, padded=True)
    for r in limits.recipes:
        b = r.largest_batch.value
        assert 1 <= b < BATCH_CAP
        assert [trains(split, rt, budget, k, 64, r.recipe, True) for k in range(1, 2 * b + 1)] == \
            [True] * b + [False] * b
        step, s = r.longest_seq.step, r.longest_seq.value
        assert step == 128            # the tiny presets' 2048-token context
        fits = [trains(split, rt, budget, 1, k * step, r.recipe, True) for k in range(1, 2048 // step + 1)]
        assert fits == [k * step <= s for k in range(1, 2048 // step + 1)]


# ----------------------------------------------------------------------------- slidetune plan


def plan(*args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["plan", *args])
    assert code == 0, out.getvalue()
    return out.getvalue()


GPU_24G = ["--model", "qwen3-8b", "--batch-size", "16", "--seq-len", "1024", "--device", "cuda",
           "--offload-activations", "--gpu-free-gib", "24", "--host-gib", "123"]


def test_plan_states_the_limits_after_its_verdict():
    text = plan(*GPU_24G)
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("limits ("))
    assert any(line.startswith(("fits", "does not fit")) for line in lines[:at])
    block = lines[at + 1:at + 5]
    assert block[0].lstrip().startswith("largest batch at seq 1,024:") and "clip 1.0 -> " in block[0]
    assert "no clip  -> " in block[1]
    assert block[2].lstrip().startswith("longest sequence at batch 1:") and "clip 1.0 -> " in block[2]
    assert "no clip  -> " in block[3]
    # the numbers are find_limits' for the machine described (packed rows, train's default data: no padding)
    split = load_model("qwen3-8b", with_tokenizer=False).split
    rt = RuntimeConfig(device="cuda", dtype="bf16", offload_activations=True)
    limits = find_limits(split, rt, MachineBudget(24 * GiB, 123 * GiB), seq_len=1024, batch_size=16,
                         max_grad_norm=1.0, padded=False)
    clip, plain = limits.recipes
    expected = [clip.largest_batch, plain.largest_batch, clip.longest_seq, plain.longest_seq]
    assert [line.split(" -> ")[1] for line in block] == [limit_words(lim) for lim in expected]
    assert f"-> {clip.largest_batch.value:,} (" in block[0]
    assert re.search(r"at [\d,]+: host RAM binds", text)
    assert "plan again with --disk-dir PATH" in text          # host RAM binds and no disk tier was given
    assert "limits (" not in plan(*GPU_24G, "--no-limits")


def test_plan_on_the_cpu_states_limits_against_host_ram():
    text = plan("--model", "tiny-llama", "--device", "cpu", "--host-gib", "1", "--seq-len", "64")
    assert re.search(r"largest batch at seq 64: +clip 1.0 -> \d+ \(at \d+: host RAM binds\)", text)


def test_plan_caps_the_gpu_at_gpu_memory_limit():
    text = plan("--model", "qwen3-8b", "--device", "cuda", "--gpu-free-gib", "80", "--gpu-memory-limit", "24",
                "--host-gib", "123", "--no-limits")
    assert "resolved on a GPU with 24.0 GiB free (--gpu-memory-limit 24)" in text
    # without --gpu-free-gib on a machine without a GPU, the limit describes the GPU planned for
    if not __import__("torch").cuda.is_available():
        text = plan("--model", "qwen3-8b", "--gpu-memory-limit", "24", "--host-gib", "123", "--no-limits")
        assert "resolved on a GPU with 24.0 GiB free (--gpu-memory-limit 24)" in text
