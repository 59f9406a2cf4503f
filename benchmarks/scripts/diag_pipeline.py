"""Where does a slide step wait? Host-side spans per measured step, for a few variants."""
import json
import os
import sys

from slidetune.bench.measure import MeasureSpec
from slidetune.bench.runner import run_isolated

out_dir = sys.argv[1]
model = sys.argv[2] if len(sys.argv) > 2 else "qwen3-1.7b"
batch = int(sys.argv[3]) if len(sys.argv) > 3 else 8
variants = {
    "gpu-cast": {},
    "cpu-cast": {"cast_on": "cpu"},
    "gpu-cast-4grad": {"grad_slots": 4},
}
os.makedirs(out_dir, exist_ok=True)
for name, extra in variants.items():
    spec = MeasureSpec(name=name, model=model, batch_size=batch, seq_len=1024, steps=3, warmup=1, per_layer=True,
                       runtime=dict(device="cuda", mode="slide", head_chunk_tokens=4096, **extra))
    r = run_isolated(spec)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(r, f, default=float)
    if r.get("status") != "ok":
        print(name, r.get("status"), r.get("error"))
        continue
    st = [s for s in r["steps"] if not s["warmup"]][-1]
    gpu = {}
    for p, l, ms in st["spans"]:
        gpu[p] = gpu.get(p, 0) + ms / 1e3
    print(f"{name}: step {r['step_s_mean']:.3f} s  gpu {sum(gpu.values()):.3f} s  "
          + "  ".join(f"{k}={v:.3f}" for k, v in st["host_s"].items()), flush=True)
