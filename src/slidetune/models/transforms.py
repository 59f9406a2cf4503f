"""Model-level arithmetic that a family's forward does outside its sliding units.

The split runs the embedding, each decoder layer and the final norm + head as separate
units. Whatever the HF `*Model.forward` / `*ForCausalLM.forward` computes between them
must be applied by the split too, or a different model trains:

- embedding multiplier: Granite scales the embedding output by `embedding_multiplier`
  before the first layer (Gemma's sqrt(hidden) normalizer lives inside its embedding
  module, `embed_scale`, and runs with it);
- logit scaling: Granite divides the logits by `logits_scaling`, Cohere multiplies them
  by `logit_scale`;
- final logit softcapping: Gemma 2/3 take `c * tanh(logits / c)`;
- a norm of the embeddings: NanoChat runs its (parameter-free) final norm on the
  embeddings before the first layer too.

Residual multipliers (Granite's `residual_multiplier`), attention multipliers, fused
projections, partial rotary and parallel blocks live inside the decoder layer modules
and run with them. Every family's split is verified against transformers' own forward
by `reference_check.py`, so a transform missed here refuses instead of training wrong.
"""
from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

from ..ops.cross_entropy import IDENTITY, LogitTransform


@dataclass(frozen=True)
class ModelTransforms:
    embed_multiplier: float = 1.0           # hidden = embed(ids) * m before the first layer
    logits: LogitTransform = IDENTITY       # applied to the fp32 logits before the loss
    norm_embeddings: bool = False           # hidden = final_norm(hidden) before the first layer (NanoChat)

    def describe(self) -> str:
        parts = []
        if self.embed_multiplier != 1.0:
            parts.append(f"embedding x {self.embed_multiplier:g}")
        if self.logits.scale != 1.0:
            parts.append(f"logits x {self.logits.scale:g}")
        if self.logits.softcap:
            parts.append(f"logit softcap {self.logits.softcap:g}")
        if self.norm_embeddings:
            parts.append("final norm on the embeddings")
        return ", ".join(parts) or "none"


def _positive(config: PretrainedConfig, name: str) -> float | None:
    value = getattr(config, name, None)
    if value is None:
        return None
    value = float(value)
    if value <= 0:
        raise ValueError(f"{config.model_type}: config.{name} = {value} must be positive")
    return value


# `logits_scaling` is a divisor in Granite (`logits / logits_scaling`) and a multiplier in
# HyperCLOVA X (`logits * logits_scaling`, "unlike GraniteConfig").
_LOGITS_SCALING_MULTIPLIES = {"hyperclovax"}


def model_transforms(config: PretrainedConfig) -> ModelTransforms:
    """The transforms `config`'s family applies outside its units, read from its config fields."""
    embed = _positive(config, "embedding_multiplier") or 1.0       # Granite, HyperCLOVA X
    scale = 1.0
    if (scaling := _positive(config, "logits_scaling")) is not None:
        scale = scaling if config.model_type in _LOGITS_SCALING_MULTIPLIES else 1.0 / scaling
    if (factor := _positive(config, "logit_scale")) is not None:       # Cohere: logits * s
        scale *= factor
    softcap = _positive(config, "final_logit_softcapping")             # Gemma 2/3
    # NanoChatModel.forward: `hidden_states = self.norm(hidden_states)  # Additional norm before the layers`
    norm_embeddings = config.model_type == "nanochat"
    return ModelTransforms(embed, LogitTransform(scale, softcap), norm_embeddings)
