"""T1M2 (seeds/001): recomputation off / on / selective, ckpt mode, Qwen3-1.7B shape, seq 256, batch 1.

Configurations: none (no recompute), all, a list of layers (default: the middle third)
and every k-th layer (default every:2). Reports per-layer forward/backward/recompute means
with 95% t CIs, per-step wall time and its delta vs none, peaks, and the top-k layers by
total (forward + backward + recompute) delta vs none. Recompute time is its own phase:
the engine times a checkpointed layer's re-run during backward as "recompute" and cuts it
out of that layer's backward span (engine/plain.py).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from . import common

NAME = "recompute"
DEFAULTS = dict(model="qwen3-1.7b", seq_len=256, batch_size=1, steps=10, warmup=3)


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.ensure_common_arguments(p, DEFAULTS)
    p.add_argument("--configs", default="none,all,list,every:2",
                   help="comma list of none, all, list, every:K")
    p.add_argument("--layers", default=None, help="layers of the 'list' config, e.g. 9,10,11 (default: middle third)")
    p.add_argument("--top-k", type=int, default=5, help="layers listed by largest total-time delta vs none")


def num_layers(model: str, override: int | None) -> int:
    if override:
        return override
    from ...models.presets import PRESETS, preset_config
    if model in PRESETS:
        return preset_config(model).num_hidden_layers
    from ...models.load import load_model
    return load_model(model, with_tokenizer=False).split.num_layers


def middle_third(L: int) -> str:
    lo, hi = L // 3, max(L // 3 + 1, (2 * L) // 3)
    return ",".join(str(i) for i in range(lo, hi))


def specs(args) -> list:
    b = common.base(args)
    L = num_layers(b["model"], args.num_layers)
    out = []
    for c in [c.strip() for c in args.configs.split(",") if c.strip()]:
        sel = (args.layers or middle_third(L)) if c == "list" else c
        out.append(common.make_spec(c, b, args, dict(mode="ckpt", recompute=sel)))
    return out


def run(args: argparse.Namespace) -> Path:
    out = common.out_dir(args, NAME)
    sp = specs(args)
    results = common.run_specs(sp, NAME)
    extra = {"baseline": "none" if any(s.name == "none" for s in sp) else (sp[0].name if sp else None),
             "top_k": args.top_k,
             "selections": {s.name: s.runtime["recompute"] for s in sp}}
    return common.finish(out, NAME, args, results, extra)
