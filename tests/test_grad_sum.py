"""The micro-batch gradient sum (engine/slide/grad_sum.py, ops/triton_grad_sum.py).

- the torch way is the reference's arithmetic: FP32 in micro-batch order, one rounding into the slot;
- the fused way's bookkeeping (up to MAX_HELD held gradients, then an FP32 running sum, strided
  views, the first-use check) gives the same bits, with a torch stand-in for the Triton pass;
- the Triton pass itself against torch's sums, on CUDA (skipped elsewhere);
- the fit's rule for the bytes each way holds, and where "auto" resolves.
"""
from __future__ import annotations

import sys
import types

import pytest
import torch

from slidetune.engine.fit import summing_bytes
from slidetune.engine.slide import grad_sum
from slidetune.engine.slide.grad_sum import MAX_HELD, GradSum, accumulation_bytes, resolve


def reference(micro: list[list[torch.Tensor]], dtype: torch.dtype) -> list[torch.Tensor]:
    """What torch gradient accumulation leaves in a slot of `dtype`: FP32 sums in order, cast once."""
    acc = [g.float() for g in micro[0]]
    for grads in micro[1:]:
        acc = [a + g.float() for a, g in zip(acc, grads)]
    return [a.to(dtype) for a in acc]


def micro_batches(k: int, seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(37, 19), (101,), (8, 8, 3)]            # ragged sizes, a 3-D one
    return [[(torch.randn(s, generator=g) * 10 ** torch.randint(-3, 3, (), generator=g)).to(torch.bfloat16)
             for s in shapes] for _ in range(k)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


@pytest.fixture
def torch_pass(monkeypatch):
    """ops/triton_grad_sum with its Triton pass replaced by the same arithmetic in torch (the
    fused way's bookkeeping runs on the CPU; the pass itself is tested on CUDA below)."""
    calls = []

    def sum_into(out, parts, acc=None):
        calls.append((len(parts), acc is not None))
        s = acc.clone() if acc is not None else parts[0].float()
        for p in parts[0 if acc is not None else 1:]:
            s = s + p.float()
        out.copy_(s)
    stub = types.ModuleType("slidetune.ops.triton_grad_sum")
    stub.sum_into = sum_into
    monkeypatch.setitem(sys.modules, "slidetune.ops.triton_grad_sum", stub)
    return calls


@pytest.mark.parametrize("k", [1, 2, 4, 7, 9])
@pytest.mark.parametrize("how", ["torch", "fused"])
@pytest.mark.parametrize("slot_dtype", [torch.bfloat16, torch.float32])
def test_both_ways_leave_the_references_bits(k, how, slot_dtype, torch_pass):
    micro = micro_batches(k, seed=k)
    summed = GradSum(k, how)
    for grads in micro:
        summed.add(grads)
    slot = [torch.empty(g.shape, dtype=slot_dtype) for g in micro[0]]
    assert summed.write(slot) is True
    for got, want in zip(slot, reference(micro, slot_dtype)):
        assert torch.equal(bits(got), bits(want))
    if how == "fused" and k > 1:
        # every micro-batch read once: folds of at most MAX_HELD, a running sum only past it
        parts = [n for n, _ in torch_pass]
        assert max(parts) <= MAX_HELD and sum(parts) == k * len(micro[0])
        assert any(has_acc for _, has_acc in torch_pass) == (k > MAX_HELD)


def test_a_strided_view_is_summed_with_torch_ops_to_the_same_bits(torch_pass):
    micro = [[torch.randn(16, 8).to(torch.bfloat16).t()] for _ in range(3)]      # non-contiguous
    summed = GradSum(3, "fused")
    for grads in micro:
        summed.add(grads)
    slot = [torch.empty(8, 16, dtype=torch.bfloat16)]
    summed.write(slot)
    assert torch.equal(bits(slot[0]), bits(reference(micro, torch.bfloat16)[0]))


def test_the_first_use_check_catches_a_wrong_pass_and_keeps_torchs_values(monkeypatch):
    def wrong(out, parts, acc=None):           # a pass that rounds every add to BF16
        s = parts[0]
        for p in parts[1:]:
            s = s + p
        out.copy_(s)
    stub = types.ModuleType("slidetune.ops.triton_grad_sum")
    stub.sum_into = wrong
    monkeypatch.setitem(sys.modules, "slidetune.ops.triton_grad_sum", stub)
    micro = micro_batches(4, seed=3)
    summed = GradSum(4, "fused")
    for grads in micro:
        summed.add(grads)
    slot = [torch.empty(g.shape, dtype=torch.bfloat16) for g in micro[0]]
    assert summed.write(slot, check=True) is False
    for got, want in zip(slot, reference(micro, torch.bfloat16)):
        assert torch.equal(bits(got), bits(want))


def test_a_pass_that_raises_leaves_torchs_sum_and_says_why(monkeypatch):
    def broken(out, parts, acc=None):
        raise RuntimeError("triton: no compiler")
    stub = types.ModuleType("slidetune.ops.triton_grad_sum")
    stub.sum_into = broken
    monkeypatch.setitem(sys.modules, "slidetune.ops.triton_grad_sum", stub)
    micro = micro_batches(6, seed=4)              # a fold into the running sum, then the write
    summed = GradSum(6, "fused")
    for grads in micro:
        summed.add(grads)
    slot = [torch.empty(g.shape, dtype=torch.bfloat16) for g in micro[0]]
    summed.write(slot)
    assert "no compiler" in summed.failed
    for got, want in zip(slot, reference(micro, torch.bfloat16)):
        assert torch.equal(bits(got), bits(want))


def test_fewer_or_more_micro_batches_than_declared_are_refused():
    summed = GradSum(2, "torch")
    summed.add([torch.zeros(3, dtype=torch.bfloat16)])
    with pytest.raises(RuntimeError, match="1 of 2 micro-batches"):
        summed.write([torch.empty(3)])


def test_what_each_way_holds_and_where_auto_goes():
    P = 1000
    assert accumulation_bytes("torch", 1, P) == accumulation_bytes("fused", 1, P) == 0
    assert accumulation_bytes("torch", 4, P) == 4 * P
    assert [accumulation_bytes("fused", k, P) for k in (2, 3, 4)] == [2 * P, 4 * P, 6 * P]
    assert accumulation_bytes("fused", 8, P) == 6 * P + 4 * P         # MAX_HELD - 1 held + an FP32 sum
    # the fit: auto may run either way on the GPU machine, so it counts the larger
    assert summing_bytes("auto", 4, P) == 6 * P and summing_bytes("auto", 2, P) == 4 * P
    assert summing_bytes("torch", 4, P) == 4 * P
    assert resolve("auto", "cpu") == "torch" and resolve("torch", "cpu") == "torch"
    with pytest.raises(ValueError, match="needs CUDA and Triton"):
        resolve("fused", "cpu")
    with pytest.raises(ValueError, match="auto, fused or torch"):
        resolve("fast", "cpu")


@pytest.mark.skipif(not grad_sum.fused_available("cuda") or not torch.cuda.is_available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_acc", [False, True])
def test_the_triton_pass_sums_as_torch_does(parts, out_dtype, with_acc):
    from slidetune.ops.triton_grad_sum import sum_into
    g = torch.Generator(device="cuda").manual_seed(parts)
    n = 3 * 4096 + 77                                   # whole blocks and a ragged tail
    xs = [(torch.randn(n, device="cuda", generator=g) * 1e-3).to(torch.bfloat16) for _ in range(parts)]
    acc = torch.randn(n, device="cuda", generator=g) if with_acc else None
    want = acc.clone() if with_acc else xs[0].float()
    for x in xs[0 if with_acc else 1:]:
        want = want + x.float()
    out = torch.empty(n, device="cuda", dtype=out_dtype)
    sum_into(out, xs, acc=acc)
    assert torch.equal(bits(out), bits(want.to(out_dtype)))
    if with_acc:                                        # in place into the running sum
        sum_into(acc, xs, acc=acc)
        assert torch.equal(bits(acc), bits(want))


def test_an_engine_summing_fused_trains_bit_for_bit_as_with_torch(monkeypatch, torch_pass):
    """The engine's backward through the fused way (its pass a torch stand-in here), with three
    micro-batches, clipped and not: the same masters and moments as summing with torch."""
    from test_checkpoint import batches, make_engine, masters, optim

    def run(how: str, clip):
        monkeypatch.setattr(grad_sum, "resolve", lambda choice, device: how)
        eng = make_engine(grad_accum=3, max_grad_norm=clip, layers=2)
        assert eng.grad_sum == how
        for s in range(2):
            eng.train_step(batches(s, n_micro=3), 1e-3)
        out = {**masters(eng), **optim(eng)}
        eng.close()
        return out
    for clip in (None, 1.0):
        torch_pass.clear()
        want, got = run("torch", clip), run("fused", clip)
        assert torch_pass, "the fused way was not used"
        assert want.keys() == got.keys()
        for k in want:
            assert torch.equal(want[k], got[k]), (clip, k)
