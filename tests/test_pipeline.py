"""Scheduling properties of the sliding pipeline (CPU: same code, streams are no-ops)."""
from __future__ import annotations

import inspect

import pytest

from slidetune.device import Device
from slidetune.engine import AdamWConfig, RuntimeConfig, build_engine
from slidetune.engine.slide import activations, engine, transfer
from test_equivalence import make_batches, make_loaded


def _engine(**rt):
    loaded = make_loaded("llama", tied=False, layers=6)
    return build_engine(loaded, RuntimeConfig(mode="slide", dtype="fp32", device="cpu", **rt), AdamWConfig(lr=1e-3))


def test_no_device_synchronize_on_the_hot_path(monkeypatch):
    calls = []
    monkeypatch.setattr(Device, "synchronize", lambda self: calls.append(1))
    eng = _engine()
    try:
        for step in range(2):
            eng.train_step(make_batches(step, 1), 1e-3)
        assert calls == []                 # only engine.synchronize() (save/eval) may call it
    finally:
        eng.close()
    for module in (engine, transfer, activations):
        assert "torch.cuda.synchronize" not in inspect.getsource(module)


@pytest.mark.parametrize("K", [2, 3, 4])
def test_layers_resident_at_the_turn_are_not_uploaded_again(K):
    """Per step: each layer up once for forward and once for backward, except the K
    still resident when the backward starts (all K slots: the planner evicts by next use);
    embedding and head once each."""
    eng = _engine(cache_units=K)
    try:
        L = eng.split.num_layers
        uploads = []
        orig = eng.uploader.upload

        def spy(unit, dst, version, after):
            uploads.append(unit.spec.name)
            return orig(unit, dst, version, after)

        eng.uploader.upload = spy
        eng.train_step(make_batches(0, 1), 1e-3)
        eng.synchronize()
        layer_loads = [u for u in uploads if u.startswith("layer.")]
        assert len(layer_loads) == 2 * L - K
        assert uploads.count("embed") == 1 and uploads.count("head") == 1
        # the backward re-uploads the layers in reverse order, after the forward's
        assert layer_loads[:L] == [f"layer.{i}" for i in range(L)]
        assert layer_loads[L:] == [f"layer.{i}" for i in reversed(range(L - K))]
    finally:
        eng.close()


def test_micro_batches_reuse_resident_vocabulary_units():
    """Within one step (deferred schedule) the weights do not change: embed/head go up once."""
    loaded = make_loaded("qwen3", tied=True, layers=3)
    eng = build_engine(loaded, RuntimeConfig(mode="slide", dtype="fp32", device="cpu"), AdamWConfig(lr=1e-3),
                       grad_accum=3)
    try:
        names = []
        orig = eng.uploader.upload
        eng.uploader.upload = lambda unit, *a: (names.append(unit.spec.name), orig(unit, *a))[1]
        eng.train_step(make_batches(0, 3), 1e-3)
        eng.synchronize()
        assert names.count("embed") == 1 and names.count("head") == 1
    finally:
        eng.close()


def test_worker_failure_surfaces_instead_of_hanging():
    eng = _engine()
    try:
        def boom(*a, **k):
            raise RuntimeError("disk on fire")
        eng.drainer.consume = boom
        with pytest.raises(Exception, match="disk on fire"):
            eng.train_step(make_batches(0, 1), 1e-3)
            eng.train_step(make_batches(1, 1), 1e-3)   # the next step waits on the failed update
            eng.synchronize()
    finally:
        try:
            eng.close()
        except Exception:
            pass
