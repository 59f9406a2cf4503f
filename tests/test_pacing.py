"""--tuning.pcie_gbps (engine/slide/pacing.py): the pacer alone on a fake clock, and a slide engine
on the CPU whose paced copies make a step at least its bytes / cap, with the uncapped run's losses."""
from __future__ import annotations

import time

import pytest

from slidetune.engine import AdamWConfig, RuntimeConfig, build_engine
from slidetune.engine.slide.pacing import BURST_S, LinkPacer, LinkPacers
from test_equivalence import make_batches, make_loaded


class FakeClock:
    """Time that moves only when the pacer sleeps, or when the test says copies took time."""

    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        assert s >= 0
        self.t += s


@pytest.mark.parametrize("copy_mb", [1, 64, 300])
def test_a_pacer_moves_at_most_its_rate_and_close_to_it(copy_mb):
    clock = FakeClock()
    pacer = LinkPacer(25, clock, clock.sleep)                 # 25 GB/s: PCIe 4.0 x16
    start, total = clock(), 0
    for i in range(max(200, 2000 // copy_mb)):        # >= 2 GB: the 1 ms bucket is < 2% of it
        pacer.take(copy_mb * 10**6)
        total += copy_mb * 10**6
        clock.t += 1e-5 * (i % 3)                            # the copy's own issue time, uneven
        assert total <= 25e9 * (clock() - start + BURST_S) * (1 + 1e-9)
    rate = total / (clock() - start)
    assert rate == pytest.approx(25e9, rel=0.03)
    assert pacer.bytes == total


def test_idle_time_earns_no_burst():
    """A link idle for a second does not then move a second's bytes at once: a copy still takes its
    bytes / rate, less the bucket's depth (a step's copies take their bytes / cap however they are
    spread)."""
    clock = FakeClock()
    pacer = LinkPacer(1, clock, clock.sleep)                  # 1 GB/s
    pacer.take(10**8)
    clock.t += 1.0
    before = clock()
    pacer.take(5 * 10**8)
    assert clock() - before == pytest.approx(0.5 - BURST_S)


def test_the_two_directions_are_independent():
    clock = FakeClock()
    pacers = LinkPacers(2, clock, clock.sleep)                # 2 GB/s each way
    pacers.h2d.take(10**9)                                    # 0.5 s
    t = clock()
    pacers.d2h.take(10**8)                                    # the D2H link was free: 0.05 s, not 0.55
    assert clock() - t == pytest.approx(0.05 - BURST_S)
    assert pacers.h2d.bytes == 10**9 and pacers.d2h.bytes == 10**8


def test_no_cap_never_sleeps():
    def sleep(_s):
        raise AssertionError("an uncapped pacer slept")
    pacers = LinkPacers(None, sleep=sleep)
    for n in (1, 2**30, 10**12):
        pacers.h2d.take(n)
        pacers.d2h.take(n)
    assert pacers.h2d.slept_s == pacers.d2h.slept_s == 0


def test_the_knob_refuses_a_rate_that_is_not_positive():
    with pytest.raises(ValueError, match="pcie_gbps must be > 0"):
        RuntimeConfig(pcie_gbps=0)
    assert RuntimeConfig(pcie_gbps=25).transfer.pcie_gbps == 25
    assert RuntimeConfig().transfer.pcie_gbps is None


def _run(steps: int, clip, **rt):
    """Losses, each step's seconds and the engine's copied bytes (h2d, d2h) of a tiny slide run."""
    loaded = make_loaded("llama", tied=False, layers=4)
    eng = build_engine(loaded, RuntimeConfig(mode="slide", dtype="fp32", device="cpu", cache_units=2, **rt),
                       AdamWConfig(lr=1e-3), grad_accum=2, max_grad_norm=clip)
    losses, seconds, moved = [], [], []
    try:
        for step in range(steps):
            up, down, t = eng.uploader.bytes, eng.drainer.bytes, time.perf_counter()
            losses.append(eng.train_step(make_batches(step, 2), 1e-3).loss)
            eng.synchronize()
            seconds.append(time.perf_counter() - t)
            moved.append((eng.uploader.bytes - up, eng.drainer.bytes - down))
    finally:
        eng.close()
    return losses, seconds, moved


@pytest.mark.parametrize("clip", [None, 1.0])
def test_a_capped_run_takes_its_bytes_over_the_cap_and_computes_the_same_losses(clip):
    free, _, moved = _run(3, clip)
    step_bytes = max(max(m) for m in moved)
    gbps = step_bytes / 0.3 / 1e9              # the busier direction's copies: ~0.3 s a step
    capped, seconds, capped_moved = _run(3, clip, pcie_gbps=gbps)
    assert capped == free                      # pacing changes timing, never values
    for s, (up, down) in zip(seconds, capped_moved):
        assert up and down
        assert s >= max(up, down) / (gbps * 1e9) - BURST_S    # a lower bound only


def test_the_benchs_runtime_overrides_pass_the_knob_through():
    """`bench throughput --runtime pcie_gbps=25` (and an A/B variant's) reach the slide run's RuntimeConfig."""
    import argparse

    from slidetune.bench.scenarios.throughput import _slide_runtime, parse_ab_variants
    fields = _slide_runtime("cuda", argparse.Namespace(runtime="pcie_gbps=25"))
    assert RuntimeConfig(**fields).transfer.pcie_gbps == 25.0
    assert parse_ab_variants("h200:;pcie4:pcie_gbps=25") == [("h200", {}), ("pcie4", {"pcie_gbps": 25.0})]
    assert parse_ab_variants("a:pcie_gbps=none") == [("a", {"pcie_gbps": None})]
