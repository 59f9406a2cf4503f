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

