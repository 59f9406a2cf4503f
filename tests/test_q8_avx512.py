"""The 8-bit moments' AVX-512 passes (engine/q8_avx512.py) against the portable ones (the same
source built with -DQ8_SCALAR), bit for bit: master, codes and scales after every part (all,
params, moments), FP32 and BF16 masters, FP32 and BF16 gradients.

Where they run: natively where the CPU has AVX-512 F/BW/VL/VBMI (the GPU hosts' Xeons: device
job `q8avx512`); elsewhere emulated through SIMDe's portable intrinsics where its headers are found
(SLIDETUNE_SIMDE_INCLUDE, the simde-py package, or /usr/include: SIMDe 0.7 or 0.8), which checks the
code's logic but not the CPU's instructions; else skipped. The source also compiles with the
AVX-512 flags forced on any x86 gcc (test_the_avx512_path_compiles_when_forced).
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile

import pytest
import torch

from slidetune.engine import blockwise8, native_adamw

pytestmark = pytest.mark.skipif(native_adamw.load_compact() is None, reason="no C compiler")

B = blockwise8.BLOCK
KW = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vbmi"]


def _simde_include() -> str | None:
    """A folder holding simde/x86/avx512.h, or None."""
    folders = [os.environ.get("SLIDETUNE_SIMDE_INCLUDE", "")]
    try:
        import simde_py
        folders.append(simde_py.get_include())
    except ImportError:
        pass
    folders.append("/usr/include")
    return next((f for f in folders if f and os.path.exists(os.path.join(f, "simde/x86/avx512.h"))), None)


@functools.cache
def _kernels() -> tuple[native_adamw.Kernel, native_adamw.Kernel, str] | str:
    """(the AVX-512 passes, the portable ones, "native" or "SIMDe"), or why they cannot run here."""
    native = native_adamw.build_compact()      # -march=native without -DQ8_SCALAR (load_compact's default)
    if native.q8_avx512:
        vector, how = native, "native"
    else:
        include = _simde_include()
        if include is None:
            return "no AVX-512 F/BW/VL/VBMI on this CPU, and no SIMDe headers to emulate them"
        try:
            vector, how = native_adamw.build_compact(("-DQ8_SIMDE", f"-I{include}", "-Wno-psabi")), "SIMDe"
        except RuntimeError as e:
            return f"SIMDe in {include} does not build the AVX-512 passes (0.7 and 0.8 do): {e}"
    portable = native_adamw.build_compact(("-DQ8_SCALAR",))
    assert vector.q8_avx512 and not portable.q8_avx512
    return vector, portable, how


def _pair() -> tuple[native_adamw.Kernel, native_adamw.Kernel, str]:
    got = _kernels()
    if isinstance(got, str):
        pytest.skip(got)
    return got


def test_the_avx512_path_compiles_when_forced():
    """The compact source with AVX-512 F/BW/VL/VBMI forced (on any x86 gcc): the object holds the
    permutes and gathers of the AVX-512 passes; with -DQ8_SCALAR beside the same flags it does not."""
    cc = native_adamw._compiler()
    if cc is None or shutil.which("objdump") is None or os.uname().machine != "x86_64":
        pytest.skip("needs an x86-64 gcc and objdump")
    flags = [f for f in native_adamw.FLAGS if f not in ("-march=native", "-shared")] + AVX512_FLAGS
    with tempfile.TemporaryDirectory() as tmp:
        src, obj = os.path.join(tmp, "compact.c"), os.path.join(tmp, "compact.o")
        with open(src, "w") as f:
            f.write(native_adamw.compact_source())
        for extra, want in (([], True), (["-DQ8_SCALAR"], False)):
            done = subprocess.run([cc, *flags, *extra, "-c", src, "-o", obj], capture_output=True, text=True)
            assert done.returncode == 0, done.stderr[-2000:]
            asm = subprocess.run(["objdump", "-d", obj], capture_output=True, text=True, check=True).stdout
            has = ("vpermi2b" in asm or "vpermt2b" in asm) and "vpgatherdd" in asm
            assert has == want, f"{extra}: byte permutes and gathers {'missing' if want else 'present'}"


def test_byte_planes_reassemble_the_codebooks():
    """kernel_tables' byte planes (the AVX-512 codebooks): byte b of entry c at plane b, column c."""
    tables = blockwise8.kernel_tables()
    planes = tables[512 + 4 * blockwise8.TABLE:].view(torch.uint8).view(2, 4, 256)
    for k, signed in enumerate((True, False)):
        rebuilt = planes[k].t().contiguous().view(torch.float32).view(-1)
        assert torch.equal(rebuilt.view(torch.int32), blockwise8.dynamic_map(signed).view(torch.int32))
    assert tables.numel() == 512 + 4 * blockwise8.TABLE + 512


def _edge_state(master: torch.dtype, n: int, gen: torch.Generator):
    """master [n], codes m, v [n] (every code), scales [blocks] over 30 decades with 0, the floor, inf
    and NaN among them: the 8-bit state a history can leave, specials included."""
    p = (torch.randn(n, generator=gen) * 10 ** torch.randint(-8, 3, (n,), generator=gen)).to(master)
    m = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    v = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    blocks = blockwise8.num_blocks(n)
    scales = [torch.rand(blocks, generator=gen) * 10.0 ** torch.randint(-20, 10, (blocks,), generator=gen)
              for _ in range(2)]
    for s in scales:
        s[:4] = torch.tensor([0.0, 1e-12, float("inf"), float("nan")])
    return p, m, v, tuple(scales)


def _edge_grads(n: int, step: int, grad: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """[n]: decades 1e-30 .. 1e10 (squares that overflow), zeros of both signs, subnormals, inf, NaN."""
    g = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-30, 10, (n,), generator=gen)
    specials = torch.tensor([0.0, -0.0, 1e-40, -1e-44, float("inf"), -float("inf"), float("nan"), 3e38])
    at = torch.randint(8 * B, n, (64,), generator=gen)
    g[at] = specials.repeat(8)
    g[5 * B + step: 6 * B] = 0.0                       # a block of zeros: the scale's floor
    return g.to(grad)


def _threshold_grads(n: int, qmap_signed: torch.Tensor, qmap_unsigned: torch.Tensor) -> torch.Tensor:
    """[n]: with beta1 = beta2 = 0, m = g and v = g * g; each block's last element 4 makes its scales
    4 and 16 (powers of two: x / scale is exact), the rest lie on every threshold of the signed map,
    one float either side, and at the square roots of the unsigned map's (v falls on and beside them)."""
    ts, tu = blockwise8.thresholds(qmap_signed), blockwise8.thresholds(qmap_unsigned)
    def either_side(x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:      # x, a float down, a float up
        return torch.cat([x, torch.nextafter(x, torch.full_like(x, lo)), torch.nextafter(x, torch.full_like(x, hi))])
    signed = either_side(ts, -2.0, 2.0)
    near = either_side((16 * tu.double()).sqrt().float(), 0.0, 5.0)
    values = torch.cat([signed * 4, near[near * near < 16.0], -near[near * near < 16.0]])
    body = values.repeat(-(-n // values.numel()))[:n].view(-1)
    body[B - 1::B] = 4.0
    return body


def _run(kernel, state, g, *, part, step, **kw) -> list[torch.Tensor]:
    p, m, v, scales = (t.clone() if isinstance(t, torch.Tensor) else tuple(x.clone() for x in t) for t in state)
    native_adamw.update_compact(p, m, v, g, step=step, scales=scales, part=part, kernel=kernel, threads=2, **kw)
    return [p, m, v, *scales]


def _differences(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> list[str]:
    """What differs, tensor by tensor, bit for bit; but in FP32 (a master, a scale) a NaN matches any
    NaN: of two NaN operands (a moment's 0 x inf plus a NaN gradient's term) x86 returns the first
    one's sign and payload, and gcc orders the operands of a commutative + or * as it allocates
    registers, in either path. The codes of a NaN block are 0 in both, a BF16 master's NaN 0x7FC0."""
    out = []
    for name, a, b in zip(("master", "exp_avg codes", "exp_avg_sq codes", "exp_avg scales", "exp_avg_sq scales"),
                          got, want):
        bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.uint8: torch.uint8}[a.dtype]
        same = a.view(bits) == b.view(bits)
        if a.dtype == torch.float32:
            same |= a.isnan() & b.isnan()
        if not bool(same.all()):
            bad = (~same).nonzero().flatten()
            out.append(f"{what} {name}: {bad.numel()} of {same.numel()} differ, first at {int(bad[0])}: "
                       f"{a[bad[0]].item()} against {b[bad[0]].item()}")
    return out


@pytest.mark.parametrize("grad", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("master", [torch.float32, torch.bfloat16])
def test_avx512_passes_write_the_portable_ones_bits(master, grad):
    """Three steps over a range with a partial last block (and a last 64-code chunk that is partial),
    the decay boundary inside a block, a clip scale and an offset; states and gradients with the
    specials; then each threshold of both maps and either side of it: every part, every bit."""
    vector, portable, how = _pair()
    gen = torch.Generator().manual_seed(46)
    n, nd = 2 * native_adamw.BLOCK + 9 * B + 37, native_adamw.BLOCK + 3 * B + 45
    state = _edge_state(master, n, gen)
    bad = []
    for step in (1, 2, 3):
        g = _edge_grads(n, step, grad, gen)
        kw = dict(decay_end=nd, seed=5, offset=(1 << 32) - 3 * B, grad_scale=0.7, **KW)   # the index's high half 0, 1
        for part in ("params", "moments", "all"):
            want = _run(portable, state, g, part=part, step=step, **kw)
            bad += _differences(_run(vector, state, g, part=part, step=step, **kw), want, f"step {step} {part}")
        state = (want[0], want[1], want[2], (want[3], want[4]))       # the next step from "all"'s
    g = _threshold_grads(n, blockwise8.dynamic_map(True), blockwise8.dynamic_map(False)).to(grad)
    kw = dict(lr=0.0, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0, seed=5)
    for part in ("all", "moments"):
        want = _run(portable, state, g, part=part, step=1, **kw)
        bad += _differences(_run(vector, state, g, part=part, step=1, **kw), want, f"thresholds {part}")
    assert not bad, f"AVX-512 ({how}) against portable: " + "; ".join(bad)


def test_rate_script_times_both_builds(tmp_path):
    """compact_adamw_rate.py --builds native,scalar --rounds 2 (device_call.sh q8avx512): a row per
    round, build, format and part, and each build's best."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "rate.json"
    subprocess.run([sys.executable, str(root / "benchmarks/scripts/compact_adamw_rate.py"), str(out), "--params", "1e5",
                    "--threads", "1", "--parts", "params,moments", "--formats", "fp32/8bit,bf16/8bit",
                    "--builds", "native,scalar", "--rounds", "2"],
                   check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root / "src")})
    got = json.loads(out.read_text())
    assert len(got["rows"]) == 2 * 2 * 2 * 2
    assert {(b["build"], b["q8_avx512"]) for b in got["best"]} == {("native", native_adamw.load_compact().q8_avx512),
                                                                    ("scalar", False)}
    assert all(b["params_per_s"]["1"] > 0 for b in got["best"]) and len(got["best"]) == 2 * 2 * 2
