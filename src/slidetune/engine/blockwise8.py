"""The 8-bit blockwise moment format (`--moments 8bit`, issue 46): bitsandbytes' dynamic
quantization, the scheme torchao's AdamW8bit and bitsandbytes' 8-bit optimizers keep AdamW's
moments in.

A moment of n elements is stored as n one-byte codes and one FP32 scale for each BLOCK
consecutive elements (the last block may be shorter): the scale is the block's absmax (at least
FLOOR, so an all-zero block divides by something), and an element's code is the index of the
codebook entry nearest to value / scale. Dequantized: codebook[code] * scale. The first moment
uses the signed map, the second (never negative) the unsigned one, twice as fine.

BLOCK 256, as torchao's AdamW8bit and bitsandbytes' blockwise optimizers use: a scale costs
4/256 B/param a moment (2 x (1 + 4/256) = 2.03125 B/param for both), and one outlier coarsens
only its own 256 neighbours. Larger blocks barely speed the kernel (one core of the 2-core CPU
machine, 2026-11-28: 0.353 G params/s at 256, 0.365 at 1024, 0.370 at 2048). The host kernel
(native_adamw) works a block at a time in registers, so the block is also the unit its threads
never split; a range it updates must start on a block boundary of its moment.

The codebook is the "dynamic" map (Dettmers, arXiv:1511.04561): a sign, then a decimal exponent
10^-6 .. 10^0 told by the count of leading zero bits, the remaining bits a linear fraction in
[0.1, 1]; built here exactly as bitsandbytes' create_dynamic_map (torchao's copy in
torchao/optim/quant_utils.py), in FP32 torch arithmetic, so the values are theirs bit for bit
(tests/test_compact_adamw.py compares them).

Quantizing is torchao's rule (quantize_8bit_with_qmap): a binary search for the last entry <= x,
then one up where x - entry >= (next - entry) / 2, in FP32. Run as written, that is 10 dependent
table lookups an element, and the host kernel ran 13x slower than the FP32 one (0.12 against
1.58 G params/s on a core). The kernel gets the same codes from one lookup: the rule is a
monotone step function of x, so it is fixed by its 255 thresholds (the least float reaching each
code, found here by bisection over the floats with the rule itself); buckets of x's sign,
exponent and top 7 mantissa bits (its BF16 bits) hold at most one threshold each (checked as the
table is built: 6 bits would not do for the unsigned map), so a bucket's entry (its first
float's code, and where in the bucket the next code starts) gives the code by one comparison.
"""
from __future__ import annotations

import functools

import torch

BLOCK = 256                    # elements sharing one scale
FLOOR = 1e-12                  # the least scale (torchao's clip): an all-zero block stays finite
CODE_DTYPE = torch.uint8
SCALE_DTYPE = torch.float32
SIGNED = {"exp_avg": True, "exp_avg_sq": False}   # which map each moment uses
# The bucket tables: |x| bits >> 16 (sign dropped, exponent, 7 mantissa bits) less LOW_BUCKET;
# below 2^-24 (exponent field LOW_EXP) every x takes the code of 0 (no threshold there: checked),
# and 1.0 is the last bucket (|x| <= 1 after the scale; larger, inf and NaN clamp to it).
LOW_EXP = 103
LOW_BUCKET = LOW_EXP << 7
TABLE = (127 - LOW_EXP) * 128 + 1      # buckets a sign: 24 binades, and 1.0
NO_STEP = 1 << 16                      # an entry's step past every float of its bucket


def dynamic_map(signed: bool, max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """The 256 codebook values, sorted ([256] FP32; -0.993 .. 1.0 signed, 0 .. 1.0 unsigned).

    bitsandbytes' construction: for each decade i (10^-6 .. 10^0), the midpoints of an even
    split of [0.1, 1] into 2^i parts (signed: and their negatives) or 2^(i+1) parts (unsigned),
    times 10^(i-6); then 0 and 1. Its `total_bits - 1` non-sign bits hold for unsigned too (as
    in bitsandbytes: the unsigned map spends the sign bit on a finer fraction)."""
    data: list[float] = []
    non_sign_bits = total_bits - 1
    for i in range(max_exponent_bits):
        items = 2 ** (i + non_sign_bits - max_exponent_bits + (0 if signed else 1)) + 1
        bounds = torch.linspace(0.1, 1, items)                   # [items] fp32, as bitsandbytes
        means = (bounds[:-1] + bounds[1:]) / 2.0                 # [items - 1] fp32
        scale = 10 ** (-(max_exponent_bits - 1) + i)
        data += (scale * means).tolist()
        if signed:
            data += (-scale * means).tolist()
    data += [0.0, 1.0]
    assert len(data) == 2 ** total_bits
    return torch.tensor(sorted(data), dtype=torch.float32)


def quantize_rule(x: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """Codes ([n] int64) of scaled values x ([n] FP32) by torchao's quantize_8bit_with_qmap,
    op for op: what the tables below reproduce (and what they are built from)."""
    codes = torch.where(x >= qmap[128], 128, 0)
    for step in (64, 32, 16, 8, 4, 2, 1):
        codes += torch.where(x >= qmap[codes + step], step, 0)
    up = (codes + 1).clip(max=255)
    down = qmap[codes]
    return torch.where(x - down >= (qmap[up] - down) * 0.5, up, codes)


def _float_of_key(key: torch.Tensor) -> torch.Tensor:
    """Ordered int64 keys (negative floats negative) -> FP32 values."""
    bits = torch.where(key >= 0, key, (-key) | 0x80000000)
    return bits.to(torch.int32).view(torch.float32)     # int64 -> int32 keeps the low 32 bits


def thresholds(qmap: torch.Tensor) -> torch.Tensor:
    """[255] FP32: for code k = 1..255, the least float x with quantize_rule(x) >= k (bisection
    over the ordered floats of [-1, 1], all codes at once; the rule is monotone in x)."""
    k = torch.arange(1, 256)
    lo = torch.full((255,), -0x3F800000 - 1, dtype=torch.int64)    # just below -1.0: every code < k
    hi = torch.full((255,), 0x3F800000, dtype=torch.int64)         # 1.0: code 255 >= k
    while bool((hi - lo > 1).any()):
        mid = (lo + hi) // 2
        reached = quantize_rule(_float_of_key(mid), qmap) >= k
        hi, lo = torch.where(reached, mid, hi), torch.where(reached, lo, mid)
    return _float_of_key(hi)


def bucket_table(qmap: torch.Tensor) -> torch.Tensor:
    """[2 * TABLE] int32, positive buckets then negative: entry = code << 17 | step, where step is
    the rank in the bucket (|x|'s low 16 bits; negative: their complement, so rank rises with x)
    from which x takes code + 1 (NO_STEP: none). Checks that no bucket holds two thresholds."""
    t = thresholds(qmap)                                            # [255]
    bits = t.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    neg, mag = bits >> 31, bits & 0x7FFFFFFF
    bucket = (mag >> 16) - LOW_BUCKET + neg * TABLE                 # [255] entry of each threshold
    rank = (mag & 0xFFFF) ^ (neg * 0xFFFF)
    inside = rank > 0                                               # at a bucket's first float: in its code
    assert bool((mag[inside] >> 16 >= LOW_BUCKET + 128).all()), "a threshold below the table's first binade"
    assert len(bucket[inside].unique()) == int(inside.sum()), "two thresholds in one bucket"
    b = torch.arange(TABLE, dtype=torch.int64) + LOW_BUCKET
    first = torch.cat([b << 16, (b << 16 | 0xFFFF) | 0x80000000])   # each bucket's least float's bits
    code = quantize_rule(first.to(torch.int32).view(torch.float32), qmap)
    step = torch.full((2 * TABLE,), NO_STEP, dtype=torch.int64)
    step[bucket[inside]] = rank[inside]
    return (code << 17 | step).to(torch.int32)


def byte_planes(qmap: torch.Tensor) -> torch.Tensor:
    """[256] int32 holding [4, 256] bytes: plane b is byte b (little-endian) of each of the 256
    FP32 entries, in code order: the AVX-512 kernel's codebook, four 64-byte registers a plane
    (engine/q8_avx512.py)."""
    return qmap.view(torch.uint8).view(256, 4).t().contiguous().view(-1).view(torch.int32)


@functools.cache
def kernel_tables() -> torch.Tensor:
    """The host kernel's tables, one int32 buffer (kept alive here): [0, 512) the signed then the
    unsigned codebook's FP32 bits; then the signed map's bucket_table, then the unsigned one's;
    then the signed and the unsigned map's byte_planes (256 each)."""
    signed, unsigned = dynamic_map(True), dynamic_map(False)
    return torch.cat([signed.view(torch.int32), unsigned.view(torch.int32),
                      bucket_table(signed), bucket_table(unsigned),
                      byte_planes(signed), byte_planes(unsigned)]).contiguous()


def num_blocks(numel: int) -> int:
    """Scales a moment of `numel` elements keeps (the last block may be partial)."""
    return -(-numel // BLOCK)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, moment: str) -> torch.Tensor:
    """The FP32 values [n] of a moment's codes ([n] uint8) and block scales ([num_blocks(n)] FP32):
    its map's entry (SIGNED[moment]: exp_avg's signed, exp_avg_sq's unsigned) times its block's
    scale, as the kernel dequantizes (a reader of a checkpoint's 8-bit moments, the tests)."""
    qmap = dynamic_map(SIGNED[moment])
    return qmap[codes.long()] * scales.repeat_interleave(BLOCK)[: codes.numel()]
