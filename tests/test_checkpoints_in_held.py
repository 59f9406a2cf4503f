"""--tuning.checkpoints_in_held: offloaded layer-input checkpoints borrow their layer's held
gradient buffer (engine/slide/activations.py, deferred.DeferredSweep.lend_held).

The same trajectory as the FP32 reference and bit for bit the run without it, with the clipped
sweep slowed so that a checkpoint written before the sweep had read the buffer would corrupt the
gradient it reads; the checkpoints really in the held buffers (no slot of their own where they fit,
only the excess where they do not); the settings it needs refused by name."""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from reference import ReferenceTrainer, build_reference
from slidetune.engine import AdamWConfig, RuntimeConfig, build_engine
from slidetune.engine.placement import PlacementPlan
from slidetune.engine.slide import transfer
from test_equivalence import LR, STEPS, make_batches, make_loaded, max_param_rel_diff

CLIP = 0.5


def _runtime(in_held: str, **extra) -> RuntimeConfig:
    return RuntimeConfig(mode="slide", dtype="fp32", device="cpu", schedule="deferred", offload_activations=True,
                         gpu_checkpoints=0, clip_sweep="whole", held_buffers=1, checkpoints_in_held=in_held,
                         head_chunk_tokens=16, chunk_mb=1, **extra)


def _slow_sweep(monkeypatch) -> None:
    """Each unit's clipped update starts 50 ms late: the next forward reaches the layers while
    their held gradients are still unread."""
    update = transfer.GradDrain.deferred_update

    def late(unit, held, *a, **kw):
        time.sleep(0.05)
        return update(unit, held, *a, **kw)
    monkeypatch.setattr(transfer.GradDrain, "deferred_update", staticmethod(late))


def _train(rt: RuntimeConfig, accum: int, batch: int, seq: int, ref: ReferenceTrainer | None = None):
    """Run STEPS clipped steps (each against `ref` where given); -> (losses, norms, master params,
    the checkpoints' own host slots' bytes, the largest relative difference from `ref`'s params)."""
    loaded = make_loaded("llama", tied=False)
    engine = build_engine(loaded, rt, AdamWConfig(lr=LR, weight_decay=0.1, eps=1e-6), grad_accum=accum,
                          max_grad_norm=CLIP)
    losses, norms = [], []
    try:
        for step in range(STEPS):
            mbs = make_batches(step, accum, batch=batch, seq=seq)
            lr = LR * (0.5 + step)
            res = engine.train_step(mbs, lr)
            if ref is not None:
                ref_loss, ref_norm = ref.step(mbs, lr)
                assert res.loss == pytest.approx(ref_loss, rel=1e-5), f"step {step}"
                assert res.grad_norm() == pytest.approx(ref_norm, rel=1e-5), f"step {step}"
            losses.append(res.loss)
            norms.append(res.grad_norm())
        engine.synchronize()
        params = {n: t.detach().clone() for n, t in engine.named_master_params()}
        worst = max_param_rel_diff(engine, ref.model) if ref is not None else (0.0, "")
        own = engine.acts.pinned_bytes()
    finally:
        engine.close()
    return losses, norms, params, own, worst


@pytest.mark.parametrize("accum,batch,seq", [(1, 2, 24), (2, 2, 24), (1, 8, 512)],
                         ids=["fits-in-held", "accum2", "exceeds-held"])
def test_checkpoints_in_held_buffers_follow_the_reference_bit_for_bit(monkeypatch, accum, batch, seq):
    _slow_sweep(monkeypatch)
    ref = ReferenceTrainer(build_reference(make_loaded("llama", tied=False)), lr=LR, weight_decay=0.1, eps=1e-6,
                           max_grad_norm=CLIP)
    on = _train(_runtime("on"), accum, batch, seq, ref)
    off = _train(_runtime("off"), accum, batch, seq)
    worst, where = on[4]
    assert worst < 1e-5, f"{where}: relative difference {worst:.2e}"
    # the same arithmetic in the same order: identical, not close
    assert on[0] == off[0] and on[1] == off[1]
    assert all(torch.equal(on[2][n], off[2][n]) for n in off[2])
    # where the checkpoints fit their layers' held buffers no slot of their own is left; where they
    # exceed them, only the excess has one
    assert off[3] > 0
    if seq == 512:
        assert 0 < on[3] < off[3]
    else:
        assert on[3] == 0


def test_the_checkpoints_go_into_the_held_buffers():
    """The bytes of each offloaded checkpoint sit in its layer's held buffer between the forward
    and the backward: read there directly after a forward of a training step."""
    loaded = make_loaded("llama", tied=False)
    engine = build_engine(loaded, _runtime("on"), AdamWConfig(lr=LR), max_grad_norm=CLIP)
    seen: dict[int, bool] = {}
    load = engine.acts.load

    def checking(i, m=0):
        key = (i, m)
        part = engine.acts.borrowed.get(key)
        t = load(i, m)
        if part is not None:         # the borrowed part holds the checkpoint's leading elements
            seen[i] = torch.equal(part, t.reshape(-1)[: part.numel()])
        return t
    engine.acts.load = checking
    try:
        engine.train_step(make_batches(0, 1), LR)
        engine.synchronize()
    finally:
        engine.close()
    assert seen and all(seen.values()) and sorted(seen) == list(range(engine.split.num_layers))


def test_the_plan_records_and_describes_it():
    loaded = make_loaded("llama", tied=False)
    engine = build_engine(loaded, _runtime("on"), AdamWConfig(lr=LR), max_grad_norm=CLIP)
    try:
        plan = engine.plan
    finally:
        engine.close()
    assert plan.checkpoints_in_held and all(plan.lends_checkpoint(i) for i in range(plan.num_layers))
    assert "offloaded checkpoints in their layers' held gradient buffers: 4 of 4" in "\n".join(plan.summary_lines())
    again = PlacementPlan.from_dict(plan.to_dict())
    assert again.checkpoints_in_held and again.lends_checkpoint(0)


@pytest.mark.parametrize("extra,named", [({"clip_sweep": "split"}, "clip_sweep whole"),
                                         ({"held_buffers": 2}, "held_buffers 1")])
def test_the_settings_it_needs_are_refused_by_name(extra, named):
    rt = RuntimeConfig(mode="slide", dtype="fp32", device="cpu", offload_activations=True,
                       checkpoints_in_held="on", **{"clip_sweep": "whole", **extra})
    with pytest.raises(ValueError, match=named):
        build_engine(make_loaded("llama", tied=False), rt, AdamWConfig(lr=LR), max_grad_norm=CLIP)


def test_a_lent_buffer_waits_for_the_sweeps_read(monkeypatch):
    """lend_held's wait returns only once the clipped sweep has read the layer's held gradient:
    asked while the sweep (slowed to 0.2 s a unit, from the embedding up) is still on its way to
    the top layer, it blocks until that layer's update has ended."""
    ended: dict[str, float] = {}
    update = transfer.GradDrain.deferred_update

    def late(unit, held, *a, **kw):
        time.sleep(0.2)
        out = update(unit, held, *a, **kw)
        ended[unit.spec.name] = time.monotonic()
        return out
    monkeypatch.setattr(transfer.GradDrain, "deferred_update", staticmethod(late))
    engine = build_engine(make_loaded("llama", tied=False), _runtime("on"), AdamWConfig(lr=LR), max_grad_norm=CLIP)
    try:
        top = engine.split.num_layers - 1
        engine.train_step(make_batches(0, 1), LR)
        asked = time.monotonic()
        buffer, wait_until_read = engine.sweep.lend_held(top)
        wait_until_read()
        returned = time.monotonic()
        name = engine.units[top + 1].spec.name
        assert buffer is engine.units[top + 1].held[0]
        assert asked < ended[name] <= returned      # it really waited, and for that read
        engine.synchronize()
    finally:
        engine.close()


@pytest.mark.gpu
def test_on_cuda_bf16_within_noise_of_the_reference():
    """On a GPU the order rests on streams: the checkpoint's copy into the buffer after the
    lender's wait, its read back before the layer's recompute, the gradient's copy after that."""
    from test_equivalence_gpu import assert_bf16_within_noise
    torch.backends.cuda.matmul.allow_tf32 = False
    assert_bf16_within_noise(make_loaded("llama", tied=False), "slide", "deferred", 2, CLIP, True,
                             {"gpu_checkpoints": 0, "clip_sweep": "whole", "held_buffers": 1,
                              "checkpoints_in_held": "on"})


def test_plan_suggests_it_where_the_host_binds_a_clipped_run():
    """Qwen3-8B b64 x 1024 clip 1.0, HF's layer, every checkpoint offloaded, a 24 GiB GPU and a
    123 GiB host: the offloaded checkpoints (18 GiB) beside the held gradients (15.3) do not fit;
    borrowing the held buffers does, and `plan` names it as an exact change."""
    from test_fit import assert_options_fit, cuda_rt, split_of
    from slidetune.engine.fit import GiB, InsufficientMemoryError, check_fit, estimate_memory
    split = split_of("qwen3-8b")
    rt = cuda_rt(vocab_update="host", device_layers=0, cache_units=3, offload_activations="on", gpu_checkpoints=0,
                 lean_layer="off", held_buffers=1)
    avail = dict(gpu_free_bytes=24 * GiB, host_available_bytes=123 * GiB)
    with pytest.raises(InsufficientMemoryError) as ei:
        check_fit(split, rt, batch_size=64, seq_len=1024, max_grad_norm=1.0, **avail)
    (line,) = [o for o in ei.value.options if "checkpoints_in_held" in o]
    assert line.startswith("--tuning.clip_sweep whole --tuning.checkpoints_in_held on  ->") and "exact" in line
    assert_options_fit(ei.value, split, rt, 64, 1024, max_grad_norm=1.0, **avail)
    # what it saves: each layer's held buffer (its parameters in BF16) off its checkpoint's slot
    on = dataclasses.replace(rt, clip_sweep="whole", checkpoints_in_held="on")
    before, after = (estimate_memory(split, r, batch_size=64, seq_len=1024, max_grad_norm=1.0).host_parts
                     for r in (rt, on))
    layer = split.layer_units[0].numel
    assert before["offloaded checkpoints"] - after["offloaded checkpoints"] == 36 * 2 * layer


def test_plan_limits_name_it_and_it_moves_the_clipped_limits():
    """`plan`'s limits on a 24 GiB GPU and a 123 GiB host (Llama-3.1-8B): the clipped recipe's
    longest sequence is host-bound, the line under the limits names checkpoints_in_held, and with
    it the clipped limit rises to the unclipped one's neighbourhood (69,632 -> 101,376 tokens on
    2026-11-29's estimate)."""
    import contextlib
    import io
    import re
    from slidetune.cli import main

    def plan(*extra: str) -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            assert main(["plan", "--model", "llama-3.1-8b", "--batch-size", "1", "--seq-len", "4096",
                         "--gpu-free-gib", "24", "--host-gib", "123", *extra]) == 0, out.getvalue()
        return out.getvalue()

    def longest(text: str, recipe: str) -> int:
        """The longest sequence at batch 1 of `recipe` ("clip 1.0" or "no clip"): its line, or the one after."""
        lines = text.splitlines()
        at = next(i for i, ln in enumerate(lines) if "longest sequence at batch 1:" in ln)
        line = next(ln for ln in lines[at:at + 2] if recipe in ln)
        return int(re.search(r"-> ([\d,]+)", line).group(1).replace(",", ""))
    before = plan()
    assert "--tuning.checkpoints_in_held on keeps the offloaded checkpoints" in before
    after = plan("--tuning.clip_sweep", "whole", "--tuning.checkpoints_in_held", "on")
    assert "--tuning.checkpoints_in_held on keeps" not in after
    clip_before, clip_after, plain = longest(before, "clip 1.0"), longest(after, "clip 1.0"), longest(before, "no clip")
    assert clip_before < 0.8 * plain and clip_after >= plain
