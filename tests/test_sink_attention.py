"""Attention with sinks through SDPA (ops/sink_attention.py) equals transformers' eager gpt-oss
attention: values and the gradients of q, k, v and the sinks, fp32, causal and sliding-window,
GQA and not, with a padded row; on CUDA (gpu-marked) through SDPA's fused kernels too."""
from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, eager_attention_forward

from slidetune.ops.sink_attention import sink_attention, sink_attention_forward

B, S, D = 2, 24, 16


def attention_module(heads: int, kv_heads: int) -> GptOssAttention:
    """transformers' own gpt-oss attention module (its sinks, its GQA groups), sinks random."""
    config = GptOssConfig(hidden_size=heads * D, head_dim=D, num_attention_heads=heads,
                          num_key_value_heads=kv_heads, num_hidden_layers=2, num_local_experts=4,
                          num_experts_per_tok=2, intermediate_size=32, sliding_window=8, vocab_size=64)
    module = GptOssAttention(config, layer_idx=0).eval()
    with torch.no_grad():
        module.sinks.copy_(torch.randn(heads, generator=torch.Generator().manual_seed(3)) * 2.0)
    return module


def bool_mask(window: int | None, padded: bool) -> torch.Tensor | None:
    """[B, 1, S, S] True = attend: causal, banded to `window` keys, row 1's last 5 tokens padding."""
    i = torch.arange(S).unsqueeze(1)
    j = torch.arange(S).unsqueeze(0)
    m = j <= i
    if window is not None:
        m = m & (j > i - window)
    m = m.expand(B, 1, S, S).clone()
    if padded:
        m[1, :, :, -5:] = False
    return m


def additive(mask: torch.Tensor) -> torch.Tensor:
    """The eager path's float mask: 0 where attended, the dtype's minimum elsewhere."""
    return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)


def inputs(heads: int, kv_heads: int, device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, heads, S, D, generator=gen)          # [B, H, S, D]
    k = torch.randn(B, kv_heads, S, D, generator=gen)       # [B, Hkv, S, D]
    v = torch.randn(B, kv_heads, S, D, generator=gen)
    return [t.to(device, dtype).requires_grad_(True) for t in (q, k, v)]


def run(fn, module, q, k, v, mask):
    out, _ = fn(module, q, k, v, mask, scaling=module.scaling, s_aux=module.sinks)    # [B, S, H, D]
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device, out.dtype)
    grads = torch.autograd.grad(out, (q, k, v, module.sinks), grad_out)
    return out, grads


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("window,padded", [(None, False), (None, True), (8, False), (8, True)],
                         ids=["causal", "causal-padded", "sliding", "sliding-padded"])
def test_sink_attention_equals_transformers_eager(heads, kv_heads, window, padded):
    module = attention_module(heads, kv_heads)
    mask = bool_mask(window, padded)
    q, k, v = inputs(heads, kv_heads)
    ref, ref_grads = run(eager_attention_forward, module, q, k, v, additive(mask))
    # the plain causal case goes without a mask (SDPA's is_causal path with the dummy row), as
    # transformers' sdpa_mask leaves it; the others with transformers' bool mask
    ours_mask = None if (window is None and not padded) else mask
    out, grads = run(sink_attention_forward, module, q, k, v, ours_mask)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for name, g, g_ref in zip("q k v sinks".split(), grads, ref_grads):
        torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"grad {name}: {m}")
    assert ref_grads[3].abs().min() > 0                       # the sinks really get a gradient


def test_additive_mask_and_a_decode_step():
    """An additive float mask admits the sink as a bool one does; a query shorter than the keys (a
    cache's decode step, no mask) sees every key up to its own position."""
    module = attention_module(4, 2)
    q, k, v = inputs(4, 2)
    mask = bool_mask(8, True)
    with torch.no_grad():
        a = sink_attention(q, k, v, module.sinks, attn_mask=mask)
        b = sink_attention(q, k, v, module.sinks, attn_mask=additive(mask))
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        last = sink_attention(q[:, :, -3:], k, v, module.sinks)                        # [B, H, 3, D]
        whole = sink_attention(q, k, v, module.sinks)
        torch.testing.assert_close(last, whole[:, :, -3:], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="sinks must be"):
        sink_attention(q, k, v, module.sinks[:2])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_sink_attention_on_cuda_kernels_equals_eager(dtype, tol):
    """SDPA's CUDA kernels (flash / memory-efficient on the is_causal path, a masked kernel on the
    sliding path) against eager in fp32 on the same (rounded) inputs."""
    module = attention_module(4, 2).cuda()
    for window, padded in ((None, False), (8, True)):
        mask = bool_mask(window, padded)
        q, k, v = inputs(4, 2, "cuda", dtype)
        q32, k32, v32 = (t.detach().float().requires_grad_(True) for t in (q, k, v))
        ref, ref_grads = run(eager_attention_forward, module, q32, k32, v32, additive(mask).cuda())
        out, grads = run(sink_attention_forward, module, q, k, v, None if window is None else mask.cuda())
        torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
        for g, g_ref in zip(grads, ref_grads):
            torch.testing.assert_close(g.float(), g_ref, rtol=tol, atol=tol)
