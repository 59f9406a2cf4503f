"""The compact optimizer state (issue 46, step 1): the formats' bytes, and the host kernels that
read and write them in one pass (native_adamw.update_compact), against references.

References, per format:
  - 8-bit blockwise moments: torchao's own pieces (torchao.optim: create_dynamic_map,
    quantize_8bit_with_qmap, scale_tensor, OptimState8bit and the AdamW step single_param_adam,
    run eagerly: AdamW8bit itself wraps the step in torch.compile, which on a CPU means a C++
    build per shape, too slow for a unit test). Same codes and scales bit for bit where the
    schemes coincide (quantizing given values); a whole step within one code (torchao's
    moments come from lerp, ours from the FP32 kernel's multiply-adds, so a value near a
    code's threshold may land on the other side). bitsandbytes (0.50.2) also runs on this CPU
    and its map is the same, but it is a 43 MB wheel and torchao (3.4 MB, no dependencies) is
    enough: torchao is in the `test` extra.
  - every format also against a plain-torch reference of the kernel's own arithmetic (the FP32
    kernel's operations in the same order, each a separate torch op, so each rounds as the C
    does): bit for bit, codes, scales, BF16 moments and the stochastically rounded master alike.
  - BF16 moments: torch's fused AdamW in FP32, then the moments cast; and torchao's step on BF16
    moment tensors.
  - BF16 master, stochastic rounding: unbiased (the mean of many roundings is the FP32 value, as
    for torchao's rule), the same bits for any thread count, schedule and split of the range,
    and bit for bit the reference's counter-based hash.
  - 50 steps of a noisy quadratic: every combination tracks the FP32 trajectory.
"""
from __future__ import annotations

import pytest
import torch

from slidetune.engine import blockwise8, native_adamw
from slidetune.engine.adamw import (FP32_ADAMW, MASTERS, MOMENTS, OPTIMIZER_STATES, FlatAdamW,
                                    optimizer_state)

pytestmark = pytest.mark.skipif(native_adamw.load_compact() is None, reason="no C compiler")

KW = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
B = blockwise8.BLOCK
M32 = 0xFFFFFFFF


# ---- the formats ----

def test_fp32_state_is_the_default_and_its_figures_are_unchanged():
    assert optimizer_state() is FP32_ADAMW is OPTIMIZER_STATES[("fp32", "fp32")] is FlatAdamW.STATE
    assert (FP32_ADAMW.master_bytes, FP32_ADAMW.moment_bytes, FP32_ADAMW.bytes_per_param) == (4, 8, 12)
    assert all(isinstance(x, int) for x in (FP32_ADAMW.moment_bytes, FP32_ADAMW.bytes_per_param))
    # benchmarks/NOTES.md "Host AdamW", bench/roofline.py ADAMW_BYTES: 26 B/param (BF16 gradients), 28 (FP32)
    assert FP32_ADAMW.update_bytes() == 26 and FP32_ADAMW.update_bytes(grad_bytes=4) == 28
    assert FP32_ADAMW.nbytes(1000) == 12_000 and FP32_ADAMW.master_rounding == "nearest"


@pytest.mark.parametrize("master, moments, stored, moved", [
    ("fp32", "fp32", 12, 26), ("fp32", "bf16", 8, 18), ("fp32", "8bit", 4 + 2 * (1 + 4 / 256), 14.0625),
    ("bf16", "fp32", 10, 22), ("bf16", "bf16", 6, 14), ("bf16", "8bit", 2 + 2 * (1 + 4 / 256), 10.0625)])
def test_each_combination_states_its_bytes(master, moments, stored, moved):
    """Stored: master + moments (8-bit: a byte each and a 4-byte absmax for each 256 elements of
    each moment). Moved by one update: every array read and written back, a BF16 gradient read."""
    s = optimizer_state(master=master, moments=moments)
    assert (s.master, s.moments) == (master, moments)
    assert s.bytes_per_param == stored and s.update_bytes() == moved
    assert s.master_dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[master]
    assert s.master_rounding == ("stochastic" if master == "bf16" else "nearest")
    assert s.moment_block == (B if moments == "8bit" else 0)
    n = 10 * B + 3                                     # a partial last block keeps a scale of its own
    item = s.moment_dtype.itemsize
    want = n * s.master_bytes + 2 * (n * item + (11 * 4 if moments == "8bit" else 0))
    assert s.nbytes(n) == want
    assert s.nbytes(100 * B) == s.bytes_per_param * 100 * B     # whole blocks: exactly the per-param figure
    # the split pair: params reads all and writes the master; moments reads and writes the moments
    assert s.update_bytes(part="params") == 2 * s.master_bytes + s.moment_bytes + 2
    assert s.update_bytes(part="moments") == 2 * s.moment_bytes + 2
    if (master, moments) == ("fp32", "fp32"):
        assert (s.update_bytes(part="params"), s.update_bytes(part="moments")) == (18, 18)   # NOTES "Clipping schedule"


def test_unknown_combination_is_refused():
    assert len(OPTIMIZER_STATES) == len(MASTERS) * len(MOMENTS) == 6
    with pytest.raises(ValueError, match="--moments"):
        optimizer_state(moments="4bit")


# ---- references ----

def _scalars(step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
             grad_scale: float = 1.0) -> list[torch.Tensor]:
    """The kernel's FP32 scalars, as 0-dim FP32 tensors (torch then computes in FP32)."""
    s = native_adamw._scalars(lr, beta1, beta2, eps, weight_decay, step, grad_scale)
    return [torch.tensor(x, dtype=torch.float32) for x in s]


def _reference_arith(p, mo, vo, g, step, nd, grad_scale=1.0, **kw):
    """The FP32 kernel's arithmetic, op by op: new (p, m, v) in FP32 from FP32 inputs."""
    decay, beta1, c1, beta2, c2, step_size, bc2_sqrt, eps, gscale = _scalars(step, grad_scale=grad_scale, **kw)
    gi = g.float() * gscale
    mi = mo * beta1 + gi * c1
    vi = vo * beta2 + gi * gi * c2
    # the square root in double, then rounded: exactly sqrtf's (torch 2.13's FP32 sqrt on this CPU
    # is not correctly rounded: 20% of a million values differed); a full tensor as the divisor:
    # torch divides by a 0-dim one as a multiplication by its reciprocal (another rounding)
    denom = vi.double().sqrt().float() / torch.full_like(vi, float(bc2_sqrt)) + eps
    pd = p * torch.where(torch.arange(p.numel()) < nd, decay, torch.tensor(1.0))
    return pd - step_size * mi / denom, mi, vi


def _qmaps():
    from torchao.optim.quant_utils import create_dynamic_map
    return (torch.tensor(create_dynamic_map(True), dtype=torch.float32),
            torch.tensor(create_dynamic_map(False), dtype=torch.float32))


def _dequant(codes, scales, qmap):
    return qmap[codes.long()] * scales.repeat_interleave(B)[: codes.numel()]


def _quant(x, qmap):
    """torchao's blockwise quantization (scale_tensor, quantize_8bit_with_qmap) of any length:
    the last partial block padded with zeros, which change no absmax."""
    from torchao.optim.quant_utils import quantize_8bit_with_qmap, scale_tensor
    n = x.numel()
    padded = torch.cat([x, x.new_zeros(-n % B)])
    scaled, scale = scale_tensor(padded, B)
    return quantize_8bit_with_qmap(scaled, qmap)[:n], scale


def _fmix32(h):
    """murmur3's 32-bit finaliser on int64 tensors holding uint32 values."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def _sr_reference(x, key, offset):
    """torchao's stochastic rounding rule with the kernel's counter-based hash: [n] FP32 -> BF16."""
    idx = torch.arange(x.numel(), dtype=torch.int64) + offset
    r = _fmix32(_fmix32((idx & M32) ^ (key & M32)) ^ (idx >> 32) ^ (key >> 32)) >> 16
    u = x.view(torch.int32).to(torch.int64) & M32
    up = (u & 0xFFFF0000) + torch.where(r < (u & 0xFFFF), 0x10000, 0)
    bits = torch.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, (up & M32) >> 16)
    return bits.to(torch.int16).view(torch.bfloat16)


def _zero_scales(n):
    return torch.zeros(blockwise8.num_blocks(n)), torch.zeros(blockwise8.num_blocks(n))


def _state(master, moments, n, gen):
    """A state with history: master [n], moments [n] (8-bit: codes and their scales); v >= m^2, as
    Adam's moments keep (else a v quantized to 0 beside a nonzero m makes a 100x update)."""
    p = torch.randn(n, generator=gen).to(master)
    m32 = torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 4 * 1e-2
    v32 = m32 * m32 * (1 + torch.rand(n, generator=gen)) + 1e-8
    if moments == torch.uint8:
        qs, qu = _qmaps()
        (cm, sm), (cv, sv) = _quant(m32, qs), _quant(v32, qu)
        return p, cm, cv, (sm, sv)
    return p, m32.to(moments), v32.to(moments), None


def _widened(p, m, v, scales):
    if scales is None:
        return p.float(), m.float(), v.float()
    qs, qu = _qmaps()
    return p.float(), _dequant(m, scales[0], qs), _dequant(v, scales[1], qu)


COMBOS = [(torch.float32, torch.bfloat16), (torch.float32, torch.uint8), (torch.bfloat16, torch.float32),
          (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.uint8)]


# ---- the kernels against the reference of their own arithmetic ----

@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("master, moments", COMBOS)
def test_kernel_matches_its_torch_reference_bit_for_bit(master, moments, grad_dtype):
    """Several steps over a range with a partial last block, the decay boundary inside a block,
    a clip scale and an offset in the unit: master (BF16: the same stochastic rounding),
    moments (BF16: round to nearest even; 8-bit: torchao's quantization of the new values
    against their block's new absmax) and scales, every bit."""
    gen = torch.Generator().manual_seed(1)
    n, nd, offset, seed = 5 * native_adamw.BLOCK + 7 * B + 100, 3 * native_adamw.BLOCK + 77, 3 * B, 42
    p, m, v, scales = _state(master, moments, n, gen)
    qs, qu = _qmaps()
    for step in (1, 2, 3):
        g = (torch.randn(n, generator=gen) * 10 ** -step).to(grad_dtype)
        pw, mw, vw = _widened(p, m, v, scales)
        want_p, want_m, want_v = _reference_arith(pw, mw, vw, g, step, nd, grad_scale=0.7, **KW)
        native_adamw.update_compact(p, m, v, g, step=step, scales=scales, decay_end=nd, seed=seed,
                                    offset=offset, grad_scale=0.7, **KW)
        if master == torch.bfloat16:
            want_p = _sr_reference(want_p, native_adamw.sr_key(seed, step), offset)
        assert torch.equal(p.view(torch.int16) if master == torch.bfloat16 else p.view(torch.int32),
                           want_p.view(torch.int16) if master == torch.bfloat16 else want_p.view(torch.int32))
        if moments == torch.uint8:
            (cm, sm), (cv, sv) = _quant(want_m, qs), _quant(want_v, qu)
            assert torch.equal(m, cm) and torch.equal(v, cv)
            assert torch.equal(scales[0], sm[: scales[0].numel()]) and torch.equal(scales[1], sv[: scales[1].numel()])
        else:
            assert torch.equal(m, want_m.to(moments)) and torch.equal(v, want_v.to(moments))


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("master, moments", COMBOS)
def test_params_then_moments_write_what_all_writes(master, moments, grad_dtype):
    """The clipped sweep's split pair (clip_sweep=split): "params" writes the master alone (8-bit
    codes and scales untouched), "moments" then the moments alone (the master untouched), and
    together they leave every bit "all" leaves, over several steps, the decay boundary inside a
    block and a clip scale."""
    gen = torch.Generator().manual_seed(7)
    n, nd, offset = 3 * native_adamw.BLOCK + 5 * B + 61, native_adamw.BLOCK + 3 * B + 17, 2 * B
    whole = _state(master, moments, n, gen)
    split = tuple(None if t is None else (tuple(x.clone() for x in t) if isinstance(t, tuple) else t.clone())
                  for t in whole)

    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8)
    for step in (1, 2, 3):
        g = (torch.randn(n, generator=gen) * 10 ** -step).to(grad_dtype)
        kw = dict(step=step, decay_end=nd, seed=11, offset=offset, grad_scale=0.6, **KW)
        p, m, v, scales = whole
        native_adamw.update_compact(p, m, v, g, scales=scales, **kw)
        p, m, v, scales = split
        before = [raw(t).clone() for t in (m, v, *(scales or ()))]
        native_adamw.update_compact(p, m, v, g, scales=scales, part="params", **kw)
        assert all(torch.equal(a, raw(b)) for a, b in zip(before, (m, v, *(scales or ()))))
        master_after_params = raw(p).clone()
        native_adamw.update_compact(p, m, v, g, scales=scales, part="moments", **kw)
        assert torch.equal(raw(p), master_after_params)
        for a, b in zip((whole[0], whole[1], whole[2], *(whole[3] or ())), (p, m, v, *(scales or ()))):
            assert torch.equal(raw(a), raw(b))
    with pytest.raises(AssertionError, match="all, params or moments"):
        native_adamw.update_compact(*split[:3], g, scales=split[3], part="weights", **kw)


@pytest.mark.parametrize("master, moments", COMBOS)
def test_thread_count_schedule_and_ranges_do_not_change_the_result(master, moments):
    """Elementwise, and the rounding's random bits depend on the element's index in its unit only:
    one call on 1 thread, 2 or 7 threads (either schedule), or two calls over two ranges (8-bit:
    split on a block boundary) give the same bits."""
    n = 4 * native_adamw.BLOCK + 333
    g = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    results = []
    for threads, schedule, split in [(1, "dynamic", None), (2, "dynamic", None), (2, "static", None),
                                     (7, "dynamic", None), (2, "dynamic", native_adamw.BLOCK + 5 * B)]:
        p, m, v, scales = _state(master, moments, n, torch.Generator().manual_seed(2))
        kw = dict(step=4, seed=9, threads=threads, schedule=schedule, **KW)
        if split is None:
            native_adamw.update_compact(p, m, v, g, scales=scales, **kw)
        else:
            for lo, hi in ((0, split), (split, n)):
                sc = None if scales is None else tuple(s[lo // B: blockwise8.num_blocks(hi)] for s in scales)
                native_adamw.update_compact(p[lo:hi], m[lo:hi], v[lo:hi], g[lo:hi], scales=sc, offset=lo, **kw)
        results.append([p, m, v] + list(scales or ()))
    for other in results[1:]:
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(results[0], other))


@pytest.mark.parametrize("moments", [torch.bfloat16, torch.uint8])
def test_first_step_from_zeros_writes_the_fp32_kernels_master(moments):
    """Zero moments (8-bit: codes 0 with scale 0 dequantize to 0) update the FP32 master exactly as
    the FP32 kernel does on its zero moments: the format changes only what is stored."""
    n = 2 * native_adamw.BLOCK + 999
    gen = torch.Generator().manual_seed(4)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(torch.bfloat16)
    want = [p.clone(), torch.zeros(n), torch.zeros(n)]
    native_adamw.update(*want, g, step=1, **KW)
    m, v = torch.zeros(n, dtype=moments), torch.zeros(n, dtype=moments)
    scales = _zero_scales(n) if moments == torch.uint8 else None
    native_adamw.update_compact(p, m, v, g, step=1, scales=scales, **KW)
    assert torch.equal(p, want[0])


def test_ranges_it_cannot_take_are_refused():
    n = 2 * B
    p, g = torch.zeros(n), torch.zeros(n)
    m, v = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    scales = (torch.zeros(2), torch.zeros(2))
    with pytest.raises(AssertionError, match="block"):
        native_adamw.update_compact(p, m, v, g, step=1, scales=scales, offset=B // 2, **KW)
    with pytest.raises(AssertionError):
        native_adamw.update_compact(p, m, v, g, step=1, scales=(torch.zeros(1), torch.zeros(1)), **KW)
    with pytest.raises(AssertionError, match="update"):         # FP32 state: the FP32 kernel
        native_adamw.update_compact(p, torch.zeros(n), torch.zeros(n), g, step=1, **KW)


# ---- 8-bit: against torchao ----

def test_codebooks_are_bitsandbytes_dynamic_map_as_torchao_builds_it():
    qs, qu = _qmaps()
    assert torch.equal(blockwise8.dynamic_map(True), qs) and torch.equal(blockwise8.dynamic_map(False), qu)
    assert torch.equal(blockwise8.kernel_tables()[:512].view(torch.float32), torch.cat([qs, qu]))
    assert float(qs[0]) < 0 and float(qu[0]) == 0 and float(qs[-1]) == float(qu[-1]) == 1.0
    # dequantize (a reader of 8-bit moments): each moment's map times its block's scale, any length
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 256, (600,), dtype=torch.uint8, generator=gen)
    scales = torch.rand(3, generator=gen) + 0.5
    assert torch.equal(blockwise8.dequantize(codes, scales, "exp_avg"), _dequant(codes, scales, qs))
    assert torch.equal(blockwise8.dequantize(codes, scales, "exp_avg_sq"), _dequant(codes, scales, qu))


def _values_at_every_threshold(qmap, gen):
    """Scaled values ([k] FP32 in [-1, 1], or [0, 1] for the unsigned map) on every code's threshold
    (the least float reaching the code, checked against torchao's quantizer), one float either
    side, every codebook value, zeros, tiny and subnormal values, and random ones over 17 decades."""
    from torchao.optim.quant_utils import quantize_8bit_with_qmap
    t = blockwise8.thresholds(qmap)
    below = torch.nextafter(t, torch.full_like(t, -2.0))
    assert bool((quantize_8bit_with_qmap(t, qmap).long() == torch.arange(1, 256)).all())
    assert bool((quantize_8bit_with_qmap(below, qmap).long() == torch.arange(0, 255)).all())
    spread = (torch.rand(20 * B, generator=gen) * 2 - 1) * torch.exp(-torch.rand(20 * B, generator=gen) * 40)
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-44, -1.0])
    x = torch.cat([t, below, torch.nextafter(t, torch.full_like(t, 2.0)), qmap, special, spread]).clamp(-1, 1)
    return x.abs() if float(qmap[0]) == 0 else x


def _in_blocks(g, top):
    """[k * B]: blocks of B - 1 values of g then `top` (each block's largest magnitude)."""
    blocks = torch.cat([g, g.new_zeros(-g.numel() % (B - 1))]).view(-1, B - 1)
    return torch.cat([blocks, torch.full((blocks.shape[0], 1), top)], 1).view(-1)


@pytest.mark.parametrize("signed", [True, False])
def test_kernel_quantizes_as_torchao_code_for_code(signed):
    """Where the schemes coincide: with beta1 = 0 the kernel's new first moment is the gradient
    itself (m * 0 + g * 1), with beta2 = 0 the second is g * g; its codes and scales must be
    torchao's quantization of those values, on every threshold of the map and either side. The
    block scale is 4 (a power of two: value / scale is exactly the scaled value); for the second
    moment g takes the floats around sqrt(4 y) for each target y, so the squares g * g fall on and
    beside each threshold."""
    gen = torch.Generator().manual_seed(5)
    qs, qu = _qmaps()
    qmap = qs if signed else qu
    y = _values_at_every_threshold(qmap, gen)
    if signed:
        g = _in_blocks(y * 4, 4.0)
    else:
        lo = hi = (4 * y).double().sqrt().float()
        near = [lo]
        for _ in range(2):                                              # two floats either side
            lo, hi = torch.nextafter(lo, torch.zeros_like(lo)), torch.nextafter(hi, torch.full_like(hi, 3.0))
            near += [lo, hi]
        g = torch.cat(near)
        g = _in_blocks(g[g * g < 4.0], 2.0)                             # g * g <= 4: the block's absmax
    n = g.numel()
    p = torch.zeros(n)
    m, v = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    scales = (torch.zeros(n // B), torch.zeros(n // B))
    native_adamw.update_compact(p, m, v, g, step=1, scales=scales, lr=0.0, beta1=0.0, beta2=0.0, eps=1e-8,
                                weight_decay=0.0)
    codes, scale = _quant(g if signed else g * g, qmap)
    got_codes, got_scale = (m, scales[0]) if signed else (v, scales[1])
    assert bool((scale == 4.0).all()) and torch.equal(got_scale, scale)
    assert torch.equal(got_codes, codes), f"{int((got_codes != codes).sum())} codes differ"
    assert len(codes.unique()) == 256                                   # every code taken


def test_a_nan_poisons_its_block_as_in_torchao():
    """torch's amax propagates a NaN: the block's scale is NaN and every code of it is 0, so the block
    reads back as NaN (not a finite value quietly standing in); the other blocks are untouched."""
    n = 3 * B
    g = torch.randn(n, generator=torch.Generator().manual_seed(6))
    g[B + 17] = float("nan")
    p = torch.zeros(n)
    m, v = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    scales = (torch.zeros(3), torch.zeros(3))
    native_adamw.update_compact(p, m, v, g, step=1, scales=scales, lr=0.0, beta1=0.0, beta2=0.0, eps=1e-8,
                                weight_decay=0.0)
    qs, qu = _qmaps()
    for got, sc, x, qmap in ((m, scales[0], g, qs), (v, scales[1], g * g, qu)):
        codes, scale = _quant(x, qmap)
        assert torch.equal(got, codes) and bool(sc[1].isnan()) and bool(scale[1].isnan())
        assert torch.equal(sc[[0, 2]], scale[[0, 2]])


def _torchao_step(p, g, step, m, v, scales, master_sr=False):
    """torchao's AdamW step (single_param_adam, eager) on the given state; 8-bit moments as its
    OptimState8bit over copies of our codes and scales, BF16/FP32 moments as plain tensors."""
    from torchao.optim.adam import single_param_adam
    from torchao.optim.subclass_8bit import OptimState8bit
    if scales is not None:
        qs, qu = _qmaps()
        m = OptimState8bit(m.clone(), scales[0].clone(), qs, True)
        v = OptimState8bit(v.clone(), scales[1].clone(), qu, False)
    else:
        m, v = m.clone(), v.clone()
    single_param_adam(p, g, torch.tensor(float(step)), m, v, None, torch.tensor(KW["lr"]), KW["beta1"],
                      KW["beta2"], KW["weight_decay"], KW["eps"], True, master_sr)
    return (m.codes, v.codes, (m.scale, v.scale)) if scales is not None else (m, v, None)


def _close_to_update(got, want, before):
    """FP32 masters of two implementations of one step: within FP32 rounding of the value and of
    the update (torchao takes the decay first and lr * (m / bc1) / denom, from lerp's moments)."""
    assert bool(((got - want).abs() <= 1e-5 * (want - before).abs() + 2.4e-7 * want.abs()).all())


def _bf16_neighbours(x):
    """The BF16 values either side of FP32 x: toward zero (the top 16 bits) and away from it."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFF0000
    as_float = lambda b: (b & M32).to(torch.int32).view(torch.float32)      # noqa: E731
    return as_float(bits), as_float(bits + 0x10000)


def _within_one_code(got, want, got_scale, want_scale, qmap):
    """Codes at most one apart, and the dequantized values within one code step of each other."""
    assert int((got.long() - want.long()).abs().max()) <= 1
    torch.testing.assert_close(got_scale, want_scale, rtol=2e-6, atol=0)
    a, b = _dequant(got, got_scale, qmap), _dequant(want, want_scale, qmap)
    lo = torch.minimum(got, want).long().clamp(max=254)             # the step below code 255
    step = (qmap[lo + 1] - qmap[lo]) * torch.maximum(got_scale, want_scale).repeat_interleave(B)
    assert bool(((a - b).abs() <= step * (1 + 1e-5) + 1e-30).all())
    return float((got != want).float().mean())


@pytest.mark.parametrize("master", [torch.float32, torch.bfloat16])
def test_8bit_step_matches_torchao_adamw8bit_within_its_quantization(master):
    """Three steps, each from the same state on both sides: codes within one (and almost all
    equal), scales to FP32 rounding, the master to FP32 rounding (BF16: the same pair of
    neighbours to round between: torchao's FP32 value rounded stochastically by either side)."""
    gen = torch.Generator().manual_seed(7)
    n = 64 * B
    p, m, v, scales = _state(master, torch.uint8, n, gen)
    qs, qu = _qmaps()
    for step in (1, 2, 3):
        g = torch.randn(n, generator=gen) * 1e-2
        before = p.float().clone()                                      # (.float() of FP32 is p itself)
        pt = before.clone()                                             # torchao's FP32 update, unrounded
        tm, tv, tscales = _torchao_step(pt, g, step, m, v, scales)
        native_adamw.update_compact(p, m, v, g, step=step, scales=scales, seed=1, **KW)
        flipped = (_within_one_code(m, tm, scales[0], tscales[0], qs)
                   + _within_one_code(v, tv, scales[1], tscales[1], qu))
        assert flipped < 2e-3, f"{flipped:.2%} of codes on the other side of a threshold"
        if master == torch.float32:
            _close_to_update(p, pt, before)
        else:                                                           # both neighbours of torchao's value
            toward, away = _bf16_neighbours(pt)
            inside = (p.float() == toward) | (p.float() == away)
            # the rest: torchao's FP32 value and ours either side of a BF16 value
            assert float(inside.float().mean()) > 0.999
        m, v, scales = m.clone(), v.clone(), tuple(s.clone() for s in scales)


# ---- BF16 moments ----

def test_bf16_moments_match_torch_fused_adamw_then_cast():
    """One step from BF16 moments: torch._fused_adamw_ on the widened moments and the FP32 master,
    then the moments cast to BF16: the master to FP32 rounding (torch's vector code orders a few
    operations differently), the moments equal but for a rare BF16 tie rounded the other way."""
    gen = torch.Generator().manual_seed(8)
    n = 3 * native_adamw.BLOCK + 11
    p, m, v, _ = _state(torch.float32, torch.bfloat16, n, gen)
    g = torch.randn(n, generator=gen) * 1e-2
    ref = [p.clone(), m.float(), v.float()]
    step = torch.tensor(3.0)
    torch._fused_adamw_([ref[0]], [g.clone()], [ref[1]], [ref[2]], [], [step], lr=KW["lr"], beta1=KW["beta1"],
                        beta2=KW["beta2"], weight_decay=KW["weight_decay"], eps=KW["eps"], amsgrad=False,
                        maximize=False)
    native_adamw.update_compact(p, m, v, g, step=3, **KW)
    torch.testing.assert_close(p, ref[0], rtol=2e-7, atol=1e-9)
    for got, want in ((m, ref[1]), (v, ref[2])):
        ulps = (got.view(torch.int16).long() - want.bfloat16().view(torch.int16).long()).abs()
        assert int(ulps.max()) <= 1 and float((ulps > 0).float().mean()) < 1e-3


def test_bf16_moments_match_torchao_on_bf16_state():
    """torchao's step on BF16 moment tensors (widened, lerp, rounded back): within one BF16 ulp."""
    gen = torch.Generator().manual_seed(9)
    n = 2 * native_adamw.BLOCK
    p, m, v, _ = _state(torch.float32, torch.bfloat16, n, gen)
    g = torch.randn(n, generator=gen) * 1e-2
    before, pt = p.clone(), p.clone()
    tm, tv, _ = _torchao_step(pt, g, 2, m, v, None)
    native_adamw.update_compact(p, m, v, g, step=2, **KW)
    _close_to_update(p, pt, before)
    for got, want in ((m, tm), (v, tv)):
        assert int((got.view(torch.int16).long() - want.view(torch.int16).long()).abs().max()) <= 1


# ---- the BF16 master's stochastic rounding ----

def test_stochastic_rounding_is_unbiased_like_torchaos():
    """Decay alone (no gradient, no moments: the new master is fl(p * decay), rarely a BF16 value):
    over 400 steps (400 independent streams), each element rounds up with the probability its
    low 16 bits give, so the mean of the roundings is the FP32 value; torchao's rule (torch's RNG)
    the same. Tolerances: 5 standard deviations of a mean of 400 Bernoulli draws."""
    from torchao.optim.quant_utils import _fp32_to_bf16_sr
    n, draws = 4096, 400
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(10)).bfloat16()
    kw = dict(KW, lr=0.37, weight_decay=0.01)                           # decay 0.9963: off the BF16 grid
    x, _, _ = _reference_arith(p0.float(), torch.zeros(n), torch.zeros(n), torch.zeros(n), 1, n, **kw)
    toward, away = _bf16_neighbours(x)
    ulp = away - toward                                                 # signed: x's side of zero
    frac = (x - toward) / ulp                                           # [n] probability of rounding away
    assert float(frac.min()) >= 0 and 0.3 < float(frac.mean()) < 0.7
    ours, theirs = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    torch.manual_seed(0)
    for seed in range(draws):
        p = p0.clone()
        native_adamw.update_compact(p, torch.zeros(n), torch.zeros(n), torch.zeros(n), step=1, seed=seed, **kw)
        ours += (p.float() - toward) / ulp
        theirs += (_fp32_to_bf16_sr(x).float() - toward) / ulp
    sigma = (frac * (1 - frac) / draws).sqrt().double() + 1e-12
    for rate in (ours / draws, theirs / draws):
        assert bool(((rate - frac) / sigma).abs().max() < 5.5)         # each element: unbiased
        assert abs(float((rate - frac).sum() / sigma.pow(2).sum().sqrt())) < 5    # all together


def test_stochastic_rounding_of_specials():
    """NaN -> 0x7FC0 (as torch's cast); inf, zero and BF16 values stay what they are."""
    n = native_adamw.BLOCK
    specials = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 1.0, -3.5, float("nan")])
    p = torch.zeros(n, dtype=torch.bfloat16)
    p[: specials.numel()] = specials.bfloat16()
    native_adamw.update_compact(p, torch.zeros(n), torch.zeros(n), torch.zeros(n), step=1,
                                **dict(KW, lr=0.0, weight_decay=0.0))
    assert torch.equal(p[:6].float(), specials[:6]) and int(p.view(torch.int16)[6]) == 0x7FC0


# ---- a trajectory ----

def _trajectory(master, moments, steps=50, n=8 * native_adamw.BLOCK):
    """AdamW on a noisy quadratic, 0.5 * a * (w - target)^2 with per-element curvature a, BF16
    gradients: the master after `steps` steps (FP32) and the mean loss at each step."""
    gen = torch.Generator().manual_seed(11)
    w0, target = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    a = torch.rand(n, generator=gen) * 2 + 0.1
    noise = [torch.randn(n, generator=gen) * 0.3 for _ in range(steps)]
    fmt = optimizer_state(master=master, moments=moments)
    w = w0.clone().to(fmt.master_dtype)
    m, v = torch.zeros(n, dtype=fmt.moment_dtype), torch.zeros(n, dtype=fmt.moment_dtype)
    scales = _zero_scales(n) if fmt.moment_block else None
    losses = []
    kw = dict(KW, lr=2e-2, weight_decay=0.01)
    for step in range(1, steps + 1):
        d = w.float() - target
        losses.append(float((0.5 * a * d * d).mean()))
        g = (a * d + noise[step - 1]).bfloat16()
        if fmt is FP32_ADAMW:
            native_adamw.update(w, m, v, g, step=step, **kw)
        else:
            native_adamw.update_compact(w, m, v, g, step=step, scales=scales, seed=5, **kw)
    return w.float(), w0, losses


# drift bounds, ~2.5x what this CPU measured (2026-11-28), by (master, moments)
DRIFT = {("fp32", "bf16"): 5e-3, ("fp32", "8bit"): 6e-2, ("bf16", "fp32"): 4e-2, ("bf16", "bf16"): 4e-2,
         ("bf16", "8bit"): 7e-2}


@pytest.mark.parametrize("master, moments", sorted(DRIFT))
def test_each_combination_tracks_the_fp32_trajectory(master, moments):
    """50 steps: the compact run's distance from the FP32 run's weights, relative to how far the FP32
    run moved them, and its mean loss at every step relative to FP32's. Measured on this CPU:
    drift 0.18% (BF16 moments), 2.2% (8-bit), 1.6% (BF16 master: each rounding a random half ulp,
    2^-9 of the weight), 1.7% (BF16 master and moments), 2.7% (BF16 master, 8-bit moments); the loss
    within 0.18% of FP32's at every step. Bounds: DRIFT, and 0.5% on the loss."""
    want, w0, want_losses = _trajectory("fp32", "fp32")
    got, _, losses = _trajectory(master, moments)
    drift = float((got - want).norm()) / float((want - w0).norm())
    assert drift < DRIFT[(master, moments)], f"{drift:.2e}"
    assert want_losses[-1] < 0.4 * want_losses[0]                      # it trained (to the noise's floor)
    worst = max(abs(a - b) / b for a, b in zip(losses, want_losses))
    assert worst < 5e-3, f"loss {worst:.2e} from FP32's"


def test_rate_script_measures_each_format_and_part(tmp_path):
    """benchmarks/scripts/compact_adamw_rate.py (device_call.sh compactrate) on a small range: one
    row a format and part, each with its bytes moved and a rate."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "rate.json"
    subprocess.run([sys.executable, str(root / "benchmarks/scripts/compact_adamw_rate.py"), str(out),
                    "--params", "2e5", "--threads", "1", "--parts", "all,params,moments"],
                   check=True, capture_output=True, text=True, env={**__import__("os").environ, "PYTHONPATH": str(root / "src")})
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == len(OPTIMIZER_STATES) * 3
    for r in rows:
        fmt = optimizer_state(r["master"], r["moments"])
        assert r["bytes_moved"] == fmt.update_bytes(2, r["part"]) and r["params_per_s"]["1"] > 0
