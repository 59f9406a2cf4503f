"""FLOP counts: the model FLOPs every TFLOPS figure uses, and the FLOPs a step really runs.

Model FLOPs per token (`train_flops_per_token`), training (forward + backward, no recompute):
  6 * N_matmul        N_matmul = parameters used in matrix products (decoder layers + the
                      output head; the embedding lookup is a gather, not a matmul)
  + 6 * L * S * d_att causal attention: QK^T and PV are 2 * S * d_att MACs per token per
                      layer for the full square, 12 L S d_att FLOPs with backward; only
                      the causal half is computed by flash/SDPA kernels, hence 6 L S d_att
                      (summed over the layers where d_att differs by layer: Gemma 4).
Recomputation is extra work and is never counted in model TFLOPS.

A step's FLOPs as slidetune runs it (`step_flops`, `StepFlops`): what the GPU must compute,
recomputation included, matrix products apart from attention (the hardware floor prices the
two at the GEMM and SDPA rates probed on the GPU, bench/roofline.py). Elementwise work (norms,
rotary, SiLU, the loss's softmax) and the embedding's gather and scatter are not counted.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import asdict, dataclass

from ..models.families import experts_per_token, num_experts
from ..models.units import SplitModel

# Flash attention's backward over its forward: the forward runs 2 matmuls a tile (S = Q K^T,
# O = P V), the backward 5 (S recomputed, dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q).
FLASH_BACKWARD_OVER_FORWARD = 2.5


def attention_width(config) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(config.num_attention_heads * head_dim)


def layer_attention_widths(config) -> list[int]:
    """Each decoder layer's query width (heads x head_dim). A heterogeneous config (transformers'
    per_layer_config: Gemma 4's full-attention layers have twice the sliding layers' head_dim)
    gives each layer its own."""
    n = int(config.num_hidden_layers)
    if getattr(config, "is_heterogeneous", False):
        return [attention_width(config.per_layer_config[i]) for i in range(n)]
    return [attention_width(config)] * n


def matmul_params(split: SplitModel) -> int:
    layers = sum(u.numel for u in split.layer_units)
    head = split.units[0].numel if split.tied else sum(
        p.numel for p in split.head_unit.params if p.local_name.startswith("lm_head."))
    return layers + head


def train_flops_per_token(split: SplitModel, seq_len: int) -> float:
    return 6.0 * matmul_params(split) + 6.0 * seq_len * sum(layer_attention_widths(split.config))


def causal_attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> float:
    """One causal attention forward, as flash / SDPA(is_causal=True) computes it: QK^T
    ([B, H, S, dh] @ [B, H, dh, S]) and PV ([B, H, S, S] @ [B, H, S, dh]) over the causal half of
    the S x S scores, 2 FLOPs a multiply-add: 2 x 2 x B x H x (S^2 / 2) x dh. Grouped KV heads
    change no FLOPs (every query head has its scores). The diagonal tiles a kernel computes whole
    (S x tile / 2 more pairs: 6% at S = 1024, tile 64) are not counted."""
    return 2.0 * batch * heads * seq * seq * head_dim


def layer_matmul_flops(split: SplitModel, index: int, tokens: int) -> float:
    """One forward of decoder layer `index`'s matrix products over `tokens` tokens: each weight
    W [out, in] of an nn.Linear is x [T, in] @ W^T, 2 x T x out x in FLOPs; an MoE layer's expert
    bank [E, a, b] (3-D, E = the config's expert count) is applied to each token by k of its E
    experts, 2 x T x (k / E) x E x a x b (the router [E, d] is a matrix like the others). Norm
    weights and biases (1-D) are elementwise and not counted."""
    experts = num_experts(split.config)
    k = experts_per_token(split.config) or 1
    flops = 0.0
    for p in split.layer_units[index].params:
        if len(p.shape) == 2:
            flops += 2.0 * tokens * p.numel
        elif len(p.shape) == 3 and experts and p.shape[0] == experts:
            flops += 2.0 * tokens * p.numel * k / experts
    return flops


@dataclass(frozen=True)
class StepFlops:
    """The FLOPs of one training step of `tokens` tokens (batch x seq), per decoder layer and for
    the head, one forward each; a step's total follows from which layers recompute.

    A decoder layer: its forward, once more where it is recomputed (the slide engine recomputes
    every layer; ckpt mode its `recompute` selection: RuntimeConfig.recomputed_layers), and a
    backward of 2x the forward's matmuls (dX = dY W: [T, out] @ [out, in]; dW = dY^T X: [out, T]
    @ [T, in]) and FLASH_BACKWARD_OVER_FORWARD x its attention.
    The head (ops/cross_entropy.py, every impl): logits = h W^T ([T, d] @ [d, V]) and both
    gradients, computed once (the chunked and fused heads compute the gradients inside the
    forward, chunk by chunk, and never recompute the logits): 2 T V d forward, 4 T V d backward,
    over every token (the chunked head skips tokens whose label is ignored: counted here).
    Document masks (packing) would skip the scores across documents; they are ignored here
    (counted as one causal sequence), and so are sliding windows (Mistral's, Qwen2's): an
    explicit mask sends SDPA to a kernel that computes the whole square. A hybrid family's
    linear-attention layers are counted as softmax attention."""

    tokens: int
    layer_matmul: tuple[float, ...]       # [L] one forward of each layer's matrix products
    layer_attention: tuple[float, ...]    # [L] one forward of each layer's causal attention
    head_matmul: float                    # the head's forward: logits, 2 x T x V x d

    @property
    def num_layers(self) -> int:
        return len(self.layer_matmul)

    def matmul_forward(self, recomputed: Collection[int]) -> float:
        """Every forward matmul: each layer once, the recomputed layers twice, the head's logits."""
        return sum(self.layer_matmul) + sum(self.layer_matmul[i] for i in recomputed) + self.head_matmul

    def matmul_backward(self) -> float:
        return 2.0 * (sum(self.layer_matmul) + self.head_matmul)

    def attention_forward(self, recomputed: Collection[int]) -> float:
        return sum(self.layer_attention) + sum(self.layer_attention[i] for i in recomputed)

    def attention_backward(self) -> float:
        return FLASH_BACKWARD_OVER_FORWARD * sum(self.layer_attention)

    def matmul(self, recomputed: Collection[int]) -> float:
        return self.matmul_forward(recomputed) + self.matmul_backward()

    def attention(self, recomputed: Collection[int]) -> float:
        return self.attention_forward(recomputed) + self.attention_backward()

    def total(self, recomputed: Collection[int]) -> float:
        return self.matmul(recomputed) + self.attention(recomputed)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> StepFlops:
        return cls(int(d["tokens"]), tuple(d["layer_matmul"]), tuple(d["layer_attention"]), float(d["head_matmul"]))


def step_flops(split: SplitModel, batch: int, seq: int) -> StepFlops:
    """The FLOPs of one step of `batch` sequences of `seq` tokens (StepFlops: shapes and what is
    counted). With grad_accum the micro-batches add up to the same tokens and the same FLOPs."""
    c, tokens = split.config, batch * seq
    heads = int(c.num_attention_heads)
    vocab_weight = split.units[0].params[0] if split.tied else next(
        p for p in split.head_unit.params if p.local_name == "lm_head.weight")
    return StepFlops(tokens=tokens,
                     layer_matmul=tuple(layer_matmul_flops(split, i, tokens) for i in range(split.num_layers)),
                     layer_attention=tuple(causal_attention_flops(batch, heads, seq, width // heads)
                                           for width in layer_attention_widths(c)),
                     head_matmul=2.0 * tokens * vocab_weight.numel)
