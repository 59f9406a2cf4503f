"""Configuration of the data pipeline."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DataConfig:
    # None -> the built-in English corpus (corpus.py, no download); otherwise a .txt file,
    # a .jsonl file, or a HuggingFace `datasets` save_to_disk directory (formats.py).
    path: str | None = None
    # Tokens per training sequence (the model's input length S). 256 matches the T1M1
    # benchmark shape and keeps CPU tests fast; real fine-tuning usually wants 1024-4096.
    seq_len: int = 256
    # True: documents are concatenated (EOS between) and cut into windows of seq_len+1
    # tokens, so no compute is spent on padding. False: one example per row, truncated to
    # seq_len+1 tokens and right-padded (what chat SFT without cross-example attention needs).
    # A split too small to fill one batch of packed rows (a few dozen short examples) falls
    # back to one example per row, with a note (build.py).
    packing: bool = True
    # Fraction of documents/examples held out for evaluation, chosen by a seeded permutation.
    # 5% of the ~1 MB built-in corpus is ~12K tokens: enough for a stable perplexity. Data sets
    # of fewer than 10 examples train without a held-out split (with a note); from 10 up at
    # least one example is held out.
    heldout_fraction: float = 0.05
    # chat / prompt-completion / alpaca data: prompt tokens get label -100, so the loss is
    # the completion's only (the usual SFT recipe). Plain text is always fully supervised.
    mask_prompt: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise ValueError(f"DataConfig.seq_len must be >= 1, got {self.seq_len}")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError(
                f"DataConfig.heldout_fraction must be in [0, 1), got {self.heldout_fraction}"
            )
