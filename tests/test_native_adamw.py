"""The host AdamW kernel (engine/native_adamw.py): one OpenMP loop, FP32 or BF16 gradients.

It must give torch's fused AdamW's result on the same (widened) gradient to within FP32
rounding, over ranges at any offset and length (decay and no-decay ranges of one flat
master, chunk by chunk), with either schedule and any thread count; a slide engine
updating through it must train like one on torch's kernel; and where it cannot be built
the engine must say so and train on torch's kernel.
"""
from __future__ import annotations

import logging
import sys
import threading
import time

import pytest
import torch

from slidetune.engine import AdamWConfig, RuntimeConfig, build_engine
from slidetune.engine import native_adamw
from slidetune.engine.adamw import FlatAdamW
from test_equivalence import LR, make_batches, make_loaded, max_param_rel_diff

CFG = AdamWConfig(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _close(got: FlatAdamW, want: FlatAdamW) -> None:
    for a, b in [(got.master, want.master), (got.exp_avg, want.exp_avg), (got.exp_avg_sq, want.exp_avg_sq)]:
        # rounding level (docs/contract.md's 1e-5), scaled to the tensor: a moment near zero differs in its last bits
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))


def test_kernel_builds_here():
    """CI and the GPU host have gcc: the kernel must build there (the fallback is for hosts without one)."""
    assert native_adamw.load() is not None


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("schedule", ["dynamic", "static"])
def test_matches_torch_fused_adamw(grad_dtype, schedule):
    torch.manual_seed(0)
    b = native_adamw.BLOCK
    n, n_decay = 3 * b + 10_007, 2 * b + 6_001
    master = torch.randn(n)
    native = FlatAdamW(master.clone(), n_decay, CFG, kernel=schedule)
    reference = FlatAdamW(master.clone(), n_decay, CFG, kernel="torch")
    # ranges of every kind: across the decay boundary, within one block, a tiny one (torch's
    # kernel), many blocks with a ragged tail
    ranges = [(0, 4_000), (4_000, 2 * b + 6_050), (2 * b + 6_050, 2 * b + 6_060), (2 * b + 6_060, n)]
    for step in range(4):
        grad = (torch.randn(n) * 10 ** -step).to(grad_dtype)           # [n], shrinking like real gradients
        native.begin_step()
        reference.begin_step()
        for lo, hi in ranges:
            lr = 1e-3 * (1 + step)
            native.update(grad[lo:hi], lr, lo)
            reference.update(grad[lo:hi].float(), lr, lo)              # fp32: torch._fused_adamw_
    _close(native, reference)
    assert not torch.equal(native.master, master)                      # it moved


def test_thread_count_and_schedule_do_not_change_the_result():
    """Elementwise: every element sees the same arithmetic however the blocks are shared out."""
    torch.manual_seed(1)
    n = 5 * native_adamw.BLOCK + 123
    grad = torch.randn(n).to(torch.bfloat16)
    results = []
    for schedule, threads in [("dynamic", 1), ("dynamic", 2), ("static", 2), ("dynamic", 7)]:
        torch.manual_seed(2)
        state = [torch.randn(n), torch.randn(n) * 1e-3, torch.rand(n) * 1e-4]     # master, m, v
        native_adamw.update(*state, grad, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=5,
                            schedule=schedule, threads=threads)
        results.append(state)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_takes_only_host_ranges_it_reads():
    g = torch.zeros(native_adamw.MIN_NATIVE)
    assert native_adamw.takes(g, torch.zeros(1))
    assert native_adamw.takes(g.bfloat16(), torch.zeros(1))
    assert not native_adamw.takes(g.half(), torch.zeros(1))                  # FP16: torch's path widens it
    assert not native_adamw.takes(g[:-1], torch.zeros(1))                    # tiny: torch's kernel
    assert not native_adamw.takes(g, torch.zeros(1, device="meta"))          # not on the host


def test_no_compiler_falls_back_with_a_message(monkeypatch, caplog):
    monkeypatch.setattr(native_adamw, "_kernel", None)
    monkeypatch.setattr(native_adamw, "_tried", False)
    monkeypatch.setattr(native_adamw, "_compiler", lambda: None)
    with caplog.at_level(logging.WARNING):
        assert native_adamw.load() is None
    assert "no C compiler" in caplog.text and "torch's fused AdamW" in caplog.text
    opt = FlatAdamW(torch.zeros(native_adamw.MIN_NATIVE), 0, CFG)             # updates through torch's kernel
    opt.begin_step()
    opt.update(torch.ones(native_adamw.MIN_NATIVE), 1e-3)
    assert bool((opt.master < 0).all())


def test_a_failing_compile_says_why(monkeypatch, caplog):
    monkeypatch.setattr(native_adamw, "_kernel", None)
    monkeypatch.setattr(native_adamw, "_tried", False)
    monkeypatch.setattr(native_adamw, "SOURCE", "this is not C")
    with caplog.at_level(logging.WARNING):
        assert native_adamw.load() is None
    assert "failed" in caplog.text


def _train(loaded, host_adamw: str, monkeypatch, kernels: bool = True):
    if not kernels:     # as on a host without a compiler: torch's kernel on widened scratch chunks
        monkeypatch.setattr(native_adamw, "load", lambda: None)
    rt = RuntimeConfig(mode="slide", dtype="bf16", device="cpu", schedule="eager", head_chunk_tokens=16, chunk_mb=1,
                       host_adamw=host_adamw)
    engine = build_engine(loaded, rt, AdamWConfig(lr=LR, weight_decay=0.1, eps=1e-6))
    assert engine.drainer.widen_in_adamw is kernels
    assert engine.drainer.ring[0].dtype == torch.bfloat16               # gradients land as BF16
    losses = [engine.train_step(make_batches(step, 1), LR * (0.5 + step)).loss for step in range(3)]
    engine.synchronize()
    monkeypatch.undo()
    return engine, losses


def test_engine_on_the_native_kernel_trains_like_on_torchs(monkeypatch):
    loaded = make_loaded("qwen3", tied=False)
    native, native_losses = _train(loaded, "dynamic", monkeypatch)
    scratch, scratch_losses = _train(loaded, "dynamic", monkeypatch, kernels=False)
    try:
        assert all(u.opt.kernel == "dynamic" for u in native.units)
        assert native_losses == pytest.approx(scratch_losses, rel=1e-5)
        worst, where = max_param_rel_diff(native, _as_module(scratch))
        assert worst < 1e-5, f"{where}: relative difference {worst:.2e}"
    finally:
        native.close()
        scratch.close()


class _as_module:
    """named_parameters() over an engine's FP32 masters (max_param_rel_diff's reference side)."""

    def __init__(self, engine):
        self.engine = engine

    def named_parameters(self):
        return self.engine.named_master_params()


def test_the_kernel_lets_go_of_the_gil():
    """The compute thread must keep running Python (launching kernels) while the host worker's
    AdamW runs: an inductor-compiled kernel held the GIL, and the GPU's backward took twice as
    long beside it (NOTES.md "Host AdamW"). A Python loop counts while one long kernel call is in flight
    on another thread. With the GIL held it gets one switch interval at most (~1-2% of the
    call here, at the engine's 0.5 ms switch interval); released, about its rate alone (2 cores: the loop and the kernel's thread)."""
    n = 1 << 24
    state = [torch.zeros(n) for _ in range(3)]
    grad = torch.ones(n, dtype=torch.bfloat16)
    in_call, finished = threading.Event(), threading.Event()
    call_s = []

    def spin_until(stop: threading.Event, counting: threading.Event) -> int:
        spins = 0
        while not stop.is_set():
            if counting.is_set():
                spins += 1
        return spins

    def host():
        in_call.set()
        t = time.perf_counter()
        native_adamw.update(*state, grad, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0,
                            step=1, threads=1)               # ~50-400 ms on one thread
        call_s.append(time.perf_counter() - t)
        in_call.clear()
        finished.set()

    # the loop's rate alone
    stop, on = threading.Event(), threading.Event()
    on.set()
    timer = threading.Timer(0.1, stop.set)
    timer.start()
    t = time.perf_counter()
    alone = spin_until(stop, on) / (time.perf_counter() - t)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(5e-4)                              # the engine's: a held GIL is lent for 0.5 ms
    try:
        worker = threading.Thread(target=host)
        worker.start()
        during = spin_until(finished, in_call)
        worker.join()
    finally:
        sys.setswitchinterval(interval)
    share = during / (alone * call_s[0])
    assert share > 0.2, f"a Python thread ran at {share:.0%} of its rate while the kernel ran"


@pytest.mark.parametrize("chunk", [1000, 4096, 10_000])
def test_update_widened_matches_a_whole_fp32_gradient(chunk):
    """FlatAdamW.update_widened (the device units' update: a BF16 gradient widened a chunk at a time
    into a scratch) matches update() with the gradient widened whole, across the decay boundary and
    with a last partial chunk; torch's kernel on both sides. To FP32 rounding, not bit for bit:
    torch's vectorized CPU loop rounds a range's unaligned tail elements its own way."""
    n, n_decay = 9_000, 5_500
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=g).to(torch.bfloat16)
    start = torch.randn(n, generator=g)
    a, b = start.clone(), start.clone()
    opt_a = FlatAdamW(a, n_decay, AdamWConfig(weight_decay=0.1), kernel="torch")
    opt_b = FlatAdamW(b, n_decay, AdamWConfig(weight_decay=0.1), kernel="torch")
    scratch = torch.empty(chunk)
    for _ in range(3):
        opt_a.begin_step()
        opt_a.update_widened(grad, 1e-3, scratch)
        opt_b.begin_step()
        opt_b.update(grad.float(), 1e-3)
    for got, want in ((a, b), (opt_a.exp_avg, opt_b.exp_avg), (opt_a.exp_avg_sq, opt_b.exp_avg_sq)):
        torch.testing.assert_close(got, want, rtol=2e-7, atol=0)


@pytest.mark.parametrize("kernel", ["dynamic", "torch"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_split_update_writes_exactly_what_the_full_one_does(grad_dtype, kernel):
    """The deferred schedule's pair: "params" (weights only) then "moments" (moments only), with a
    clip scale applied to the read-only gradient, leaves master and moments bit for bit as one
    "all" update does, over decay and no-decay ranges and a tail too small for the kernel
    (updated in full by "params", left alone by "moments"); the gradient is not modified."""
    n, n_decay = 3 * native_adamw.BLOCK + 777, 2 * native_adamw.BLOCK + 5
    g0 = torch.Generator().manual_seed(3)
    master = torch.randn(n, generator=g0)
    grad = torch.randn(n, generator=g0).to(grad_dtype)
    full, split = (FlatAdamW(master.clone(), n_decay, CFG, kernel) for _ in range(2))
    for opt in (full, split):            # some history in the moments first
        opt.begin_step()
        opt.update(torch.randn(n, generator=torch.Generator().manual_seed(4)).to(grad_dtype), 1e-3)
    kept = grad.clone()
    full.begin_step()
    full.update(grad.clone(), 1e-3, grad_scale=0.37)
    split.begin_step()
    split.update(grad, 1e-3, grad_scale=0.37, part="params")
    if kernel != "torch":
        assert not torch.equal(split.exp_avg, full.exp_avg)        # moments not written yet
    split.update(grad, 0.0, grad_scale=0.37, part="moments")
    for a, b in [(split.master, full.master), (split.exp_avg, full.exp_avg), (split.exp_avg_sq, full.exp_avg_sq)]:
        assert torch.equal(a, b)
    if kernel != "torch":
        assert torch.equal(grad, kept)


def test_weights_kernel_rounds_to_bf16_as_torch_does():
    """The weights pass's BF16 store (round to nearest even) against torch's cast, on values that
    sit on ties, near the overflow, subnormal, infinite and NaN: the parameters written as BF16
    by the kernel equal the FP32 parameters of the full update cast by torch."""
    n = native_adamw.BLOCK + 333
    g0 = torch.Generator().manual_seed(5)
    master = torch.randn(n, generator=g0)
    # exact ties and their neighbours (low 16 bits 0x8000, 0x7fff, 0x8001), extremes, specials
    bits = torch.randint(0, 0x7F00, (n,), generator=g0, dtype=torch.int32) << 16     # finite, both signs below
    bits[::2] |= -2**31
    bits[:300] |= 0x8000
    bits[300:600] |= 0x7FFF
    bits[600:900] |= 0x8001
    master = torch.where(torch.arange(n) < 900, bits.view(torch.float32), master)
    master[900:905] = torch.tensor([3.3e38, -3.3e38, 1e-40, float("inf"), -float("inf")])
    grad = torch.zeros(n)              # lr 0 and no decay: the new parameters are the old ones
    grad[905] = float("nan")           # ... but one NaN
    opt = FlatAdamW(master.clone(), 0, CFG, "dynamic")
    opt.begin_step()
    weights = torch.empty(n, dtype=torch.bfloat16)
    opt.update(grad, 0.0, part="weights", weights=weights)
    assert torch.equal(opt.master, master)                             # the master is not written
    want = master.clone()
    want[905] = float("nan")
    got, ref = weights.view(torch.int16), want.to(torch.bfloat16).view(torch.int16)
    finite = ~torch.isnan(want)
    assert torch.equal(got[finite], ref[finite])
    assert int(got[905]) == 0x7FC0                                     # torch's canonical NaN


@pytest.mark.parametrize("kernel", ["dynamic", "torch"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_weights_then_rest_writes_what_the_full_update_does(grad_dtype, kernel):
    """clip_sweep=weights' pair: "weights" writes only the BF16 parameters (master and moments as
    they were), then "rest" the whole update; master and moments end bit for bit as one "all"
    update leaves them, and the BF16 weights are exactly the new master's cast, over decay and
    no-decay ranges and a tail too small for the kernel (updated in full by "weights")."""
    n, n_decay = 3 * native_adamw.BLOCK + 777, 2 * native_adamw.BLOCK + 5
    g0 = torch.Generator().manual_seed(6)
    master = torch.randn(n, generator=g0)
    grad = torch.randn(n, generator=g0).to(grad_dtype)
    full, pair = (FlatAdamW(master.clone(), n_decay, CFG, kernel) for _ in range(2))
    for opt in (full, pair):
        opt.begin_step()
        opt.update(torch.randn(n, generator=torch.Generator().manual_seed(7)).to(grad_dtype), 1e-3)
    before = pair.master.clone()
    full.begin_step()
    full.update(grad.clone(), 1e-3, grad_scale=0.37)
    pair.begin_step()
    weights = torch.empty(n, dtype=torch.bfloat16)
    pair.update(grad, 1e-3, grad_scale=0.37, part="weights", weights=weights)
    if kernel != "torch":
        tail = n - native_adamw.MIN_NATIVE                         # the kernel's ranges: not written yet
        assert torch.equal(pair.master[:n_decay], before[:n_decay]) and tail > 0
    pair.update(grad, 1e-3, grad_scale=0.37, part="rest")
    for a, b in [(pair.master, full.master), (pair.exp_avg, full.exp_avg), (pair.exp_avg_sq, full.exp_avg_sq)]:
        assert torch.equal(a, b)
    assert torch.equal(weights, full.master.to(torch.bfloat16))


@pytest.mark.parametrize("offset", [0, 5, 31, 32])
def test_weights_pass_streams_whole_lines_and_stores_the_ragged_ends(offset):
    """The weights pass stores whole 64-byte lines of its BF16 copy with non-temporal stores and
    the ends of a block that are not whole lines plainly: a copy that starts off a line (offset
    elements into a line-aligned buffer) and ends mid-line gets every element, equal to torch's
    cast of the full update's master, and not one element past its end."""
    if native_adamw.load() is None:
        pytest.skip("no C compiler: torch's kernel has no weights pass of its own")
    n = 2 * native_adamw.BLOCK + 77
    g0 = torch.Generator().manual_seed(11)
    master, grad = torch.randn(n, generator=g0), torch.randn(n, generator=g0).to(torch.bfloat16)
    m, v = torch.randn(n, generator=g0) * 0.1, torch.rand(n, generator=g0) * 0.01
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3, grad_scale=0.5)
    full = [t.clone() for t in (master, m, v)]
    native_adamw.update(*full, grad, **kw)
    # a 64-byte-aligned buffer with room on both sides; the copy is the view at `offset`
    raw = torch.full((n + 128,), -7.0, dtype=torch.bfloat16)
    skip = (-raw.data_ptr() % 64) // 2
    weights = raw[skip + offset:skip + offset + n]
    native_adamw.update(master.clone(), m.clone(), v.clone(), grad, part="weights", weights=weights, **kw)
    assert torch.equal(weights.view(torch.int16), full[0].to(torch.bfloat16).view(torch.int16))
    assert bool((raw[:skip + offset] == -7.0).all()) and bool((raw[skip + offset + n:] == -7.0).all())
