"""The preference head's cost against SFT's, the head alone on the GPU: where DPO's extra time a step goes.

Measured on the H200 (NOTES.md "Preference tuning"): a DPO step of Qwen3-8B's shape, 8 pairs x 1024
under 24 GiB, is 0.105 s longer than SFT's 16 x 1024, while the head's first pass (each token's CE,
the forward alone) was predicted at ~0.03-0.04 s (one of the head's three GEMMs). This script times,
with the engine's own head functions (ops.cross_entropy, objectives.preference.head_scales) on
random BF16 tensors of the model's head shape:

    sft_all_valid   linear_cross_entropy_grads, every token a label, one scale (SFT's packed rows)
    sft_masked      the same with DPO's labels (prompts and padding ignored: the gathered chunks)
    first_pass      linear_token_losses (each token's CE, no gradient)
    scales          head_scales: the sequences' sums, the objective's coefficients, each token's factor
    second_pass     linear_cross_entropy_grads with the per-token factor
    dpo_total       first_pass + scales + second_pass, as one step's head runs them

each the median of --reps CUDA-event-timed calls after two warm-up calls (wall time, the host's
syncs included), and the GPU time by kernel class of one sft_all_valid and one dpo_total
(torch.profiler, telemetry/kernel_classes.py).

    PYTHONPATH=src python benchmarks/scripts/preference_head.py OUT.json [--hidden 4096
        --vocab 151936 --pairs 8 --seq 1024 --prompt 512 --reps 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from slidetune.objectives.preference import PairTokens, PreferenceConfig, head_scales
from slidetune.ops.cross_entropy import auto_impl, linear_cross_entropy_grads, linear_token_losses
from slidetune.telemetry.kernel_classes import profile_call


def pair_labels(pairs: int, seq: int, prompt: int, gen: torch.Generator) -> tuple[torch.Tensor, PairTokens]:
    """The bench's DPO labels [2P * S] (bench/measure.py: each row's first `prompt` tokens its prompt,
    ignored, the rest its completion, no padding); and the PairTokens the head's scales read."""
    rows = 2 * pairs
    labels = torch.full((rows, seq), -100, dtype=torch.long)
    labels[:, prompt:] = torch.randint(0, 1000, (rows, seq - prompt), generator=gen)
    seq_of = torch.arange(rows).repeat_interleave(seq)                     # [N]
    completion = labels.reshape(-1) != -100                                 # [N]
    tokens = PairTokens(seq_of=seq_of, completion=completion, nll=torch.zeros_like(completion),
                        ref_logps=-torch.rand(rows, generator=gen, dtype=torch.float64) * 500,
                        pairs_in_step=pairs, nll_tokens_in_step=0)
    return labels.reshape(-1), tokens


def timed(fn, reps: int) -> float:
    """Median ms of `reps` calls after two warm-up calls, each synchronized (wall time on the GPU's clock)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args(argv)
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    n = 2 * a.pairs * a.seq
    hidden = (torch.randn(n, a.hidden, generator=gen) * 0.5).to(dev, bf16)          # [N, d]
    weight = (torch.randn(a.vocab, a.hidden, generator=gen) * 0.02).to(dev, bf16)   # [V, d]
    labels, tokens = pair_labels(a.pairs, a.seq, a.prompt, gen)
    labels, tokens = labels.to(dev), tokens.to(dev)
    all_valid = torch.randint(0, 1000, (n,), generator=gen).to(dev)
    impl, cfg = auto_impl("cuda"), PreferenceConfig("dpo")

    def sft(lab):
        return lambda: linear_cross_entropy_grads(hidden, weight, lab, 1.0 / n, impl=impl)

    def first():
        return linear_token_losses(hidden, weight, labels, impl=impl)

    ce = first()

    def scales():
        return head_scales(cfg, ce, tokens)

    scale = scales()[1]

    def second():
        return linear_cross_entropy_grads(hidden, weight, labels, scale, impl=impl)

    def dpo_total():
        token_ce = linear_token_losses(hidden, weight, labels, impl=impl)
        s = head_scales(cfg, token_ce, tokens)[1]
        return linear_cross_entropy_grads(hidden, weight, labels, s, impl=impl)

    ms = {name: timed(fn, a.reps) for name, fn in (
        ("sft_all_valid", sft(all_valid)), ("sft_masked", sft(labels)), ("first_pass", first),
        ("scales", scales), ("second_pass", second), ("dpo_total", dpo_total))}
    gemm_tflop = 2 * n * a.hidden * a.vocab / 1e12       # one of the head's GEMMs over every row
    out = {"shape": vars(a), "impl": impl, "completion_tokens": int(tokens.completion.sum()),
           "ms": ms, "dpo_minus_sft_ms": ms["dpo_total"] - ms["sft_all_valid"],
           "one_gemm_tflop": gemm_tflop,
           "profile": {"sft_all_valid": profile_call(sft(all_valid), top=8), "dpo_total": profile_call(dpo_total, top=8)},
           "machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}}
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] for k in ("impl", "completion_tokens", "ms", "dpo_minus_sft_ms")}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
