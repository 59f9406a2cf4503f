"""The collective probe (bench/collective.py), the floor's data-parallel terms (bench/roofline.py)
and `bench throughput --gpus` (bench/scenarios/throughput.py), on CPU: 2 gloo ranks under torchrun."""
from __future__ import annotations

import argparse
import json
import math

import pytest

from slidetune.bench.collective import (LATENCY_BYTES, allgather_bus_factor, allreduce_bus_factor, allreduce_term,
                                        measure_collective, message_sizes)
from slidetune.bench.floor_probes import ADAMW_BYTES
from slidetune.bench.roofline import UPLOAD_READ_BYTES, floor_terms, largest_shard, plan_of_runtime
from slidetune.engine.distributed import shard_units
from slidetune.telemetry.machine import host_peak_rss

GIB = 2**30


@pytest.fixture(scope="module")
def probe():
    """One probe run on 2 gloo ranks (two processes under torchrun): a latency size and 1 MiB."""
    return measure_collective(2, sizes=(LATENCY_BYTES, 2**20), device="cpu", reps=3, warmup=1, timeout_s=300)


@pytest.mark.slow
def test_probe_on_two_gloo_ranks_gives_positive_bandwidths_by_the_nccl_tests_definitions(probe):
    assert probe["status"] == "ok", probe.get("error")
    assert (probe["world_size"], probe["backend"], probe["dtype"]) == (2, "gloo", "float32")
    for op, factor in (("allreduce", allreduce_bus_factor(2)), ("allgather", allgather_bus_factor(2))):
        rows = probe[op]
        assert [r["bytes"] for r in rows] == [LATENCY_BYTES, 2**20]       # whole elements, 2 equal shards
        for r in rows:
            assert len(r["rank_time_s"]) == 2 and r["time_s"] == max(r["rank_time_s"]) > 0
            assert math.isfinite(r["algbw_gib_s"]) and r["algbw_gib_s"] > 0
            assert r["algbw_gib_s"] == pytest.approx(r["bytes"] / r["time_s"] / GIB)
            assert r["busbw_gib_s"] == pytest.approx(r["algbw_gib_s"] * factor)
    # 2 ranks: a ring all-reduce moves 2 (N-1)/N = 1 x the message per rank, an all-gather 1/2
    assert allreduce_bus_factor(2) == 1.0 and allgather_bus_factor(2) == 0.5
    assert allreduce_bus_factor(8) == pytest.approx(1.75)


def test_probe_needs_two_ranks():
    one = measure_collective(1, sizes=(LATENCY_BYTES,), device="cpu", timeout_s=120)
    assert one["status"] == "error" and "at least 2 ranks" in one["error"]


# ------------------------------------------------------------------ the floor on N ranks
_COMP = {"num_layers": 4, "layer_params": 100 * 2**20, "vocab_params": 50 * 2**20, "embed_params": 30 * 2**20,
         "compute_s": 1.0, "layer_recompute_backward_s": 0.15, "layer_forward_s": 0.05, "head_s": 0.1,
         "embed_s": 0.05}
_COPY = {"h2d_gib_s": 50.0, "d2h_gib_s": 50.0}
_ADAMW = {"adamw_params_per_s": 1e9, "adamw_bf16_grad_params_per_s": 1e9, "grad_dtype": "bf16",
          "dram_gib_s": 20.0}


def _collective(world: int, small_bw: float, large_bw: float) -> dict:
    """A probe result in bench.collective's form: the latency size and 128 MiB (their bus bandwidths given)."""
    rows = [{"bytes": LATENCY_BYTES, "busbw_gib_s": small_bw}, {"bytes": 128 * 2**20, "busbw_gib_s": large_bw}]
    return {"status": "ok", "world_size": world, "bytes_per_elem": 2, "allreduce": rows, "allgather": []}


def test_floor_on_two_ranks_adds_the_allreduce_on_the_compute_stream_and_splits_the_downloads():
    plan = plan_of_runtime(_COMP)
    numels = [u.numel for u in plan.units]          # embed 30M, 4 layers of 100M, head 20M
    coll = _collective(2, small_bw=1.0, large_bw=40.0)
    one = floor_terms(_COMP, _COPY, _ADAMW, plan)
    two = floor_terms(_COMP, _COPY, _ADAMW, plan, collective=coll, ranks=2)
    # every unit's BF16 gradient, 2 (N-1)/N x its bytes at the bus bandwidth probed nearest its size
    # (all of these units are nearer 128 MiB than 4 KiB on a log scale)
    want = sum(allreduce_bus_factor(2) * 2 * n / (40.0 * GIB) for n in numels)
    assert two["allreduce_s"] == pytest.approx(want) == pytest.approx(allreduce_term(numels, coll))
    assert two["compute_s"] == pytest.approx(one["compute_s"] + want)
    # only the owner downloads: the busiest rank's shard (shard_units' balance), over its own link
    owners = shard_units(numels, 2)
    shard = max(sum(n for n, o in zip(numels, owners) if o == r) for r in range(2))
    assert largest_shard(plan, 2) == shard < sum(numels)
    assert two["d2h_s"] == pytest.approx(2 * shard / (50 * GIB))
    # units updated on the GPU have no owner: 3 host layers of 100M over 2 ranks, the busiest holds 2
    placed = plan_of_runtime(_COMP, {"vocab_update": "device", "device_layers": 1})
    assert largest_shard(placed, 2) == 2 * _COMP["layer_params"]
    # every rank uploads every unit over its own link; the host's AdamW is the host's
    assert two["h2d_s"] == one["h2d_s"] and two["adamw_s"] == one["adamw_s"]
    # the shared master read by both ranks' uploads, beside AdamW's traffic and the gradients' DMA
    # writes (2 B/param, each unit once), at the probes' best DRAM rate; one rank: one upload read
    seen = max(20.0, 1e9 * ADAMW_BYTES["adamw_bf16_grad_params_per_s"] / GIB)
    dram = (2 * UPLOAD_READ_BYTES * plan.upload_params() + (26 + 2) * plan.host_updated_params) / (seen * GIB)
    assert two["host_dram_s"] == pytest.approx(dram)
    assert one["host_dram_s"] == pytest.approx(
        (UPLOAD_READ_BYTES * plan.upload_params() + (26 + 2) * plan.host_updated_params) / (seen * GIB))
    # fp32 gradient slots move twice the bytes
    assert floor_terms(_COMP, _COPY, _ADAMW, plan, collective=coll, ranks=2, grad_bytes=4)["allreduce_s"] == \
        pytest.approx(2 * want)
    # clipped: the sweep waits for the whole backward, all-reduces included
    clipped = plan_of_runtime(_COMP, clipped=True)
    c1 = floor_terms(_COMP, _COPY, _ADAMW, clipped)
    c2 = floor_terms(_COMP, _COPY, _ADAMW, clipped, collective=coll, ranks=2)
    assert c2["clip_sweep_s"] == pytest.approx(c1["clip_sweep_s"] + want)


def test_floor_on_one_rank_is_unchanged_and_the_probe_must_match_the_ranks():
    plan = plan_of_runtime(_COMP)
    base = floor_terms(_COMP, _COPY, _ADAMW, plan)
    assert floor_terms(_COMP, _COPY, _ADAMW, plan, ranks=1) == base
    # one rank has no collective terms; its host DRAM term is AdamW's and the DMA's traffic
    assert set(base) == {"compute_s", "h2d_s", "d2h_s", "adamw_s", "host_dram_s"}
    no_dram = {k: v for k, v in _ADAMW.items() if k != "dram_gib_s"}
    assert set(floor_terms(_COMP, _COPY, no_dram, plan)) == {"compute_s", "h2d_s", "d2h_s", "adamw_s"}
    with pytest.raises(ValueError, match="2 ranks, the floor is for 4"):
        floor_terms(_COMP, _COPY, _ADAMW, plan, collective=_collective(2, 1.0, 40.0), ranks=4)


def test_small_messages_take_the_latency_sizes_bandwidth():
    coll = _collective(2, small_bw=0.5, large_bw=40.0)
    assert allreduce_term([1024], coll) == pytest.approx(2 * 1024 / (0.5 * GIB))
    assert allreduce_term([64 * 2**20], coll) == pytest.approx(2 * 64 * 2**20 / (40.0 * GIB))
    assert allreduce_term([64 * 2**20], _collective(1, 1.0, 1.0) | {"world_size": 1}) == 0.0
    assert message_sizes([10, 10, 3000], 2) == (20, LATENCY_BYTES, 6000)


def test_host_rss_counts_the_shared_state_once():
    gib = 2**30
    ranks = [{"peak_rss": 5 * gib, "rss_shmem": 3 * gib}, {"peak_rss": 4 * gib, "rss_shmem": 3 * gib}]
    assert host_peak_rss(ranks) == (2 + 1 + 3) * gib
    assert host_peak_rss([{"peak_rss": 5 * gib, "rss_shmem": 0}]) == 5 * gib
    # each rank has touched 3 GiB of a 5 GiB shared file (its shard, the masters it uploads): the
    # whole file is host memory (reserved with posix_fallocate), counted once
    assert host_peak_rss(ranks, shared_bytes=5 * gib) == (2 + 1 + 5) * gib
    # the libraries' file pages (0.5 GiB a rank) are one page-cache copy: counted once
    with_files = [dict(r, rss_file=gib // 2) for r in ranks]
    assert host_peak_rss(with_files, shared_bytes=5 * gib) == (2 + 1 - 0.5 + 5) * gib
    # a run that recorded them only in its host-memory snapshots (2026-11-26) is read the same way
    snapped = [dict(r, host_memory={"stepped": {"rss_file": gib // 2}}) for r in ranks]
    assert host_peak_rss(snapped, shared_bytes=5 * gib) == (2 + 1 - 0.5 + 5) * gib


# ------------------------------------------------------------------ bench throughput --gpus
def _args(module, argv):
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return p.parse_args(argv)


def test_gpus_beyond_the_visible_count_are_refused():
    from slidetune.bench.scenarios.throughput import parse_gpus
    assert parse_gpus("1,2", "cpu") == [1, 2]
    assert parse_gpus("2,2,1", "cpu") == [2, 1]
    with pytest.raises(ValueError, match="--gpus 2 with --device cuda: this machine has 0 visible GPUs"):
        parse_gpus("1,2", "cuda")
    with pytest.raises(ValueError, match="at least 1"):
        parse_gpus("0", "cpu")


def test_ranks_share_the_hosts_cores():
    """torchrun would give each of several ranks one OpenMP thread (the host AdamW's threads)."""
    from slidetune.parallel import launch
    cores = launch.host_cores()
    assert launch.rank_threads_env(2, {})["OMP_NUM_THREADS"] == str(max(1, cores // 2))
    assert launch.rank_threads_env(2, {"OMP_NUM_THREADS": "3"})["OMP_NUM_THREADS"] == "3"     # the user's
    assert "OMP_NUM_THREADS" not in launch.rank_threads_env(1, {})


def test_rows_on_two_ranks_carry_the_allreduce_term_and_the_scaling():
    """The row logic alone (a partial CPU floor, as a CPU run gets): the N=2 row's floor adds the
    all-reduce of the probe's units; efficiency is per-GPU tokens/s over the N=1 row's."""
    from slidetune.bench.scenarios import throughput_rows
    fl = {"status": "ok", "partial": True, "floor_s": 0.01, "bound_by": "adamw_s",
          "terms": {"compute_s": None, "h2d_s": None, "d2h_s": None, "adamw_s": 0.01}}
    numels = [300, 2000, 2000, 200]
    coll = {**_collective(2, small_bw=1e-4, large_bw=1e-3), "bytes_per_elem": 4,
            "sizes_from": {"unit_numels": numels, "grad_bytes": 4}}
    rt = {"mode": "slide", "dtype": "fp32"}
    one = throughput_rows._row("slide", "m", 2, 32, {"status": "ok", "step_s_mean": 1.0, "tokens_per_s": 64.0,
                                                "runtime": rt}, None, fl, ranks=1)
    two = throughput_rows._row("slide", "m", 2, 32, {"status": "ok", "step_s_mean": 1.6, "tokens_per_s": 80.0,
                                                "tokens_per_s_per_gpu": 40.0, "runtime": rt}, None, fl,
                          collective=coll, ranks=2)
    throughput_rows.add_scaling([one, two])
    want = allreduce_term(numels, coll, 4)
    assert one["allreduce_s"] is None and one["floor_s"] == 0.01
    assert two["allreduce_s"] == pytest.approx(want) and two["floor_s"] == pytest.approx(max(0.01, want))
    assert two["scaling_efficiency"] == pytest.approx(40.0 / 64.0) and one["scaling_efficiency"] == 1.0


@pytest.mark.slow
def test_bench_throughput_gpus_1_2_on_cpu(tmp_path):
    """`bench throughput --gpus 1,2 --device cpu` (--smoke: a tiny Qwen3, 2 steps after 1 warm-up):
    a row per rank count, the 2-rank one on 2 gloo processes with its floor's all-reduce term from
    the probe run in the same call, its scaling efficiency and the host's RSS over both ranks."""
    from slidetune.bench.scenarios import throughput
    from slidetune.bench.output import read_csv
    out = throughput.run(_args(throughput, ["--smoke", "--out", str(tmp_path), "--models", "tiny-qwen3",
                                            "--systems", "slide", "--recipes", "clip", "--gpus", "1,2"]))
    rows = {int(r["gpus"]): r for r in read_csv(out / "throughput.csv")}
    assert set(rows) == {1, 2} and {r["status"] for r in rows.values()} == {"ok"}, rows
    one, two = rows[1], rows[2]
    assert float(two["tokens_per_s_per_gpu"]) == pytest.approx(float(two["tokens_per_s"]) / 2)
    assert float(two["scaling_efficiency"]) == pytest.approx(float(two["tokens_per_s_per_gpu"])
                                                             / float(one["tokens_per_s"]))
    assert float(one["scaling_efficiency"]) == 1.0 and one["allreduce_s"] == ""
    doc = json.loads((out / "throughput.json").read_text())
    coll = doc["collectives"]["tiny-qwen3/n2"]
    assert coll["status"] == "ok" and coll["world_size"] == 2 and coll["backend"] == "gloo"
    want = allreduce_term(coll["sizes_from"]["unit_numels"], coll, 4)          # fp32 slots on the CPU
    assert want > 0 and float(two["allreduce_s"]) == pytest.approx(want)
    assert float(two["floor_s"]) >= want and two["floor_bound_by"] in ("adamw_s", "allreduce_s")
    # two processes: more than rank 0's own peak, less than two of the larger
    run2 = next(r for r in doc["runs"] if r.get("gpus") == 2)
    assert run2["world_size"] == 2 and len(run2["rank_results"]) == 2
    assert float(two["cpu_peak_rss_gib"]) < float(two["host_rss_gib"])
    assert float(two["host_rss_gib"]) <= sum(r["peak_rss"] for r in run2["rank_results"]) / GIB
    # each rank's host memory by kind at start, built and stepped (a rank's fixed cost read apart)
    for r in run2["rank_results"]:
        snaps = r["host_memory"]
        assert list(snaps) == ["start", "built", "stepped"]
        assert all(s["rss_anon"] > 0 and s["rss"] >= s["rss_anon"] for s in snaps.values())
        assert snaps["stepped"]["peak_rss"] >= snaps["built"]["rss"] >= snaps["start"]["rss_anon"]
    run1 = next(r for r in doc["runs"] if r.get("gpus") == 1)
    assert set(run1["host_memory"]) == {"start", "built", "stepped"}
    report = (out / "report.md").read_text()
    assert "## Scaling: slide on N GPUs of one host" in report and "| tiny-qwen3/n2 | allreduce |" in report
    assert (out / "scaling.png").stat().st_size > 1000


def test_floor_of_gathered_weights_uploads_a_shard_and_broadcasts_the_rest():
    """dp_weights=gather: each rank uploads its owners' share, the master is read once, and every
    upload crosses the GPUs' links at the all-gather bus bandwidth ((N-1)/N of its bytes)."""
    plan = plan_of_runtime(_COMP)
    rows = [{"bytes": LATENCY_BYTES, "busbw_gib_s": 1.0}, {"bytes": 128 * 2**20, "busbw_gib_s": 100.0}]
    coll = _collective(2, small_bw=1.0, large_bw=40.0) | {"allgather": rows}
    upload = floor_terms(_COMP, _COPY, _ADAMW, plan, collective=coll, ranks=2)
    gather = floor_terms(_COMP, _COPY, _ADAMW, plan, collective=coll, ranks=2, dp_weights="gather")
    share = largest_shard(plan, 2) / plan.host_updated_params
    assert 0.5 <= share < 1
    assert gather["h2d_s"] == pytest.approx(upload["h2d_s"] * share)
    layer_uploads, _ = plan.uploads_per_step()
    messages = [_COMP["layer_params"]] * layer_uploads + [plan.units[0].numel, plan.units[-1].numel]
    assert gather["gather_s"] == pytest.approx(sum(0.5 * 2 * n / (100.0 * GIB) for n in messages))
    seen = max(20.0, 1e9 * ADAMW_BYTES["adamw_bf16_grad_params_per_s"] / GIB)
    assert gather["host_dram_s"] == pytest.approx(
        (UPLOAD_READ_BYTES * plan.upload_params() + (26 + 2) * plan.host_updated_params) / (seen * GIB))
    assert gather["host_dram_s"] < upload["host_dram_s"]
    assert gather["allreduce_s"] == upload["allreduce_s"] and "gather_s" not in upload


def test_host_dram_counts_the_clipped_sweeps_two_passes_and_the_dma():
    """One rank, clipped with the split sweep: the host DRAM term is both AdamW passes over the RAM
    units (18 + 18 B/param), a whole pass over the disk units (26) and the upload copies' copy pass
    and whole update (16 + 26), the uploads' master reads (4 B per uploaded parameter) and the
    gradients' DMA writes (2 B/param), at the best DRAM rate the probes saw (here the moments
    pass's own traffic, above the a += b probe's)."""
    from slidetune.bench.roofline import adamw_dram_bytes
    adamw = dict(_ADAMW, adamw_weights_pass_params_per_s=8e9, adamw_moments_pass_params_per_s=9e9,
                 adamw_weights_copy_pass_params_per_s=7e9)
    seen = 9e9 * 18 / GIB                                  # 150.9 GiB/s against the probe's 20
    clipped = plan_of_runtime(_COMP, clipped=True)
    P = clipped.host_updated_params
    assert adamw_dram_bytes(clipped, adamw) == 36 * P
    terms = floor_terms(_COMP, _COPY, adamw, clipped)
    assert terms["host_dram_s"] == pytest.approx((36 * P + 2 * P + UPLOAD_READ_BYTES * clipped.upload_params())
                                                 / (seen * GIB))
    # no split sweep (its passes not probed, or not split): one whole pass
    assert adamw_dram_bytes(clipped, _ADAMW) == 26 * P
    assert adamw_dram_bytes(clipped, adamw, split_sweep=False) == 26 * P
    # disk units a whole pass; upload copies (clip_sweep=weights) the copy pass and the whole update
    mixed = plan_of_runtime(_COMP, {"disk_units": 1, "disk_dir": "/d", "clip_sweep": "weights"}, clipped=True)
    disk, copies = mixed.params("disk"), mixed.upload_copy_numel()
    assert disk and copies == mixed.params("host")
    assert adamw_dram_bytes(mixed, adamw) == 26 * disk + (16 + 26) * copies
    # unclipped: one pass
    assert adamw_dram_bytes(plan_of_runtime(_COMP), adamw) == 26 * P


def test_the_clipped_sweep_shares_the_dram_with_the_uploads_that_follow_it():
    """Clipped, split sweep: the weights pass over the RAM units runs while the next forward
    uploads each swept unit (its master read, 4 B/param; 2 ranks on one host, twice), so the sweep
    takes at least (18 + 4 x uploads) B/param at the best DRAM rate the probes saw, where that
    exceeds the pass alone at its probed rate; with a fast DRAM the pass's own rate binds."""
    clipped = plan_of_runtime(_COMP, clipped=True)
    ram = clipped.params("host")
    backward = 4 * 0.15 + 0.1 + 0.05
    slow = dict(_ADAMW, adamw_weights_pass_params_per_s=8e9, adamw_moments_pass_params_per_s=8e9)
    best = 8e9 * 18 / GIB                                  # the passes' own traffic, above the probe's 20 GiB/s
    swept = (18 + UPLOAD_READ_BYTES) * ram / (best * GIB)  # > ram / 8e9: the DRAM binds
    assert swept > ram / 8e9
    assert floor_terms(_COMP, _COPY, slow, clipped)["clip_sweep_s"] == pytest.approx(backward + swept + 0.05)
    coll = _collective(2, small_bw=1.0, large_bw=1e6)
    two = floor_terms(_COMP, _COPY, slow, clipped, collective=coll, ranks=2)
    reduce_s = allreduce_term([u.numel for u in clipped.units], coll)
    assert two["clip_sweep_s"] == pytest.approx(backward + reduce_s + (18 + 2 * UPLOAD_READ_BYTES) * ram / (best * GIB)
                                                + 0.05)
    # a DRAM far faster than the pass: the pass's probed rate
    fast = dict(slow, dram_gib_s=10_000.0)
    assert floor_terms(_COMP, _COPY, fast, clipped)["clip_sweep_s"] == pytest.approx(backward + ram / 8e9 + 0.05)
    # no DRAM probe: the pass's rate
    no_dram = {k: v for k, v in slow.items() if k != "dram_gib_s"}
    assert floor_terms(_COMP, _COPY, no_dram, clipped)["clip_sweep_s"] == pytest.approx(backward + ram / 8e9 + 0.05)
