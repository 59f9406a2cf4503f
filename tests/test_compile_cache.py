"""The compile cache (engine/compile_cache.py): a second process compiling the same layers into the
same directory reads them from it (dynamo's counters say so), with the same losses, and `slidetune
train` says so and records it in summary.json; a new shape misses; "off" and a user's TORCHINDUCTOR_CACHE_DIR leave torch's choice alone; compile_layers auto
counts a cached compile at its warm cost."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from slidetune.engine import compile_cache
from slidetune.engine.compile_cache import (INDUCTOR_ENV, CompileCache, CompileCounters, cache_holds,
                                            default_compile_cache_dir, describe_cache, describe_compile, layer_compile_key,
                                            remember_compile, use_compile_cache)
from slidetune.engine.compile_policy import COMPILE_S, WARM_COMPILE_FRACTION, choose_compile_layers
from slidetune.engine.config import RuntimeConfig
from slidetune.models.load import load_model

SRC = str(Path(__file__).resolve().parents[1] / "src")

# One run in a fresh interpreter: the setup every run shares (run_setup.prepare_run, which points the
# cache), a 2-layer tiny Llama with compiled layers, two steps at [2, SEQ]; then, with `--new-shape`,
# an evaluation at [2, SEQ + 8] (a shape compiled for the first time). Prints its losses and counters.
CHILD = """
import json, sys, torch
from slidetune.data.batch import Batch
from slidetune.device import Device
from slidetune.engine import AdamWConfig, RuntimeConfig
from slidetune.engine.compile_cache import CompileCounters
from slidetune.run_setup import RunRequest, prepare_run

cache_dir, seq, new_shape = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "--new-shape"
rt = RuntimeConfig(mode="slide", device="cpu", dtype="fp32", compile_layers="on", compile_cache_dir=cache_dir)
req = RunRequest(model="tiny-llama", runtime=rt, optim=AdamWConfig(lr=1e-3), batch_size=2, seq_len=seq,
                 num_layers=2, with_tokenizer=False)
prepared = prepare_run(req, Device.resolve("cpu"))
engine, vocab = prepared.engine, prepared.loaded.split.config.vocab_size
def batch(step, s):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, vocab, (2, s), generator=g)       # [2, s]
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    return Batch(ids, labels, None)
before = CompileCounters.now()
losses = [engine.train_step([batch(step, seq)], 1e-3).loss for step in range(2)]
engine.synchronize()
trained = CompileCounters.now().since(before)
new = None
if new_shape:
    engine.eval_loss(batch(9, seq + 8))
    new = CompileCounters.now().since(before).since(trained).summary()
engine.close()
print(json.dumps({"losses": losses, "trained": trained.summary(), "from_cache": trained.from_cache,
                  "new_shape": new, "env": __import__("os").environ.get("TORCHINDUCTOR_CACHE_DIR")}))
"""


def run_child(cache_dir: Path, seq: int, new_shape: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (INDUCTOR_ENV, "TRITON_CACHE_DIR")}
    env["PYTHONPATH"] = SRC
    out = subprocess.run([sys.executable, "-c", CHILD, str(cache_dir), str(seq),
                          "--new-shape" if new_shape else "-"], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_train(argv: list[str]) -> str:
    env = {k: v for k, v in os.environ.items() if k not in (INDUCTOR_ENV, "TRITON_CACHE_DIR")}
    env["PYTHONPATH"] = SRC
    code = "import sys; from slidetune.cli import main; sys.exit(main(sys.argv[1:]))"
    out = subprocess.run([sys.executable, "-c", code, "train", *argv], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    return out.stdout


def test_a_second_process_reads_the_compiled_layers_from_the_cache(tmp_path):
    cache = tmp_path / "compile"
    cold = run_child(cache, 16)
    assert cold["env"] == str(cache.resolve())
    assert cold["trained"]["compile_fx_cache_misses"] > 0 and cold["trained"]["compile_fx_cache_hits"] == 0
    assert cold["trained"]["compile_autograd_cache_misses"] > 0 and not cold["from_cache"]
    assert (cache / "fxgraph").is_dir() and (cache / "aotautograd").is_dir()
    warm = run_child(cache, 16, new_shape=True)
    trained = warm["trained"]
    assert warm["from_cache"] and trained["compile_fx_cache_misses"] == trained["compile_fx_cache_bypasses"] == 0
    assert trained["compile_fx_cache_hits"] == cold["trained"]["compile_fx_cache_misses"]
    assert trained["compile_autograd_cache_hits"] == cold["trained"]["compile_autograd_cache_misses"]
    assert warm["losses"] == cold["losses"]          # the same compiled code: bit for bit
    # a shape the cache has not seen compiles anew
    assert warm["new_shape"]["compile_fx_cache_misses"] > 0 and warm["new_shape"]["compile_fx_cache_hits"] == 0
    # `slidetune train` of the same layers and shape (a pre-tokenized corpus: full rows, no padding
    # mask, as above) says so at its first step, records it in summary.json and leaves the marker
    # compile_layers auto reads (compile_cache.cache_holds). Packing causal: SDPA's causal attention as in the
    # child (masked packing's layers take a document mask for every batch: ops/packed_attention.packed_mask)
    np.save(tmp_path / "ids.npy", (np.arange(4000) * 7 % 250).astype(np.uint16))
    out = run_train(["--model", "tiny-llama", "--num-layers", "2", "--data", str(tmp_path / "ids.npy"),
                     "--seq-len", "16", "--batch-size", "2", "--heldout-fraction", "0", "--packing", "causal", "--progress", "false",
                     "--device", "cpu", "--dtype", "fp32", "--compile-layers", "true", "--compile-cache-dir", str(cache),
                     "--max-steps", "2", "--output-dir", str(tmp_path / "run")])
    assert "compiled layers: from the cache in" in out and f"compile cache: {cache} (--compile-cache-dir" in out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["compile_fx_cache_hits"] == cold["trained"]["compile_fx_cache_misses"]
    assert summary["compile_fx_cache_misses"] == summary["compile_autograd_cache_misses"] == 0
    assert summary["compile_s"] > 0 and len(list((cache / "slidetune-layers").glob("*.json"))) == 1


@pytest.fixture
def clean_env(monkeypatch):
    """No TORCHINDUCTOR_CACHE_DIR of the user's; what this module set before is forgotten after."""
    monkeypatch.delenv(INDUCTOR_ENV, raising=False)
    monkeypatch.setattr(compile_cache, "_set_here", set())
    return monkeypatch


def test_off_leaves_torch_defaults_alone(clean_env):
    cache = use_compile_cache("off")
    assert cache.directory is None and not cache.persistent and INDUCTOR_ENV not in os.environ
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir
    assert cache_dir() == os.path.abspath(default_cache_dir())
    assert use_compile_cache("OFF").directory is None


def test_default_and_given_directories(clean_env, tmp_path):
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_compile_cache_dir() == tmp_path / "xdg" / "slidetune" / "compile"
    cache = use_compile_cache(None)
    assert cache.directory == tmp_path / "xdg" / "slidetune" / "compile" and cache.directory.is_dir()
    assert os.environ[INDUCTOR_ENV] == str(cache.directory.resolve())
    # a later run in the same process may point it elsewhere: the value was this module's, not the user's
    assert use_compile_cache(str(tmp_path / "given")).directory == tmp_path / "given"
    assert os.environ[INDUCTOR_ENV] == str((tmp_path / "given").resolve())
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    assert inductor_config.fx_graph_cache and functorch_config.enable_autograd_cache
    # a cache the user turned off through torch's own variable stays off
    clean_env.setattr(inductor_config, "fx_graph_cache", False)
    clean_env.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
    use_compile_cache(None)
    assert not inductor_config.fx_graph_cache


def test_a_users_inductor_directory_is_kept(clean_env, tmp_path):
    clean_env.setenv(INDUCTOR_ENV, str(tmp_path / "theirs"))
    cache = use_compile_cache(str(tmp_path / "ours"))
    assert cache.directory == tmp_path / "theirs" and "set by the user" in cache.source
    assert os.environ[INDUCTOR_ENV] == str(tmp_path / "theirs") and not (tmp_path / "ours").exists()
    assert describe_cache(cache).startswith(f"compile cache: {tmp_path / 'theirs'} ({INDUCTOR_ENV} set by the user")
    # torch's own default, which importing torch._dynamo writes into the variable, is not the user's
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    clean_env.setenv(INDUCTOR_ENV, default_cache_dir())
    assert use_compile_cache(str(tmp_path / "ours")).directory == tmp_path / "ours"


def test_an_unwritable_directory_is_refused_naming_the_field(clean_env, tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="compile_cache_dir"):
        use_compile_cache(str(tmp_path / "file" / "compile"))


def test_the_marker_makes_auto_count_the_warm_compile(tmp_path):
    split = load_model("qwen3-8b", with_tokenizer=False).split
    rt = RuntimeConfig(mode="slide")
    cache = CompileCache(tmp_path, "the default")
    key = layer_compile_key(split.config, rt, 16, 1024, "NVIDIA H200")
    assert key != layer_compile_key(split.config, rt, 16, 2048, "NVIDIA H200")
    rt_fp32 = RuntimeConfig(mode="slide", dtype="fp32")
    assert layer_compile_key(split.config, rt_fp32, 16, 1024, "cpu") != layer_compile_key(
        split.config, RuntimeConfig(mode="slide", dtype="bf16"), 16, 1024, "cpu")
    assert not cache_holds(cache, key)
    cold = CompileCounters(fx_misses=6, autograd_misses=4, compile_s=35.0)
    remember_compile(cache, key, cold)
    assert cache_holds(cache, key) and not cache_holds(CompileCache(None, "off"), key)
    assert "compiled in 35.0 s; cached in" in describe_compile(cold, cache)
    assert "from the cache in 3.0 s" in describe_compile(CompileCounters(fx_hits=6, autograd_hits=4, compile_s=3.0), cache)
    bypassed = CompileCounters(fx_hits=5, fx_bypasses=1, autograd_hits=4, compile_s=9.0)
    assert not bypassed.from_cache and "5 of 6 graphs from inductor's cache, 1 not cacheable" in describe_compile(
        bypassed, cache)
    # a run too short to earn a cold compile back earns the cached one
    kw = dict(is_cuda=True, tokens_per_step=16 * 1024, seq_len=1024)
    steps = next(s for s in range(1, 10_000) if choose_compile_layers(rt, split, steps=s, cached=True,
                                                                        **kw).compile_layers == "on")
    assert choose_compile_layers(rt, split, steps=steps, **kw).compile_layers == "off"
    warm = choose_compile_layers(rt, split, steps=steps, cached=True, **kw)
    assert f"~{COMPILE_S * WARM_COMPILE_FRACTION:.0f} s compile (from the compile cache)" in warm.reason
