"""`slidetune bench soak`: the per-step resource series, their fitted growth, and a 1,000-step CPU soak
whose memory, page-locked buffers, file descriptors and threads stay flat after warm-up."""
from __future__ import annotations


import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from slidetune.bench.output import read_csv
from slidetune.cli import main
from slidetune.models.presets import tiny_config
from slidetune.telemetry.resources import growth_per_100_steps


def test_growth_is_the_least_squares_slope_in_percent_of_the_mean_per_100_steps():
    steps = list(range(21, 121))
    flat_with_noise = [1000.0 + (5 if s % 2 else -5) for s in steps]
    leak = [1000.0 + 0.1 * (s - 70.5) for s in steps]            # mean 1000, +10 per 100 steps
    assert abs(growth_per_100_steps("x", steps, flat_with_noise).growth_pct_per_100) < 0.05   # noise: ~0.03
    g = growth_per_100_steps("x", steps, leak)
    assert g.growth_pct_per_100 == pytest.approx(1.0) and not g.within(0.5)
    assert growth_per_100_steps("gpu", steps, [0.0] * len(steps)).growth_pct_per_100 == 0.0
    with pytest.raises(ValueError, match="more --steps or a shorter --warmup"):
        growth_per_100_steps("x", [1], [1.0])


def test_growth_carries_a_95pct_interval_from_block_means_and_a_three_way_verdict():
    """A leak under noise is shown ("no"), flat noise rules growth out ("yes"), and a series that
    wanders slowly (a host-bound step time: a sine of 150 steps over 230) is "unresolved": its
    point slope is above the target but the interval from 10-step block means spans it. (A wander
    as long as the run itself can still read as growth: one run cannot tell them apart.)"""
    import math
    rng = np.random.default_rng(0)
    steps = list(range(21, 251))
    noise = rng.normal(0.0, 2.0, len(steps))
    leak = [1000.0 + 0.2 * (s - 136) + e for s, e in zip(steps, noise)]           # +2% per 100 steps
    g = growth_per_100_steps("x", steps, leak)
    assert g.ci_low_pct < g.growth_pct_per_100 < g.ci_high_pct and g.ci_low_pct > 0.5
    assert g.verdict(0.5) == "no" and not g.within(0.5)
    flat = growth_per_100_steps("x", steps, [1000.0 + e for e in noise])
    assert flat.ci_high_pct < 0.5 and flat.verdict(0.5) == "yes" and flat.within(0.5)
    wander = [1.4 * (1 + 0.04 * math.sin(2 * math.pi * s / 150 + 3.5)) + 0.01 * e for s, e in zip(steps, noise)]
    w = growth_per_100_steps("step_s", steps, wander)
    assert w.growth_pct_per_100 > 0.5 and w.ci_low_pct < 0.5 < w.ci_high_pct, w
    assert w.verdict(0.5) == "unresolved"
    exact = growth_per_100_steps("x", steps, [5.0] * len(steps))            # a constant: no interval to widen
    assert abs(exact.ci_low_pct) < 1e-9 and abs(exact.ci_high_pct) < 1e-9 and exact.verdict(0.5) == "yes"
    short = growth_per_100_steps("x", list(range(30)), [float(k) for k in range(30)])   # 3 blocks: the point
    assert short.ci_low_pct == short.ci_high_pct == short.growth_pct_per_100


@pytest.mark.slow
def test_report_refits_a_soak_directory_from_its_samples(tmp_path):
    """`slidetune report DIR` on a soak's results: the same fit from results.json's samples, the
    report with each series' interval and verdict."""
    out = tmp_path / "soak"
    assert main(["bench", "soak", "--smoke", "--out", str(out)]) == 0
    before = read_csv(out / "growth.csv")
    (out / "report.md").unlink()
    (out / "growth.csv").unlink()
    assert main(["report", str(out)]) == 0
    after = read_csv(out / "growth.csv")
    assert [(r["series"], r["growth_pct_per_100"], r["verdict"]) for r in after] == \
           [(r["series"], r["growth_pct_per_100"], r["verdict"]) for r in before]
    assert {r["verdict"] for r in after} <= {"yes", "no", "unresolved"}
    report = (out / "report.md").read_text()
    assert "| 95% interval | within |" in report and "| default | threads |" in report


def test_the_pinned_counter_follows_a_buffer_until_its_last_view_is_freed():
    """In a fresh process: the counter is process-wide, and in the suite's process buffers of
    earlier tests' engines are freed by any gc.collect() of this one."""
    import subprocess
    import sys
    code = """
import gc, torch
from slidetune.device import Device, pinned_bytes
gc.collect()
before = pinned_bytes()
buf = Device(torch.device("cpu")).host_empty(1024, torch.float32)
view = buf[10:20]
assert pinned_bytes() - before == 4096, pinned_bytes() - before
del buf
gc.collect()
assert pinned_bytes() - before == 4096, pinned_bytes() - before     # a view still holds the storage
del view
gc.collect()
assert pinned_bytes() == before, pinned_bytes() - before
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.slow
def test_a_1000_step_cpu_soak_grows_nothing_after_warm_up(tmp_path, capsys):
    """A 2-layer Llama of vocabulary 256 (a step of tens of ms) in slide mode with the default recipe,
    1,000 steps after which RSS, page-locked buffers, fds and threads grow under 0.5% per 100 steps.
    Step time is reported, not asserted: on 2 CPU cores shared with other jobs it follows their load."""
    model_dir = tmp_path / "tiny"
    AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=256, layers=2)).save_pretrained(model_dir)
    out = tmp_path / "soak"
    code = main(["bench", "soak", "--model", str(model_dir), "--seq-len", "16", "--batch-size", "1",
                 "--steps", "1000", "--warmup", "100", "--device", "cpu", "--out", str(out)])
    assert code == 0
    growth = {r["series"]: r for r in read_csv(out / "growth.csv")}
    for series in ("rss_bytes", "pinned_bytes", "open_fds", "threads"):
        assert float(growth[series]["growth_pct_per_100"]) < 0.5, growth[series]
        assert growth[series]["within_target"] == "True"
    assert float(growth["pinned_bytes"]["mean"]) > 0        # the engine's staging buffers are counted
    assert int(growth["rss_bytes"]["n"]) == 900
    samples = read_csv(out / "samples.csv")
    assert [int(s["step"]) for s in samples] == list(range(0, 1001))
    assert all(float(s["step_s"]) > 0 for s in samples[1:])
    assert (out / "soak.png").read_bytes()[:4] == b"\x89PNG"
    report = (out / "report.md").read_text()
    assert "target: at most 0.5%" in report and "| default | rss_bytes |" in report
    assert "# machine.cpu:" in (out / "growth.csv").read_text()


def test_too_few_steps_after_warm_up_is_refused_naming_both(tmp_path, capsys):
    code = main(["bench", "soak", "--model", "tiny-llama", "--steps", "10", "--warmup", "9", "--device", "cpu",
                 "--out", str(tmp_path)])
    assert code == 2
    assert "--steps 10 leaves fewer than 2 steps after --warmup 9" in capsys.readouterr().err


def test_a_soak_cut_short_keeps_its_samples(tmp_path):
    """Samples go to their JSON-lines file as they are taken: --max-minutes ends the run early
    with the steps done kept, and a worker that never returned (a deadline's kill, a crash) is
    reported as "partial" from that file, fitted where enough steps are past the warm-up."""
    import json
    from dataclasses import asdict
    from slidetune.bench.scenarios.soak import recover_partial
    from slidetune.bench.soak import SoakSpec, soak
    path = tmp_path / "samples.jsonl"
    spec = SoakSpec.from_dict(dict(name="cut", model="tiny-qwen3", seq_len=16, batch_size=1, steps=50, warmup=1,
                                   runtime={"device": "cpu"}, samples_path=str(path), max_minutes=1e-9))
    result = soak(spec)
    assert result["status"] == "ok" and result["stopped_after_steps"] == 1       # the deadline passed at once
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [s["step"] for s in lines] == [0, 1] and lines == json.loads(json.dumps(result["samples"]))
    # a run that was killed: its result is a timeout, its file has 4 steps (2 past the warm-up)
    more = lines + [dict(lines[-1], step=k) for k in (2, 3, 4)]
    path.write_text("".join(json.dumps(s) + "\n" for s in more))
    timed_out = {"spec": asdict(spec), "status": "timeout", "error": "exceeded 60 s"}
    got = recover_partial(timed_out, path, warmup=2)
    assert got["status"] == "partial" and got["steps_done"] == 4 and len(got["samples"]) == 5
    assert "exceeded 60 s" in got["error"]
    assert recover_partial(timed_out, path, warmup=3)["status"] == "timeout"      # 1 step past warm-up: no fit


def test_cpu_time_shares_are_percentages_of_all_cores_between_calls():
    """CpuTimesSampler: busy, stolen and I/O-wait shares of the cores' time since the last call,
    each within [0, 100], busy rising while this process spins a core."""
    import time
    from slidetune.telemetry.resources import CONTEXT, CpuTimesSampler
    sampler = CpuTimesSampler()
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end:       # one core busy for 0.3 s
        pass
    got = sampler.sample()
    assert set(got) == set(CONTEXT)
    assert all(0.0 <= v <= 100.0 for v in got.values()), got
    assert got["cpu_busy_pct"] > 0.0


def test_the_soak_loop_finishes_each_step_after_issuing_the_next_as_the_trainer_does(monkeypatch):
    """bench.soak's loop is train.Trainer.advance's: step k is issued before step k-1's norm is
    read, every step is sampled once, in order, the last one after one more step is issued (and
    finished, not sampled); samples carry the wall-clock time and the CPU context."""
    from slidetune.bench import soak as soak_mod
    from slidetune.engine.slide.engine import SlideEngine
    from slidetune.telemetry.resources import CONTEXT
    from test_train_e2e import norm_read_spy
    events: list[tuple[str, int]] = []
    real_step, spy = SlideEngine.train_step, norm_read_spy(events)

    def traced_step(self, *a, **kw):
        return spy(self, real_step(self, *a, **kw))
    monkeypatch.setattr(SlideEngine, "train_step", traced_step)
    spec = soak_mod.SoakSpec.from_dict(dict(name="loop", model="tiny-qwen3", seq_len=16, batch_size=1, steps=4,
                                            warmup=1, runtime={"device": "cpu"}, progress_every=0))
    result = soak_mod.soak(spec)
    assert result["status"] == "ok" and result["stopped_after_steps"] is None
    assert events == [("issued", 0), ("issued", 1), ("norm", 0), ("issued", 2), ("norm", 1),
                      ("issued", 3), ("norm", 2), ("issued", 4), ("norm", 3), ("norm", 4)]      # steps 1-5
    samples = result["samples"]
    assert [s["step"] for s in samples] == [0, 1, 2, 3, 4]
    assert all(set(CONTEXT) <= set(s) and s["time"] > 1.7e9 for s in samples)
    assert all(s["step_s"] > 0 for s in samples[1:])
