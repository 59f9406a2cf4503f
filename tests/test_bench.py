"""The runtime benchmark at --smoke size: every configuration in its own process, finite results."""
from __future__ import annotations

import json
import math
import pytest

from slidetune.bench.measure import MeasureSpec, measure
from slidetune.bench.output import read_csv, read_csv_machine
from slidetune import run_setup
from slidetune.bench.workload import BenchWorkload
from slidetune.cli import main
from test_bench_scenarios import report_again


@pytest.mark.slow
def test_runtime_smoke_writes_finite_results(tmp_path):
    out = tmp_path / "rt"
    assert main(["bench", "runtime", "--smoke", "--out", str(out)]) == 0
    assert read_csv_machine(out / "results.csv")["torch"]          # machine details in the CSV too
    rows = read_csv(out / "results.csv")
    assert {r["name"] for r in rows} >= {"gpu", "ckpt", "slide", "slide-offload-2L", "slide-offload-4L"}
    for r in rows:
        assert r["status"] == "ok", r
        for key in ("step_s_mean", "tokens_per_s", "cpu_peak_rss_gib"):
            assert math.isfinite(float(r[key])) and float(r[key]) > 0, (r["name"], key)
    data = json.loads((out / "results.json").read_text())
    assert data["machine"]["torch"]
    assert "Runtime checks" in (out / "report.md").read_text()
    # `slidetune report` writes the runtime's own report again (its checks), not a generic one
    (out / "results.csv").unlink()
    report_again(out, "# Runtime checks", "## Checks", "big_rss_within_budget")
    assert read_csv(out / "results.csv") == rows


def test_measure_records_per_layer_phases_and_host_spans():
    spec = MeasureSpec(workload=BenchWorkload("tiny-llama", seq_len=16, batch_size=2, steps=2, warmup=1),
                       runtime=dict(device="cpu", mode="slide"))
    r = measure(spec)
    assert r["status"] == "ok"
    measured = [s for s in r["steps"] if not s["warmup"]]
    assert len(measured) == 2
    phases = {(p, layer) for p, layer, _ in measured[0]["spans"]}
    for i in range(r["num_layers"]):        # recompute is its own phase, apart from backward
        assert {("forward", i), ("recompute", i), ("backward", i)} <= phases
    assert any(k.startswith("host.") for k in measured[0]["host_s"])
    assert 0 < measured[0]["overlap"]["gpu_compute_fraction_of_step"] <= 1.0
    assert "host.adamw_overlapped_with_gpu_compute" in r["overlap_mean"]
    # the last measured step as a Gantt chart: the GPU's layer phases and the host threads, per unit
    tl = r["step_timeline"]
    assert tl["step"] == r["steps"][-1]["step"]
    rows = tl["rows"]
    gpu = {(what, unit) for lane, what, unit, _, _ in rows if lane == "gpu"}
    assert {("forward", f"layer.{i}") for i in range(r["num_layers"])} <= gpu
    adamw_units = {unit for lane, what, unit, _, _ in rows if (lane, what) == ("host", "adamw")}
    # which updates fall between the last two returns depends on timing (on the CPU device the
    # call computes the whole backward, and the host may finish the previous step's layers
    # inside that call): some do, and each names a unit of the model
    assert adamw_units and adamw_units <= {"embed", "head"} | {f"layer.{i}" for i in range(r["num_layers"])}
    assert all(0 <= s <= e <= tl["step_ms"] + 1e-6 for *_, s, e in rows)


def test_steps_record_gc_pauses_and_allocator_events(tmp_path):
    """Each step says how long Python's collections stopped the process inside it (a full one is
    timed as generation 2) and, on CUDA, the caching allocator's retries and cudaMallocs; the
    per-run steps.csv carries them. On the CPU the allocator columns stay empty."""
    import gc
    from slidetune.bench.measure import GCPauses
    from slidetune.bench.tables import write_tables
    pauses = GCPauses()
    try:
        gc.collect()
        (gen, seconds), *_ = pauses.take()
        assert gen == 2 and seconds >= 0
        assert pauses.take() == []
    finally:
        pauses.close()
    assert pauses._callback not in gc.callbacks
    spec = MeasureSpec(workload=BenchWorkload("tiny-llama", seq_len=16, batch_size=2, steps=2, warmup=1),
                       runtime=dict(device="cpu", mode="slide"))
    r = measure(spec)
    assert all(s["gc_s"] >= 0 and s["gc_gen2"] >= 0 and s["alloc"] == {} for s in r["steps"])
    assert not any(c.__self__.__class__ is GCPauses for c in gc.callbacks if hasattr(c, "__self__"))
    write_tables(tmp_path, [r], r["machine"])
    rows = read_csv(tmp_path / "steps.csv")
    assert len(rows) == 3 and all(float(row["gc_s"]) >= 0 and row["alloc_retries"] in ("", None) for row in rows)


def test_step_timeline_table_and_plot(tmp_path):
    from slidetune.bench.measure_report import draw, load
    from slidetune.bench.tables import write_tables
    spec = MeasureSpec(workload=BenchWorkload("tiny-llama", seq_len=16, batch_size=2, steps=1, warmup=1),
                       runtime=dict(device="cpu", mode="slide"))
    r = measure(spec)
    write_tables(tmp_path, [r], r["machine"])
    data = load(tmp_path)
    assert data["step_timeline"] and {row["lane"] for row in data["step_timeline"]} >= {"gpu", "host"}
    paths = draw(tmp_path, {**data, "doc": {"scenario": "throughput", "results": []}})
    png = [p for p in paths if p.name.startswith("step_timeline_")]
    assert len(png) == 1 and png[0].stat().st_size > 10_000


def test_profile_summary_sees_the_worker_threads():
    """The profiler records the host worker's AdamW ranges (profile_all_threads), not only the caller's."""
    spec = MeasureSpec(workload=BenchWorkload("tiny-llama", seq_len=16, batch_size=2, steps=1, warmup=0),
                       per_layer=False, profile=True, runtime=dict(device="cpu", mode="slide"))
    r = measure(spec)
    assert r["status"] == "ok", r.get("error")
    ts = r["trace_summary"]
    assert ts["n_steps"] == 3
    assert ts["cpu_adamw_busy_ms"] > 0


def test_measured_step_includes_the_work_left_in_the_background(monkeypatch):
    """train_step returns once its work is issued; what the workers still do (the GPU tail, D2H,
    AdamW) belongs to the step. Here each call returns after 10 ms and leaves 60 ms of background
    work that the gradient norm and the next call wait for: the step is ~70 ms. (Timing only the
    call, and reading the norm between calls, read ~10 ms.)"""
    from concurrent.futures import Future
    import threading
    import time

    from slidetune.engine.result import StepResult

    from slidetune.engine.interface import Engine

    class BackgroundEngine(Engine):
        """An engine whose step leaves 60 ms of work in the background (the parts measure() does
        not call refuse)."""
        def __init__(self):
            self.pending = None

        def memory_report(self):
            return {}

        def eval_loss(self, batch):
            raise AssertionError("measure() does not evaluate")

        next_token_logits = token_losses = named_master_params = optimizer_tensors = load_state = eval_loss

        def train_step(self, micro_batches, lr):
            if self.pending is not None:
                self.pending.join()          # the next forward waits for the last step's updates
            time.sleep(0.01)
            norm: Future = Future()

            def background():
                time.sleep(0.06)
                norm.set_result(1.0)
            self.pending = threading.Thread(target=background)
            self.pending.start()
            return StepResult(loss=1.0, n_tokens=4, grad_norm_future=norm)

        def synchronize(self):
            if self.pending is not None:
                self.pending.join()

        def close(self):
            self.synchronize()

    monkeypatch.setattr(run_setup, "build_engine", lambda *a, **k: BackgroundEngine())
    r = measure(MeasureSpec(workload=BenchWorkload("tiny-llama", seq_len=8, batch_size=1, steps=4, warmup=1),
                            per_layer=False, runtime=dict(device="cpu", mode="slide")))
    measured = [s for s in r["steps"] if not s["warmup"]]
    assert 0.065 < r["step_s_mean"] < 0.2 and all(s["wall_s"] > 0.065 for s in measured)
    assert all(s["wall_s"] >= s["call_s"] for s in r["steps"])


def test_measure_refuses_what_does_not_fit_before_building(monkeypatch):
    """A slide run the fit check refuses ends as status "refused" with the check's message (what is
    short, the options that fit) before the engine allocates anything; check_memory=False skips it."""
    from slidetune.engine.fit import ENV_HOST_MEMORY
    built = []
    real_build = run_setup.build_engine
    monkeypatch.setattr(run_setup, "build_engine", lambda *a, **k: (built.append(1), real_build(*a, **k))[1])
    monkeypatch.setenv(ENV_HOST_MEMORY, str(64 * 2**20))          # a 64 MiB host
    spec = MeasureSpec(workload=BenchWorkload("tiny-llama", seq_len=16, batch_size=2, steps=1, warmup=0),
                       runtime=dict(device="cpu", mode="slide"))
    r = measure(spec)
    assert r["status"] == "refused" and "host RAM" in r["error"] and not built
    monkeypatch.delenv(ENV_HOST_MEMORY)
    assert measure(spec)["status"] == "ok" and built


def test_a_disk_tier_run_warms_up_past_its_first_sweep_and_reports_its_disk_rate(tmp_path):
    # The tier's files start as unwritten extents: the first sweep reads zeros the disk never
    # serves, so one warm-up step measured a fast step then a slow one (the 2026-11-25 14B: 22 s,
    # 65 s). The bench keeps at least two warm-up steps there, and says so.
    from slidetune.bench.scenarios.throughput_rows import _row
    spec = MeasureSpec(workload=BenchWorkload("tiny-llama", seq_len=16, batch_size=2, steps=1, warmup=1),
                       per_layer=False, max_grad_norm=1.0,
                       runtime=dict(device="cpu", mode="slide", disk_units=1, disk_dir=str(tmp_path),
                                    disk_block_mb=0.1, disk_buffers=3))
    r = measure(spec)
    assert r["status"] == "ok"
    assert r["warmup_raised"]["asked"] == 1 and r["warmup_raised"]["used"] == 2
    assert [s["warmup"] for s in r["steps"]] == [True, True, False]
    # one disk unit (the head, then the top layers): its moments read and written once a step
    assert r["disk_io_bytes_per_step"] > 0
    assert r["engine_memory"]["disk_state"] * 2 == r["disk_io_bytes_per_step"]
    row = _row("slide", "tiny-llama", 2, 16, r, None, None)
    assert row["disk_gib_s"] == pytest.approx(r["disk_io_bytes_per_step"] / 2**30 / r["step_s_mean"])
    # what the tier moved in the measured interval: one read and one write of each block (a
    # block still in a buffer from its last write may skip its read; a unit's last block is
    # padded, so whole blocks move a little more than the plan's bytes)
    assert 0.5 <= row["disk_io_ratio"] <= 1.05
    assert row["disk_buffers"] == 3                           # the run's resolved read-ahead
    # the disk lane's busy share of the timed step (the Gantt chart's disk lanes, their union)
    assert 0 < row["disk_busy_frac"] <= 1
    # without a disk tier the warm-up is the one asked for
    r = measure(MeasureSpec(workload=BenchWorkload("tiny-llama", seq_len=16, batch_size=2, steps=1, warmup=1),
                            per_layer=False, runtime=dict(device="cpu", mode="slide")))
    assert "warmup_raised" not in r and [s["warmup"] for s in r["steps"]] == [True, False]
    assert "disk_io_bytes_per_step" not in r


def test_lane_busy_fraction_is_the_union_of_a_lanes_spans_over_the_step():
    from slidetune.bench.measure import lane_busy_fraction
    timeline = {"step": 3, "step_ms": 100.0,
                "rows": [["disk", "read", "layer.3", 0.0, 30.0], ["disk", "write", "layer.2", 20.0, 50.0],
                         ["disk", "read", "layer.4", 70.0, 80.0], ["gpu", "forward", "layer.0", 0.0, 100.0]]}
    assert lane_busy_fraction(timeline, "disk") == pytest.approx(0.6)     # [0, 50] and [70, 80]
    assert lane_busy_fraction(timeline, "gpu") == pytest.approx(1.0)
    assert lane_busy_fraction(timeline, "upload") is None and lane_busy_fraction(None, "disk") is None


@pytest.mark.slow
def test_measure_times_the_reference_pass_of_an_objective_with_a_reference():
    """ipo (a reference): the result carries the reference pass over a step's pairs, each repeat
    measured; simpo (reference-free): no reference pass to time, no field."""
    def run(objective: str) -> dict:
        spec = MeasureSpec(workload=BenchWorkload("tiny-llama", seq_len=16, batch_size=2, steps=1, warmup=1),
                           grad_accum=2, runtime=dict(device="cpu", mode="ckpt"), per_layer=False,
                           objective=objective)
        r = measure(spec)
        assert r["status"] == "ok", r.get("error")
        return r
    ipo = run("ipo")
    assert len(ipo["reference_s_repeats"]) == 3 and all(t > 0 for t in ipo["reference_s_repeats"])
    assert ipo["reference_s"] == pytest.approx(sum(ipo["reference_s_repeats"]) / 3)
    assert ipo["reference_tokens_per_s"] == pytest.approx(2 * 16 * 2 / ipo["reference_s"])
    simpo = run("simpo")
    assert "reference_s" not in simpo and "reference_tokens_per_s" not in simpo
