"""The widening AdamW kernel: BF16 gradients against FP32 state, in one compiled pass.

It must give torch's fused AdamW's result on the same (widened) gradient to within FP32
rounding, over ranges at any offset and length (decay and no-decay ranges of one flat
master, chunk by chunk), without recompiling per range; and the slide engine that feeds
it BF16 gradients must train like the one that widens them into a scratch buffer first.
"""
from __future__ import annotations

import pytest
import torch

from slidetune.engine import AdamWConfig, RuntimeConfig, build_engine
from slidetune.engine import adamw_widening
from slidetune.engine.adamw import FlatAdamW
from test_equivalence import LR, make_batches, make_loaded, max_param_rel_diff

CFG = AdamWConfig(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def test_kernel_builds_here():
    """CI and the GPU host have a C++ compiler: the kernel must build there (the fallback is
    for machines without one)."""
    assert adamw_widening.build(torch.bfloat16)


def test_the_compiled_loop_runs_on_every_thread():
    """Compiled with build()'s options, the loop is an OpenMP parallel one even when compiled on
    a few hundred elements (inductor decides parallelism from the compile-time size; a serial
    kernel ran 5x slower on a 16-core host)."""
    from torch._inductor.utils import run_and_get_cpp_code
    n = 256
    state = [torch.zeros(n) for _ in range(3)]
    grad = torch.ones(n, dtype=torch.bfloat16)
    scalars = torch.tensor([1.0, 0.9, 0.1, 0.95, 0.05, 1e-3, 0.2, 1e-8])
    torch._dynamo.reset()
    kernel = torch.compile(adamw_widening._adamw_widening, dynamic=True, fullgraph=True,
                           options=adamw_widening.COMPILE_OPTIONS)
    _, code = run_and_get_cpp_code(kernel, *state, grad, scalars)
    assert "#pragma omp parallel" in code or "#pragma omp for" in code, code[:2000]


def test_matches_torch_fused_adamw_on_the_widened_gradient():
    assert adamw_widening.build(torch.bfloat16)
    torch.manual_seed(0)
    n, n_decay = 10_007, 6_001
    master = torch.randn(n)
    widened = FlatAdamW(master.clone(), n_decay, CFG, kernel="torch")        # native_adamw's kernel off
    reference = FlatAdamW(master.clone(), n_decay, CFG, kernel="torch")
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # ranges of every kind: across the decay boundary, tiny ones (the eager path), a tail
    ranges = [(0, 4_000), (4_000, 6_050), (6_050, 6_060), (6_060, n)]
    for step in range(4):
        grad = (torch.randn(n) * 10 ** -step).to(torch.bfloat16)       # [n] bf16, shrinking like real gradients
        widened.begin_step()
        reference.begin_step()
        for lo, hi in ranges:
            lr = 1e-3 * (1 + step)
            widened.update(grad[lo:hi], lr, lo)                        # bf16: the widening kernel
            reference.update(grad[lo:hi].float(), lr, lo)              # fp32: torch._fused_adamw_
    for got, want in [(widened.master, reference.master), (widened.exp_avg, reference.exp_avg),
                      (widened.exp_avg_sq, reference.exp_avg_sq)]:
        # rounding level (DESIGN.md's 1e-5), scaled to the tensor: a moment near zero differs in its last bits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    assert not torch.equal(widened.master, master)                     # it moved
    # one graph for every range length and offset
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before


def _train(loaded, widen: bool, monkeypatch) -> tuple[object, list[float]]:
    if not widen:
        monkeypatch.setattr(adamw_widening, "build", lambda dtype: False)   # as on a host without a compiler
    rt = RuntimeConfig(mode="slide", dtype="bf16", device="cpu", schedule="eager", head_chunk_tokens=16, chunk_mb=1,
                       host_adamw="torch")
    engine = build_engine(loaded, rt, AdamWConfig(lr=LR, weight_decay=0.1, eps=1e-6))
    assert engine.drainer.widen_in_adamw is widen
    assert engine.drainer.ring[0].dtype == torch.bfloat16               # gradients land as BF16
    losses = [engine.train_step(make_batches(step, 1), LR * (0.5 + step)).loss for step in range(3)]
    engine.synchronize()
    monkeypatch.undo()
    return engine, losses


def test_engine_with_the_kernel_trains_like_the_scratch_path(monkeypatch):
    loaded = make_loaded("qwen3", tied=False)
    fused, fused_losses = _train(loaded, True, monkeypatch)
    scratch, scratch_losses = _train(loaded, False, monkeypatch)
    try:
        assert fused_losses == pytest.approx(scratch_losses, rel=1e-5)
        worst, where = max_param_rel_diff(fused, _as_module(scratch))
        assert worst < 1e-5, f"{where}: relative difference {worst:.2e}"
    finally:
        fused.close()
        scratch.close()


class _as_module:
    """named_parameters() over an engine's FP32 masters (max_param_rel_diff's reference side)."""

    def __init__(self, engine):
        self.engine = engine

    def named_parameters(self):
        return self.engine.named_master_params()
