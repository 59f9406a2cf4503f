"""Compiled layers compile once per purpose (engine/slide/layer_runner.py, ops/packed_attention.py,
engine/slide/engine.py's _row_positions): `slidetune train` with compiled layers, a held-out evaluation
and masked packing (the default) compiles the layer's two graphs, the no-grad forward and the recompute,
once each, through batches with and without document boundaries, and trains as the eager run does.

Before 2026-11-29 the same run compiled 4 frames (grad mode x the mask / rotary form of the first batch
without a document boundary against one with), 35.0 s on 2 CPU cores; now 2, 28.0 s (benchmarks/NOTES.md
"Compile")."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slidetune.engine.compile_cache import INDUCTOR_ENV

SRC = str(Path(__file__).resolve().parents[1] / "src")

# One interpreter (fresh dynamo counters): `slidetune train` compiled, then eager, of a 2-layer tiny Llama
# on the built-in corpus at [3, 32] (3 steps; the whole held-out split, whose last batch is short, before,
# after step 2 and at the end). Counts
# whether transformers found documents in each mask it built (the real packed_mask, wrapped), so the test
# knows both kinds of batch came by. Prints what dynamo compiled and why it recompiled.
CHILD = """
import json, sys
import torch._dynamo.utils as dynamo_utils
from slidetune.cli import main
from slidetune.ops import packed_attention

out, cache = sys.argv[1], sys.argv[2]
seen = []
has_documents = packed_attention._has_documents
def counted(fn):
    seen.append(has_documents(fn))
    return seen[-1]
packed_attention._has_documents = counted
common = ["--model", "tiny-llama", "--num-layers", "2", "--seq-len", "32", "--batch-size", "3", "--max-steps", "3",
          "--eval-every", "2", "--eval-batches", "0", "--heldout-fraction", "0.005", "--progress", "false",
          "--device", "cpu", "--dtype", "fp32", "--compile-cache-dir", cache]
assert main(["train", *common, "--compile-layers", "true", "--output-dir", out + "/compiled"]) == 0
compiled = {"frames": len(dynamo_utils.compilation_time_metrics.get("_compile.compile_inner", [])),
            "unique_graphs": dynamo_utils.counters["stats"]["unique_graphs"],
            "guard_failures": {code.co_name: [str(r) for r in reasons]
                               for code, reasons in dynamo_utils.guard_failures.items()},
            "documents_seen": sorted(set(seen))}
assert main(["train", *common, "--compile-layers", "false", "--output-dir", out + "/eager"]) == 0
print(json.dumps(compiled))
"""


def metrics(run: Path) -> tuple[list[float], list[float]]:
    """(train losses by step, eval losses) from a run's metrics.csv."""
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    return ([float(r["loss"]) for r in rows if r["loss"]], [float(r["eval_loss"]) for r in rows if r["eval_loss"]])


@pytest.mark.slow
def test_train_with_an_evaluation_compiles_each_graph_once(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (INDUCTOR_ENV, "TRITON_CACHE_DIR", "TORCH_LOGS")}
    env["PYTHONPATH"] = SRC
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), str(tmp_path / "compile")], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    compiled = json.loads(done.stdout.strip().splitlines()[-1])
    # batches with and without a document boundary both came by (the case that recompiled)
    assert compiled["documents_seen"] == [False, True]
    # the no-grad forward (evaluations, the step's forward) and the recompute: one frame each, no recompile
    assert compiled["frames"] == 2 and compiled["unique_graphs"] == 2, compiled
    assert compiled["guard_failures"] == {}, compiled["guard_failures"]
    # what the run records of it (compile_cache.CompileCounters: the GPU's device job reads the same field)
    summary = json.loads((tmp_path / "compiled" / "summary.json").read_text())
    assert summary["compile_frames"] == 2
    assert summary["heldout_sequences"] % 3 != 0                 # a short last batch, evaluated at [3, 32] too
    losses, evals = metrics(tmp_path / "compiled")
    eager_losses, eager_evals = metrics(tmp_path / "eager")
    assert len(losses) == 3 and len(evals) == 3                  # before training, after step 2, at the end
    assert losses == pytest.approx(eager_losses, rel=1e-5) and evals == pytest.approx(eager_evals, rel=1e-5)
