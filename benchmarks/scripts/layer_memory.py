"""One decoder layer as the slide engine runs it: time and peak GPU memory of its forward and of
its recompute + backward, HF's layer against the lean one (models/lean_layer.py), eager and
compiled, at the shapes that bind a 24 GiB GPU; beside it the hardware's limit for the same work.

Each variant goes through `engine.slide.layer_runner.LayerRunner`, the engine's only way of
running a layer, on a layer built on the GPU in BF16 (random weights) with the engine's layer
kwargs (SDPA, causal, no padding mask: full rows). Measured per variant and shape:

    fwd_ms / rb_ms       median of `--reps` CUDA-event-timed calls (after 2 warm-up calls, the
                         compile's included) of the no-grad forward and of recompute + backward
    fwd_peak_gib /       the allocator's peak during one call above what was allocated before it
    rb_peak_gib          (the layer's input, its gradient, the weights): the working set the fit
                         check's "layer working set" phase stands for
    hw_rb_ms             the recompute + backward's FLOPs (telemetry.flops.StepFlops: the layer's
                         matmuls once forward and twice backward, its causal attention once forward
                         and 2.5x backward) at the rates bench.roofline.probe_hardware measures at
                         this shape (BF16 GEMMs on the layer's own shapes, SDPA causal), priced by
                         bench.roofline.hardware_compute: what the GPU could do
    rb_over_hw           rb_ms / hw_rb_ms
    gemm_*/sdpa_*_tflops the probed rates (forward, backward)

    PYTHONPATH=src python benchmarks/scripts/layer_memory.py OUT_DIR [--shapes qwen3-8b:16x1024,...]

Writes OUT_DIR/layer_memory.json (rows + machine) and layer_memory.md (a table).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from slidetune.bench.roofline import hardware_compute, probe_hardware
from slidetune.device import Device
from slidetune.engine.config import RuntimeConfig
from slidetune.engine.slide.layer_runner import LayerRunner
from slidetune.models.load import RandomInit, fill_on_device, load_model
from slidetune.telemetry.events import EventTimer
from slidetune.telemetry.flops import StepFlops
from slidetune.telemetry.machine import machine_info

GIB = 2**30
DEFAULT_SHAPES = "qwen3-8b:16x1024,qwen3-8b:64x1024,llama-3.1-8b:1x65536"
VARIANTS = {"hf": dict(lean_layer="off", compile_layers="off"),
            "hf-compiled": dict(lean_layer="off", compile_layers="on"),
            "lean": dict(lean_layer="on", compile_layers="off"),
            "lean-compiled": dict(lean_layer="on", compile_layers="on")}


def _timed(fn, reps: int) -> tuple[float, float]:
    """(median ms, peak GiB above the allocation before the call) over `reps` calls after 2 warm-ups."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times, peaks = [], []
    for _ in range(reps):
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        peaks.append((torch.cuda.max_memory_allocated() - base) / GIB)
    return statistics.median(times), max(peaks)


def measure(model: str, batch: int, seq: int, variants: list[str], reps: int,
            save=lambda rows: None) -> list[dict]:
    dev = torch.device("cuda")
    loaded = load_model(model, num_layers=1, with_tokenizer=False)
    split = loaded.split
    unit = split.layer_units[0]
    flat = fill_on_device(RandomInit(0), unit, dev).to(torch.bfloat16)       # [numel]
    kwargs = split.layer_kwargs(batch, seq, torch.bfloat16, dev)[0]
    x = torch.randn(batch, seq, split.hidden_size, device=dev, dtype=torch.bfloat16)    # [B, S, d]
    dy = torch.randn_like(x)
    hw = probe_hardware(split, batch, seq)              # the GPU's rates at this layer's shapes
    rates = {k: v for k, v in hw.items() if k.endswith("_tflops")}
    flops = StepFlops.from_dict(hw["flops"])
    # recompute (one forward) + backward (2x the matmuls, 2.5x the attention) of the one layer
    flops_rb = 3 * flops.layer_matmul[0] + 3.5 * flops.layer_attention[0]
    hw_rb_s = hardware_compute(hw, {0})["layer_recompute_backward_s"]
    no_spans = EventTimer(Device(dev), enabled=False)       # the script times whole calls
    rows = []
    for name in variants:
        runner = LayerRunner(split, RuntimeConfig(mode="slide", dtype="bf16", device="cuda",
                                                  mlp_tile_tokens=ARGS.tile, **VARIANTS[name]))
        views = unit.views(flat)
        leaves = {k: v.detach().requires_grad_(True) for k, v in views.items()}
        row = {"model": model, "batch": batch, "seq": seq, "tokens": batch * seq, "variant": name,
               "mlp_tile_tokens": ARGS.tile if runner.lean is not None else None, **rates}
        try:
            with torch.no_grad():
                row["fwd_ms"], row["fwd_peak_gib"] = _timed(lambda: runner.forward(0, views, x, kwargs), reps)
            row["rb_ms"], row["rb_peak_gib"] = _timed(
                lambda: runner.recompute_backward(0, leaves, x, dy.clone(), kwargs, no_spans), reps)
            row["hw_rb_ms"] = hw_rb_s * 1e3
            row["rb_over_hw"] = row["rb_ms"] / row["hw_rb_ms"]
            row["rb_tflops"] = flops_rb / (row["rb_ms"] / 1e3) / 1e12
        except torch.OutOfMemoryError as e:
            row["error"] = f"OOM: {str(e).splitlines()[0][:200]}"
        rows.append(row)
        save(rows)                                 # each row as it comes: a call cut short keeps them
        print(json.dumps(row), flush=True)
        del runner, leaves
        torch._dynamo.reset()
        torch.cuda.empty_cache()                   # between variants, outside the timed calls
    return rows


def _table(rows: list[dict]) -> str:
    out = ["hw rb ms: the recompute + backward's FLOPs at the BF16 GEMM and SDPA rates probed at each shape "
           "(gemm / sdpa: forward, backward TFLOP/s).", "",
           "| model | B x S | variant | fwd ms | fwd peak GiB | rb ms | rb peak GiB | hw rb ms | rb / hw | rb TFLOP/s "
           "| gemm | sdpa |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['batch']} x {r['seq']} | {r['variant']} | {r['error']} |||||||||")
            continue
        out.append(f"| {r['model']} | {r['batch']} x {r['seq']} | {r['variant']} | {r['fwd_ms']:.1f} | "
                   f"{r['fwd_peak_gib']:.2f} | {r['rb_ms']:.1f} | {r['rb_peak_gib']:.2f} | {r['hw_rb_ms']:.1f} | "
                   f"{r['rb_over_hw']:.2f} | {r['rb_tflops']:.0f} | {r['gemm_forward_tflops']:.0f}, "
                   f"{r['gemm_backward_tflops']:.0f} | {r['sdpa_forward_tflops']:.0f}, "
                   f"{r['sdpa_backward_tflops']:.0f} |")
    return "\n".join(out) + "\n"


def main() -> int:
    global ARGS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="MODEL:BxS,... (default %(default)s)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="of " + ", ".join(VARIANTS))
    p.add_argument("--tile", type=int, default=RuntimeConfig().mlp_tile_tokens, help="the lean layer's MLP tile")
    p.add_argument("--reps", type=int, default=5)
    ARGS = p.parse_args()
    if not torch.cuda.is_available():
        print("layer_memory.py needs CUDA", file=sys.stderr)
        return 2
    out = Path(ARGS.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    machine, rows = machine_info(), []

    def save(more: list[dict]) -> None:
        (out / "layer_memory.json").write_text(json.dumps({"machine": machine, "args": vars(ARGS),
                                                           "rows": rows + more}, indent=2))
    for shape in ARGS.shapes.split(","):
        model, bs = shape.split(":")
        b, s = (int(v) for v in bs.split("x"))
        rows += measure(model, b, s, ARGS.variants.split(","), ARGS.reps, save)
    (out / "layer_memory.md").write_text(_table(rows))
    print(_table(rows))
    return 0


ARGS: argparse.Namespace


if __name__ == "__main__":
    sys.exit(main())
