"""techniques / throughput / roofline scenarios at --smoke size, the largest-batch search, OOM parsing."""
import argparse
import json
import math

import pytest
import torch

from slidetune.bench.baselines.proc import parse_oom
from slidetune.bench.scenarios.common import read_csv, read_csv_machine
from slidetune.bench.scenarios.techniques import find_max_batch
from slidetune.ops.attention import band_mask


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


def test_throughput_smoke(tmp_path):
    from slidetune.bench.scenarios import throughput
    out = throughput.run(_args(throughput, ["--smoke", "--out", str(tmp_path), "--models", "tiny-llama"]))
    rows = _finite_csv(out / "throughput.csv", ["step_s_mean", "tokens_per_s", "model_tflops", "step_over_floor",
                                                "floor_s"])
    by = {r["system"]: r for r in rows}
    assert by["slide"]["status"] == "ok" and by["gpu-ckpt"]["status"] == "ok"
    assert float(by["slide"]["tokens_per_s"]) > 0 and float(by["slide"]["step_over_floor"]) > 0
    assert by["fsdp2"]["status"] == "needs CUDA"
    assert by["deepspeed"]["status"] in ("not installed", "needs CUDA")
    json.loads((out / "throughput.json").read_text())
    _pngs(out, ["tokens_per_s.png", "model_tflops.png", "gpu_peak.png", "step_over_floor.png"])
    assert "6 N_matmul" in (out / "report.md").read_text()


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
    _pngs(out, ["roofline.png"])


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


def test_longest_sequence_search_reports_the_largest_that_trains(tmp_path, monkeypatch):
    """--max-seq: doubling then bisection over multiples of the granule, each probe a run;
    here a stand-in run "fits" up to 100 tokens, so the answer is 96 (granule 16)."""
    from slidetune.bench.scenarios import throughput
    seen = []

    def fake_run(system, model, layers, batch, seq, steps, warmup, dev, cuda, args):
        seen.append((system, batch, seq))
        fits = seq <= 100
        return {"status": "ok" if fits else "oom", "step_s_mean": 0.1 if fits else None,
                "error": None if fits else "CUDA out of memory"}

    monkeypatch.setattr(throughput, "_run_system", fake_run)
    out = throughput.run(_args(throughput, ["--smoke", "--out", str(tmp_path), "--models", "tiny-llama",
                                            "--systems", "slide", "--no-floor", "--max-seq"]))
    probes = [s for s in seen if s[1] == 1]
    assert all(system == "slide" for system, _, _ in probes)
    assert [s for _, _, s in probes] == [32, 64, 128, 96, 112]      # doubling from 32, then bisection
    (row,) = read_csv(out / "max_seq.csv")
    assert row["model"] == "tiny-llama" and int(row["max_seq"]) == 96
    assert "## Longest trainable sequence" in (out / "report.md").read_text()
