"""Training data: the built-in corpus, text/JSONL/datasets sources, tokenization with
prompt masking, held-out split, packing or padding, and resumable batch sampling.

    train, heldout = build_datasets(DataConfig(seq_len=256), tokenizer)
    sampler = BatchSampler(train, batch_size=8, seed=0, pad_id=default_pad_id(tokenizer))
    batch = sampler.batch(step * grad_accum + micro)   # Batch: input_ids, labels (shifted), mask
"""
from .batch import IGNORE_INDEX, Batch, collate
from .build import build_datasets, load_source
from .config import DataConfig
from .corpus import builtin_corpus
from .dataset import Row, TokenDataset
from .errors import DataError
from .formats import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT
from .sources import read_source
from .sampler import BatchSampler, eval_batches
from .tokenization import default_pad_id

__all__ = [
    "ALPACA_PROMPT", "ALPACA_PROMPT_NO_INPUT", "Batch", "BatchSampler", "DataConfig", "DataError",
    "IGNORE_INDEX", "Row", "TokenDataset", "build_datasets", "builtin_corpus", "collate",
    "default_pad_id", "eval_batches", "load_source", "read_source",
]
