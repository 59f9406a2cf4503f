"""techniques / throughput / roofline scenarios at --smoke size, the largest-batch search, OOM parsing."""
import argparse
import json
import math

import pytest
import torch

from slidetune.bench.baselines.proc import parse_oom
from slidetune.bench.output import read_csv, read_csv_machine
from slidetune.bench.scenarios.techniques import find_max_batch
from slidetune.ops.attention import band_mask
from test_bench_scenarios import report_again


def _fake(limit):
    calls = []

    def probe(b):
        calls.append(b)
        return b <= limit
    return probe, calls


@pytest.mark.parametrize("limit", [1, 2, 3, 5, 7, 8, 100, 463, 1135, 2038])
def test_max_batch_doubling_then_bisection(limit):
    probe, calls = _fake(limit)
    best, hist = find_max_batch(probe, cap=4096)
    assert best == limit
    assert [b for b, _ in hist] == calls
    assert len(set(calls)) == len(calls)                       # never probes a size twice
    # doubling phase: 1, 2, 4, ... up to the first failure
    k = next(i for i, b in enumerate(calls) if b > limit)
    assert calls[:k + 1] == [2 ** i for i in range(k + 1)]
    assert len(calls) <= 2 * math.ceil(math.log2(limit + 1)) + 2


def test_max_batch_cap_zero_and_known():
    probe, calls = _fake(10_000)
    assert find_max_batch(probe, cap=48)[0] == 48 and calls[-1] == 48
    probe, calls = _fake(0)
    assert find_max_batch(probe, cap=64) == (0, [(1, False)])
    probe, calls = _fake(6)
    best, _ = find_max_batch(probe, cap=64, known={1: True, 2: True, 4: True})
    assert best == 6 and 1 not in calls and 2 not in calls and calls[0] == 8
    # a known failure ends the doubling: no probe at or past it
    probe, calls = _fake(9)
    assert find_max_batch(probe, start=8, cap=64, known={12: False})[0] == 9 and max(calls) < 12
    # starting above the limit halves down first
    probe, calls = _fake(5)
    assert find_max_batch(probe, start=16, cap=64)[0] == 5


@pytest.mark.parametrize("limit", [100, 463, 1135, 2038])
def test_max_batch_tolerance_stops_the_bisection_early(limit):
    """rel_tol=0.05: the answer trains, is within 5% of the true largest batch, in fewer probes;
    starting from a known success skips the small sizes."""
    probe, calls = _fake(limit)
    exact = len(find_max_batch(probe, cap=4096)[1])
    probe, calls = _fake(limit)
    best, hist = find_max_batch(probe, cap=4096, rel_tol=0.05, start=64, known={64: True})
    assert best <= limit and limit - best <= max(1, 0.05 * best)
    assert all(b >= 64 for b, _ in hist) and len(hist) < exact


def test_parse_oom_message():
    msg = ("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity of 79.11 GiB of which "
           "1.2 GiB is free.")
    assert parse_oom(msg) == {"requested_gib": 2.5, "capacity_gib": 79.11}
    assert parse_oom("Tried to allocate 512.00 MiB")["requested_gib"] == 0.5
    assert parse_oom("something else") == {}


def test_local_attention_mask_banded():
    m = band_mask(64, 8)
    i, j = torch.meshgrid(torch.arange(64), torch.arange(64), indexing="ij")
    assert torch.equal(m, (j <= i) & (j > i - 8))
    assert int(m.sum()) == 8 * 64 - 8 * 7 // 2


def _args(module, argv):
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return p.parse_args(argv)


def _finite_csv(path, numeric):
    assert read_csv_machine(path)["torch"]                # machine details in every CSV
    rows = read_csv(path)
    assert rows
    for r in rows:
        for k in numeric:
            if r.get(k) not in (None, ""):
                assert math.isfinite(float(r[k])), (k, r)
    return rows


def _pngs(out, names):
    for n in names:
        assert (out / n).stat().st_size > 1000, n


@pytest.mark.slow
def test_techniques_smoke(tmp_path):
    from slidetune.bench.scenarios import techniques
    out = techniques.run(_args(techniques, ["--smoke", "--out", str(tmp_path),
                                            "--techniques", "fp32,local-w16,recompute,slide"]))
    rows = _finite_csv(out / "techniques.csv", ["step_s_mean", "tokens_per_s", "peak_gib", "perplexity"])
    assert {(r["technique"], r["regime"]) for r in rows} >= {("fp32", "same"), ("slide", "max")}
    assert all(r["status"] == "ok" for r in rows)
    assert all(float(r["perplexity"]) > 1 for r in rows)
    probes = read_csv(out / "probes.csv")
    assert probes and all(int(p["batch_size"]) <= 2 for p in probes)      # smoke cap
    data = json.loads((out / "techniques.json").read_text())
    assert data["machine"]["torch"] and data["rows"]
    _pngs(out, ["peak_memory.png", "throughput.png", "max_batch.png", "perplexity.png", "pareto.png"])
    assert "Memory-optimization" in (out / "report.md").read_text()
    # per-layer record of the same-batch runs: HF hooks (fp32, local, recompute) and slide's own timer
    summary = {r["config"]: r for r in read_csv(out / "per_run" / "summary.csv")}
    assert set(summary) == {"fp32", "local-w16", "recompute", "slide"}
    layers = read_csv(out / "per_run" / "layers.csv")
    for name in summary:
        got = {r["phase"] for r in layers if r["config"] == name}
        assert {"forward", "backward"} <= got, (name, got)
        assert all(math.isfinite(float(r["mean_ms"])) for r in layers if r["config"] == name)
    assert "recompute" in {r["phase"] for r in layers if r["config"] == "slide"}
    _pngs(out / "per_run", ["time_breakdown.png", "per_layer_times.png", "memory_timeline.png", "step_times.png"])
    assert "per_run/per_layer_times.png" in (out / "report.md").read_text()
    report_again(out, "Memory-optimization", "per_run/per_layer_times.png")


@pytest.mark.slow
def test_throughput_profile_adds_the_profiled_table_and_gantt_charts(tmp_path):
    """--profile: each slide run of the sweep is profiled after its measured steps; the report
    says where the step goes between streams and threads, with a Gantt chart per run."""
    from slidetune.bench.scenarios import throughput
    out = throughput.run(_args(throughput, ["--smoke", "--out", str(tmp_path), "--models", "tiny-llama",
                                            "--systems", "slide", "--no-floor", "--profile"]))
    (row,) = read_csv(out / "per_run" / "profile.csv")
    assert row["config"] == "slide-tiny-llama-b2-s32"
    assert 0 <= float(row["gpu_compute_fraction"]) <= 1.0 and float(row["host.adamw_s"]) > 0
    assert "## Profiled (torch.profiler" in (out / "report.md").read_text()
    _pngs(out / "per_run", ["pipeline_slide-tiny-llama-b2-s32.png"])


def test_throughput_trains_a_preference_objective(tmp_path):
    """`bench throughput --objective dpo`: the slide row trains micro-batches of whole pairs through
    the two-pass head (its recipe named), measured like any other, with the reference pass a DPO run
    makes before training beside it (reference_s, per step's pairs: a forward alone, below the step);
    an odd micro-batch is refused."""
    from slidetune.bench.scenarios import throughput
    out = throughput.run(_args(throughput, ["--smoke", "--out", str(tmp_path), "--models", "tiny-llama",
                                            "--systems", "slide", "--recipes", "clip", "--objective", "dpo"]))
    (row,) = _finite_csv(out / "throughput.csv", ["step_s_mean", "tokens_per_s", "reference_s",
                                                  "reference_tokens_per_s"])
    assert row["status"] == "ok" and row["recipe"] == "clip+dpo" and float(row["tokens_per_s"]) > 0
    assert 0 < float(row["reference_s"]) < float(row["step_s_mean"])
    assert float(row["reference_tokens_per_s"]) > float(row["tokens_per_s"])
    run = json.loads((out / "throughput.json").read_text())["runs"][0]
    spec = run["spec"]
    assert spec["objective"] == "dpo" and spec["max_grad_norm"] == 1.0
    assert len(run["reference_s_repeats"]) == 3 and all(t > 0 for t in run["reference_s_repeats"])
    report = (out / "report.md").read_text()
    assert "| reference_s |" in report and "reference_s: the reference pass" in report
    with pytest.raises(ValueError, match="whole pairs"):
        throughput.run(_args(throughput, ["--smoke", "--out", str(tmp_path / "odd"), "--models", "tiny-llama",
                                          "--systems", "slide", "--recipes", "clip+accum2", "--objective", "dpo"]))


@pytest.mark.slow
def test_throughput_smoke(tmp_path):
    from slidetune.bench.scenarios import throughput
    out = throughput.run(_args(throughput, ["--smoke", "--out", str(tmp_path), "--models", "tiny-llama"]))
    rows = _finite_csv(out / "throughput.csv", ["step_s_mean", "tokens_per_s", "model_tflops", "step_over_floor",
                                                "floor_s"])
    by = {r["system"]: r for r in rows}
    assert by["slide"]["status"] == "ok" and by["gpu-ckpt"]["status"] == "ok"
    assert float(by["slide"]["tokens_per_s"]) > 0 and float(by["slide"]["step_over_floor"]) > 0
    assert by["fsdp2"]["status"] == "needs CUDA"
    # the CPU's floor is partial (no GPU rates): the hardware floor stays empty, the column there
    assert by["slide"]["hw_floor_s"] == by["slide"]["step_over_hw_floor"] == ""
    assert by["deepspeed"]["status"] in ("not installed", "needs CUDA")
    # SFT has no reference pass: the columns are there, empty, and the report leaves them out
    assert by["slide"]["reference_s"] == by["slide"]["reference_tokens_per_s"] == ""
    assert "reference_s" not in (out / "report.md").read_text()
    json.loads((out / "throughput.json").read_text())
    _pngs(out, ["tokens_per_s.png", "model_tflops.png", "gpu_peak.png", "step_over_floor.png"])
    assert "6 N_matmul" in (out / "report.md").read_text()
    # where the slide step goes: the host timeline per step, inside the interval-timed step
    slide = by["slide"]
    assert 0 < float(slide["host_adamw_s"]) <= float(slide["step_s_mean"]) * 1.05
    assert 0 < float(slide["call_s_mean"]) <= float(slide["step_s_mean"]) * 1.05
    assert "Where a slide step goes" in (out / "report.md").read_text()
    # the scenarios' common tables and plots, per run, in per_run/
    summary = {r["config"]: r for r in read_csv(out / "per_run" / "summary.csv")}
    for system in ("slide", "gpu-ckpt"):
        row = summary[f"{system}-tiny-llama-b2-s32"]
        assert row["status"] == "ok"
        for k in ("step_s_mean", "t_forward_s", "t_backward_s", "t_recompute_s", "t_optimizer_s"):
            assert math.isfinite(float(row[k])) and float(row[k]) >= 0, (system, k)
    assert float(summary["slide-tiny-llama-b2-s32"]["t_transfer_s"]) > 0       # host timeline copies
    layers = read_csv(out / "per_run" / "layers.csv")
    assert {r["phase"] for r in layers} >= {"forward", "backward", "recompute"}
    assert read_csv(out / "per_run" / "memory_timeline.csv")
    _pngs(out / "per_run", ["time_breakdown.png", "peak_memory.png", "memory_timeline.png", "per_layer_times.png",
                            "step_times.png", "pareto.png"])
    assert "per_run/time_breakdown.png" in (out / "report.md").read_text()
    report_again(out, "6 N_matmul", "Where a slide step goes", "per_run/time_breakdown.png")


@pytest.mark.slow
def test_roofline_smoke(tmp_path):
    from slidetune.bench.scenarios import roofline
    out = roofline.run(_args(roofline, ["--smoke", "--out", str(tmp_path)]))
    rows = _finite_csv(out / "roofline.csv", ["seconds"])
    by = {r["term"]: r for r in rows}
    assert float(by["adamw_s"]["seconds"]) > 0 and float(by["floor_s"]["seconds"]) > 0
    if not torch.cuda.is_available():
        assert by["compute_s"]["note"] == "needs CUDA"
    data = json.loads((out / "roofline.json").read_text())
    assert data["status"] == "ok" and data["adamw"]["adamw_params_per_s"] > 0
    if not torch.cuda.is_available():
        # no GPU rates to price the FLOPs at: no hardware floor, rather than a partial one
        assert "hardware" not in data and "hw_floor_s" not in by
    _pngs(out, ["roofline.png"])
    # `slidetune report` reads a roofline's directory too: the same table and plot from roofline.json
    written = {name: (out / name).read_bytes() for name in ("report.md", "roofline.csv")}
    (out / "roofline.csv").unlink()
    (out / "roofline.png").unlink()
    assert report_again(out, "# Roofline: tiny-qwen3, batch 2, seq 32", "| floor_s |") == written["report.md"].decode()
    assert (out / "roofline.csv").read_bytes() == written["roofline.csv"]
    _pngs(out, ["roofline.png"])


@pytest.mark.gpu
def test_probe_hardware_rates_on_the_gpu():
    """The GEMM and SDPA probes at a tiny model's shapes give finite rates, and the hardware compute
    is the step's FLOPs at them (every rate positive, the head a matmul)."""
    from slidetune.bench.hardware_floor import hardware_compute, probe_gemm, probe_hardware
    from slidetune.models.load import load_model
    split = load_model("tiny-llama", with_tokenizer=False).split
    hw = probe_hardware(split, 2, 128)
    for k in ("gemm_forward_tflops", "gemm_backward_tflops", "sdpa_forward_tflops", "sdpa_backward_tflops"):
        assert 0 < hw[k] < 1e4, k
    assert {(g["in"], g["out"]) for g in hw["gemm_shapes"]} == {(64, 64), (64, 32), (64, 128), (128, 64)}
    priced = hardware_compute(hw, range(split.num_layers))
    assert priced["compute_s"] > priced["head_s"] > 0
    assert probe_gemm([{"rows": 1024, "in": 1024, "out": 1024}])["gemm_tflops"] > 0


@pytest.mark.slow
def test_fsdp2_one_rank_gloo_cpu():
    """FSDP2's fully_shard on a one-rank gloo group trains on the CPU (no offload policy: nothing to
    offload to); the CUDA path with CPUOffloadPolicy + MixedPrecisionPolicy needs the GPU run."""
    from slidetune.bench.baselines.proc import run_worker
    r = run_worker("slidetune.bench.baselines.fsdp2", dict(model="tiny-llama", num_layers=2, seq_len=16, batch_size=2,
                                                             steps=2, warmup=1, device="cpu", offload=False),
                   timeout_s=120)
    if r.get("status") != "ok" and "gloo" in str(r.get("error", "")).lower():
        pytest.skip(f"fully_shard on CPU/gloo unsupported here: {r.get('error')}")
    assert r["status"] == "ok", r.get("traceback") or r.get("error")
    assert math.isfinite(r["final_loss"]) and r["tokens_per_s"] > 0


@pytest.mark.slow
def test_throughput_max_seq_and_max_batch_run_at_the_planned_limits(tmp_path, monkeypatch):
    """--max-seq / --max-batch (no --batches: those workloads alone): slide runs at batch 1 and the
    longest sequence, and at the largest batch at --seq-lens, that engine.limits finds on the budget a
    run reads here (a 1 GiB host, SLIDETUNE_HOST_MEMORY_BYTES, which the runs' own fit check reads too);
    each row says it was chosen so, and each run passes its fit check and trains."""
    from slidetune.bench.scenarios import throughput, throughput_report
    from slidetune.engine.config import RuntimeConfig
    from slidetune.engine.fit import ENV_HOST_MEMORY
    from slidetune.engine.limits import MachineBudget, Recipe, find_limits
    from slidetune.models.load import load_model
    monkeypatch.setenv(ENV_HOST_MEMORY, "1G")
    out = throughput.run(_args(throughput, ["--out", str(tmp_path), "--models", "tiny-llama", "--device", "cpu",
                                            "--systems", "slide", "--no-floor", "--steps", "1", "--warmup", "0",
                                            "--seq-lens", "32", "--max-seq", "--max-batch"]))
    split = load_model("tiny-llama", with_tokenizer=False).split
    rt = RuntimeConfig(mode="slide", device="cpu", dtype="fp32", head_impl="chunked")
    (planned,) = find_limits(split, rt, MachineBudget(None, 2**30), seq_len=32, padded=False,
                             recipes=(Recipe("clip", 1.0),)).recipes
    assert 64 <= planned.longest_seq.value < 2048 and 2 <= planned.largest_batch.value < 4096   # host RAM binds
    rows = read_csv(out / "throughput.csv")
    assert [(r["batch_size"], r["seq_len"], r["status"]) for r in rows] == \
        [("1", str(planned.longest_seq.value), "ok"), (str(planned.largest_batch.value), "32", "ok")]
    assert rows[0]["chosen_by"].startswith("longest sequence at batch 1 (plan: host 1.0 GiB")
    assert rows[1]["chosen_by"].startswith("largest batch at seq 32 (plan: host 1.0 GiB")
    assert all(float(r["tokens_per_s"]) > 0 for r in rows)
    limits = json.loads((out / "throughput.json").read_text())["limits"]["tiny-llama"]
    assert [f["limit"]["value"] for f in limits] == [planned.longest_seq.value, planned.largest_batch.value]
    assert limits[0]["limit"]["over"]["binds"] == ["host RAM"]
    report = (out / "report.md").read_text()
    assert "## At the planned limits (--max-seq, --max-batch)" in report
    assert f"| 1 x {planned.longest_seq.value} |" in report and f"{planned.longest_seq.value + 128}: host RAM" in report
    # `slidetune report` rewrites it from throughput.json: the rows keep how they were chosen
    throughput_report.rewrite_report(out)
    assert "## At the planned limits" in (out / "report.md").read_text()
    assert read_csv(out / "throughput.csv")[0]["chosen_by"] == rows[0]["chosen_by"]


def test_longest_sequence_search_reports_the_largest_that_trains(tmp_path, monkeypatch):
    """--max-seq-search: doubling then bisection over multiples of the granule, each probe a run;
    here a stand-in run "fits" up to 100 tokens, so the answer is 96 (granule 16)."""
    from slidetune.bench.scenarios import throughput
    seen = []

    profiled = []

    def fake_run(system, model, layers, batch, seq, steps, warmup, dev, cuda, args, profile=False, recipe=None,
                 ranks=1, variant=None):
        seen.append((system, batch, seq))
        profiled.append((batch, profile))
        fits = seq <= 100
        runtime = {"mode": "slide", "offload_activations": True, "gpu_checkpoints": 3, "cache_units": 3,
                   "vocab_update": "device", "device_layers": 0}
        return {"status": "ok" if fits else "oom", "step_s_mean": 0.1 if fits else None,
                "tokens_per_s": seq / 0.1 if fits else None, "runtime": runtime,
                "error": None if fits else "CUDA out of memory"}

    monkeypatch.setattr(throughput, "_run_system", fake_run)
    out = throughput.run(_args(throughput, ["--smoke", "--out", str(tmp_path), "--models", "tiny-llama",
                                            "--systems", "slide", "--no-floor", "--max-seq-search", "--profile"]))
    # --profile profiles the sweep's runs (batch 2 here), never the search's one-step probes
    assert {p for b, p in profiled if b == 2} == {True} and {p for b, p in profiled if b == 1} == {False}
    probes = [s for s in seen if s[1] == 1]
    assert all(system == "slide" for system, _, _ in probes)
    assert [s for _, _, s in probes] == [32, 64, 128, 96, 112]      # doubling from 32, then bisection
    (row,) = read_csv(out / "max_seq.csv")
    assert row["model"] == "tiny-llama" and int(row["max_seq"]) == 96
    report = (out / "report.md").read_text()
    assert "## Longest trainable sequence" in report
    # the longest probe's step, tokens/s and the placement its auto settings resolved to
    (line,) = [x for x in report.splitlines() if x.startswith("| tiny-llama | 96 |")]
    assert "0.1 s, 960," in line and "cache_units=3 resident_layers=0 vocab_update=device device_layers=0 gpu_checkpoints=3" in line
    # every probe is logged as it ends, so a search cut short keeps what it found
    logged = [json.loads(line) for line in (out / "max_seq_probes.jsonl").read_text().splitlines()]
    assert [(r["seq_len"], r["status"]) for r in logged if r["model"] == "tiny-llama"] == \
        [(32, "ok"), (64, "ok"), (128, "oom"), (96, "ok"), (112, "oom")]
    # a search cut short resumes from its log: the logged probes are not run again
    partial = tmp_path / "partial.jsonl"
    partial.write_text("\n".join(json.dumps(r) for r in logged[:3]) + "\n")
    seen.clear()
    out2 = throughput.run(_args(throughput, ["--smoke", "--out", str(tmp_path / "again"), "--models", "tiny-llama",
                                             "--systems", "slide", "--no-floor", "--max-seq-search",
                                             "--max-seq-known", str(partial)]))
    assert [s for _, b, s in seen if b == 1] == [96, 112]
    (row,) = read_csv(out2 / "max_seq.csv")
    assert int(row["max_seq"]) == 96
    assert "64: yes (earlier call)" in (out2 / "report.md").read_text()
    relogged = [json.loads(line) for line in (out2 / "max_seq_probes.jsonl").read_text().splitlines()]
    assert [(r["seq_len"], r.get("reused", False)) for r in relogged] == \
        [(32, True), (64, True), (128, True), (96, False), (112, False)]


def test_longest_sequence_search_counts_the_sweeps_own_batch_1_rows(tmp_path, monkeypatch):
    """A batch-1 slide row of the same call at a length the search would probe is not run again:
    with a row at 128 that trains and a cap of 128, the search runs no probe at all."""
    from slidetune.bench.scenarios import throughput
    seen = []

    def fake_run(system, model, layers, batch, seq, steps, warmup, dev, cuda, args, profile=False, recipe=None,
                 ranks=1, variant=None):
        seen.append((batch, seq, steps))
        return {"status": "ok", "step_s_mean": 2.0, "tokens_per_s": seq / 2.0,
                "runtime": {"mode": "slide", "offload_activations": True, "gpu_checkpoints": 1}}

    monkeypatch.setattr(throughput, "_run_system", fake_run)
    monkeypatch.setattr(throughput, "_flops_per_token", lambda *a: None)
    monkeypatch.setattr("slidetune.models.presets.preset_config",
                        lambda model, layers: type("C", (), {"max_position_embeddings": 128})())
    args = _args(throughput, ["--out", str(tmp_path), "--models", "tiny-llama", "--systems", "slide", "--no-floor",
                              "--device", "cpu", "--batches", "1", "--seq-lens", "128", "--max-seq-search",
                              "--max-seq-start", "128", "--seq-granule", "16", "--steps", "2", "--warmup", "1"])
    out = throughput.run(args)
    assert seen == [(1, 128, 2)]                  # the sweep row only: no probe
    (row,) = read_csv(out / "max_seq.csv")
    assert int(row["max_seq"]) == 128
    section = (out / "report.md").read_text().split("## Longest trainable sequence")[1]
    (line,) = [x for x in section.splitlines() if x.startswith("| tiny-llama | 128 |")]
    assert "128: yes (sweep row)" in line and "2.0 s, 64," in line and "gpu_checkpoints=1" in line


# ------------------------------------------------------------------ techniques: partial results, resume

class _FakeWorker:
    """Stands in for run_worker: batch b fits when b <= limit[technique]; records the launches and,
    at each launch, what techniques.json on disk held (to prove it was written before)."""

    def __init__(self, out, limits, fail=None, run_limits=None):
        self.out, self.limits, self.fail, self.calls, self.seen_on_disk = out, limits, fail or {}, [], []
        self.run_limits = run_limits or {}     # a timed run may fit less than its shorter probe did

    def __call__(self, module, spec, timeout_s=0):
        path = self.out / "techniques.json"
        self.seen_on_disk.append(len(json.loads(path.read_text())["results"]) if path.exists() else -1)
        name, b = spec["name"], spec["batch_size"]
        self.calls.append((name, b, spec["eval"]))
        machine = {"torch": torch.__version__, "gpu": "fake", "gpu_memory_gib": 79.2}
        if self.fail.get(name) == b:
            return {"spec": spec, "status": "error", "error": "RuntimeError: boom", "machine": machine}
        assert spec["data"] == "corpus"        # probes train on the runs' data
        limit = self.run_limits.get(name, self.limits[name]) if spec["eval"] else self.limits[name]
        if b > limit:
            return {"spec": spec, "status": "oom", "error": "CUDA out of memory", "oom_requested_gib": 1.0,
                    "machine": machine}
        return {"spec": spec, "status": "ok", "step_s_mean": 0.01 * b, "step_s_std": 0.0, "tokens_per_s": 100.0 * b,
                "gpu_peak_alloc_gib": 0.1 * b, "gpu_peak_reserved_gib": 0.2 * b, "cpu_peak_rss_gib": 1.0,
                "perplexity": 50.0 - b if spec["eval"] else None, "final_loss": 4.0, "machine": machine}


def _techniques_args(out, *extra):
    from slidetune.bench.scenarios import techniques
    return _args(techniques, ["--out", str(out), "--techniques", "fp32,flash,recompute", "--device", "cpu",
                              "--seq-len", "16", "--steps", "4", "--probe-steps", "2", "--jobs", "1", *extra])


def _fake_env(monkeypatch, tmp_path, limits, fail=None, run_limits=None):
    from slidetune.bench.scenarios import techniques
    fake = _FakeWorker(tmp_path, limits, fail, run_limits)
    monkeypatch.setattr(techniques, "run_worker", fake)
    monkeypatch.setattr(techniques, "_dataset", lambda out, S, given: (tmp_path / "corpus.safetensors", False))
    return techniques, fake


@pytest.mark.slow
def test_techniques_writes_after_every_process_and_resumes(tmp_path, monkeypatch):
    """Outputs are rewritten after every process; a run stopped by --time-budget leaves valid files
    that list what is pending, and --resume launches only what is missing."""
    limits = {"fp32": 5, "flash": 12, "recompute": 30}
    techniques, fake = _fake_env(monkeypatch, tmp_path, limits)
    techniques.run(_techniques_args(tmp_path))
    full = list(fake.calls)
    assert fake.seen_on_disk == list(range(len(full)))       # each process found all earlier ones on disk
    rows = {(r["technique"], r["regime"]): r for r in read_csv(tmp_path / "techniques.csv")}
    assert rows[("fp32", "same")]["batch_size"] == "5" and rows[("recompute", "max")]["status"] == "ok"
    assert 30 - int(rows[("recompute", "max")]["batch_size"]) <= 1          # exact search (tolerance 0)
    # same-batch runs settle their batch: no technique re-probes the sizes below FP32's largest
    assert not [c for c in full if c[0] != "fp32" and c[1] < 5]
    doc = json.loads((tmp_path / "techniques.json").read_text())
    assert doc["state"] == "complete" and "State: complete" in (tmp_path / "report.md").read_text()

    # stopped: a budget spent after the first few processes
    out = tmp_path / "partial"
    out.mkdir()
    techniques, fake = _fake_env(monkeypatch, out, limits)
    monkeypatch.setattr(techniques.time, "monotonic", lambda: float(len(fake.calls)))   # 1 s per process
    techniques.run(_techniques_args(out, "--time-budget", "9"))
    n_first = len(fake.calls)
    assert 0 < n_first < len(full)
    doc = json.loads((out / "techniques.json").read_text())
    assert doc["state"].startswith("stopped: time budget")
    rows = _finite_csv(out / "techniques.csv", ["step_s_mean", "tokens_per_s", "peak_gib", "perplexity"])
    assert any(r["status"] == "pending" for r in rows) and any(r["status"] == "ok" for r in rows)
    report = (out / "report.md").read_text()
    assert "Pending:" in report and "stopped: time budget" in report
    _pngs(out, ["peak_memory.png", "throughput.png", "max_batch.png", "perplexity.png", "pareto.png"])

    # resumed: only the rest runs, and the result is the uninterrupted one
    techniques, fake = _fake_env(monkeypatch, out, limits)
    monkeypatch.setattr(techniques.time, "monotonic", lambda: 0.0)
    techniques.run(_techniques_args(out, "--resume"))
    assert len(fake.calls) + n_first == len(full)
    assert sorted(fake.calls + full[:n_first]) == sorted(full)
    resumed = {(r["technique"], r["regime"]): r["batch_size"] for r in read_csv(out / "techniques.csv")}
    assert resumed == {k: r["batch_size"] for k, r in rows_by(tmp_path).items()}
    assert json.loads((out / "techniques.json").read_text())["state"] == "complete"


def rows_by(out):
    return {(r["technique"], r["regime"]): r for r in read_csv(out / "techniques.csv")}


def test_techniques_outputs_survive_a_kill(tmp_path, monkeypatch):
    """A process killed mid-run (here: the launcher raises) leaves the files of what finished."""
    techniques, fake = _fake_env(monkeypatch, tmp_path, {"fp32": 4, "flash": 8, "recompute": 8})
    real = _FakeWorker.__call__

    def dying(self, module, spec, timeout_s=0):
        if len(self.calls) == 6:
            raise KeyboardInterrupt
        return real(self, module, spec, timeout_s)
    monkeypatch.setattr(_FakeWorker, "__call__", dying)
    with pytest.raises(KeyboardInterrupt):
        techniques.run(_techniques_args(tmp_path))
    doc = json.loads((tmp_path / "techniques.json").read_text())
    assert len(doc["results"]) == 6 and doc["state"] == "stopped: interrupted"
    assert "Pending:" in (tmp_path / "report.md").read_text()


def test_techniques_probe_error_is_no_largest_batch(tmp_path, monkeypatch):
    """A probe that fails otherwise than by OOM stops that search with an error row, not a wrong batch."""
    techniques, fake = _fake_env(monkeypatch, tmp_path, {"fp32": 4, "flash": 16, "recompute": 16},
                                 fail={"flash": 8})
    techniques.run(_techniques_args(tmp_path))
    rows = rows_by(tmp_path)
    assert rows[("flash", "max")]["status"] == "error" and "boom" in rows[("flash", "max")]["error"]
    assert rows[("flash", "same")]["status"] == "ok" and rows[("recompute", "max")]["batch_size"] == "16"


@pytest.mark.slow
def test_techniques_report_compares_with_the_seed(tmp_path, monkeypatch):
    from slidetune.bench.report import write_report
    techniques, fake = _fake_env(monkeypatch, tmp_path, {"fp32": 4, "bf16-amp": 4, "flash": 9, "recompute": 17})
    techniques.run(_techniques_args(tmp_path, "--techniques", "fp32,bf16-amp,flash,recompute", "--max-batch-tolerance",
                                    "0.25"))
    text = write_report(tmp_path, compare_seeds=True).read_text()
    assert "## Compared with the seed report" in text
    line = next(x for x in text.splitlines() if x.startswith("| GradCP | recompute | max"))
    assert "4.40x / " in line and "n/a" not in line          # batch ratio: seed 2038/463, ours from the search


def test_hf_train_cuda_device_has_an_index(monkeypatch):
    """The memory cap (set_per_process_memory_fraction) needs an indexed device; 'cuda' alone failed."""
    from slidetune.bench.baselines import hf_train
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    dev = hf_train._device("cuda")
    assert dev == torch.device("cuda", 0)
    assert torch.cuda._utils._get_device_index(dev) == 0          # what the cap call parses
    assert hf_train._device("cpu") == torch.device("cpu")


def test_flex_local_attention_casts_to_the_autocast_dtype(monkeypatch):
    """Under autocast, HF's rotary leaves q and k in FP32 beside a bf16 v; flex (no autocast op) gets
    all three in the autocast dtype, as SDPA would."""
    from slidetune.ops import attention
    seen = []
    monkeypatch.setattr(attention, "_flex_compiled", lambda q, k, v, **kw: seen.append((q.dtype, k.dtype, v.dtype)) or q)
    monkeypatch.setattr(attention, "_flex_block_mask", lambda *a: None)
    q, k = torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    v = torch.randn(1, 2, 16, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        attention.local_attention(q, k, v, 4, backend="flex")
    attention.local_attention(q, k, v.float(), 4, backend="flex")
    assert seen == [(torch.bfloat16,) * 3, (torch.float32,) * 3]


@pytest.mark.slow
def test_techniques_run_oom_searches_below(tmp_path, monkeypatch):
    """A timed run that runs out of memory where its probe fitted: that batch counts as a failure
    and the search goes on below it, so the 'max' row is a batch that trained."""
    techniques, fake = _fake_env(monkeypatch, tmp_path, {"fp32": 4, "flash": 16, "recompute": 16},
                                 run_limits={"flash": 11})
    techniques.run(_techniques_args(tmp_path))
    rows = rows_by(tmp_path)
    assert rows[("flash", "max")]["status"] == "ok" and rows[("flash", "max")]["batch_size"] == "11"
    flash_runs = [b for n, b, ev in fake.calls if n == "flash" and ev]
    assert flash_runs[0] == 4 and flash_runs[1] == 16 and flash_runs[-1] == 11
    assert rows[("recompute", "max")]["batch_size"] == "16"


def test_techniques_probe_steps_at_least_two(tmp_path, monkeypatch):
    techniques, fake = _fake_env(monkeypatch, tmp_path, {"fp32": 4, "flash": 8, "recompute": 8})
    with pytest.raises(SystemExit, match="at least 2 steps"):
        techniques.run(_techniques_args(tmp_path, "--probe-steps", "1"))
    assert not fake.calls


@pytest.mark.slow
def test_techniques_resume_reprobes_when_probe_settings_change(tmp_path, monkeypatch):
    """--resume with other probe settings keeps the timed runs and runs the probes again."""
    limits = {"fp32": 4, "flash": 8, "recompute": 8}
    techniques, fake = _fake_env(monkeypatch, tmp_path, limits)
    techniques.run(_techniques_args(tmp_path))
    first = list(fake.calls)
    techniques, fake = _fake_env(monkeypatch, tmp_path, limits)
    techniques.run(_techniques_args(tmp_path, "--probe-steps", "3", "--resume"))
    assert fake.calls and not [c for c in fake.calls if c[2]]                 # no timed run again
    settled = {(n, b) for n, b, ev in first if ev}                             # a timed run settles its batch
    assert sorted(fake.calls) == sorted(c for c in first if not c[2] and (c[0], c[1]) not in settled)
    assert rows_by(tmp_path)[("flash", "max")]["batch_size"] == "8"


# ------------------------------------------------------------------ the floor of a placement

_COMP = {"num_layers": 4, "layer_params": 100 * 2**20, "vocab_params": 50 * 2**20, "compute_s": 1.0}
_COPY = {"h2d_gib_s": 50.0, "d2h_gib_s": 50.0}
_ADAMW = {"adamw_params_per_s": 1e9}


def test_floor_terms_count_only_what_the_host_updates():
    """Every unit on the host: all parameters through the host's AdamW and down as BF16 gradients,
    the layers up twice but for the window's slots, the vocabulary once. Units updated on the GPU
    (device_layers, vocab_update=device) leave all three terms; resident layers go up once."""
    from slidetune.bench.roofline import floor_terms, plan_of_runtime
    L, P, V, gib = 4, 100 * 2**20, 50 * 2**20, 2**30

    def Placement(**rt):
        return plan_of_runtime(_COMP, rt)
    host = floor_terms(_COMP, _COPY, _ADAMW)
    assert host["adamw_s"] == pytest.approx((L * P + V) / 1e9)
    assert host["d2h_s"] == pytest.approx(2 * (L * P + V) / (50 * gib))
    assert host["h2d_s"] == pytest.approx(2 * (P * (2 * L - 3) + V) / (50 * gib))
    assert host["compute_s"] == 1.0
    placed = floor_terms(_COMP, _COPY, _ADAMW, Placement(device_layers=3, vocab_update="device", cache_units=0))
    assert placed["adamw_s"] == pytest.approx(P / 1e9)
    assert placed["d2h_s"] == pytest.approx(2 * P / (50 * gib))
    assert placed["h2d_s"] == pytest.approx(2 * P / (50 * gib))          # the one host layer, once
    everything = floor_terms(_COMP, _COPY, _ADAMW, Placement(device_layers=L, vocab_update="device"))
    assert everything["adamw_s"] == everything["d2h_s"] == everything["h2d_s"] == 0
    # the GPU's AdamW of the units updated there runs on the compute stream: it adds to compute
    rate = {"device_adamw_params_per_s": 1e10}
    placed_dev = floor_terms(_COMP, _COPY, _ADAMW, Placement(device_layers=3, vocab_update="device"), rate)
    assert placed_dev["compute_s"] == pytest.approx(1.0 + (3 * P + V) / 1e10)
    assert floor_terms(_COMP, _COPY, _ADAMW, Placement(), rate)["compute_s"] == 1.0
    assert Placement(device_layers=-1, vocab_update="auto", cache_units=3) == Placement()
    # layer uploads a step: resident layers once, window layers twice but for the slots at the turn
    from slidetune.engine.config import RuntimeConfig
    from slidetune.engine.placement import PlacementPlan, shapes_from_counts

    def uploads(layers, **rt):
        return PlacementPlan.build(shapes_from_counts(layers, 1, 1, 1), RuntimeConfig(**rt)).uploads_per_step()[0]
    assert uploads(20, cache_units=3) == 2 * 20 - 3
    assert uploads(20, cache_units=0) == 20
    assert uploads(20, cache_units=3, resident_layers=5) == 5 + 2 * 15 - 3
    assert uploads(20, cache_units=3, resident_layers=17) == 20      # the window would hold the rest


# The hardware probes of a 4-layer model, by hand: each layer's forward matmuls 1 TFLOP, its
# attention 0.1 TFLOP, the head's logits 1 TFLOP; GEMMs at 50 TFLOP/s, SDPA at 10, both ways.
_HW = {"gemm_forward_tflops": 50.0, "gemm_backward_tflops": 50.0, "sdpa_forward_tflops": 10.0,
       "sdpa_backward_tflops": 10.0,
       "flops": {"tokens": 8192, "layer_matmul": [1e12] * 4, "layer_attention": [1e11] * 4, "head_matmul": 1e12}}


def test_hardware_compute_prices_each_flop_at_its_rate():
    """Every layer recomputed: matmuls forward 4 + 4 (recompute) + 1 (head) = 9 TFLOP, backward
    2 x (4 + 1) = 10, 19 TFLOP at 50 TFLOP/s = 0.38 s; attention forward 0.4 + 0.4, backward
    2.5 x 0.4 = 1.0, 1.8 TFLOP at 10 = 0.18 s: 0.56 s. None recomputed: 15 TFLOP = 0.30 s and
    1.4 TFLOP = 0.14 s. Rates apart: forward GEMMs at 100, backward at 25, SDPA 20 and 5."""
    from slidetune.bench.hardware_floor import hardware_compute
    every = hardware_compute(_HW, range(4))
    assert every["compute_s"] == pytest.approx(0.56)
    assert every["matmul_flops"] == pytest.approx(19e12) and every["attention_flops"] == pytest.approx(1.8e12)
    assert every["head_s"] == pytest.approx(3e12 / 50e12) and every["embed_s"] == 0
    # the probe's decomposition holds: L x (forward + recompute and backward) + head = the step
    assert every["layer_forward_s"] == pytest.approx(1e12 / 50e12 + 1e11 / 10e12)
    assert 4 * (every["layer_forward_s"] + every["layer_recompute_backward_s"]) + every["head_s"] == \
        pytest.approx(0.56)
    assert hardware_compute(_HW, set())["compute_s"] == pytest.approx(0.44)
    apart = dict(_HW, gemm_forward_tflops=100.0, gemm_backward_tflops=25.0, sdpa_forward_tflops=20.0,
                 sdpa_backward_tflops=5.0)
    assert hardware_compute(apart, range(4))["compute_s"] == pytest.approx(9 / 100 + 10 / 25 + 0.8 / 20 + 1.0 / 5)


def test_throughput_rows_use_the_floor_of_the_runs_placement(tmp_path):
    """A slide run that updated layers on the GPU is held to the floor of that placement, not to
    the all-on-host probe floor (which it can beat); `slidetune report` rewrites an existing
    throughput directory with it, keeping the baselines' rows as they were."""
    from slidetune.bench.report import write_report
    from slidetune.bench.scenarios import throughput_rows
    fl = {"status": "ok", "partial": False, "floor_s": 2.0, "bound_by": "adamw_s", "compute": _COMP,
          "copy": _COPY, "adamw": {"adamw_params_per_s": (4 * 100 + 50) * 2**20 / 2.0}}
    slide = {"status": "ok", "step_s_mean": 1.1, "tokens_per_s": 100.0, "flops_per_token": 1e9,
             "runtime": {"device_layers": 3, "vocab_update": "device", "cache_units": 0},
             "spec": {"runtime": {"mode": "slide", "device": "cuda", "compile_layers": True}},
             "device_layers": 3, "host_threads": 15}
    row = throughput_rows._row("slide", "m", 8, 1024, slide, 1e9, fl)
    assert row["floor_bound_by"] == "compute_s" and row["step_over_floor"] == pytest.approx(1.1)
    assert (row["device_layers"], row["host_threads"]) == (3, 15)
    ds = {"status": "ok", "step_s_mean": 3.0, "tokens_per_s": 30.0, "system": "deepspeed-zero3-cpu-offload"}
    assert throughput_rows._row("deepspeed", "m", 8, 1024, ds, 1e9, fl)["step_over_floor"] == pytest.approx(1.5)
    # an old directory whose rows held the probe floor (step/floor 0.55) is rewritten
    old = [dict(throughput_rows._row("slide", "m", 8, 1024, slide, 1e9, fl), step_over_floor=0.55, floor_bound_by="adamw_s"),
           throughput_rows._row("deepspeed", "m", 8, 1024, ds, 1e9, fl)]
    doc = {"machine": {"gpu": "test"}, "rows": old, "floors": {"m/b8/s1024": fl},
           "runs": [{"key": "m/b8/s1024", "system": "slide", **slide}, {"key": "m/b8/s1024", **ds}]}
    (tmp_path / "throughput.json").write_text(json.dumps(doc))
    report = write_report(tmp_path).read_text()
    rows = {r["system"]: r for r in read_csv(tmp_path / "throughput.csv")}
    assert float(rows["slide"]["step_over_floor"]) == pytest.approx(1.1)
    assert rows["slide"]["floor_bound_by"] == "compute_s"
    assert float(rows["deepspeed"]["step_over_floor"]) == pytest.approx(1.5)
    assert float(rows["deepspeed"]["model_tflops"]) == pytest.approx(30.0 * 1e9 / 1e12)
    assert "`compile_layers=true`" in report and "| compute_s |" in report


def test_throughput_rows_hold_each_run_to_its_hardware_floor(tmp_path):
    """step/hw-floor beside step/floor in every row: the floor's terms with compute_s the step's FLOPs
    at the probed rates (_HW), each system's own recomputation counted. slide (every layer
    recomputed, 3 layers and the vocabulary updated on the GPU): compute 0.56 s binds (the one host
    layer's AdamW is 0.44 s). deepspeed (the probe's placement, every unit on the host: AdamW 2.0 s
    binds); a baseline without recomputation costs 0.44 s of compute, not 0.56. `slidetune report`
    rebuilds the columns from throughput.json's floors; a file from before the probes leaves them
    empty."""
    from slidetune.bench.report import write_report
    from slidetune.bench.roofline import floor_terms
    from slidetune.bench.scenarios import throughput_floor, throughput_recipe, throughput_rows
    adamw = {"adamw_params_per_s": (4 * 100 + 50) * 2**20 / 2.0}
    terms = floor_terms(_COMP, _COPY, adamw)
    fl = {"status": "ok", "partial": False, "floor_s": 2.0, "bound_by": "adamw_s", "terms": terms,
          "compute": _COMP, "copy": _COPY, "adamw": adamw, "hardware": _HW}
    slide = {"status": "ok", "step_s_mean": 1.1, "tokens_per_s": 100.0, "flops_per_token": 1e9,
             "runtime": {"mode": "slide", "device_layers": 3, "vocab_update": "device", "cache_units": 0},
             "spec": {"runtime": {"mode": "slide", "device": "cuda"}}}
    row = throughput_rows._row("slide", "m", 8, 1024, slide, 1e9, fl)
    assert row["floor_bound_by"] == "compute_s" and row["step_over_floor"] == pytest.approx(1.1)
    assert row["hw_floor_bound_by"] == "compute_s" and row["hw_floor_s"] == pytest.approx(0.56)
    assert row["step_over_hw_floor"] == pytest.approx(1.1 / 0.56)
    # clipped: the sweep's GPU part (every layer's recompute + backward, the head, one layer's forward:
    # 0.56 - 3 x 0.03 s) at the hardware's rates too, then the one host layer's AdamW, 200/450 s
    clipped = throughput_floor._hardware_floor("slide", slide, fl, throughput_recipe.parse_recipe("clip"), None, 1)
    assert clipped[1] == "clip_sweep_s" and clipped[0] == pytest.approx(0.56 - 3 * 0.03 + 200 / 450)
    ds = {"status": "ok", "step_s_mean": 3.0, "tokens_per_s": 30.0, "spec": {"recompute": True}}
    ds_row = throughput_rows._row("deepspeed", "m", 8, 1024, ds, 1e9, fl)
    assert ds_row["hw_floor_bound_by"] == "adamw_s" and ds_row["step_over_hw_floor"] == pytest.approx(1.5)
    plain = throughput_recipe.parse_recipe("plain")
    assert throughput_floor._hardware_floor("deepspeed", ds, fl, plain, None, 1)[2]["compute_s"] == pytest.approx(0.56)
    no_recompute = dict(ds, spec={"recompute": False})
    assert throughput_floor._hardware_floor("fsdp2", no_recompute, fl, plain, None, 1)[2]["compute_s"] == pytest.approx(0.44)
    ckpt = {"status": "ok", "step_s_mean": 0.5, "runtime": {"mode": "ckpt", "recompute": "none"}}
    assert throughput_floor._hardware_floor("gpu-ckpt", ckpt, fl, plain, None, 1)[2]["compute_s"] == pytest.approx(0.44)
    # the CPU's partial floor: no hardware floor, the columns empty
    cpu = {"status": "ok", "partial": True, "floor_s": 0.5, "bound_by": "adamw_s", "adamw": adamw,
           "terms": {"compute_s": None, "adamw_s": 0.5}}
    cpu_row = throughput_rows._row("slide", "m", 8, 1024, slide, 1e9, cpu)
    assert cpu_row["step_over_floor"] == pytest.approx(2.2)
    assert cpu_row["hw_floor_s"] is None and cpu_row.get("step_over_hw_floor") is None

    def rewritten(floor: dict) -> dict:
        rows = [throughput_rows._row("slide", "m", 8, 1024, slide, 1e9, floor),
                throughput_rows._row("deepspeed", "m", 8, 1024, ds, 1e9, floor)]
        doc = {"machine": {"gpu": "test"}, "rows": rows, "floors": {"m/b8/s1024": floor},
               "runs": [{"key": "m/b8/s1024", "system": "slide", **slide}, {"key": "m/b8/s1024", **ds}]}
        (tmp_path / "throughput.json").write_text(json.dumps(doc))
        report = write_report(tmp_path).read_text()
        assert "step_over_hw_floor" in report
        return {r["system"]: r for r in read_csv(tmp_path / "throughput.csv")}, report
    rows, report = rewritten(fl)
    assert float(rows["slide"]["step_over_hw_floor"]) == pytest.approx(1.1 / 0.56)
    assert float(rows["deepspeed"]["step_over_hw_floor"]) == pytest.approx(1.5)
    assert "The hardware floor's inputs" in report and "| m/b8/s1024 | 50.000 | 50.000 | 10.000 | 10.000 |" in report
    old = {k: v for k, v in fl.items() if k != "hardware"}         # a throughput.json from before the probes
    rows, report = rewritten(old)
    assert float(rows["slide"]["step_over_floor"]) == pytest.approx(1.1)
    assert rows["slide"]["hw_floor_s"] == rows["slide"]["step_over_hw_floor"] == ""
    assert rows["deepspeed"]["step_over_hw_floor"] == "" and "The hardware floor's inputs" not in report


@pytest.mark.slow
def test_throughput_variants_alternate_and_pair_in_one_call(tmp_path):
    """--variants a:...;b:... --rounds 2: slide runs a, b, a, b (one floor probe), each row says its
    variant and round, and the report pairs each b with the a of its round."""
    from slidetune.bench.scenarios import throughput, throughput_report
    out = throughput.run(_args(throughput, ["--smoke", "--out", str(tmp_path), "--models", "tiny-llama",
                                            "--systems", "slide", "--recipes", "clip", "--rounds", "2",
                                            "--variants", "one:held_buffers=1;two:held_buffers=2"]))
    rows = read_csv(out / "throughput.csv")
    assert [(r["variant"], r["round"]) for r in rows] == [("one", "1"), ("two", "1"), ("one", "2"), ("two", "2")]
    assert all(r["status"] == "ok" and float(r["step_s_mean"]) > 0 for r in rows)
    runs = json.loads((out / "throughput.json").read_text())["runs"]
    assert [r["runtime"]["held_buffers"] for r in runs] == [1, 2, 1, 2]       # each run got its variant
    table = {t["variant"]: t for t in throughput_report.ab_table(json.loads((out / "throughput.json").read_text())["rows"])}
    steps = {(r["variant"], r["round"]): float(r["step_s_mean"]) for r in rows}
    assert table["one"]["paired_ratio_mean"] == pytest.approx(1.0)
    expect = (steps["two", "1"] / steps["one", "1"] + steps["two", "2"] / steps["one", "2"]) / 2
    assert table["two"]["paired_ratio_mean"] == pytest.approx(expect)
    report = (out / "report.md").read_text()
    assert "## A/B: variants run alternately in this call" in report
    summary = {r["config"] for r in read_csv(out / "per_run" / "summary.csv")}
    assert "slide-tiny-llama-b2-s32-two-r2" in summary
    # the report rewritten from its JSON keeps the variants
    throughput_report.rewrite_report(out)
    assert [r["variant"] for r in read_csv(out / "throughput.csv")] == ["one", "two", "one", "two"]


def test_throughput_variants_of_state_format_each_get_their_adamw_floor(tmp_path):
    """--variants fp32:;q8:moments=8bit: one floor probe for the workload, and the 8-bit variant's
    floor with the host AdamW probed in its own format (its own key), found again by `report`."""
    from slidetune.bench.scenarios import throughput
    from slidetune.bench.scenarios.throughput_report import rewrite_report
    out = throughput.run(_args(throughput, ["--smoke", "--out", str(tmp_path), "--models", "tiny-llama",
                                            "--systems", "slide", "--recipes", "clip",
                                            "--variants", "fp32:;q8:moments=8bit"]))
    doc = json.loads((out / "throughput.json").read_text())
    floors = doc["floors"]
    base = next(k for k in floors if "moments" not in k)
    q8 = base + "/master-fp32-moments-8bit"
    assert set(floors) == {base, q8}
    assert floors[base]["adamw"]["moments"] == "fp32" and floors[q8]["adamw"]["moments"] == "8bit"
    assert floors[q8]["adamw_state"] == ["fp32", "8bit"]
    rows = {r["variant"]: r for r in read_csv(out / "throughput.csv")}
    assert all(float(rows[v]["floor_s"]) > 0 for v in ("fp32", "q8"))
    # the 8-bit kernel's own rate sets its floor (a partial one on the CPU: the AdamW term alone)
    ratio = floors[base]["adamw"]["adamw_params_per_s"] / floors[q8]["adamw"]["adamw_params_per_s"]
    assert float(rows["q8"]["floor_s"]) == pytest.approx(float(rows["fp32"]["floor_s"]) * ratio, rel=1e-6)
    rewrite_report(out)
    again = {r["variant"]: r for r in read_csv(out / "throughput.csv")}
    assert again["q8"]["floor_s"] == rows["q8"]["floor_s"]


def test_throughput_variants_are_named_and_leave_the_floor_alone():
    from slidetune.bench.scenarios.throughput import parse_ab_variants
    assert parse_ab_variants("") == [("", {})]
    assert parse_ab_variants("a:;b:clip_sweep=weights") == [("a", {}), ("b", {"clip_sweep": "weights"})]
    with pytest.raises(ValueError, match="its own name"):
        parse_ab_variants("a:;a:held_buffers=1")
    with pytest.raises(ValueError, match="compile_layers also sets how the floor is probed"):
        parse_ab_variants("a:;b:compile_layers=on")
    with pytest.raises(ValueError, match="RuntimeConfig field"):
        parse_ab_variants("a:;b:no_such_knob=1")
    # a variant is checked with --runtime's settings: disk units need the disk directory given there
    with pytest.raises(ValueError, match="disk directory"):
        parse_ab_variants("ram:disk_units=0;disk4:disk_units=4")
    assert parse_ab_variants("ram:disk_units=0;disk4:disk_units=4", {"disk_dir": "/d"}) == [
        ("ram", {"disk_units": 0}), ("disk4", {"disk_units": 4})]


def test_throughput_floor_is_probed_for_the_layer_the_run_resolved(tmp_path):
    """Each run's floor times the decoder layer it ran: a slide run that resolved lean_layer on gets
    the floor probed with the lean layer alone (its own key), HF's layer otherwise and for the
    baselines; `slidetune report` finds each run's floor again, and a directory from before (one
    floor per workload, both layers timed) still reads."""
    from slidetune.bench.report import write_report
    from slidetune.bench.scenarios import throughput_floor, throughput_rows
    lean_run = {"status": "ok", "runtime": {"mode": "slide", "lean_layer": "on"}}
    hf_run = {"status": "ok", "runtime": {"mode": "slide", "lean_layer": "off"}}
    assert throughput_floor._layer_ran("slide", lean_run) == "lean"
    assert throughput_floor._layer_ran("slide", hf_run) == "hf"
    assert throughput_floor._layer_ran("slide", {"status": "refused"}) == "hf"       # ended before it resolved
    assert throughput_floor._layer_ran("deepspeed", lean_run) == "hf"
    assert throughput_floor._floor_key("m", 8, 1024, "lean") == "m/b8/s1024/lean"
    assert throughput_floor._floor_key("m", 8, 1024, "hf") == "m/b8/s1024"
    slide = {"status": "ok", "step_s_mean": 1.5, "tokens_per_s": 100.0, "flops_per_token": 1e9,
             "runtime": {"mode": "slide", "lean_layer": "on", "device_layers": 0, "cache_units": 3},
             "spec": {"runtime": {"mode": "slide", "device": "cuda"}}}
    adamw = {"adamw_params_per_s": 1e12}          # compute binds: the floor is the layer probed
    fl_hf = {"status": "ok", "partial": False, "floor_s": 1.0, "bound_by": "compute_s",
             "compute": dict(_COMP, layer_forward_s=0.05, layer_recompute_backward_s=0.15, head_s=0.2, embed_s=0.0,
                             compute_s=1.0), "copy": _COPY, "adamw": adamw}
    lean_comp = dict(_COMP, layer_forward_s=0.1, layer_recompute_backward_s=0.2, head_s=0.2, embed_s=0.0,
                     compute_s=1.4, lean_layer_forward_s=0.1, lean_layer_recompute_backward_s=0.2,
                     layer_probed="lean")
    fl_lean = dict(fl_hf, compute=lean_comp, floor_s=1.4)
    row = throughput_rows._row("slide", "m", 8, 1024, slide, 1e9, fl_lean)
    assert row["step_over_floor"] == pytest.approx(1.5 / 1.4)
    old_row = dict(row, step_over_floor=9.9)
    doc = {"machine": {"gpu": "test"}, "rows": [old_row], "runs": [{"key": "m/b8/s1024", "system": "slide", **slide}],
           "floors": {"m/b8/s1024": fl_hf, "m/b8/s1024/lean": fl_lean}}
    (tmp_path / "throughput.json").write_text(json.dumps(doc))
    write_report(tmp_path)
    (rewritten,) = read_csv(tmp_path / "throughput.csv")
    assert float(rewritten["step_over_floor"]) == pytest.approx(1.5 / 1.4)
