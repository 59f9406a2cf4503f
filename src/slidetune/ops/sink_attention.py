"""Attention with per-head sinks (gpt-oss) through SDPA, exactly.

gpt-oss gives each query head h a learned sink logit s_h (`self_attn.sinks` [H]) that joins the
softmax's denominator and carries no value. transformers' eager attention computes, for query i:

    p_ij = exp(a_ij) / (exp(s_h) + sum_j' exp(a_ij')),   a_ij = scale * q_i . k_j (+ mask)
    o_i  = sum_j p_ij v_j                                 (the sink's own probability is dropped)

That is an ordinary softmax over one extra key whose logit is s_h and whose value is 0. SDPA takes
q . k * scale as the logit, so the sink goes in as a key through one extra column:

    q' = [q, s_h / scale, 0 x 7]      [B, H, S, D + 8]   (the per-head sink rides on the query side,
    k' = [k, 0, 0 x 7]                [B, Hkv, Skv, D + 8]  so the sink key is the same for every
    k_sink = [0 x D, 1, 0 x 7]        [B, Hkv, 1, D + 8]    head and GQA stays GQA: no repeat of k/v)
    v' = [v, 0 x 8], v_sink = 0       [B, Hkv, 1 + Skv, D + 8]

    scale * q'_i . k'_j     = scale * q_i . k_j = a_ij
    scale * q'_i . k_sink   = scale * s_h / scale = s_h

The 8 columns (not 1) keep the head dim a multiple of 8, which the fused CUDA kernels require; the
zeros add nothing to any dot product. The output's last 8 columns are 0 and are cut off. Gradients
reach q, k, v through SDPA's backward and s_h through the q' column (d a_sink / d s_h = 1).

Masks. The sink key is placed first (position 0 of the keys) and every query sees it:
  - no mask (plain causal, every row one document): a dummy query row is placed first too, so that
    queries and keys are both 1 + S long and SDPA's `is_causal=True` (top-left aligned) stays exact:
    real query i + 1 sees keys 0 .. i + 1 = the sink and real keys 0 .. i. The dummy row (zeros) sees
    the sink alone, its output (0) is dropped. The fused causal kernels stay usable;
  - a mask from transformers (padding, sliding window, packed documents: bool [B|1, 1|H, S, Skv], or
    additive float) gets one leading column that admits the sink (True / 0.0). A row the mask empties
    entirely still has the sink, so it is 0, not NaN, as in eager.

`register()` adds the AttentionInterface entry "slidetune_sinks" (transformers passes the sinks as
`s_aux`) with transformers' `sdpa_mask` as its mask builder, so each layer's mask (gpt-oss alternates
sliding-window and full layers by `config.layer_types`) is transformers' own.

Packed rows (packing "masked"). transformers' gpt-oss builds its masks without the position ids
(GptOssModel.forward gives `create_causal_mask` no `position_ids`, unlike Llama's), so its eager
and SDPA paths let a packed row's documents see each other; only its flash path separates them.
`use_packed_attention` therefore moves a sink model to "slidetune_sinks_packed", the same attention
with "same document" ANDed into the mask, the documents read from the position ids the layer is
given (a new document wherever the position does not grow by 1, transformers' own rule in
`find_packed_sequence_indices`), without a host sync. tests/test_packing.py checks each document's
loss against transformers' eager gpt-oss on the document alone.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

IMPL_NAME = "slidetune_sinks"
PACKED_IMPL_NAME = "slidetune_sinks_packed"
FAMILIES = ("gpt_oss",)        # families whose attention has per-head sinks
_EXTRA = 8                     # extra head-dim columns: the sink's, then zeros to a multiple of 8


def _augment(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, scale: float):
    """q', [k_sink; k'], [0; v'] as in the module docstring."""
    B, H, S, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    sink_col = (sinks.to(q.dtype) / scale).view(1, H, 1, 1).expand(B, H, S, 1)         # [B, H, S, 1]
    q_aug = torch.cat([q, sink_col, q.new_zeros(B, H, S, _EXTRA - 1)], dim=-1)          # [B, H, S, D+8]
    sink_key = k.new_zeros(B, Hkv, 1, D + _EXTRA)
    sink_key[..., D] = 1.0                                                               # [B, Hkv, 1, D+8]
    k_aug = torch.cat([sink_key, F.pad(k, (0, _EXTRA))], dim=2)                         # [B, Hkv, 1+Skv, D+8]
    v_aug = F.pad(v, (0, _EXTRA, 1, 0))                                                 # [B, Hkv, 1+Skv, D+8]
    return q_aug, k_aug, v_aug


def _with_sink_column(mask: torch.Tensor) -> torch.Tensor:
    """[..., S, Skv] -> [..., S, 1 + Skv]: the leading sink key admitted for every query."""
    admit = torch.ones if mask.dtype == torch.bool else torch.zeros
    lead = admit(*mask.shape[:-1], 1, dtype=mask.dtype, device=mask.device)
    return torch.cat([lead, mask], dim=-1)


def _causal_mask(q_len: int, kv_len: int, device) -> torch.Tensor:
    """[q_len, kv_len] bool: queries are the last q_len positions (a cache's decode step)."""
    i = torch.arange(q_len, device=device).unsqueeze(1) + (kv_len - q_len)
    return torch.arange(kv_len, device=device).unsqueeze(0) <= i


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, *,
                   scale: float | None = None, attn_mask: torch.Tensor | None = None,
                   dropout: float = 0.0) -> torch.Tensor:
    """Causal attention with per-head sinks. q: [B, H, S, D]; k, v: [B, Hkv, Skv, D] (GQA: H a
    multiple of Hkv); sinks: [H] logits; attn_mask: None (causal) or transformers' mask
    ([B|1, 1|H, S, Skv], bool True = attend, or additive float), which then is the whole mask.
    Returns [B, H, S, D]."""
    B, H, S, D = q.shape
    Skv = k.shape[2]
    if sinks.shape != (H,):
        raise ValueError(f"sinks must be [{H}] (one per query head), got {tuple(sinks.shape)}")
    scale = D ** -0.5 if scale is None else float(scale)
    q_aug, k_aug, v_aug = _augment(q, k, v, sinks, scale)
    gqa = k.shape[1] != H
    if attn_mask is None and S == Skv:
        q_aug = F.pad(q_aug, (0, 0, 1, 0))                                   # [B, H, 1+S, D+8] dummy row 0
        out = F.scaled_dot_product_attention(q_aug, k_aug, v_aug, dropout_p=dropout, is_causal=True,
                                             scale=scale, enable_gqa=gqa)
        return out[:, :, 1:, :D]
    if attn_mask is None:
        attn_mask = _causal_mask(S, Skv, q.device)
    out = F.scaled_dot_product_attention(q_aug, k_aug, v_aug, attn_mask=_with_sink_column(attn_mask),
                                         dropout_p=dropout, scale=scale, enable_gqa=gqa)
    return out[..., :D]


def document_mask(position_ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """`mask` (None: causal; bool or additive [B|1, 1|H, S, S]) with "same document" ANDed in:
    position_ids [B|1, S] start a new document wherever they do not grow by 1. -> [B, 1|H, S, S]."""
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1)                   # [B, S]
    doc = (step != 1).cumsum(-1)                                                        # [B, S] document index
    same = (doc[:, :, None] == doc[:, None, :]).unsqueeze(1)                            # [B, 1, S, S]
    if mask is None:
        S = position_ids.shape[-1]
        return same & _causal_mask(S, S, position_ids.device)
    if mask.dtype == torch.bool:
        return mask & same
    return mask.masked_fill(~same, torch.finfo(mask.dtype).min)


# ------------------------------------------------------------------ HF integration

def sink_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, s_aux=None,
                           **kwargs):
    """transformers AttentionInterface signature (gpt-oss passes its sinks as `s_aux`);
    query [B, H, S, D], key/value [B, Hkv, Skv, D] -> ([B, S, H, D], None)."""
    sinks = s_aux if s_aux is not None else getattr(module, "sinks", None)
    if sinks is None:
        raise RuntimeError(f"{IMPL_NAME} attention needs the layer's sinks (s_aux); "
                           f"{type(module).__name__} has none")
    if attention_mask is not None:
        attention_mask = attention_mask[..., : key.shape[-2]]
    out = sink_attention(query, key, value, sinks, scale=scaling, attn_mask=attention_mask, dropout=dropout)
    return out.transpose(1, 2).contiguous(), None


def sink_attention_packed_forward(module, query, key, value, attention_mask, position_ids=None, **kwargs):
    """sink_attention_forward with each packed document attending to itself alone (module docstring)."""
    if position_ids is not None and query.shape[-2] == key.shape[-2]:
        if attention_mask is not None:
            attention_mask = attention_mask[..., : key.shape[-2]]
        attention_mask = document_mask(position_ids, attention_mask)
    return sink_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register() -> str:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask
    AttentionInterface.register(IMPL_NAME, sink_attention_forward)
    AttentionMaskInterface.register(IMPL_NAME, sdpa_mask)
    AttentionInterface.register(PACKED_IMPL_NAME, sink_attention_packed_forward)
    AttentionMaskInterface.register(PACKED_IMPL_NAME, sdpa_mask)
    return IMPL_NAME


def has_sinks(config: PretrainedConfig) -> bool:
    return getattr(config, "model_type", None) in FAMILIES


def split_attention(config: PretrainedConfig) -> str:
    """The attention implementation slidetune builds `config`'s model with: SDPA, or SDPA with
    sinks for a family that has them (transformers offers no SDPA path for those)."""
    return register() if has_sinks(config) else "sdpa"


def reference_attention(config: PretrainedConfig) -> str:
    """transformers' own implementation to check the split against: its eager attention where it
    has no SDPA (the sink families), SDPA otherwise."""
    return "eager" if has_sinks(config) else "sdpa"
