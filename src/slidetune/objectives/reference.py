"""The reference model's log-probabilities, computed once before training (issue 47; TRL's
`precompute_ref_log_probs`): no second model in memory.

DPO and IPO compare the policy's log-probability of each completion with the reference's, the
model as it was before preference tuning. At step 0 the policy *is* the reference, so the engine
that trains it computes them: a forward-only pass over every pair (`reference_logps`, each
sequence's completion tokens summed from the head's per-token losses, no logits kept), before the
first update. The result, [pairs, 2] FP32 (chosen, rejected), is cached as one safetensors file
(`cached_reference_logps`) keyed on what it depends on: the initial weights
(`WeightSource.fingerprint`), the pairs' token ids, the sequence cut, the compute dtype and this
format. A resumed run (its policy has moved on) reads the cache of the run it continues; a
second run on the same model and data skips the pass. The file is written to a temporary name
and renamed, with a digest of its values checked when read; one that fails is computed again.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ..atomic_write import write_atomically
from ..data.preference import TokenizedPair, collate_pairs, pair_micro_batches
from .preference import PreferenceConfig, completion_sums

log = logging.getLogger(__name__)

REFERENCE_FORMAT = 1          # bump when what a cached value means changes


@dataclass
class PairScores:
    """Pairs scored by the engine's current weights (a forward each batch, no update)."""
    logps: torch.Tensor          # [pairs, 2] FP32: each side's completion log-probability sum (chosen, rejected)
    tokens: torch.Tensor         # [pairs, 2] int64: each side's completion tokens
    nll_sum: float               # the NLL term's tokens' summed CE (SimPO, ORPO; 0 for the others)
    nll_tokens: int


def score_pairs(engine, pairs: list[TokenizedPair], cfg: PreferenceConfig, pad_id: int, max_length: int | None,
                batch_pairs: int) -> PairScores:
    """Every pair through the engine's forward, `batch_pairs` pairs a batch (2 x batch_pairs sequences
    padded to `max_length`, the training steps' shape), each token's loss summed into its sequence:
    the reference pass, and the held-out evaluation of a preference run."""
    logps = torch.empty(len(pairs), 2, dtype=torch.float32)
    tokens = torch.empty(len(pairs), 2, dtype=torch.long)
    nll_sum, nll_tokens = 0.0, 0
    for start in range(0, len(pairs), batch_pairs):
        part = pairs[start:start + batch_pairs]
        (batch,) = pair_micro_batches(collate_pairs(part, pad_id, max_length, pad_to=max_length), cfg)
        rows = engine.token_losses(batch).float().cpu()                                  # [2B * S]
        sums, counts = completion_sums(rows, batch.pairs, 2 * len(part))                 # [2B] each
        logps[start:start + len(part)] = torch.stack(sums.chunk(2), dim=1)               # [B, 2]
        tokens[start:start + len(part)] = torch.stack(counts.chunk(2), dim=1)
        nll_sum += float((rows.double() * batch.pairs.nll).sum())
        nll_tokens += int(batch.pairs.nll.sum())
    return PairScores(logps, tokens, nll_sum, nll_tokens)


def reference_logps(engine, pairs: list[TokenizedPair], cfg: PreferenceConfig, pad_id: int,
                    max_length: int | None, batch_pairs: int) -> torch.Tensor:
    """[len(pairs), 2] FP32: each pair's chosen and rejected completion log-probability sums with the
    engine's current weights, `batch_pairs` pairs a forward (2 x batch_pairs sequences)."""
    return score_pairs(engine, pairs, cfg, pad_id, max_length, batch_pairs).logps


def reference_key(model_fingerprint: str, pairs: list[TokenizedPair], max_length: int | None, dtype: str) -> str:
    """Hex key of what the reference's values depend on."""
    import xxhash
    h = xxhash.xxh3_128()
    h.update(f"{REFERENCE_FORMAT}\x00{max_length}\x00{dtype}\x00".encode())
    h.update(model_fingerprint.encode())
    for p in pairs:
        for ids in (p.prompt, p.chosen, p.rejected):
            h.update(len(ids).to_bytes(4, "little"))
            h.update(torch.tensor(ids, dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()


def _values_digest(values: torch.Tensor) -> str:
    import xxhash
    return xxhash.xxh3_128(values.contiguous().numpy().tobytes()).hexdigest()


def _read(file: Path, key: str, count: int) -> torch.Tensor | None:
    """The cached values, or None (and why, logged) where the file is absent or does not check out."""
    if not file.exists():
        return None
    from safetensors import safe_open
    try:
        with safe_open(str(file), "pt") as f:
            meta = f.metadata() or {}
            values = f.get_tensor("reference_logps")
    except Exception as e:  # noqa: BLE001 - a cut or overwritten file raises many types; each means: compute again
        log.warning("%s: unreadable (%s: %s); computing the reference log-probabilities again", file, type(e).__name__, e)
        return None
    if meta.get("key") != key or tuple(values.shape) != (count, 2) or meta.get("digest") != _values_digest(values):
        log.warning("%s: does not match its key, the pairs or its digest; computing the reference "
                    "log-probabilities again", file)
        return None
    return values


@dataclass
class Reference:
    """The reference's sums of a run's pairs, and where they came from."""
    logps: torch.Tensor          # [pairs, 2] FP32 (chosen, rejected)
    file: Path | None            # the cache file (None: no cache)
    read: bool                   # read from the cache (False: computed by the engine)


def cached_reference_logps(engine, pairs: list[TokenizedPair], cfg: PreferenceConfig, pad_id: int,
                           max_length: int | None, batch_pairs: int, cache_dir: Path | None,
                           model_fingerprint: str, dtype: str) -> Reference:
    """reference_logps, read from `cache_dir` where an earlier run (or the run this one resumes) left
    them for the same weights, pairs, cut and dtype; else computed and written there (None: no
    cache, always computed)."""
    key = reference_key(model_fingerprint, pairs, max_length, dtype)
    file = cache_dir / f"reference-logps-{key}.safetensors" if cache_dir is not None else None
    if file is not None:
        values = _read(file, key, len(pairs))
        if values is not None:
            log.info("reference log-probabilities of %d pairs read from %s", len(pairs), file)
            return Reference(values, file, read=True)
    values = reference_logps(engine, pairs, cfg, pad_id, max_length, batch_pairs)
    if file is not None:
        from safetensors.torch import save_file
        file.parent.mkdir(parents=True, exist_ok=True)
        meta = {"key": key, "digest": _values_digest(values), "pairs": str(len(pairs)), "dtype": dtype}
        write_atomically(file, lambda tmp: save_file({"reference_logps": values}, str(tmp), metadata=meta))
    return Reference(values, file, read=False)
