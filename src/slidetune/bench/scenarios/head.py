"""T1M3 (seeds/004): full / chunked / fused cross-entropy at the output layer, seq 1024 and longer.

Default: Qwen3-1.7B shape, batch 2, seqs 1024 and 4096, slide mode. Slide mode is the
default because it streams the weights and keeps only layer checkpoints on the GPU, so the
(B, S, V) logits of the head dominate the GPU peak (as in the seed, where the head was
the remaining spike); in slide mode the "head" span holds the head's forward and backward
together. `--mode ckpt` splits them ("head" = forward, "head_backward" = backward), with the
whole model resident. fused runs only where ops.cross_entropy.available_impls() has it;
elsewhere its row says "unavailable". Reports peaks, the memory timeline and head time.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from . import common

NAME = "head"
DEFAULTS = dict(model="qwen3-1.7b", seq_len=1024, batch_size=2, steps=5, warmup=2)


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.ensure_common_arguments(p, DEFAULTS)
    p.add_argument("--impls", default="full,chunked,fused")
    p.add_argument("--seqs", default="1024,4096", help="comma list of sequence lengths (overrides --seq-len)")
    p.add_argument("--mode", default="slide", choices=("slide", "ckpt", "gpu"))
    # 1024 tokens x 152k vocab: ~0.3 GB of bf16 logits per chunk, well below full (B*S) logits
    p.add_argument("--chunk-tokens", type=int, default=1024, help="tokens per logits chunk for 'chunked'")


def specs(args) -> list:
    from ...ops.cross_entropy import available_impls
    b = common.base(args)
    seqs = [int(s) for s in str(args.seqs).split(",") if s.strip()] or [b["seq_len"]]
    chunk = args.chunk_tokens
    if getattr(args, "smoke", False):
        seqs, chunk = [32], 16      # one length keeps the smoke near 20 s
    have = set(available_impls())
    out = []
    for seq in seqs:
        for impl in [i.strip() for i in args.impls.split(",") if i.strip()]:
            spec = common.make_spec(f"{impl}-s{seq}", b, args,
                                    dict(mode=args.mode, head_impl=impl, head_chunk_tokens=chunk,
                                         **({"cache_units": 3} if args.mode == "slide" else {})), seq_len=seq)
            out.append((spec, impl in have))
    return out


def run(args: argparse.Namespace) -> Path:
    out = common.out_dir(args, NAME)
    results = []
    for spec, ok in specs(args):
        if ok:
            results += common.run_specs([spec], NAME)
        else:
            results.append(common.unavailable(spec, "fused cross-entropy needs CUDA with Triton or liger-kernel"))
    base = next((r["spec"]["name"] for r in results if r["spec"]["name"].startswith("full-")), None)
    return common.finish(out, NAME, args, results, {"baseline": base, "head_mode": args.mode})
