"""Memory estimate and fit check (engine/fit/): arithmetic on meta skeletons, plus the
activation and head formulas against what torch really allocates for a tiny layer on the CPU."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from slidetune.engine.config import RuntimeConfig, runtime_fields
from slidetune.engine.placement import PlacementPlan, shapes_from_counts, unit_shapes
from slidetune.engine.fit import (ACTIVATION_MARGIN, ENV_HOST_MEMORY, FIT_SAFETY, GiB, MiB, InsufficientMemoryError,
                                  check_fit, choose_auto_settings, estimate_memory, head_bytes,
                                  layer_activation_bytes)
from slidetune.models.load import skeleton
from slidetune.models.presets import preset_config, tiny_config
from slidetune.models.units import SplitModel
from allocator_peak import allocator_peak

_SPLITS: dict = {}


def split_of(name: str) -> SplitModel:
    if name not in _SPLITS:
        _SPLITS[name] = SplitModel(skeleton(preset_config(name)))      # meta device: no memory
    return _SPLITS[name]


def cuda_rt(**kw) -> RuntimeConfig:
    return RuntimeConfig(device="cuda", **kw)   # plan for a GPU; nothing needs CUDA here


H100 = dict(gpu_free_bytes=80 * GiB, host_available_bytes=128 * GiB)


def auto_with_ample_host(split: SplitModel, rt: RuntimeConfig, **kw) -> RuntimeConfig:
    """choose_auto_settings where host RAM never binds: the speed-first choices alone (this
    machine's own RAM must not decide what the GPU-side tests see)."""
    from slidetune.engine.fit import choose_auto_settings
    return choose_auto_settings(split, rt, host_available_bytes=1 << 50, **kw)


def apply_option(line: str, rt: RuntimeConfig, batch_size: int, grad_accum: int, max_grad_norm):
    """Turn a suggested '--flag value ...  -> ...' line back into a configuration, through the real CLI parser."""
    import argparse

    from slidetune.config import add_config_flags

    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    ns = parser.parse_args(line.split("->")[0].split())
    changes, B, accum, clip = {}, batch_size, grad_accum, max_grad_norm
    fields = set(runtime_fields())
    for key, value in vars(ns).items():
        if key == "config":
            continue
        name = key.split(".")[-1]
        if key == "batch_size":
            B = value
        elif key == "grad_accum":
            accum = value
        elif key == "max_grad_norm":
            clip = value or None
        else:
            assert key.startswith("runtime.") and name in fields, key
            changes[name] = value
    return dataclasses.replace(rt, **changes), B, accum, clip


def assert_options_fit(err: InsufficientMemoryError, split, rt, batch_size, seq_len, grad_accum=1,
                       max_grad_norm=None, **avail):
    assert err.options, str(err)
    for line in err.options:
        rt2, B, accum, clip = apply_option(line, rt, batch_size, grad_accum, max_grad_norm)
        check_fit(split, rt2, batch_size=B, seq_len=seq_len, grad_accum=accum, max_grad_norm=clip, **avail)


# --------------------------------------------------------------------------- host / slide


def test_slide_8b_host_is_12_bytes_per_param_plus_buffers():
    split = split_of("qwen3-8b")
    P = split.num_params()
    rt = cuda_rt()
    eager = estimate_memory(split, rt, batch_size=8, seq_len=1024)
    assert eager.schedule == "eager"
    assert eager.host_parts["master + Adam moments (12 B/param)"] == 12 * P
    buffers = eager.host_bytes - 12 * P
    # the budget: 12.5 B/param + 8 GiB in all
    assert 0 < buffers < 0.5 * P + 8 * GiB, eager.summary()
    # pinned on CUDA (casts on the GPU): a gradient ring in chunks of chunk_mb MiB of FP32
    # elements, of DEADLINE_RING_LAYERS layers (updates reordered earliest-deadline-first), 3
    # in FIFO order; BF16 elements (grad_download=compute, the default), FP32 with fp32
    layer = split.layer_units[0].numel
    chunk = rt.transfer.chunk_mb * MiB // 4
    assert rt.transfer.grad_download == "compute"
    assert eager.pinned_bytes == -(-rt.DEADLINE_RING_LAYERS * layer // chunk) * chunk * 2
    fp32 = estimate_memory(split, dataclasses.replace(rt, grad_download="fp32"), batch_size=8, seq_len=1024)
    assert fp32.pinned_bytes == 2 * eager.pinned_bytes
    fifo = estimate_memory(split, dataclasses.replace(rt, update_order="fifo"), batch_size=8, seq_len=1024)
    assert fifo.pinned_bytes == -(-3 * layer // chunk) * chunk * 2
    deferred = estimate_memory(split, rt, batch_size=8, seq_len=1024, max_grad_norm=1.0)
    assert deferred.schedule == "deferred"
    # clipping holds each gradient as the backward made it, BF16: 2 B/param (page-locked), not 4;
    # it comes down straight into that buffer, so there is no gradient ring
    assert deferred.host_parts["held gradients (deferred schedule, 2 B/param)"] == 2 * P
    assert deferred.host_parts["upload/download rings"] == 0
    assert deferred.host_bytes - eager.host_bytes == (2 * P - eager.host_parts["upload/download rings"]
                                                      - eager.host_parts["fp32 drain scratch"])
    assert deferred.pinned_bytes == 2 * P
    # two held buffers on alternate steps (held_buffers=2): twice the held bytes, page-locked too
    two = estimate_memory(split, dataclasses.replace(rt, held_buffers=2), batch_size=8, seq_len=1024,
                          max_grad_norm=1.0)
    assert two.host_parts["held gradients (deferred schedule, 4 B/param)"] == 4 * P
    assert two.host_bytes - deferred.host_bytes == two.pinned_bytes - deferred.pinned_bytes == 2 * P
    # the 8B state is ~92 GiB: fits a 128 GiB host with eager updates, and with clipping
    check_fit(split, rt, batch_size=8, seq_len=1024, **H100)
    check_fit(split, rt, batch_size=8, seq_len=1024, max_grad_norm=1.0, **H100)


def test_slide_gpu_parts_follow_the_engine_allocations():
    split = split_of("llama-3.1-8b")
    rt = cuda_rt(cache_units=3, grad_slots=2)
    est = estimate_memory(split, rt, batch_size=4, seq_len=2048)
    P_L = max(u.numel for u in split.layer_units)
    assert est.gpu_parts["layer weight slots"] == 3 * P_L * 2
    assert est.gpu_parts["layer grad slots"] == 2 * P_L * 2
    assert est.gpu_parts["vocab weight slots"] == (split.embed_unit.numel + split.head_unit.numel) * 2
    assert est.gpu_parts["activation checkpoints"] == split.num_layers * 4 * 2048 * 4096 * 2
    assert est.gpu_bytes == sum(est.gpu_parts.values())
    assert est.host_bytes == sum(est.host_parts.values())
    assert set(est.phases) == {"layer working set", "head/logits", "embedding backward"}
    assert max(est.phases.values()) in est.gpu_parts.values()


def test_offload_lowers_gpu_and_raises_pinned():
    split = split_of("qwen3-8b")
    on_gpu = estimate_memory(split, cuda_rt(), batch_size=16, seq_len=2048)
    off = estimate_memory(split, cuda_rt(offload_activations=True), batch_size=16, seq_len=2048)
    ckpts = split.num_layers * 16 * 2048 * 4096 * 2
    assert off.gpu_bytes < on_gpu.gpu_bytes
    assert on_gpu.gpu_bytes - off.gpu_bytes == ckpts - 2 * 16 * 2048 * 4096 * 2
    assert off.pinned_bytes - on_gpu.pinned_bytes == ckpts
    # the loading transient is gone before the checkpoint slots are allocated: only one peak counts
    transient = on_gpu.host_parts["weight loading transient"]
    assert off.host_bytes - on_gpu.host_bytes == ckpts - min(transient, ckpts)
    assert off.host_parts["weight loading transient"] == max(0, transient - ckpts)


@pytest.mark.parametrize("mode", ["slide", "gpu", "ckpt"])
@pytest.mark.parametrize("head_impl", ["full", "chunked", "fused"])
def test_estimates_are_monotone_in_batch_and_seq(mode, head_impl):
    split = split_of("qwen3-1.7b")
    rt = cuda_rt(mode=mode, head_impl=head_impl, head_chunk_tokens=1024)
    for S in (128, 1024):
        prev = None
        for B in (1, 2, 3, 4, 7, 8, 16, 33, 64):
            est = estimate_memory(split, rt, batch_size=B, seq_len=S)
            if prev is not None:
                assert est.gpu_bytes >= prev.gpu_bytes and est.host_bytes >= prev.host_bytes, (B, S)
            prev = est
    for B in (1, 8):
        prev = None
        for S in (16, 128, 500, 1024, 4096, 16384):
            est = estimate_memory(split, rt, batch_size=B, seq_len=S)
            if prev is not None:
                assert est.gpu_bytes >= prev.gpu_bytes and est.host_bytes >= prev.host_bytes, (B, S)
            prev = est


def test_plain_mode_bytes_per_param():
    split = split_of("qwen3-1.7b")
    P = split.num_params()
    est = estimate_memory(split, cuda_rt(mode="gpu"), batch_size=1, seq_len=128)
    per_param = sum(est.gpu_parts[k] for k in ("fp32 master", "Adam moments", "fp32 grad accumulator",
                                                "compute weights", "compute grads"))
    assert per_param == 20 * P                      # 4 + 8 + 4 + 2 + 2 in bf16
    fp32 = estimate_memory(split, cuda_rt(mode="gpu", dtype="fp32"), batch_size=1, seq_len=128)
    assert fp32.gpu_parts["compute weights"] == 4 * P
    # recomputation stores only the layer inputs
    ckpt = estimate_memory(split, cuda_rt(mode="ckpt"), batch_size=8, seq_len=1024)
    gpu = estimate_memory(split, cuda_rt(mode="gpu"), batch_size=8, seq_len=1024)
    assert ckpt.gpu_parts["stored activations"] == split.num_layers * 8 * 1024 * 2048 * 2
    assert gpu.gpu_parts["stored activations"] > 5 * ckpt.gpu_parts["stored activations"]
    half = estimate_memory(split, cuda_rt(mode="ckpt", recompute="every:2"), batch_size=8, seq_len=1024)
    assert ckpt.gpu_bytes < half.gpu_bytes < gpu.gpu_bytes


# --------------------------------------------------------------------------- refusals


def test_gpu_mode_8b_on_80gb_refuses_and_suggests_slide():
    split = split_of("llama-3.1-8b")
    rt = cuda_rt(mode="gpu")
    with pytest.raises(InsufficientMemoryError) as ei:
        check_fit(split, rt, batch_size=8, seq_len=1024, **H100)
    msg = str(ei.value)
    assert "GPU memory: needs" in msg and "usable 76.00 GiB (95% of 80.00 GiB available)" in msg
    assert re.search(r"needs \d+\.\d\d GiB", msg)
    assert "largest items:" in msg and "Adam moments" in msg
    assert any(o.startswith("--mode slide") for o in ei.value.options), msg
    # ckpt mode still holds 20 B/param (160 GB) on the GPU: it must not be offered
    assert "--mode ckpt" not in msg
    assert_options_fit(ei.value, split, rt, 8, 1024, **H100)


def test_slide_batch_too_large_suggests_smaller_batch_and_offload():
    split = split_of("qwen3-8b")
    rt = cuda_rt(compile_layers="off")      # the eager layer's working set: the compiled one fits b32 x 4096
    avail = dict(gpu_free_bytes=80 * GiB, host_available_bytes=256 * GiB)
    with pytest.raises(InsufficientMemoryError) as ei:
        check_fit(split, rt, batch_size=32, seq_len=4096, **avail)
    err = ei.value
    msg = str(err)
    assert "activation checkpoints" in msg
    # the same configuration with a smaller micro-batch, the sequences per step kept
    first = err.options[0]
    m = re.match(r"--batch-size (\d+) --grad-accum (\d+)", first)
    assert m, msg
    B, accum = int(m.group(1)), int(m.group(2))
    assert B < 32 and B * accum == 32
    assert "--tuning.schedule" not in first       # auto schedule turns deferred by itself
    assert any("--offload-activations" in o for o in err.options), msg
    assert_options_fit(err, split, rt, 32, 4096, **avail)
    # the largest batch claimed to fit does, and one more does not
    largest = int(re.search(r"largest micro-batch that fits: (\d+)", msg).group(1)) if "largest" in msg else B
    check_fit(split, rt, batch_size=largest, seq_len=4096, grad_accum=2, **avail)
    with pytest.raises(InsufficientMemoryError):
        check_fit(split, rt, batch_size=largest + 1, seq_len=4096, grad_accum=2, **avail)


def test_suggestions_with_accumulation_keep_an_eager_device_vocabulary():
    """Accumulation needs neither the deferred schedule nor the vocabulary on the host (a unit's
    micro-batches are summed on the GPU): an option that accumulates keeps both, and every option
    still fits when applied through the CLI parser."""
    split = split_of("qwen3-8b")
    rt = cuda_rt(vocab_update="device", schedule="eager", compile_layers="off")     # eager: b32 x 4096 does not fit
    avail = dict(gpu_free_bytes=80 * GiB, host_available_bytes=256 * GiB)
    with pytest.raises(InsufficientMemoryError) as ei:
        check_fit(split, rt, batch_size=32, seq_len=4096, **avail)
    accumulating = [o for o in ei.value.options if "--grad-accum" in o]
    assert accumulating[0].startswith("--batch-size 8 --grad-accum 4 ")        # nothing else changed
    assert all("--tuning.schedule" not in o for o in accumulating)
    assert_options_fit(ei.value, split, rt, 32, 4096, **avail)


def test_offload_alone_can_be_the_fix():
    split = split_of("qwen3-8b")
    rt = cuda_rt()
    # checkpoints of 36 layers x 8 x 4096 tokens = 9 GiB; pick a GPU where only offload fits
    on = estimate_memory(split, rt, batch_size=8, seq_len=4096)
    off = estimate_memory(split, cuda_rt(offload_activations="on"), batch_size=8, seq_len=4096)
    gpu = int((on.gpu_bytes + off.gpu_bytes) / 2 / FIT_SAFETY)
    avail = dict(gpu_free_bytes=gpu, host_available_bytes=256 * GiB)
    with pytest.raises(InsufficientMemoryError) as ei:
        check_fit(split, rt, batch_size=8, seq_len=4096, **avail)
    assert "--offload-activations on  ->" in str(ei.value)
    assert_options_fit(ei.value, split, rt, 8, 4096, **avail)


def test_full_head_suggests_chunked():
    split = split_of("qwen3-1.7b")
    rt = cuda_rt(head_impl="full")
    full = estimate_memory(split, rt, batch_size=16, seq_len=2048)
    chunked = estimate_memory(split, cuda_rt(head_impl="chunked"), batch_size=16, seq_len=2048)
    assert full.phases["head/logits"] > 4 * chunked.phases["head/logits"]
    gpu = int(chunked.gpu_bytes / FIT_SAFETY) + GiB
    with pytest.raises(InsufficientMemoryError) as ei:
        check_fit(split, rt, batch_size=16, seq_len=2048, gpu_free_bytes=gpu, host_available_bytes=128 * GiB)
    assert any(o.startswith("--tuning.head_impl chunked") for o in ei.value.options), str(ei.value)
    assert_options_fit(ei.value, split, rt, 16, 2048, gpu_free_bytes=gpu, host_available_bytes=128 * GiB)


def test_host_too_small_for_deferred_suggests_eager_and_names_the_env_var():
    split = split_of("qwen3-8b")
    rt = cuda_rt(vocab_update="host", device_layers=0, cache_units=3)
    host = dict(H100, host_available_bytes=112 * GiB)    # 12 + 2 B/param = 107 GiB > 90% of 112
    with pytest.raises(InsufficientMemoryError) as ei:
        check_fit(split, rt, batch_size=4, seq_len=1024, max_grad_norm=1.0, **host)
    msg = str(ei.value)
    assert "host RAM: needs" in msg and "held gradients (deferred schedule" in msg
    assert ENV_HOST_MEMORY in msg
    assert any("--max-grad-norm 0" in o for o in ei.value.options), msg
    assert_options_fit(ei.value, split, rt, 4, 1024, max_grad_norm=1.0, **host)


def test_nothing_fits_says_so():
    split = split_of("qwen3-14b")                      # 14.8B x 12 B = 165 GiB of host state
    with pytest.raises(InsufficientMemoryError) as ei:
        check_fit(split, cuda_rt(), batch_size=4, seq_len=1024, **H100)
    # no change of placement or batch fits; the one option is the opt-in compact moments (8 of 12 B/param)
    assert len(ei.value.options) == 1 and ei.value.options[0].startswith("--moments bf16  -> ")
    assert "opt-in: AdamW's moments in bf16" in ei.value.options[0]
    # host RAM is what does not fit: the disk tier is named, with what it would hold
    assert "With a local disk: --disk-dir PATH" in str(ei.value)
    with pytest.raises(InsufficientMemoryError) as ei:
        check_fit(split, cuda_rt(), batch_size=4, seq_len=1024, gpu_free_bytes=78 * GiB,
                  host_available_bytes=32 * GiB)
    assert ei.value.options == []
    assert "No single change" in str(ei.value) and "--disk-dir" not in str(ei.value)


def test_env_var_overrides_host_memory(monkeypatch):
    split = split_of("qwen3-8b")
    monkeypatch.setenv(ENV_HOST_MEMORY, "64G")
    with pytest.raises(InsufficientMemoryError, match=r"host RAM: needs \d+\.\d\d GiB, usable 60\.80 GiB"):
        check_fit(split, cuda_rt(), batch_size=1, seq_len=128, gpu_free_bytes=80 * GiB)
    monkeypatch.setenv(ENV_HOST_MEMORY, str(200 * GiB))
    check_fit(split, cuda_rt(), batch_size=1, seq_len=128, gpu_free_bytes=80 * GiB)


def test_cpu_device_counts_model_state_against_ram():
    split = SplitModel(skeleton(tiny_config("llama")))
    rt = RuntimeConfig(device="cpu", mode="gpu", dtype="fp32")
    est = check_fit(split, rt, batch_size=2, seq_len=64, host_available_bytes=8 * GiB)
    assert est.device_type == "cpu" and est.pinned_bytes == 0
    assert "cuda context + allocator slack" not in est.gpu_parts
    assert est.host_total_bytes == est.host_bytes + est.gpu_bytes
    with pytest.raises(InsufficientMemoryError, match="host RAM"):
        check_fit(split, rt, batch_size=2, seq_len=64, host_available_bytes=est.host_bytes + 1)


def test_invalid_inputs():
    split = split_of("qwen3-1.7b")
    with pytest.raises(ValueError):
        estimate_memory(split, cuda_rt(), batch_size=0, seq_len=128)
    with pytest.raises(ValueError, match="eager"):
        estimate_memory(split, cuda_rt(schedule="eager"), batch_size=1, seq_len=128, max_grad_norm=1.0)


# --------------------------------------------------------------------------- formulas vs torch


def _tiny_layer(family: str, dtype, B, S, padded: bool):
    from transformers import AutoModelForCausalLM
    cfg = tiny_config(family, layers=1, vocab_size=128, hidden=256, heads=8, kv_heads=2, ffn=688)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(dtype).eval()
    split = SplitModel(model)
    mask = None
    if padded:
        mask = torch.ones(B, S, dtype=torch.long)
        mask[0, -3:] = 0
    kwargs = split.layer_kwargs(B, S, dtype, torch.device("cpu"), attention_mask=mask)[0]
    params = {k: v.detach().requires_grad_(True) for k, v in split.layer_modules[0].named_parameters()}
    return split, kwargs, params


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [False, True])
def test_saved_activations_match_saved_tensors_hooks(family, dtype, padded):
    B, S = 4, 128
    split, kwargs, params = _tiny_layer(family, dtype, B, S, padded)
    x = torch.randn(B, S, 256, dtype=dtype, requires_grad=True)
    storages: dict = {}

    def pack(t):
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        split.layer_forward(0, params, x, kwargs)
    exclude = {p.untyped_storage().data_ptr() for p in params.values()} | {x.untyped_storage().data_ptr()}
    measured = sum(n for ptr, n in storages.items() if ptr not in exclude)
    est = layer_activation_bytes(split, B, S, dtype, masked=padded)["saved"]
    assert measured <= est * 1.1 and est <= 1.5 * measured, (measured, est)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,S,padded", [(1, 16, False), (4, 256, False), (2, 512, True), (8, 512, False)])
def test_layer_working_set_matchesallocator_peak(family, dtype, B, S, padded):
    """Forward + backward of one layer (what slide's recompute does): estimate vs real peak."""
    split, kwargs, params = _tiny_layer(family, dtype, B, S, padded)
    x = torch.randn(B, S, 256, dtype=dtype, requires_grad=True)

    def step():
        g = torch.randn(B, S, 256, dtype=dtype)            # the incoming gradient counts too
        out = split.layer_forward(0, params, x, kwargs)
        grads = torch.autograd.grad(out, [x] + list(params.values()), g)
        del out, grads, g

    peak = allocator_peak(step)
    est = ACTIVATION_MARGIN * layer_activation_bytes(split, B, S, dtype, masked=padded)["peak"]
    assert peak <= est <= 1.5 * peak, (peak, est, est / peak)


def test_no_s_squared_term_for_fused_attention():
    """Same tokens, double the sequence: the CPU flash kernel keeps the peak flat."""
    dtype = torch.float32
    peaks = []
    for B, S in ((4, 256), (2, 512)):
        split, kwargs, params = _tiny_layer("llama", dtype, B, S, False)
        x = torch.randn(B, S, 256, dtype=dtype, requires_grad=True)

        def step():
            out = split.layer_forward(0, params, x, kwargs)
            torch.autograd.grad(out.sum(), [x] + list(params.values()))

        peaks.append(allocator_peak(step))
    assert peaks[1] < 1.1 * peaks[0], peaks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl,N,chunk", [("full", 1024, 4096), ("chunked", 1024, 256),
                                          ("chunked", 1024, 4096), ("chunked", 4096, 512)])
@pytest.mark.parametrize("in_place", [False, True], ids=["autograd", "engine"])
def test_head_estimate_matchesallocator_peak(dtype, impl, N, chunk, in_place):
    """head_bytes against the CPU allocator's peak, through autograd (plain mode) and through the
    slide engine's path (head_loss_and_grads: no graph, gradients scaled in place); the final norm
    runs inside the chunks."""
    V, d = 8192, 64
    split = SplitModel(skeleton(tiny_config("llama", vocab_size=V, hidden=d)))
    w = (torch.randn(V, d) * 0.02).to(dtype).requires_grad_(True)
    norm_w = torch.ones(d, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, V, (1, N))
    params = {"norm.weight": norm_w, "lm_head.weight": w}

    def step():
        x = torch.randn(1, N, d, dtype=dtype, requires_grad=True)
        if in_place:
            out = split.head_loss_and_grads(params, x.detach(), labels, 1.0 / N, impl=impl, chunk_tokens=chunk)
        else:
            loss = split.head_loss(params, x, labels, impl=impl, chunk_tokens=chunk)
            out = torch.autograd.grad(loss, [x, norm_w, w])
        del out, x

    peak = allocator_peak(step)
    est = head_bytes(split, N, dtype, impl, chunk, grads_in_place=in_place)
    assert 0.97 * peak <= est <= 1.25 * peak, (peak, est, est / peak)


def test_auto_cache_units_keeps_every_layer_resident_only_when_it_fits():
    """cache_units=-1: one slot per layer (0) where the whole configuration then fits in the
    GPU's free memory, else the 3-slot window; CPU and non-slide modes are left alone."""
    from slidetune.engine.fit import estimate_memory
    split = split_of("qwen3-8b")
    kw = dict(batch_size=16, seq_len=1024)
    rt = cuda_rt(mode="slide", grad_slot_dtype="compute")
    assert rt.placement.cache_units == -1
    resident = estimate_memory(split, dataclasses.replace(rt, cache_units=0), **kw).gpu_bytes
    window = estimate_memory(split, dataclasses.replace(rt, cache_units=3), **kw).gpu_bytes
    # resident: a weight slot per layer, and (deadline order) more gradient slots
    extra_grad_slots = (
        dataclasses.replace(rt, cache_units=0).resolved_grad_slots(split.num_layers) - 3)
    assert resident - window == (split.num_layers - 3 + extra_grad_slots) * max(u.numel for u in split.layer_units) * 2
    assert auto_with_ample_host(split, rt, gpu_free_bytes=80 * GiB, **kw).placement.cache_units == 0      # H100
    assert auto_with_ample_host(split, rt, gpu_free_bytes=24 * GiB, **kw).placement.cache_units == 3      # a 24 GB card
    cpu = RuntimeConfig(device="cpu", mode="slide")
    assert auto_with_ample_host(split, cpu, **kw).placement.cache_units == 3
    assert auto_with_ample_host(split, cpu, **kw).transfer.grad_slot_dtype == "compute"
    ckpt = cuda_rt(mode="ckpt")
    assert auto_with_ample_host(split, ckpt, gpu_free_bytes=80 * GiB, **kw) is ckpt
    pinned = cuda_rt(mode="slide", cache_units=4, grad_slot_dtype="compute", vocab_update="host", device_layers=0,
                     held_buffers=1, lean_layer="off", offload_activations="off")
    assert auto_with_ample_host(split, pinned, gpu_free_bytes=80 * GiB, **kw) is pinned
    # lean_layer auto is resolved too: HF's layer, which fits here
    assert auto_with_ample_host(split, dataclasses.replace(pinned, lean_layer="auto"), gpu_free_bytes=80 * GiB,
                                **kw) == pinned


def test_auto_grad_slot_dtype_takes_fp32_after_resident_layers_where_it_fits():
    """grad_slot_dtype=auto: FP32 slots (2 B/param more per slot) only where everything then
    fits; resident layers are preferred to FP32 slots; cast_on=cpu keeps compute slots. Only with
    grad_download=fp32: with compute-dtype downloads (the default) the slots keep the compute dtype."""
    from slidetune.engine.fit import estimate_memory
    split = split_of("llama-3.1-8b")
    kw = dict(batch_size=16, seq_len=1024)
    default = auto_with_ample_host(split, cuda_rt(mode="slide", vocab_update="host"), gpu_free_bytes=140 * GiB, **kw)
    assert (default.placement.cache_units, default.transfer.grad_slot_dtype) == (0, "compute")
    rt = cuda_rt(mode="slide", vocab_update="host", grad_download="fp32")
    assert rt.transfer.grad_slot_dtype == "auto" and not rt.grad_slots_fp32()

    def gpu(**changes) -> int:
        return estimate_memory(split, dataclasses.replace(rt, **changes), **kw).gpu_bytes

    r0_fp32, r0_bf16 = gpu(cache_units=0, grad_slot_dtype="fp32"), gpu(cache_units=0, grad_slot_dtype="compute")
    r3_fp32 = gpu(cache_units=3, grad_slot_dtype="fp32")
    P_L = max(u.numel for u in split.layer_units)
    slots = dataclasses.replace(rt, cache_units=0).resolved_grad_slots(split.num_layers)
    # the embedding and the head share one gradient slot (both updated on the host)
    vocab = max(split.embed_unit.numel, split.head_unit.numel)
    d2h_cast_staging = 2 * rt.transfer.chunk_elems(P_L) * 4        # compute-dtype slots cast on the D2H stream
    assert r0_fp32 - r0_bf16 == (slots * P_L + vocab) * 2 - d2h_cast_staging
    for free, want in [(r0_fp32 / FIT_SAFETY + 1, (0, "fp32")), (r0_fp32 / FIT_SAFETY - 1, (0, "compute")),
                       (r3_fp32 / FIT_SAFETY + 1, (3, "fp32")) if r3_fp32 < r0_bf16 else (r0_bf16 / FIT_SAFETY + 1, (0, "compute"))]:
        got = auto_with_ample_host(split, rt, gpu_free_bytes=int(free), **kw)
        assert (got.placement.cache_units, got.transfer.grad_slot_dtype) == want
    tiny = auto_with_ample_host(split, rt, gpu_free_bytes=1 * GiB, **kw)        # nothing fits: the lean one
    assert (tiny.placement.cache_units, tiny.transfer.grad_slot_dtype) == (3, "compute")
    host_casts = auto_with_ample_host(split, dataclasses.replace(rt, cast_on="cpu"), gpu_free_bytes=80 * GiB, **kw)
    assert host_casts.transfer.grad_slot_dtype == "compute"
    explicit = auto_with_ample_host(split, dataclasses.replace(rt, cache_units=0, grad_slot_dtype="compute"),
                                    gpu_free_bytes=80 * GiB, **kw)
    assert (explicit.placement.cache_units, explicit.transfer.grad_slot_dtype) == (0, "compute")


def test_auto_vocab_update_takes_the_device_where_it_fits_under_either_schedule():
    """vocab_update=auto: the embedding and head state (12 B/param) moves to the GPU after resident
    layers and before FP32 gradient slots, only where everything fits; the host then holds 12
    B/param less for them. Clipping (the deferred schedule) keeps it: their gradients wait on
    the GPU for the clip coefficient."""
    from slidetune.engine.fit import estimate_memory
    from slidetune.engine.slide.host_store import BUILD_WORKERS
    split = split_of("llama-3.1-8b")
    kw = dict(batch_size=16, seq_len=1024)
    rt = cuda_rt(mode="slide", grad_download="fp32")
    assert rt.placement.vocab_update == "auto" and not PlacementPlan.build(unit_shapes(split), rt).vocab_on_device
    vocab = split.embed_unit.numel + split.head_unit.numel

    def est(**changes):
        return estimate_memory(split, dataclasses.replace(rt, cache_units=0, **changes), **kw)

    dev_fp32, host_fp32 = est(vocab_update="device", grad_slot_dtype="fp32"), est(vocab_update="host",
                                                                                 grad_slot_dtype="fp32")
    dev_bf16 = est(vocab_update="device", grad_slot_dtype="compute")
    # ... and on the host they share one FP32 gradient slot, on the device each has its own
    shared = 4 * min(split.embed_unit.numel, split.head_unit.numel)
    assert dev_fp32.gpu_bytes - host_fp32.gpu_bytes == 12 * vocab + shared
    state = "master + Adam moments (12 B/param)"
    assert host_fp32.host_parts[state] - dev_fp32.host_parts[state] == 12 * vocab
    # built on the device a parameter at a time: both vocabulary matrices at once, at most
    matrices = [max(p.numel for p in u.params) for u in (split.embed_unit, split.head_unit)]
    assert dev_fp32.host_parts["weight loading transient"] == 4 * max(
        sum(matrices) if BUILD_WORKERS >= 2 else max(matrices),
        max(p.numel for u in split.units for p in u.params))
    assert dev_fp32.gpu_bytes > dev_bf16.gpu_bytes > host_fp32.gpu_bytes     # Llama-8B's numbers order them so
    # the checkpoints on the GPU and HF's layer, given: with them on auto the choice by predicted time
    # offloads checkpoints for device layers at the first size (1.869 s against 1.938, vocab on the host)
    pinned = dataclasses.replace(rt, offload_activations="off", lean_layer="off")
    for free, want in [(dev_fp32.gpu_bytes / FIT_SAFETY + 1, ("device", "fp32")),
                       (dev_bf16.gpu_bytes / FIT_SAFETY + 1, ("device", "compute")),
                       (host_fp32.gpu_bytes / FIT_SAFETY + 1, ("host", "fp32"))]:
        got = auto_with_ample_host(split, pinned, gpu_free_bytes=int(free), **kw)
        assert (got.placement.cache_units, got.placement.vocab_update, got.transfer.grad_slot_dtype) == (0, *want)
    clipped = auto_with_ample_host(split, rt, gpu_free_bytes=140 * GiB, max_grad_norm=1.0, **kw)
    assert clipped.placement.vocab_update == "device"
    held = estimate_memory(split, dataclasses.replace(rt, vocab_update="device"), max_grad_norm=1.0, **kw)
    host_params = split.num_params() - vocab
    assert held.host_parts["held gradients (deferred schedule, 2 B/param)"] == 2 * host_params
    assert auto_with_ample_host(split, RuntimeConfig(device="cpu", mode="slide"), **kw).placement.vocab_update == "host"


def test_plan_prints_the_estimate_and_the_resident_alternative(capsys):
    """`slidetune plan`: the estimate by part, and with cache_units auto the GPU memory from
    which every layer would stay resident."""
    from slidetune.cli import main
    assert main(["plan", "--model", "qwen3-1.7b", "--batch-size", "8", "--seq-len", "1024", "--max-grad-norm", "0",
                 "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "GPU " in out and "layer weight slots" in out and "master + Adam moments" in out
    m = re.search(r"at least ([\d.]+) GiB free every layer stays resident \(GPU ([\d.]+) GiB", out)
    assert m and float(m[1]) > float(m[2]) > 0
    # grad_slot_dtype auto: compute-dtype slots with compute-dtype downloads (the default) ...
    assert "grad_slot_dtype auto: compute (gradients cross PCIe in the compute dtype" in out
    # ... and with FP32 downloads, the memory from which FP32 slots are taken, for both slot choices
    assert main(["plan", "--model", "qwen3-1.7b", "--batch-size", "8", "--seq-len", "1024", "--max-grad-norm", "0",
                 "--device", "cuda", "--tuning.grad_download", "fp32"]) == 0
    out = capsys.readouterr().out
    fp32 = re.findall(r"with cache_units (\d+), FP32 gradient slots need a GPU with ([\d.]+) GiB free "
                      r"\(GPU ([\d.]+) GiB", out)
    assert sorted(int(c) for c, _, _ in fp32) == [0, 3]
    resident_fp32 = next(float(g) for c, _, g in fp32 if c == "0")
    assert resident_fp32 > float(m[2])                  # FP32 slots cost more than compute-dtype ones
    # vocab_update auto (eager here: no clipping): the memory from which the vocabulary units move
    vocab = re.findall(r"vocab_update auto: with cache_units (\d+), the embedding and head are updated on the GPU "
                       r"on one with ([\d.]+) GiB free \(GPU ([\d.]+) GiB", out)
    assert sorted(int(c) for c, _, _ in vocab) == [0, 3]
    assert next(float(g) for c, _, g in vocab if c == "0") > float(m[2])


def test_device_layers_move_their_state_from_host_to_gpu():
    """device_layers=k: the k lowest layers' master and moments (12 B/param) leave the host for the
    GPU, with a weight slot of their own each, and with one slot per layer the rotating slots
    shrink by the same k; the update's FP32 gradient copy counts as a phase."""
    from slidetune.engine.fit import estimate_memory
    from slidetune.engine.slide.host_store import BUILD_WORKERS
    split = split_of("qwen3-8b")
    kw = dict(batch_size=16, seq_len=1024)
    rt = cuda_rt(mode="slide", cache_units=0, vocab_update="host", grad_slot_dtype="compute")
    base = estimate_memory(split, rt, **kw)
    four = estimate_memory(split, dataclasses.replace(rt, device_layers=4), **kw)
    moved = sum(u.numel for u in split.layer_units[:4])
    state = "master + Adam moments (12 B/param)"
    assert base.host_parts[state] - four.host_parts[state] == 12 * moved
    # units built on the device pass through a host buffer each, BUILD_WORKERS at once; without
    # them the transient is the largest single parameter (the embedding) being loaded
    largest = max(p.numel for u in split.units for p in u.params)
    assert base.host_parts["weight loading transient"] == 4 * largest
    layers = sorted((u.numel for u in split.layer_units), reverse=True)
    for k in (4, split.num_layers):
        got = estimate_memory(split, dataclasses.replace(rt, device_layers=k), **kw)
        assert got.host_parts["weight loading transient"] == 4 * max(largest, sum(layers[:min(k, BUILD_WORKERS)]))
    assert four.gpu_bytes - base.gpu_bytes >= 12 * moved                 # + the widening buffer
    assert four.gpu_parts["device update widening buffer"] == 4 * rt.transfer.chunk_elems(
        max(u.numel for u in split.layer_units))
    assert four.gpu_parts["layer weight slots"] == base.gpu_parts["layer weight slots"] - 2 * moved
    # clipping: their gradients wait on the GPU in the compute dtype (2 B/param more there), and
    # the host holds the others' (2 B/param) instead of 4 B/param of FP32 for every unit
    clip4 = estimate_memory(split, dataclasses.replace(rt, device_layers=4), max_grad_norm=1.0, **kw)
    assert clip4.gpu_parts["device layers' held gradients (deferred schedule)"] == 2 * moved
    assert clip4.host_parts["held gradients (deferred schedule, 2 B/param)"] == 2 * (split.num_params() - moved)


def test_auto_device_layers_takes_as_many_as_fit():
    """device_layers=-1: after the other auto choices, the most layers whose state still fits in
    90% of the free GPU memory, under either schedule; none on the CPU."""
    from slidetune.engine.fit import estimate_memory
    split = split_of("qwen3-8b")
    kw = dict(batch_size=16, seq_len=1024)
    rt = cuda_rt(mode="slide", cache_units=0, vocab_update="device", grad_slot_dtype="compute", device_layers=-1)
    for k in (0, 5, 36):
        need = estimate_memory(split, dataclasses.replace(rt, device_layers=k), **kw).gpu_bytes
        got = auto_with_ample_host(split, rt, gpu_free_bytes=int(need / FIT_SAFETY) + 1, **kw)
        assert got.placement.device_layers == k
    clipped = dataclasses.replace(rt, vocab_update="auto")       # the deferred schedule keeps them
    assert auto_with_ample_host(split, clipped, gpu_free_bytes=500 * GiB, max_grad_norm=1.0,
                                **kw).placement.device_layers == 36
    assert auto_with_ample_host(split, RuntimeConfig(device="cpu", mode="slide", device_layers=-1),
                                **kw).placement.device_layers == 0


def _hf_masks(split: SplitModel, B: int, S: int, padded: bool) -> int:
    """Distinct [B,1,S,S] masks HF hands the layers (SDPA) for such a batch."""
    mask = None
    if padded:
        mask = torch.ones(B, S, dtype=torch.long)
        mask[0, -2:] = 0
    kwargs = split.layer_kwargs(B, S, torch.float32, torch.device("cpu"), attention_mask=mask)
    return len({id(kw["attention_mask"]) for kw in kwargs if kw.get("attention_mask") is not None})


@pytest.mark.parametrize("family,window", [("llama", None), ("qwen3", None), ("mistral", 8)])
@pytest.mark.parametrize("S", [4, 32])
@pytest.mark.parametrize("padded", [False, True])
def test_materialized_masks_match_what_hf_builds(family, window, S, padded):
    """Unpadded causal batches get no mask (SDPA's is_causal); a sliding window shorter than the
    sequence does; any padding does, one per mask kind."""
    from slidetune.engine.fit import materialized_masks
    split = SplitModel(skeleton(tiny_config(family, tied=False, vocab_size=128, layers=2, sliding_window=window)))
    assert materialized_masks(split, S, padded) == _hf_masks(split, 2, S, padded)


def test_unpadded_long_sequences_drop_the_s_squared_terms():
    """Packed or synthetic batches (padded=False): no [B,1,S,S] masks and no mask copy inside SDPA,
    so an 8B layer at 128K tokens is linear in S; a padded batch keeps both S^2 terms."""
    split = split_of("llama-3.1-8b")
    rt = cuda_rt(mode="slide", offload_activations=True, cache_units=3, vocab_update="host", device_layers=0)
    kw = dict(batch_size=1, seq_len=131072)
    padded, packed = estimate_memory(split, rt, **kw), estimate_memory(split, rt, padded=False, **kw)
    S, b = 131072, 2
    inputs = "layer inputs (masks, rotary, ids)"
    assert padded.gpu_parts[inputs] - packed.gpu_parts[inputs] == S * S          # one bool mask
    act = layer_activation_bytes(split, 1, S, torch.bfloat16)
    assert act["saved"] - layer_activation_bytes(split, 1, S, torch.bfloat16, masked=False)["saved"] == b * S * S
    assert packed.gpu_bytes < 60 * GiB < padded.gpu_bytes
    half = estimate_memory(split, rt, padded=False, batch_size=1, seq_len=S // 2)
    working = "layer working set (peak phase)"
    # linear in S (but for the constant weight-gradient term of the peak phase)
    assert packed.gpu_parts[working] == pytest.approx(2 * half.gpu_parts[working], rel=0.01)


def test_checkpoints_kept_on_the_gpu_leave_host_ram():
    """gpu_checkpoints=k with offload: k checkpoints (plus the 2 in flight) on the GPU, L - k in
    pinned host RAM; without offload every checkpoint is on the GPU whatever k says."""
    split = split_of("llama-3.1-8b")
    L, S = split.num_layers, 131072
    ckpt = S * 4096 * 2                                     # [1, S, d] bf16: 1 GiB
    kw = dict(batch_size=1, seq_len=S, padded=False)
    rt = cuda_rt(mode="slide", offload_activations=True, cache_units=3, vocab_update="host", device_layers=0)
    for k in (0, 8, L - 1, L):
        est = estimate_memory(split, dataclasses.replace(rt, gpu_checkpoints=k), **kw)
        assert est.gpu_parts["activation checkpoints"] == min(L, k + 2) * ckpt
        assert est.host_parts.get("offloaded checkpoints", 0) == (L - k) * ckpt
    base = estimate_memory(split, dataclasses.replace(rt, gpu_checkpoints=0), **kw)
    eight = estimate_memory(split, dataclasses.replace(rt, gpu_checkpoints=8), **kw)
    assert base.host_bytes - eight.host_bytes == base.pinned_bytes - eight.pinned_bytes == 8 * ckpt
    assert estimate_memory(split, rt, **kw).host_bytes == base.host_bytes         # auto, unresolved: none kept
    on_gpu = dataclasses.replace(rt, offload_activations=False, gpu_checkpoints=3)
    assert estimate_memory(split, on_gpu, **kw).gpu_parts["activation checkpoints"] == L * ckpt
    with pytest.raises(ValueError, match="gpu_checkpoints"):
        RuntimeConfig(gpu_checkpoints=-2)


def test_auto_settings_where_host_ram_binds_give_the_gpu_to_what_frees_the_host():
    """Llama-3.1-8B, batch 1 x 128K tokens, offloaded checkpoints, on an 80 GiB GPU and 118 GiB of
    RAM available: the speed-first choices (every layer resident) need more host RAM
    than there is; the host-bound choices (3-slot window, vocabulary and checkpoints on the GPU)
    fit both. With RAM to spare the speed-first choices stand."""
    from slidetune.engine.fit import check_fit, choose_auto_settings
    split = split_of("llama-3.1-8b")
    kw = dict(batch_size=1, seq_len=131072, max_grad_norm=0.0, padded=False)
    rt = cuda_rt(mode="slide", offload_activations=True, compile_layers="off")     # HF's layer eager
    gpu, host = 80 * GiB, 118 * GiB
    fastest = auto_with_ample_host(split, rt, gpu_free_bytes=gpu, **kw)
    assert fastest.placement.cache_units == 0
    assert estimate_memory(split, fastest, **kw).host_bytes > FIT_SAFETY * host
    got = choose_auto_settings(split, rt, gpu_free_bytes=gpu, host_available_bytes=host, **kw)
    est = estimate_memory(split, got, **kw)
    p = got.placement
    assert (p.cache_units, p.vocab_update) == (3, "device") and p.gpu_checkpoints > 0
    assert est.host_bytes <= FIT_SAFETY * host and est.gpu_bytes <= FIT_SAFETY * gpu
    # checkpoints before device layers: one more checkpoint would not fit on the GPU
    assert estimate_memory(split, dataclasses.replace(got, gpu_checkpoints=got.placement.gpu_checkpoints + 1),
                           **kw).gpu_bytes > FIT_SAFETY * gpu
    check_fit(split, got, gpu_free_bytes=gpu, host_available_bytes=host, **kw)      # does not raise
    # a host far too small: the configuration with the least host RAM, which check_fit refuses
    small = choose_auto_settings(split, rt, gpu_free_bytes=gpu, host_available_bytes=64 * GiB, **kw)
    assert estimate_memory(split, small, **kw).host_bytes <= est.host_bytes
    with pytest.raises(InsufficientMemoryError, match="host RAM"):
        check_fit(split, small, gpu_free_bytes=gpu, host_available_bytes=64 * GiB, **kw)


def test_auto_gpu_checkpoints_fill_what_device_layers_leave():
    """With RAM to spare, checkpoints kept on the GPU come after device layers (those take work
    off the host's AdamW; checkpoints only save PCIe and host RAM): as many as then fit."""
    split = split_of("llama-3.1-8b")
    kw = dict(batch_size=1, seq_len=8192, max_grad_norm=0.0, padded=False)
    got = auto_with_ample_host(split, cuda_rt(mode="slide", offload_activations=True), gpu_free_bytes=80 * GiB, **kw)
    assert got.placement.device_layers > 0 and 0 < got.placement.gpu_checkpoints <= split.num_layers

    def gpu(**change):
        return estimate_memory(split, dataclasses.replace(got, **change), **kw).gpu_bytes
    assert gpu() <= FIT_SAFETY * 80 * GiB
    if got.placement.gpu_checkpoints < split.num_layers:
        assert gpu(gpu_checkpoints=got.placement.gpu_checkpoints + 1) > FIT_SAFETY * 80 * GiB
    explicit = auto_with_ample_host(split, cuda_rt(mode="slide", offload_activations=True, gpu_checkpoints=0),
                                    gpu_free_bytes=80 * GiB, **kw)
    assert explicit.placement.gpu_checkpoints == 0


# what `plan` prints between its "resolved on ..." line and its verdict: describe_autos' lines,
# indented (engine/autos.py)
AUTO_LINES = r"(?:  .*\n)*"


def test_plan_resolves_the_auto_settings_for_a_given_gpu_and_host(capsys):
    """`slidetune plan --gpu-free-gib G --host-gib H`: the placement the auto settings resolve to
    there (as train would), its estimate, and whether it fits; Llama-3.1-8B at 128K tokens fits
    the H100 host only with the host-bound placement."""
    from slidetune.cli import main
    args = ["plan", "--model", "llama-3.1-8b", "--batch-size", "1", "--seq-len", "131072", "--offload-activations",
            "--device", "cuda", "--max-grad-norm", "0", "--gpu-free-gib", "78.5", "--compile-layers", "off"]
    assert main(args + ["--host-gib", "123"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"resolved on a GPU with 78.5 GiB free and 123.0 GiB of host RAM: cache_units=3 "
                  r"resident_layers=(\d+) vocab_update=device grad_slot_dtype=compute device_layers=0 "
                  r"offload_activations=on gpu_checkpoints=(\d+) lean_layer=off head_impl=fused: GPU ([\d.]+) GiB, "
                  r"host ([\d.]+) GiB\n" + AUTO_LINES + "fits", out)
    assert m and int(m[2]) > 0 and float(m[3]) <= FIT_SAFETY * 78.5 and float(m[4]) <= FIT_SAFETY * 123
    # the checkpoints take the GPU's room first (each frees a host byte); what is left is a layer
    # slot or a few, which go to resident layers (int(m[1]) may be 0)
    # with less host RAM, the lean layer's smaller working set leaves the GPU room for more checkpoints
    # (HF's layer alone no longer fits 100 GiB: NOTES.md "Lean layer"), and with less still nothing fits
    assert main(args + ["--host-gib", "100"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"gpu_checkpoints=\d+ lean_layer=on head_impl=fused: GPU [\d.]+ GiB, host [\d.]+ GiB\n"
                     + AUTO_LINES + "fits", out), out
    assert main(args + ["--host-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "does not fit: mode slide, batch 1 x 131072 tokens" in out and "host RAM too small" in out
    # --device auto (the default) plans for CUDA when a GPU size is given
    assert main([a for a in args if a not in ("--device", "cuda")] + ["--host-gib", "123"]) == 0
    assert "resolved on a GPU with 78.5 GiB free" in capsys.readouterr().out
    if not torch.cuda.is_available():              # planning for a GPU on a machine without one: a hint
        assert main(["plan", "--model", "llama-3.1-8b", "--device", "cuda"]) == 0
        assert "pass --gpu-free-gib" in capsys.readouterr().out


def test_refusal_offers_the_placement_auto_would_choose():
    """Placements given explicitly that leave host RAM short: the refusal names the placement the
    auto settings would take on that GPU and host, with its estimate, as an option that fits."""
    from slidetune.engine.fit import check_fit
    split = split_of("llama-3.1-8b")
    rt = cuda_rt(mode="slide", offload_activations=True, cache_units=0, vocab_update="host", device_layers=0,
                 gpu_checkpoints=0, grad_slot_dtype="compute", compile_layers="off")
    kw = dict(batch_size=1, seq_len=131072, max_grad_norm=0.0, padded=False,
              gpu_free_bytes=int(78.5 * GiB), host_available_bytes=123 * GiB)
    with pytest.raises(InsufficientMemoryError, match="host RAM too small") as err:
        check_fit(split, rt, **kw)
    m = re.search(r"--tuning.cache_units 3 --tuning.vocab_update device --tuning.gpu_checkpoints (\d+)  "
                  r"-> GPU ([\d.]+) GiB, host ([\d.]+) GiB", str(err.value))
    assert m and int(m[1]) > 0 and float(m[3]) <= FIT_SAFETY * 123
    assert any("--tuning.gpu_checkpoints" in o for o in err.value.options)


def test_the_plan_resolves_the_gradient_slots():
    """The GPU gradient slots' count and dtype are the plan's (the engine's slots and the estimate
    read them there): auto (0) resolves to 3, or 16 under deadline order with every layer resident
    and eager updates; grad_slot_dtype auto, unresolved, to the compute dtype."""
    shapes = shapes_from_counts(20, 10, 5, 5)
    assert (PlacementPlan.build(shapes, RuntimeConfig()).grad_slots, PlacementPlan.build(
        shapes, RuntimeConfig()).grad_slots_fp32) == (3, False)
    assert PlacementPlan.build(shapes, RuntimeConfig(cache_units=0)).grad_slots == 16
    assert PlacementPlan.build(shapes, RuntimeConfig(cache_units=0), "deferred").grad_slots == 3
    assert PlacementPlan.build(shapes, RuntimeConfig(cache_units=0, update_order="fifo")).grad_slots == 3
    plan = PlacementPlan.build(shapes, RuntimeConfig(grad_slots=5, grad_slot_dtype="fp32"))
    assert (plan.grad_slots, plan.grad_slots_fp32) == (5, True)
    assert PlacementPlan.from_dict(plan.to_dict()) == plan
    old = {k: v for k, v in plan.to_dict().items() if k not in ("grad_slots", "grad_slots_fp32")}
    assert (PlacementPlan.from_dict(old).grad_slots, PlacementPlan.from_dict(old).grad_slots_fp32) == (3, False)


def test_resident_layers_beside_the_window():
    """resident_layers=R with a window of K slots: the lowest R host layers get a slot of their own,
    the others share the window; where the window would hold every layer left to it, all are
    resident. The estimate counts R + K layer slots and no host RAM for them."""
    def plan(layers=20, **kw):
        return PlacementPlan.build(shapes_from_counts(layers, 10, 5, 5), RuntimeConfig(**kw))
    p = plan(cache_units=3, resident_layers=5)
    assert (p.resident_layers, p.window_slots, p.layer_slots) == (5, 3, 8)
    assert plan(cache_units=3, resident_layers=17).resident_layers == 20     # 3 left: no window
    assert plan(cache_units=3, resident_layers=17).window_slots == 0
    assert plan(cache_units=0, resident_layers=2).resident_layers == 20
    assert plan(cache_units=3).resident_layers == 0                          # auto, unresolved
    assert plan(layers=2, cache_units=3, resident_layers=4).resident_layers == 2
    with pytest.raises(ValueError, match="resident_layers"):
        RuntimeConfig(resident_layers=-2)
    split = split_of("qwen3-8b")
    kw = dict(batch_size=8, seq_len=1024)
    window = cuda_rt(mode="slide", cache_units=3, vocab_update="host", grad_slot_dtype="compute", device_layers=2)
    base, five = (estimate_memory(split, dataclasses.replace(window, resident_layers=r), **kw) for r in (0, 5))
    layer = split.layer_units[0].numel * 2
    assert base.gpu_parts["layer weight slots"] == 3 * layer and five.gpu_parts["layer weight slots"] == 8 * layer
    assert five.host_bytes == base.host_bytes


def test_auto_settings_where_host_ram_binds_give_what_is_left_to_resident_layers():
    """Qwen3-14B b8 on a GPU with 128 GiB free and 105.5 GiB of RAM available: every layer resident
    with the most device layers that fit needs more host RAM than that. The auto settings take
    the 3-slot window, the fewest device layers with which the host fits, and give the GPU's room
    left to resident layers (the all-window placement left this step bound by its uploads,
    benchmarks/NOTES.md "PCIe uploads")."""
    from slidetune.engine.fit import choose_auto_settings
    split = split_of("qwen3-14b")
    L = split.num_layers
    kw = dict(batch_size=8, seq_len=1024, max_grad_norm=0.0)
    rt = cuda_rt(mode="slide")
    gpu, host = 128 * GiB, int(105.5 * GiB)

    def est(c):
        return estimate_memory(split, c, **kw)
    fastest = auto_with_ample_host(split, rt, gpu_free_bytes=gpu, **kw)
    assert fastest.placement.cache_units == 0 and est(fastest).host_bytes > FIT_SAFETY * host
    got = choose_auto_settings(split, rt, gpu_free_bytes=gpu, host_available_bytes=host, **kw)
    host_layers = L - got.placement.device_layers
    plan = PlacementPlan.build(unit_shapes(split), got)
    resident = plan.resident_layers
    assert got.placement.cache_units == 3 and 0 < resident < host_layers and plan.window_slots == 3
    assert est(got).gpu_bytes <= FIT_SAFETY * gpu and est(got).host_bytes <= FIT_SAFETY * host
    # the fewest device layers: one fewer and the host does not fit
    assert est(dataclasses.replace(got, device_layers=got.placement.device_layers - 1)).host_bytes > FIT_SAFETY * host
    # as many resident layers as fit
    assert est(dataclasses.replace(got, resident_layers=got.placement.resident_layers + 1)).gpu_bytes > FIT_SAFETY * gpu
    # fewer layer uploads a step than the window alone with the most device layers (the 2026-11-24 Qwen3-14B run)
    window_only = PlacementPlan.build(unit_shapes(split), RuntimeConfig(device_layers=19, cache_units=3))
    assert plan.uploads_per_step()[0] < window_only.uploads_per_step()[0]


def test_auto_resident_layers_fill_a_gpu_too_small_for_all():
    """A GPU with room for the window and some layers more (Qwen3-8B on a 24 GB card, RAM to
    spare): as many resident layers as fit beside the 3-slot window. An explicit cache_units=3
    asks for the small window and gets no resident layers."""
    split = split_of("qwen3-8b")
    kw = dict(batch_size=4, seq_len=1024)
    got = auto_with_ample_host(split, cuda_rt(mode="slide"), gpu_free_bytes=24 * GiB, **kw)
    L = split.num_layers
    assert got.placement.cache_units == 3 and got.placement.device_layers == 0
    assert 0 < PlacementPlan.build(unit_shapes(split), got).resident_layers < L
    assert estimate_memory(split, got, **kw).gpu_bytes <= FIT_SAFETY * 24 * GiB
    more = dataclasses.replace(got, resident_layers=got.placement.resident_layers + 1)
    assert estimate_memory(split, more, **kw).gpu_bytes > FIT_SAFETY * 24 * GiB
    explicit = auto_with_ample_host(split, cuda_rt(mode="slide", cache_units=3), gpu_free_bytes=24 * GiB, **kw)
    assert PlacementPlan.build(unit_shapes(split), explicit).resident_layers == 0


def test_auto_settings_count_every_rank_of_the_host():
    """Data parallel: two ranks on one host share the state but each has its own rings and
    offloaded checkpoints. On a host with RAM for one rank's speed-first placement only, the
    two-rank choice gives the GPUs more of the host's load (checkpoints, vocabulary, device
    layers) so the host's two ranks fit; check_fit agrees for both counts."""
    from slidetune.engine.fit import check_fit, choose_auto_settings
    split = split_of("llama-3.1-8b")
    kw = dict(batch_size=1, seq_len=65536, max_grad_norm=1.0, padded=False)
    rt = cuda_rt(mode="slide", offload_activations=True)
    gpu = 80 * GiB
    fastest = auto_with_ample_host(split, rt, gpu_free_bytes=gpu, **kw)
    one_rank = estimate_memory(split, fastest, **kw)
    host = int(one_rank.host_bytes / FIT_SAFETY) + GiB          # room for one rank's speed-first placement
    assert one_rank.host_bytes_per_host(2) > FIT_SAFETY * host  # not for two of them
    got1 = choose_auto_settings(split, rt, gpu_free_bytes=gpu, host_available_bytes=host, **kw)
    assert got1 == fastest
    got2 = choose_auto_settings(split, rt, gpu_free_bytes=gpu, host_available_bytes=host, ranks_per_host=2, **kw)
    assert got2 != fastest
    est2 = estimate_memory(split, got2, **kw)
    assert est2.host_bytes_per_host(2) <= FIT_SAFETY * host and est2.gpu_bytes <= FIT_SAFETY * gpu
    shm = dict(ranks_per_host=2, shm_free_bytes=host)      # /dev/shm enlarged to the RAM
    check_fit(split, got2, gpu_free_bytes=gpu, host_available_bytes=host, **shm, **kw)
    with pytest.raises(InsufficientMemoryError, match="host RAM"):
        check_fit(split, got1, gpu_free_bytes=gpu, host_available_bytes=host, **shm, **kw)


def test_auto_shards_the_fewest_layers_that_let_a_70b_fit_a_multi_gpu_host():
    """Llama-3.1-70B clip 1.0 on 8 H200s of a 555 GiB host (no disk): device layers keep a copy of
    their state on every GPU, so the host cannot hold what they leave it; shard_layers auto spreads
    the fewest layers' state over the GPUs that let it, one GPU each. One rank keeps none, and
    with shard_layers 0 the same host does not fit."""
    from slidetune.engine.fit import check_fit, choose_auto_settings
    split = split_of("llama-3.1-70b")
    kw = dict(batch_size=16, seq_len=1024, max_grad_norm=1.0)
    rt = cuda_rt(mode="slide", held_buffers=1)
    machine = dict(gpu_free_bytes=139 * GiB, host_available_bytes=555 * GiB)
    got = choose_auto_settings(split, rt, ranks_per_host=8, **machine, **kw)
    plan = estimate_memory(split, got, ranks_per_host=8, **kw).plan
    assert plan.shard_layers > 0 and plan.device_layers == 0 and not plan.indices("disk")
    check_fit(split, got, ranks_per_host=8, shm_free_bytes=555 * GiB, **machine, **kw)
    # the fewest: one fewer leaves the host short
    fewer = dataclasses.replace(got, shard_layers=plan.shard_layers - 1)
    assert estimate_memory(split, fewer, ranks_per_host=8, **kw).host_bytes_per_host(8) > FIT_SAFETY * 555 * GiB
    # each GPU holds its share of them: 1/8 of the layers' master and moments
    assert estimate_memory(split, got, ranks_per_host=8, **kw).gpu_bytes <= FIT_SAFETY * 139 * GiB
    one = choose_auto_settings(split, rt, **machine, **kw)
    assert estimate_memory(split, one, **kw).plan.shard_layers == 0
    unsharded = choose_auto_settings(split, dataclasses.replace(rt, shard_layers=0), ranks_per_host=8, **machine, **kw)
    with pytest.raises(InsufficientMemoryError, match="host RAM"):        # (/dev/shm aside)
        check_fit(split, unsharded, ranks_per_host=8, shm_free_bytes=2048 * GiB, **machine, **kw)


def test_plan_for_several_ranks_counts_the_host_once_and_checks_shared_memory(capsys):
    """`slidetune plan --gpus 2`: the auto settings for two ranks on the host, the host's RAM for
    both (the shared state once), and the shared state against /dev/shm (--shm-gib)."""
    from slidetune.cli import main
    args = ["plan", "--model", "qwen3-8b", "--batch-size", "16", "--seq-len", "1024", "--device", "cuda",
            "--gpu-free-gib", "78.5", "--host-gib", "250", "--gpus", "2"]
    assert main(args + ["--shm-gib", "125"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"resolved on 2 ranks on one host, each on a GPU with 78.5 GiB free and 250.0 GiB of host RAM: "
                  r".*: GPU ([\d.]+) GiB per rank, host ([\d.]+) GiB for its 2 ranks \(the shared state, ([\d.]+) GiB "
                  r"in /dev/shm, once\)\n" + AUTO_LINES + "fits", out)
    assert m, out
    assert float(m[1]) <= FIT_SAFETY * 78.5 and float(m[2]) <= FIT_SAFETY * 250 and float(m[3]) <= 125
    # a container's default /dev/shm (64 MB) cannot hold it: said, with the fix
    assert main(args + ["--shm-gib", "0.0625"]) == 0
    assert "does not fit: data parallel keeps one copy of the training state per host" in (out := capsys.readouterr().out)
    assert "--shm-size" in out


def test_units_kept_on_the_device_are_built_a_parameter_at_a_time():
    """fill_on_device gives the values fill() gives, and the build's host transient counts the
    largest matrix of each device unit, not the unit (Qwen3-8B: a layer's largest projection is
    about a quarter of the layer)."""
    from slidetune.models.load import RandomInit, fill_on_device
    from test_equivalence import make_loaded
    loaded = make_loaded("llama", tied=False)
    for unit in loaded.split.units:
        host = torch.empty(unit.numel, dtype=torch.float32)
        loaded.source.fill(unit, host)
        assert torch.equal(fill_on_device(loaded.source, unit, torch.device("cpu")), host)
        rnd = torch.empty(unit.numel)
        RandomInit(seed=3).fill(unit, rnd)
        assert torch.equal(fill_on_device(RandomInit(seed=3), unit, torch.device("cpu")), rnd)
    split = split_of("qwen3-8b")
    kw = dict(batch_size=16, seq_len=1024, max_grad_norm=1.0)
    rt = cuda_rt(mode="slide", cache_units=0, vocab_update="device", device_layers=8, resident_layers=0,
                 grad_slot_dtype="compute", offload_activations=False)
    est = estimate_memory(split, rt, **kw)
    layer_largest = max(p.numel for p in split.layer_units[0].params)
    vocab_largest = max(p.numel for p in split.units[0].params)
    assert layer_largest * 3 < split.layer_units[0].numel
    from slidetune.engine.slide.host_store import BUILD_WORKERS          # builds at once: min(8, cores)
    building = sorted([vocab_largest] * 2 + [layer_largest] * 8, reverse=True)[:BUILD_WORKERS]
    want = max(vocab_largest, sum(building)) * 4
    assert est.host_parts["weight loading transient"] == want


def test_auto_held_buffers_take_two_where_the_host_has_room():
    """held_buffers=-1: the clipped schedule's second held buffer (2 B/param of host RAM) where it
    fits beside the auto placement (Qwen3-8B b16 on the H100 host); where only some fit
    (Llama-3.1-8B on a 24 GB GPU: the host holds nearly everything), the lowest host units' only,
    as many as fit; one where none fits or nothing is held (unclipped); the placement itself is
    the same as with one buffer."""
    from slidetune.engine.fit import choose_auto_settings
    host = 123 * GiB
    rt = cuda_rt(mode="slide", held_buffers=-1)
    kw = dict(seq_len=1024, host_available_bytes=host)
    big = choose_auto_settings(split_of("qwen3-8b"), rt, batch_size=16, max_grad_norm=1.0, gpu_free_bytes=int(78.5 * GiB),
                               **kw)
    assert big.clip.held_buffers == 2
    one = choose_auto_settings(split_of("qwen3-8b"), dataclasses.replace(rt, held_buffers=1), batch_size=16,
                               max_grad_norm=1.0, gpu_free_bytes=int(78.5 * GiB), **kw)
    assert dataclasses.replace(big, held_buffers=1) == one
    est = estimate_memory(split_of("qwen3-8b"), big, batch_size=16, seq_len=1024, max_grad_norm=1.0)
    assert est.host_bytes <= FIT_SAFETY * host and "held gradients (deferred schedule, 4 B/param)" in est.host_parts
    small = choose_auto_settings(split_of("llama-3.1-8b"), rt, batch_size=8, max_grad_norm=1.0,
                                 gpu_free_bytes=int(23.5 * GiB), **kw)
    host_units = len(split_of("llama-3.1-8b").units)          # all on the host here
    assert small.clip.held_buffers == 2 and 0 < small.clip.held_second_units < host_units
    est = estimate_memory(split_of("llama-3.1-8b"), small, batch_size=8, seq_len=1024, max_grad_norm=1.0)
    assert est.host_bytes <= FIT_SAFETY * host
    more = dataclasses.replace(small, held_second_units=small.clip.held_second_units + 1)      # the next does not fit
    assert estimate_memory(split_of("llama-3.1-8b"), more, batch_size=8, seq_len=1024,
                           max_grad_norm=1.0).host_bytes > FIT_SAFETY * host
    plan = PlacementPlan.build(unit_shapes(split_of("llama-3.1-8b")), small, "deferred")
    second = small.clip.held_second_units
    assert [u.held for u in plan.units] == [2] * second + [1] * (host_units - second)
    tight = choose_auto_settings(split_of("llama-3.1-8b"), rt, batch_size=8, max_grad_norm=1.0,
                                 gpu_free_bytes=int(23.5 * GiB), seq_len=1024, host_available_bytes=114 * GiB)
    assert (tight.clip.held_buffers, tight.clip.held_second_units) == (1, -1)
    plain = choose_auto_settings(split_of("qwen3-8b"), rt, batch_size=16, max_grad_norm=0.0,
                                 gpu_free_bytes=int(78.5 * GiB), **kw)
    assert plain.clip.held_buffers == 1


def test_auto_disk_buffers_read_ahead_as_deep_as_host_ram_has_room_for():
    """disk_buffers=-1: the disk tier's block buffers (its read-ahead) fill host RAM's room beside
    the placement, before the held buffers take any: at most half the disk units' blocks (more would
    keep every written block for the next step: an in-RAM store that also writes to disk), at
    least 8 (what the fit counted when it placed the units). Qwen3-8B b16 clipped, 4 layers on
    disk, on the H100 host: half the blocks get a buffer; a host with less room: as many as fit, the
    estimate within its budget and one more over it; nothing on disk: 8; a count given: kept."""
    from slidetune.engine.fit import choose_auto_settings
    from slidetune.engine.placement import DISK_BUFFERS_UNRESOLVED
    from slidetune.engine.slide.disk_tier import block_elems, tier_blocks
    split = split_of("qwen3-8b")
    rt = cuda_rt(mode="slide", disk_dir="/tmp", disk_units=4)
    kw = dict(batch_size=16, seq_len=1024, max_grad_norm=1.0, gpu_free_bytes=int(78.5 * GiB))
    roomy = choose_auto_settings(split, rt, host_available_bytes=123 * GiB, **kw)
    plan = PlacementPlan.build(unit_shapes(split), roomy, "deferred")
    blocks = tier_blocks(plan, rt.disk.disk_block_mb)
    assert blocks == sum(-(-u.numel // block_elems(64)) for u in plan.units if u.state == "disk") > 8
    assert roomy.disk.disk_buffers == plan.disk_buffers == blocks // 2
    est = estimate_memory(split, roomy, batch_size=16, seq_len=1024, max_grad_norm=1.0)
    assert est.host_parts["disk tier block buffers"] == blocks // 2 * 8 * block_elems(64)
    assert est.host_bytes <= FIT_SAFETY * 123 * GiB
    # less room: the buffers take what is left beside the placement and the held buffers get none
    least = estimate_memory(split, dataclasses.replace(roomy, disk_buffers=8, held_buffers=1),
                            batch_size=16, seq_len=1024, max_grad_norm=1.0).host_bytes
    host = int((least + 20 * 8 * block_elems(64) + 2**20) / FIT_SAFETY)          # room for 20 more buffers
    tight = choose_auto_settings(split, rt, host_available_bytes=host, **kw)
    assert (tight.disk.disk_units, tight.disk.disk_buffers, tight.clip.held_buffers) == (4, 28, 1)
    assert estimate_memory(split, tight, batch_size=16, seq_len=1024, max_grad_norm=1.0).host_bytes <= FIT_SAFETY * host
    assert estimate_memory(split, dataclasses.replace(tight, disk_buffers=29), batch_size=16, seq_len=1024,
                           max_grad_norm=1.0).host_bytes > FIT_SAFETY * host
    # nothing on disk (left at auto: moot), or a count given
    none = choose_auto_settings(split, cuda_rt(mode="slide"), host_available_bytes=123 * GiB, **kw)
    assert none.disk.disk_buffers == -1
    given = choose_auto_settings(split, dataclasses.replace(rt, disk_buffers=12), host_available_bytes=123 * GiB, **kw)
    assert given.disk.disk_buffers == 12
    # unresolved (an engine built directly): the old 8; the plan's record keeps the count
    assert PlacementPlan.build(unit_shapes(split), rt, "deferred").disk_buffers == DISK_BUFFERS_UNRESOLVED
    assert PlacementPlan.from_dict(plan.to_dict()) == plan
    with pytest.raises(ValueError, match="disk_buffers"):
        RuntimeConfig(disk_buffers=2)


def test_the_plan_places_held_buffers_on_host_units_of_the_clipped_schedule_only():
    """UnitPlace.held: none for the eager schedule or units updated on the GPU; one per host unit
    when clipped; the second (held_buffers 2) for all, or for the lowest held_second_units host
    units (the embedding up, device layers skipped); the plan's record keeps them."""
    shapes = shapes_from_counts(4, 10, 5, 5)
    rt = RuntimeConfig(mode="slide", device="cpu", device_layers=1, held_buffers=2, held_second_units=2)
    assert [u.held for u in PlacementPlan.build(shapes, rt, "eager").units] == [0] * 6
    plan = PlacementPlan.build(shapes, rt, "deferred")
    assert [u.held for u in plan.units] == [2, 0, 2, 1, 1, 1]       # embed, (layer 0 on the GPU), layer 1, ...
    assert plan.held_numel() == 2 * 5 + 2 * 10 + 10 + 10 + 5
    assert [u.held for u in PlacementPlan.build(shapes, dataclasses.replace(rt, held_second_units=-1),
                                                "deferred").units] == [2, 0, 2, 2, 2, 2]
    assert [u.held for u in PlacementPlan.build(shapes, dataclasses.replace(rt, held_buffers=1),
                                                "deferred").units] == [1, 0, 1, 1, 1, 1]
    assert PlacementPlan.from_dict(plan.to_dict()) == plan
    assert any("two buffers for embed, layer 1, one for layers 2-3, head" in line for line in plan.summary_lines())
    with pytest.raises(ValueError, match="held_second_units"):
        RuntimeConfig(held_second_units=-2)


def test_clip_sweep_weights_counts_its_upload_copies_in_host_and_pinned_ram():
    """clip_sweep=weights keeps a BF16 copy of every host-RAM unit's weights (the plan's
    upload_copy; not the GPU's units, not the disk tier's): 2 B/param more host RAM, page-locked,
    where the clip runs the deferred schedule; an eager run keeps none."""
    split = split_of("qwen3-8b")
    rt = dataclasses.replace(cuda_rt(), device_layers=8, vocab_update="device", disk_units=2, disk_dir="/tmp")
    kw = dict(batch_size=16, seq_len=1024, max_grad_norm=1.0)
    split_est = estimate_memory(split, rt, **kw)
    weights_rt = dataclasses.replace(rt, clip_sweep="weights")
    weights_est = estimate_memory(split, weights_rt, **kw)
    plan = PlacementPlan.build(unit_shapes(split), weights_rt, "deferred")
    copied = [u for u in plan.units if u.upload_copy]
    assert copied and all(u.state == "host" for u in copied)
    assert {u.index for u in copied} == set(plan.indices("host"))         # 26 layers: not the 2 on disk
    assert len(copied) == 36 - 8 - 2
    extra = 2 * sum(u.numel for u in copied)
    assert weights_est.host_parts["upload copies (clip_sweep weights, 2 B/param)"] == extra
    assert weights_est.host_bytes - split_est.host_bytes == extra
    assert weights_est.pinned_bytes - split_est.pinned_bytes == extra
    eager = estimate_memory(split, weights_rt, batch_size=16, seq_len=1024)
    assert not any(k.startswith("upload copies") for k in eager.host_parts)
    assert any("upload copies" in line for line in plan.summary_lines())
    assert PlacementPlan.from_dict(plan.to_dict()) == plan


def test_placement_plan_refuses_the_combinations_the_engine_cannot_run():
    """PlacementPlan.build refuses what the engine could not run, before anything is built (so
    `slidetune plan` and a run stop there), naming the setting to change: clip_sweep=weights with
    a compute dtype other than BF16, or under data parallel; the masters of disk units on disk
    under data parallel. An auto dtype not resolved yet is not judged; one rank, BF16: a plan."""
    shapes = shapes_from_counts(4, 1000, 500, 500)
    weights = RuntimeConfig(dtype="fp32", clip_sweep="weights")
    with pytest.raises(ValueError, match="clip_sweep weights writes BF16 upload copies, but the compute dtype "
                                         "is torch.float32; use split"):
        PlacementPlan.build(shapes, weights, "deferred")
    with pytest.raises(ValueError, match="clip_sweep weights writes BF16 upload copies.*use split"):
        PlacementPlan.build(shapes, dataclasses.replace(weights, dtype="auto"), "deferred", dtype=torch.float16)
    assert PlacementPlan.build(shapes, weights, "eager").upload_copy_numel() == 0     # no clipped sweep: no copies
    assert PlacementPlan.build(shapes, dataclasses.replace(weights, dtype="auto"), "deferred").upload_copy_numel()
    bf16 = dataclasses.replace(weights, dtype="bf16")
    assert PlacementPlan.build(shapes, bf16, "deferred").upload_copy_numel() == 4 * 1000 + 1000
    with pytest.raises(ValueError, match="clip_sweep weights runs on one rank for now.*use split under data"):
        PlacementPlan.build(shapes, bf16, "deferred", ranks=2)
    disk_master = RuntimeConfig(disk_units=2, disk_dir="/tmp", disk_master="on")
    assert PlacementPlan.build(shapes, disk_master).master_params("disk") == 1000 + 500   # the head and layer 3
    with pytest.raises(ValueError, match="does not support --tuning.disk_master yet.*use --tuning.disk_master off"):
        PlacementPlan.build(shapes, disk_master, ranks=2)


# --------------------------------------------------------------------------- the lean layer
# One layer's recompute + backward measured on the H200 (benchmarks/results/lean_layer/, the lean
# layer with 8192-token MLP tiles, eager): (model, batch, seq) -> the allocator's peak in GiB.
LEAN_MEASURED_GIB = {("llama-3.1-8b", 1, 65536): 7.14, ("qwen3-8b", 64, 1024): 7.62, ("qwen3-8b", 16, 1024): 2.75}


@pytest.mark.parametrize("shape", list(LEAN_MEASURED_GIB))
def test_lean_layer_estimate_is_above_its_measured_peak_and_close(shape):
    """The fit's lean working set never under the H200's measured peak (the run would fail), and
    within 20% above it (the GPU's room would be wasted)."""
    model, batch, seq = shape
    from slidetune.engine.fit import lean_layer_bytes
    est = lean_layer_bytes(split_of(model), batch, seq, torch.bfloat16, tile_tokens=8192, masked=False)["peak"] / GiB
    assert LEAN_MEASURED_GIB[shape] <= est <= 1.2 * LEAN_MEASURED_GIB[shape], est


# The lean layer compiled, one Qwen3-8B layer at 64 x 1024 on the H200 (benchmarks/results/lean_layer/
# row_tiles_h200/): the allocator's peak in GiB, in row tiles of 16 sequences (the default
# layer_row_tokens) and untiled.
LEAN_ROW_TILED_MEASURED_GIB = {16384: 3.97, 0: 7.34}


@pytest.mark.parametrize("row_tokens", list(LEAN_ROW_TILED_MEASURED_GIB))
def test_row_tiled_lean_estimate_is_above_its_measured_peak(row_tokens):
    """The fit's row-tiled working set (lean_row_tiled_bytes) never under the H200's measured peak,
    and within 30% above it (the FP32 gradient sums and both full-batch gradients counted apart)."""
    from slidetune.engine.fit import lean_row_tiled_bytes
    est = lean_row_tiled_bytes(split_of("qwen3-8b"), 64, 1024, torch.bfloat16, tile_tokens=8192,
                               row_tokens=row_tokens, masked=False)["peak"] / GiB
    measured = LEAN_ROW_TILED_MEASURED_GIB[row_tokens]
    assert measured <= est <= 1.3 * measured, est


def test_a_long_sequence_on_the_small_gpu_takes_the_lean_layer_and_keeps_checkpoints_there():
    """Llama-3.1-8B 1 x 65536 clipped under a 24 GiB budget beside 123 GiB of host RAM (the H200 run
    of benchmarks/results/throughput/slideformer_shapes_h200/g24_llama_64k_longest/): the lean layer (one
    sequence: no row tiles), the fused head, offloaded checkpoints with 13 kept on the GPU, and it fits;
    HF's layer does not."""
    split = split_of("llama-3.1-8b")
    kw = dict(batch_size=1, seq_len=65536, max_grad_norm=1.0, padded=False)
    small = dict(gpu_free_bytes=24 * GiB, host_available_bytes=123 * GiB)
    got = choose_auto_settings(split, cuda_rt(), **small, **kw)
    est = estimate_memory(split, got, **kw)
    assert (got.layer.lean_layer, got.resolved_head_impl, got.offloads_activations) == ("on", "fused", True)
    assert est.plan.gpu_checkpoints == 13
    check_fit(split, got, **small, **kw)
    with pytest.raises(InsufficientMemoryError):
        check_fit(split, dataclasses.replace(got, lean_layer="off"), **small, **kw)


def test_the_estimate_counts_the_layer_the_runtime_runs():
    split = split_of("qwen3-8b")
    kw = dict(batch_size=32, seq_len=1024, max_grad_norm=1.0, padded=False)
    eager = estimate_memory(split, cuda_rt(lean_layer="off", compile_layers="off"), **kw).phases["layer working set"]
    compiled = estimate_memory(split, cuda_rt(lean_layer="off", compile_layers="on"), **kw).phases["layer working set"]
    lean = estimate_memory(split, cuda_rt(lean_layer="on"), **kw).phases["layer working set"]
    assert lean < 0.5 * eager and lean < compiled < 0.7 * eager
    # auto, unresolved (an engine built directly): HF's layer, as layer_runner.resolve_lean_layer, and
    # compile auto on CUDA counted compiled (byte_models.fit_counts_compiled; train keeps it on
    # where the placement needs it), on the CPU eager
    assert estimate_memory(split, cuda_rt(), **kw).phases["layer working set"] == compiled
    assert estimate_memory(split, RuntimeConfig(device="cpu"), **kw).phases["layer working set"] == eager


# HF's layer compiled, one recompute + backward on the H200 (benchmarks/results/lean_layer/layer_memory.json,
# variant hf-compiled, torch 2.11): (model, batch, seq) -> the allocator's peak in GiB.
HF_COMPILED_MEASURED_GIB = {("qwen3-8b", 16, 1024): 2.69, ("qwen3-8b", 64, 1024): 10.49,
                            ("llama-3.1-8b", 1, 65536): 10.87}


@pytest.mark.parametrize("shape", list(HF_COMPILED_MEASURED_GIB))
def test_compiled_layer_estimate_is_above_its_measured_peak_and_close(shape):
    """The fit's compiled HF working set (compiled_layer_activation_bytes) never under the H200's
    measured peak, within 10% above it, and ACTIVATION_MARGIN on top of that."""
    from slidetune.engine.fit.byte_models import compiled_layer_activation_bytes
    model, batch, seq = shape
    est = compiled_layer_activation_bytes(split_of(model), batch, seq, torch.bfloat16, masked=False)["peak"] / GiB
    assert HF_COMPILED_MEASURED_GIB[shape] <= est <= 1.1 * HF_COMPILED_MEASURED_GIB[shape], est


def test_auto_picks_the_lean_layer_only_where_it_makes_the_run_fit(tmp_path):
    """Qwen3-8B on a 24 GiB GPU and a 123 GiB host (the H200 under --gpu-memory-limit 24), the
    defaults: b64 unclipped fits with HF's compiled layer and every checkpoint offloaded (predicted
    6.33 s a step against the lean layer's 6.99 with 18 checkpoints kept: the tiles' ~12 ms a layer,
    NOTES.md "Lean layer"), not with HF's eager layer; b64 clipped fits only with the lean layer (the
    held gradients and HF's offloaded checkpoints leave the host short; row tiles and the lean head
    leave room for 18 checkpoints on the GPU) and not without row tiles; on an 80 GiB GPU at b16 HF's
    layer fits and stays (with some checkpoints offloaded for more device layers: predicted 2.035 s a
    step against 2.100 with all of them on the GPU, bench/step_model.py at its nominal rates)."""
    split = split_of("qwen3-8b")
    rt = cuda_rt()
    small = dict(gpu_free_bytes=24 * GiB, host_available_bytes=123 * GiB, seq_len=1024, padded=False)
    plain = choose_auto_settings(split, rt, batch_size=64, max_grad_norm=0.0, **small)
    assert (plain.layer.lean_layer, plain.offload_activations, plain.resolved_head_impl) == ("off", "on", "fused")
    assert plain.placement.gpu_checkpoints == 0
    check_fit(split, plain, batch_size=64, max_grad_norm=0.0, **small)
    with pytest.raises(InsufficientMemoryError):
        check_fit(split, dataclasses.replace(plain, compile_layers="off"), batch_size=64, max_grad_norm=0.0, **small)
    clipped = choose_auto_settings(split, rt, batch_size=64, max_grad_norm=1.0, **small)
    assert clipped.layer.lean_layer == "on" and clipped.disk.disk_units == 0
    check_fit(split, clipped, batch_size=64, max_grad_norm=1.0, **small)
    with pytest.raises(InsufficientMemoryError, match="host RAM"):
        check_fit(split, dataclasses.replace(clipped, lean_layer="off", gpu_checkpoints=0), batch_size=64,
                  max_grad_norm=1.0, **small)
    untiled = choose_auto_settings(split, dataclasses.replace(rt, layer_row_tokens=0), batch_size=64,
                                   max_grad_norm=1.0, **small)
    with pytest.raises(InsufficientMemoryError, match="host RAM"):
        check_fit(split, untiled, batch_size=64, max_grad_norm=1.0, **small)
    disk = dataclasses.replace(rt, disk_dir=str(tmp_path), layer_row_tokens=0)
    b64 = choose_auto_settings(split, disk, batch_size=64, max_grad_norm=1.0, **small)
    assert b64.disk.disk_units > 0          # untiled, the lean layer needs the disk tier as HF's compiled one does
    check_fit(split, b64, batch_size=64, max_grad_norm=1.0, disk_free_bytes=60 * GiB, **small)
    roomy = choose_auto_settings(split, cuda_rt(), batch_size=16, gpu_free_bytes=80 * GiB,
                                 host_available_bytes=125 * GiB, seq_len=1024, max_grad_norm=1.0)
    assert (roomy.layer.lean_layer, roomy.offload_activations) == ("off", "on")


def test_the_small_gpu_offloads_checkpoints_and_fuses_the_head_by_itself():
    """Qwen3-8B b16 x 1024 clipped under a 24 GiB budget with every setting on auto: the run fits
    (issue 31: the defaults were refused by the chunked head's logits), with the fused head and, as
    the checkpoints do not all fit beside it, offloaded ones; the whole H200 keeps them all."""
    split = split_of("qwen3-8b")
    kw = dict(batch_size=16, seq_len=1024, max_grad_norm=1.0)
    small = choose_auto_settings(split, cuda_rt(), gpu_free_bytes=24 * GiB, host_available_bytes=123 * GiB, **kw)
    assert small.resolved_head_impl == "fused"
    check_fit(split, small, gpu_free_bytes=24 * GiB, host_available_bytes=123 * GiB, **kw)
    whole = choose_auto_settings(split, cuda_rt(), gpu_free_bytes=139 * GiB, host_available_bytes=123 * GiB, **kw)
    assert whole.offload_activations == "off" and not whole.offloads_activations
    assert RuntimeConfig(head_impl="auto", device="cpu").resolved_head_impl == "chunked"
