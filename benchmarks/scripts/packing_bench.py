"""Packed rows with a per-document mask against plain causal SDPA: forward + backward time.

Issue 20 item 3's check (target: packed-with-mask at most 1.10x the causal time). One process,
one GPU: a stack of Qwen3-8B-shaped decoder layers (hidden 4096, 32 heads / 8 KV heads of 128,
FFN 12288, bf16; --layers of them, 4 by default: the layers are identical, more add time, not
information), rows of --seq-len 4096 tokens, each packed with ~--docs 10 documents of random
lengths. Every variant runs as slidetune's engine runs layers: the layer inputs come from
`SplitModel.layer_kwargs` (the base model's own mask and rotary code, from the batch's position
ids), then each layer's forward; backward from a random output gradient.

  causal   attn "sdpa", positions 0..S-1: no mask, SDPA's is_causal (flash) kernel
  masked   attn "slidetune_packed", positions restarting per document: transformers builds a
           FlexAttention BlockMask (create_block_mask, compiled as transformers does) and runs
           its flex_attention_forward (flex compiled by transformers' wrapper)

each eager, and with the layer forward under torch.compile (as compile_layers does; the
flex call is then part of the layer's graph). A step is the mask build (layer_kwargs) + forward +
backward; median of --iters steps after --warmup, each step with another document layout (a pool
of 4), so a mask that forced a recompile per micro-batch would show in the time and in
``graphs_during_timing`` (dynamo's unique-graph count over the timed steps; 0 expected).

Writes packing_bench.csv (one row per variant) and packing_bench.json (rows + machine: GPU name,
driver, torch, transformers) into OUT_DIR; prints a summary with the masked/causal ratio.
--smoke: the CPU, a tiny shape, a few steps (the masked path is SDPA with a boolean
block-diagonal mask there; flex has no CPU backward), eager only: checks the script, not speed.

Usage: python benchmarks/scripts/packing_bench.py OUT_DIR [--layers 4 --docs 10] [--smoke]
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import time

import torch

from slidetune.data.batch import document_positions
from slidetune.models.units import SplitModel
from slidetune.ops.packed_attention import use_packed_attention
from slidetune.telemetry.machine import machine_info


def qwen3_8b_config(layers: int, smoke: bool):
    from transformers import Qwen3Config
    if smoke:
        return Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)
    # Qwen3-8B's layer shape (models/presets.py "qwen3-8b"); a small vocabulary: the bench is the layers
    return Qwen3Config(vocab_size=1024, hidden_size=4096, intermediate_size=12288, num_hidden_layers=layers,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rope_theta=1_000_000.0)


def document_layouts(n: int, batch: int, seq: int, docs: int, seed: int = 0) -> list[torch.Tensor]:
    """n layouts, each [batch, seq] bool document starts: ~docs documents of random lengths a row."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        starts = torch.zeros(batch, seq, dtype=torch.bool)
        for b in range(batch):
            cuts = torch.randperm(seq - 1, generator=g)[:docs - 1] + 1
            starts[b, cuts] = True
        starts[:, 0] = True
        out.append(starts)
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def unique_graphs() -> int:
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def run_variant(split: SplitModel, name: str, compiled: bool, layouts: list[torch.Tensor], args,
                device: torch.device, dtype: torch.dtype) -> dict:
    model = split.model
    if name == "masked":
        use_packed_attention(model)
    else:
        model.set_attn_implementation("sdpa")
    layers = split.layer_modules
    # compile_layers compiles one layer call, keyed on the module (dynamic=False, as the engine)
    call = torch.compile(_layer_call, dynamic=False) if compiled else _layer_call
    B, S, d = args.batch, args.seq_len, split.hidden_size
    g = torch.Generator(device="cpu").manual_seed(1)
    x0 = (torch.randn(B, S, d, generator=g) * 0.5).to(device, dtype)
    grad = torch.randn(B, S, d, generator=g).to(device, dtype)

    def step(k: int) -> tuple[float, float]:
        sync(device)
        t0 = time.perf_counter()
        positions = document_positions(layouts[k % len(layouts)]).to(device) if name == "masked" else None
        kwargs = split.layer_kwargs(B, S, dtype, device, position_ids=positions)
        sync(device)
        t1 = time.perf_counter()
        x = x0.detach().requires_grad_(True)
        h = x
        for layer, kw in zip(layers, kwargs):
            h = call(layer, h, kw)
        h.backward(grad)
        sync(device)
        return t1 - t0, time.perf_counter() - t0

    for k in range(args.warmup):
        step(k)
    graphs_before = unique_graphs()
    times, masks = [], []
    for k in range(args.iters):
        mask_s, total_s = step(args.warmup + k)
        masks.append(mask_s)
        times.append(total_s)
    row = {"variant": name, "compiled_layers": compiled, "layers": len(layers), "batch": B, "seq_len": S,
           "docs_per_row": args.docs if name == "masked" else 1, "iters": args.iters,
           "step_ms_median": round(1e3 * statistics.median(times), 3),
           "step_ms_min": round(1e3 * min(times), 3),
           "mask_ms_median": round(1e3 * statistics.median(masks), 3),
           "graphs_during_timing": unique_graphs() - graphs_before,
           "attn_implementation": model.config._attn_implementation}
    if device.type == "cuda":
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        torch.cuda.reset_peak_memory_stats()
    print(f"{name:>7} {'compiled' if compiled else 'eager':>8}: {row['step_ms_median']:9.2f} ms/step "
          f"(mask {row['mask_ms_median']:.2f} ms, graphs during timing {row['graphs_during_timing']})", flush=True)
    return row


def _layer_call(layer: torch.nn.Module, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
    out = layer(x, **kwargs)                                      # [B, S, d]
    return out[0] if isinstance(out, tuple) else out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--docs", type=int, default=10, help="documents per row")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--no-compile", action="store_true", help="eager layers only")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape, few steps: checks the script")
    args = ap.parse_args()
    if args.smoke:
        args.layers, args.seq_len, args.batch, args.iters, args.warmup = 2, 64, 2, 2, 1
        args.no_compile = True
        device, dtype = torch.device("cpu"), torch.float32
    else:
        if not torch.cuda.is_available():
            raise SystemExit("packing_bench: no CUDA device; run with --smoke to check the script on the CPU")
        device, dtype = torch.device("cuda"), torch.bfloat16

    from transformers import AutoModelForCausalLM
    cfg = qwen3_8b_config(args.layers, args.smoke)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype)
    model.eval()        # no dropout; the layers still build autograd graphs (no torch.no_grad)
    model.requires_grad_(True)
    split = SplitModel(model)
    layouts = document_layouts(4, args.batch, args.seq_len, args.docs)

    rows = []
    for compiled in ([False] if args.no_compile else [False, True]):
        for name in ("causal", "masked"):
            rows.append(run_variant(split, name, compiled, layouts, args, device, dtype))

    ratios = {}
    for compiled in sorted({r["compiled_layers"] for r in rows}):
        by = {r["variant"]: r for r in rows if r["compiled_layers"] == compiled}
        ratios["compiled" if compiled else "eager"] = round(by["masked"]["step_ms_median"]
                                                          / by["causal"]["step_ms_median"], 4)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "packing_bench.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        w.writeheader()
        w.writerows(rows)
    result = {"machine": machine_info(), "smoke": args.smoke, "dtype": str(dtype).replace("torch.", ""),
              "shape": {"hidden": cfg.hidden_size, "heads": cfg.num_attention_heads,
                        "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
                        "ffn": cfg.intermediate_size, "layers": args.layers},
              "rows": rows, "ratio_masked_over_causal": ratios, "target_ratio": 1.10}
    with open(os.path.join(args.out_dir, "packing_bench.json"), "w") as f:
        json.dump(result, f, indent=2)
    gpu = result["machine"].get("gpu") or "CPU"
    for kind, ratio in ratios.items():
        verdict = "meets" if ratio <= 1.10 else "misses"
        print(f"packing_bench on {gpu}, {kind} layers: masked/causal = {ratio:.3f}x ({verdict} the <= 1.10x target"
              + (", smoke run: not a measurement" if args.smoke else "") + ")")


if __name__ == "__main__":
    main()
