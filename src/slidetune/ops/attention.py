"""Local (sliding-window, causal banded) attention that is really banded.

Query i sees keys j with  i - w < j <= i  (w keys, itself included), the convention of
HF's `sliding_window_overlay` and of Mistral/Qwen2 sliding windows.

Three backends, one contract (tests/test_attention.py checks each against a brute-force
windowed softmax):
  mask     full S x S boolean band mask + SDPA. Exact, but the kernel still visits every
           (i, j) pair: banded semantics at full cost. The reference for the others.
  blocked  plain PyTorch, works everywhere: queries in blocks of `block` rows; block
           [q0, q1) attends only keys [q0 - w + 1, q1), so scores cost B*H*S*(block + w)
           instead of B*H*S*S -- memory and FLOPs are O(S w), not O(S^2).
  flex     torch.nn.attention.flex_attention with a BlockMask built from the band:
           128 x 128 tiles wholly outside the band are skipped by the kernel (CUDA only:
           flex has no CPU backward).
`auto` picks flex on CUDA when it imports, else blocked.

HF integration: `use_local_attention(model_or_config, window)` registers an attention
function "slidetune_local" with `transformers.AttentionInterface` (and the sdpa mask
builder under the same name, so padding masks still arrive) and points the config at it.
Every decoder layer of Llama/Qwen/Mistral-family models then runs the band; the model's
code is unchanged.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

IMPL_NAME = "slidetune_local"
BACKENDS = ("auto", "mask", "blocked", "flex")


def band_mask(q_len: int, window: int, kv_len: int | None = None, device=None) -> torch.Tensor:
    """[q_len, kv_len] bool, True = attend. Queries are the last q_len positions of kv_len."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    kv_len = q_len if kv_len is None else kv_len
    offset = kv_len - q_len
    i = torch.arange(q_len, device=device).unsqueeze(1) + offset     # [q, 1] absolute query position
    j = torch.arange(kv_len, device=device).unsqueeze(0)             # [1, kv]
    return (j <= i) & (j > i - window)


def band_fraction(seq_len: int, window: int) -> float:
    """Share of the S x S square inside the band (what a banded kernel computes)."""
    w = min(window, seq_len)
    inside = w * seq_len - w * (w - 1) // 2
    return inside / (seq_len * seq_len)


def reference_local_attention(q, k, v, window: int, scale: float | None = None) -> torch.Tensor:
    """Brute force: softmax over the band, masked entries at -inf. q,k,v: [B, H, S, D]."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    ct = torch.promote_types(q.dtype, torch.float32)
    s = (q.to(ct) @ k.to(ct).transpose(-1, -2)) * scale                         # [B, H, S, S]
    s = s.masked_fill(~band_mask(q.shape[-2], window, k.shape[-2], q.device), float("-inf"))
    return (s.softmax(-1) @ v.to(ct)).to(q.dtype)


def _flex_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


_block_mask_cache: dict = {}
_flex_compiled = None


def _flex_block_mask(q_len: int, kv_len: int, window: int, device):
    from torch.nn.attention.flex_attention import create_block_mask
    key = (q_len, kv_len, window, str(device))
    if key not in _block_mask_cache:
        offset = kv_len - q_len

        def band(b, h, qi, kj):
            qa = qi + offset
            return (kj <= qa) & (kj > qa - window)
        _block_mask_cache[key] = create_block_mask(band, None, None, q_len, kv_len, device=device)
    return _block_mask_cache[key]


def _flex(q, k, v, window, scale, extra_mask):
    global _flex_compiled
    from torch.nn.attention.flex_attention import flex_attention
    if extra_mask is not None:
        raise NotImplementedError("flex backend with a padding mask: use backend='blocked'")
    if _flex_compiled is None:
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    if torch.is_autocast_enabled(q.device.type):
        # flex_attention is no autocast op (SDPA is): under HF's rotary, q and k arrive in FP32 beside
        # a bf16 v, so cast as autocast would cast SDPA's inputs
        dt = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
    bm = _flex_block_mask(q.shape[-2], k.shape[-2], window, q.device)
    return _flex_compiled(q, k, v, block_mask=bm, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def _repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    return x if n == 1 else x.repeat_interleave(n, dim=1)


def _blocked(q, k, v, window, scale, extra_mask, block):
    """Queries in blocks; each block sees only its band of keys. extra_mask: [B|1, 1|H, S, S] bool or None."""
    S, Skv = q.shape[-2], k.shape[-2]
    offset = Skv - S
    outs = []
    for q0 in range(0, S, block):
        q1 = min(S, q0 + block)
        k0 = max(0, q0 + offset - window + 1)
        k1 = q1 + offset
        qa = torch.arange(q0, q1, device=q.device).unsqueeze(1) + offset       # [bq, 1]
        ka = torch.arange(k0, k1, device=q.device).unsqueeze(0)                # [1, bk]
        m = (ka <= qa) & (ka > qa - window)
        if extra_mask is not None:
            m = m & extra_mask[..., q0:q1, k0:k1]
        outs.append(F.scaled_dot_product_attention(q[..., q0:q1, :], k[..., k0:k1, :], v[..., k0:k1, :],
                                                   attn_mask=m, scale=scale))
    return torch.cat(outs, dim=-2)


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, *,
                    scale: float | None = None, backend: str = "auto", block: int | None = None,
                    extra_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal sliding-window attention. q: [B, H, S, D]; k, v: [B, Hkv, Skv, D] (GQA ok).

    extra_mask: optional bool [B|1, 1|H, S, Skv], True = attend (e.g. padding), ANDed with the band.
    Returns [B, H, S, D].
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
    if backend == "auto":
        backend = "flex" if (_flex_available(q.device) and extra_mask is None) else "blocked"
    if backend == "flex":
        return _flex(q, k, v, window, scale, extra_mask)
    n_rep = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
    if backend == "mask":
        m = band_mask(q.shape[-2], window, k.shape[-2], q.device)
        if extra_mask is not None:
            m = m & extra_mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale)
    return _blocked(q, k, v, window, scale, extra_mask, block or max(16, min(window, 256)))


# ------------------------------------------------------------------ HF integration

def _hf_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers AttentionInterface signature; returns ([B, S, H, D], None)."""
    window = getattr(module, "local_window", None) or getattr(module.config, "local_window", None)
    if window is None:
        raise RuntimeError("slidetune_local attention needs config.local_window (use_local_attention)")
    backend = getattr(module.config, "local_backend", "auto")
    extra = None
    if attention_mask is not None:
        extra = attention_mask if attention_mask.dtype == torch.bool else attention_mask > -1  # additive -> bool
        extra = extra[..., : key.shape[-2]]
    out = local_attention(query, key, value, int(window), scale=scaling, backend=backend, extra_mask=extra)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask
    AttentionInterface.register(IMPL_NAME, _hf_attention)
    AttentionMaskInterface.register(IMPL_NAME, sdpa_mask)
    return IMPL_NAME


def use_local_attention(target, window: int, backend: str = "auto"):
    """Make a HF model (or its config, before building) run sliding-window attention of `window`.

    Sets config.local_window / config.local_backend and the attention implementation to the
    registered "slidetune_local". Returns the target.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
    register()
    config = getattr(target, "config", target)
    config.local_window = int(window)
    config.local_backend = backend
    if hasattr(target, "set_attn_implementation"):
        target.set_attn_implementation(IMPL_NAME)
    else:
        config._attn_implementation = IMPL_NAME
    return target
