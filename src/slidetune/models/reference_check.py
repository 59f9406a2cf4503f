"""The reference self-check: the split computes what transformers computes, for this family.

Before training, the model's own config is cut to a tiny copy (one or two layers, each
kind of layer once, small widths where the family allows, vocabulary 256), given random
weights on the CPU in fp32, and one batch of 2 x 16 tokens (a padded row, a masked
prompt) runs twice on the same weights:

- slidetune's split, as the engines run it: embedding unit, each decoder layer unit
  with the kwargs the base model hands its layers (and its constant buffers, random too), final norm + head through the
  chunked cross-entropy (with the family's transforms), token-summed loss / tokens;
- transformers' own `model(input_ids, attention_mask, labels).loss` and `backward()`.

Loss and every parameter's gradient must agree to `tolerance` (relative). Rounding
alone stays near 1e-6 in fp32; a missed model-level transform is far above (Granite's
embedding multiplier and logit scaling: 0.66% on the loss). It takes about a second.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from ..ops.sink_attention import reference_attention
from .units import SplitModel

BATCH, SEQ, VOCAB = 2, 16, 256
TOLERANCE = 1e-4


class ReferenceMismatchError(ValueError):
    pass


@dataclass
class ReferenceCheckResult:
    family: str              # config.model_type
    shape: str               # the cut config that ran, e.g. "2 layers, hidden 64, vocab 256"
    num_layers: int          # decoder layers of the cut config
    loss: float              # the split's loss
    reference_loss: float    # transformers' own loss
    loss_gap: float          # |loss - reference| / |reference|
    grad_gap: float          # max over parameters of |g - g_ref| / |g_ref|
    worst_param: str         # where grad_gap is
    seconds: float
    tolerance: float = TOLERANCE

    @property
    def ok(self) -> bool:
        return self.loss_gap <= self.tolerance and self.grad_gap <= self.tolerance

    def summary(self) -> str:
        return (f"{self.family} ({self.shape}): loss {self.loss:.6f} vs transformers {self.reference_loss:.6f} "
                f"(gap {self.loss_gap:.2e}), largest gradient gap {self.grad_gap:.2e} at {self.worst_param} "
                f"(tolerance {self.tolerance:.0e}), {self.seconds:.1f} s")


# ---- the tiny copy of the config ---------------------------------------------------------

# Widths set where the config has the field. Heads keep the family's GQA-or-not.
_SMALL_WIDTHS = {
    "hidden_size": 64, "intermediate_size": 128, "head_dim": 16,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "ffn_hidden_size": 128,
    # multi-head latent attention (DeepSeek-V2/V3 and kin)
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
}
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_EXPERTS_PER_TOKEN = ("num_experts_per_tok", "moe_k", "top_k", "top_k_experts")
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id")


def _layer_indices(config: PretrainedConfig) -> list[int]:
    """Two layers, or the first layer of each kind when the family mixes kinds (up to 3). With KV
    sharing (Gemma 4 E2B / E4B: the last `num_kv_shared_layers` layers read the K/V of the last
    earlier layer of their kind) each kind once before the shared layers and once among them."""
    n = int(config.num_hidden_layers)
    kinds = getattr(config, "layer_types", None)
    shared = _kv_shared_layers(config)
    if isinstance(kinds, (list, tuple)) and len(kinds) == n and 0 < shared < n:
        own, tail = list(kinds[:n - shared]), list(kinds[n - shared:])
        return [own.index(k) for k in dict.fromkeys(own)] + [n - shared + tail.index(k) for k in dict.fromkeys(tail)]
    if isinstance(kinds, (list, tuple)) and len(kinds) == n:
        firsts = [kinds.index(k) for k in dict.fromkeys(kinds)][:3]
        if len(firsts) > 1:
            return firsts
    return list(range(min(n, 2)))


def _kv_shared_layers(config: PretrainedConfig) -> int:
    return int(getattr(config, "num_kv_shared_layers", 0) or 0)


def _cut(config: PretrainedConfig, small_widths: bool, small_vocab: bool) -> PretrainedConfig:
    d = config.to_dict()
    n = int(config.num_hidden_layers)
    keep = _layer_indices(config)
    if 0 < _kv_shared_layers(config) < n:
        d["num_kv_shared_layers"] = sum(1 for i in keep if i >= n - _kv_shared_layers(config))
    for key, value in list(d.items()):       # per-layer lists follow the kept layers
        if isinstance(value, list) and len(value) == n and n > len(keep):
            d[key] = [value[i] for i in keep]
    if d.get("per_layer_config"):
        d["per_layer_config"] = _cut_per_layer_config(d["per_layer_config"], keep, small_widths)
    d["num_hidden_layers"] = len(keep)
    layers = d.get("num_layers")
    if isinstance(layers, int) and 0 < layers < n and n % layers == 0:
        # blocks of n // layers sub-layers each, counted in num_layers too (LongCat-Flash: 2)
        d["num_layers"] = max(1, len(keep) * layers // n)
    if small_vocab:
        d["vocab_size"] = VOCAB
        if d.get("vocab_size_per_layer_input"):            # Gemma 4's per-layer embedding (E2B: 262144 rows)
            d["vocab_size_per_layer_input"] = VOCAB
        for key in _TOKEN_IDS:                 # ids past the small vocabulary would index out of range
            v = d.get(key)
            if isinstance(v, int) and v >= VOCAB:
                d[key] = VOCAB - 1
            elif isinstance(v, list):
                d[key] = [min(int(t), VOCAB - 1) for t in v]
    if small_widths:
        for key, value in _SMALL_WIDTHS.items():
            if d.get(key) is not None:
                d[key] = value
        if d.get("hidden_size_per_layer_input"):           # 0: no per-layer inputs (left so)
            d["hidden_size_per_layer_input"] = 16
        heads, kv = d.get("num_attention_heads"), d.get("num_key_value_heads")
        if heads:
            d["num_attention_heads"] = 4
            if "num_key_value_heads" in d:
                d["num_key_value_heads"] = 4 if kv in (None, heads) else 2
        if d.get("qk_rope_head_dim") is not None and d.get("head_dim") is not None:
            d["head_dim"] = d["qk_rope_head_dim"]     # MLA: the rotary runs over the rope part only
        if d.get("qk_head_dim") is not None and d.get("qk_nope_head_dim") is not None:
            d["qk_head_dim"] = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]   # derived, saved (LongCat)
        for key in _EXPERT_COUNTS:
            if isinstance(d.get(key), int) and d[key] > 4:
                d[key] = 4
        for key in _EXPERTS_PER_TOKEN:
            if isinstance(d.get(key), int) and d[key] > 2:
                d[key] = 2
        if isinstance(d.get("n_group"), int) and d["n_group"] > 2:
            # grouped routing (DeepSeek-V3, A.X K1): 8 groups of 4 experts would be empty; 2 groups of
            # 2, the best one kept, still route through the groups
            d["n_group"], d["topk_group"] = 2, 1
    if isinstance(d.get("sliding_window"), int):
        d["sliding_window"] = min(d["sliding_window"], SEQ // 2)   # so the window cuts inside the batch
    d.pop("transformers_version", None)
    d.pop("architectures", None)
    cut = type(config).from_dict(d)
    cut._attn_implementation = reference_attention(cut)
    return cut


def _cut_per_layer_config(overrides: dict, keep: list[int], small_widths: bool) -> dict:
    """A heterogeneous config's per-layer overrides (transformers' `per_layer_config`, keyed by
    layer index: Gemma 4's full-attention layers' head_dim and KV heads) renumbered for the kept
    layers. With small widths an overridden width becomes twice the small one and overridden KV
    heads one, so the kept layers still differ from the others as the model's do."""
    by_index = {int(k): v for k, v in overrides.items()}      # to_dict zero-pads the keys ("05")
    cut = {}
    for new, old in enumerate(keep):
        layer = dict(by_index.get(old) or {})
        if small_widths:
            for key in layer:
                if key in _SMALL_WIDTHS and isinstance(layer[key], int):
                    layer[key] = 2 * _SMALL_WIDTHS[key]
                elif key == "num_key_value_heads" and isinstance(layer[key], int):
                    layer[key] = 1
        if layer:
            cut[str(new)] = layer
    return cut


def _describe(config: PretrainedConfig) -> str:
    return f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size}"


def _random_weights(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random (not HF's init: zero biases or unit norms would hide a missed term)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.1
            p.copy_(1.0 + noise if p.dim() < 2 and name.endswith("weight") else noise)


def _random_buffers(model: torch.nn.Module, split: SplitModel, seed: int) -> None:
    """The constant buffers the split carries (MoE routers' correction biases: HF's init is zero,
    which would hide a buffer the split dropped) random in the reference, and the split given the
    same values, as a loaded model's buffers are given by its weight source."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, _ in split.named_buffers():
            b = model.get_buffer(name)
            b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    split.set_buffers({name: model.get_buffer(name) for name, _ in split.named_buffers()})


def _batch(vocab: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)           # [B, S]
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, -3:] = 0                                                      # a right-padded row
    hf_labels = ids.masked_fill(mask == 0, -100)
    hf_labels[0, :3] = -100                                               # a masked prompt
    labels = torch.roll(hf_labels, -1, 1)                                 # the split takes them shifted
    labels[:, -1] = -100
    return ids, mask, hf_labels, labels


def _split_loss_and_grads(split: SplitModel, state: dict, ids, mask, labels):
    leaves = []
    for unit in split.units:
        leaves.append({p.local_name: state[p.full_name].detach().clone().requires_grad_(True)
                       for p in unit.params})
    kwargs = split.layer_kwargs(*ids.shape, torch.float32, ids.device, attention_mask=mask)
    x = split.embed_forward(leaves[0], ids)                                   # [B, S, d]
    split.attach_sides(kwargs, leaves[0], ids, x)                             # Gemma 4's per-layer inputs
    for i in range(split.num_layers):
        x = split.layer_forward(i, leaves[i + 1], x, kwargs[i])
    tied = leaves[0]["weight"] if split.tied else None
    n = int((labels != -100).sum())
    loss = split.head_loss(leaves[-1], x, labels, lm_weight=tied) / n
    loss.backward()
    grads = {p.full_name: leaf.grad for unit, lv in zip(split.units, leaves)
             for p, leaf in zip(unit.params, lv.values())}
    return float(loss.detach()), grads


def _run(config: PretrainedConfig, seed: int) -> ReferenceCheckResult:
    from .load import skeleton
    start = time.perf_counter()
    torch.manual_seed(seed)
    # a copy: the model keeps its config object and sets the implementation on it, which the split's
    # skeleton (another implementation for gpt-oss) would then share
    reference = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=reference_attention(config),
                                                 dtype=torch.float32)
    reference.eval()                        # no dropout; gradients still flow
    _random_weights(reference, seed)
    split = SplitModel(skeleton(config))
    _random_buffers(reference, split, seed)
    state = dict(reference.named_parameters())
    ids, mask, hf_labels, labels = _batch(config.vocab_size, seed)

    ref_loss = reference(input_ids=ids, attention_mask=mask, labels=hf_labels, use_cache=False).loss
    ref_loss.backward()
    loss, grads = _split_loss_and_grads(split, state, ids, mask, labels)

    worst, where = 0.0, ""
    for name, p in state.items():
        g, g_ref = grads.get(name), p.grad
        if g is None or g_ref is None:
            if (g is None) != (g_ref is None) and (g if g is not None else g_ref).abs().max() > 0:
                worst, where = float("inf"), f"{name} (gradient on one side only)"
            continue
        gap = float((g - g_ref).norm() / g_ref.norm().clamp_min(1e-12))
        if gap > worst:
            worst, where = gap, name
    r = float(ref_loss.detach())
    return ReferenceCheckResult(config.model_type, _describe(config), config.num_hidden_layers, loss, r,
                                abs(loss - r) / max(abs(r), 1e-12), worst, where,
                                time.perf_counter() - start)


def tiny_copy(config: PretrainedConfig) -> PretrainedConfig:
    """The cut config the check runs: small widths if the family builds with them, else full widths."""
    errors = []
    for small_widths in (True, False):
        try:
            cut = _cut(config, small_widths=small_widths, small_vocab=True)
            with torch.device("meta"):
                AutoModelForCausalLM.from_config(cut)   # the family accepts these sizes
            return cut
        except Exception as e:        # a family-specific constraint on the widths (a ratio, a list per head)
            errors.append(f"{type(e).__name__}: {e}")
    raise ValueError(f"{config.model_type}: could not build a 1-2 layer copy of the config for the "
                     f"reference check ({'; '.join(errors)})")


def reference_check(config: PretrainedConfig, seed: int = 0) -> ReferenceCheckResult:
    """Run the split and transformers on a tiny copy of `config`; the gaps, not a verdict."""
    return _run(tiny_copy(copy.deepcopy(config)), seed)


def require_faithful(config: PretrainedConfig, seed: int = 0) -> ReferenceCheckResult:
    """The check, refusing on a mismatch with a message naming the family and the gap."""
    result = reference_check(config, seed)
    if not result.ok:
        raise ReferenceMismatchError(
            f"reference check failed for model family {result.family!r}: slidetune's split does not "
            f"compute what transformers computes. {result.summary()}. Training would optimize a different "
            f"model. Report the family, or pass --skip-reference-check to train anyway.")
    return result
