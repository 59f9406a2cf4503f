"""Every causal-LM family of transformers 5.17, by `config.model_type`: tested or refused.

`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` lists 178 model types. Each is in exactly one of:

- `TESTED`: decoder-only families whose split agrees with transformers' own forward and
  backward (loss and every gradient, fp32, relative 1e-4) on a tiny config, in
  `tests/test_families.py` (with the family's model-level transforms set away from 1);
- `REFUSED`: decoder-only families slidetune does not train, with the reason;
- `REFUSED_SETTINGS`: settings of a tested family refused by config field, with the reason
  (none at present);
- `NOT_DECODER_ONLY`: encoder-decoder halves, encoders usable as decoders and multimodal
  composite configs, with the reason (for a composite, the text family to use instead).

`require_supported_family` runs at load (from `load.skeleton`): a refused family gets
its reason at once instead of a failure deep in the split. A family not listed (remote
code, a newer transformers) is not refused by name: the reference self-check
(`reference_check.py`) is its guard.

Mixture-of-experts families train the loss transformers trains: cross-entropy alone
unless `output_router_logits` is set, when transformers adds the router's auxiliary
loss; that case is refused (not implemented). Sliding an MoE layer moves all of its
experts, though each token uses only k of them: `moe_note` says what that costs.
"""
from __future__ import annotations

from transformers import PretrainedConfig

from .units import UnsupportedModelError


class UnsupportedFamilyError(UnsupportedModelError):
    pass


# Decoder-only families verified against transformers (tests/test_families.py).
TESTED = (
    "afmoe", "arcee", "aria_text", "bitnet", "cohere", "cohere2", "cohere2_moe", "cwm", "deepseek_v2",
    "deepseek_v3", "deepseek_v32", "diffllama", "doge", "ernie4_5", "ernie4_5_moe", "exaone4", "flex_olmo",
    "gemma", "gemma2", "gemma3_text", "glm", "glm4", "granite", "granitemoe", "granitemoeshared", "helium",
    "hyperclovax", "jais2", "jetmoe", "laguna", "llama", "llama4_text", "mellum", "minicpm3", "ministral3",
    "mistral", "mixtral", "nanochat", "nemotron", "olmo", "olmo2", "olmo3", "olmo_hybrid", "olmoe", "phi3",
    "phimoe", "qwen2", "qwen2_moe", "qwen3", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_next",
    "seed_oss", "smollm3", "stablelm", "starcoder2", "vaultgemma", "youtu",
    # constant buffers carried beside the layer's parameters (buffers.py): MoE routers' score-correction
    # biases, Apertus' xIELU constants
    "apertus", "axk1", "axk2", "dots1", "exaone_moe", "glm4_moe", "glm4_moe_lite", "hy_v3", "longcat_flash",
    "minimax_m2", "minimax_m3_vl_text", "solar_open",
    # per-head attention sinks run through SDPA as one extra key (ops/sink_attention.py)
    "gpt_oss",
    # per-layer attention shapes (transformers' per_layer_config: head_dim and KV heads of the full
    # layers), keys shared with values, an MoE block beside the MLP, a constant layer scalar (buffer);
    # per-layer input embeddings and KV sharing (E2B / E4B: layer_sides.py)
    "gemma4_text", "gemma4_unified_text",
)

_NO_SDPA = ("transformers has no SDPA attention for it (eager only); slidetune runs every family's "
            "attention through SDPA")
_LEARNED_POSITIONS = ("learned absolute position embeddings are added outside the embedding module, and "
                      "the blocks are not a `model.layers` decoder stack the split can slide")
_NOT_MODEL_LAYERS = ("its decoder stack and final norm are not at `model.layers` / `model.norm`, where the "
                     "split finds them")
_RECURRENT = ("hybrid or recurrent layers (state-space, convolution or linear-attention state) outside the "
              "decoder layer contract the split slides")

REFUSED: dict[str, str] = {
    # attention implementation
    **{t: _NO_SDPA for t in ("bloom", "codegen", "cpmant", "gpt_neo", "gpt_neox_japanese", "gptj", "mpt",
                             "openai-gpt", "reformer", "xlnet", "xlm", "granite_swa", "granitemoe_swa",
                             "mimo_v2_flash", "hy_v4", "deepseek_v4")},
    # layout
    **{t: _LEARNED_POSITIONS for t in ("gpt2", "gpt-sw3", "gpt_bigcode", "ctrl", "opt", "biogpt", "xglm")},
    **{t: _NOT_MODEL_LAYERS for t in ("gpt_neox", "falcon", "phi", "persimmon", "modernbert-decoder",
                                      "hrm_text")},
    "cohere_compass_text": "its default layer types do not build a 1-2 layer copy for the reference check; untested",
    "dbrx": "its nested attn_config/ffn_config do not round-trip into a 1-2 layer copy for the reference check; untested",
    "ministral": "its config does not build a 1-2 layer copy for the reference check (head_dim/rope fields); untested",
    "glm_moe_dsa": "its sparse (DSA) attention indexer returns extra values the layer contract does not carry",
    "moshi": "a speech model whose layers keep their own rotary buffers; the sliding units move parameters only",
    "gemma3n_text": "per-layer input embeddings and AltUp are computed outside the decoder layers",
    "qwen4_exp_text": "its default config does not build a 1-2 layer copy for the reference check; untested",
    # model-level arithmetic the units do not hold
    "inkling_text": ("its base model norms the embeddings (`embed_norm`, a weight outside the units) before the "
                     "layers, and its layers run short convolutions with state"),
    "zaya": ("its base model adds a bias and a scale to the embeddings (weights outside the units), and each "
             "layer hands its router's hidden states to the next beside hidden_states"),
    "hunyuan_v1_dense": "its default config does not build a 1-2 layer copy for the reference check; untested",
    "hunyuan_v1_moe": "its default config does not build a 1-2 layer copy for the reference check; untested",
    # recurrent / hybrid state
    **{t: _RECURRENT for t in ("mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm", "recurrent_gemma", "jamba",
                               "bamba", "zamba", "zamba2", "falcon_h1", "nemotron_h", "granitemoehybrid",
                               "lfm2", "lfm2_moe", "minimax", "kimi_linear")},
    "blt": "byte latent transformer: local encoder/decoder and patching around a global model, not one decoder stack",
}

# Settings of a tested family that the split does not train, refused at load when the field is set
# (non-zero): family -> {config field: why}. None at present: Gemma 4's per-layer input embeddings and
# KV sharing (E2B / E4B), once refused here, train since 2026-11-29 (layer_sides.py).
REFUSED_SETTINGS: dict[str, dict[str, str]] = {}

_ENC_DEC = "the decoder half of an encoder-decoder model (cross-attention to an encoder), not a decoder-only LM"
_ENCODER = "an encoder architecture (BERT-style) that can run as a decoder, not a decoder-only LM"
_MULTIMODAL = "a multimodal composite config (vision/audio + text)"
NOT_DECODER_ONLY: dict[str, str] = {
    **{t: _ENC_DEC for t in ("bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart",
                             "mvp", "pegasus", "plbart", "prophetnet", "trocr", "whisper", "musicgen",
                             "musicgen_melody")},
    **{t: _ENCODER for t in ("bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra",
                             "ernie", "megatron-bert", "rembert", "roberta", "roberta-prelayernorm", "roc_bert",
                             "roformer", "xlm-roberta", "xlm-roberta-xl", "xmod")},
    "gemma3": _MULTIMODAL + "; train the text model (model_type gemma3_text)",
    "llama4": _MULTIMODAL + "; train the text model (model_type llama4_text)",
    "qwen3_5": _MULTIMODAL + "; train the text model (model_type qwen3_5_text)",
    "qwen3_5_moe": _MULTIMODAL + "; train the text model (model_type qwen3_5_moe_text)",
    "gemma4": _MULTIMODAL + "; train the text model (model_type gemma4_text)",
    "gemma4_unified": _MULTIMODAL + "; train the text model (model_type gemma4_unified_text)",
    **{t: _MULTIMODAL for t in ("emu3", "fuyu", "gemma3n", "gemma4_assistant",
                                "gemma4_unified_assistant", "git", "got_ocr2", "mllama", "phi4_multimodal",
                                "qwen4_exp")},
}

_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def family_status(model_type: str) -> tuple[str, str]:
    """("tested" | "refused" | "not decoder-only" | "unlisted", reason)."""
    if model_type in TESTED:
        return "tested", ""
    if model_type in REFUSED:
        return "refused", REFUSED[model_type]
    if model_type in NOT_DECODER_ONLY:
        return "not decoder-only", NOT_DECODER_ONLY[model_type]
    return "unlisted", "not in transformers 5.17's causal-LM families; the reference check guards it"


def num_experts(config: PretrainedConfig) -> int:
    """Routed experts per MoE layer (0 for a dense model)."""
    for key in _EXPERT_COUNTS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 1:
            return value
    return 0


def require_supported_family(config: PretrainedConfig) -> None:
    """Refuse, with the reason, a family (or a family's setting, naming the field and its value)
    slidetune does not train faithfully."""
    model_type = getattr(config, "model_type", "")
    status, reason = family_status(model_type)
    if status in ("refused", "not decoder-only"):
        raise UnsupportedFamilyError(
            f"model family {model_type!r} is not supported: {reason}. Supported families: "
            f"{', '.join(TESTED)} (README, 'Model families')")
    for field, why in REFUSED_SETTINGS.get(model_type, {}).items():
        if value := getattr(config, field, None):
            raise UnsupportedFamilyError(
                f"model family {model_type!r} with {field}={value!r} in config.json is not supported: {why}")
    if num_experts(config) and getattr(config, "output_router_logits", False) \
            and float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) != 0.0:
        raise UnsupportedFamilyError(
            f"model family {model_type!r} with output_router_logits=True: transformers adds the router's "
            f"auxiliary loss (coefficient {config.router_aux_loss_coef}) to the training loss, and the sliding "
            f"engine does not implement it (router auxiliary loss / expert placement). Set "
            f"output_router_logits to false in config.json to train the cross-entropy alone, as transformers "
            f"does by default")


def experts_per_token(config: PretrainedConfig) -> int | None:
    """Routed experts each token uses in an MoE layer (k of top-k), where the config says."""
    return next((getattr(config, a) for a in ("num_experts_per_tok", "moe_k", "top_k", "top_k_experts")
                 if isinstance(getattr(config, a, None), int)), None)


def moe_note(config: PretrainedConfig, layer_params: int, bytes_per_param: int = 2) -> str | None:
    """What sliding one MoE layer moves: all its experts, though a token uses k of them."""
    experts = num_experts(config)
    if not experts:
        return None
    k = experts_per_token(config)
    used = f"; each token uses {k} of them" if k else ""
    return (f"mixture of experts: sliding a layer moves all {experts} experts "
            f"({layer_params * bytes_per_param / 2**30:.2f} GiB per layer upload at {bytes_per_param} B/param){used}")
