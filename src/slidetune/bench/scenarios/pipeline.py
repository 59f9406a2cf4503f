"""`slidetune bench pipeline`: A/B the slide pipeline's knobs on one workload, profiled.

Each variant is a set of RuntimeConfig overrides on slide mode; each runs in its own
process, with the measured steps timed as everywhere else, then three extra steps under
torch.profiler (all threads) whose trace is reduced to: the fraction of the step during
which the GPU computes, per-stream busy time, how long the kernels off the compute stream
(GPU casts on the copy streams) take, and a Gantt chart of one step per stream and thread.

The default workload is a Qwen3-8B-wide model cut to 12 layers: every decoder layer of the
8B model behaves the same in the pipeline, so 12 layers show the steady state at a third of
the start-up cost (random init, page-locking the host store).

--variants: "name:key=value,key=value;name2:..." ("base:" = the defaults).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ...engine.config import RuntimeConfig, runtime_fields
from ...fields import base_type
from . import common

NAME = "pipeline"
DEFAULTS = dict(model="qwen3-8b", seq_len=1024, batch_size=16, steps=4, warmup=2)
DEFAULT_VARIANTS = ("base:;"
                    "chunk256:chunk_mb=256;"
                    "fp32-grad-slots:grad_slot_dtype=fp32;"
                    "cast-in-compute:upload_cast_stream=compute,grad_slot_dtype=fp32;"
                    "cast-in-compute-chunk256:upload_cast_stream=compute,grad_slot_dtype=fp32,chunk_mb=256;"
                    "cpu-casts:cast_on=cpu")


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.ensure_common_arguments(p, DEFAULTS)
    p.set_defaults(num_layers=12)
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="'name:key=value,...;name2:...' (RuntimeConfig fields)")
    p.add_argument("--head-chunk-tokens", type=int, default=4096)


def parse_variants(text: str, base: dict | None = None) -> list[tuple[str, dict]]:
    """'a:chunk_mb=256,cache_units=4;b:' -> [("a", {"chunk_mb": 256, "cache_units": 4}), ("b", {})].
    base: settings every variant runs with (e.g. --runtime's), checked together with each variant's."""
    fields = runtime_fields()
    out = []
    for part in [p.strip() for p in text.split(";") if p.strip()]:
        name, _, body = part.partition(":")
        over: dict = {}
        for kv in [x.strip() for x in body.split(",") if x.strip()]:
            key, eq, value = kv.partition("=")
            if not eq or key not in fields:
                raise ValueError(f"variant {name!r}: {kv!r} is not key=value with a RuntimeConfig field "
                                 f"(fields: {', '.join(sorted(fields))})")
            # Literal[-1, 1, 2]: an int; float | None (pcie_gbps): a float, or none
            typ, optional = base_type(fields[key].type)
            none = optional and typ is not str and value.lower() == "none"      # a str's "none" is a word
            over[key] = (None if none else int(value) if typ is int else float(value) if typ is float else
                         value.lower() in ("1", "true", "yes") if typ is bool else value)
        RuntimeConfig(**{**(base or {}), **over})        # reject bad values here, not in a worker process
        out.append((name.strip(), over))
    if not out:
        raise ValueError("--variants names no variant")
    return out


def specs(args) -> list:
    b = common.base(args)
    variants = parse_variants(args.variants)
    if args.smoke:
        variants = variants[:2]
    out = []
    for name, over in variants:
        rt = dict(mode="slide", head_chunk_tokens=args.head_chunk_tokens, **over)
        if b["device"] == "cpu":
            rt.update(dtype="fp32", cast_on="auto" if over.get("cast_on") == "gpu" else over.get("cast_on", "auto"))
        out.append(common.make_spec(name, b, args, rt, profile=True,
                                    num_layers=None if args.smoke else args.num_layers))
    return out


def run(args: argparse.Namespace) -> Path:
    out = common.out_dir(args, NAME)
    results = common.run_specs(specs(args), NAME)
    return common.finish(out, NAME, args, results, {"baseline": results[0]["spec"]["name"] if results else None})
