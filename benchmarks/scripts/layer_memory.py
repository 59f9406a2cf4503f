"""One decoder layer as the slide engine runs it: time and peak GPU memory of its forward and of
its recompute + backward, HF's layer against the lean one (models/lean_layer.py), eager and
compiled, on torch's or Liger's kernels, at the shapes that bind a 24 GiB GPU; beside it the
hardware's limit for the same work, and with --profile where the GPU's time goes.

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
    lean_ops             what ran the lean layer's RMSNorm, SwiGLU product and rotary
    compiled_graphs /    compiled variants: dynamo's graphs and its graph breaks by reason
    graph_breaks         (a Liger call under lean-liger-compiled is one, by design)
    profile              --profile: torch.profiler over one more recompute + backward: the GPU
                         time summed by kernel class (telemetry/kernel_classes.py: gemm,
                         attention, triton, elementwise, copy, other), the GEMMs' time over the
                         GEMM limit for the matmuls alone (gemm_over_hw), attention's TFLOP/s,
                         and the top kernels by time

Variants: hf / lean (eager) and -compiled (compile_layers on); lean-liger*: the lean layer on
Liger's RMSNorm, SwiGLU and rotary (lean_kernels liger, models/lean_kernels.py), compiled with
a graph break around each Liger call, or -traced with dynamo tracing into them; hf-liger*: HF's
layer with Liger's modules patched in by liger_kernel.transformers' own function for the family
(SlideFormer's way). The Liger variants need liger-kernel (pip install 'slidetune[liger]'); a
variant that fails (not installed, a compile error, OOM) leaves a row with its error.

    PYTHONPATH=src python benchmarks/scripts/layer_memory.py OUT_DIR [--shapes qwen3-8b:16x1024,...]
        [--variants hf-compiled,lean-compiled,lean-liger-compiled,...] [--profile]

Writes OUT_DIR/layer_memory.json (rows + machine) and layer_memory.md (the tables).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import statistics
import sys
import traceback
from pathlib import Path

import torch

import slidetune.models.lean_kernels as lean_kernels
from slidetune.bench.hardware_floor import hardware_compute, probe_hardware
from slidetune.device import Device
from slidetune.engine.config import RuntimeConfig
from slidetune.engine.slide.layer_runner import LayerRunner
from slidetune.models.load import RandomInit, fill_on_device, load_model
from slidetune.models.units import SplitModel
from slidetune.telemetry.events import EventTimer
from slidetune.telemetry.kernel_classes import KERNEL_CLASSES, profile_call
from slidetune.telemetry.flops import StepFlops
from slidetune.telemetry.machine import machine_info

GIB = 2**30
DEFAULT_SHAPES = "qwen3-8b:16x1024,qwen3-8b:64x1024,llama-3.1-8b:1x65536"
VARIANTS = {"hf": dict(lean_layer="off", compile_layers="off"),
            "hf-compiled": dict(lean_layer="off", compile_layers="on"),
            "lean": dict(lean_layer="on", compile_layers="off"),
            "lean-compiled": dict(lean_layer="on", compile_layers="on"),
            # the lean layer without its row tiles (all sequences at once: layer_row_tokens 0)
            "lean-untiled": dict(lean_layer="on", compile_layers="off", layer_row_tokens=0),
            "lean-untiled-compiled": dict(lean_layer="on", compile_layers="on", layer_row_tokens=0),
            "lean-liger": dict(lean_layer="on", lean_kernels="liger", compile_layers="off"),
            "lean-liger-compiled": dict(lean_layer="on", lean_kernels="liger", compile_layers="on"),
            "lean-liger-traced": dict(lean_layer="on", lean_kernels="liger", compile_layers="on"),
            "hf-liger": dict(lean_layer="off", compile_layers="off"),
            "hf-liger-compiled": dict(lean_layer="off", compile_layers="on")}
HF_LIGER = ("hf-liger", "hf-liger-compiled")
LIGER_TRACED = ("lean-liger-traced",)


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


@contextlib.contextmanager
def _hf_with_liger(split: SplitModel):
    """HF's layer with Liger's RMSNorm, SwiGLU MLP and rotary, as liger_kernel.transformers' own
    function for the family patches them in (the modules' forwards, and the modeling module's
    apply_rotary_pos_emb and classes); the modeling module gets its names back after."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    modeling = sys.modules[type(split.layer_modules[0]).__module__]
    saved = dict(vars(modeling))
    try:
        _apply_liger_kernel_to_instance(split.model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                        fused_linear_cross_entropy=False)
        if "forward" not in vars(split.layer_modules[0].input_layernorm):
            raise RuntimeError(f"liger_kernel.transformers patches no {split.config.model_type} model")
        yield
    finally:
        for name in set(vars(modeling)) - set(saved):
            delattr(modeling, name)
        for name, value in saved.items():
            if getattr(modeling, name, None) is not value:
                setattr(modeling, name, value)


@contextlib.contextmanager
def _kernels_of(variant: str, split: SplitModel):
    """What a variant changes beside its RuntimeConfig, for the time it runs."""
    if variant in HF_LIGER:
        with _hf_with_liger(split):
            yield
    elif variant in LIGER_TRACED:
        saved, lean_kernels.LIGER_UNDER_COMPILE = lean_kernels.LIGER_UNDER_COMPILE, "trace"
        try:
            yield
        finally:
            lean_kernels.LIGER_UNDER_COMPILE = saved
    else:
        yield


def _compile_stats(row: dict) -> None:
    counters = torch._dynamo.utils.counters
    row["compiled_graphs"] = counters["stats"]["unique_graphs"]
    row["graph_breaks"] = {reason.splitlines()[0][:160]: n for reason, n in counters["graph_break"].most_common(5)}


def measure(model: str, batch: int, seq: int, variants: list[str], reps: int,
            save=lambda rows: None) -> list[dict]:
    dev = torch.device("cuda")
    split = load_model(model, num_layers=1, with_tokenizer=False).split
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
    flops_attn = 3.5 * flops.layer_attention[0]             # recompute (1x) + backward (2.5x)
    gemm_hw_ms = (flops.layer_matmul[0] / hw["gemm_forward_tflops"]
                  + 2 * flops.layer_matmul[0] / hw["gemm_backward_tflops"]) / 1e9
    no_spans = EventTimer(Device(dev), enabled=False)       # the script times whole calls
    liger_installed = importlib.util.find_spec("liger_kernel") is not None
    rows = []
    for name in variants:
        rt = RuntimeConfig(mode="slide", dtype="bf16", device="cuda", mlp_tile_tokens=ARGS.tile, **VARIANTS[name])
        row = {"model": model, "batch": batch, "seq": seq, "tokens": batch * seq, "variant": name,
               "mlp_tile_tokens": ARGS.tile if rt.layer.lean_layer == "on" else None, **rates}
        if "liger" in name and not liger_installed:
            row["error"] = "liger-kernel is not installed (pip install 'slidetune[liger]')"
        else:
            # fresh modules: a variant's kernels go onto its own layer's instances
            fresh = load_model(model, num_layers=1, with_tokenizer=False).split
            views = fresh.layer_units[0].views(flat)
            leaves = {k: v.detach().requires_grad_(True) for k, v in views.items()}
            torch._dynamo.utils.counters.clear()
            try:
                with _kernels_of(name, fresh):
                    runner = LayerRunner(fresh, rt, dev)
                    row["lean_ops"] = runner.lean.ops if runner.lean is not None else None
                    with torch.no_grad():
                        row["fwd_ms"], row["fwd_peak_gib"] = _timed(lambda: runner.forward(0, views, x, kwargs), reps)

                    def rb():
                        return runner.recompute_backward(0, leaves, x, dy.clone(), kwargs, no_spans)
                    row["rb_ms"], row["rb_peak_gib"] = _timed(rb, reps)
                    row["hw_rb_ms"] = hw_rb_s * 1e3
                    row["rb_over_hw"] = row["rb_ms"] / row["hw_rb_ms"]
                    row["rb_tflops"] = flops_rb / (row["rb_ms"] / 1e3) / 1e12
                    if rt.compile_layers == "on":
                        _compile_stats(row)
                    if ARGS.profile:
                        prof = profile_call(rb, ARGS.profile_top)
                        cls = prof["classes"]
                        prof["gemm_hw_ms"] = gemm_hw_ms
                        prof["gemm_over_hw"] = cls["gemm"] / prof["gemm_hw_ms"]
                        prof["attention_tflops"] = flops_attn / (cls["attention"] / 1e3) / 1e12 \
                            if cls["attention"] else None
                        prof["kernel_over_rb"] = prof["kernel_ms"] / row["rb_ms"]
                        row["profile"] = prof
            except Exception as e:  # noqa: BLE001 - the row records it; the other variants still run
                row["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
                traceback.print_exc()
            runner = leaves = None
        rows.append(row)
        save(rows)                                 # each row as it comes: a call cut short keeps them
        print(json.dumps(row), flush=True)
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


CLASS_HEADS = {"gemm": "GEMM", "attention": "attention", "triton": "Triton", "elementwise": "aten elementwise",
               "copy": "copy/memset", "other": "other"}


def _profile_tables(rows: list[dict]) -> str:
    """The --profile rows: GPU time by kernel class, then each variant's top kernels."""
    profiled = [r for r in rows if "profile" in r]
    if not profiled:
        return ""
    out = ["", "GPU time of one profiled recompute + backward by kernel class, ms (telemetry/kernel_classes.py); "
           "GEMM / hw: the GEMMs' time over the matmuls' FLOPs at the probed rate; kernels / rb: the kernels' "
           "summed time over the timed call's (below 1: the GPU idles between kernels).", "",
           "| model | B x S | variant | rb ms | kernels ms | kernels / rb | "
           + " | ".join(CLASS_HEADS[c] for c in KERNEL_CLASSES) + " | GEMM / hw | attention TFLOP/s | graphs / breaks |",
           "|---|---|---|---|---|---|" + "---|" * len(KERNEL_CLASSES) + "---|---|---|"]
    for r in profiled:
        p = r["profile"]
        graphs = (f"{r['compiled_graphs']} / {sum(r['graph_breaks'].values())}" if "compiled_graphs" in r else "")
        attn = f"{p['attention_tflops']:.0f}" if p["attention_tflops"] else ""
        out.append(f"| {r['model']} | {r['batch']} x {r['seq']} | {r['variant']} | {r['rb_ms']:.1f} | "
                   f"{p['kernel_ms']:.1f} | {p['kernel_over_rb']:.2f} | "
                   + " | ".join(f"{p['classes'][c]:.1f}" for c in KERNEL_CLASSES)
                   + f" | {p['gemm_over_hw']:.2f} | {attn} | {graphs} |")
    for r in profiled:
        out += ["", f"Top kernels: {r['model']} {r['batch']} x {r['seq']} {r['variant']}", "",
                "| ms | calls | class | kernel |", "|---|---|---|---|"]
        out += [f"| {k['ms']:.2f} | {k['calls']} | {k['class']} | `{k['name'].replace('|', '/')}` |"
                for k in r["profile"]["top"]]
    return "\n".join(out) + "\n"


def main() -> int:
    global ARGS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="MODEL:BxS,... (default %(default)s)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="of " + ", ".join(VARIANTS))
    p.add_argument("--tile", type=int, default=RuntimeConfig().layer.mlp_tile_tokens, help="the lean layer's MLP tile")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler over one more recompute + backward per variant: GPU time by kernel class")
    p.add_argument("--profile-top", type=int, default=15, help="kernels listed per profiled variant")
    ARGS = p.parse_args()
    unknown = set(ARGS.variants.split(",")) - set(VARIANTS)
    if unknown:
        print(f"unknown variants {sorted(unknown)}; of {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
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
    text = _table(rows) + _profile_tables(rows)
    (out / "layer_memory.md").write_text(text)
    print(text)
    return 0


ARGS: argparse.Namespace


if __name__ == "__main__":
    sys.exit(main())
