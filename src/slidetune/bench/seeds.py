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


def _num(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) and b != 0 else math.nan


def _our_names(scenario: str, summary: list[dict]) -> dict[str, str]:
    seed = SEEDS[scenario]
    names = dict(seed["ours"])
    if scenario == "head":
        seqs = sorted({int(_num(r.get("seq_len"))) for r in summary if r.get("status") == "ok"
                       and not math.isnan(_num(r.get("seq_len")))})
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
        o = _ratio(_num(a.get(metric)), _num(b.get(metric)))
        rows.append({"ratio": label, "seed": s, "ours": o, "ours_over_seed": _ratio(o, s),
                     "ours_configs": f"{names[num]}/{names[den]}"})
    return rows


def seed_table_markdown(scenario: str) -> list[str]:
    seed = SEEDS[scenario]
    metrics = sorted({m for row in seed["rows"].values() for m in row})
    lines = [f"Seed: {seed['title']} - {seed['source']}; {seed['gpu']}.", "",
             "| seed config | " + " | ".join(metrics) + " |", "|---" * (len(metrics) + 1) + "|"]
    for name, row in seed["rows"].items():
        lines.append(f"| {name} | " + " | ".join(f"{row[m]:g}" if m in row else "" for m in metrics) + " |")
    if seed.get("notes"):
        lines += ["", seed["notes"]]
    return lines
