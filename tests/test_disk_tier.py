"""The disk tier (engine/slide/disk_tier.py) and the one placement plan (engine/placement.py).

- the tier's ring: read ahead, AdamW, write behind, with an update order the prefetch did not
  foresee, never deadlocks and never loses a write;
- an engine with units on disk is bit-exact against the in-RAM store, across steps (eager,
  clipped with accumulation) and across a checkpoint/resume, in either direction;
- the fit places state across GPU, host RAM and disk at its boundaries: the disk only when RAM
  and GPU cannot hold the state, and only as many units as needed;
- a disk directory that is missing, a file, read-only or too small gets a clear error before
  step 1; the scratch files are removed at close, a killed run's at the next start, and never
  taken for a checkpoint.
(The bit-exactness against the plain reference is in test_equivalence.py, runs "*disk*".)
"""
from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from slidetune.checkpoint import checkpoint_dir, latest_checkpoint, load_checkpoint, save_checkpoint
from slidetune.engine.config import RuntimeConfig
from slidetune.engine.fit import FIT_SAFETY, GiB, InsufficientMemoryError, check_fit, choose_auto_settings, estimate_memory
from slidetune.engine.placement import PlacementPlan, shapes_from_counts, unit_shapes
from slidetune.engine.slide import disk_tier
from slidetune.engine.slide.disk_tier import (SCRATCH_NOTE, SCRATCH_PREFIX, DiskTier, DiskTierError,
                                              StreamedTensor, check_directory)
from test_checkpoint import batches, make_engine, shut, train
from test_fit import cuda_rt, split_of

DISK = dict(disk_block_mb=0.1, disk_buffers=3)   # several blocks a tiny layer, a 3-buffer ring


def state(eng) -> dict[str, torch.Tensor]:
    """Masters and optimizer state, the disk tier's read back through it."""
    eng.synchronize()
    out = {k: v.materialize() if isinstance(v, StreamedTensor) else v.clone() for k, v in eng.named_master_params()}
    for k, t in eng.optimizer_tensors().items():
        out[k] = t.materialize() if isinstance(t, StreamedTensor) else t.clone()
    return out


def assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].reshape(-1), b[k].reshape(-1)), k


# --------------------------------------------------------------------------- the ring
def test_ring_serves_any_order_and_keeps_every_write(tmp_path):
    """Units prefetched in one order and updated in another (as earliest-deadline-first may do),
    through 3 buffers: every block read back holds what was last written to it."""
    units = {1: 30000, 2: 30000, 3: 5000}
    tier = DiskTier(tmp_path, units, block_mb=0.05, buffers=3, io_threads=2)
    try:
        assert tier.block == 6144 and tier.blocks(1) == 5 and tier.blocks(3) == 1
        for rnd in range(3):
            for u in (3, 2, 1):
                tier.prefetch(u)
            for u in (1, 3, 2):                          # not the prefetch order
                for b in range(tier.blocks(u)):
                    blk = tier.acquire(u, b)
                    m, v = blk.exp_avg, blk.exp_avg_sq
                    lo, hi = tier.block_range(u, b)
                    assert torch.equal(m, torch.full((hi - lo,), float(rnd * 100 + u))) or rnd == 0
                    assert rnd > 0 or (m == 0).all() and (v == 0).all()       # AdamW's moments start at zero
                    m.fill_((rnd + 1) * 100 + u)
                    v.fill_(-u)
                    tier.release(u, b)
        tier.drain()
        assert torch.equal(torch.cat(list(tier.read_range(2, "exp_avg", 0, 30000))), torch.full((30000,), 302.0))
        assert torch.equal(torch.cat(list(tier.read_range(3, "exp_avg_sq", 0, 5000))), torch.full((5000,), -3.0))
        assert tier.bytes_written >= 3 * sum(8 * tier.block * tier.blocks(u) for u in units)
    finally:
        tier.close()
    assert list(tmp_path.iterdir()) == []                  # the scratch directory is gone


@pytest.mark.parametrize("seed", [2, 3, 4])
def test_an_io_bound_sweep_reads_each_block_once(tmp_path, monkeypatch, seed):
    """The engine's pattern on a slow disk (the 2026-11-25 Qwen3-14B): step k's prefetch comes
    before step k-1's sweep has run, the sweep runs in another thread and may start before the
    next prefetch, and AdamW outruns the reads. Every block is read at most once a sweep and every
    update sees the last one's values. (The demand path used to take back a prefetched block and
    put it first in the queue, where the pump read it again at once: with these timings 23-27%
    more reads than blocks; on the GPU machine the next sweep's first unit was read ~20 times a
    step, half the step's disk I/O.)"""
    import random
    rng, lock = random.Random(seed), threading.Lock()
    real_read, real_write = os.preadv, os.pwritev

    def slow(io, lo, hi):
        def run(*a):
            with lock:
                delay = rng.uniform(lo, hi)
            threading.Event().wait(delay)
            return io(*a)
        return run
    monkeypatch.setattr(os, "preadv", slow(real_read, 0.002, 0.012))
    monkeypatch.setattr(os, "pwritev", slow(real_write, 0.001, 0.008))
    units = {i: 2048 * 10 for i in range(20, 30)}
    tier = DiskTier(tmp_path, units, block_mb=0.02, buffers=8, io_threads=4)
    sweeps, seen = 6, []

    def pause(longest: float) -> None:
        with lock:
            delay = rng.uniform(0, longest)
        threading.Event().wait(delay)

    def sweep(k: int) -> None:
        pause(0.3)                                        # the backward the norm waits for
        for u in sorted(units):
            for b in range(tier.blocks(u)):
                blk = tier.acquire(u, b)
                seen.append(bool((blk.exp_avg == float(k)).all()))
                blk.exp_avg.add_(1.0)
                pause(0.002)                              # AdamW on the block
                tier.release(u, b)
    try:
        worker = None
        for k in range(sweeps):
            for u in sorted(units):                       # train_step k's prefetch
                tier.prefetch(u)
            if worker is not None:
                worker.join()                             # its forward waits for sweep k-1
            worker = threading.Thread(target=sweep, args=(k,))
            worker.start()                                # sweep k, submitted at train_step k's end
            pause(0.3)                                    # the rest of train_step k
        worker.join()
        tier.drain()
        blocks = sum(tier.blocks(u) for u in units)
        assert all(seen) and len(seen) == sweeps * blocks
        assert tier.bytes_written == sweeps * blocks * 8 * tier.block
        assert tier.bytes_read <= sweeps * blocks * 8 * tier.block
    finally:
        tier.close()


@pytest.mark.parametrize("seed", [1, 5, 9])
def test_the_ring_stays_exact_under_any_mix_of_orders_and_demands(tmp_path, monkeypatch, seed):
    """Random rings (2-6 buffers, 1-4 I/O threads, ragged units) over 12 steps mixing what the
    engine and checkpoints do: steps with and without a prefetch, prefetches no update consumes,
    updates in an order the prefetch did not foresee, whole-unit reads and fresh writes between
    steps. Every block read holds what was last written to it, and nothing deadlocks."""
    import random
    rng, lock = random.Random(seed), threading.Lock()
    real_read, real_write = os.preadv, os.pwritev

    def jitter(hi: float) -> None:
        with lock:
            delay = rng.uniform(0, hi)
        threading.Event().wait(delay)
    monkeypatch.setattr(os, "preadv", lambda *a: (jitter(0.004), real_read(*a))[1])
    monkeypatch.setattr(os, "pwritev", lambda *a: (jitter(0.003), real_write(*a))[1])
    units = {i: 2048 * rng.randint(1, 6) + rng.randint(0, 2047) for i in range(5)}
    tier = DiskTier(tmp_path, units, block_mb=0.02, buffers=rng.randint(2, 6), io_threads=rng.randint(1, 4))
    expect = {(u, b): 0.0 for u in units for b in range(tier.blocks(u))}
    try:
        for step in range(12):
            order = sorted(units)
            if rng.random() < 0.7:
                for u in order:
                    tier.prefetch(u)
            if rng.random() < 0.3:
                rng.shuffle(order)
            if rng.random() < 0.8:
                for u in order:
                    for b in range(tier.blocks(u)):
                        blk = tier.acquire(u, b)
                        assert bool((blk.exp_avg == expect[u, b]).all()), (step, u, b)
                        blk.exp_avg.add_(1.0)
                        expect[u, b] += 1.0
                        tier.release(u, b)
            if rng.random() < 0.3:
                tier.drain()
                u = rng.choice(sorted(units))
                want = torch.cat([torch.full((tier.block_range(u, b)[1] - tier.block_range(u, b)[0],), expect[u, b])
                                  for b in range(tier.blocks(u))])
                assert torch.equal(torch.cat(list(tier.read_range(u, "exp_avg", 0, units[u]))), want)
            if rng.random() < 0.2:
                u = rng.choice(sorted(units))
                tier.write_unit(u, exp_avg=float(step * 100), exp_avg_sq=0.0)
                expect.update({(u, b): float(step * 100) for b in range(tier.blocks(u))})
        tier.drain()
    finally:
        tier.close()


def test_an_io_error_surfaces_in_the_waiting_thread(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, {1: 5000}, block_mb=0.05, buffers=3, io_threads=1)
    try:
        def broken(*a, **k):
            raise OSError(5, "Input/output error")
        monkeypatch.setattr(os, "preadv", broken)
        with pytest.raises(DiskTierError, match="disk tier I/O failed.*Input/output error"):
            tier.acquire(1, 0)
    finally:
        tier.close()


def test_an_aborted_run_stops_waiting(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, {1: 5000}, block_mb=0.05, buffers=3, io_threads=1)
    stop = threading.Event()
    monkeypatch.setattr(os, "preadv", lambda *a: stop.wait(5) or 0)
    tier.abort = threading.Event()
    tier.abort.set()
    try:
        with pytest.raises(DiskTierError, match="another pipeline thread failed"):
            tier.acquire(1, 0)
    finally:
        stop.set()
        tier._error = None
        tier.close()


# --------------------------------------------------------------------------- the engine
@pytest.mark.parametrize("recipe", ["eager", "clip-accum2", "clip-device-vocab-resident"])
def test_disk_units_are_bit_exact_against_the_ram_store(tmp_path, recipe):
    accum, clip, extra = {"eager": (1, None, {}),
                          "clip-accum2": (2, 0.5, {}),
                          "clip-device-vocab-resident": (1, 0.5, {"device_layers": 1, "vocab_update": "device",
                                                                  "cache_units": 2, "resident_layers": 1})}[recipe]
    ram = make_engine(grad_accum=accum, max_grad_norm=clip, layers=4, runtime=dict(extra))
    disk = make_engine(grad_accum=accum, max_grad_norm=clip, layers=4,
                       runtime=dict(extra, disk_units=3, disk_dir=str(tmp_path), **DISK))
    try:
        # the head and layers 3, 2; with the head on the device, layers 3, 2, 1
        on_disk = [u.tier.name == "disk" for u in disk.units]
        assert on_disk == ([False, False, False, True, True, True] if "vocab_update" not in extra
                           else [False, False, True, True, True, False])
        assert train(ram, range(4), accum) == train(disk, range(4), accum)
        assert_identical(state(ram), state(disk))
        report = disk.memory_report()
        assert report["host_state"] < ram.memory_report()["host_state"]
        assert report["disk_read"] > 0 and report["disk_written"] > 0
    finally:
        shut(ram)
        shut(disk)


@pytest.mark.parametrize("saved,resumed", [("disk", "disk"), ("disk", "ram"), ("ram", "disk"), ("master", "master"),
                                           ("disk", "master"), ("master", "disk"), ("master", "ram")])
def test_resume_across_the_disk_tier_is_exact(tmp_path, saved, resumed):
    """A checkpoint taken while units live on disk reads their moments (and masters, "master":
    --tuning.disk_master on) from there and writes them like any other tensor: it resumes
    exactly, with or without the tier or the masters on it, and the other way."""
    def runtime(where):
        if where == "ram":
            return {}
        return dict(disk_units=2, disk_dir=str(tmp_path / "scratch"), disk_master="on" if where == "master" else "off",
                    **DISK)
    (tmp_path / "scratch").mkdir()
    ref = make_engine(max_grad_norm=0.5, runtime=runtime(saved))
    ref_losses = train(ref, range(4))
    want = state(ref)
    shut(ref)
    first = make_engine(max_grad_norm=0.5, runtime=runtime(saved))
    losses = train(first, range(2))
    ckpt = save_checkpoint(first, checkpoint_dir(tmp_path / "run", 2), step=2)
    shut(first)
    other = make_engine(max_grad_norm=0.5, seed=99, runtime=runtime(resumed))
    try:
        load_checkpoint(other, ckpt)
        losses += train(other, range(2, 4))
        assert losses == ref_losses
        assert_identical(state(other), want)
    finally:
        shut(other)
    assert not any((tmp_path / "scratch").iterdir())         # every engine removed its scratch files


def test_scratch_files_are_not_a_checkpoint_and_go_at_close(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    eng = make_engine(runtime=dict(disk_units=1, disk_dir=str(run), **DISK))
    try:
        train(eng, range(1))
        scratch = [p for p in run.iterdir() if p.name.startswith(SCRATCH_PREFIX)]
        assert len(scratch) == 1 and (scratch[0] / SCRATCH_NOTE).exists()
        assert latest_checkpoint(run) is None
    finally:
        shut(eng)
    assert list(run.iterdir()) == []


def test_a_killed_runs_scratch_is_removed_at_the_next_start(tmp_path):
    dead = tmp_path / f"{SCRATCH_PREFIX}999999999-1"       # no such process
    dead.mkdir()
    (dead / "unit-0001.moments").write_bytes(b"x" * 4096)
    alive = tmp_path / f"{SCRATCH_PREFIX}{os.getppid()}-1"   # a running process's: kept
    alive.mkdir()
    check_directory(tmp_path, 0)
    assert not dead.exists() and alive.exists()


# --------------------------------------------------------------------------- directory errors
def test_directory_errors_are_clear_before_step_1(tmp_path, monkeypatch):
    with pytest.raises(DiskTierError, match="does not exist; create it"):
        check_directory(tmp_path / "missing", 1)
    (tmp_path / "file").write_text("x")
    with pytest.raises(DiskTierError, match="is a file, not a directory"):
        check_directory(tmp_path / "file", 1)
    with pytest.raises(DiskTierError, match=r"GiB free but the disk tier needs .* \(--tuning.disk_units\)"):
        check_directory(tmp_path, 1 << 60)
    # read-only: this suite may run as root, for whom permission bits do not stop a write, so the
    # answer a read-only filesystem gives is simulated
    monkeypatch.setattr(disk_tier.os, "access", lambda p, mode: False)
    with pytest.raises(DiskTierError, match="is not writable"):
        check_directory(tmp_path, 1)


def test_a_described_disk_is_checked_by_its_size_alone(tmp_path):
    """`plan --disk-dir PATH --disk-free-gib N` plans another machine's disk: PATH need not exist here."""
    assert check_directory(tmp_path / "elsewhere", 10 * GiB, free_bytes=20 * GiB) == tmp_path / "elsewhere"
    with pytest.raises(DiskTierError, match="20.0 GiB free but the disk tier needs 30.0 GiB"):
        check_directory(tmp_path / "elsewhere", 30 * GiB, free_bytes=20 * GiB)


def test_the_fit_check_refuses_a_disk_too_small_before_allocating(tmp_path, monkeypatch):
    split = split_of("qwen3-14b")
    rt = cuda_rt(disk_dir=str(tmp_path), disk_units=10)
    monkeypatch.setattr(disk_tier.shutil, "disk_usage", lambda p: SimpleNamespace(free=2 * GiB))
    with pytest.raises(DiskTierError, match="2.0 GiB free but the disk tier needs"):
        check_fit(split, rt, batch_size=4, seq_len=1024, gpu_free_bytes=78 * GiB, host_available_bytes=900 * GiB)
    with pytest.raises(DiskTierError, match="does not exist"):
        check_fit(split, dataclasses.replace(rt, disk_dir=str(tmp_path / "nope")), batch_size=4, seq_len=1024,
                  gpu_free_bytes=78 * GiB, host_available_bytes=900 * GiB)


def test_disk_units_without_a_directory_are_refused():
    with pytest.raises(ValueError, match="--disk-dir PATH"):
        RuntimeConfig(disk_units=2)


# --------------------------------------------------------------------------- placement across tiers
def test_the_plan_puts_the_head_then_the_top_layers_on_disk():
    shapes = shapes_from_counts(6, 100, 50, 50)
    plan = PlacementPlan.build(shapes, RuntimeConfig(disk_dir="/x", disk_units=3, device_layers=2,
                                                     vocab_update="device"))
    # the head is on the GPU: layers 5, 4 and 3 (units 6, 5, 4)
    assert [u.state for u in plan.units] == ["gpu", "gpu", "gpu", "host", "disk", "disk", "disk", "gpu"]
    plan = PlacementPlan.build(shapes, RuntimeConfig(disk_dir="/x", disk_units=3))
    assert plan.indices("disk") == [5, 6, 7]      # the head (unit 7), then layers 5 and 4 (units 6, 5)
    assert plan.state_bytes() == {"gpu": 0, "host": 12 * 700 - 8 * 250, "disk": 8 * 250}
    assert plan.disk_capacity() == 7              # every unit but the embedding
    half = PlacementPlan.build(shapes, RuntimeConfig(disk_dir="/x", disk_units=0.5))
    assert half.indices("disk") == [4, 5, 6, 7]   # a fraction of the 7 that may go (round(3.5) = 4)
    assert RuntimeConfig(disk_dir="/x", disk_units=3.0).disk.disk_units == 3
    with pytest.raises(ValueError, match="a count, a fraction"):
        RuntimeConfig(disk_dir="/x", disk_units=2.5)
    with pytest.raises(ValueError, match="only 7 units can go to disk"):
        PlacementPlan.build(shapes, RuntimeConfig(disk_dir="/x", disk_units=8))
    assert "disk tier (moments; master in host RAM): layers 4-5, head" in "\n".join(plan.summary_lines())
    assert PlacementPlan.from_dict(plan.to_dict()) == plan


def test_auto_places_on_disk_only_what_ram_and_gpu_cannot_hold(tmp_path):
    """Qwen3-14B b4 on the H100 machine (78 GiB GPU): with RAM to spare nothing goes to disk; with
    110 GiB of host RAM (what the machine has) the fewest units that make the host fit: one
    fewer and it does not. Without a disk directory the refusal names the tier."""
    split = split_of("qwen3-14b")
    kw = dict(batch_size=4, seq_len=1024, max_grad_norm=1.0)
    rt = cuda_rt(disk_dir=str(tmp_path))
    roomy = choose_auto_settings(split, rt, gpu_free_bytes=78 * GiB, host_available_bytes=400 * GiB, **kw)
    assert roomy.disk.disk_units == 0
    host = 123 * GiB
    got = choose_auto_settings(split, rt, gpu_free_bytes=78 * GiB, host_available_bytes=host, **kw)
    est = estimate_memory(split, got, **kw)
    assert got.disk.disk_units > 0 and est.host_bytes <= FIT_SAFETY * host and est.gpu_bytes <= FIT_SAFETY * 78 * GiB
    fewer = estimate_memory(split, dataclasses.replace(got, disk_units=got.disk.disk_units - 1), **kw)
    assert fewer.host_bytes > FIT_SAFETY * host
    plan = PlacementPlan.build(unit_shapes(split), got, "deferred")
    # the disk units: the topmost units the GPU does not hold, contiguous
    top = max(u.index for u in plan.units if u.state != "gpu")
    assert plan.indices("disk") == list(range(top - got.disk.disk_units + 1, top + 1))
    assert est.disk_bytes >= 8 * plan.params("disk")
    assert est.host_parts["disk units' masters (4 B/param; moments on disk)"] == 4 * plan.params("disk")
    with pytest.raises(InsufficientMemoryError, match="With a local disk: --disk-dir PATH"):
        check_fit(split, cuda_rt(), gpu_free_bytes=78 * GiB, host_available_bytes=host, **kw)


def test_floor_has_a_disk_term():
    from slidetune.bench.roofline import floor_terms, plan_of_runtime
    comp = {"num_layers": 4, "layer_params": 100 * 2**20, "vocab_params": 50 * 2**20, "compute_s": 1.0,
            "layer_recompute_backward_s": 0.15, "head_s": 0.05, "embed_s": 0.01, "layer_forward_s": 0.05}
    copy, adamw = {"h2d_gib_s": 50.0, "d2h_gib_s": 50.0}, {"adamw_params_per_s": 1e9}
    disk = {"read_gib_s": 1.0, "write_gib_s": 2.0}
    plan = plan_of_runtime(comp, {"disk_dir": "/x", "disk_units": 2})       # the head and layer 3
    P = 25 * 2**20 + 100 * 2**20
    eager = floor_terms(comp, copy, adamw, plan, disk=disk)
    assert eager["disk_s"] == pytest.approx(8 * P / 2**30 + 8 * P / (2 * 2**30))
    clipped = floor_terms(comp, copy, adamw, plan_of_runtime(comp, {"disk_dir": "/x", "disk_units": 2}, clipped=True),
                          disk=disk)
    backward = 4 * 0.15 + 0.05 + 0.01
    # the disk's I/O is its own term, clipped too (the step needs the disk that long, whatever
    # overlaps it): not added after the backward (two GPU runs stepped below that sum, NOTES.md "Disk tier")
    assert clipped["disk_s"] == pytest.approx(eager["disk_s"])
    ram, on_disk = 3 * 100 * 2**20 + 25 * 2**20, P      # the embedding and layers 0-2; the head and layer 3
    assert clipped["clip_sweep_s"] == pytest.approx(backward + ram / 1e9 + on_disk / 1e9 + 0.05)
    assert "disk_s" not in floor_terms(comp, copy, adamw, plan_of_runtime(comp), disk=disk)
    # with the probe's mixed rate (reads ahead and writes behind at once): 16 B/param at that rate
    mixed = floor_terms(comp, copy, adamw, plan, disk=dict(disk, mixed_gib_s=4.0))
    assert mixed["disk_s"] == pytest.approx(16 * P / (4 * 2**30))


def test_probe_measures_the_directory(tmp_path):
    from slidetune.bench.floor_probes import probe_disk
    r = probe_disk(str(tmp_path), total_bytes=8 * 2**20, block_mb=1, threads=2)
    assert r["read_gib_s"] > 0 and r["write_gib_s"] > 0 and r["mixed_gib_s"] > 0
    assert r["bytes"] >= 8 * 2**20 and list(Path(tmp_path).iterdir()) == []
    assert r["first_write_gib_s"] > 0 and r["warm_passes"] == 1      # the untimed first touch, reported
    cold = probe_disk(str(tmp_path), total_bytes=8 * 2**20, block_mb=1, threads=2, warm_passes=0)
    assert cold["first_write_gib_s"] is None and cold["write_gib_s"] > 0
    best = probe_disk(str(tmp_path), total_bytes=8 * 2**20, block_mb=1, threads=2, repeats=3)   # the fastest of 3
    assert all(len(best["passes"][k]) == 3 and best[f"{k}_gib_s"] == max(best["passes"][k])
               for k in ("read", "write", "mixed"))
    # the tier's pattern: several files (one per unit), the mixed pass from one pool; and the old split pass
    for mixed in ("pool", "split"):
        r = probe_disk(str(tmp_path), total_bytes=8 * 2**20, block_mb=1, threads=2, files=3, mixed=mixed)
        assert r["files"] == 3 and r["mixed"] == mixed and r["mixed_gib_s"] > 0 and r["read_gib_s"] > 0
        assert r["bytes"] == 8 * 2**20 and list(Path(tmp_path).iterdir()) == []     # every file removed
    with pytest.raises(ValueError, match="pool or split"):
        probe_disk(str(tmp_path), total_bytes=8 * 2**20, block_mb=1, threads=2, mixed="both")


@pytest.mark.slow
def test_plan_terms_prints_the_three_tiers_and_each_term(tmp_path, capsys):
    """`slidetune plan --terms` on the CPU machine: the placement (disk units included), then the
    terms this machine can probe (the host's AdamW over the host-updated units, the disk's moments
    at the probed rate) and the floor they give."""
    import re
    from slidetune.cli import main
    code = main(["plan", "--model", "tiny-llama", "--device", "cpu", "--seq-len", "32", "--batch-size", "2",
                 "--disk-dir", str(tmp_path), "--tuning.disk_units", "2", "--terms"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "placement:" in out and "disk tier" in out
    adamw = re.search(r"adamw_s\s+([\d.]+)\s+host AdamW over", out)
    disk = re.search(r"disk_s\s+([\d.]+)\s+disk: moments of [\d.]+ [MB] params read and written", out)
    assert adamw and disk and float(adamw.group(1)) > 0 and float(disk.group(1)) > 0
    assert re.search(r"disk probe: read [\d.]+, write [\d.]+, both at once [\d.]+ GiB/s", out)
    assert re.search(r"floor [\d.]+ s a step \(bound by (adamw_s|disk_s)\)", out)
    assert list(tmp_path.iterdir()) == []          # the probe's file is gone


def test_floor_takes_the_upload_copies_weights_pass_at_its_own_rate():
    """clip_sweep=weights: every host-RAM unit has an upload copy; the clipped sweep runs its
    BF16-writing pass (adamw_weights_copy_pass_params_per_s) where the forward waits, and the host's
    AdamW a step is that pass plus the whole update; a disk unit keeps its one-pass update."""
    from slidetune.bench.roofline import floor_terms, plan_of_runtime
    comp = {"num_layers": 4, "layer_params": 100 * 2**20, "vocab_params": 50 * 2**20, "compute_s": 1.0,
            "layer_recompute_backward_s": 0.15, "head_s": 0.05, "embed_s": 0.01, "layer_forward_s": 0.05}
    copy = {"h2d_gib_s": 50.0, "d2h_gib_s": 50.0}
    adamw = {"adamw_params_per_s": 1e9, "adamw_weights_pass_params_per_s": 2e9,
             "adamw_moments_pass_params_per_s": 3e9, "adamw_weights_copy_pass_params_per_s": 4e9}
    disk = {"read_gib_s": 1.0, "write_gib_s": 2.0}
    rt = {"disk_dir": "/x", "disk_units": 1, "clip_sweep": "weights"}                   # the head on disk
    plan = plan_of_runtime(comp, rt, clipped=True)
    head = 25 * 2**20
    ram = 4 * 100 * 2**20 + 25 * 2**20                   # the embedding and the 4 layers: all copies
    assert plan.upload_copy_numel() == ram
    terms = floor_terms(comp, copy, adamw, plan, disk=disk)
    backward = 4 * 0.15 + 0.05 + 0.01
    assert terms["clip_sweep_s"] == pytest.approx(backward + ram / 4e9 + head / 1e9 + 0.05)
    assert terms["adamw_s"] == pytest.approx(ram / 4e9 + ram / 1e9 + head / 1e9)
    split = floor_terms(comp, copy, adamw, plan_of_runtime(comp, dict(rt, clip_sweep="split"), clipped=True),
                        disk=disk)
    assert split["clip_sweep_s"] == pytest.approx(backward + ram / 2e9 + head / 1e9 + 0.05)
