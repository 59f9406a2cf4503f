"""Model FLOPs per token, the formula every TFLOPS figure in slidetune uses.

Per token, training (forward + backward, no recompute):
  6 * N_matmul        N_matmul = parameters used in matrix products (decoder layers + the
                      output head; the embedding lookup is a gather, not a matmul)
  + 6 * L * S * d_att causal attention: QK^T and PV are 2 * S * d_att MACs per token per
                      layer for the full square, 12 L S d_att FLOPs with backward; only
                      the causal half is computed by flash/SDPA kernels, hence 6 L S d_att.
Recomputation is extra work and is never counted in model TFLOPS.
"""
from __future__ import annotations

from ..models.units import SplitModel


def attention_width(config) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(config.num_attention_heads * head_dim)


def matmul_params(split: SplitModel) -> int:
    layers = sum(u.numel for u in split.layer_units)
    head = split.units[0].numel if split.tied else sum(
        p.numel for p in split.head_unit.params if p.local_name.startswith("lm_head."))
    return layers + head


def train_flops_per_token(split: SplitModel, seq_len: int) -> float:
    return 6.0 * matmul_params(split) + 6.0 * split.num_layers * seq_len * attention_width(split.config)
