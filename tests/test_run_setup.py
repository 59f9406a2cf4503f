"""One setup path (run_setup.prepare_run): `slidetune train`, `bench measure` and `bench soak`
build their engine through it, and for one configuration they resolve the same auto settings
into the same placement; describe_autos says what those autos chose."""
from __future__ import annotations

import contextlib
import dataclasses
import io

import pytest

from slidetune import run_setup
from slidetune.bench.measure import MeasureSpec, measure
from slidetune.bench.soak import SoakSpec, soak
from slidetune.bench.workload import BenchWorkload
from slidetune.cli import main
from slidetune.data.corpus import builtin_corpus
from slidetune.device import Device
from slidetune.engine import AdamWConfig, RuntimeConfig
from slidetune.engine.autos import describe_autos
from slidetune.engine.placement import PlacementPlan, unit_shapes

# the settings the auto rules resolve (engine.fit.choose_auto_settings), compared across the three
AUTO_FIELDS = ("cache_units", "resident_layers", "grad_slot_dtype", "lean_layer", "held_buffers",
               "held_second_units", "vocab_update", "device_layers", "offload_activations", "gpu_checkpoints",
               "disk_buffers", "head_impl")
SHAPE = dict(batch_size=2, seq_len=16)


@pytest.fixture
def built(monkeypatch):
    """Every engine run_setup builds, as (runtime, its placement plan): only prepare_run calls
    run_setup.build_engine, so an entry means the caller set up through it."""
    seen: list[tuple[RuntimeConfig, PlacementPlan]] = []
    real = run_setup.build_engine

    def build(loaded, rt, optim, device, grad_accum=1, max_grad_norm=None, **kw):
        seen.append((rt, PlacementPlan.build(unit_shapes(loaded.split), rt,
                                             rt.resolved_schedule(grad_accum, max_grad_norm))))
        return real(loaded, rt, optim, device, grad_accum=grad_accum, max_grad_norm=max_grad_norm, **kw)
    monkeypatch.setattr(run_setup, "build_engine", build)
    return seen


def _autos(rt: RuntimeConfig) -> dict:
    return {name: rt.setting(name) for name in AUTO_FIELDS}


def test_train_measure_and_soak_set_up_through_prepare_run_alike(built, tmp_path):
    data = tmp_path / "small.txt"
    data.write_text("\n\n".join(builtin_corpus()[:40]) + "\n")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = main(["train", "--model", "tiny-llama", "--device", "cpu", "--dtype", "fp32", "--data", str(data),
                     "--batch-size", "2", "--seq-len", "16", "--max-steps", "1", "--eval-batches", "1",
                     "--progress", "false", "--max-grad-norm", "1.0", "--output-dir", str(tmp_path / "run")])
    assert code == 0 and len(built) == 1
    workload = BenchWorkload("tiny-llama", steps=1, warmup=0, **SHAPE)
    runtime = dict(device="cpu", dtype="fp32", mode="slide")
    assert measure(MeasureSpec(workload=workload, runtime=runtime, max_grad_norm=1.0,
                               per_layer=False))["status"] == "ok"
    assert soak(SoakSpec(workload=workload, runtime=runtime, max_grad_norm=1.0, progress_every=0))["status"] == "ok"
    assert len(built) == 3                            # measure and soak built through run_setup too
    (train_rt, train_plan), (measure_rt, measure_plan), (soak_rt, soak_plan) = built
    assert train_rt.placement.cache_units != -1 and train_rt.clip.held_buffers in (1, 2)     # resolved, not auto
    assert _autos(train_rt) == _autos(measure_rt) == _autos(soak_rt)
    assert train_plan.to_dict() == measure_plan.to_dict() == soak_plan.to_dict()


def test_a_refusal_is_a_result_when_asked_and_nothing_is_built(built, monkeypatch):
    from slidetune.engine.fit import ENV_HOST_MEMORY, InsufficientMemoryError
    monkeypatch.setenv(ENV_HOST_MEMORY, str(64 * 2**20))          # a 64 MiB host
    req = run_setup.RunRequest(model="tiny-llama", runtime=RuntimeConfig(device="cpu", mode="slide"),
                               optim=AdamWConfig(lr=1e-3), with_tokenizer=False, refusal_as_result=True, **SHAPE)
    device = Device.resolve("cpu")
    prepared = run_setup.prepare_run(req, device)
    assert prepared.engine is None and "host RAM" in prepared.refusal and not built
    assert prepared.runtime.placement.cache_units != -1 and prepared.plan is not None   # placed before the check
    with pytest.raises(InsufficientMemoryError):
        run_setup.prepare_run(dataclasses.replace(req, refusal_as_result=False), device)
    assert not built


def test_describe_autos_names_each_auto_and_keeps_only_the_disk_tier_off_the_gpu(tmp_path):
    requested = RuntimeConfig(device="cuda", mode="slide", disk_dir=str(tmp_path))
    resolved = dataclasses.replace(requested, cache_units=3, resident_layers=0, grad_slot_dtype="fp32",
                                   lean_layer="off", held_buffers=1, vocab_update="device", device_layers=2,
                                   offload_activations="off", disk_units=2, disk_master="off", disk_buffers=8,
                                   head_impl="fused")
    plan = PlacementPlan.build(unit_shapes_of(6), resolved, "eager")
    lines = describe_autos(requested, resolved, plan)
    assert "cache_units auto -> 3: a 3-slot window" in lines
    assert "device_layers auto -> 2 (decoder layers 0-1 kept and updated on the GPU)" in lines
    assert "vocab_update auto -> device (embedding and head updated on the GPU)" in lines
    disk = [line for line in lines if line.startswith(("disk_units", "disk_buffers", "disk_master"))]
    assert any(line.startswith("disk_units auto -> 2 (") for line in disk)
    assert describe_autos(requested, resolved, plan, gpu_lines=False) == disk
    # nothing on auto: nothing to say
    assert describe_autos(resolved, resolved, plan) == []


def unit_shapes_of(layers: int):
    from slidetune.engine.placement import shapes_from_counts
    return shapes_from_counts(layers, layer_params=1000, embed_params=4000, head_params=4000)
