"""compile_layers=auto resolves from the planned run: compile where it earns the compile back."""
from __future__ import annotations

import argparse

import pytest

from slidetune.config import add_config_flags, config_from_args
from slidetune.engine.compile_policy import PAYBACK, choose_compile_layers
from slidetune.engine.config import RuntimeConfig
from slidetune.models.load import load_model


@pytest.fixture(scope="module")
def split_8b():
    return load_model("qwen3-8b", with_tokenizer=False).split


def test_long_cuda_runs_compile_short_ones_do_not(split_8b):
    rt = RuntimeConfig(mode="slide")
    long_run = choose_compile_layers(rt, split_8b, is_cuda=True, steps=1000, tokens_per_step=16 * 1024, seq_len=1024)
    assert long_run.compile_layers == "on" and "steps" in long_run.reason
    short = choose_compile_layers(rt, split_8b, is_cuda=True, steps=5, tokens_per_step=16 * 1024, seq_len=1024)
    assert short.compile_layers == "off" and f"< {PAYBACK:g}x" in short.reason
    # the default 8B run: 300 steps of 16 x 1024 tokens
    assert choose_compile_layers(rt, split_8b, is_cuda=True, steps=300, tokens_per_step=16 * 1024,
                                 seq_len=1024).compile_layers == "on"
    # the crossover: twice as many tokens a step halves the steps it takes
    def smallest(tokens):
        return next(s for s in range(1, 100_000) if choose_compile_layers(
            rt, split_8b, is_cuda=True, steps=s, tokens_per_step=tokens, seq_len=1024).compile_layers == "on")
    assert smallest(16 * 1024) == pytest.approx(2 * smallest(32 * 1024), abs=1)


def test_explicit_choices_cpu_and_other_modes(split_8b):
    kw = dict(is_cuda=True, steps=10**6, tokens_per_step=16 * 1024, seq_len=1024)
    assert choose_compile_layers(RuntimeConfig(mode="slide", compile_layers="off"), split_8b, **kw).compile_layers == "off"
    assert choose_compile_layers(RuntimeConfig(mode="slide", compile_layers=True), split_8b,
                                 **{**kw, "steps": 1}).compile_layers == "on"
    assert choose_compile_layers(RuntimeConfig(mode="ckpt"), split_8b, **kw).compile_layers == "off"
    assert choose_compile_layers(RuntimeConfig(mode="slide"), split_8b, **{**kw, "is_cuda": False}).reason == "not on CUDA"


def test_values_and_the_flag():
    assert RuntimeConfig(compile_layers="true").compile_layers == "on"
    assert RuntimeConfig(compile_layers=False).compile_layers == "off"
    assert not RuntimeConfig().compiles_layers()                # auto, unresolved: an engine built directly
    with pytest.raises(ValueError, match="compile_layers must be auto, on or off"):
        RuntimeConfig(compile_layers="sometimes")
    p = argparse.ArgumentParser()
    add_config_flags(p)
    assert config_from_args(p.parse_args(["--compile-layers"])).runtime.compile_layers == "on"
    assert config_from_args(p.parse_args(["--compile-layers", "off"])).runtime.compile_layers == "off"
    assert config_from_args(p.parse_args([])).runtime.compile_layers == "auto"



def test_train_keeps_compile_on_where_only_the_compiled_layer_fits(split_8b, monkeypatch):
    """compile auto on CUDA: the fit counts HF's layer compiled (engine/fit/byte_models.fit_counts_compiled), so
    Qwen3-8B b64 x 1024 unclipped under 24 GiB places HF's layer with offloaded checkpoints, which the
    eager layer's working set would not fit (b16 there fills the room it leaves with resident layers,
    likewise): train's compile choice is then on whatever the payback (a 5-step run would not earn the
    compile back). An explicit --compile-layers is kept, and off places for the eager layer."""
    import dataclasses

    import torch
    from slidetune.device import Device
    from slidetune.engine.fit.byte_models import fit_counts_compiled
    from slidetune.engine.fit import Workload, check_fit, choose_auto_settings
    from slidetune.run_setup import PreparedRun
    from slidetune.train_setup import _placement_needs_compile
    monkeypatch.setenv("SLIDETUNE_HOST_MEMORY_BYTES", str(123 * 2**30))     # the H200 host, not this machine's
    cuda = Device(torch.device("cuda"))
    assert fit_counts_compiled(RuntimeConfig(mode="slide", device="cuda"))
    assert not fit_counts_compiled(RuntimeConfig(mode="slide", device="cpu"))
    assert not fit_counts_compiled(RuntimeConfig(mode="slide", device="cuda", compile_layers="off"))
    loaded = load_model("qwen3-8b", with_tokenizer=False)
    work = Workload(batch_size=64, seq_len=1024, max_grad_norm=0.0, padded=False, gpu_free_bytes=24 * 2**30)
    placed = choose_auto_settings(split_8b, RuntimeConfig(mode="slide", device="cuda"), **work.fit_kwargs())
    assert placed.layer.lean_layer == "off"
    assert _placement_needs_compile(PreparedRun(loaded, placed, None, work), cuda)
    short = choose_compile_layers(placed, split_8b, is_cuda=True, steps=5, tokens_per_step=64 * 1024,
                                  seq_len=1024, placement_needs_it=True)
    assert short.compile_layers == "on" and "compiled layer's working set" in short.reason
    # explicit settings are kept: on needs no check; off places for the eager layer, which fits
    assert not _placement_needs_compile(PreparedRun(loaded, dataclasses.replace(placed, compile_layers="on"),
                                                    None, work), cuda)
    eager = choose_auto_settings(split_8b, RuntimeConfig(mode="slide", device="cuda", compile_layers="off"),
                                 **work.fit_kwargs())
    assert eager.layer.lean_layer == "on" and not _placement_needs_compile(PreparedRun(loaded, eager, None, work), cuda)
    check_fit(split_8b, eager, **work.fit_kwargs())
