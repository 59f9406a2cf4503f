"""Named model shapes (random weights) for benchmarks, tests and capacity planning.

The shapes follow the published configs of each model; weights are random, so a
preset measures speed and memory, never quality. Tiny shapes exist for the CPU
tests: they keep each family's distinguishing features (GQA, q/k norms, tied or
untied head, sliding windows) at a size that trains in milliseconds.
"""
from __future__ import annotations

from typing import Callable

from transformers import LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config, Qwen3Config

# Llama-3 rotary scaling as shipped in the 3.1/3.2 configs.
_LLAMA3_ROPE_8B = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
}
_LLAMA3_ROPE_1B = dict(_LLAMA3_ROPE_8B, factor=32.0)


def _llama3(hidden: int, ffn: int, layers: int, heads: int, rope: dict, tied: bool,
            head_dim: int | None = None) -> PretrainedConfig:
    """A Llama-3.x shape: GQA with 8 KV heads, the 128K vocabulary, llama3 rotary scaling."""
    extra = {"head_dim": head_dim} if head_dim else {}
    return LlamaConfig(
        vocab_size=128256, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=8, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_parameters=rope, tie_word_embeddings=tied,
        bos_token_id=128000, eos_token_id=128001, **extra)


def _qwen3(hidden: int, ffn: int, layers: int, heads: int, tied: bool) -> PretrainedConfig:
    return Qwen3Config(
        vocab_size=151936, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=tied, bos_token_id=151643, eos_token_id=151645)


def _qwen2_5_32b() -> PretrainedConfig:
    # Qwen2 layers carry q/k/v biases; the 32B's sliding window is off (use_sliding_window false).
    return Qwen2Config(
        vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
        num_attention_heads=40, num_key_value_heads=8, max_position_embeddings=32768,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        use_sliding_window=False, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645)


def _mistral_7b() -> PretrainedConfig:
    # v0.3: 32768-token vocabulary, no sliding window.
    return MistralConfig(
        vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        sliding_window=None, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


# Tiny shapes. The vocabulary (49152) matches the embedded SmolLM2 tokenizer so the
# CLI can train them on real text; tests that only need random ids pass vocab_size.
TINY_VOCAB = 49152


def tiny_config(family: str, *, tied: bool = False, layers: int = 3, vocab_size: int = TINY_VOCAB,
                hidden: int = 64, heads: int = 4, kv_heads: int = 2, ffn: int = 128,
                sliding_window: int | None = None) -> PretrainedConfig:
    """A small config of one family: GQA (heads/kv_heads), rotary, optional sliding window."""
    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=ffn,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=2048, tie_word_embeddings=tied,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        # Qwen2 carries q/k/v biases: exercises bias parameters (no weight decay).
        if sliding_window:
            return Qwen2Config(**common, use_sliding_window=True, sliding_window=sliding_window,
                               max_window_layers=1)
        return Qwen2Config(**common)
    if family == "qwen3":
        # Qwen3 adds per-head q/k RMSNorms.
        return Qwen3Config(**common, head_dim=hidden // heads)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=sliding_window)
    raise ValueError(f"unknown tiny family {family!r}; choose llama, qwen2, qwen3, mistral")


PRESETS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama-3.1-8b": lambda: _llama3(4096, 14336, 32, 32, _LLAMA3_ROPE_8B, tied=False),
    "llama-3.1-70b": lambda: _llama3(8192, 28672, 80, 64, _LLAMA3_ROPE_8B, tied=False),
    "llama-3.2-1b": lambda: _llama3(2048, 8192, 16, 32, _LLAMA3_ROPE_1B, tied=True, head_dim=64),
    "qwen3-1.7b": lambda: _qwen3(2048, 6144, 28, 16, tied=True),
    "qwen3-4b": lambda: _qwen3(2560, 9728, 36, 32, tied=True),
    "qwen3-8b": lambda: _qwen3(4096, 12288, 36, 32, tied=False),
    "qwen3-14b": lambda: _qwen3(5120, 17408, 40, 40, tied=False),
    "qwen3-32b": lambda: _qwen3(5120, 25600, 64, 64, tied=False),
    "qwen2.5-32b": _qwen2_5_32b,
    "mistral-7b": _mistral_7b,
    # The memory-optimization study's shape (seeds/003): 12 x 768, 12 heads, FFN 3072. Its 30k WordPiece
    # vocabulary is replaced by the embedded SmolLM2 tokenizer's 49152 so it trains on real text.
    "study-12x768": lambda: LlamaConfig(
        vocab_size=TINY_VOCAB, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=4096,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    "tiny-llama": lambda: tiny_config("llama"),
    "tiny-llama-tied": lambda: tiny_config("llama", tied=True),
    "tiny-qwen2": lambda: tiny_config("qwen2"),
    "tiny-qwen3": lambda: tiny_config("qwen3", tied=True),
    "tiny-mistral": lambda: tiny_config("mistral", sliding_window=16),
}


def preset_config(name: str, num_layers: int | None = None) -> PretrainedConfig:
    """The config of a named shape; `num_layers` overrides the depth (e.g. 14- vs 28-layer studies)."""
    key = name.lower()
    if key not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    config = PRESETS[key]()
    if num_layers is not None:
        config.num_hidden_layers = num_layers
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = config.layer_types[:num_layers] + [config.layer_types[-1]] * max(
                0, num_layers - len(config.layer_types))
    return config
