"""The disk tier's directory, probed three ways (issue 19: why the floor's disk term missed).

1. cold: the timed write goes into fresh extents (probe_disk warm_passes=0);
2. warm: one untimed write of the file first, so the timed passes rewrite (warm_passes=1);
3. warm under load: the same while the host AdamW loop runs on every other core, as during a
   slide step (the tier's I/O threads then share the cores and the memory bus with it).

--grid instead: the warm probe's patterns side by side (LOG.md 2026-11-26 "On the GPU: the fused gradient sum": the floor's mixed rate read
1.45 GiB/s where the tier drew 1.79): how the mixed pass shares its threads (split: half read,
half write; pool: one queue, as the tier's pool), one file or several (the tier has one per
unit), 4 or 8 threads.

    PYTHONPATH=src python benchmarks/scripts/disk_probe.py OUT.json [--dir D] [--gib 4] [--grid]
"""
from __future__ import annotations

import argparse
import json
import threading
import time

import torch

from slidetune.bench.floor_probes import _adamw_rate, probe_disk
from slidetune.telemetry.machine import machine_info


def adamw_load(stop: threading.Event, rates: list[float], n: int) -> None:
    """The host AdamW's loop, over and over until `stop`: its params/s each round."""
    while not stop.is_set():
        rates.append(_adamw_rate(n, 3, torch.bfloat16, "dynamic"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--dir", default="/var/tmp/slidetune_disk")
    ap.add_argument("--gib", type=float, default=4)
    ap.add_argument("--block-mb", type=int, default=64)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--adamw-params", type=int, default=128 * 2**20)
    ap.add_argument("--grid", action="store_true", help="the warm probe's patterns side by side, nothing else")
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    size = int(a.gib * 2**30)
    out = {"machine": machine_info(), "gib": a.gib, "block_mb": a.block_mb, "threads": a.threads}
    if a.grid:
        out["grid"] = []
        for mixed in ("split", "pool"):
            for files in (1, 8):
                for threads in (4, 8):
                    r = probe_disk(a.dir, size, a.block_mb, threads, warm_passes=1, repeats=a.repeats,
                                   files=files, mixed=mixed)
                    out["grid"].append(r)
                    print(f"mixed={mixed:5s} files={files} threads={threads}: write {r['write_gib_s']:.2f}  "
                          f"read {r['read_gib_s']:.2f}  mixed {r['mixed_gib_s']:.2f} GiB/s  "
                          f"(passes {r['passes']['mixed']})", flush=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
        return
    out["cold"] = probe_disk(a.dir, size, a.block_mb, a.threads, warm_passes=0)
    out["warm"] = probe_disk(a.dir, size, a.block_mb, a.threads, warm_passes=1)
    out["adamw_alone_params_per_s"] = _adamw_rate(a.adamw_params, 5, torch.bfloat16, "dynamic")
    stop, rates = threading.Event(), []
    load = threading.Thread(target=adamw_load, args=(stop, rates, a.adamw_params), daemon=True)
    load.start()
    time.sleep(1.0)
    out["warm_under_adamw"] = probe_disk(a.dir, size, a.block_mb, a.threads, warm_passes=1)
    stop.set()
    load.join()
    out["adamw_under_disk_params_per_s"] = sorted(rates)[len(rates) // 2] if rates else None
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    for k in ("cold", "warm", "warm_under_adamw"):
        r = out[k]
        print(f"{k:18s} first write {r['first_write_gib_s'] or 0:.2f}  write {r['write_gib_s']:.2f}  "
              f"read {r['read_gib_s']:.2f}  mixed {r['mixed_gib_s']:.2f} GiB/s")
    print(f"host AdamW alone {out['adamw_alone_params_per_s'] / 1e9:.2f} G params/s, under disk I/O "
          f"{(out['adamw_under_disk_params_per_s'] or 0) / 1e9:.2f}")


if __name__ == "__main__":
    main()
