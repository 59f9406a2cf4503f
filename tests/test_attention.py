"""Local attention is really banded: exact mask, brute-force equality, no influence outside the window."""
import pytest
import torch

from slidetune.ops.attention import (band_fraction, band_mask, local_attention, reference_local_attention,
                                     use_local_attention)


def test_band_mask_exact_pattern():
    m = band_mask(5, 2)
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 1, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(m, expected)
    # window 1: only the diagonal; window >= S: plain causal
    assert torch.equal(band_mask(4, 1), torch.eye(4, dtype=torch.bool))
    assert torch.equal(band_mask(4, 9), torch.ones(4, 4, dtype=torch.bool).tril())


def test_band_mask_is_banded_for_every_row():
    S, w = 37, 6
    m = band_mask(S, w)
    for i in range(S):
        cols = m[i].nonzero().flatten().tolist()
        assert cols == list(range(max(0, i - w + 1), i + 1))
    assert m.sum().item() == pytest.approx(band_fraction(S, w) * S * S)


def test_band_mask_with_kv_offset():
    # 2 new queries after 4 cached keys: query rows are absolute positions 4, 5
    m = band_mask(2, 3, kv_len=6)
    assert m.tolist() == [[False, False, True, True, True, False], [False, False, False, True, True, True]]


@pytest.mark.parametrize("backend", ["mask", "blocked"])
@pytest.mark.parametrize("S,w,block", [(33, 8, 16), (64, 16, 16), (20, 64, 16), (50, 1, 16), (40, 7, 5)])
def test_matches_brute_force(backend, S, w, block):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, S, 8, generator=g, dtype=torch.float64) for _ in range(3))
    ref = reference_local_attention(q, k, v, w)
    out = local_attention(q, k, v, w, backend=backend, block=block)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_gqa_matches_brute_force():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 6, 30, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 30, 8, generator=g, dtype=torch.float64) for _ in range(2))
    ref = reference_local_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), 5)
    torch.testing.assert_close(local_attention(q, k, v, 5, backend="blocked", block=8), ref)


@pytest.mark.parametrize("backend", ["mask", "blocked"])
def test_no_gradient_outside_window(backend):
    S, w = 24, 5
    q, k, v = (torch.randn(1, 2, S, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    i = 17                                     # one query row; it may only see keys 13..17
    out = local_attention(q, k, v, w, backend=backend, block=8)
    out[:, :, i].sum().backward()
    inside = torch.zeros(S, dtype=torch.bool)
    inside[i - w + 1:i + 1] = True
    for t in (k, v):
        per_pos = t.grad.abs().sum(dim=(0, 1, 3))
        assert torch.all(per_pos[~inside] == 0)
        assert torch.all(per_pos[inside] > 0)
    # changing a key/value outside the window leaves the output at i unchanged
    with torch.no_grad():
        k2, v2 = k.clone(), v.clone()
        k2[:, :, :i - w + 1] += 5.0
        v2[:, :, :i - w + 1] -= 3.0
        a = local_attention(q, k, v, w, backend=backend)[:, :, i]
        b = local_attention(q, k2, v2, w, backend=backend)[:, :, i]
    torch.testing.assert_close(a, b)


def test_extra_padding_mask_is_anded():
    S, w = 12, 4
    q, k, v = (torch.randn(1, 1, S, 4, dtype=torch.float64) for _ in range(3))
    pad = torch.ones(1, 1, S, S, dtype=torch.bool)
    pad[..., 2] = False                        # key 2 is padding
    out = local_attention(q, k, v, w, backend="blocked", block=4, extra_mask=pad)
    ref = local_attention(q, k, v, w, backend="mask", extra_mask=pad)
    torch.testing.assert_close(out, ref)


def test_hf_model_uses_band():
    from transformers import AutoModelForCausalLM
    from slidetune.models.presets import tiny_config
    cfg = tiny_config("llama", vocab_size=97, layers=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").double().eval()
    ids = torch.randint(0, 97, (1, 40))
    full = model(ids).logits
    use_local_attention(model, 4, backend="blocked")
    assert model.config._attn_implementation == "slidetune_local"
    local = model(ids).logits
    # the first 4 positions see the same keys either way; later ones differ
    torch.testing.assert_close(local[:, :4], full[:, :4])
    assert not torch.allclose(local[:, 10:], full[:, 10:])
    # and a 2-layer model with window 4 has receptive field 2*(4-1)+1 = 7: tokens further back have no effect
    ids2 = ids.clone()
    ids2[0, :20] = (ids2[0, :20] + 1) % 97
    local2 = model(ids2).logits
    torch.testing.assert_close(local[:, 27:], local2[:, 27:])
    assert not torch.allclose(local[:, 20:26], local2[:, 20:26])
    # mask backend agrees with blocked inside the model
    model.config.local_backend = "mask"
    torch.testing.assert_close(model(ids).logits, local)


def test_the_backend_probe_times_and_checks_each_kernel_it_can_run(tmp_path):
    """benchmarks/scripts/attention_backends.py (device_call.sh attnbackends) on the CPU at a small
    GQA shape: a backend that runs gets a row a length with its rate and its error against the
    math backend in FP32 (the math backend itself in BF16 within 3x flash's), SDPA's own choice
    ("default") among them; one this build cannot run (memory-efficient on the CPU) is named with
    its error."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "attn.json"
    subprocess.run([sys.executable, str(root / "benchmarks/scripts/attention_backends.py"), str(out), "--device", "cpu",
                    "--seq-lens", "128,256", "--tokens", "256", "--heads", "4", "--kv-heads", "2", "--head-dim", "32",
                    "--backends", "default,flash,efficient,math"],
                   check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root / "src")})
    report = json.loads(out.read_text())
    assert report["backends"]["flash"]["runs"] and report["backends"]["math"]["runs"]
    assert not report["backends"]["efficient"]["runs"] and "No viable backend" in report["backends"]["efficient"]["error"]
    rows = {(r["backend"], r["seq"]): r for r in report["rows"]}
    assert set(rows) == {(b, s) for b in ("default", "flash", "math") for s in (128, 256)}
    assert report["layout"] == "hf" and rows[("default", 128)]["chosen"] is None     # (the choice: CUDA only)
    for r in rows.values():
        assert r["forward_tflops"] > 0 and r["backward_tflops"] > 0 and r["correct"]
        assert 0 < max(r["max_error_vs_math_fp32"].values()) < 0.1        # BF16 against FP32
    assert set(report["fastest_correct"]) == {"128", "256"}          # (JSON keys: the lengths as strings)


def test_the_floor_names_the_kernel_sdpa_picks():
    """bench.roofline.sdpa_backend: the backend SDPA's dispatcher picks for a causal GQA call with
    gradients, in HF's layout (on this CPU build: flash's CPU kernel or the math one), as the hardware
    floor records it beside SDPA's rates (issue 45: which kernel the layer really runs)."""
    from slidetune.bench.hardware_floor import sdpa_backend
    q = torch.randn(2, 8, 4, 16).transpose(1, 2).requires_grad_()        # [B, H, S, dh] of [B, S, H, dh]
    k = torch.randn(2, 8, 2, 16).transpose(1, 2).requires_grad_()
    assert sdpa_backend(q, k, k, {"enable_gqa": True}) in ("FLASH_ATTENTION", "MATH")
