"""The auto settings choose by predicted time (issue 45, item 3): bench/step_model.py prices a
placement's floor terms at probed or nominal rates, engine/fit/search.choose_placement takes the
fastest placement that fits (engine/fit/choice.py), for plain and clipped runs alike, and `plan`
says what it predicted and what it rejected."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import pytest

from slidetune.bench.cards import CARDS
from slidetune.bench.hardware_floor import hardware_compute
from slidetune.bench.roofline import best_dram_gib_s
from slidetune.bench.step_model import (LAYER_OVER_HARDWARE, NOMINAL_RATES, StepModel, rates_for_card,
                                        rates_from_floor)
from slidetune.engine.config import RuntimeConfig
from slidetune.engine.fit import choose_auto_settings, choose_placement, estimate_memory
from slidetune.engine.fit.choice import TIE, kept_layers, settings_of
from slidetune.models.load import load_model
from slidetune.telemetry.flops import step_flops

GiB = 2**30
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
# the 24 GiB Qwen3-8B b64 x 1024 row on the H200 (2026-11-26): its floor probe, and its measured step
G24_ROW = RESULTS / "throughput" / "slideformer_shapes_h200" / "g24_qwen3_b16_b32_b64" / "throughput.json"
G24_B64_CLIP_STEP_S = 7.226


@pytest.fixture(scope="module")
def qwen():
    return load_model("qwen3-8b", with_tokenizer=False).split


def cuda_rt(**kw) -> RuntimeConfig:
    return RuntimeConfig(device="cuda", dtype="bf16", **kw)


def slow_host(rates=NOMINAL_RATES):
    """The nominal rates with the host's AdamW and DRAM at half speed (a desktop's host)."""
    return dataclasses.replace(rates, adamw={k: v / 2 if isinstance(v, float) else v for k, v in rates.adamw.items()})


def test_the_model_prices_each_layer_kind_from_the_flops_and_its_measured_overhead(qwen):
    model = StepModel(qwen, batch_size=64, seq_len=1024)
    L = qwen.num_layers
    forward, backward = NOMINAL_RATES.sdpa_at(1024)
    hw = hardware_compute({"gemm_forward_tflops": NOMINAL_RATES.gemm_forward_tflops,
                           "gemm_backward_tflops": NOMINAL_RATES.gemm_backward_tflops,
                           "sdpa_forward_tflops": forward, "sdpa_backward_tflops": backward,
                           "flops": step_flops(qwen, 64, 1024).as_dict()}, range(L))
    for kind in ("off", "on"):
        comp = model.compute(kind)
        layers = L * (comp["layer_forward_s"] + comp["layer_recompute_backward_s"])
        assert layers == pytest.approx((hw["compute_s"] - hw["head_s"]) * LAYER_OVER_HARDWARE[kind])
        assert comp["compute_s"] == pytest.approx(layers + hw["head_s"])
    # SDPA's rate by length: 1K takes the 1,024 row, 40K the 16,384 one, below them all the first
    assert NOMINAL_RATES.sdpa_at(40960) == (583.0, 523.0) and NOMINAL_RATES.sdpa_at(512) == (427.0, 291.0)
    # two micro-batches of 32 rows: the same FLOPs as one of 64
    assert StepModel(qwen, batch_size=32, seq_len=1024, grad_accum=2).compute("on")["compute_s"] == \
        pytest.approx(model.compute("on")["compute_s"])


def test_offloaded_checkpoints_cross_pcie_both_ways_and_the_host_dram(qwen):
    model = StepModel(qwen, batch_size=64, seq_len=1024)
    kw = dict(batch_size=64, seq_len=1024, max_grad_norm=1.0, padded=False)
    rt = cuda_rt(offload_activations="on", lean_layer="on", cache_units=3, resident_layers=1, vocab_update="host",
                 device_layers=0, grad_slot_dtype="compute")
    kept = dataclasses.replace(rt, gpu_checkpoints=18)
    none = dataclasses.replace(rt, gpu_checkpoints=0)
    a = model.predict(kept, estimate_memory(qwen, kept, **kw).plan).terms
    b = model.predict(none, estimate_memory(qwen, none, **kw).plan).terms
    ckpt = 18 * 64 * 1024 * qwen.config.hidden_size * 2           # [B, S, d] in BF16, 18 more offloaded
    assert b["h2d_s"] - a["h2d_s"] == pytest.approx(ckpt / (NOMINAL_RATES.copy["h2d_gib_s"] * GiB))
    assert b["d2h_s"] - a["d2h_s"] == pytest.approx(ckpt / (NOMINAL_RATES.copy["d2h_gib_s"] * GiB))
    best = best_dram_gib_s(NOMINAL_RATES.adamw)            # the best DRAM rate the probes saw
    assert b["host_dram_s"] - a["host_dram_s"] == pytest.approx(2 * ckpt / (best * GiB))
    assert a["compute_s"] == b["compute_s"] and a["clip_sweep_s"] == b["clip_sweep_s"]


def test_the_measured_24g_b64_row_is_predicted_compute_bound_below_its_step(qwen):
    """The placement the H200 ran (the lean layer, 18 checkpoints on the GPU, one resident layer,
    clipped) at the nominal rates (that row's own probes): bound by the lean layer's compute, at
    most 10% under the measured 7.226 s."""
    choice = choose_placement(qwen, cuda_rt(), batch_size=64, seq_len=1024, max_grad_norm=1.0, padded=False,
                              gpu_free_bytes=24 * GiB, host_available_bytes=123 * GiB)
    assert (settings_of(choice.pick)["gpu_checkpoints"], choice.pick.prediction.bound) == (18, "compute_s")
    assert 0.9 * G24_B64_CLIP_STEP_S < choice.pick.seconds < G24_B64_CLIP_STEP_S


def test_a_floor_probe_gives_its_rates_and_a_card_its_link_and_bf16_rate(qwen):
    fl = {**json.loads(G24_ROW.read_text())["floors"]["qwen3-8b/b64/s1024/lean"], "status": "ok"}
    rates = rates_from_floor(fl)
    assert rates.copy == fl["copy"] and rates.sdpa_by_seq is None and rates.label == "probed here"
    assert rates.gemm_forward_tflops == fl["hardware"]["gemm_forward_tflops"]
    # the probe's lean layer, timed at this workload, in place of the FLOPs
    model = StepModel(qwen, batch_size=64, seq_len=1024, rates=rates)
    assert model.compute("on")["compute_s"] == pytest.approx(fl["compute"]["compute_s"])
    # that probe timed the lean layer only: HF's is priced from it by the layers' measured ratio
    lean, hf = model.compute("on"), model.compute("off")
    assert hf["layer_recompute_backward_s"] == pytest.approx(
        lean["layer_recompute_backward_s"] * LAYER_OVER_HARDWARE["off"] / LAYER_OVER_HARDWARE["on"])
    other = StepModel(qwen, batch_size=32, seq_len=1024, rates=rates)     # another workload: the FLOPs
    assert other.compute("on")["compute_s"] < 0.6 * fl["compute"]["compute_s"]
    card = rates_for_card(CARDS["rtx4090"], rates)
    assert card.copy["h2d_gib_s"] == pytest.approx(25e9 / GiB)
    gemm = (rates.gemm_forward_tflops + rates.gemm_backward_tflops) / 2
    scaled = StepModel(qwen, batch_size=64, seq_len=1024, rates=card).compute("on")["compute_s"]
    assert scaled == pytest.approx(fl["compute"]["compute_s"] * gemm / 165.2)
    # no GPU here: the host's probes, the GPU's rates nominal
    host = rates_from_floor({"status": "ok", "partial": True, "adamw": {"adamw_fp32_grad_params_per_s": 1e9}})
    assert host.adamw == {"adamw_fp32_grad_params_per_s": 1e9} and host.copy == NOMINAL_RATES.copy
    assert rates_from_floor({"status": "failed"}) is NOMINAL_RATES


@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
def test_the_auto_takes_the_faster_placement_plain_and_clipped_alike(qwen, max_grad_norm):
    """Qwen3-8B b16 x 1024 on an 80 GiB GPU, the host's AdamW and DRAM at half the nominal rates: the
    search's own order (every checkpoint on the GPU, then resident and device layers) is predicted
    more than TIE slower than offloading checkpoints for more device layers, and the auto takes the
    faster, under either schedule; it keeps as many layers on the GPU between steps. HF's layer eager:
    compiled, its smaller working set leaves the order's own choice more device layers, within TIE."""
    kw = dict(batch_size=16, seq_len=1024, max_grad_norm=max_grad_norm, padded=False,
              gpu_free_bytes=80 * GiB, host_available_bytes=125 * GiB, rates=slow_host())
    choice = choose_placement(qwen, cuda_rt(compile_layers="off"), **kw)
    first = next(c for c in choice.candidates if c.fits and not c.disk)        # the order's own choice
    assert settings_of(first)["offload_activations"] == "off" and first is not choice.pick
    assert choice.pick.fits and choice.pick.seconds * (1 + TIE) < first.seconds
    assert settings_of(choice.pick)["offload_activations"] == "on"
    assert settings_of(choice.pick)["device_layers"] > settings_of(first)["device_layers"]
    assert kept_layers(choice.pick) >= kept_layers(first)
    # the first, in the search's order, within TIE of the fastest that keeps as many layers on the GPU
    eligible = [c for c in choice.candidates if c.fits and not c.disk and kept_layers(c) >= kept_layers(first)]
    best = min(c.seconds for c in eligible)
    assert choice.pick is next(c for c in eligible if c.seconds <= best * (1 + TIE))
    # choose_auto_settings resolves the same placement (the held buffers, host RAM only, beside it)
    resolved = choose_auto_settings(qwen, cuda_rt(compile_layers="off"), **kw)
    plan = estimate_memory(qwen, resolved, **{k: kw[k] for k in ("batch_size", "seq_len", "max_grad_norm",
                                                                  "padded")}).plan
    assert [u[:4] for u in plan.to_dict()["units"]] == [u[:4] for u in choice.pick.plan.to_dict()["units"]]
    assert plan.gpu_checkpoints == choice.pick.plan.gpu_checkpoints
    # at the nominal rates the unclipped step is compute-bound: the order's choice stands
    nominal = choose_placement(qwen, cuda_rt(compile_layers="off"), **{**kw, "rates": None})
    if max_grad_norm == 0.0:
        assert nominal.pick is next(c for c in nominal.candidates if c.fits and not c.disk)


def test_the_24_gib_b64_rows_take_hf_compiled_layer_where_it_fits(qwen):
    """The 24 GiB b64 rows (issue 45's measurement). Unclipped, HF's compiled layer fits with every
    checkpoint offloaded and 7 resident layers, and is taken, predicted ~10% faster than the lean
    layer with 26 resident (measured on the H200 2026-11-29: 6.72 against 7.26 s a step,
    benchmarks/results/throughput/b64_plain_hf_compiled_24g_h200/); eager, it would not fit. Clipped,
    HF's offloaded checkpoints beside the held gradients leave the host short: only the lean layer
    with 18 checkpoints on the GPU fits, the placement the H200 ran."""
    kw = dict(batch_size=64, seq_len=1024, padded=False, gpu_free_bytes=24 * GiB, host_available_bytes=123 * GiB)
    plain = choose_placement(qwen, cuda_rt(), max_grad_norm=0.0, **kw)
    assert plain.pick.config.layer.lean_layer == "off"
    assert (settings_of(plain.pick)["resident_layers"], settings_of(plain.pick)["gpu_checkpoints"]) == (7, 0)
    lean = choose_placement(qwen, cuda_rt(lean_layer="on"), max_grad_norm=0.0, **kw)
    assert plain.pick.seconds * 1.08 < lean.pick.seconds
    eager = choose_placement(qwen, cuda_rt(compile_layers="off"), max_grad_norm=0.0, **kw)
    assert eager.pick.config.layer.lean_layer == "on"
    clipped = choose_placement(qwen, cuda_rt(), max_grad_norm=1.0, **kw)
    assert (settings_of(clipped.pick)["resident_layers"], settings_of(clipped.pick)["gpu_checkpoints"]) == (1, 18)
    assert clipped.pick.config.layer.lean_layer == "on"
    assert all(not c.fits and why.startswith("does not fit") for c, why in clipped.rejected())
    hf = [c for c in clipped.candidates if c.config.layer.lean_layer == "off"]
    assert hf and all(c.seconds < clipped.pick.seconds / 1.08 for c in hf)       # faster, but no room


def test_plan_says_the_predicted_step_in_one_line_and_the_table_lists_the_rejected(qwen):
    out = io.StringIO()
    args = ["plan", "--model", "qwen3-8b", "--batch-size", "64", "--seq-len", "1024", "--gpu-free-gib", "24",
            "--host-gib", "123", "--no-limits"]
    from slidetune.cli import main
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(args) == 0
    lines = out.getvalue().splitlines()
    predicted = [line for line in lines if line.startswith("predicted step")]
    assert len(predicted) == 1 and "bound by compute_s; rates: nominal" in predicted[0]
    assert lines.index(predicted[0]) == next(i for i, line in enumerate(lines) if line.startswith("fits")) + 1
    choice = choose_placement(qwen, cuda_rt(), batch_size=64, seq_len=1024, max_grad_norm=1.0,
                              gpu_free_bytes=int(24 * GiB), host_available_bytes=123 * GiB)
    table = choice.table_lines()
    assert table[0].startswith(f"predicted step {choice.pick.seconds:.3f} s (bound by compute_s)")
    assert any("lean_layer=off" in line and "does not fit: GPU memory" in line for line in table)
    assert all(" / " in line for line in table[2:])


def test_the_choice_is_quick_and_deterministic(qwen):
    import time
    kw = dict(batch_size=16, seq_len=1024, max_grad_norm=1.0, gpu_free_bytes=80 * GiB,
              host_available_bytes=125 * GiB)
    t = time.perf_counter()
    first = choose_auto_settings(qwen, cuda_rt(), **kw)
    assert time.perf_counter() - t < 2.0          # well under a second on an idle core
    assert choose_auto_settings(qwen, cuda_rt(), **kw) == first


@pytest.mark.slow
def test_plan_terms_prints_the_rejected_placements_with_their_predicted_steps():
    """`plan --terms` on the CPU machine for an 80 GiB GPU: it probes the host first (no GPU here: the
    GPU's rates nominal), then prints the chosen placement's predicted step and each alternative's:
    what differs, its predicted step, why it was not taken."""
    import re
    from slidetune.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(["plan", "--model", "qwen3-8b", "--batch-size", "16", "--seq-len", "1024", "--gpu-free-gib", "80",
                     "--host-gib", "125", "--no-limits", "--terms"]) == 0
    text = out.getvalue()
    assert text.index("probing this machine") < text.index("resolved on")
    assert "rates: host probed here, GPU nominal" in text
    table = text[text.index("the auto settings' choice by predicted step"):].splitlines()
    assert re.match(r"predicted step [\d.]+ s \(bound by \w+\), rates probed here: the host's AdamW", table[1])
    rows = [line for line in table[3:] if re.match(r"\s+[\d.]+s\s+\w+\s", line)]
    assert len(rows) >= 2 and all(" / " in row for row in rows)
    # the alternatives differ from the chosen in where the checkpoints live (which way depends on this
    # machine's probed host rates: the chosen keeps them all, or offloads some)
    assert any("offload_activations=" in row for row in rows)
