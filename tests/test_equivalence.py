"""slide, gpu and ckpt modes follow the plain PyTorch reference (FP32 compute, CPU).

The contract (docs/contract.md): losses and every parameter within relative 1e-5 of
`reference.ReferenceTrainer` after several optimizer steps, per model family, tied and
untied, both update schedules, accumulation 1 and 4, clipping, activation offload.
The learning rate is a realistic 1e-3: at 1e-2 tiny random models diverge and Adam
amplifies rounding noise in near-zero gradients, which tests chaos, not the engine.
"""
from __future__ import annotations

import time

import pytest
import torch

from reference import ReferenceTrainer, build_reference
from slidetune.data import Batch
from slidetune.engine import AdamWConfig, RuntimeConfig, build_engine
from slidetune.engine.slide.disk_tier import StreamedTensor
from slidetune.models.load import LoadedModel, RandomInit, skeleton
from slidetune.models.presets import tiny_config
from slidetune.models.units import SplitModel

VOCAB = 512
FAMILIES = {
    "llama": dict(family="llama", tied=False),
    "llama-tied": dict(family="llama", tied=True),
    "qwen2-bias": dict(family="qwen2", tied=False),
    "qwen3-tied-qknorm": dict(family="qwen3", tied=True),
    "mistral-window": dict(family="mistral", tied=False, sliding_window=8),
}
# The disk tier in a test's tmp_path (disk_dir "TMP"), with small blocks: several per layer.
DISK = {"disk_dir": "TMP", "disk_block_mb": 0.1, "disk_buffers": 3}
# (mode, schedule, grad_accum, max_grad_norm, offload, extra runtime options)
RUNS = {
    "slide-eager": ("slide", "eager", 1, None, False, {}),
    "slide-eager-offload": ("slide", "eager", 1, None, True, {"cache_units": 2}),
    # the last two layers' checkpoints stay on the device, the first two are offloaded
    "slide-eager-offload-2-kept": ("slide", "eager", 1, None, True, {"cache_units": 2, "gpu_checkpoints": 2}),
    "slide-deferred-accum4-clip-offload": ("slide", "deferred", 4, 0.5, True, {}),
    "slide-deferred-clip": ("slide", "deferred", 1, 0.5, False, {"grad_slots": 1}),
    # one GPU slot per layer: next-step weights uploaded as each update lands
    "slide-eager-resident": ("slide", "eager", 1, None, False, {"cache_units": 0}),
    # embedding and head updated on the device (here the CPU device, on the compute thread)
    "slide-eager-vocab-device": ("slide", "eager", 1, None, False, {"vocab_update": "device"}),
    # the lowest layers kept and updated on the device too; with a 2-slot window for the
    # others, and with every layer there (no layer slots at all)
    "slide-eager-device-layers": ("slide", "eager", 1, None, True, {"device_layers": 2, "cache_units": 2}),
    "slide-eager-resident-device-layers-vocab": ("slide", "eager", 1, None, False,
                                                 {"device_layers": 1, "cache_units": 0, "vocab_update": "device"}),
    "slide-eager-all-layers-on-device": ("slide", "eager", 1, None, False, {"device_layers": 4}),
    "slide-deferred-accum2-clip-resident": ("slide", "deferred", 2, 0.5, True, {"cache_units": 0}),
    # layer 0 resident (a slot of its own), layers 1-3 through a 2-slot window
    "slide-eager-partly-resident": ("slide", "eager", 1, None, False, {"cache_units": 2, "resident_layers": 1}),
    "slide-deferred-accum2-clip-partly-resident": ("slide", "deferred", 2, 0.5, True,
                                                   {"cache_units": 2, "resident_layers": 1}),
    # uploads land in FP32 buffers and are cast on the compute stream; FP32 gradient slots
    "slide-deferred-accum2-cast-in-compute": ("slide", "deferred", 2, None, False,
                                              {"upload_cast_stream": "compute", "grad_slot_dtype": "fp32"}),
    # accumulation without clipping: eager (each unit's micro-batches summed on the device first)
    "slide-eager-accum3-device-layers-vocab": ("slide", "eager", 3, None, True,
                                               {"device_layers": 1, "cache_units": 2, "vocab_update": "device"}),
    # the recipe users run: clipping (deferred) with every placement kept: the embedding and head
    # and the lowest layer updated on the device with their gradients held there, one resident
    # layer, a 2-slot window; with and without accumulation, checkpoints offloaded or not
    "slide-deferred-clip-device-layers-vocab-partly-resident": (
        "slide", "deferred", 1, 0.5, False,
        {"device_layers": 1, "vocab_update": "device", "cache_units": 2, "resident_layers": 1}),
    "slide-deferred-accum4-clip-device-layers-vocab-partly-resident-offload": (
        "slide", "deferred", 4, 0.5, True,
        {"device_layers": 1, "vocab_update": "device", "cache_units": 2, "resident_layers": 1,
         "gpu_checkpoints": 1}),
    # two held gradient buffers per host unit, on alternate steps (held_buffers=2: the backward
    # writes one while the last step's moments pass reads the other), with a window, a resident
    # layer, a device layer and the disk tier
    "slide-deferred-accum2-clip-held2": ("slide", "deferred", 2, 0.5, True,
                                         {"held_buffers": 2, "cache_units": 2, "resident_layers": 1,
                                          "device_layers": 1, "disk_units": 1, **DISK}),
    # the second buffer for the lowest host units only (held_second_units: the embedding and
    # layer 0), one for the rest: the two kinds of unit alternate differently in one step
    "slide-deferred-accum2-clip-held2-lowest": ("slide", "deferred", 2, 0.5, False,
                                                {"held_buffers": 2, "held_second_units": 2, "cache_units": 2}),
    # the clipped sweep in one pass (clip_sweep=whole: the host binds)
    "slide-deferred-accum2-clip-whole-sweep": ("slide", "deferred", 2, 0.5, False,
                                               {"clip_sweep": "whole", "device_layers": 1, "cache_units": 2}),
    "slide-deferred-accum2-clip-all-on-device": ("slide", "deferred", 2, 0.5, False,
                                                 {"device_layers": 4, "vocab_update": "device"}),
    # the disk tier: the moments of the head and the top layers in files (three blocks a layer,
    # a 3-buffer ring: reads ahead, AdamW, writes behind), unclipped and on the clipped recipe
    # with every other placement beside it
    "slide-eager-disk": ("slide", "eager", 1, None, False, {"disk_units": 3, **DISK}),
    "slide-deferred-accum2-clip-disk-device-layers-vocab-partly-resident": (
        "slide", "deferred", 2, 0.5, True,
        {"disk_units": 2, "device_layers": 1, "vocab_update": "device", "cache_units": 2, "resident_layers": 1,
         **DISK}),
    # ... and the masters of the disk units there too (--tuning.disk_master): RAM holds their weights
    "slide-eager-disk-master": ("slide", "eager", 1, None, False, {"disk_units": 3, "disk_master": "on", **DISK}),
    "slide-deferred-accum2-clip-disk-master-device-layers": (
        "slide", "deferred", 2, 0.5, False,
        {"disk_units": 2, "disk_master": "on", "device_layers": 1, "cache_units": 2, **DISK}),
    # the lean layer (models/lean_layer.py), its MLP in one tile, and in tiles of 20 tokens (48 a
    # micro-batch: 20, 20 and a ragged 8)
    "slide-eager-lean": ("slide", "eager", 1, None, False, {"lean_layer": "on"}),
    "slide-deferred-accum2-clip-lean-mlp-tiles": ("slide", "deferred", 2, 0.5, True,
                                                  {"lean_layer": "on", "mlp_tile_tokens": 20}),
    # ... and in row tiles of one sequence (2 rows of 24 tokens a micro-batch), MLP tiles inside
    "slide-deferred-accum2-clip-lean-row-tiles": ("slide", "deferred", 2, 0.5, True,
                                                  {"lean_layer": "on", "mlp_tile_tokens": 20,
                                                   "layer_row_tokens": 24}),
    "gpu-accum2-clip": ("gpu", "auto", 2, 0.5, False, {}),
    "ckpt-every2": ("ckpt", "auto", 1, None, False, {"recompute": "every:2"}),
}
LR = 1e-3
STEPS = 3


def make_loaded(family: str, tied: bool, sliding_window: int | None = None, layers: int = 4) -> LoadedModel:
    cfg = tiny_config(family, tied=tied, vocab_size=VOCAB, layers=layers, sliding_window=sliding_window)
    return LoadedModel("tiny", SplitModel(skeleton(cfg)), RandomInit(1, std=0.1, bias_std=0.1), None)


def make_batches(step: int, accum: int, batch: int = 2, seq: int = 24) -> list[Batch]:
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(accum):
        ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
        labels = torch.roll(ids, -1, 1)
        labels[:, -1] = -100
        labels[0, :5] = -100          # a masked prompt
        out.append(Batch(ids, labels, None))
    return out


def max_param_rel_diff(engine, reference_model) -> tuple[float, str]:
    ref = dict(reference_model.named_parameters())
    worst, where = 0.0, ""
    for name, t in engine.named_master_params():
        if isinstance(t, StreamedTensor):       # a master on disk (--tuning.disk_master)
            t = t.materialize()
        r = ref[name].detach()
        rel = float((t.float() - r).norm() / r.norm())
        if rel > worst:
            worst, where = rel, name
    return worst, where


@pytest.mark.parametrize("run", list(RUNS))
@pytest.mark.parametrize("fam", list(FAMILIES))
def test_matches_reference(fam, run, tmp_path):
    mode, schedule, accum, clip, offload, extra = RUNS[run]
    if extra.get("disk_dir") == "TMP":
        extra = dict(extra, disk_dir=str(tmp_path))
    loaded = make_loaded(**FAMILIES[fam])
    ref = ReferenceTrainer(build_reference(loaded), lr=LR, weight_decay=0.1, eps=1e-6, max_grad_norm=clip)
    rt = RuntimeConfig(mode=mode, dtype="fp32", device="cpu", schedule=schedule, offload_activations=offload,
                       head_chunk_tokens=16, chunk_mb=1, **extra)
    engine = build_engine(loaded, rt, AdamWConfig(lr=LR, weight_decay=0.1, eps=1e-6),
                          grad_accum=accum, max_grad_norm=clip)
    try:
        for step in range(STEPS):
            mbs = make_batches(step, accum)
            lr = LR * (0.5 + step)                       # a changing LR, as a schedule gives
            ref_loss, ref_norm = ref.step(mbs, lr)
            res = engine.train_step(mbs, lr)
            assert res.loss == pytest.approx(ref_loss, rel=1e-5), f"step {step}"
            assert res.grad_norm() == pytest.approx(ref_norm, rel=1e-5), f"step {step}"
        engine.synchronize()
        worst, where = max_param_rel_diff(engine, ref.model)
        assert worst < 1e-5, f"{where}: relative difference {worst:.2e}"
        # The weights really moved (a no-op engine would fail here too, but loudly).
        assert engine.step_index == STEPS
    finally:
        engine.close()


def test_eval_loss_matches_training_forward():
    loaded = make_loaded("llama", tied=True)
    rt = RuntimeConfig(mode="slide", dtype="fp32", device="cpu")
    engine = build_engine(loaded, rt, AdamWConfig(lr=LR))
    ref = build_reference(loaded)
    try:
        (mb,) = make_batches(0, 1)
        loss_sum, n = engine.eval_loss(mb)
        logits = ref(input_ids=mb.input_ids).logits
        want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), mb.labels.flatten(), reduction="sum")
        assert n == mb.num_target_tokens()
        assert loss_sum == pytest.approx(float(want), rel=1e-5)
    finally:
        engine.close()


def test_padding_mask_is_honoured():
    """Right-padded rows: the engine passes the attention mask to HF's mask builder."""
    loaded = make_loaded("qwen2", tied=False)
    ref = ReferenceTrainer(build_reference(loaded), lr=LR, eps=1e-6)
    engine = build_engine(loaded, RuntimeConfig(mode="slide", dtype="fp32", device="cpu"),
                          AdamWConfig(lr=LR, eps=1e-6))
    try:
        (mb,) = make_batches(0, 1)
        mask = torch.ones_like(mb.input_ids)
        mask[1, 16:] = 0
        labels = mb.labels.clone()
        labels[1, 15:] = -100
        mb = Batch(mb.input_ids, labels, mask)
        for step in range(2):
            ref_loss, _ = ref.step([mb], LR)
            assert engine.train_step([mb], LR).loss == pytest.approx(ref_loss, rel=1e-5)
        engine.synchronize()
        worst, where = max_param_rel_diff(engine, ref.model)
        assert worst < 1e-5, where
    finally:
        engine.close()


def test_partly_resident_layers_are_uploaded_once_a_step_and_the_window_twice(monkeypatch):
    """device_layers=1, resident_layers=2, a 2-slot window, 6 layers: layer 0 on the device, layers
    1-2 in slots of their own (uploaded once a step, as each update lands: the first step's and
    then one per step), layers 3-5 through the window (forward and backward, except the two still
    in their slots at the turn). Training matches the reference."""
    loaded = make_loaded("llama", tied=False, layers=6)
    ref = ReferenceTrainer(build_reference(loaded), lr=LR, weight_decay=0.1, eps=1e-6, max_grad_norm=None)
    rt = RuntimeConfig(mode="slide", dtype="fp32", device="cpu", schedule="eager", device_layers=1,
                       resident_layers=2, cache_units=2, head_chunk_tokens=16, chunk_mb=1)
    engine = build_engine(loaded, rt, AdamWConfig(lr=LR, weight_decay=0.1, eps=1e-6))
    uploads: list[tuple[str, int]] = []
    upload = engine.uploader.upload
    monkeypatch.setattr(engine.uploader, "upload",
                        lambda unit, dst, version, after: (uploads.append((unit.spec.name, version)),
                                                           upload(unit, dst, version, after))[1])
    try:
        assert len(engine.layer_slots) == 2 and set(engine.own_slots) == {0, 1, 2, 3, 7}
        for step in range(STEPS):
            mbs = make_batches(step, 1)
            ref_loss, _ = ref.step(mbs, LR)
            assert engine.train_step(mbs, LR).loss == pytest.approx(ref_loss, rel=1e-5)
        engine.synchronize()
        worst, where = max_param_rel_diff(engine, ref.model)
        assert worst < 1e-5, f"{where}: relative difference {worst:.2e}"
    finally:
        engine.close()
    names = [u.name for u in loaded.split.layer_units]
    for i in (1, 2):     # resident: version 0 before the first forward, then each step's as it lands
        assert sorted(v for n, v in uploads if n == names[i]) == list(range(STEPS + 1))
    assert not any(n == names[0] for n, _ in uploads)            # on the device: never uploaded
    per_step = {names[3]: 2, names[4]: 1, names[5]: 1}           # layers 4 and 5 are in the window at the turn
    for name, k in per_step.items():
        assert sorted(v for n, v in uploads if n == name) == sorted(list(range(STEPS)) * k)


def test_eager_refuses_clipping_and_auto_defers_only_for_it():
    loaded = make_loaded("llama", tied=False, layers=2)
    with pytest.raises(ValueError, match="eager schedule"):
        build_engine(loaded, RuntimeConfig(mode="slide", dtype="fp32", device="cpu", schedule="eager"),
                     AdamWConfig(), max_grad_norm=1.0)
    rt = RuntimeConfig(mode="slide")
    assert rt.resolved_schedule(4, None) == "eager" and rt.resolved_schedule(4, 0.0) == "eager"
    assert rt.resolved_schedule(1, 1.0) == "deferred"


@pytest.mark.parametrize("buffers", [1, 2, "lowest"])
def test_two_held_buffers_let_the_backward_go_down_while_the_moments_pass_runs(monkeypatch, buffers):
    """held_buffers=2: a step's gradients go down into the buffers the last step's moments pass is
    not reading, so no hold waits for it; with one buffer each hold waits for that unit's moments
    (the wait the H100's clipped step spent 0.43 s in, NOTES.md "Clipping schedule"); with the second buffer for the
    lowest two units only (held_second_units=2), only those go down early. The moments pass is
    slowed here (0.4 s a unit) so the order shows; which order, not how long, is what is checked."""
    from slidetune.engine.slide import transfer
    loaded = make_loaded("llama", tied=False, layers=3)
    rt = RuntimeConfig(mode="slide", dtype="fp32", device="cpu", head_chunk_tokens=16, chunk_mb=1,
                       offload_activations=False, held_buffers=1 if buffers == 1 else 2,
                       held_second_units=2 if buffers == "lowest" else -1)
    engine = build_engine(loaded, rt, AdamWConfig(lr=LR, eps=1e-6), max_grad_norm=1.0)
    moments_end: dict[str, list[float]] = {}       # unit -> when each of its moments passes ended
    hold_start: dict[str, list[float]] = {}        # unit -> when each of its holds started
    slow_moments = transfer.GradDrain.deferred_moments

    def moments(unit, held, coef, chunk, **kw):
        time.sleep(0.4)
        slow_moments(unit, held, coef, chunk, **kw)
        moments_end.setdefault(unit.spec.name, []).append(time.monotonic())

    copy = engine.drainer.hold              # the copy itself, once whatever it waits for is done
    owner = {h.data_ptr(): u.spec.name for u in engine.units for h in u.held}

    def hold(held, *a):
        hold_start.setdefault(owner[held.data_ptr()], []).append(time.monotonic())
        return copy(held, *a)
    monkeypatch.setattr(transfer.GradDrain, "deferred_moments", staticmethod(moments))
    monkeypatch.setattr(engine.drainer, "hold", hold)
    try:
        for step in range(2):
            engine.train_step(make_batches(step, 1), LR)
        engine.synchronize()
    finally:
        engine.close()
    names = [u.spec.name for u in engine.units if u.on_host]
    # step 2's hold of a unit against the end of step 1's moments pass of that unit
    early = [n for n in names if hold_start[n][1] < moments_end[n][0]]
    if buffers == 1:
        assert early == []
    elif buffers == "lowest":
        assert [len(u.held) for u in engine.units if u.on_host] == [2, 2, 1, 1, 1]
        assert early and set(early) <= set(names[:2]), (early, hold_start, moments_end)
    else:
        assert early, (hold_start, moments_end)


def test_deferred_holds_gradients_in_the_compute_dtype_and_updates_after_the_norm(monkeypatch):
    """The deferred schedule: no unit is updated before the backward has ended (the global norm
    is known); host units hold their gradient in the compute dtype (no FP32 copy: 12 + 2 B/param
    of host RAM in BF16), the device units in a device slot of their own; nothing is drained
    chunk-wise to the host's AdamW."""
    loaded = make_loaded("llama", tied=False, layers=4)
    rt = RuntimeConfig(mode="slide", dtype="bf16", device="cpu", device_layers=1, vocab_update="device",
                       cache_units=2, resident_layers=1)
    engine = build_engine(loaded, rt, AdamWConfig(lr=LR, eps=1e-6), grad_accum=2, max_grad_norm=1.0)
    versions_when_complete: list[list[int]] = []
    complete = engine._gradient_complete

    def record(i, *a, **k):
        versions_when_complete.append([u.version for u in engine.units])
        return complete(i, *a, **k)

    monkeypatch.setattr(engine, "_gradient_complete", record)
    monkeypatch.setattr(engine, "_submit_drain", lambda *a, **k: pytest.fail("deferred drained to AdamW"))
    try:
        assert engine.schedule == "deferred"
        held = [u.held for u in engine.units]
        assert [len(h) for h in held] == [0, 0, 1, 1, 1, 0]   # device: embed, layer 0, head; one buffer each
        assert all(h[0].dtype == torch.bfloat16 and h[0].numel() == u.spec.numel
                   for h, u in zip(held, engine.units) if h)
        assert set(engine.device_grad_slots) == {1}
        host_params = sum(u.spec.numel for u in engine.units if u.on_host)
        assert engine.store.state_bytes() == 14 * host_params
        for step in range(2):
            res = engine.train_step(make_batches(step, 2), LR)
            assert res.grad_norm() > 0
        engine.synchronize()
        # every gradient of a step was complete before any unit of that step was updated
        assert len(versions_when_complete) == 2 * 6
        for step in range(2):
            assert all(v == [step] * 6 for v in versions_when_complete[6 * step: 6 * step + 6])
        assert [u.version for u in engine.units] == [2] * 6
    finally:
        engine.close()


def test_device_layers_stay_on_the_device_and_never_reach_the_host(monkeypatch):
    """device_layers=2: layers 0 and 1 keep master and moments on the device, get slots of their
    own and no layer slot, and no gradient of theirs is drained to the host. (The two host
    layers, resident, have slots of their own too: no window.)"""
    loaded = make_loaded("llama", tied=False, layers=4)
    rt = RuntimeConfig(mode="slide", dtype="fp32", device="cpu", schedule="eager", device_layers=2, cache_units=0)
    engine = build_engine(loaded, rt, AdamWConfig(lr=LR, eps=1e-6))
    drained: list[int] = []
    submit = engine._submit_drain
    monkeypatch.setattr(engine, "_submit_drain", lambda i, *a, **k: (drained.append(i), submit(i, *a, **k)))
    try:
        for step in range(2):
            engine.train_step(make_batches(step, 1), LR)
        engine.synchronize()
        assert [u.on_device for u in engine.units] == [False, True, True, False, False, False]
        assert len(engine.layer_slots) == 0 and set(engine.own_slots) == {0, 1, 2, 3, 4, 5}
        assert sorted(set(drained)) == [0, 3, 4, 5]                  # embedding, layers 2-3, head
        assert all(engine.units[i].version == 2 for i in (1, 2))      # updated on the device, twice
        layers = loaded.split.layer_units
        assert engine.memory_report()["device_state"] == 12 * (layers[0].numel + layers[1].numel)
    finally:
        engine.close()
    with pytest.raises(ValueError, match="4 decoder layers"):
        build_engine(loaded, RuntimeConfig(mode="slide", dtype="fp32", device="cpu", device_layers=5), AdamWConfig())


def test_device_updates_widen_compute_dtype_gradients_chunk_by_chunk():
    """Units updated on the device with BF16 gradient slots: the gradient is widened a chunk at a
    time into one preallocated FP32 buffer, and the trajectory matches FP32 gradient slots (where
    the slot copy itself widens, exactly, and the update takes the whole unit) to FP32 rounding
    (torch's vectorized CPU loop may round a range's unaligned tail its own way)."""
    cfg = tiny_config("llama", tied=False, vocab_size=4 * VOCAB, layers=2)     # a vocabulary of several chunks
    loaded = LoadedModel("tiny", SplitModel(skeleton(cfg)), RandomInit(1, std=0.1, bias_std=0.1), None)
    finals = {}
    for slots in ("compute", "fp32"):
        rt = RuntimeConfig(mode="slide", dtype="bf16", device="cpu", schedule="eager", device_layers=1,
                           vocab_update="device", cache_units=0, grad_slot_dtype=slots)
        engine = build_engine(loaded, rt, AdamWConfig(lr=LR, eps=1e-6))
        try:
            embed = engine.units[0].spec.numel
            if slots == "compute":
                assert engine.device_grad32.numel() == engine.chunk < embed     # the vocabulary spans chunks
            else:
                assert engine.device_grad32 is None
            for step in range(3):
                engine.train_step(make_batches(step, 1), LR)
            engine.synchronize()
            finals[slots] = {k: v.clone() for k, v in engine.named_master_params()}
        finally:
            engine.close()
    for name, t in finals["compute"].items():
        torch.testing.assert_close(t, finals["fp32"][name], rtol=1e-6, atol=1e-9, msg=name)


def test_units_kept_on_the_device_are_built_there_without_host_state():
    """HostStore's device units: master and moments are allocated on the device from the start
    (the host holds neither, only a transient buffer while loading), with the same weights a host
    unit gets; the other units stay on the host. "meta" stands in for a device that is not the host."""
    from slidetune.engine.slide.host_store import HostStore
    loaded = make_loaded("llama", tied=False, layers=3)
    split, meta = loaded.split, torch.device("meta")
    store = HostStore(split, loaded.source, AdamWConfig(), device_units=frozenset({0, 2}), device=meta)
    host = HostStore(split, loaded.source, AdamWConfig())
    for i, unit in enumerate(store.units):
        on_device = i in (0, 2)
        assert unit.on_device is on_device and unit.on_host is not on_device
        for t in (unit.master, unit.opt.exp_avg, unit.opt.exp_avg_sq):
            assert t.device.type == ("meta" if on_device else "cpu")
        if not on_device:
            torch.testing.assert_close(unit.master, host.units[i].master, rtol=0, atol=0)
    with pytest.raises(ValueError, match="device_units needs the device"):
        HostStore(split, loaded.source, AdamWConfig(), device_units=frozenset({0}))


def test_units_larger_than_the_staging_ring_stream_through_it():
    """A 3.1M-parameter embedding through a one-chunk (1 MiB) ring: chunks pipeline, no deadlock."""
    cfg = tiny_config("llama", tied=False, vocab_size=49152, layers=2)
    loaded = LoadedModel("tiny", SplitModel(skeleton(cfg)), RandomInit(1, std=0.1), None)
    ref = ReferenceTrainer(build_reference(loaded), lr=LR, eps=1e-6)
    rt = RuntimeConfig(mode="slide", dtype="fp32", device="cpu", chunk_mb=1, download_ring=1, upload_ring=1)
    engine = build_engine(loaded, rt, AdamWConfig(lr=LR, eps=1e-6))
    try:
        g = torch.Generator().manual_seed(0)
        for step in range(2):
            ids = torch.randint(0, 49152, (2, 16), generator=g)
            labels = torch.roll(ids, -1, 1)
            labels[:, -1] = -100
            mb = Batch(ids, labels, None)
            assert engine.train_step([mb], LR).loss == pytest.approx(ref.step([mb], LR)[0], rel=1e-5)
        engine.synchronize()
        worst, where = max_param_rel_diff(engine, ref.model)
        assert worst < 1e-5, where
    finally:
        engine.close()
        engine.close()      # closing twice is harmless


@pytest.mark.parametrize("schedule", ["eager", "deferred"])
@pytest.mark.parametrize("cache_units", [0, 3])
def test_eval_between_steps_sees_the_updated_weights(cache_units, schedule):
    """Evaluation between training steps uses the weights after the last update, also when the
    next step's weights were already prefetched into resident slots (cache_units=0)."""
    loaded = make_loaded("qwen3", tied=False)
    rt = RuntimeConfig(mode="slide", dtype="fp32", device="cpu", cache_units=cache_units, chunk_mb=1,
                       schedule=schedule)
    engine = build_engine(loaded, rt, AdamWConfig(lr=LR, eps=1e-6))
    ref = ReferenceTrainer(build_reference(loaded), lr=LR, eps=1e-6)
    (held,) = make_batches(99, 1)
    try:
        for step in range(2):
            mbs = make_batches(step, 1)
            assert engine.train_step(mbs, LR).loss == pytest.approx(ref.step(mbs, LR)[0], rel=1e-5)
            loss_sum, n = engine.eval_loss(held)
            with torch.no_grad():
                logits = ref.model(input_ids=held.input_ids).logits
            want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), held.labels.flatten(), reduction="sum")
            assert loss_sum == pytest.approx(float(want), rel=1e-5), f"after step {step}"
    finally:
        engine.close()


@pytest.mark.parametrize("lean", ["off", "on"])
def test_compiled_layers_match_the_reference(monkeypatch, lean):
    """compile_layers: torch.compile'd decoder layers (one graph per kind of layer, here one
    for all four; the lean layer's attention half and MLP tiles, a full and a ragged tile) follow
    the reference like the eager ones; inductor may reorder sums. Each step ends by releasing
    inductor's compile workers (compile_workers.py)."""
    import slidetune.engine.slide.engine as slide_engine
    released = []
    monkeypatch.setattr(slide_engine, "release_compile_workers", lambda: released.append(True) or False)
    loaded = make_loaded("qwen3", tied=True)
    ref = ReferenceTrainer(build_reference(loaded), lr=LR, eps=1e-6)
    rt = RuntimeConfig(mode="slide", dtype="fp32", device="cpu", compile_layers=True, chunk_mb=1, lean_layer=lean,
                       mlp_tile_tokens=20)
    engine = build_engine(loaded, rt, AdamWConfig(lr=LR, eps=1e-6))
    try:
        assert len({id(m) for m in engine.layers._templates}) == 1
        assert (engine.layers.lean is not None) == (lean == "on")
        for step in range(2):
            mbs = make_batches(step, 1)
            assert engine.train_step(mbs, LR).loss == pytest.approx(ref.step(mbs, LR)[0], rel=1e-5)
            assert len(released) == step + 1
        engine.synchronize()
        worst, where = max_param_rel_diff(engine, ref.model)
        assert worst < 1e-4, f"{where}: relative difference {worst:.2e}"
    finally:
        engine.close()


@pytest.mark.parametrize("family", ["llama", "qwen3-tied-qknorm"])
def test_clip_sweep_weights_trains_exactly_as_split(family, tmp_path):
    """clip_sweep=weights (the weights pass writes BF16 upload copies; master and moments in the
    second pass) against split, both BF16 on the CPU, clipped with accumulation, a 2-slot window,
    a resident layer, the vocabulary and a layer on the host and one decoder layer's moments on
    disk (a disk unit keeps its one-pass update and no copy): the same losses and norms, masters
    and moments bit for bit, the uploads' copies equal to the masters' BF16 casts; then a state
    loaded into a fresh engine refreshes the copies, and a step after it is still the same."""
    loaded = make_loaded(**FAMILIES[family], layers=4)
    base = dict(mode="slide", dtype="bf16", device="cpu", cache_units=2, resident_layers=1, held_buffers=2,
                disk_units=1, **DISK)
    opt = AdamWConfig(lr=LR, eps=1e-6)
    for d in ("split", "weights", "fresh"):
        (tmp_path / d).mkdir()
    engines = {sweep: build_engine(loaded, RuntimeConfig(**{**base, "disk_dir": str(tmp_path / sweep)}, clip_sweep=sweep),
                                   opt, grad_accum=2, max_grad_norm=0.05) for sweep in ("split", "weights")}
    try:
        weights = engines["weights"]
        copies = [u for u in weights.units if u.weights is not None]
        assert copies and all(u.tier.name == "ram" and u.on_host for u in copies)
        assert engines["split"].store.state_bytes() + 2 * sum(u.spec.numel for u in copies) \
            == weights.store.state_bytes()
        out = {}
        for sweep, engine in engines.items():
            results = [engine.train_step(make_batches(step, 2), LR) for step in range(3)]
            out[sweep] = [(r.loss, r.grad_norm()) for r in results]
            engine.synchronize()
        assert out["weights"] == out["split"] and all(n > 0.05 for _, n in out["split"])   # clipped
        masters = {sweep: dict(e.named_master_params()) for sweep, e in engines.items()}
        for name, t in masters["split"].items():
            assert torch.equal(t, masters["weights"][name]), name
        state = {sweep: e.optimizer_tensors() for sweep, e in engines.items()}
        for name, t in state["split"].items():
            got = state["weights"][name]
            assert torch.equal(t.materialize() if isinstance(t, StreamedTensor) else t,
                               got.materialize() if isinstance(got, StreamedTensor) else got), name
        for u in copies:
            assert torch.equal(u.weights, u.master.to(torch.bfloat16)), u.spec.name
        # resume: the split run's state into a fresh weights engine
        fresh = build_engine(loaded, RuntimeConfig(**{**base, "disk_dir": str(tmp_path / "fresh")}, clip_sweep="weights"),
                             opt, grad_accum=2, max_grad_norm=0.05)
        try:
            fresh.load_state({k: v.clone() for k, v in masters["split"].items()},
                             {k: (v.materialize() if isinstance(v, StreamedTensor) else v).clone()
                              for k, v in state["split"].items()}, 3)
            for u in fresh.units:
                if u.weights is not None:
                    assert torch.equal(u.weights, u.master.to(torch.bfloat16)), u.spec.name
            after = [e.train_step(make_batches(3, 2), LR) for e in (engines["split"], fresh)]
            assert (after[0].loss, after[0].grad_norm()) == (after[1].loss, after[1].grad_norm())
        finally:
            fresh.close()
    finally:
        for engine in engines.values():
            engine.close()


def test_clip_sweep_weights_refuses_a_compute_dtype_other_than_bf16():
    """The upload copies are BF16 (the kernel's store): an FP32 run with clip_sweep=weights is
    refused when the engine is built, naming the setting to use instead."""
    rt = RuntimeConfig(mode="slide", dtype="fp32", device="cpu", clip_sweep="weights")
    with pytest.raises(ValueError, match="clip_sweep weights writes BF16 upload copies.*use split"):
        build_engine(make_loaded("llama", tied=False, layers=2), rt, AdamWConfig(lr=LR), max_grad_norm=1.0)
