"""`slidetune train | plan | bench` command line.

Expected failures (bad data, unknown model, a configuration that does not fit, a failed
save, a non-finite loss, ...) print `slidetune: error: <what and where>` and exit with
status 2; an interrupted run exits with 130. Set SLIDETUNE_TRACEBACK=1 to get the
traceback as well.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .config import add_config_flags, config_from_args, config_to_dict


def _train(ns) -> int:
    from .train import train
    cfg = config_from_args(ns)
    print("resolved config:\n" + json.dumps(config_to_dict(cfg), indent=2), flush=True)
    summary = train(cfg)
    print(json.dumps(summary.__dict__, indent=2))
    return 130 if summary.interrupted else 0


def _plan(ns) -> int:
    """Print the memory estimate of a configuration without allocating anything."""
    from .engine.fit import estimate_memory
    from .models.load import load_model
    cfg = config_from_args(ns)
    loaded = load_model(cfg.model, num_layers=cfg.num_layers, with_tokenizer=False)
    est = estimate_memory(loaded.split, cfg.runtime, batch_size=cfg.batch_size, seq_len=cfg.data.seq_len,
                          grad_accum=cfg.grad_accum, max_grad_norm=cfg.max_grad_norm)
    gib = 2**30
    print(f"model {cfg.model}: {loaded.split.num_params() / 1e9:.3f} B parameters, mode {cfg.runtime.mode}")
    print(f"GPU  {est.gpu_bytes / gib:8.2f} GiB")
    for k, v in est.gpu_parts.items():
        print(f"   {k:<28} {v / gib:8.2f}")
    print(f"host {est.host_bytes / gib:8.2f} GiB (pinned {est.pinned_bytes / gib:.2f})")
    for k, v in est.host_parts.items():
        print(f"   {k:<28} {v / gib:8.2f}")
    return 0


def _bench(ns) -> int:
    from pathlib import Path
    if ns.scenario == "runtime":
        from .bench.runtime_check import run
        parts = tuple(ns.parts.split(","))
        checks = run(Path(ns.out), smoke=ns.smoke, big_model=ns.big_model, big_batch=ns.big_batch, parts=parts)
        print(json.dumps(checks, indent=1, default=float))
        return 0
    if ns.scenario == "roofline":
        from .bench.roofline import floor
        fl = floor(ns.big_model, ns.big_batch, ns.seq_len)
        Path(ns.out).mkdir(parents=True, exist_ok=True)
        (Path(ns.out) / "roofline.json").write_text(json.dumps(fl, indent=1))
        print(json.dumps(fl, indent=1))
        return 0
    raise ValueError(f"unknown scenario {ns.scenario!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slidetune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="fine-tune a model (default: SmolLM2-135M on the built-in corpus)",
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_config_flags(p_train)
    p_train.set_defaults(func=_train)
    p_plan = sub.add_parser("plan", help="print the memory a configuration needs, allocating nothing")
    add_config_flags(p_plan)
    p_plan.set_defaults(func=_plan)
    p_bench = sub.add_parser("bench", help="run a benchmark scenario (each configuration in its own process)")
    p_bench.add_argument("scenario", choices=["runtime", "roofline"])
    p_bench.add_argument("--out", default="benchmarks/results/latest")
    p_bench.add_argument("--smoke", action="store_true", help="tiny sizes that run on the CPU in seconds")
    p_bench.add_argument("--parts", default="memory,big")
    p_bench.add_argument("--big-model", default="qwen3-8b")
    p_bench.add_argument("--big-batch", type=int, default=16)
    p_bench.add_argument("--seq-len", type=int, default=1024)
    p_bench.set_defaults(func=_bench)
    return parser


# Errors whose message is the interface (bad input, a refused configuration, I/O):
# shown without a traceback. Anything else is a bug and keeps its traceback.
_CLEAN_ERRORS = (ValueError, OSError, RuntimeError, ImportError, KeyError)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return ns.func(ns)
    except KeyboardInterrupt:
        print("slidetune: interrupted", file=sys.stderr)
        return 130
    except _CLEAN_ERRORS as e:
        if os.environ.get("SLIDETUNE_TRACEBACK"):
            import traceback
            traceback.print_exc()
        msg = e.args[0] if isinstance(e, KeyError) and len(e.args) == 1 else e
        print(f"slidetune: error: {type(e).__name__}: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
