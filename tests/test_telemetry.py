"""Telemetry: trace summary arithmetic, host timeline, FLOP formula, event timer, how host threads wait."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from slidetune.models.load import skeleton
from slidetune.models.presets import preset_config
from slidetune.models.units import SplitModel
from slidetune.telemetry.flops import matmul_params, train_flops_per_token
from slidetune.telemetry.host_timeline import HostTimeline, summarize
from slidetune.telemetry.trace_summary import summarize_trace


def test_trace_summary_busy_and_overlap(tmp_path):
    ev = lambda cat, name, ts, dur: {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}  # noqa: E731
    events = [
        ev("user_annotation", "slidetune.step", 0, 100),
        ev("kernel", "gemm", 0, 40), ev("kernel", "gemm", 30, 20),      # union 0-50
        ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 40, 20),      # 40-60: 10 overlapped
        ev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 70, 10),      # 70-80: none
        ev("kernel", "late", 150, 10),                                   # outside the step window
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    s = summarize_trace(path)
    assert s["window_ms"] == pytest.approx(0.1)
    assert s["gpu_compute_busy_ms"] == pytest.approx(0.05)
    assert s["gpu_compute_fraction_of_step"] == pytest.approx(0.5)
    assert s["h2d_overlapped_with_compute_fraction"] == pytest.approx(0.5)
    assert s["d2h_overlapped_with_compute_fraction"] == pytest.approx(0.0)


def test_host_timeline_clips_to_window():
    tl = HostTimeline(enabled=True)
    tl.spans = [("host", "adamw", 0.0, 2.0), ("compute", "wait", 1.5, 3.0), ("host", "adamw", 5.0, 6.0)]
    s = summarize(tl.take(), 1.0, 4.0)
    assert s == {"compute.wait": pytest.approx(1.5), "host.adamw": pytest.approx(1.0)}
    assert tl.spans == []


def test_flops_formula_llama8b():
    split = SplitModel(skeleton(preset_config("llama-3.1-8b")))
    n = matmul_params(split)      # all but the input embedding lookup
    assert n == split.num_params() - split.embed_unit.numel - 4096   # final norm is not a matmul
    per_tok = train_flops_per_token(split, 1024)
    assert per_tok == pytest.approx(6 * n + 6 * 32 * 1024 * 4096)


def _tiny_split(**kw):
    """Hidden 64, 4 heads of 16 (2 KV heads), FFN 128, 3 layers, vocabulary 100, untied."""
    from slidetune.models.presets import tiny_config
    return SplitModel(skeleton(tiny_config("llama", vocab_size=100, **kw)))


def test_step_flops_by_hand_tiny_llama():
    """A step's FLOPs worked out by hand for a tiny Llama, 2 sequences of 8 tokens (T = 16).
    A layer's matrices: q 64x64 (4096), k and v 32x64 (2048 each), o 64x64 (4096), gate and up
    128x64 and down 64x128 (8192 each): 36864 parameters, forward 2 x 16 x 36864 = 1,179,648.
    Causal attention, a forward: QK^T is B x H x (S^2 / 2) x dh = 2 x 4 x 32 x 16 = 4096 MACs,
    PV as many: 2 x 8192 = 16384 FLOPs. Head: 2 x 16 x 100 x 64 = 204,800 forward."""
    from slidetune.engine.config import RuntimeConfig
    from slidetune.telemetry.flops import step_flops
    f = step_flops(_tiny_split(), batch=2, seq=8)
    assert f.tokens == 16
    assert f.layer_matmul == (1_179_648,) * 3 and f.layer_attention == (16_384,) * 3
    assert f.head_matmul == 204_800
    # slide recomputes every layer: 2 forwards + a backward of 2 forwards' worth = 4 x each layer's
    # matmuls, the head 3 x (no recompute: its gradients come with its forward, chunk by chunk)
    every = RuntimeConfig(mode="slide").recomputed_layers(3)
    assert every == {0, 1, 2}
    assert f.matmul(every) == 4 * 3 * 1_179_648 + 3 * 204_800 == 14_770_176
    # attention: forward, recompute, backward 2.5 forwards (flash's 5 matmuls against 2)
    assert f.attention(every) == 3 * 16_384 * 4.5 == 221_184
    # gpu mode recomputes nothing; ckpt's every:2 recomputes layers 0 and 2
    assert RuntimeConfig(mode="gpu").recomputed_layers(3) == set()
    none = set()
    assert f.matmul(none) == 3 * 3 * 1_179_648 + 3 * 204_800 == 11_231_232
    assert f.attention(none) == 3 * 16_384 * 3.5 == 172_032
    some = RuntimeConfig(mode="ckpt", recompute="every:2").recomputed_layers(3)
    assert some == {0, 2}
    assert f.total(some) == 11_231_232 + 2 * 1_179_648 + 172_032 + 2 * 16_384 == 13_795_328
    # the dict a floor records round-trips
    from slidetune.telemetry.flops import StepFlops
    assert StepFlops.from_dict(json.loads(json.dumps(f.as_dict()))) == f


def test_step_flops_tied_head_and_moe_experts_by_hand():
    """A tied head multiplies by the embedding [V, d] (same FLOPs as an lm_head); an MoE layer's
    expert banks count k of E experts a token: Qwen3-MoE, 8 experts, 2 a token, expert FFN 32.
    Per layer: q and o 64x64 (4096 each), k and v 32x64 (2048 each): 12288; router 8x64 = 512;
    gate_up [8, 64, 64] = 32768 x 2/8 = 8192, down [8, 64, 32] = 16384 x 2/8 = 4096: 25088
    parameters a token, 2 x 16 x 25088 = 802,816 FLOPs forward at T = 16."""
    from transformers import Qwen3MoeConfig

    from slidetune.telemetry.flops import step_flops
    tied = step_flops(_tiny_split(tied=True), batch=2, seq=8)
    assert tied.head_matmul == 204_800 and tied.layer_matmul == (1_179_648,) * 3
    moe = Qwen3MoeConfig(vocab_size=100, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)
    f = step_flops(SplitModel(skeleton(moe)), batch=2, seq=8)
    assert f.layer_matmul == (802_816,) * 2 and f.layer_attention == (16_384,) * 2


def test_overlap_report_intersects_host_and_gpu_spans():
    from slidetune.telemetry.host_timeline import overlap_report
    gpu = [(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]                 # union: 0-2, 3-4 -> 3 of 5 s
    host = [("host", "adamw", 1.0, 3.0), ("upload", "upload", 4.0, 5.0)]
    r = overlap_report(gpu, host, 0.0, 5.0)
    assert r["gpu_compute_fraction_of_step"] == pytest.approx(0.6)
    assert r["host.adamw_s"] == pytest.approx(2.0)
    assert r["host.adamw_overlapped_with_gpu_compute"] == pytest.approx(0.5)
    assert r["upload.upload_overlapped_with_gpu_compute"] == pytest.approx(0.0)


def test_t_interval():
    from slidetune.telemetry.stats import summarize, t_quantile_975
    assert t_quantile_975(4) == pytest.approx(2.7764)
    assert 2.0211 > t_quantile_975(50) > 2.0003
    assert t_quantile_975(10_000) == pytest.approx(1.96, abs=2e-3)
    s = summarize([1.0, 2.0, 3.0, 4.0, 5.0])
    assert s.mean == 3.0 and s.std == pytest.approx(1.5811, abs=1e-4)
    assert s.ci95 == pytest.approx(2.7764 * 1.5811 / 5 ** 0.5, rel=1e-4)


def test_stream_stats_and_lanes_from_a_trace(tmp_path):
    """A hand-made trace: compute stream 7 (GEMMs), upload stream 20 (H2D + a slow cast), D2H stream 21."""
    import json as _json

    from slidetune.telemetry.trace_summary import lanes, stream_stats

    def x(name, cat, ts, dur, stream=None):
        ev = {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}
        if stream is not None:
            ev["args"] = {"stream": stream}
        return ev

    events = [x("slidetune.step", "user_annotation", 0, 1000), x("slidetune.step", "user_annotation", 1000, 1000),
              x("gemm", "kernel", 1000, 300, 7), x("gemm", "kernel", 1350, 300, 7),
              x("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 1000, 100, 20),
              x("cast", "kernel", 1100, 400, 20),                       # starved: 400 us
              x("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", 1700, 200, 21),
              x("slidetune.adamw", "user_annotation", 1750, 150),
              x("slidetune.wait_grad_slot", "user_annotation", 1900, 50)]
    path = tmp_path / "trace.json"
    path.write_text(_json.dumps({"traceEvents": events}))
    st = stream_stats(path)
    assert st["compute_stream"] == 7
    assert st["streams"]["7"]["kernel_busy_ms"] == pytest.approx(0.6)
    assert st["streams"]["20"]["h2d_busy_ms"] == pytest.approx(0.1)
    assert st["side_kernels"]["count"] == 1 and st["side_kernels"]["mean_us"] == pytest.approx(400)
    ln = lanes(path, step_index=1, merge_gap_us=60)
    assert ln["step_ms"] == pytest.approx(1.0)
    L = ln["lanes"]
    assert L["compute stream 7: kernel"] == [(0.0, 0.65)]              # 50 us gap merged
    assert L["upload stream 20: h2d"] == [(0.0, 0.1)]
    assert L["download stream 21: d2h"] == [(0.7, 0.9)]
    assert L["cpu: AdamW"] == [(0.75, 0.9)] and L["cpu: compute wait_grad_slot"] == [(0.9, 0.95)]


def test_event_timer_cut_defers_resolution_and_keeps_step_boundaries():
    """measure() cuts the timer after every step and resolves after the loop (no GPU wait
    inside the timed loop): each cut holds exactly the spans of its step."""
    from slidetune.device import Device
    from slidetune.telemetry.events import EventTimer

    timer = EventTimer(Device.resolve("cpu"))
    cuts = []
    for step in range(3):
        for layer in range(step + 1):
            with timer.span("forward", layer):
                time.sleep(0.001)
        cuts.append(timer.cut())
    assert timer.cut() == []
    spans = [timer.resolve(c) for c in cuts]
    assert [len(s) for s in spans] == [1, 2, 3]
    assert [s.layer for s in spans[2]] == [0, 1, 2]
    assert all(s.ms >= 1.0 and s.end_s > s.start_s for ss in spans for s in ss)
    assert timer.collect() == []


def test_cuda_waits_option_is_validated():
    from slidetune.device import Device
    from slidetune.engine.config import RuntimeConfig

    with pytest.raises(ValueError, match="cuda_waits must be block or spin"):
        RuntimeConfig(cuda_waits="yield")
    with pytest.raises(ValueError, match="waits must be block or spin"):
        Device.resolve("cpu", waits="yield")
    cpu = Device.resolve("cpu", waits="spin")
    assert cpu.waits == "spin" and cpu.context_waits == "n/a"


@pytest.mark.parametrize("recompute,early_stop", [(False, True), (True, True), (True, False)])
def test_module_probe_times_every_layer_of_an_hf_model_without_changing_it(recompute, early_stop):
    """The techniques runs' per-layer record (telemetry.module_probe): hooks on an unmodified
    HF model give forward and backward spans for every decoder layer; head, head_backward,
    embed_backward and optimizer spans; memory points; and the same losses as the run without
    hooks. Under checkpointing with torch's early stop the re-run's end is invisible to hooks
    (no recompute span: it stays in backward); without early stop each layer gets one."""
    import torch.utils.checkpoint as ckpt
    from slidetune.bench.baselines.hf_train import run_technique
    spec = dict(name="probe", model="tiny-llama", num_layers=3, seq_len=32, batch_size=2, steps=3, warmup=1,
                lr=1e-3, lr_warmup_steps=0, data="synthetic", eval=False, device="cpu", precision="fp32",
                attention="sdpa", recompute=recompute)
    with ckpt.set_checkpoint_early_stop(early_stop):
        plain = run_technique(dict(spec, per_layer=False))
        timed = run_technique(dict(spec, per_layer=True))
    assert "steps" not in plain
    assert timed["loss"] == plain["loss"]                       # hooks observe, they change nothing
    assert len(timed["steps"]) == 3 and [s["warmup"] for s in timed["steps"]] == [True, False, False]
    for step in timed["steps"]:
        phases: dict[str, list[int]] = {}
        for phase, layer, ms in step["spans"]:
            assert ms >= 0.0
            phases.setdefault(phase, []).append(layer)
        assert sorted(phases["forward"]) == [0, 1, 2] and sorted(phases["backward"]) == [0, 1, 2]
        assert sorted(phases.get("recompute", [])) == ([0, 1, 2] if recompute and not early_stop else [])
        for one in ("head", "head_backward", "embed_backward", "optimizer"):
            assert phases[one] == [-1], one
        marks = [p[0] for p in step["memory"]]
        assert marks.count("forward") == 3 and marks.count("backward") == 3 and marks[-1] == "optimizer"
        assert all(p[4] > 0 for p in step["memory"])            # host RSS at every point


def test_request_blocking_sync_reports_instead_of_raising():
    """Without a driver (this CPU machine) the request says why it could not be granted;
    with one it reports what the primary context's scheduling flag now is."""
    from slidetune.device import request_blocking_sync
    got = request_blocking_sync(0)
    if torch.cuda.is_available():
        assert got == "blocking_sync" or got.startswith("spin (")
    else:
        assert got.startswith("spin (") and ("libcuda" in got or "cuInit" in got)


@pytest.mark.skipif(not Path("/dev/shm").is_dir() or not Path("/proc/self/status").exists(),
                    reason="needs /dev/shm and /proc (Linux)")
def test_host_rss_counts_the_shared_state_file_once_however_the_ranks_touched_it(tmp_path):
    """Two processes map one /dev/shm file (data parallel's host state) and each touches its half:
    each one's RssShmem is half the file, and the host's memory is both private parts plus the
    whole file once (not the larger half, what rank 0 alone would show)."""
    import mmap
    import subprocess
    import sys

    from slidetune.telemetry.machine import HostRss, _kib_fields
    size, half = 64 * 2**20, 32 * 2**20
    path = Path("/dev/shm") / f"slidetune_test_hostrss_{os.getpid()}"
    with open(path, "wb") as f:
        f.truncate(size)
    child = subprocess.Popen([sys.executable, "-c", (
        "import mmap, sys, time\n"
        f"f = open({str(path)!r}, 'r+b'); m = mmap.mmap(f.fileno(), {size})\n"
        f"m[{half}:{size}] = b'x' * {half}\n"
        "print('ready', flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    try:
        with open(path, "r+b") as f, mmap.mmap(f.fileno(), size) as m:
            m[:half] = b"y" * half                                   # this process: the first half
            assert child.stdout.readline().strip() == "ready"          # the child: the second half
            time.sleep(0.1)
            pids = [os.getpid(), child.pid]
            parts = [_kib_fields(f"/proc/{p}/status", ("VmRSS", "RssShmem", "RssFile")) for p in pids]
            # private memory, the mapped libraries' pages once (one page-cache copy for both)
            private = (sum(p["VmRSS"] - p["RssShmem"] - p["RssFile"] for p in parts)
                       + max(p["RssFile"] for p in parts))
            assert all(p["RssShmem"] >= half * 0.9 and p["RssShmem"] < size for p in parts), parts
            got = HostRss(pids, shared_bytes=size).bytes()
            # the processes' private memory moves a little between the two reads
            assert abs(got - (private + size)) < 8 * 2**20, (got, private, size)
            assert got > private + max(p["RssShmem"] for p in parts) + half * 0.9
            assert HostRss().bytes() > 0                                # one rank: this process's RSS
    finally:
        child.kill()
        child.wait()
        path.unlink()
