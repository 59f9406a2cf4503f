"""`slidetune bench roofline`: the floor of a slide step for a workload (model, batch, seq).

floor = max(GPU compute, weight bytes H2D / H2D bandwidth, gradient bytes D2H / D2H
bandwidth, parameters / CPU AdamW rate), each term measured by bench.roofline's probes in
a separate process. Without CUDA only the CPU AdamW rate can be measured: the GPU probes
are reported as unavailable and the "floor" is the AdamW term alone (marked partial).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ...engine.tiers import TIERS
from .. import output as O
from ..baselines.proc import run_worker
from ..floor_probes import PROGRESS_VAR
from ..plots import bar_plot
from . import add_common_arguments

NAME = "roofline"
WORKER = "slidetune.bench.scenarios.roofline"


def floor_worker(spec: dict) -> dict:
    """Runs in its own process. spec: model, batch_size, seq_len, num_layers, adamw_n, copy, adamw."""
    from ...telemetry.machine import machine_info
    from ..floor_probes import probe_adamw, probe_disk, probing
    from ..roofline import floor
    with probing("host AdamW"):
        adamw = spec.get("adamw") or probe_adamw(n=spec.get("adamw_n", 128 * 2**20),
                                                 grad_download=spec.get("grad_download", "compute"),
                                                 host_adamw=spec.get("host_adamw", "dynamic"),
                                                 moments=spec.get("moments", "fp32"),
                                                 master=spec.get("master", "fp32"))
    out = {"spec": spec, "machine": machine_info(), "status": "ok"}
    if spec.get("disk_dir"):
        with probing("the disk tier's directory"):
            # under the tier's name, where its probe_of reads it back
            out[TIERS.with_files.name] = probe_disk(
                spec["disk_dir"], block_mb=spec.get("disk_block_mb", 64), threads=spec.get("disk_io_threads", 4),
                total_bytes=2 * 2**30 if torch.cuda.is_available() else 2**28,
                repeats=3)      # the fastest of 3: a floor takes the disk's best
    if torch.cuda.is_available() and spec.get("device", "auto") != "cpu":
        fl = floor(spec["model"], spec["batch_size"], spec["seq_len"], spec.get("num_layers"),
                   copy=spec.get("copy"), adamw=adamw, compile_layers=bool(spec.get("compile_layers")),
                   head_impl=spec.get("head_impl", "chunked"), layer=spec.get("layer", "both"))
        out.update(fl, partial=False)
        if spec.get("gemm"):        # plan --card: this GPU's GEMM rate on the layer's shapes (bench/cards.py)
            from ...models.load import load_model
            from ..hardware_floor import layer_gemm_shapes, probe_gemm
            split = load_model(spec["model"], num_layers=spec.get("num_layers"), with_tokenizer=False).split
            with probing("the GEMM rate on the layer's shapes (--card)"):
                out["gemm"] = probe_gemm(layer_gemm_shapes(split, spec["batch_size"] * spec["seq_len"]))
        return out
    from ...models.load import load_model
    split = load_model(spec["model"], num_layers=spec.get("num_layers"), with_tokenizer=False).split
    adamw_s = split.num_params() / adamw["adamw_params_per_s"]
    out.update(floor_s=adamw_s, bound_by="adamw_s", partial=True, adamw=adamw,
               terms={"compute_s": None, "h2d_s": None, "d2h_s": None, "adamw_s": adamw_s},
               unavailable={"compute_s": "needs CUDA", "h2d_s": "needs CUDA", "d2h_s": "needs CUDA"},
               params=split.num_params(), tokens_per_step=spec["batch_size"] * spec["seq_len"])
    return out


def measure_floor(model: str, batch: int, seq: int, num_layers: int | None = None, device: str = "auto",
                  adamw_n: int = 128 * 2**20, copy: dict | None = None, adamw: dict | None = None,
                  timeout_s: float = 1800, compile_layers: bool = False, grad_download: str = "compute",
                  host_adamw: str = "dynamic", disk_dir: str | None = None, disk_block_mb: int = 64,
                  disk_io_threads: int = 4, head_impl: str = "chunked", layer: str = "both",
                  moments: str = "fp32", master: str = "fp32", gemm: bool = False, progress: bool = False) -> dict:
    """disk_dir: also probe the disk tier's directory (bench.floor_probes.probe_disk) for the disk term.
    gemm: also probe the GPU's GEMM rate on the layer's shapes (hardware_floor.probe_gemm; plan --card).
    layer: the decoder layer the compute probe times (hf, lean or both: bench.floor_probes.probe_compute).
    moments, master: the host units' state format the AdamW probe keeps (--moments, --master).
    progress: each probe's seconds on stderr as it ends (floor_probes.probing; `plan --terms`)."""
    return run_worker(WORKER, dict(model=model, batch_size=batch, seq_len=seq, num_layers=num_layers,
                                   device=device, adamw_n=adamw_n, copy=copy, adamw=adamw,
                                   compile_layers=compile_layers, grad_download=grad_download,
                                   host_adamw=host_adamw, disk_dir=disk_dir, disk_block_mb=disk_block_mb,
                                   disk_io_threads=disk_io_threads, head_impl=head_impl, layer=layer,
                                   moments=moments, master=master, gemm=gemm),
                      timeout_s=timeout_s, env={PROGRESS_VAR: "1"} if progress else None, show_stderr=progress)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p, model="qwen3-8b", seq_len=1024, batch_size=16, steps=1, warmup=0)


def run(args: argparse.Namespace) -> Path:
    out = Path(args.out or "benchmarks/results/roofline")
    out.mkdir(parents=True, exist_ok=True)
    model, batch, seq, layers = args.model, args.batch_size, args.seq_len, args.num_layers
    device, adamw_n = args.device, 128 * 2**20
    if args.smoke:
        model = "tiny-qwen3" if args.model == "qwen3-8b" else args.model
        batch, seq, device, adamw_n = 2, 32, "cpu", 4 * 2**20
    r = measure_floor(model, batch, seq, layers, device, adamw_n)
    O.write_json(out / "roofline.json", r)
    print(_write_outputs(out, r), flush=True)
    return out


def rewrite_report(out: Path) -> Path:
    """roofline.csv, roofline.png and report.md again from roofline.json: `slidetune report DIR`."""
    out = Path(out)
    _write_outputs(out, json.loads((out / "roofline.json").read_text()))
    return out / "report.md"


def _rows(r: dict) -> list[dict]:
    """One row a floor term (seconds, a note), then the floor and the hardware floor."""
    terms = r.get("terms", {}) or {}
    unavailable = r.get("unavailable", {}) or {}
    rows = [dict(term=k, seconds=v, note=unavailable.get(k, "bound" if k == r.get("bound_by") else ""))
            for k, v in terms.items()]
    rows.append(dict(term="floor_s", seconds=r.get("floor_s"),
                     note=("partial: AdamW term only (no CUDA)" if r.get("partial") else f"bound by {r.get('bound_by')}")))
    if r.get("hw_floor_s") is not None:
        rows.append(dict(term="hw_floor_s", seconds=r["hw_floor_s"],
                         note=f"hardware floor: compute_s {O.fmt(r['hw_terms']['compute_s'], 4)} at the probed GEMM / "
                              f"SDPA rates; bound by {r['hw_bound_by']}"))
    return rows


def _write_outputs(out: Path, r: dict) -> str:
    """roofline.csv, roofline.png and report.md of one measure_floor result (the workload from its
    spec: a smoke run's sizes are what ran); returns the report's table for the console."""
    spec = r["spec"]
    model, batch, seq = spec["model"], spec["batch_size"], spec["seq_len"]
    rows = _rows(r)
    O.write_csv(out / "roofline.csv", [dict(model=model, batch_size=batch, seq_len=seq, **row) for row in rows], None,
                r.get("machine", {}))
    bar_plot(out / "roofline.png", [x["term"] for x in rows], {"seconds": [x["seconds"] for x in rows]},
             "seconds per step", f"Floor terms: {model}, batch {batch}, seq {seq}")
    lines = [f"# Roofline: {model}, batch {batch}, seq {seq}", "", *O.machine_lines(r.get("machine", {})), "",
             "floor = max(GPU compute [L x (fwd + recompute + bwd) of one resident layer + head + embedding], "
             "weight bytes H2D / pinned H2D bandwidth, gradient bytes D2H / D2H bandwidth, "
             "parameters / host AdamW rate (the engine's kernel)); each term measured by a probe (bench/roofline.py). "
             "hw_floor_s: the same with compute at the step's FLOPs (every layer recomputed) over the probed BF16 "
             "GEMM and SDPA rates (GPU only).", "",
             f"status: {r.get('status')} {r.get('error') or ''}", ""]
    lines += O.md_table(rows, ["term", "seconds", "note"], {"seconds": 4})
    for key in ("copy", "adamw"):
        if r.get(key):
            lines += ["", f"{key}: " + ", ".join(f"{k}={O.fmt(v, 3)}" for k, v in r[key].items())]
    hw = r.get("hardware")
    if hw:
        lines += ["", "hardware: " + ", ".join(f"{k}={O.fmt(v, 1)}" for k, v in hw.items() if k.endswith("_tflops"))
                  + " (TFLOP/s; bench.roofline.probe_hardware)"]
    comp = r.get("compute")
    if comp:
        lines += ["", "compute: " + ", ".join(f"{k}={O.fmt(v, 4)}" for k, v in comp.items())]
    lines.append("")
    (out / "report.md").write_text("\n".join(lines))
    return "\n".join(lines[-len(rows) - 4:])


if __name__ == "__main__":
    import sys
    from ..baselines.proc import worker_main
    sys.exit(worker_main(floor_worker))
