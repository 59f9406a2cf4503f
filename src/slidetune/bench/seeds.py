"""The seed reports' key tables (../shared/seeds/), transcribed, and ratio comparisons.

The seeds ran on an RTX 3080 (16 GB; T1M2 on the Laptop variant) with PyTorch 2.7, so
absolute numbers do not transfer; `compare()` sets each seed ratio (e.g. slide/gpu peak
reserved) beside the same ratio from our results. The seeds' scripts had measurement
errors (per-layer synchronize, recompute time inside backward, warm-up kept in some
statistics, empty_cache() in the loop), so a ratio that differs is not necessarily ours
being wrong: benchmarks/NOTES.md discusses each.
"""
from __future__ import annotations

import math

from .output import md_table, number

SEEDS = {
    "modes": {
        "title": "T1M1: gpu vs ckpt vs slide (seq 256, batch 1, 28 layers, BF16)",
        "source": "seeds/000_4930a75b133e2896.txt, Table 1",
        "gpu": "RTX 3080 16 GB, CUDA 12.8, PyTorch 2.7",
        # config -> metrics (step_s mean/std over 9 steady-state iterations; GiB)
        "rows": {
            "gpu": {"step_s_mean": 0.375, "step_s_std": 0.007, "gpu_peak_reserved_gib": 6.31, "cpu_peak_rss_gib": 1.28},
            "ckpt": {"step_s_mean": 0.479, "step_s_std": 0.039, "gpu_peak_reserved_gib": 6.00, "cpu_peak_rss_gib": 1.28},
            "slide": {"step_s_mean": 1.571, "step_s_std": 0.012, "gpu_peak_reserved_gib": 0.93, "cpu_peak_rss_gib": 4.93},
        },
        # (label, numerator config, denominator config, metric); our config names are the same
        "ratios": [
            ("slide/gpu step time", "slide", "gpu", "step_s_mean"),
            ("ckpt/gpu step time", "ckpt", "gpu", "step_s_mean"),
            ("slide/gpu peak GPU reserved", "slide", "gpu", "gpu_peak_reserved_gib"),
            ("ckpt/gpu peak GPU reserved", "ckpt", "gpu", "gpu_peak_reserved_gib"),
            ("slide/gpu peak CPU RSS", "slide", "gpu", "cpu_peak_rss_gib"),
        ],
        "ours": {"gpu": "gpu", "ckpt": "ckpt", "slide": "slide"},
    },
    "recompute": {
        "title": "T1M2: recomputation off vs on (seq 256, batch 1, 28 layers, BF16)",
        "source": "seeds/001_818773accea9d173.txt, Table 1",
        "gpu": "RTX 3080 Laptop GPU (16 GB), CUDA 12.8, PyTorch 2.7.0, Windows",
        "rows": {
            "off": {"step_s_mean": 0.3367, "gpu_peak_alloc_gib": 7.94, "gpu_peak_reserved_gib": 9.28,
                    "cpu_peak_rss_gib": 2.33},
            "on": {"step_s_mean": 0.4758, "gpu_peak_alloc_gib": 7.66, "gpu_peak_reserved_gib": 8.32,
                   "cpu_peak_rss_gib": 2.70},
        },
        "ratios": [
            ("on/off (ckpt all / none) step time", "on", "off", "step_s_mean"),
            ("on/off peak GPU allocated", "on", "off", "gpu_peak_alloc_gib"),
            ("on/off peak GPU reserved", "on", "off", "gpu_peak_reserved_gib"),
            ("on/off peak CPU RSS", "on", "off", "cpu_peak_rss_gib"),
        ],
        "ours": {"off": "none", "on": "all"},
        "notes": "Seed top-3 layers by per-layer total delta (on - off): 12, 18, 23.",
    },
    "head": {
        "title": "T1M3: full vs chunked cross-entropy (seq 1024, batch 2, BF16, no checkpointing)",
        "source": "seeds/004_71b48d29c6826a41.txt, Table 1",
        "gpu": "RTX 3080 16 GB",
        "rows": {
            "full": {"step_s_mean": 1.2825, "gpu_peak_alloc_gib": 13.08, "gpu_peak_reserved_gib": 13.83,
                     "head_fwd_ms": 61.5, "head_bwd_ms": 872.7},
            "chunked": {"step_s_mean": 1.3703, "gpu_peak_alloc_gib": 9.90, "gpu_peak_reserved_gib": 10.70,
                        "head_fwd_ms": 88.2, "head_bwd_ms": 926.2},
        },
        "ratios": [
            ("chunked/full step time", "chunked", "full", "step_s_mean"),
            ("chunked/full peak GPU allocated", "chunked", "full", "gpu_peak_alloc_gib"),
            ("chunked/full peak GPU reserved", "chunked", "full", "gpu_peak_reserved_gib"),
            ("chunked/full head forward time", "chunked", "full", "head_fwd_ms"),
        ],
        # resolved against our configs at the sequence length closest to the seed's 1024
        "ours": {"full": "full-s{seq}", "chunked": "chunked-s{seq}"},
        "seq": 1024,
    },
}


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) and b != 0 else math.nan


def _our_names(scenario: str, summary: list[dict]) -> dict[str, str]:
    seed = SEEDS[scenario]
    names = dict(seed["ours"])
    if scenario == "head":
        seqs = sorted({int(number(r.get("seq_len"))) for r in summary if r.get("status") == "ok"
                       and not math.isnan(number(r.get("seq_len")))})
        if seqs:
            seq = min(seqs, key=lambda s: abs(s - seed["seq"]))
            names = {k: v.format(seq=seq) for k, v in names.items()}
    return names


def compare(scenario: str, summary: list[dict]) -> list[dict]:
    """Rows: ratio label, seed value, ours, ours/seed (NaN where ours cannot be formed,
    e.g. GPU memory ratios from a CPU-only run)."""
    if scenario not in SEEDS:
        return []
    seed = SEEDS[scenario]
    ours = {r.get("config"): r for r in summary if r.get("status") == "ok"}
    names = _our_names(scenario, summary)
    rows = []
    for label, num, den, metric in seed["ratios"]:
        s = _ratio(seed["rows"][num].get(metric, math.nan), seed["rows"][den].get(metric, math.nan))
        a, b = ours.get(names[num], {}), ours.get(names[den], {})
        o = _ratio(number(a.get(metric)), number(b.get(metric)))
        rows.append({"ratio": label, "seed": s, "ours": o, "ours_over_seed": _ratio(o, s),
                     "ours_configs": f"{names[num]}/{names[den]}"})
    return rows


def seed_table_markdown(scenario: str) -> list[str]:
    seed = SEEDS[scenario]
    metrics = sorted({m for row in seed["rows"].values() for m in row})
    rows = [[name] + [f"{row[m]:g}" if m in row else "" for m in metrics] for name, row in seed["rows"].items()]
    lines = [f"Seed: {seed['title']} - {seed['source']}; {seed['gpu']}.", ""] + md_table(rows, ["seed config"] + metrics)
    if seed.get("notes"):
        lines += ["", seed["notes"]]
    return lines


# seeds/003 (the memory-optimization study): Table 1, per technique and regime
# (batch, peak MB, step s, perplexity); BF16-AMP at the same batch did not fit (OOM).
TECHNIQUES_SEED = {
    "title": "memory-optimization techniques (12 layers x 768, seq 1024, 200 steps)",
    "source": "seeds/003_33569d534dba563c.txt, Tables 1 and 2",
    "gpu": "A100 40 GB, CUDA 11.x",
    "rows": {   # (seed name, regime): batch, peak_mb, step_s, perplexity
        ("Baseline (FP32)", "same"): (463, 40798, 2.34, 12.67),
        ("BF16-AMP", "max"): (457, 43867, 2.30, 13.00),
        ("FlashAttn", "same"): (463, 18401, 1.19, 13.02),
        ("FlashAttn", "max"): (1135, 44613, 2.37, 12.38),
        ("LocalAttn-W128", "same"): (463, 18401, 1.18, 12.78),
        ("LocalAttn-W128", "max"): (1135, 44613, 2.41, 11.26),
        ("LocalAttn-W256", "same"): (463, 18401, 1.16, 13.11),
        ("LocalAttn-W256", "max"): (1135, 44613, 2.30, 12.31),
        ("GradCP", "same"): (463, 9879, 2.65, 13.38),
        ("GradCP", "max"): (2038, 42357, 13.12, 12.23),
        ("FlashAttn+GradCP", "max"): (2038, 41444, 5.62, 12.17),
    },
    # seed name -> our technique (GradCP: the study's checkpointing ran under BF16 AMP, eager attention)
    "ours": {"Baseline (FP32)": "fp32", "BF16-AMP": "bf16-amp", "FlashAttn": "flash",
             "LocalAttn-W128": "local-w128", "LocalAttn-W256": "local-w256", "GradCP": "recompute",
             "FlashAttn+GradCP": "flash+recompute"},
}


def techniques_seed_ratios() -> list[dict]:
    """seeds/003 Table 2 recomputed from Table 1 (it matches the printed Table 2 to rounding),
    plus the ratios that table lacks: tokens/s and largest batch vs FP32."""
    rows = TECHNIQUES_SEED["rows"]
    b0, m0, t0, p0 = rows[("Baseline (FP32)", "same")]
    out = []
    for (name, regime), (b, m, t, p) in rows.items():
        if name.startswith("Baseline"):
            continue
        out.append(dict(seed=name, technique=TECHNIQUES_SEED["ours"][name], regime=regime,
                        step_time_ratio=t0 / t, throughput_ratio=(b / t) / (b0 / t0), batch_ratio=b / b0,
                        memory_reduction=1 - m / m0, ppl_change=p / p0 - 1))
    return out


def techniques_comparison_markdown(rows: list[dict], max_batch: dict[str, int | None]) -> list[str]:
    """Our techniques rows (scenarios.techniques) beside seeds/003's ratios, each vs its own FP32 run."""
    ours = {(r["technique"], r["regime"]): r for r in rows if r.get("status") == "ok"}
    fp32_max = max_batch.get("fp32")

    def pair(seed_v: float, our_v, pct: bool = False) -> str:
        f = (lambda v: f"{100 * v:+.1f}%") if pct else (lambda v: f"{v:.2f}x")
        return f"{f(seed_v)} / " + (f(float(our_v)) if our_v not in (None, "") else "n/a")

    lines = ["## Compared with the seed report", "",
             f"Seed: {TECHNIQUES_SEED['title']} - {TECHNIQUES_SEED['source']}; {TECHNIQUES_SEED['gpu']}. "
             "The hardware, model (vocabulary, block) and step count differ, so only ratios vs each study's own "
             "FP32 same-batch run are compared; each cell is seed / ours.", "",
             "| seed technique | ours | regime | step-time ratio (study's 'speedup') | tokens/s ratio | "
             "batch ratio | memory reduction | perplexity change |", "|---" * 8 + "|"]
    for s in techniques_seed_ratios():
        r = ours.get((s["technique"], s["regime"]), {})
        batch = r.get("batch_ratio_vs_fp32")
        if s["regime"] == "max" and fp32_max and s["technique"] in max_batch and max_batch[s["technique"]]:
            batch = max_batch[s["technique"]] / fp32_max           # largest batch vs FP32's largest
        lines.append(f"| {s['seed']} | {s['technique']} | {s['regime']} | "
                     f"{pair(s['step_time_ratio'], r.get('step_time_ratio_vs_fp32'))} | "
                     f"{pair(s['throughput_ratio'], r.get('speedup_vs_fp32'))} | {pair(s['batch_ratio'], batch)} | "
                     f"{pair(s['memory_reduction'], r.get('memory_reduction_vs_fp32'), True)} | "
                     f"{pair(s['ppl_change'], r.get('ppl_change_vs_fp32'), True)} |")
    bf = ours.get(("bf16-amp", "same"))
    lines += ["", "The seed has no BF16-AMP same-batch row (it did not fit at FP32's batch there); ours: "
              + (f"{bf['status']}, step-time ratio {float(bf['step_time_ratio_vs_fp32']):.2f}x, memory reduction "
                 f"{100 * float(bf['memory_reduction_vs_fp32']):+.1f}%." if bf else "not ok or not run."),
              "Seed peak memory is its 'Peak Memory (MB)' column (its Table 3 gives allocated 2,944 MB and "
              "reserved 44,098 MB for the same FP32 run, so that column is neither); ours is peak allocated."]
    return lines
