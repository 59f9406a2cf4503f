"""The bench scenarios (modes, recompute, head) at --smoke size, the report, the seed
comparison, and the recompute-time attribution of the ckpt engine (CPU)."""
from __future__ import annotations

import argparse
import json
import math
import time
from collections import defaultdict

import pytest
import torch

from slidetune.bench.report import main_report, write_report
from slidetune.bench.scenarios import add_common_arguments, scenario_module
from slidetune.bench.output import read_csv, read_csv_machine

CSVS = ("summary.csv", "steps.csv", "layers.csv", "memory_timeline.csv")
PLOTS = ("time_breakdown.png", "peak_memory.png", "memory_timeline.png", "per_layer_times.png",
         "step_times.png", "pareto.png")


def _args(name: str, out) -> argparse.Namespace:
    mod = scenario_module(name)
    p = argparse.ArgumentParser()
    add_common_arguments(p, **mod.DEFAULTS)
    mod.add_arguments(p)
    return p.parse_args(["--smoke", "--out", str(out)])


def _check_dir(out, configs: set[str]) -> list[dict]:
    data = json.loads((out / "results.json").read_text())
    assert data["machine"]["torch"] and "cpu" in data["machine"]
    for name in CSVS:
        assert read_csv_machine(out / name)["torch"] == data["machine"]["torch"], name
        rows = read_csv(out / name)
        assert rows, name
        for row in rows:
            if row.get("status", "ok") != "ok":
                continue
            for k, v in row.items():
                if v in ("", None) or k in ("config", "phase", "status", "error", "model", "mode", "recompute",
                                            "head_impl"):
                    continue
                assert math.isfinite(float(v)), (name, row["config"], k, v)
    summary = read_csv(out / "summary.csv")
    assert {r["config"] for r in summary} == configs
    for r in summary:
        if r["status"] == "ok":
            assert float(r["step_s_mean"]) > 0 and float(r["tokens_per_s"]) > 0 and float(r["cpu_peak_rss_gib"]) > 0
    for png in PLOTS:
        assert (out / png).stat().st_size > 1000, png
    report = (out / "report.md").read_text()
    assert "Student-t" in report and "## Machine" in report
    return summary


@pytest.fixture(scope="module")
def modes_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("modes")
    assert scenario_module("modes").run(_args("modes", out)) == out
    return out


@pytest.mark.slow
def test_modes_smoke(modes_dir):
    summary = _check_dir(modes_dir, {"gpu", "ckpt", "slide"})
    assert all(r["status"] == "ok" for r in summary), summary
    by = {r["config"]: r for r in summary}
    assert float(by["ckpt"]["t_recompute_s"]) > 0 and float(by["gpu"]["t_recompute_s"]) == 0
    assert float(by["slide"]["t_transfer_s"]) > 0
    layers = read_csv(modes_dir / "layers.csv")
    phases = {(r["config"], r["phase"]) for r in layers if int(r["layer"]) >= 0}
    assert {("gpu", "forward"), ("gpu", "backward"), ("gpu", "optimizer"), ("ckpt", "recompute")} <= phases


@pytest.mark.slow
def test_recompute_smoke(tmp_path):
    out = tmp_path / "recompute"
    scenario_module("recompute").run(_args("recompute", out))
    summary = _check_dir(out, {"none", "all", "list", "every:2"})
    assert all(r["status"] == "ok" for r in summary), summary
    layers = read_csv(out / "layers.csv")
    rec = defaultdict(set)
    for r in layers:
        if r["phase"] == "recompute":
            rec[r["config"]].add(int(r["layer"]))
    assert rec["all"] == {0, 1, 2} and rec["every:2"] == {0, 2} and rec["list"] == {1} and not rec["none"]
    report = (out / "report.md").read_text()
    assert "Top 5 layers" in report and "per_layer_delta.png" in report
    report_again(out, "Top 5 layers", "per_layer_delta.png")


@pytest.mark.slow
def test_head_smoke(tmp_path):
    from slidetune.ops.cross_entropy import available_impls
    out = tmp_path / "head"
    scenario_module("head").run(_args("head", out))
    summary = _check_dir(out, {"full-s32", "chunked-s32", "fused-s32"})
    by = {r["config"]: r for r in summary}
    assert by["full-s32"]["status"] == "ok" and by["chunked-s32"]["status"] == "ok"
    assert float(by["chunked-s32"]["head_fwd_ms"]) > 0
    if "fused" not in available_impls():
        assert by["fused-s32"]["status"] == "unavailable"
    assert (out / "head_time.png").exists()
    assert "## Output layer" in (out / "report.md").read_text()
    report_again(out, "## Output layer")


@pytest.mark.slow
def test_report_regenerates_from_results_dir(modes_dir, tmp_path):
    import shutil
    d = tmp_path / "copy"
    shutil.copytree(modes_dir, d)
    for f in [*PLOTS, "report.md", *CSVS]:
        (d / f).unlink()
    path = write_report(d)
    assert path.exists()
    for f in [*PLOTS, *CSVS]:
        assert (d / f).exists(), f
    assert read_csv(d / "summary.csv") == read_csv(modes_dir / "summary.csv")


def report_again(out, *expected: str) -> str:
    """`slidetune report OUT` on a scenario's (smoke) output with its report.md deleted: exit 0 and a
    report.md again, holding each of `expected` (what the scenario's own report has)."""
    (out / "report.md").unlink()
    code, err = _report_cli(out)
    assert code == 0, err
    text = (out / "report.md").read_text()
    assert all(e in text for e in expected), (expected, text[:2000])
    return text


def _report_cli(d) -> tuple[int, str]:
    import contextlib
    import io
    from slidetune.cli import main
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(["report", str(d)])
    return code, err.getvalue()


@pytest.mark.parametrize("files, named, words", [
    ({}, "", "no benchmark results in it"),
    (None, "", "no such directory"),
    ({"results.json": "[1, 2]"}, "results.json", "expected a JSON object"),
    ({"results.json": "{bad"}, "results.json", "not valid JSON"),
    ({"results.json": b"\xff\xfe"}, "results.json", "not valid JSON"),
    ({"results.json": '{"scenario": "modes"}'}, "results.json", "no configuration to report"),
    ({"results.json": '{"scenario": "modes", "results": []}'}, "results.json", "no configuration to report"),
    ({"results.json": '{"results": "none"}'}, "results.json", "'results' must be a JSON array of objects"),
    ({"results.json": '{"results": [1]}'}, "results.json", "'results' must be a JSON array of objects"),
    ({"results.json": '{"scenario": "soak", "args": {}}'}, "results.json", "lacks 'target_pct', 'results'"),
    ({"throughput.json": '{"runs": []}'}, "throughput.json", "lacks 'rows'"),
    ({"roofline.json": '{"status": "ok"}'}, "roofline.json", "lacks 'spec'"),
    ({"results.json": '{"checks": {}}'}, "results.json", "lacks 'results'"),
    ({"techniques.json": "[]"}, "techniques.json", "expected a JSON object"),
    ({"summary.csv": "config,status\n"}, "summary.csv", "no configuration to report")])
def test_report_refuses_a_malformed_directory_naming_the_file(tmp_path, files, named, words):
    """`slidetune report` on what no bench run wrote: exit 2, the file (or directory) and what is
    wrong, no traceback, no report.md."""
    d = tmp_path / "results"
    if files is not None:
        d.mkdir()
        for name, content in files.items():
            (d / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    code, err = _report_cli(d)
    assert code == 2 and "Traceback" not in err, err
    assert f"{d / named if named else d}: " in err and words in err, err
    assert not (d / "report.md").exists()


@pytest.mark.slow
def test_report_names_the_file_of_an_entry_it_cannot_read(modes_dir, tmp_path):
    """A results entry of another shape (a step without its wall time): the file is named, no traceback."""
    import shutil
    d = tmp_path / "copy"
    shutil.copytree(modes_dir, d)
    for f in [*CSVS, "report.md"]:
        (d / f).unlink()
    doc = json.loads((d / "results.json").read_text())
    del doc["results"][0]["steps"][0]["wall_s"]
    (d / "results.json").write_text(json.dumps(doc))
    code, err = _report_cli(d)
    assert code == 2 and "Traceback" not in err, err
    assert f"{d / 'results.json'}: cannot be reported" in err and "wall_s" in err, err


@pytest.mark.slow
def test_compare_seeds_ratio_tables(modes_dir):
    assert main_report(modes_dir, compare_seeds=True) == 0
    text = (modes_dir / "report.md").read_text()
    assert "Compared with the seed report" in text and "000_4930a75b133e2896" in text and "RTX 3080" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("| slide/gpu step time"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert math.isclose(float(cells[1]), 1.571 / 0.375, rel_tol=1e-3)     # the seed's ratio
    assert math.isfinite(float(cells[2])) and math.isfinite(float(cells[3]))  # ours, ours/seed


def test_seed_ratios_for_recompute_and_head():
    from slidetune.bench.seeds import compare
    rows = compare("recompute", [{"config": "none", "status": "ok", "step_s_mean": "1.0"},
                                 {"config": "all", "status": "ok", "step_s_mean": "1.5"}])
    r = next(r for r in rows if r["ratio"].endswith("step time"))
    assert math.isclose(r["seed"], 475.8 / 336.7, rel_tol=1e-3) and r["ours"] == 1.5
    rows = compare("head", [{"config": f"{i}-s{s}", "status": "ok", "seq_len": str(s), "gpu_peak_reserved_gib": v}
                            for i, s, v in (("full", 1024, 10), ("chunked", 1024, 5), ("full", 4096, 40),
                                            ("chunked", 4096, 6))])
    r = next(r for r in rows if r["ratio"] == "chunked/full peak GPU reserved")
    assert r["ours"] == 0.5 and r["ours_configs"] == "chunked-s1024/full-s1024"
    assert math.isclose(r["seed"], 10.70 / 13.83, rel_tol=1e-3)


# ---------------------------------------------------------------- recompute attribution
SLEEP_S = 1.0           # far above a tiny layer's compute and a loaded 2-core machine's stalls (0.16-0.33 s seen), so misattribution cannot hide in noise


def _ckpt_step_spans(recompute: str):
    """One ckpt-mode step of tiny-llama whose decoder layers each sleep SLEEP_S per call.
    Returns summed span seconds per (phase, layer) and the layer calls made during backward."""
    from slidetune.bench.measure import synthetic_batches
    from slidetune.device import Device
    from slidetune.engine import AdamWConfig, RuntimeConfig, build_engine
    from slidetune.models.load import load_model
    from slidetune.telemetry.events import EventTimer

    loaded = load_model("tiny-llama", seed=0, with_tokenizer=False)
    dev = Device.resolve("cpu")
    timer = EventTimer(dev)
    engine = build_engine(loaded, RuntimeConfig(mode="ckpt", recompute=recompute, device="cpu", dtype="fp32"),
                          AdamWConfig(lr=1e-3), dev, timer=timer)
    split = engine.split
    orig = split.layer_forward
    calls = []

    def slow_layer(i, params, x, kw):
        t0, in_backward = time.perf_counter(), engine._in_backward
        try:        # a non-reentrant checkpoint's recompute may end early by raising
            time.sleep(SLEEP_S)
            return orig(i, params, x, kw)
        finally:
            calls.append((i, in_backward, time.perf_counter() - t0))

    split.layer_forward = slow_layer
    try:
        mbs = synthetic_batches(split.config.vocab_size, 2, 16, 1, 0)
        engine.train_step(mbs, 1e-3)
        spans = timer.collect()
    finally:
        del split.layer_forward
        engine.close()
    agg = defaultdict(float)
    for s in spans:
        agg[(s.phase, s.layer)] += s.ms / 1e3
    # the layer calls made in backward, each with how long it really took (a stalled sleep included)
    return agg, {i: took for i, in_bw, took in calls if in_bw}, split.num_layers


def test_recompute_time_is_attributed_to_recompute_not_backward():
    agg, bw_calls, L = _ckpt_step_spans("all")
    assert sorted(bw_calls) == list(range(L))          # every checkpointed layer re-ran once in backward
    for i in range(L):
        assert agg[("forward", i)] >= SLEEP_S * 0.95
        assert agg[("recompute", i)] >= SLEEP_S * 0.95       # the re-run is timed as recompute ...
        # ... once: against the call's own duration, so a stalled sleep on a busy machine does not
        # read as double counting (twice would add another SLEEP_S)
        assert agg[("recompute", i)] < bw_calls[i] + 0.9 * SLEEP_S, (i, agg[("recompute", i)], bw_calls[i])
        # ... and not as backward: a recompute counted there would add a whole sleep (>= SLEEP_S); the
        # backward's own few ms may stall on a loaded machine
        assert agg[("backward", i)] < 0.9 * SLEEP_S, (i, agg[("backward", i)])
    assert agg[("head_backward", -1)] < 0.9 * SLEEP_S and agg[("embed_backward", -1)] < 0.9 * SLEEP_S

    agg_none, bw_calls_none, _ = _ckpt_step_spans("none")
    assert bw_calls_none == {} and not any(p == "recompute" for p, _ in agg_none)
    for i in range(L):
        assert agg_none[("backward", i)] < 0.9 * SLEEP_S

    agg_sel, bw_sel, _ = _ckpt_step_spans("1")
    assert list(bw_sel) == [1] and {layer for p, layer in agg_sel if p == "recompute"} == {1}
    assert agg_sel[("recompute", 1)] >= SLEEP_S * 0.95 and agg_sel[("backward", 1)] < 0.9 * SLEEP_S


@pytest.mark.slow
def test_pipeline_smoke(tmp_path):
    """Two slide variants, each profiled: the pipeline table and one Gantt chart per variant."""
    out = tmp_path / "pipeline"
    scenario_module("pipeline").run(_args("pipeline", out))
    summary = _check_dir(out, {"base", "chunk256"})
    assert all(r["status"] == "ok" for r in summary), summary
    report = (out / "report.md").read_text()
    assert "## Pipeline" in report
    for name in ("base", "chunk256"):
        assert (out / f"pipeline_{name}.png").stat().st_size > 1000
        assert f"| {name} |" in report.split("## Pipeline")[1]
    raw = json.loads((out / "results.json").read_text())["results"]
    assert raw[1]["spec"]["runtime"]["chunk_mb"] == 256
    assert "cpu: AdamW" in raw[0]["trace_summary"]["lanes"]["lanes"]
    report_again(out, "## Pipeline", "| chunk256 |")


def test_pipeline_variants_parse_and_reject_bad_fields():
    from slidetune.bench.scenarios.pipeline import parse_variants
    assert parse_variants("base:;big:chunk_mb=256,offload_activations=true,cast_on=cpu") == [
        ("base", {}), ("big", {"chunk_mb": 256, "offload_activations": "true", "cast_on": "cpu"})]
    with pytest.raises(ValueError, match="not key=value with a RuntimeConfig field"):
        parse_variants("x:chunk=3")
    with pytest.raises(ValueError, match="grad_slot_dtype"):
        parse_variants("x:grad_slot_dtype=fp16")


def test_a_machine_value_with_line_breaks_stays_one_comment_line(tmp_path):
    """nvidia-smi's driver query answers one line per GPU: on a 2-GPU host a raw value with a line
    break ended the comment block, and its second line became the CSV's header (the scaling run's
    memory-timeline plot then failed with KeyError 'config')."""
    from slidetune.bench.output import read_csv, read_csv_machine, write_csv
    path = write_csv(tmp_path / "t.csv", [{"config": "a", "n": 1}], ["config", "n"],
                     {"driver": "580.159.04\n580.159.04", "gpu": "H100"})
    assert read_csv(path) == [{"config": "a", "n": "1"}]
    assert read_csv_machine(path) == {"driver": "580.159.04 / 580.159.04", "gpu": "H100"}


def test_the_throughput_sweep_lists_its_runs_in_the_order_they_run():
    """Per workload and rank count: each system; on 2 ranks slide alone; the baselines once (plain),
    slide every recipe, an A/B's variants back to back within each round."""
    from slidetune.bench.scenarios.throughput import sweep
    from slidetune.bench.scenarios.throughput_recipe import parse_recipe
    plain, clip = parse_recipe("plain"), parse_recipe("clip")
    runs = sweep(["m"], [64], [2, 4], [1, 2], ["slide", "fsdp2"], [plain, clip], [("a", {"x": 1}), ("b", {})], 2)
    assert [(r.batch, r.gpus, r.system, r.round, r.recipe["name"], r.variant) for r in runs[:9]] == [
        (2, 1, "slide", 1, "plain", "a"), (2, 1, "slide", 1, "plain", "b"),
        (2, 1, "slide", 1, "clip", "a"), (2, 1, "slide", 1, "clip", "b"),
        (2, 1, "slide", 2, "plain", "a"), (2, 1, "slide", 2, "plain", "b"),
        (2, 1, "slide", 2, "clip", "a"), (2, 1, "slide", 2, "clip", "b"),
        (2, 1, "fsdp2", 1, "plain", "")]
    assert runs[0].overrides == {"x": 1} and runs[8].overrides == {}
    assert [r.system for r in runs if r.gpus == 2] == ["slide"] * 16
    assert len(runs) == 2 * (9 + 8) and runs[17].batch == 4


def test_a_specs_json_form_keeps_the_workload_fields_at_its_top_level():
    """Workers read SPEC.json and the result files carry "spec" flat, as before the workload was
    composed: to_dict flattens it, from_dict reads it back, and a workload field it lacks keeps
    the spec's own default (a soak runs 250 steps, a technique 20)."""
    from slidetune.bench.baselines.fsdp2 import FSDP2Spec
    from slidetune.bench.baselines.hf_train import TechniqueSpec
    from slidetune.bench.measure import MeasureSpec
    from slidetune.bench.soak import SoakSpec
    from slidetune.bench.workload import BenchWorkload
    spec = MeasureSpec(name="a", workload=BenchWorkload("tiny-llama", seq_len=16, batch_size=2), grad_accum=3,
                       runtime={"mode": "slide"})
    d = spec.to_dict()
    assert d["model"] == "tiny-llama" and d["seq_len"] == 16 and d["grad_accum"] == 3 and "workload" not in d
    assert MeasureSpec.from_dict(json.loads(json.dumps(d))) == spec
    d["runtime"]["mode"] = "gpu"                 # a copy: the spec's own dict is left alone
    assert spec.runtime == {"mode": "slide"}
    assert SoakSpec.from_dict({"model": "tiny-qwen3"}).workload == BenchWorkload("tiny-qwen3", batch_size=8, steps=250,
                                                                                 warmup=20, lr=1e-5)
    assert TechniqueSpec.from_dict({"seq_len": 16}).workload.steps == 20
    assert FSDP2Spec.from_dict({"name": "deepspeed-zero3"}).workload.model == "qwen3-4b"
