"""Add the shared host state's size to data-parallel runs measured before bench.measure recorded it
(the 2026-11-25 first 2x H100 sweep), then rewrite the report: host_rss_gib then counts the whole
/dev/shm file once instead of the largest rank's resident part of it (telemetry.machine.host_peak_rss).

    python benchmarks/scripts/dp_shared_state.py benchmarks/results/scaling/2xh100_qwen3_8b_clip/upload ...

The size is what the engine allocates for the run's own resolved placement: PlacementPlan.build from
the run's runtime and the unit sizes of its floor's compute probe, then fit.shared_state_bytes."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from slidetune.bench.scenarios.throughput_report import rewrite_report
from slidetune.engine.config import RuntimeConfig
from slidetune.engine.fit import shared_state_bytes
from slidetune.engine.placement import PlacementPlan, shapes_from_counts


def add_shared_state(out: Path) -> list[float]:
    doc = json.loads((out / "throughput.json").read_text())
    sizes = []
    for run in doc["runs"]:
        if (run.get("world_size") or 1) < 2 or "shared_state_gib" in run:
            continue
        c = doc["floors"][f"{run['spec']['model']}/b{run['spec']['batch_size']}/s{run['spec']['seq_len']}"]["compute"]
        shapes = shapes_from_counts(c["num_layers"], c["layer_params"], c["embed_params"],
                                    c["vocab_params"] - c["embed_params"])
        plan = PlacementPlan.build(shapes, RuntimeConfig(**run["runtime"]), schedule="deferred")
        run["shared_state_gib"] = shared_state_bytes(plan) / 2**30
        sizes.append(run["shared_state_gib"])
    (out / "throughput.json").write_text(json.dumps(doc, indent=1, default=float))
    rewrite_report(out)
    return sizes


if __name__ == "__main__":
    for d in sys.argv[1:]:
        print(d, [f"{g:.2f} GiB" for g in add_shared_state(Path(d))])
